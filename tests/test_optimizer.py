"""``dew.training.optimizer.adamw``: the schedule against its formula (also across a resume), the
update against a plain NumPy AdamW with clipping and masked decay, the step's ``grad_norm``
against a one-device reference, and each way of making the state smaller: its bytes and dtypes,
the bfloat16 weights' master copies, and the update with the state in host memory equal to the
one on the device."""

import json
import math
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import dew
from dew.cli import optimizer_flags
from dew.cli.main import build_parser
from dew.data import TokenWindows
from dew.training import optimizer as opt
from dew.training import schedule as lr_schedules
from tests.equivalence import host_state
from tests.helpers import (
    SEQ,
    fresh_batch,
    random_token_folder,
    tiny_objective,
)

ROWS = 16


def expected_lr(step, lr, steps, warmup, schedule, lr_min):
    """The learning rate of a run's step ``step`` (1-based), written from the docs' formula."""
    if step <= warmup:
        return lr * step / warmup
    if schedule == "constant":
        return lr
    p = min((step - warmup) / (steps - warmup), 1.0)
    if schedule == "linear":
        return lr - (lr - lr_min) * p
    return lr_min + (lr - lr_min) * 0.5 * (1 + math.cos(math.pi * p))


@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear"])
@pytest.mark.parametrize("warmup", [0, 3])
def test_the_schedule_is_its_formula_at_every_step(schedule, warmup):
    lr_min = 0.0 if schedule == "constant" else 3e-5
    lr_at = lr_schedules.schedule(
        3e-4, steps=10, warmup_steps=warmup, lr_schedule=schedule, lr_min=lr_min
    )
    got = [float(lr_at(count)) for count in range(12)]  # two counts past the end
    want = [expected_lr(s, 3e-4, 10, warmup, schedule, lr_min) for s in range(1, 13)]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    if schedule != "constant":
        assert got[9] == pytest.approx(lr_min, rel=1e-6), "a decay reaches lr_min at steps"


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(lr_min=1e-2, lr_schedule="cosine", steps=10), "lr_min 0.01 is above the learning"),
        (dict(warmup_steps=11, steps=10), "warmup_steps 11 is above steps 10"),
        (dict(warmup_steps=-1), "warmup_steps must be an integer >= 0, got -1"),
        (dict(lr_schedule="cosine"), "decays to lr_min at steps: give steps"),
        (dict(lr_schedule="step"), "unknown lr_schedule 'step'"),
        (dict(lr_min=-1.0, lr_schedule="linear", steps=5), "lr_min must be a number >= 0"),
        (dict(clip_norm=-1.0), "clip_norm must be a number above 0"),
        (dict(weight_decay=-0.1), "weight_decay must be a number >= 0, got -0.1"),
        (dict(moments_dtype="int8"), "unknown moments_dtype 'int8'"),
        (dict(b2=1.0), "b2 must be in [0, 1), got 1.0"),
        (dict(rounding="up"), "unknown rounding 'up'; expected one of stochastic, nearest"),
        (dict(rounding_seed=-1), "rounding_seed must be in [0, 2**32), got -1"),
    ],
)
def test_settings_that_make_no_sense_are_refused_naming_the_values(settings, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        opt.adamw(1e-3, **settings)


def test_the_cli_refuses_bad_optimizer_flags_and_its_choices_are_the_modules():
    parse = build_parser().parse_args
    # Refused by the flags' names (dew.training.schedule.check_schedule's names=), the values as
    # given; a negative number is a value, not a flag (--lr -1e-3).
    for flags, message in [
        ("--lr-schedule cosine --lr-min 0.5", "--lr-min 0.5 is above --lr 0.001"),
        ("--lr-min 0.0001", "--lr-min 0.0001 is the end of a decay; --lr-schedule 'constant' has"),
        ("--warmup-steps 30", "--warmup-steps 30 is above --steps 20"),
        ("--lr -1e-3", "--lr must be a number above 0, got -0.001"),
        ("--lr-schedule cosine --lr-min -1e-5", "--lr-min must be a number >= 0, got -1e-05"),
        ("--clip-norm -1", "--clip-norm must be >= 0"),
        ("--weight-decay -0.1", "--weight-decay must be >= 0, got -0.1"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            optimizer_flags.optimizer_from(parse(["train", *flags.split()]))
    assert optimizer_flags.SCHEDULES == lr_schedules.SCHEDULES
    assert optimizer_flags.MOMENTS_DTYPES == opt.MOMENTS_DTYPES
    assert optimizer_flags.MASTER_WEIGHTS == opt.MASTER_WEIGHTS
    assert (optimizer_flags.CLIP_NORM, optimizer_flags.WEIGHT_DECAY) == (
        opt.CLIP_NORM,
        opt.WEIGHT_DECAY,
    )


# --- the update against plain formulas ------------------------------------------------------------


def tiny_tree(seed, dtype=jnp.float32):
    """A matrix, a norm's scale, a stacked norm scale, a stacked bias (two dimensions: spared
    from the decay by its name alone) and an embedding table."""
    rng = np.random.default_rng(seed)
    return {
        "params": {
            "w": jnp.asarray(0.02 * rng.standard_normal((8, 16)), dtype),
            "final_norm": {"scale": jnp.ones((16,), dtype)},
            "layers": {
                "attn_norm": {"scale": jnp.ones((2, 16), dtype)},
                "mlp": {"bias": jnp.asarray(0.02 * rng.standard_normal((2, 16)), dtype)},
            },
            "embed_tokens": {"embedding": jnp.asarray(rng.standard_normal((32, 16)), dtype)},
        }
    }


def numpy_adamw(params, grads_per_step, lr_of, clip, wd, decayed, b1=0.9, b2=0.95, eps=1e-8):
    """AdamW in float64 NumPy, one weight at a time: the global norm over every weight, the
    gradient scaled to ``clip`` when the norm is above it, Adam's bias-corrected moments, and
    ``w -= lr (u + wd w)`` for the weights named in ``decayed``."""
    w = {k: np.asarray(v, np.float64) for k, v in params.items()}
    mu = {k: np.zeros_like(v) for k, v in w.items()}
    nu = {k: np.zeros_like(v) for k, v in w.items()}
    norms = []
    for t, grads in enumerate(grads_per_step, start=1):
        g = {k: np.asarray(v, np.float64) for k, v in grads.items()}
        norm = math.sqrt(sum(float(np.sum(x * x)) for x in g.values()))
        norms.append(norm)
        if norm >= clip:
            g = {k: x * clip / norm for k, x in g.items()}
        for k in w:
            mu[k] = b1 * mu[k] + (1 - b1) * g[k]
            nu[k] = b2 * nu[k] + (1 - b2) * g[k] ** 2
            u = (mu[k] / (1 - b1**t)) / (np.sqrt(nu[k] / (1 - b2**t)) + eps)
            if k in decayed:
                u = u + wd * w[k]
            w[k] = w[k] - lr_of(t) * u
    return w, norms


def flat(tree):
    return {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(tree)}


def test_the_decay_spares_norms_and_the_embedding_on_the_models_tree():
    params = jax.eval_shape(tiny_objective(tie_embeddings=False).model.init, jax.random.key(0))
    decayed = {k for k, v in flat(opt.decay_mask(params)).items() if v}
    assert decayed == {
        f"['params']['layers']['{w}']" for w in ("attn']['q", "attn']['k", "attn']['v")
    } | {
        "['params']['layers']['attn']['o']",
        "['params']['layers']['mlp']['down']",
        "['params']['layers']['mlp']['gate']",
        "['params']['layers']['mlp']['up']",
        "['params']['lm_head']['kernel']",
    }


def test_clipping_and_weight_decay_equal_a_plain_formula(seed):
    params = tiny_tree(seed)
    rng = np.random.default_rng(seed + 1)
    # Norms above the clip (scale 3) and below it (scale 0.01): both branches of the clip.
    grads = [
        jax.tree_util.tree_map(lambda p: jnp.asarray(s * rng.standard_normal(p.shape)), params)
        for s in (3.0, 0.01, 3.0)
    ]
    optimizer = opt.adamw(1e-2, steps=3, warmup_steps=1, lr_schedule="linear", lr_min=1e-3)
    state, p = optimizer.init(params), params
    update = jax.jit(optimizer.update)  # one compiled program, not op by op
    for g in grads:
        updates, state = update(g, state, p)
        p = optax.apply_updates(p, updates)
    decayed = {k for k, v in flat(opt.decay_mask(params)).items() if v}
    assert decayed == {"['params']['w']"}
    want, norms = numpy_adamw(
        flat(params),
        [flat(g) for g in grads],
        lambda t: expected_lr(t, 1e-2, 3, 1, "linear", 1e-3),
        clip=1.0,
        wd=0.1,
        decayed=decayed,
    )
    assert norms[0] > 1.0 > norms[1], f"seed {seed}: one step clips, one does not ({norms})"
    for name, value in flat(p).items():
        np.testing.assert_allclose(value, want[name], rtol=1e-5, atol=1e-7, err_msg=name)
    # And the same as optax's own pieces chained.
    reference = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(
            optimizer.schedule, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, mask=opt.decay_mask
        ),
    )
    rstate, q = reference.init(params), params
    reference_update = jax.jit(reference.update)
    for g in grads:
        updates, rstate = reference_update(g, rstate, q)
        q = optax.apply_updates(q, updates)
    for name, value in flat(p).items():
        np.testing.assert_allclose(value, flat(q)[name], rtol=1e-6, atol=1e-8, err_msg=name)


def reference_stochastic_round(x, bits):
    """float32 ``x`` to bfloat16 from the definition: ``lo <= |x| < hi`` its two bfloat16
    neighbours in magnitude, ``|x|``'s fraction of the way between them ``f = (|x| - lo) / (hi -
    lo)``, and ``r`` the low 16 of ``bits`` over 2**16 (uniform in [0, 1)): ``hi`` where ``r >=
    1 - f`` (probability ``f``), else ``lo``, with ``x``'s sign. For finite normal ``x``."""
    x = np.asarray(x, np.float32)
    magnitude = np.abs(x)
    lo = magnitude.astype(ml_dtypes.bfloat16)  # to nearest; below |x| or above it
    lo = np.where(lo.astype(np.float32) > magnitude, np.nextafter(lo, np.zeros_like(lo)), lo)
    hi = np.nextafter(lo, np.full_like(lo, np.inf))
    lo64, hi64 = lo.astype(np.float64), hi.astype(np.float64)
    fraction = (magnitude.astype(np.float64) - lo64) / (hi64 - lo64)
    r = (np.asarray(bits, np.uint32) & 0xFFFF).astype(np.float64) / 2**16
    rounded = np.where(r >= 1.0 - fraction, hi, lo)
    return np.where(x < 0, -rounded, rounded).astype(ml_dtypes.bfloat16)


def spec_rounding_bits(seed, count, index, shape) -> np.ndarray:
    """The stochastic rounding's bits as ``rounding_bits``' docstring specifies them, written from
    that statement and not by calling it: threefry bits (``jax.random``'s default key) of the key
    ``seed`` folded with the update's ``count`` (0 for the first), then with the weight's
    ``index`` among the tree's leaves, drawn at the weight's global ``shape``."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), count), index)
    return np.asarray(jax.random.bits(key, shape, jnp.uint32))


def leaf_index(params, name):
    """The position of the weight ``name`` (a ``flat`` key) among the tree's leaves."""
    return list(flat(params)).index(name)


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_bfloat16_weights_keep_a_float32_master_of_their_vectors(rounding, seed):
    """With bfloat16 weights, a norm's scale follows its float32 master (equal to float32 AdamW
    on float32 weights, whose updates of 1e-4 bfloat16 could not hold at 1.0), and a matrix takes
    each update rounded once to bfloat16: stochastically, with the bits of ``rounding_bits`` for
    its count and place in the tree (``reference_stochastic_round``), or to nearest."""
    params = tiny_tree(seed, jnp.bfloat16)
    rng = np.random.default_rng(seed + 1)
    grads = [
        jax.tree_util.tree_map(lambda p: jnp.asarray(rng.standard_normal(p.shape)), params)
        for _ in range(3)
    ]
    optimizer = opt.adamw(1e-4, clip_norm=None, rounding=rounding, rounding_seed=seed)
    state, p = optimizer.init(params), params
    masters = {k for k, v in flat(state.master).items() if v is not None}
    assert masters == {
        "['params']['final_norm']['scale']",
        "['params']['layers']['attn_norm']['scale']",
        "['params']['layers']['mlp']['bias']",
    }
    float32 = opt.adamw(1e-4, clip_norm=None)
    p32 = jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), params)
    s32 = float32.init(p32)
    index = leaf_index(params, "['params']['w']")
    for count, g in enumerate(grads):
        before = p
        updates, state = optimizer.update(g, state, p)
        p = optax.apply_updates(p, updates)
        u32, s32 = float32.update(g, s32, p32)
        # The matrix: its bfloat16 weight plus the update (from that weight), rounded once.
        x = before["params"]["w"].astype(jnp.float32) + u32["params"]["w"]
        if rounding == "stochastic":
            bits = spec_rounding_bits(seed, count, index, x.shape)
            want_w = reference_stochastic_round(x, bits)
        else:
            want_w = x.astype(jnp.bfloat16)
        p32 = optax.apply_updates(p32, u32)
        np.testing.assert_array_equal(p["params"]["w"], want_w, err_msg=f"seed {seed}")
        p32["params"]["w"] = p["params"]["w"].astype(jnp.float32)  # the same weight next step
    for name in masters:
        master, reference = flat(state.master)[name], flat(p32)[name]
        # The same float32 arithmetic as float32 AdamW's: equal (measured), held to an ulp.
        np.testing.assert_allclose(master, reference, rtol=MASTER_RTOL, atol=0, err_msg=name)
        np.testing.assert_array_equal(flat(p)[name], master.astype(jnp.bfloat16))
        if name.endswith("['scale']"):
            moved = float(jnp.max(jnp.abs(master - 1.0)))
            assert 1e-4 < moved < 2**-9, f"{name}: updates below bfloat16's spacing ({moved})"
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(p))


