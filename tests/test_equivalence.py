"""Every layout computes what one device computes: same initial weights, loss, gradients, updates.

The reference is the model's plain loss on one device, `jax.grad` and the optax update, with no
mesh, no shard_map and no Trainer. Keys and tokens come from the module's seed
(tests/conftest.py): fresh every session, shown when a test fails, replayed with ``DEW_SEED``.
"""

import jax
import numpy as np
import optax
import pytest

import dew
from tests.helpers import (
    fresh_batch,
    relative_error,
    seeded_key,
    smooth_optimizer,
    tiny_objective,
)

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
        state, metrics = step(state, placed)
        run["losses"].append(float(metrics["loss"]))
    run.update(params=state.params, opt_state=state.opt_state, step=int(state.step))
    return run


def layout_case(seed):
    """``(key, batches, cache)`` of a layout test module: its key and ``STEPS`` batches drawn from
    ``seed``, and an empty cache of one-device runs for ``cached_reference``."""
    key = seeded_key(seed)
    return key, [fresh_batch(ROWS, (seed, i)) for i in range(STEPS)], {}


def cached_reference(case, objective, name):
    """The one-device run of ``objective`` on ``case``'s key and batches, run once per ``name``
    (a hashable description of the model)."""
    key, batches, cache = case
    if name not in cache:
        cache[name] = reference_run(objective, smooth_optimizer(), key, batches)
    return cache[name]


@pytest.fixture(scope="module")
def objective():
    return tiny_objective()


@pytest.fixture(scope="module")
def case(objective, module_seed):
    """The module's key and batches, from its seed, and the one-device run on them."""
    key = seeded_key(module_seed)
    batches = [fresh_batch(ROWS, (module_seed, i)) for i in range(STEPS)]
    return key, batches, reference_run(objective, smooth_optimizer(), key, batches)


def assert_matches(run, reference, seed):
    np.testing.assert_allclose(
        run["losses"], reference["losses"], rtol=TOL, err_msg=f"losses, seed {seed}"
    )
    for step, (grads, expected) in enumerate(zip(run["grads"], reference["grads"], strict=True)):
        error = relative_error(grads, expected)
        assert error < TOL, f"gradients of step {step} differ by {error:.3g}, seed {seed}"
    for part in ("params", "opt_state"):
        error = relative_error(run[part], reference[part])
        assert error < TOL, f"{part} after {STEPS} steps differ by {error:.3g}, seed {seed}"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_one_device(objective, case, seed, name):
    key, batches, reference = case
    run = sharded_run(objective, smooth_optimizer(), key, batches, LAYOUTS[name])
    for got, want in zip(
        jax.tree_util.tree_leaves(run["initial"]), jax.tree_util.tree_leaves(reference["initial"])
    ):
        np.testing.assert_array_equal(
            got, want, err_msg=f"initial weights depend on the layout, seed {seed}"
        )
    assert_matches(run, reference, seed)
    assert run["step"] == STEPS


@pytest.mark.parametrize("name", ["fsdp8", "data2_fsdp4"])
def test_accumulation_matches_whole_batch(objective, case, seed, name):
    key, batches, reference = case
    assert_matches(
        sharded_run(objective, smooth_optimizer(), key, batches, LAYOUTS[name], accumulation=4),
        reference,
        seed,
    )


def test_gspmd_engine_with_accumulation_matches_one_device(objective, case, seed):
    # The GSPMD engine's own accumulation path (global arrays, no shard_map), 2 microbatches.
    key, batches, reference = case
    run = sharded_run(
        objective,
        smooth_optimizer(),
        key,
        batches,
        LAYOUTS["data2_fsdp4"],
        accumulation=2,
        engine="gspmd",
    )
    assert_matches(run, reference, seed)


def test_untied_output_head_matches_one_device(case, seed):
    key, batches, _ = case
    objective = tiny_objective(tie_embeddings=False)
    reference = reference_run(objective, smooth_optimizer(), key, batches)
    assert "lm_head" in reference["params"]["params"], "the head is not a weight of its own"
    run = sharded_run(objective, smooth_optimizer(), key, batches, LAYOUTS["data2_fsdp4"])
    assert_matches(run, reference, seed)


