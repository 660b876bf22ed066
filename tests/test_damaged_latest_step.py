"""A checkpoint directory whose latest step is damaged, a file of it truncated on disk (issue 52):
an export or a load that names no step refuses, naming the damaged step and the intact ones,
and writes nothing; one that names an intact step reads it; resuming a run still falls back.

Steps 1 and 2 hold other weights than step 0 (step 0's plus 1 and 2), so reading the wrong step
shows; step 1 is damaged too, so the steps named intact are checked, not merely listed. A LoRA
run's checkpoint (``lora_run``) holds the same for its adapters: ``--to peft`` and
``load_checkpoint`` refuse its damaged latest step as ``--to hf`` does. A byte flipped in place
(the size kept, so only its checksum tells) leaves the damaged step out of the intact ones.
"""

import os

import jax
import numpy as np
import pytest

from dew.checkpoints import Checkpoints, DamagedLatestStepError
from dew.cli import convert
from dew.models import hf
from dew.models.checkpoint import load_checkpoint
from tests.lora_reference import HF_BASE, write_run
from tests.test_cli_errors import TIED


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    """``(directory, step 0's params, step 2's file, its size before)``: the tied reference model
    as step 0 (``dew convert``), its weights plus one as steps 1 and 2; step 1's data file then
    gone, and step 2's (the latest) cut to half its length, as a full disk or a killed copy
    leaves it. Step 0 is the one intact step."""
    directory = tmp_path_factory.mktemp("damaged") / "ckpt"
    convert.to_checkpoint(TIED, directory)
    _, params = load_checkpoint(directory)
    checkpoints = Checkpoints(directory, keep=None)
    for step in (1, 2):
        checkpoints.save(
            step, jax.tree.map(lambda a: a + step, params), metadata=checkpoints.metadata(0)
        )
    checkpoints.wait()
    (gone,) = (directory / "step_00000001").glob("*.npz")
    gone.unlink()
    (data,) = (directory / "step_00000002").glob("*.npz")
    size = data.stat().st_size
    os.truncate(data, size // 2)
    return directory, params, data, size


def test_load_checkpoint_refuses_a_damaged_latest_step_and_reads_a_named_one(damaged):
    directory, params, data, size = damaged
    with pytest.raises(DamagedLatestStepError) as refused:
        load_checkpoint(directory)
    assert (refused.value.step, refused.value.intact) == (2, [0])
    assert str(refused.value) == (
        f"checkpoint step 2 in {directory}, the latest, is damaged, and an older step is not "
        f"read in its place: step 2: {data} is truncated: {size // 2} bytes, the index records "
        f"{size}; the intact steps (every file whole) are 0: name one to read it "
        "(load_checkpoint(..., step=N))"
    )
    _, step0 = load_checkpoint(directory, step=0)
    jax.tree.map(np.testing.assert_array_equal, step0, params)


def test_dew_convert_refuses_it_in_one_line_and_writes_nothing(damaged, dew_here, tmp_path):
    directory, params, _, _ = damaged
    out = tmp_path / "hf"
    run = dew_here("convert", str(directory), str(out), "--to", "hf", cwd=tmp_path)
    assert run.returncode == 2, run.stdout
    (line,) = run.stderr.splitlines()
    assert line.startswith(f"dew convert: checkpoint step 2 in {directory}, the latest, is dam")
    assert line.endswith(
        "the intact steps (every file whole) are 0: name one to read it (export one with --step N)"
    ), line
    assert not out.exists()
    # Named, the intact step exports: step 0's weights, not step 1's.
    run = dew_here("convert", str(directory), str(out), "--to", "hf", "--step", "0", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    _, exported = hf.load(out)
    jax.tree.map(np.testing.assert_array_equal, exported, params)


def test_init_from_refuses_it_and_says_how_to_start_from_an_intact_step(
    damaged, dew_here, tmp_path
):
    directory = damaged[0]
    run = dew_here("train", "--init-from", str(directory), "--run-dir", "run", cwd=tmp_path)
    assert run.returncode == 2, run.stdout
    assert run.stderr.splitlines()[-1].endswith(
        f"are 0: name one to read it (--init-from reads the latest step: dew convert {directory} "
        "FOLDER --to hf --step N exports one, for --init-from FOLDER)"
    ), run.stderr


def test_resuming_still_falls_back_to_the_intact_step(damaged):
    # A run resumes from the newest intact step (and repeats the steps after it), with a warning.
    directory, params, _, _ = damaged
    checkpoints = Checkpoints(directory)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one), params)
    with pytest.warns(UserWarning) as warned:
        restored, _ = checkpoints.restore(target)
    assert [str(w.message).split(": ")[0] for w in warned] == [
        f"checkpoint step 2 in {directory} is damaged, trying step 1",
        f"checkpoint step 1 in {directory} is damaged, trying step 0",
    ]
    assert checkpoints.restored_step == 0
    jax.tree.map(np.testing.assert_array_equal, restored, params)