# A float32 master and float32 AdamW on float32 weights do the same float32 arithmetic: equal in
# every seed measured (0 difference); one ulp of float32 is below 1.2e-7 relative.
MASTER_RTOL = 1.2e-7


def test_master_weights_all_follow_float32_adamw_decay_included(seed):
    """``master_weights="all"``: every bfloat16 weight's float32 master takes float32 AdamW's
    update of float32 weights, the decay computed from the master (not from the bfloat16 weight,
    which lags it by up to 2**-9 of itself: 1e-5 to 2e-4 relative after 4 steps here), and the
    weight is its master rounded to nearest."""
    print(f"seed {seed}")
    params = tiny_tree(seed, jnp.bfloat16)
    rng = np.random.default_rng(seed + 1)
    grads = [
        jax.tree_util.tree_map(lambda p: jnp.asarray(rng.standard_normal(p.shape)), params)
        for _ in range(4)
    ]
    optimizer = opt.adamw(1e-2, master_weights="all", rounding_seed=seed)
    float32 = opt.adamw(1e-2)
    state, p = optimizer.init(params), params
    p32 = jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), params)
    s32 = float32.init(p32)
    assert all(m is not None for m in flat(state.master).values())
    for g in grads:
        updates, state = optimizer.update(g, state, p)
        p = optax.apply_updates(p, updates)
        u32, s32 = float32.update(g, s32, p32)
        p32 = optax.apply_updates(p32, u32)
    for name, master in flat(state.master).items():
        np.testing.assert_allclose(
            master, flat(p32)[name], rtol=MASTER_RTOL, atol=0, err_msg=f"{name}, seed {seed}"
        )
        np.testing.assert_array_equal(flat(p)[name], master.astype(jnp.bfloat16), err_msg=name)
    # Not vacuous: the decayed matrix's master is not its bfloat16 weight.
    w = flat(state.master)["['params']['w']"]
    assert float(jnp.max(jnp.abs(w - flat(p)["['params']['w']"].astype(jnp.float32)))) > 0