@pytest.mark.parametrize("attention_impl", ["xla", "pallas"])
def test_grouped_query_attention_matches_one_device(case, seed, attention_impl):
    # 4 query heads over 2 kv heads: each kv head serves two query heads.
    key, batches, _ = case
    objective = tiny_objective(num_layers=1, num_kv_heads=2, attention_impl=attention_impl)
    reference = reference_run(objective, smooth_optimizer(), key, batches)
    assert reference["params"]["params"]["layers"]["attn"]["k"].shape[2] == 2
    run = sharded_run(objective, smooth_optimizer(), key, batches, LAYOUTS["data2_fsdp4"])
    assert_matches(run, reference, seed)


def test_clip_by_global_norm_matches_one_device(objective, case, seed):
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
    error = relative_error(moved, ref_moved)
    assert error < 1e-4, f"clipped moves differ by {error:.3g}, seed {seed}"


def host(tree):
    return jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), tree)


def test_ema_follows_params(seed):
    # decay 0.9, not 0.5: an EMA that swapped decay and 1 - decay would pass at 0.5.
    decay = 0.9
    trainer = dew.Trainer(
        tiny_objective(ema_decay=decay),
        optax.sgd(1.0),
        seeded_key(seed),
        mesh=dew.MeshSpec(fsdp=8),
        layout=dew.Layout(min_shard=1),
    )
    state = trainer.init_state()
    initial = host(state.params)
    expected = initial
    step = trainer.train_step(16)
    for i in range(3):
        state, _ = step(state, trainer.device_batch(fresh_batch(16, (seed, i)), 16))
        # The EMA of the params after each step: e_t = decay * e_(t-1) + (1 - decay) * p_t.
        expected = jax.tree_util.tree_map(
            lambda e, p: decay * e + (1 - decay) * p, expected, host(state.params)
        )
        # Compared as moves from the initial weights, which a wrong EMA gets wrong by their own
        # size (swapped decays: 8x, the params before the step: 1x). Float32 rounding of the
        # weights themselves is about 3e-5 of the moves.
        moved = jax.tree_util.tree_map(np.subtract, host(state.ema), initial)
        expected_moved = jax.tree_util.tree_map(np.subtract, expected, initial)
        error = relative_error(moved, expected_moved)
        assert error < 1e-3, f"EMA after step {i + 1} is off by {error:.3g}, seed {seed}"
    assert (
        state.ema["params"]["embed_tokens"]["embedding"].sharding.spec
        == state.params["params"]["embed_tokens"]["embedding"].sharding.spec
    )


def test_validation_loss_matches_one_device(tmp_path, seed):
    from dew.data import TokenWindows, write_token_folder
    from tests.helpers import SEQ, VOCAB

    rng = np.random.default_rng(seed)
    write_token_folder(
        tmp_path / "t", rng.integers(0, VOCAB, 2000), rng.integers(0, VOCAB, 800), vocab_size=VOCAB
    )
    data = TokenWindows(tmp_path / "t", seq_len=SEQ, val_batches=2).load(batch=16)
    objective = tiny_objective(ema_decay=0.5)
    trainer = dew.Trainer(
        objective,
        optax.sgd(0.1),
        seeded_key(seed),
        mesh=dew.MeshSpec(fsdp=4),
        layout=dew.Layout(min_shard=1),
    )
    state = trainer.init_state()
    state, _ = trainer.train_step(16)(state, trainer.device_batch(fresh_batch(16, seed), 16))
    for which in ("params", "ema"):
        weights = jax.tree_util.tree_map(np.asarray, getattr(state, which))
        expected = np.mean([float(objective.loss(weights, b)) for b in data.validation()])
        np.testing.assert_allclose(
            trainer.evaluate(state, data, params=which),
            expected,
            rtol=TOL,
            err_msg=f"{which}, seed {seed}",
        )
    assert trainer.evaluate(state, data) != trainer.evaluate(state, data, params="ema"), seed
