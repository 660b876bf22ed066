"""Mixture of experts (its layouts' equivalence with one device, dropless and with a capacity, is in
tests/test_equivalence.py's table): a skewed router trains dropless and drops exactly the
documented copies with a capacity; expert weights are split over the expert axis; bad sizes are
refused before compiling. The router losses and the dropped fraction are held by value to the
reference of tests/test_moe_reference.py.

The reference is the plain one-device run of tests/equivalence.py on the module's fresh seed
(tests/conftest.py; replay with ``DEW_SEED``).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dew
from dew.benchmark import state_bytes_per_device
from dew.data import TokenWindows
from dew.layout import path_names
from dew.nn import moe
from dew.parallel import ONE_DEVICE, expert
from tests.equivalence import (
    ROWS,
    STEPS,
    host_state,
    layout_case,
    routing_margins,
)
from tests.helpers import (
    SEQ,
    fresh_batch,
    random_token_folder,
    seeded_key,
    smooth_optimizer,
    tiny_objective,
)
from tests.test_moe_reference import TOL, assert_metrics_match, model_router_metrics

EXPERTS = 8
MOE = {"num_experts": EXPERTS, "experts_per_token": 2}


def objective_for(overrides):
    return tiny_objective(**{**MOE, **overrides})


@pytest.fixture(scope="module")
def case(module_seed):
    return layout_case(module_seed)


def test_router_losses_are_in_the_loss(case, seed):
    # The one-device reference's loss is the cross-entropy plus the weighted router losses: with
    # both weights at 0 it is the cross-entropy alone, and the difference is what the weights add.
    key, batches, _ = case
    # (Each call one compiled program, not op by op.)
    model = objective_for({}).model
    params = jax.jit(model.init)(key)
    batch = jnp.asarray(batches[0])

    @jax.jit
    def plain_cross_entropy(params, batch):
        logits = model.apply(params, batch[:, :-1])
        picked = jnp.take_along_axis(logits, batch[:, 1:, None], axis=-1)[..., 0]
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)

    cross_entropy = float(plain_cross_entropy(params, batch))
    loss, stats = jax.jit(objective_for({}).loss_sum)(params, batch)
    tokens = batch.shape[0] * SEQ
    balance, z = float(stats.load_balance) / tokens, float(stats.z_loss) / tokens
    # The router losses by value: the reference of tests/test_moe_reference.py, written from the
    # formulas, on the same weights and tokens (one microbatch of every row, dropless).
    want = model_router_metrics(model, params, batch[:, :-1], [np.arange(batch.shape[0])])
    np.testing.assert_allclose(balance, want["load_balance_loss"], rtol=TOL, err_msg=f"seed {seed}")
    np.testing.assert_allclose(z, want["router_z_loss"], rtol=TOL, err_msg=f"seed {seed}")
    assert float(stats.dropped) == 0 and want["dropped_fraction"] == 0, seed
    want = cross_entropy + model.router_aux_weight * balance + model.router_z_weight * z
    np.testing.assert_allclose(float(loss) / tokens, want, rtol=1e-5, err_msg=f"seed {seed}")
    no_aux = objective_for({"router_aux_weight": 0.0, "router_z_weight": 0.0})
    np.testing.assert_allclose(
        float(jax.jit(no_aux.loss)(params, batch)), cross_entropy, rtol=1e-5, err_msg=f"seed {seed}"
    )


# ------------------------------------------------------------------------------------------------
# A skewed router: all router weights zero, so every token's probabilities tie and top_k picks
# the first k experts for every token.


def skewed(params):
    def zero_routers(path, leaf):
        return jnp.zeros_like(leaf) if path_names(path)[-2:] == ("router", "kernel") else leaf

    return jax.tree_util.tree_map_with_path(zero_routers, params)


def test_capacity_drops_the_later_positions_of_a_skewed_router(seed):
    experts, k, factor = 4, 2, 1.0
    model = tiny_objective(num_experts=experts, experts_per_token=k, capacity_factor=factor).model
    # Each call one compiled program, not op by op.
    params = jax.jit(model.init)(seeded_key(seed))
    layer = jax.tree_util.tree_map(lambda w: w[0], skewed(params))
    h = jax.random.normal(seeded_key(seed, 1), (3, SEQ, model.emb_features))
    limit = moe.capacity(SEQ, k, experts, factor)
    assert limit == 8  # ceil(1.0 * 16 * 2 / 4)

    def run(capacity_factor):
        return jax.jit(
            lambda weights, h: expert.moe_mlp(
                weights,
                h,
                ONE_DEVICE,
                num_experts=experts,
                k=k,
                capacity_factor=capacity_factor,
            )
        )(layer["params"]["moe_layers"]["moe"], h)

    kept, stats = run(factor)
    whole, dropless_stats = run(None)
    # Expert 0 takes every token's first copy, expert 1 every second one: each keeps the row's
    # first `limit` positions. Those pass through unchanged; the later ones get nothing at all.
    np.testing.assert_allclose(kept[:, :limit], whole[:, :limit], rtol=1e-6, err_msg=f"{seed}")
    np.testing.assert_array_equal(kept[:, limit:], 0.0, err_msg=f"seed {seed}")
    assert np.all(np.abs(np.asarray(whole[:, limit:])).sum(-1) > 0), seed
    assert float(stats.dropped) == 3 * (SEQ - limit) * k, (stats, seed)
    assert float(stats.routed) == 3 * SEQ * k and float(dropless_stats.dropped) == 0, seed


# A router trained one step from zero has logits of at most about 0.05 (0.041 to 0.085 over 25
# seeds), where the equivalence table's routers' are of order 1: rounding that differs between
# one device and a layout moves them by about 1e-8. ROUTING_MARGIN (1e-5) would send 80% of these
# draws to be drawn again (20 of 25 seeds); 5e-7 sends 16% (4 of 25), 50 times the rounding.
SKEWED_ROUTING_MARGIN = 5e-7


@pytest.mark.parametrize("capacity_factor", [None, 1.0], ids=["dropless", "capacity1"])
def test_a_skewed_router_trains_like_one_device(case, seed, capacity_factor):
    key, batches, _ = case
    # Three of four experts a token: the one no token picks at step 1 has no twin. With two of
    # four, experts 2 and 3 got bit-equal router columns from the first update (neither picked),
    # and at step 2 float rounding broke their exact tie one way on one device and the other on
    # the layout (DEW_SEED=1206679465 at 4369278: losses 3.8e-4 apart).
    objective = tiny_objective(num_experts=4, experts_per_token=3, capacity_factor=capacity_factor)
    optimizer = smooth_optimizer()
    params = skewed(jax.jit(objective.model.init)(key))  # one compiled program, not op by op

    # One device, from the skewed weights: each step one program (the update run op by op would
    # compile each of its small ops apart).
    loss_and_grads = jax.value_and_grad(objective.loss)

    def one_device(batches):
        """The reference's losses and final weights, and the smallest routing margin of its
        steps after the first (the first ties every token exactly, on both sides alike)."""
        opt_state, losses, reference = optimizer.init(params), [], params
        with routing_margins() as margins:
            # A function of its own each call, traced here, so that its margins come to this
            # list (a draw again traces again).
            @jax.jit
            def step(params, opt_state, batch):
                loss, grads = loss_and_grads(params, batch)
                updates, opt_state = optimizer.update(grads, opt_state, params)
                return optax.apply_updates(params, updates), opt_state, loss

            for n, batch in enumerate(batches):
                if n == 1:
                    jax.effects_barrier()
                    margins.clear()
                reference, opt_state, loss = step(reference, opt_state, jnp.asarray(batch))
                losses.append(float(loss))
            jax.effects_barrier()
        assert margins, "no routing was measured"
        return losses, reference, min(margins)

    # From step 2 the trained router can route a token next to a tie, which rounding breaks one
    # way on one device and the other on the layout (DEW_SEED=910515154 at 57e4a18: a margin of
    # 1.1e-8, losses 1.5e-4 apart): such batches are drawn again from the seed, as the
    # equivalence table does, at a margin of this router's scale (SKEWED_ROUTING_MARGIN).
    for attempt in range(8):
        if attempt:
            batches = [fresh_batch(ROWS, (seed, i, attempt)) for i in range(STEPS)]
        want, reference, margin = one_device(batches)
        if margin >= SKEWED_ROUTING_MARGIN:
            break
        print(f"a token routed {margin:.2g} from a tie after step 1; batches drawn again")
    else:
        pytest.fail(f"every draw routes a token within {SKEWED_ROUTING_MARGIN} of a tie ({seed})")

    trainer = dew.Trainer(
        objective, optimizer, key, mesh=dew.MeshSpec(expert=4), layout=dew.Layout(min_shard=1)
    )
    # From the skewed weights on the host (no initialisation to compile; the trainer's own is
    # checked in tests/test_equivalence.py).
    state = host_state(trainer, params, jax.device_get(jax.jit(optimizer.init)(params)))
    step, got, dropped = trainer.train_step(ROWS), [], []
    for batch in batches:
        state, metrics = step(state, trainer.device_batch(batch, ROWS))
        got.append(float(metrics["loss"]))
        dropped.append(float(metrics["dropped_fraction"]))
    np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=f"losses, seed {seed}")
    error = max(
        float(
            np.max(np.abs(np.asarray(a) - np.asarray(b))) / (np.max(np.abs(np.asarray(b))) + 1e-30)
        )
        for a, b in zip(
            jax.tree_util.tree_leaves(state.params), jax.tree_util.tree_leaves(reference)
        )
    )
    assert error < 1e-5, f"params differ by {error:.3g}, seed {seed}"
    if capacity_factor is None:
        assert dropped == [0.0] * STEPS, (dropped, seed)
    else:
        # Step 1: experts 0, 1 and 2 each get a row's 16 tokens and keep 12 (capacity
        # ceil(16 * 3 / 4)): 12 of the 48 copies drop.
        assert dropped[0] == 0.25, (dropped, seed)


# ------------------------------------------------------------------------------------------------
# Memory, metrics, errors


def test_expert_weights_split_over_the_expert_axis(seed):
    def placed(mesh):
        trainer = dew.Trainer(
            objective_for({}), optax.adam(1e-3), seeded_key(seed), mesh=mesh, layout=dew.Layout()
        )
        return trainer, trainer.init_state()

    trainer, state = placed(dew.MeshSpec(expert=8))
    whole = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(state.params)[0]:
        if "experts" in path_names(path):
            assert leaf.sharding.spec[1] == "expert", (path_names(path), leaf.sharding.spec)
            assert leaf.addressable_shards[0].data.shape[1] == EXPERTS // 8
            whole += leaf.nbytes
    # The state (weights and Adam's two moments) per device: the experts' 1/8, the rest whole.
    _, replicated = placed(dew.MeshSpec())
    full = state_bytes_per_device(replicated)
    saved = state_bytes_per_device(state)
    assert full - saved == 3 * whole * 7 // 8, (full, saved, whole)


def test_an_expert_checkpoint_restores_into_fsdp(tmp_path, seed):
    # Saved with the experts split over expert 4, restored over fsdp 8: every array equal.
    def trainer(mesh):
        return dew.Trainer(
            objective_for({}),
            optax.adam(1e-3),
            seeded_key(seed),
            mesh=mesh,
            layout=dew.Layout(min_shard=1),
            checkpoints=dew.Checkpoints(tmp_path / "ckpt"),
        )

    saver = trainer(dew.MeshSpec(expert=4))
    state = saver.init_state()
    state, _ = saver.train_step(ROWS)(state, saver.device_batch(fresh_batch(ROWS, seed), ROWS))
    saver.save(state)
    saver.checkpoints.wait()
    restored, _, _ = trainer(dew.MeshSpec(fsdp=8)).place()
    for got, want in zip(
        jax.tree_util.tree_leaves((restored.params, restored.opt_state)),
        jax.tree_util.tree_leaves((state.params, state.opt_state)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"seed {seed}")


def test_metrics_carry_the_router_losses(tmp_path, seed, capsys):
    folder = random_token_folder(tmp_path / "tokens", seed, train=4000, val=0)
    data = TokenWindows(folder, seq_len=SEQ, seed=seed).load(batch=16)
    objective = tiny_objective(num_experts=4, capacity_factor=0.5)
    trainer = dew.Trainer(
        objective,
        optax.adamw(1e-3),
        seeded_key(seed),
        mesh=dew.MeshSpec(expert=4),
        layout=dew.Layout(min_shard=1),
    )
    trainer.fit(data, steps=2, log_every=1, metrics=tmp_path / "metrics.jsonl")
    lines = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [line["step"] for line in lines] == [1, 2]
    # By value: each line is the reference of tests/test_moe_reference.py on the step's batch and
    # the weights the step started from (replayed from the same initial state).
    state, step = trainer.init_state(), trainer.train_step(data.batch_size)
    for index, line in enumerate(lines):
        batch = data.batch(index)
        rows = np.arange(data.batch_size)
        want = model_router_metrics(objective.model, state.params, batch[:, :-1], [rows])
        # A capacity of half the even share drops at least half of the copies.
        assert want["dropped_fraction"] >= 0.5, (want, seed)
        assert_metrics_match(line, want, f"step {line['step']}, seed {seed}")
        state, _ = step(state, trainer.device_batch(batch, data.batch_size))
    printed = capsys.readouterr().out
    assert f"load balance {lines[0]['load_balance_loss']:.4f}" in printed, printed


@pytest.mark.parametrize(
    "overrides, mesh, match",
    [
        ({"num_experts": 6}, dew.MeshSpec(expert=4), "num_experts 6 does not split over expert 4"),
        ({"num_experts": 4, "experts_per_token": 5}, None, "experts_per_token 5 .* num_experts 4"),
        ({"num_experts": 4, "experts_per_token": 0}, None, "experts_per_token 0"),
        ({"num_experts": 4, "capacity_factor": 0.0}, None, "capacity_factor must be .* got 0.0"),
        ({"num_experts": 4, "capacity_factor": -1}, None, "capacity_factor must be .* got -1"),
        ({"num_experts": 4, "moe_every": 3}, None, "num_layers 2 is not a multiple of moe_every 3"),
        (
            {"num_experts": 4, "capacity_factor": 1.0},
            dew.MeshSpec(sequence=2),
            "capacity_factor 1.0 with sequence 2",
        ),
    ],
)
def test_bad_moe_sizes_are_refused_before_compiling(overrides, mesh, match):
    with pytest.raises(ValueError, match=match):
        objective = tiny_objective(**overrides)
        dew.Trainer(objective, optax.sgd(0.1), jax.random.key(0), mesh=mesh or dew.MeshSpec())


def test_a_layout_that_leaves_experts_whole_is_refused():
    rules = [rule for rule in dew.layout.DEFAULT_RULES if rule[1] != "expert"]
    with pytest.raises(ValueError, match="experts' dimension, and only it, split over 'expert'"):
        dew.Trainer(
            objective_for({}),
            optax.sgd(0.1),
            jax.random.key(0),
            mesh=dew.MeshSpec(expert=2),
            layout=dew.Layout(rules=rules),
        )