# --- stochastic rounding of bfloat16 weights ------------------------------------------------------


def test_stochastic_rounding_is_unbiased(seed):
    """2**16 roundings of each of 8 float32 values between two bfloat16 neighbours (both signs,
    from 1e-5 to 300): each lands on one of the two, and their mean is the value within 5
    standard deviations of the mean (a Bernoulli(f) step of the neighbours' spacing: a rounding
    to nearest misses by 0.05 spacings or more, 5 deviations are at most 0.01)."""
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    draws = 2**16
    lo = np.array([1.0, 0.02, -3e-5, 300.0, -1.5, 7e-3, -0.4, 1e-5], ml_dtypes.bfloat16)
    hi = np.nextafter(lo, np.where(lo < 0, -np.inf, np.inf).astype(ml_dtypes.bfloat16))
    spacing = np.abs(hi.astype(np.float64) - lo.astype(np.float64))
    fraction = rng.uniform(0.05, 0.95, lo.shape)  # of the way from lo to hi
    x = (lo.astype(np.float64) + np.sign(lo.astype(np.float64)) * fraction * spacing).astype(
        np.float32
    )
    fraction = np.abs(x.astype(np.float64) - lo.astype(np.float64)) / spacing  # as float32 holds
    bits = jax.random.bits(jax.random.key(seed), (draws, x.size), jnp.uint32)
    rounded = np.asarray(
        jax.jit(opt.stochastic_round)(jnp.broadcast_to(jnp.asarray(x), bits.shape), bits),
        np.float64,
    )
    assert np.all((rounded == lo.astype(np.float64)) | (rounded == hi.astype(np.float64)))
    bound = 5 * np.sqrt(fraction * (1 - fraction) / draws) * spacing
    error = np.abs(rounded.mean(axis=0) - x.astype(np.float64))
    assert np.all(error <= bound), f"seed {seed}: errors {error / spacing} spacings"


