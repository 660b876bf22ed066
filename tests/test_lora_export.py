"""A LoRA run's checkpoint and its exports: the PEFT adapter that transformers and peft load
gives Dew's logits, the merged Hugging Face folder too, and resuming on another base is refused.
A run trained with an attention window on a Dew checkpoint's base exports its base with
``--base-out`` as a Mistral folder (``sliding_window``), on which PEFT's
``AutoPeftModelForCausalLM`` gives Dew's logits at every position; without it, it is refused.

The references are transformers' and peft's own outputs (scripts/make_lora_reference.py, in an
environment of their own), on the checkpoints ``tests/lora_reference.write_run`` and
``write_windowed_run`` write."""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dew
from dew.checkpoints.errors import CheckpointMismatchError
from dew.cli import convert
from dew.models import hf, lora, safetensors
from dew.models.checkpoint import load_lora
from tests.helpers import relative_error
from tests.lora_reference import (
    HF_BASE,
    OUT,
    WINDOW,
    WINDOW_BASE,
    WINDOW_OUT,
    write_run,
    write_windowed_run,
)

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
    written, base, base_written = convert.to_peft(run, tmp_path / "adapter")
    assert (base, base_written) == (str(HF_BASE), [])
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
    # The exports read the base too: a base changed in place is refused, as resuming is.
    with pytest.raises(CheckpointMismatchError, match="another base"):
        convert.to_peft(copy, tmp_path / "adapter")
    with pytest.raises(CheckpointMismatchError, match="another base"):
        convert.to_hf(copy, tmp_path / "merged")
    assert not (tmp_path / "adapter").exists() and not (tmp_path / "merged").exists()


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