def test_on_object_storage_too(seed):
    # The same rule on a memory:// URL (the object-storage reader; its files are checked by a
    # listing of their sizes): step 2 truncated, step 1's data gone, step 0 intact.
    import uuid

    import fsspec

    print(f"seed: {seed}")
    weights = np.random.default_rng(seed).standard_normal((64, 32)).astype(np.float32)
    url = f"memory://dew-{uuid.uuid4().hex[:8]}/run"
    checkpoints = Checkpoints(url, keep=None)
    for step in (0, 1, 2):
        checkpoints.save(step, {"w": weights + step})
        checkpoints.wait()
    fs, root = fsspec.core.url_to_fs(url)
    try:
        fs.rm(f"{root}/step_00000001/process_00000.npz")
        data = f"{root}/step_00000002/process_00000.npz"
        fs.pipe_file(data, fs.cat_file(data)[:1000])
        with pytest.raises(DamagedLatestStepError, match="is truncated: 1000 bytes") as refused:
            Checkpoints(url).restore({"w": np.zeros_like(weights)}, fall_back=False)
        assert (refused.value.step, refused.value.intact) == (2, [0])
        restored, _ = Checkpoints(url).restore({"w": np.zeros_like(weights)}, 0, fall_back=False)
        np.testing.assert_array_equal(restored["w"], weights)
    finally:
        fs.rm(root, recursive=True)


def test_a_flipped_byte_keeps_its_size_and_its_step_is_not_named_intact(tmp_path, seed):
    # Damage no size check sees: one byte of step 2's weights flipped in place. Its checksum
    # refuses it, and the steps named intact are the two others, never the damaged one itself
    # (whose every file has the size its index records).
    import json

    print(f"seed: {seed}")
    weights = np.random.default_rng(seed).standard_normal((64, 32)).astype(np.float32)
    checkpoints = Checkpoints(tmp_path, keep=None)
    for step in (0, 1, 2):
        checkpoints.save(step, {"w": weights + step})
        checkpoints.wait()
    step_dir = tmp_path / "step_00000002"
    (piece,) = json.loads((step_dir / "index.json").read_text())["arrays"][0]["pieces"]
    data = bytearray((step_dir / piece["file"]).read_bytes())
    data[piece["offset"] + piece["nbytes"] // 2] ^= 0x01
    (step_dir / piece["file"]).write_bytes(bytes(data))
    with pytest.raises(DamagedLatestStepError, match="checksum mismatch") as refused:
        Checkpoints(tmp_path).restore({"w": np.zeros_like(weights)}, fall_back=False)
    assert (refused.value.step, refused.value.intact) == (2, [0, 1])
    assert "the intact steps (every file whole) are 0, 1: name one" in str(refused.value)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """``(run directory, step 0's adapters)``: the LoRA reference run (step 0, base
    ``HF_BASE``), its adapters plus one as step 1, whose data file is then cut to half."""
    import dew
    from dew.models.checkpoint import load_lora
    from dew.objectives.lm import LMObjective

    run = tmp_path_factory.mktemp("lora_damaged")
    write_run(run)
    model, _, adapters = load_lora(run)
    trainer = dew.Trainer(
        LMObjective(model, 40),
        dew.training.optimizer.default_optimizer(),
        jax.random.key(0),
        checkpoints=dew.Checkpoints(run / "checkpoints", keep=None),
        base=HF_BASE,
    )
    state, _, _ = trainer.place()
    later = jax.tree.map(lambda a: a + 1, state.params)
    trainer.save(state.replace(step=state.step + 1, params=later))
    trainer.checkpoints.wait()
    (data,) = (run / "checkpoints" / "step_00000001").glob("*.npz")
    os.truncate(data, data.stat().st_size // 2)
    return run, adapters


def test_peft_export_refuses_a_damaged_latest_step_and_exports_a_named_one(
    lora_run, dew_here, tmp_path
):
    from dew.models import safetensors

    run, adapters = lora_run
    out = tmp_path / "adapter"
    with pytest.raises(DamagedLatestStepError) as refused:
        convert.to_peft(run, out)
    assert (refused.value.step, refused.value.intact) == (1, [0])
    assert str(refused.value).endswith(
        "the intact steps (every file whole) are 0: name one to read it (export one with --step N)"
    ), str(refused.value)
    assert not out.exists()
    with pytest.raises(DamagedLatestStepError, match=r"\(load_checkpoint\(\.\.\., step=N\)\)$"):
        load_checkpoint(run)  # the merged model: base and adapters, refused alike
    # Named, step 0 exports: its adapters (A of layer 0's q, PEFT's [R, in]), not step 1's.
    run_cli = dew_here("convert", str(run), str(out), "--to", "peft", "--step", "0", cwd=tmp_path)
    assert run_cli.returncode == 0, run_cli.stderr
    assert run_cli.stdout.strip().endswith(f"a PEFT adapter on the base {HF_BASE}"), run_cli.stdout
    header = safetensors.Header.read(out / "adapter_model.safetensors")
    tensor = header.tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    a = np.asarray(adapters["lora"]["layers"]["attn"]["q"]["a"][0])  # [embed, R]
    np.testing.assert_array_equal(safetensors.read_block(tensor, (0, tensor.shape[0])), a.T)