def test_stochastic_rounding_keeps_what_bfloat16_holds():
    """A value bfloat16 holds (zeros of both signs, the largest finite, subnormals), infinities
    and NaN come back as themselves whatever the bits, all 2**16 low halves of them; so do
    float32 NaNs whose payload lies in the low half alone (truncated, an infinity) or fills it
    (carried, a zero)."""
    values = np.array(
        [0.0, -0.0, 1.0, -2.5, 3.3895e38, -3.3895e38, 1e-40, np.inf, -np.inf, np.nan],
        np.float32,
    ).astype(ml_dtypes.bfloat16)
    bits = jnp.arange(2**16, dtype=jnp.uint32)[:, None] * jnp.uint32(0x10001)
    x = jnp.broadcast_to(jnp.asarray(values.astype(np.float32)), (2**16, values.size))
    rounded = np.asarray(jax.jit(opt.stochastic_round)(x, bits))
    want = np.broadcast_to(values, rounded.shape)
    assert np.array_equal(rounded.view(np.uint16), want.view(np.uint16))  # -0.0, NaN included
    nans = np.array([0x7F800001, 0x7FFFFFFF, 0xFFFFFFFF, 0xFF80FFFF], np.uint32).view(np.float32)
    x = jnp.broadcast_to(jnp.asarray(nans), (2**16, nans.size))
    rounded = np.asarray(jax.jit(opt.stochastic_round)(x, bits[:, :1]), np.float32)
    assert np.isnan(rounded).all()


