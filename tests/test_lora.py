"""LoRA: the adapted layer against its formula, a fresh adapter changes nothing, the merged weights
compute the adapted model, a LoRA step on three layouts equals one device, the base stays
bit-equal, and the step sums no gradient of it."""

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import dew
from dew.models import lora
from dew.nn.lora import Adapted
from dew.objectives.lm import LMObjective
from tests.equivalence import TOL, recording
from tests.helpers import SEQ, VOCAB, fresh_batch, relative_error, seeded_key, smooth_optimizer

# One worker runs the module: its one-device reference (``case``) is computed once.
pytestmark = pytest.mark.xdist_group("lora")

ROWS = 16
RANK = 4


def lora_objective(**lora_fields):
    model = dew.models.build(
        "causal_transformer",
        vocab_size=VOCAB,
        emb_features=32,
        num_layers=2,
        num_heads=4,
        max_seq_len=SEQ,
        lora=lora.Lora(rank=RANK, **lora_fields),
    )
    return LMObjective(model, SEQ)


def base_and_adapters(model, base_key, adapters_key):
    """The model's initial weights from ``base_key`` and ``random_adapters`` from
    ``adapters_key``, in one compiled program (not op by op, nor two)."""
    return jax.jit(lambda k0, k1: (model.init(k0), random_adapters(model, k1)))(
        base_key, adapters_key
    )


def random_adapters(model, key):
    """Adapters as after some training: A as drawn at init, B drawn too (a fresh B is zero, and
    so then is A's gradient), at 0.05 standard deviation."""
    fresh = lora.init_adapters(model, key)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(fresh)
    keys = jax.random.split(jax.random.fold_in(key, 1), len(leaves))
    drawn = [
        0.05 * jax.random.normal(k, x.shape, x.dtype) if path[-1].key == "b" else x
        for k, (path, x) in zip(keys, leaves)
    ]
    return jax.tree_util.tree_unflatten(treedef, drawn)


# --- The layer ----------------------------------------------------------------------------------


SPECS = [
    # (einsum, x shape, W shape, input dims of W)
    ("bse,ehd->bshd", (2, 3, 8), (8, 4, 2), 1),
    ("bshd,hde->bse", (2, 3, 4, 2), (4, 2, 8), 2),
    ("te,ef->tf", (5, 8), (8, 6), 1),
    ("tf,fe->te", (5, 6), (6, 8), 1),
]


@pytest.mark.parametrize("spec,x_shape,w_shape,inputs", SPECS, ids=[s[0] for s in SPECS])
def test_adapted_layer_is_x_w_plus_scaled_x_a_b(spec, x_shape, w_shape, inputs, seed):
    """``Adapted.einsum`` against ``x W + (alpha / R) x A B`` written as matrices in numpy
    (float64), and no gradient reaches ``W``."""
    rng = np.random.default_rng(seed)
    print(f"seed {seed}")
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = rng.standard_normal(w_shape).astype(np.float32)
    n_in = math.prod(w_shape[:inputs])
    a = rng.standard_normal((*w_shape[:inputs], RANK)).astype(np.float32)
    b = rng.standard_normal((RANK, *w_shape[inputs:])).astype(np.float32)
    scale = 1.75
    got = Adapted(jnp.asarray(w), jnp.asarray(a), jnp.asarray(b), scale).einsum(spec, x)
    # As matrices: x [tokens, in], W [in, out], A [in, R], B [R, out].
    x_cols = x.shape[len(x_shape) - inputs :]
    assert x_cols == w_shape[:inputs]
    tokens = x.reshape(-1, n_in).astype(np.float64)
    w2, a2, b2 = (m.reshape(n_in if m is not b else RANK, -1).astype(np.float64) for m in (w, a, b))
    want = tokens @ w2 + scale * (tokens @ a2) @ b2
    want = want.reshape(*x_shape[: len(x_shape) - inputs], *w_shape[inputs:])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)

    def loss(w, a):
        return jnp.sum(Adapted(w, a, jnp.asarray(b), scale).einsum(spec, x) ** 2)

    grad_w, grad_a = jax.grad(loss, argnums=(0, 1))(jnp.asarray(w), jnp.asarray(a))
    assert not np.any(np.asarray(grad_w)), "a gradient reached the frozen weight"
    assert np.any(np.asarray(grad_a))


