"""The Trainer's edge paths: saving without checkpoints, evaluating what cannot be evaluated, a fit
that has nothing left to train, and checkpoint_every below 1."""

import os

import jax
import numpy as np
import pytest

import dew
from dew.data import TokenWindows
from tests.helpers import SEQ, random_token_folder, seeded_key, smooth_optimizer, tiny_objective

ROWS = 8
MESH = dew.MeshSpec(fsdp=4)
# One worker runs this module: its module fixtures (a compiled initial state) then run once.
pytestmark = pytest.mark.xdist_group("trainer-edges")


@pytest.fixture(scope="module")
def folder(tmp_path_factory, module_seed):
    return random_token_folder(
        tmp_path_factory.mktemp("trainer") / "tokens", module_seed, 2000, 400
    )


def trainer(seed, ema_decay=None, checkpoints=None):
    return dew.Trainer(
        tiny_objective(ema_decay=ema_decay),
        smooth_optimizer(),
        seeded_key(seed),
        mesh=MESH,
        layout=dew.Layout(min_shard=1),
        checkpoints=checkpoints,
    )


@pytest.fixture(scope="module")
def fresh(module_seed):
    """A trainer with an EMA and no checkpoints, and its initial state (no test changes them)."""
    t = trainer(module_seed, ema_decay=0.9)
    return t, t.init_state()


def refuse_compiling(monkeypatch):
    """From here on, any new ``jax.jit`` fails the test: the refusal must come before compiling."""

    def boom(*args, **kwargs):
        raise AssertionError("compiled before checking the input")

    monkeypatch.setattr(jax, "jit", boom)


def test_save_without_checkpoints(fresh):
    t, state = fresh
    with pytest.raises(
        ValueError, match="this Trainer was built with checkpoints=None; there is nowhere to save"
    ):
        t.save(state)


def test_evaluate_without_validation_batches(folder, fresh, monkeypatch):
    data = TokenWindows(folder, seq_len=SEQ).load(batch=ROWS)  # val_batches=0
    t, state = fresh
    refuse_compiling(monkeypatch)
    with pytest.raises(
        ValueError, match="the data has no validation batches; load it with val_batches >= 1"
    ):
        t.evaluate(state, data)


@pytest.mark.parametrize(
    "has_ema, params",
    [(True, "best"), (True, "EMA"), (False, "ema")],
    ids=["unknown", "wrong_case", "ema_of_a_state_without_one"],
)
def test_evaluate_params_not_params_or_ema(folder, fresh, monkeypatch, has_ema, params):
    data = TokenWindows(folder, seq_len=SEQ, val_batches=1).load(batch=ROWS)
    t, state = fresh
    if not has_ema:
        state = state.replace(ema=None)  # what a Trainer without ema_decay holds
    refuse_compiling(monkeypatch)
    with pytest.raises(
        ValueError,
        match=rf"params must be 'params' or 'ema' \(with ema_decay set\), got '{params}'",
    ):
        t.evaluate(state, data, params=params)


def host(tree):
    return jax.tree_util.tree_map(np.asarray, tree)


def assert_same_state(got, want, seed):
    assert int(got.step) == int(want.step), seed
    for part in ("params", "opt_state"):
        for g, w in zip(
            jax.tree_util.tree_leaves(host(getattr(got, part))),
            jax.tree_util.tree_leaves(host(getattr(want, part))),
            strict=True,
        ):
            np.testing.assert_array_equal(g, w, err_msg=f"{part}, seed {seed}")


def test_fit_to_step_zero_trains_nothing(folder, fresh, seed, capsys):
    data = TokenWindows(folder, seq_len=SEQ).load(batch=ROWS)
    t, initial = fresh
    state = t.fit(data, steps=0)
    out = capsys.readouterr().out
    assert out == (
        f"Already at step 0; fit(steps=0) has nothing to train on {dict(t.mesh.shape)}\n"
    ), out
    assert_same_state(state, initial, seed)


def test_fit_resumed_at_or_past_its_target(folder, tmp_path, seed, capsys):
    # A finished run started again: it resumes, trains nothing and writes no checkpoint.
    data = TokenWindows(folder, seq_len=SEQ).load(batch=ROWS)
    checkpoints = tmp_path / "checkpoints"
    finished = trainer(seed, checkpoints=dew.Checkpoints(checkpoints)).fit(data, steps=2)
    written = sorted((p.name, p.stat().st_mtime_ns) for p in checkpoints.rglob("*"))
    capsys.readouterr()
    for steps in (2, 1):
        again = trainer(seed, checkpoints=dew.Checkpoints(checkpoints))
        state = again.fit(data, steps=steps)
        out = capsys.readouterr().out
        assert out == (
            f"Resumed from step 2 in {checkpoints}\n"
            f"Already at step 2; fit(steps={steps}) has nothing to train on "
            f"{dict(again.mesh.shape)}\n"
        ), out
        assert_same_state(state, finished, seed)
        assert sorted((p.name, p.stat().st_mtime_ns) for p in checkpoints.rglob("*")) == written


@pytest.mark.parametrize("every", [0, -3])
def test_checkpoint_every_below_one(folder, tmp_path, seed, monkeypatch, every):
    data = TokenWindows(folder, seq_len=SEQ).load(batch=ROWS)
    t = trainer(seed, checkpoints=dew.Checkpoints(tmp_path / "checkpoints"))
    refuse_compiling(monkeypatch)
    with pytest.raises(ValueError, match=f"checkpoint_every must be an integer >= 1, got {every}"):
        t.fit(data, steps=1, checkpoint_every=every)
    assert not os.path.exists(tmp_path / "checkpoints")