def test_the_applied_weight_is_the_stochastically_rounded_value_bit_for_bit(seed):
    """bfloat16 weights from 2**-20 to 2**10 take one update of about 1 (lr 1, Adam's first
    step): weights that grow by 2**20, cross zero, or nearly cancel. ``optax.apply_updates`` of
    the update lands exactly on ``reference_stochastic_round`` of the float32 ``w + u`` wherever
    the new weight is at least 2**-16 of the old in magnitude; below that (float32 cannot hold
    the difference) within 2**-24 of the old weight."""
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    scales = np.exp2(rng.integers(-20, 11, (64, 64)))
    w = jnp.asarray(scales * rng.standard_normal((64, 64)), jnp.bfloat16)
    g = jnp.asarray(rng.standard_normal((64, 64)), jnp.float32)
    params, grads = {"w": w}, {"w": g}
    optimizer = opt.adamw(1.0, clip_norm=None, weight_decay=0.0, rounding_seed=seed)
    updates, _ = jax.jit(optimizer.update)(grads, optimizer.init(params), params)
    landed = np.asarray(jax.jit(optax.apply_updates)(params, updates)["w"], np.float64)
    float32 = opt.adamw(1.0, clip_norm=None, weight_decay=0.0)
    p32 = {"w": w.astype(jnp.float32)}
    u32, _ = float32.update(grads, float32.init(p32), p32)
    x = p32["w"] + u32["w"]
    want = reference_stochastic_round(x, spec_rounding_bits(seed, 0, 0, x.shape))
    want = want.astype(np.float64)
    old = np.abs(np.asarray(w, np.float64))
    held = np.abs(want) >= 2.0**-16 * old
    assert held.mean() > 0.99 and np.ptp(np.log2(old)) >= 25, "the cases the docstring names"
    assert np.sum(np.abs(want) > 2**10 * old) > 100 and np.sum(want * old < 0) > 100
    np.testing.assert_array_equal(landed[held], want[held], err_msg=f"seed {seed}")
    assert np.all(np.abs(landed - want)[~held] <= 2.0**-24 * old[~held]), f"seed {seed}"