def test_dropout_drops_the_updates_input_at_its_rate(seed):
    """With a key and rate ``p`` the update is ``(alpha / R) ((x * m / (1 - p)) A) B``, ``m`` the
    key's Bernoulli(1 - p) mask, the base ``x W`` untouched; about ``p`` of the entries drop;
    rate 0 (an evaluation) is the layer without dropout, exactly."""
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((64, 32)), jnp.float32)
    w, a = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((32, 24), (32, RANK)))
    b = jnp.asarray(rng.standard_normal((RANK, 24)), jnp.float32)
    key, p = seeded_key(seed), 0.3
    plain = Adapted(w, a, b, 2.0).einsum("te,ef->tf", x)
    off = Adapted(w, a, b, 2.0, key, jnp.float32(0.0)).einsum("te,ef->tf", x)
    np.testing.assert_array_equal(np.asarray(off), np.asarray(plain))
    got = Adapted(w, a, b, 2.0, key, jnp.float32(p)).einsum("te,ef->tf", x)
    keep = np.asarray(jax.random.bernoulli(key, 1.0 - p, x.shape))
    x64, a64, b64 = (np.asarray(m, np.float64) for m in (x, a, b))
    want = x64 @ np.asarray(w, np.float64) + 2.0 * ((x64 * keep / (1 - p)) @ a64) @ b64
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    dropped = 1.0 - keep.mean()
    assert abs(dropped - p) < 4 * math.sqrt(p * (1 - p) / keep.size), dropped


def test_a_dropout_step_draws_its_masks_from_the_step(case):
    """``Lora(dropout=0.2)`` on fsdp=8: the same state and batch give the same loss again (the
    masks are the step's key's), and another step number another loss."""
    model = dataclasses_replace(case["objective"].model, lora=lora.Lora(rank=RANK, dropout=0.2))
    trainer = dew.Trainer(
        LMObjective(model, SEQ),
        smooth_optimizer(),
        case["key"],
        mesh=dew.MeshSpec(fsdp=8),
        layout=dew.Layout(min_shard=1),
    )
    # The state in host memory, laid out afresh for each call (the step donates it): a transfer,
    # where copying each placed leaf would compile a copy program per shape and layout.
    state = dew.TrainState(
        step=np.zeros((), np.int32),
        params=jax.tree_util.tree_map(np.asarray, case["adapters"]),
        opt_state=jax.tree_util.tree_map(np.asarray, trainer.optimizer.init(case["adapters"])),
        ema=None,
        key=np.asarray(jax.random.key_data(case["key"])),
        frozen=jax.tree_util.tree_map(np.asarray, case["base"]),
    )
    step = trainer.train_step(ROWS)
    batch = trainer.device_batch(case["batches"][0], ROWS)

    def placed(state):
        state = state.replace(key=jax.random.wrap_key_data(state.key))
        return jax.device_put(state, trainer.state_shardings)

    losses = [float(step(placed(state), batch)[1]["loss"]) for _ in range(2)]
    later = float(step(placed(state.replace(step=np.ones((), np.int32))), batch)[1]["loss"])
    assert losses[0] == losses[1]
    # The same weights and batch at the next step: other masks and another loss (the step number
    # reaches the loss only through the masks: the learning rate acts after it). How much
    # dropout moves the loss depends on the drawn adapters, down to 1e-5 of it: the rate itself
    # is held to its formula above.
    assert later != losses[0], "nothing dropped"


def test_fresh_adapters_give_the_base_logits_exactly(seed):
    """B = 0 at init: the adapted model's logits are the base model's, bit for bit."""
    model = lora_objective().model
    key = seeded_key(seed)
    base = jax.jit(model.init)(key)  # one compiled program, not op by op
    adapters = jax.jit(lambda key: lora.init_adapters(model, key))(key)
    assert all(not np.any(np.asarray(ab["b"])) for ab in _pairs(adapters))
    assert all(np.any(np.asarray(ab["a"])) for ab in _pairs(adapters))
    tokens = jnp.asarray(fresh_batch(2, seed)[:, :-1])
    apply = jax.jit(model.apply)
    plain = apply(base, tokens)
    adapted = apply(lora.combine(model, base, adapters), tokens)
    np.testing.assert_array_equal(np.asarray(adapted), np.asarray(plain))


def _pairs(adapters):
    return [
        ab
        for groups in adapters["lora"].values()
        for weights in groups.values()
        for ab in weights.values()
    ]


