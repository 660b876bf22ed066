"""A resumed run equals an uninterrupted one, batches read included, in any layout."""

import re

import jax
import numpy as np
import optax
import pytest

import dew
from dew.checkpoints import CheckpointMismatchError
from dew.data import TokenWindows
from tests.helpers import SEQ, random_token_folder, tiny_objective

ROWS = 16


@pytest.fixture(scope="module")
def folder(tmp_path_factory, module_seed):
    # 3000 tokens: 187 windows, 11 batches an epoch, so 2 x 8 steps cross an epoch boundary.
    return random_token_folder(tmp_path_factory.mktemp("tokens") / "tokens", module_seed, 3000, 300)


def trainer(directory, mesh, objective=None, **kwargs):
    return dew.Trainer(
        objective or tiny_objective(ema_decay=0.9),
        optax.adamw(1e-2),
        jax.random.key(11),
        mesh=mesh,
        layout=dew.Layout(min_shard=1),
        checkpoints=dew.Checkpoints(directory) if directory else None,
        **kwargs,
    )


def leaves_equal(a, b):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(la) == len(lb) and all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb)
    )


def losses(text):
    return re.findall(r"^step \d+: loss [^\s,]+(?=, )", text, re.M)


def test_restart_equals_an_uninterrupted_run(folder, tmp_path, capsys):
    data = TokenWindows(folder, seq_len=SEQ, seed=3).load(batch=ROWS)
    whole = trainer(None, dew.MeshSpec(fsdp=8)).fit(data, steps=16, log_every=1)
    whole_losses = losses(capsys.readouterr().out)

    trainer(tmp_path / "run", dew.MeshSpec(fsdp=8)).fit(data, steps=8, log_every=1)
    first_half = losses(capsys.readouterr().out)
    again = trainer(tmp_path / "run", dew.MeshSpec(fsdp=8))  # a new Trainer, same directory
    resumed = again.fit(data, steps=16, log_every=1)
    out = capsys.readouterr().out
    assert out.startswith(f"Resumed from step 8 in {(tmp_path / 'run').resolve()}")
    assert first_half + losses(out) == whole_losses  # the same batches, in order
    assert int(resumed.step) == 16
    assert leaves_equal(resumed.params, whole.params)
    assert leaves_equal(resumed.opt_state, whole.opt_state)
    assert leaves_equal(resumed.ema, whole.ema)
    _, _, position = again.place()
    assert position["next_batch"] == 16


def test_restore_into_another_layout_is_bit_for_bit(folder, tmp_path):
    data = TokenWindows(folder, seq_len=SEQ).load(batch=ROWS)
    saved = trainer(tmp_path / "run", dew.MeshSpec()).fit(data, steps=2)
    for mesh in (dew.MeshSpec(fsdp=8), dew.MeshSpec(fsdp=4), dew.MeshSpec(fsdp=2)):
        restored, shardings, _ = trainer(tmp_path / "run", mesh).place()
        assert leaves_equal(restored.params, saved.params)
        assert leaves_equal(restored.opt_state, saved.opt_state)
        assert leaves_equal(restored.ema, saved.ema)
        assert jax.random.key_data(restored.key).tolist() == jax.random.key_data(saved.key).tolist()
        table = restored.params["params"]["embed_tokens"]["embedding"]
        assert table.sharding == shardings.params["params"]["embed_tokens"]["embedding"]
        assert table.sharding.spec == jax.sharding.PartitionSpec("fsdp")


def test_bfloat16_params_round_trip(folder, tmp_path):
    data = TokenWindows(folder, seq_len=SEQ).load(batch=ROWS)
    objective = tiny_objective(param_dtype="bfloat16", dtype="bfloat16")
    saved = trainer(tmp_path / "run", dew.MeshSpec(fsdp=8), objective).fit(data, steps=1)
    restored, _, _ = trainer(tmp_path / "run", dew.MeshSpec(fsdp=2), objective).place()
    table = restored.params["params"]["embed_tokens"]["embedding"]
    assert table.dtype == jax.numpy.bfloat16
    assert leaves_equal(restored.params, saved.params)


def test_checkpoint_every_and_keep(folder, tmp_path):
    data = TokenWindows(folder, seq_len=SEQ).load(batch=ROWS)
    t = trainer(tmp_path / "run", dew.MeshSpec(fsdp=8))
    t.fit(data, steps=7, checkpoint_every=2)
    assert t.checkpoints.steps == [6, 7]  # keep=2: 2 and 4 were removed
    assert t.checkpoints.latest == 7


def test_a_checkpoint_of_another_model_is_refused(folder, tmp_path):
    data = TokenWindows(folder, seq_len=SEQ).load(batch=ROWS)
    trainer(tmp_path / "run", dew.MeshSpec()).fit(data, steps=1)
    wider = tiny_objective(ema_decay=0.9, emb_features=64)
    with pytest.raises(
        CheckpointMismatchError,
        match=r"\['embed_tokens'\]\['embedding'\].*\(64, 32\).*\(64, 64\)|"
        r"\['embed_tokens'\]\['embedding'\].*\(64, 64\).*\(64, 32\)",
    ):
        trainer(tmp_path / "run", dew.MeshSpec(), wider).place()


def test_a_non_finite_loss_stops_before_saving(folder, tmp_path):
    data = TokenWindows(folder, seq_len=SEQ).load(batch=ROWS)
    trainer(tmp_path / "run", dew.MeshSpec(fsdp=8)).fit(data, steps=2)
    diverging = dew.Trainer(
        tiny_objective(ema_decay=0.9),
        optax.adamw(float("nan")),
        jax.random.key(11),
        mesh=dew.MeshSpec(fsdp=8),
        layout=dew.Layout(min_shard=1),
        checkpoints=dew.Checkpoints(tmp_path / "run"),
    )
    # Step 3's loss is computed before its update and is finite; the weights it leaves are NaN.
    with pytest.raises(
        FloatingPointError, match=r"step 3: the weights hold NaN or inf; not saving"
    ):
        diverging.fit(data, steps=6, checkpoint_every=1)
    with pytest.raises(
        FloatingPointError, match=r"step 4: the loss is nan; .*latest checkpoint: 2"
    ):
        diverging.fit(data, steps=6)  # resumes from step 2; step 4 computes the first NaN loss
    assert diverging.checkpoints.steps == [2]