def test_small_updates_add_up_under_stochastic_rounding_and_vanish_to_nearest(seed):
    """A matrix of entries at 1.0 (bfloat16's spacing 2**-7 above, 2**-8 below) and 40 updates
    of lr = 1e-3 each (a constant gradient: Adam's step is lr): rounded to nearest, no entry ever
    moves; rounded stochastically, their mean falls by the 40 updates' 0.04, within 6 standard
    deviations (each rounding adds at most a quarter spacing squared of variance).

    And each update draws new bits: below 1.0 every step is ``lr`` of the spacing ``2**-8``
    (``f = 0.256``), taken down with probability ``f``, so an entry's count of steps down is
    Binomial(40, f), of standard deviation 2.76 steps across the entries. Bits that did not
    change with the count would take an entry down every step or never (17.5 steps)."""
    print(f"seed {seed}")
    params = {"w": jnp.ones((64, 64), jnp.bfloat16)}
    grads = {"w": jnp.ones((64, 64), jnp.float32)}
    lr, steps = 1e-3, 40
    finals = {}
    for rounding in ("stochastic", "nearest"):
        optimizer = opt.adamw(
            lr, clip_norm=None, weight_decay=0.0, rounding=rounding, rounding_seed=seed
        )

        @jax.jit
        def run(params):
            def body(carry, _):
                p, state = carry
                updates, state = optimizer.update(grads, state, p)
                return (optax.apply_updates(p, updates), state), None

            (p, _), _ = jax.lax.scan(body, (params, optimizer.init(params)), length=steps)
            return p

        finals[rounding] = np.asarray(run(params)["w"], np.float64)
    means = {rounding: float(final.mean()) for rounding, final in finals.items()}
    assert means["nearest"] == 1.0
    sigma = math.sqrt(steps * (2**-7) ** 2 / 4 / 64**2)
    assert abs(means["stochastic"] - (1.0 - steps * lr)) < 6 * sigma, (seed, means)
    down = (1.0 - finals["stochastic"]) / 2**-8  # each entry's steps down
    assert np.array_equal(down, np.round(down)), "every entry on the grid below 1.0"
    f = lr / 2**-8
    binomial = math.sqrt(steps * f * (1 - f))
    # 4096 entries: the spread's estimate is within 1.1% of its value (a standard deviation).
    assert abs(down.std() / binomial - 1) < 0.1, (seed, down.std(), binomial)