def test_the_peft_export_of_a_run_without_a_base_folder_says_so(dew_here, tmp_path):
    """A run whose base was drawn from its key records no path: the adapter's
    base_model_name_or_path is null, and the line printed says what the base was; with
    --base-out those weights are written there, and the adapter names the folder."""
    write_run(tmp_path / "run", base=None)
    out = tmp_path / "adapter"
    printed = dew_here("convert", "run", str(out), "--to", "peft", cwd=tmp_path)
    assert printed.returncode == 0, printed.stderr
    assert "base None" not in printed.stdout
    assert printed.stdout.strip().endswith(
        "a PEFT adapter on the model's initial weights drawn from the run's key (the run named "
        "no base folder: base_model_name_or_path is null; --base-out FOLDER writes them as its "
        "base)"
    ), printed.stdout
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] is None
    args = ("convert", "run", "adapter2", "--to", "peft", "--base-out", "base")
    printed = dew_here(*args, cwd=tmp_path)
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout.splitlines()[0] == (
        "Wrote model.safetensors, config.json to base: the run's base as a Hugging Face folder"
    ), printed.stdout
    config = json.loads((tmp_path / "adapter2" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tmp_path / "base")
    _, drawn, _ = load_lora(tmp_path / "run")
    _, written = hf.load(tmp_path / "base")
    jax.tree_util.tree_map(np.testing.assert_array_equal, written, drawn)


# --- A run trained with an attention window, on a Dew checkpoint's base ---------------------------


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    path = tmp_path_factory.mktemp("windowed_run")
    write_windowed_run(path)
    return path


def _json(path):
    return json.loads(path.read_text())


def test_a_windowed_run_on_a_dew_base_exports_an_adapter_peft_loads(windowed, tmp_path):
    """``--to peft --base-out`` writes the adapter and the run's base, a Mistral folder with the
    run's window (sliding_window 5; the base checkpoint had none), each file what the committed
    reference holds; PEFT's ``AutoPeftModelForCausalLM`` of that adapter (finding the base by
    its base_model_name_or_path) and transformers on the base alone give Dew's logits at every
    one of the 24 positions (float32, 1e-5 relative), which without the window agree only
    within the first 5."""
    export = convert.to_peft(windowed, tmp_path / "adapter", base_out=tmp_path / "base")
    assert export.base == str((tmp_path / "base").resolve())
    assert sorted(export.base_written) == ["config.json", "model.safetensors"]
    config = _json(tmp_path / "base" / "config.json")
    assert (config["model_type"], config["architectures"]) == ("mistral", ["MistralForCausalLM"])
    assert config["sliding_window"] == WINDOW
    assert config == _json(WINDOW_OUT / "base" / "config.json")
    adapter = _json(tmp_path / "adapter" / "adapter_config.json")
    assert adapter.pop("base_model_name_or_path") == export.base
    want = _json(WINDOW_OUT / "adapter" / "adapter_config.json")
    want.pop("base_model_name_or_path")  # the folder it was written at
    assert adapter == want
    for folder, name in (("base", "model.safetensors"), ("adapter", "adapter_model.safetensors")):
        got, ref = _tensors(tmp_path / folder / name), _tensors(WINDOW_OUT / folder / name)
        assert sorted(got) == sorted(ref), folder
        for key in ref:
            np.testing.assert_array_equal(got[key], ref[key], err_msg=key)

    tokens = jnp.asarray(np.load(WINDOW_BASE / "tokens.npy"))
    assert tokens.shape[1] >= 4 * WINDOW
    model, base, adapters = load_lora(windowed)
    assert model.attention_window == WINDOW
    peft_logits = np.load(WINDOW_OUT / "peft_logits.npy")
    joined = np.asarray(model.apply(lora.combine(model, base, adapters), tokens))
    assert relative_error(joined, peft_logits) < TOL
    base_model, base_params = hf.load(tmp_path / "base")
    assert base_model.attention_window == WINDOW
    base_logits = np.load(WINDOW_OUT / "base_logits.npy")
    assert relative_error(np.asarray(base_model.apply(base_params, tokens)), base_logits) < TOL
    assert relative_error(base_logits, peft_logits) > 0.1, "the adapters changed nothing"
    unwindowed = dataclasses.replace(model, attention_window=None)
    plain = np.asarray(unwindowed.apply(lora.combine(unwindowed, base, adapters), tokens))
    assert relative_error(plain[:, :WINDOW], peft_logits[:, :WINDOW]) < TOL
    assert relative_error(plain, peft_logits) > 0.1, "the window changed nothing"


def test_an_adapter_whose_base_transformers_would_not_run_as_trained_is_refused(
    windowed, dew_here, tmp_path
):
    """Without ``--base-out``, ``--to peft`` refuses in one line naming it: a base that is a Dew
    checkpoint (transformers cannot load it), and a Hugging Face base without the run's window
    (transformers would run the adapter without it). ``--base-out`` naming a folder that holds
    the base already is checked and used as it is; one with other weights is refused."""
    printed = dew_here("convert", str(windowed), str(tmp_path / "a"), "--to", "peft", cwd=tmp_path)
    assert printed.returncode != 0 and printed.stdout == ""
    message = printed.stderr.strip()
    assert len(message.splitlines()) == 1, message
    assert "is a Dew checkpoint, which transformers cannot load" in message
    assert "give --base-out FOLDER" in message and "Traceback" not in message
    assert not (tmp_path / "a").exists()
    args = ("convert", str(windowed), "a", "--to", "hf", "--base-out", "b")
    printed = dew_here(*args, cwd=tmp_path)
    assert printed.returncode != 0
    assert "--base-out applies to --to peft only, not --to hf" in printed.stderr

    # The same weights as a Llama folder (no window): the base the adapters trained on, but
    # not the model.
    llama = tmp_path / "llama_base"
    shutil.copytree(WINDOW_OUT / "base", llama)
    config = _json(llama / "config.json")
    for key in ("sliding_window", "model_type", "architectures"):
        config.pop(key)
    (llama / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    run = tmp_path / "run"
    shutil.copytree(windowed / "checkpoints", run)
    index_file = next(run.glob("step_*/index.json"))
    index = _json(index_file)
    index["metadata"]["lora_base"] = {**index["metadata"]["lora_base"], "path": str(llama)}
    index["metadata"]["lora_base"].pop("step", None)  # a Hugging Face base has no step
    index_file.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"attention window of {WINDOW} .* has no attention"):
        convert.to_peft(run, tmp_path / "b")
    # --base-out naming the committed base: it holds the run's base, bit for bit.
    export = convert.to_peft(run, tmp_path / "b", base_out=WINDOW_OUT / "base")
    assert (export.base, export.base_written) == (str(WINDOW_OUT / "base"), [])
    other = tmp_path / "other"
    shutil.copytree(WINDOW_OUT / "base", other)
    weights = other / "model.safetensors"
    tensor = safetensors.Header.read(weights).tensors["model.layers.1.self_attn.v_proj.weight"]
    data = bytearray(weights.read_bytes())
    data[tensor.offset + 2] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="holds other weights than the run's base"):
        convert.to_peft(run, tmp_path / "c", base_out=other)
    with pytest.raises(ValueError, match="has no attention window where the run trained"):
        convert.to_peft(run, tmp_path / "c", base_out=llama)
