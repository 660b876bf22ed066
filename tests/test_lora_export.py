"""A LoRA run's checkpoint and its exports: the PEFT adapter that transformers and peft load
gives Dew's logits, the merged Hugging Face folder too, and resuming on another base is refused.

The references are transformers' and peft's own outputs (scripts/make_lora_reference.py, in an
environment of their own), on the checkpoint ``tests/lora_reference.write_run`` writes."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dew
from dew.checkpoints.errors import CheckpointMismatchError
from dew.cli import convert
from dew.models import lora, safetensors
from dew.models.checkpoint import load_lora
from tests.helpers import relative_error
from tests.lora_reference import HF_BASE, OUT, write_run

TOL = 1e-5
# One worker runs the module: the LoRA run's checkpoint (``run``) is written once.
pytestmark = pytest.mark.xdist_group("lora_export")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    path = tmp_path_factory.mktemp("lora_run")
    write_run(path)
    return path


def _tensors(path):
    header = safetensors.Header.read(path)
    return {name: safetensors.read_block(t, (0, t.shape[0])) for name, t in header.tensors.items()}


def test_the_peft_export_is_the_adapter_peft_loaded(run, tmp_path):
    """``--to peft`` writes the tensors and config the committed reference was made from, under
    PEFT's names and shapes ([R, in] and [out, R])."""
    written, base = convert.to_peft(run, tmp_path / "adapter")
    assert base == str(HF_BASE)
    got = _tensors(tmp_path / "adapter" / "adapter_model.safetensors")
    want = _tensors(OUT / "adapter" / "adapter_model.safetensors")
    assert sorted(got) == sorted(want)
    assert got["base_model.model.model.layers.1.self_attn.o_proj.lora_A.weight"].shape == (4, 64)
    assert got["base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight"].shape == (96, 4)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 6, "LORA")


def test_peft_and_the_merged_export_give_dews_logits(run, tmp_path):
    """transformers + ``PeftModel.from_pretrained`` on the adapter, and ``from_pretrained`` on the
    merged export, give the logits Dew computes from the checkpoint, base and adapters joined and
    merged alike (float32, 1e-5 relative)."""
    tokens = jnp.asarray(np.load(HF_BASE / "tokens.npy"))
    model, base, adapters = load_lora(run)
    joined = np.asarray(model.apply(lora.combine(model, base, adapters), tokens))
    peft_logits = np.load(OUT / "peft_logits.npy")
    assert relative_error(joined, peft_logits) < TOL
    plain = np.load(HF_BASE / "logits.npy")
    assert relative_error(plain, peft_logits) > 0.1, "the adapters changed nothing"
    merged_model, merged = dew.load_checkpoint(run)
    assert merged_model.lora is None
    logits = np.asarray(merged_model.apply(merged, tokens))
    assert relative_error(logits, np.load(OUT / "merged_logits.npy")) < TOL
    convert.to_hf(run, tmp_path / "merged")
    got = _tensors(tmp_path / "merged" / "model.safetensors")
    want = _tensors(OUT / "merged" / "model.safetensors")
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-6, err_msg=name)


def test_resuming_on_another_base_is_refused(run, tmp_path):
    """A run resumed with a base whose weights differ from the recorded one stops, naming both
    checksums; the exports refuse it too."""
    import shutil

    other = tmp_path / "other_base"
    shutil.copytree(HF_BASE, other)
    path = other / "model.safetensors"
    header = safetensors.Header.read(path)
    tensor = header.tensors["model.layers.0.mlp.down_proj.weight"]
    data = bytearray(path.read_bytes())
    data[tensor.offset] ^= 0x40  # one bit of one weight
    path.write_bytes(bytes(data))
    model, _, _ = load_lora(run)
    from dew.objectives.lm import LMObjective

    trainer = dew.Trainer(
        LMObjective(model, 40),
        dew.training.optimizer.default_optimizer(),
        jax.random.key(0),
        checkpoints=dew.Checkpoints(run / "checkpoints"),
        base=other,
    )
    with pytest.raises(CheckpointMismatchError, match=f"trained on the base {HF_BASE}"):
        trainer.place()
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    metadata_file = next((copy / "checkpoints").glob("step_*/index.json"))
    index = json.loads(metadata_file.read_text())
    index["metadata"]["lora_base"]["path"] = str(other)
    metadata_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointMismatchError, match="another base"):
        load_lora(copy)


def test_a_base_given_by_a_relative_path_is_found_from_another_directory(tmp_path, monkeypatch):
    """The base, a Dew checkpoint directory named relative to where the run started, is recorded
    as its absolute path and the step read (0); the base's own run then writes step 1 (other
    weights). From another working directory ``load_lora`` reads step 0 again (the checksum
    agrees: the base the adapters trained on) and a resume with the base's absolute path does
    too."""
    from dew.checkpoints import Checkpoints
    from dew.models import hf
    from dew.objectives.lm import LMObjective

    start, elsewhere = tmp_path / "start", tmp_path / "elsewhere"
    elsewhere.mkdir()
    convert.to_checkpoint(HF_BASE, start / "base")
    model = hf.model_from_config(
        hf.read_config(HF_BASE), str(HF_BASE), lora=lora.Lora(rank=2, alpha=4.0)
    )

    def trainer(base):
        return dew.Trainer(
            LMObjective(model, 40),
            dew.training.optimizer.default_optimizer(),
            jax.random.key(0),
            checkpoints=dew.Checkpoints(start / "run"),
            base=base,
        )

    monkeypatch.chdir(start)
    first = trainer("base")
    first.save(first.init_state())
    first.checkpoints.wait()
    recorded = Checkpoints(start / "run").metadata()["lora_base"]
    assert (recorded["path"], recorded["step"]) == (str((start / "base").resolve()), 0)
    base_steps = Checkpoints(start / "base")
    _, weights = hf.load(HF_BASE)
    base_steps.save(1, jax.tree.map(lambda w: w + 1, weights), metadata=base_steps.metadata(0))
    base_steps.wait()

    monkeypatch.chdir(elsewhere)
    _, base, _ = load_lora(start / "run")  # checks the checksum: raises for step 1's weights
    got = base["params"]["layers"]["mlp"]["down"]
    np.testing.assert_array_equal(got, weights["params"]["layers"]["mlp"]["down"])
    trainer(start / "base").place()  # the resume reads step 0 too (and checks its checksum)


def test_the_peft_export_of_a_run_without_a_base_folder_says_so(run, dew_here, tmp_path):
    """A run whose base was drawn from its key records no path: the adapter's
    base_model_name_or_path is null, and the line printed says what the base was."""
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    index_file = next((copy / "checkpoints").glob("step_*/index.json"))
    index = json.loads(index_file.read_text())
    index["metadata"]["lora_base"]["path"] = None
    index_file.write_text(json.dumps(index))
    out = tmp_path / "adapter"
    printed = dew_here("convert", str(copy), str(out), "--to", "peft", cwd=tmp_path)
    assert printed.returncode == 0, printed.stderr
    assert "base None" not in printed.stdout
    assert printed.stdout.strip().endswith(
        "a PEFT adapter on the model's initial weights drawn from the run's key (the run named "
        "no base folder: base_model_name_or_path is null)"
    ), printed.stdout
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] is None