def test_stochastic_rounding_is_the_same_on_fsdp8_as_on_one_device(seed):
    """Three updates of the model's bfloat16 weights, on the Trainer's fsdp=8 layout and on one
    device, from the same weights and gradients: the same weights bit for bit (the rounding's bits
    are drawn at each weight's global shape). Without clipping, the rest of the update is
    elementwise and the same in both; a Trainer's own steps differ already in their gradients,
    summed in bfloat16 in another order."""
    print(f"seed {seed}")
    t = trainer(dew.MeshSpec(fsdp=8), opt.adamw(), param_dtype="bfloat16")
    optimizer = opt.adamw(1e-2, clip_norm=None, rounding_seed=seed)
    # On the host, weights and gradients: placed from there, where one device's arrays would each
    # be cut by a program of their own (jax's _multi_slice, per shape).
    params = jax.device_get(jax.jit(t.objective.model.init)(jax.random.key(seed)))
    rng = np.random.default_rng(seed)
    grads = [
        jax.tree_util.tree_map(
            lambda p: rng.standard_normal(p.shape).astype(ml_dtypes.bfloat16), params
        )
        for _ in range(3)
    ]
    one = jax.devices()[0]
    split = t.state_shardings.params

    def update(p, state, g):
        updates, state = optimizer.update(g, state, p)
        return optax.apply_updates(p, updates), state

    runs = []
    for place in (lambda tree: jax.device_put(tree, one), lambda tree: jax.device_put(tree, split)):
        p = place(params)
        state = jax.jit(optimizer.init)(p)  # one program, not op by op
        # The weights and state leave each update laid out as they came: one compile of it for
        # each placement, where the partitioner's own layout of the state would compile it again.
        layout = jax.tree_util.tree_map(lambda x: x.sharding, (p, state))
        step = jax.jit(update, out_shardings=layout)
        for g in grads:
            p, state = step(p, state, place(g))
        runs.append(p)
    sharded = [x.sharding for x in jax.tree_util.tree_leaves(runs[1])]
    assert any(not s.is_fully_replicated for s in sharded), "some weight split over fsdp"
    changed = 0
    for a, b, start in zip(*map(jax.tree_util.tree_leaves, (*runs, params)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"seed {seed}")
        changed += int(np.sum(np.asarray(a) != np.asarray(start)))
    assert changed > 1000


# --- the step: grad_norm, lr, and the state's choices ------------------------------------------


def trainer(mesh, optimizer, checkpoints=None, **model):
    return dew.Trainer(
        tiny_objective(**model),
        optimizer,
        jax.random.key(3),
        mesh=mesh,
        layout=dew.Layout(min_shard=1),
        checkpoints=checkpoints,
    )


@pytest.fixture(scope="module")
def one_device_norm(module_seed):
    """A batch, the initial weights of ``trainer``'s model (key 3) on one device, on the host, and
    the norm of their gradients there (float64 on the host), shared by the layouts."""
    objective = tiny_objective()
    batch = fresh_batch(ROWS, module_seed)
    one = jax.devices()[0]
    params = jax.jit(objective.model.init)(jax.device_put(jax.random.key(3), one))
    grads = jax.jit(jax.grad(objective.loss))(params, jax.device_put(batch, one))
    squares = [
        np.sum(np.square(np.asarray(g, np.float64))) for g in jax.tree_util.tree_leaves(grads)
    ]
    return batch, jax.device_get(params), math.sqrt(sum(squares))


@pytest.mark.parametrize(
    "mesh", [dew.MeshSpec(fsdp=8), dew.MeshSpec(data=2, tensor=4)], ids=["fsdp8", "data2_tensor4"]
)
def test_grad_norm_is_the_one_device_gradients_norm(one_device_norm, mesh, seed):
    optimizer = opt.adamw(1e-3, steps=4, warmup_steps=2, lr_schedule="cosine", lr_min=1e-4)
    t = trainer(mesh, optimizer)
    batch, params, want = one_device_norm
    # The trainer's initial state from the one-device weights (the same as its own initialisation
    # makes: tests/test_equivalence.py), on the host: the step is the one program compiled.
    state = host_state(t, params, jax.device_get(jax.jit(t.optimizer.init)(params)))
    _, metrics = t.train_step(ROWS)(state, t.device_batch(batch, ROWS))
    assert float(metrics["grad_norm"]) == pytest.approx(want, rel=1e-5), f"seed {seed}"
    assert want > 1.0, "above the clip: the metric is the norm before clipping"
    assert float(metrics["lr"]) == pytest.approx(5e-4, rel=1e-6)  # step 1 of a 2-step warmup


def test_the_schedule_continues_exactly_across_a_resume(tmp_path, seed):
    """Steps 1-3, saved; a new Trainer resumes to step 7: every step's lr (in the metrics file)
    is the formula's, and the weights equal an uninterrupted run's. The resumed run keeps its
    state in host memory (saved from there and restored to there), the other on the device."""
    folder = random_token_folder(tmp_path / "tokens", seed, 3000, 300)
    data = TokenWindows(folder, seq_len=SEQ).load(batch=ROWS)
    settings = dict(steps=7, warmup_steps=2, lr_schedule="cosine", lr_min=3e-5)
    metrics = tmp_path / "metrics.jsonl"
    for steps in (3, 7):
        checkpoints = dew.Checkpoints(tmp_path / "run")
        t = trainer(dew.MeshSpec(fsdp=8), opt.adamw(3e-4, offload=True, **settings), checkpoints)
        resumed = t.fit(data, steps=steps, log_every=100, metrics=metrics)
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, 8))
    want = [expected_lr(s, 3e-4, 7, 2, "cosine", 3e-5) for s in range(1, 8)]
    np.testing.assert_allclose([line["lr"] for line in lines], want, rtol=1e-6)
    assert int(resumed.opt_state.count) == 7
    whole = trainer(dew.MeshSpec(fsdp=8), opt.adamw(3e-4, **settings))
    state, step = whole.init_state(), whole.train_step(ROWS)
    with data.batches(start=0) as batches:
        for _ in range(7):
            state, _ = step(state, whole.device_batch(next(batches)[1], ROWS))
    for a, b in zip(
        jax.tree_util.tree_leaves(resumed.params), jax.tree_util.tree_leaves(state.params)
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, err_msg=f"seed {seed}")


def state_of(t):
    return t._abstract_state.opt_state, t.state_shardings.opt_state