def test_merged_weights_compute_the_adapted_model(case, seed):
    """``lora.merge`` (W + alpha / R A B) gives the adapted model's logits (float32): the base and
    drawn adapters of the step's reference (``case``), on two of its rows."""
    model, base, adapters = case["objective"].model, case["base"], case["adapters"]
    tokens = jnp.asarray(case["batches"][0][:2, :-1])
    apply = jax.jit(model.apply)
    adapted = apply(lora.combine(model, base, adapters), tokens)
    merged = apply(lora.merge(model, base, adapters), tokens)
    assert relative_error(merged, adapted) < TOL
    changed = apply(base, tokens)
    assert relative_error(changed, adapted) > 1e-2, "the adapters changed nothing"


# --- The step on every layout -------------------------------------------------------------------

STEPS = 2


@pytest.fixture(scope="module")
def case(module_seed):
    """The one-device reference: ``jax.grad`` of the plain loss of the joined model with respect
    to the adapters, and the optax update, for ``STEPS`` batches."""
    objective = lora_objective()
    model = objective.model
    key = seeded_key(module_seed)
    base, adapters = base_and_adapters(model, key, seeded_key(module_seed, 1))
    batches = [fresh_batch(ROWS, (module_seed, i)) for i in range(STEPS)]
    optimizer = smooth_optimizer()

    def loss(adapters, batch):
        return objective.loss(lora.combine(model, base, adapters), batch)

    # The gradient and the update in one program.
    @jax.jit
    def step(params, opt_state, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return value, grads, optax.apply_updates(params, updates), opt_state

    params, opt_state = adapters, optimizer.init(adapters)
    reference = {"losses": [], "grads": []}
    for batch in batches:
        value, grads, params, opt_state = step(params, opt_state, batch)
        reference["losses"].append(float(value))
        reference["grads"].append(grads)
    reference.update(params=params, opt_state=opt_state)
    return dict(
        objective=objective, key=key, base=base, adapters=adapters, batches=batches, **reference
    )


def _lora_run(case, mesh, **trainer_args):
    trainer = dew.Trainer(
        case["objective"],
        recording(smooth_optimizer()),
        case["key"],
        mesh=mesh,
        layout=dew.Layout(min_shard=1),
        **trainer_args,
    )
    params = jax.tree_util.tree_map(np.asarray, case["adapters"])
    state = dew.TrainState(
        step=np.zeros((), np.int32),
        params=params,
        # On the host, as the weights: device_put lays host arrays out directly, where one
        # device's arrays would each be cut by a program of their own (jax's _multi_slice).
        opt_state=jax.device_get(trainer.optimizer.init(params)),
        ema=None,
        key=jax.random.wrap_key_data(
            np.asarray(jax.random.key_data(trainer.key)), impl=jax.random.key_impl(trainer.key)
        ),
        frozen=jax.tree_util.tree_map(np.asarray, case["base"]),
    )
    state = jax.device_put(state, trainer.state_shardings)
    step = trainer.train_step(ROWS)
    run = {"losses": [], "grads": []}
    for batch in case["batches"]:
        state, metrics = step(state, trainer.device_batch(batch, ROWS))
        run["losses"].append(float(metrics["loss"]))
        run["grads"].append(jax.tree_util.tree_map(np.asarray, state.opt_state[0]))
    return trainer, state, run


LAYOUTS = {
    "fsdp=8": dict(mesh=dew.MeshSpec(fsdp=8)),
    "data=2,tensor=4": dict(mesh=dew.MeshSpec(data=2, tensor=4)),
    "sequence=2,fsdp=4 accumulation=2": dict(mesh=dew.MeshSpec(sequence=2, fsdp=4), accumulation=2),
    "stage=2,fsdp=2": dict(mesh=dew.MeshSpec(stage=2, fsdp=2, microbatches=2)),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_lora_step_matches_one_device_and_leaves_the_base_bit_equal(case, seed, name):
    """Loss, the adapters' gradients of each step, and the adapters and optimizer state after
    them within 1e-5 of one device; the frozen base after the steps is the base before, bit for
    bit; and the optimizer state holds the adapters alone."""
    trainer, state, run = _lora_run(case, **LAYOUTS[name])
    where = f"{name}, seed {seed}"
    np.testing.assert_allclose(run["losses"], case["losses"], rtol=TOL, err_msg=where)
    for i, (got, want) in enumerate(zip(run["grads"], case["grads"], strict=True)):
        assert relative_error(got, want) < TOL, f"gradients of step {i}, {where}"
    assert relative_error(state.params, case["params"]) < TOL, where
    assert relative_error(state.opt_state[1], case["opt_state"]) < TOL, where
    for got, want in zip(
        jax.tree_util.tree_leaves(state.frozen),
        jax.tree_util.tree_leaves(case["base"]),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=where)
    moments = jax.tree_util.tree_leaves(state.opt_state[1])
    adapter_elements = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
    assert sum(np.size(m) for m in moments) <= adapter_elements + 1, "state beyond the adapters"


def test_fsdp_step_gathers_the_base_and_sums_only_adapter_gradients(case):
    """The collectives of a LoRA step on fsdp=8: the base's all_gathers remain (forward and the
    recomputed backward), no psum_scatter (the transpose of a gather: a base gradient) runs, and
    the psums carry the adapters' gradients and the loss, nothing more."""
    from dew.collectives import collectives

    trainer = dew.Trainer(
        case["objective"],
        smooth_optimizer(),
        case["key"],
        mesh=dew.MeshSpec(fsdp=8),
        layout=dew.Layout(min_shard=1),
    )
    report = collectives(trainer.train_step(ROWS), *trainer.step_arguments(ROWS))
    ops = {row.op for row in report.rows}
    assert "all_gather" in ops
    assert "psum_scatter" not in ops, report
    (psum,) = [row for row in report.rows if row.op == "psum"]
    adapter_bytes = sum(x.size * 4 for x in jax.tree_util.tree_leaves(case["adapters"]))
    # The adapters' float32 gradients and the loss's float32 scalar.
    assert psum.operand_bytes == adapter_bytes + 4, report
    gathered = sum(row.operand_bytes for row in report.rows if row.op == "all_gather")
    base_bytes = sum(x.size * 4 for x in jax.tree_util.tree_leaves(case["base"]))
    assert gathered >= base_bytes / 8, report


def test_an_moe_model_adapts_attention_and_dense_mlps_on_expert_2_fsdp_2(seed):
    """What LoRA means for experts: an MoE layer's attention gets adapters, its experts and
    router none (they stay frozen, split over ``expert``); a dense layer's MLP does. One step on
    expert=2, fsdp=2 equals one device (the batch cut into the step's 8 shards, as the router's
    load-balancing statistics are per shard: tests/equivalence.Microbatched)."""
    from tests.equivalence import Microbatched, away_from_ties, tie_draws

    model = dataclasses_replace(lora_objective().model, num_experts=4, moe_every=2)
    objective = LMObjective(model, SEQ)
    key = seeded_key(seed)
    base, adapters = base_and_adapters(model, key, seeded_key(seed, 1))
    assert set(adapters["lora"]["moe_layers"]) == {"attn"}
    assert set(adapters["lora"]["layers"]) == {"attn", "mlp"}
    reference = Microbatched(objective, 8, 1)

    def one_device(batch):
        def loss(adapters):
            return reference.loss(lora.combine(model, base, adapters), batch)

        return jax.jit(jax.value_and_grad(loss))(adapters)

    batch, (want_loss, want_grads) = away_from_ties(
        one_device, tie_draws(seed, ROWS), f"seed {seed}"
    )
    case = dict(objective=objective, key=key, adapters=adapters, base=base, batches=[batch])
    _, _, run = _lora_run(case, mesh=dew.MeshSpec(expert=2, fsdp=2))
    np.testing.assert_allclose(run["losses"][0], float(want_loss), rtol=TOL)
    assert relative_error(run["grads"][0], want_grads) < TOL, f"seed {seed}"


# --- Refusals -----------------------------------------------------------------------------------


def test_bad_settings_are_refused_naming_the_values():
    with pytest.raises(ValueError, match="rank must be a positive integer, got 0"):
        lora.Lora(rank=0)
    with pytest.raises(ValueError, match="alpha must be above 0"):
        lora.Lora(rank=4, alpha=-1)
    with pytest.raises(ValueError, match="qkv_proj"):
        lora.Lora(rank=4, targets=("q_proj", "qkv_proj"))
    with pytest.raises(ValueError, match="base_dtype 'int4'"):
        lora.Lora(rank=4, base_dtype="int4")
    assert lora.Lora(rank=8).alpha == 16.0
    objective = lora_objective()
    plain = LMObjective(dataclasses_replace(objective.model, lora=None), SEQ)
    with pytest.raises(ValueError, match="has no lora"):
        dew.Trainer(plain, smooth_optimizer(), jax.random.key(0), base="somewhere")
    shared = lora_objective()
    shared = LMObjective(dataclasses_replace(shared.model, num_kv_heads=2), SEQ)
    with pytest.raises(ValueError, match="kv heads shared over tensor"):
        dew.Trainer(shared, smooth_optimizer(), jax.random.key(0), mesh=dew.MeshSpec(tensor=4))


def test_a_rank_above_a_weights_min_in_out_is_refused_naming_it():
    """``A B`` has rank at most ``min(in, out)``: a rank above the lowest such bound of the
    adapted weights is refused, naming that weight and its shape. Width 32, 4 heads of 8, 2 kv
    heads: k and v are 32 x 16, q and o 32 x 32, the MLP 32 x 128 and 128 x 32."""

    def build(rank, targets=lora.DEFAULT_TARGETS):
        return dataclasses_replace(
            lora_objective().model, num_kv_heads=2, lora=lora.Lora(rank, targets=targets)
        )

    assert build(16).lora.rank == 16  # k and v's bound itself: a full-rank update
    with pytest.raises(ValueError) as refused:
        build(17)
    assert (
        str(refused.value)
        == "LoRA rank 17 is above k_proj's min(in, out) = 16 (its weight is 32 x 16)"
    )
    assert build(32, targets=("q_proj", "o_proj", "down_proj")).lora.rank == 32
    with pytest.raises(
        ValueError, match=r"rank 33 is above q_proj's min\(in, out\) = 32 \(its weight is 32 x 32\)"
    ):
        build(33, targets=("q_proj", "gate_proj"))
    with pytest.raises(
        ValueError,
        match=r"rank 33 is above down_proj's min\(in, out\) = 32 \(its weight is 128 x 32\)",
    ):
        build(33, targets=("down_proj",))


TIED = Path(__file__).resolve().parent / "data" / "hf" / "llama3_tied"

# (dew command line, {tied}: the 64-wide reference folder; the one line on stderr). The example
# decoder is 64 wide with 4 heads and rows of 32 (its context); the folder has 2 kv heads of 16
# and a context of 64.
CLI_REFUSALS = [
    (
        "train --lora-rank 100000",
        "--lora-rank 100000 is above q_proj's min(in, out) = 64 (its weight is 64 x 64)",
    ),
    (
        "train --init-from {tied} --lora-rank 33",
        "--lora-rank 33 is above k_proj's min(in, out) = 32 (its weight is 64 x 32)",
    ),
    (
        "bench --layers 1 --width 48 --heads 4 --lora-rank 49 --lora-targets up_proj,o_proj",
        "--lora-rank 49 is above o_proj's min(in, out) = 48 (its weight is 48 x 48)",
    ),
    (
        "train --lora-rank 8 --lora-targets q_proj,,v_proj",
        "--lora-targets 'q_proj,,v_proj' has an empty entry (two commas together, one at an "
        "end, or no name at all): give the names with one comma between each two",
    ),
    ("train --lora-rank 8 --lora-targets q_proj,", "--lora-targets 'q_proj,' has an empty entry"),
    (
        "train --attention-window 32",
        "--attention-window 32 is not below the context of 32 tokens (--seq-len): every token "
        "would see every earlier one, as without a window; give a window below 32, or leave "
        "--attention-window out",
    ),
    (
        "train --init-from {tied} --attention-window 1000",
        "--attention-window 1000 is not below the context of {tied}, 64 tokens",
    ),
    (
        "train --init-from {tied} --attention-window 0",
        "--attention-window must be an integer >= 1, got 0",
    ),
    (
        "plan --target v5e-1 --model gpt2-small --attention-window 1024",
        "--attention-window 1024 is not below gpt2-small's context of 1024 tokens",
    ),
]


@pytest.mark.parametrize("line, says", CLI_REFUSALS, ids=[line for line, _ in CLI_REFUSALS])
def test_the_cli_refuses_lora_and_window_edges_naming_the_flags(
    line, says, dew_here, tmp_path, monkeypatch
):
    """Each is one line naming the flag as typed and the values, exit 2, before any compile."""
    from dew.targets import COMPILE_ONLY_ENVIRONMENT

    for name, value in COMPILE_ONLY_ENVIRONMENT.items():  # dew plan's, restored after
        monkeypatch.setenv(name, value)
    args = line.format(tied=TIED).split()
    # One step at most where the refusal is missing (planting it back costs seconds, not minutes).
    more = ["--run-dir", str(tmp_path / "run"), "--steps", "1"] if args[0] == "train" else []
    run = dew_here(*args, *more, cwd=tmp_path)
    assert run.returncode == 2, (line, run.stdout, run.stderr)
    (message,) = run.stderr.splitlines()
    assert message.startswith(f"dew {args[0]}: {says.format(tied=TIED)}"), message


def test_the_header_says_a_random_base_and_a_window_that_hides_nothing():
    """``dew train --lora-rank`` without ``--init-from`` trains adapters on drawn weights: its
    first line says so (``dew plan`` and ``dew bench`` have no base to name); a window no
    narrower than the rows is stated."""
    import argparse

    from dew.cli.model_flags import sizes_text

    config = dict(
        vocab_size=256,
        emb_features=64,
        num_layers=2,
        num_heads=4,
        max_seq_len=128,
        lora=dict(rank=8),
    )
    train = argparse.Namespace(model=None, batch=16, seq_len=32, init_from=None)
    plan = argparse.Namespace(model=None, batch=16, seq_len=32)
    assert sizes_text(config, train).endswith(
        "float32 base frozen (a random base: no --init-from); batch 16 x 32 tokens"
    )
    assert sizes_text(config, train, name="base").endswith(
        "float32 base frozen; batch 16 x 32 tokens"
    )
    assert "random" not in sizes_text(config, plan)
    windows = {w: sizes_text({**config, "attention_window": w}, plan) for w in (31, 32)}
    assert "attention xla (window 31);" in windows[31]
    assert (
        "attention xla (window 32, no narrower than the rows of 32 tokens: training runs as "
        "without it);" in windows[32]
    )


def dataclasses_replace(model, **changes):
    import dataclasses

    return dataclasses.replace(model, **changes)


def test_a_lora_steps_model_flops_are_4n_plus_attention_plus_6_adapters():
    """The MFU count of a LoRA step (``dew.training.flops``), by hand for the test model: width
    32, 2 layers, 4 heads of 8, MLP 128, tied vocabulary 64, rows of 16, rank 4 on all seven
    projections."""
    from dew.training.flops import model_flops_per_token

    model = lora_objective().model
    layer = 4 * 32 * 32 + 3 * 32 * 128 + 2 * 32  # q, k, v, o; gate, up, down; two norms
    n = 2 * layer + 32 + 64 * 32  # the layers, the final norm, the tied head
    adapters = 2 * (4 * 4 * (32 + 32) + 2 * 4 * (32 + 128) + 4 * (128 + 32))  # R (in + out)
    attention = 12 * 2 * 4 * 8 * SEQ
    assert model_flops_per_token(model, SEQ) == 4 * n + attention + 6 * adapters


def test_the_plans_state_counts_the_base_and_the_adapters_moments(case):
    """``dew plan``'s state per device (``planning._state_bytes``) of a LoRA run: the frozen base
    (float32 here, split over fsdp) and the adapters with two float32 moments each, whole on
    every device; nothing else of the base's."""
    from dew.planning import _state_bytes

    trainer = dew.Trainer(
        case["objective"],
        optax.adam(1e-3),
        case["key"],
        mesh=dew.MeshSpec(fsdp=8),
        layout=dew.Layout(min_shard=1),
    )
    base = sum(x.size * 4 for x in jax.tree_util.tree_leaves(case["base"]))
    adapters = sum(x.size * 4 for x in jax.tree_util.tree_leaves(case["adapters"]))
    split = sum(
        x.size * 4
        for x, spec in zip(
            jax.tree_util.tree_leaves(case["base"]),
            jax.tree_util.tree_leaves(trainer.frozen_specs, is_leaf=lambda s: isinstance(s, P)),
        )
        if "fsdp" in str(spec)
    )
    # The adam count, the step and the key: a few bytes.
    extra = _state_bytes(trainer) - (base - split + split // 8 + 3 * adapters)
    assert 0 <= extra <= 64, extra
