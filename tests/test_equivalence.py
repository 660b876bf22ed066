"""Every layout computes what one device computes: same initial weights, loss, gradients, updates.

The reference is the model's plain loss on one device, `jax.grad` and the optax update, with no mesh,
no shard_map and no Trainer. Keys and tokens are drawn fresh every session.
"""

import jax
import numpy as np
import optax
import pytest

import dew
from tests.helpers import fresh_batch, relative_error, smooth_optimizer, tiny_objective

LAYOUTS = {
    "data8": dew.MeshSpec(),
    "fsdp8": dew.MeshSpec(fsdp=8),
    "data2_fsdp4": dew.MeshSpec(fsdp=4),
    "data4_fsdp2": dew.MeshSpec(fsdp=2),
}
ROWS = 32  # 4 rows per device: room for 4 microbatches
STEPS = 3
TOL = 1e-5


def reference_run(objective, optimizer, key, batches):
    """One device: plain init, loss, grad and optax update."""
    one = jax.devices()[0]
    params = jax.jit(objective.model.init)(jax.device_put(key, one))
    opt_state = optimizer.init(params)
    loss_and_grads = jax.jit(jax.value_and_grad(objective.loss))
    run = {"initial": params, "losses": [], "grads": []}
    for batch in batches:
        loss, grads = loss_and_grads(params, jax.device_put(batch, one))
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        run["losses"].append(float(loss))
        run["grads"].append(grads)
    run.update(params=params, opt_state=opt_state)
    return run


def sharded_run(objective, optimizer, key, batches, mesh, **trainer_args):
    trainer = dew.Trainer(
        objective, optimizer, key, mesh=mesh, layout=dew.Layout(min_shard=1), **trainer_args
    )
    state = trainer.init_state()
    run = {"initial": jax.tree_util.tree_map(np.asarray, state.params), "losses": [], "grads": []}
    step = trainer.train_step(ROWS)
    for batch in batches:
        placed = trainer.device_batch(batch, ROWS)
        run["grads"].append(trainer.gradients(state.params, placed)[0])
        state, loss = step(state, placed)
        run["losses"].append(float(loss))
    run.update(params=state.params, opt_state=state.opt_state, step=int(state.step))
    return run


@pytest.fixture(scope="module")
def objective():
    return tiny_objective()


@pytest.fixture(scope="module")
def case(objective):
    """A fresh key and batches, and the one-device run on them."""
    key = jax.random.key(int(np.random.default_rng().integers(1 << 30)))
    batches = [fresh_batch(ROWS) for _ in range(STEPS)]
    return key, batches, reference_run(objective, smooth_optimizer(), key, batches)


def assert_matches(run, reference):
    np.testing.assert_allclose(run["losses"], reference["losses"], rtol=TOL)
    for step, (grads, expected) in enumerate(zip(run["grads"], reference["grads"])):
        assert relative_error(grads, expected) < TOL, f"gradients of step {step} differ"
    assert relative_error(run["params"], reference["params"]) < TOL
    assert relative_error(run["opt_state"], reference["opt_state"]) < TOL


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_one_device(objective, case, name):
    key, batches, reference = case
    run = sharded_run(objective, smooth_optimizer(), key, batches, LAYOUTS[name])
    for got, want in zip(
        jax.tree_util.tree_leaves(run["initial"]), jax.tree_util.tree_leaves(reference["initial"])
    ):
        np.testing.assert_array_equal(got, want, err_msg="initial weights depend on the layout")
    assert_matches(run, reference)
    assert run["step"] == STEPS


@pytest.mark.parametrize("name", ["fsdp8", "data2_fsdp4"])
def test_accumulation_matches_whole_batch(objective, case, name):
    key, batches, reference = case
    assert_matches(
        sharded_run(objective, smooth_optimizer(), key, batches, LAYOUTS[name], accumulation=4),
        reference,
    )


def test_clip_by_global_norm_matches_one_device(objective, case):
    key, batches, _ = case
    # A threshold far below the gradient norm, so the clip is active and depends on the global norm,
    # and a learning rate that makes each update 1.0 in norm, large enough to compare in float32.
    optimizer = optax.chain(optax.clip_by_global_norm(1e-3), optax.sgd(1e3))
    reference = reference_run(objective, optimizer, key, batches[:2])
    run = sharded_run(objective, optimizer, key, batches[:2], LAYOUTS["fsdp8"])
    # A norm summed over one device's shards only would scale the moves by about sqrt(8).
    moved = jax.tree_util.tree_map(lambda a, b: np.asarray(a) - b, run["params"], run["initial"])
    ref_moved = jax.tree_util.tree_map(
        lambda a, b: np.asarray(a) - np.asarray(b), reference["params"], reference["initial"]
    )
    assert relative_error(moved, ref_moved) < 1e-4


def test_ema_follows_params():
    key = jax.random.key(1)
    trainer = dew.Trainer(
        tiny_objective(ema_decay=0.5),
        optax.sgd(0.1),
        key,
        mesh=dew.MeshSpec(fsdp=8),
        layout=dew.Layout(min_shard=1),
    )
    state = trainer.init_state()
    before = jax.tree_util.tree_map(np.asarray, state.params)
    state, _ = trainer.train_step(16)(state, trainer.device_batch(fresh_batch(16), 16))
    expected = jax.tree_util.tree_map(
        lambda b, p: 0.5 * b + 0.5 * np.asarray(p), before, state.params
    )
    assert relative_error(state.ema, expected) < 1e-6
    assert (
        state.ema["params"]["embed_tokens"]["embedding"].sharding.spec
        == state.params["params"]["embed_tokens"]["embedding"].sharding.spec
    )


def test_validation_loss_matches_one_device(tmp_path):
    from dew.data import TokenWindows, write_token_folder
    from tests.helpers import SEQ, VOCAB

    rng = np.random.default_rng()
    write_token_folder(
        tmp_path / "t", rng.integers(0, VOCAB, 2000), rng.integers(0, VOCAB, 800), vocab_size=VOCAB
    )
    data = TokenWindows(tmp_path / "t", seq_len=SEQ, val_batches=2).load(batch=16)
    objective = tiny_objective(ema_decay=0.5)
    trainer = dew.Trainer(
        objective,
        optax.sgd(0.1),
        jax.random.key(2),
        mesh=dew.MeshSpec(fsdp=4),
        layout=dew.Layout(min_shard=1),
    )
    state = trainer.init_state()
    state, _ = trainer.train_step(16)(state, trainer.device_batch(fresh_batch(16), 16))
    for which in ("params", "ema"):
        weights = jax.tree_util.tree_map(np.asarray, getattr(state, which))
        expected = np.mean([float(objective.loss(weights, b)) for b in data.validation()])
        np.testing.assert_allclose(trainer.evaluate(state, data, params=which), expected, rtol=TOL)
    assert trainer.evaluate(state, data) != trainer.evaluate(state, data, params="ema")