def test_each_choice_has_the_bytes_and_dtypes_it_says():
    mesh = dew.MeshSpec(fsdp=8)
    weights = sum(
        math.prod(x.shape)
        for x in jax.tree_util.tree_leaves(
            jax.eval_shape(tiny_objective().model.init, jax.random.key(0))
        )
    )
    vectors = 32 * (1 + 2 + 2)  # the final norm's scale, and two norms' in each of 2 layers
    plain, _ = state_of(trainer(mesh, opt.adamw()))
    assert opt.state_bytes(plain) == {"moments": 8 * weights, "master": 0, "count": 4}
    small, _ = state_of(trainer(mesh, opt.adamw(moments_dtype="bfloat16")))
    assert opt.state_bytes(small) == {"moments": 4 * weights, "master": 0, "count": 4}
    assert {x.dtype for x in jax.tree_util.tree_leaves((small.mu, small.nu))} == {
        np.dtype(ml_dtypes.bfloat16)
    }
    half, _ = state_of(trainer(mesh, opt.adamw(), param_dtype="bfloat16"))
    assert opt.state_bytes(half) == {"moments": 8 * weights, "master": 4 * vectors, "count": 4}
    assert {x.dtype for x in jax.tree_util.tree_leaves(half.master)} == {np.dtype(np.float32)}
    every, _ = state_of(trainer(mesh, opt.adamw(master_weights="all"), param_dtype="bfloat16"))
    assert opt.state_bytes(every)["master"] == 4 * weights
    host, shardings = state_of(trainer(mesh, opt.adamw(offload=True), param_dtype="bfloat16"))
    assert opt.state_bytes(host) == opt.state_bytes(half)
    kinds = {s.memory_kind for s in jax.tree_util.tree_leaves((shardings.mu, shardings.nu))}
    assert kinds == {"pinned_host"}
    assert {s.memory_kind for s in jax.tree_util.tree_leaves(shardings.master)} == {"pinned_host"}
    assert shardings.count.memory_kind != "pinned_host"


def test_the_update_with_the_state_in_host_memory_equals_the_one_on_the_device(seed):
    """bfloat16 weights and moments (master copies too) on fsdp=8, three steps: the state in
    host memory gives the same weights and state, bit for bit, and stays in host memory."""
    choice = dict(moments_dtype="bfloat16", steps=3, warmup_steps=1, lr_schedule="cosine")
    runs, initial = [], None
    for offload in (False, True):
        t = trainer(
            dew.MeshSpec(fsdp=8), opt.adamw(1e-2, offload=offload, **choice), param_dtype="bfloat16"
        )
        if initial is None:
            # One initial state for both, on the host (its key as data, which device_get takes):
            # the same values either way (the placement is the trainer's), one program fewer.
            state = t.init_state()
            initial = jax.device_get(state.replace(key=jax.random.key_data(state.key)))
        key = jax.random.wrap_key_data(initial.key, impl=jax.random.key_impl(t.key))
        state = jax.device_put(initial.replace(key=key), t.state_shardings)
        step = t.train_step(ROWS)
        for i in range(3):
            state, _ = step(state, t.device_batch(fresh_batch(ROWS, (seed, i)), ROWS))
        runs.append(state)
    on_device, on_host = runs
    kinds = {x.sharding.memory_kind for x in jax.tree_util.tree_leaves(on_host.opt_state.mu)}
    assert kinds == {"pinned_host"}
    for a, b in zip(
        jax.tree_util.tree_leaves((on_device.params, on_device.opt_state)),
        jax.tree_util.tree_leaves((on_host.params, on_host.opt_state)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"seed {seed}")


def test_dew_train_writes_the_schedules_lr_and_the_grad_norm(tmp_path, dew_here):
    """The issue's command, at toy size: every step's lr is the formula's. (Run by ``main`` in this
    process, as tests/test_cli.py runs ``dew train``: a child process would import JAX again.)"""
    args = "--warmup-steps 2 --lr-schedule cosine --lr 3e-4 --lr-min 3e-5 --clip-norm 1.0"
    out = dew_here(
        *("train", "--mesh", "fsdp=8", "--steps", "5", "--log-every", "5"),
        *(args + " --weight-decay 0.1 --layers 1 --width 32 --heads 2").split(),
        *("--metrics", str(tmp_path / "m.jsonl"), "--run-dir", str(tmp_path / "run")),
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    want = [expected_lr(s, 3e-4, 5, 2, "cosine", 3e-5) for s in range(1, 6)]
    np.testing.assert_allclose([line["lr"] for line in lines], want, rtol=1e-6)
    assert all(line["grad_norm"] > 0 for line in lines)
    assert f"grad norm {lines[-1]['grad_norm']:.4g}, lr {want[-1]:.4g}" in out.stdout
