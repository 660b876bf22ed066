"""int8 matmuls in training (``dew.nn.quantized``, ``StepOptions(quantize="int8")``).

The reference is the formula in numpy: quantize (float32, as the module docstring writes it),
multiply the integers in int64, dequantize. The stochastic rounding's uniform draws are an input
of the formula, taken from the keys the docstring names."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dew
from dew.nn import quantized
from dew.nn.int8 import Quantized, quantize
from dew.nn.param import spec_labels
from tests.equivalence import host_state, recording
from tests.helpers import (
    fresh_batch,
    parse_log_line,
    relative_error,
    seeded_key,
    tiny_objective,
)

RECIPROCAL = np.float32(1.0 / 127)


def ref_quantize(v, summed, u=None):
    """``(q int64, scale float32 with the summed axes kept)``: nearest, or ``floor(v / s + u)``."""
    v = np.asarray(v, np.float32)
    peak = np.max(np.abs(v), axis=summed, keepdims=True)
    scale = np.where(peak > 0, peak * RECIPROCAL, np.float32(1)).astype(np.float32)
    q = np.round(v / scale) if u is None else np.floor(v / scale + np.asarray(u, np.float32))
    return np.clip(q, -127, 127).astype(np.int64), scale


def ref_forward(x, w):
    """``te,ef->tf``: per-token ``x`` (over e), per-output-channel ``w`` (over e)."""
    qx, sx = ref_quantize(x, 1)
    qw, sw = ref_quantize(w, 0)
    acc = (qx @ qw).astype(np.float32)
    return acc * sx * sw, (qx, sx, qw, sw)


def ref_gradients(x, w, d_out, key):
    """``(dx, dw)`` of ``te,ef->tf`` from the formula, the uniform draws from ``key`` as
    ``int8_einsum`` says."""
    _, (qx, sx, qw, sw) = ref_forward(x, w)
    d_out = np.asarray(d_out, np.float32)
    dx_key, dw_key = jax.random.split(key)
    g = d_out * sw
    qg, sg = ref_quantize(g, 1, jax.random.uniform(dx_key, g.shape))
    dx = (qg @ qw.T).astype(np.float32) * sg
    h = d_out * sx
    qh, sh = ref_quantize(h, 0, jax.random.uniform(dw_key, h.shape))
    dw = (qx.T @ qh).astype(np.float32) * sh
    return dx, dw


def draw(seed, tokens=24, features=40, out=12):
    """``x`` ``[tokens, features]`` with per-row magnitudes apart by 100x, ``w`` with per-column
    ones apart by 30x (a scale on the wrong axis then loses most rows' or columns' bits), a
    cotangent ``d_out``."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, features)) * np.exp(rng.uniform(-2.3, 2.3, (tokens, 1)))
    w = rng.standard_normal((features, out)) * np.exp(rng.uniform(-1.7, 1.7, (1, out)))
    d_out = rng.standard_normal((tokens, out)) * np.exp(rng.uniform(-2, 2, (tokens, 1)))
    return x.astype(np.float32), w.astype(np.float32), d_out.astype(np.float32)


def edge_halves(seed):
    """The half steps of ``edge_rows``' third row (those exact in float32 at its scale)."""
    scale = np.float32(2.5) * RECIPROCAL
    halves = np.array([126.5, -126.5, 0.5, -0.5, 1.5, 2.5, -3.5, 64.5], np.float32)
    return halves[(halves * scale) / scale == halves]


def edge_rows(x, seed):
    """``x`` with a row of zeros, a row of one large outlier, a row at exact half steps (ties:
    half to even), and a row whose peak lands just above 127 steps (``peak * float32(1 / 127)``
    below ``peak / 127``), where stochastic rounding reaches 128 unless clipped."""
    rng = np.random.default_rng(seed)
    x = x.copy()
    x[0] = 0.0
    x[1] = rng.standard_normal(x.shape[1]) * 0.01
    x[1, 3] = 5000.0
    peak = np.float32(2.5)
    scale = peak * RECIPROCAL
    exact = edge_halves(seed)
    assert len(exact) >= 4, exact
    x[2] = 0.0
    x[2, 0] = peak
    x[2, 1 : 1 + len(exact)] = exact * scale
    values = np.linspace(0.01, 3.0, 1000, dtype=np.float32)
    above = values[values / (values * RECIPROCAL) > 127][0]
    x[3] = rng.uniform(-1, 1, x.shape[1]) * above * 0.5
    x[3, 5] = -above
    return x


def test_the_forward_is_the_formula_exactly_in_the_integers(seed):
    """``int8_einsum("te,ef->tf")`` against quantize / int64 matmul / dequantize, edge rows
    included: the same integers and scales, so the same float32 product."""
    print(f"seed {seed}")
    x, w, _ = draw(seed)
    x = edge_rows(x, seed)
    qx, sx = ref_quantize(x, 1)
    assert np.all(qx[0] == 0) and sx[0, 0] == 1.0, "a row of zeros: scale 1, q 0"
    assert qx[1, 3] == 127 and np.sum(np.abs(qx[1])) == 127, "the outlier takes the row's bits"
    out = np.asarray(quantized.int8_einsum("te,ef->tf", jnp.asarray(x), jnp.asarray(w)))
    expected, _ = ref_forward(x, w)
    np.testing.assert_array_equal(out, expected)
    # The device's quantizer on the same rows, ties and the row above 127 steps included.
    q, scale = quantize(jnp.asarray(x), out_dims=(0,))
    np.testing.assert_array_equal(np.asarray(q), qx)
    np.testing.assert_array_equal(np.asarray(scale), sx[:, 0])
    ties = {126.5: 126, -126.5: -126, 0.5: 0, -0.5: 0, 1.5: 2, 2.5: 2, -3.5: -4, 64.5: 64}
    halves = np.asarray(q)[2, 1:]
    assert [ties[float(h)] for h in edge_halves(seed)] == list(halves[: len(edge_halves(seed))])


def test_a_batched_spec_is_the_formula(seed):
    """``"bse,ehd->bhsd"`` (q's projection): per-token scales over ``e`` for each ``(b, s)``,
    per-channel ones over ``e`` for each ``(h, d)``; the same numbers as the 2-D formula on the
    flattened operands."""
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((2, 5, 16)) * rng.uniform(0.1, 10, (2, 5, 1))).astype(np.float32)
    w = (rng.standard_normal((16, 3, 4)) * rng.uniform(0.1, 10, (1, 3, 4))).astype(np.float32)
    out = quantized.int8_einsum("bse,ehd->bhsd", jnp.asarray(x), jnp.asarray(w))
    flat, _ = ref_forward(x.reshape(10, 16), w.reshape(16, 12))
    expected = flat.reshape(2, 5, 3, 4).transpose(0, 2, 1, 3)
    np.testing.assert_array_equal(np.asarray(out), expected)


def test_both_gradients_are_the_formula(seed):
    """``dx`` (the gradient times the weight's scales, per token, stochastically rounded, times
    the forward's int8 weight) and ``dw`` (the gradient times the input's per-token scales, per
    output channel, times the forward's int8 input) against numpy, edge rows included."""
    print(f"seed {seed}")
    x, w, d_out = draw(seed)
    x = edge_rows(x, seed)
    d_out[4] = 0.0  # a gradient row of zeros
    d_out[5, 2] = 3e3  # and one outlier
    key = jax.random.key(seed)
    _, vjp = jax.vjp(
        lambda a, b: quantized.int8_einsum("te,ef->tf", a, b, key), jnp.asarray(x), jnp.asarray(w)
    )
    dx, dw = vjp(jnp.asarray(d_out))
    ref_dx, ref_dw = ref_gradients(x, w, d_out, key)
    np.testing.assert_array_equal(np.asarray(dx), ref_dx)
    np.testing.assert_array_equal(np.asarray(dw), ref_dw)
    # Near the float gradients: int8 rounding, not another formula.
    exact_dx, exact_dw = d_out @ w.T, x.T @ d_out
    assert np.abs(np.asarray(dx) - exact_dx).max() < 0.05 * np.abs(exact_dx).max()
    assert np.abs(np.asarray(dw) - exact_dw).max() < 0.05 * np.abs(exact_dw).max()


def test_the_frozen_int8_base_multiplies_w8a8(seed):
    """``frozen_int8_einsum`` on a stored ``Quantized`` weight: the forward's formula with the
    stored integers and scales, the input gradient's too, and no weight gradient."""
    print(f"seed {seed}")
    x, w, d_out = draw(seed)
    qw, sw = quantize(jnp.asarray(w), out_dims=(1,))
    weight = Quantized(qw, sw)
    key = jax.random.key(seed + 1)
    out, vjp = jax.vjp(
        lambda a, b: quantized.frozen_int8_einsum("te,ef->tf", a, b, key), jnp.asarray(x), weight
    )
    expected, _ = ref_forward(x, w)
    np.testing.assert_array_equal(np.asarray(out), expected)
    dx, d_weight = vjp(jnp.asarray(d_out))
    np.testing.assert_array_equal(np.asarray(dx), ref_gradients(x, w, d_out, key)[0])
    assert not np.any(np.asarray(d_weight.scale))


def test_stochastic_rounding_is_unbiased(seed):
    """Over 4,000 keys the mean of ``q * scale`` is within 5 standard errors of ``v`` for every
    entry (each a fraction of a step from 0.1 to 0.9 away from an integer: rounding to nearest is
    off by up to 0.4 steps, 28 standard errors)."""
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    steps = rng.integers(-120, 120, (6, 16)) + rng.uniform(0.1, 0.9, (6, 16))
    steps[:, 0] = 127.0  # each row's peak: scale = 127 steps / 127
    v = jnp.asarray(steps * 0.37, jnp.float32)
    keys = jax.random.split(jax.random.key(seed), 4000)
    q, scale = jax.vmap(lambda k: quantized.quantize_stochastic(v, (1,), k))(keys)
    mean = np.mean(np.asarray(q, np.float64) * np.asarray(scale)[:, :, None], axis=0)
    step = np.asarray(scale[0])[:, None]
    error = np.abs(mean - np.asarray(v, np.float64)) / step
    assert error.max() < 5 * 0.5 / np.sqrt(len(keys)), error.max()
    assert set(np.unique(np.asarray(q)[:, 0, 1] - np.floor(steps[0, 1]))) == {0, 1}


def test_stochastic_rounding_follows_its_key(seed):
    """Both gradients: equal for equal keys, different for different keys (a rounding that
    ignores its key gives equal ones), and different from rounding to nearest (no key)."""
    print(f"seed {seed}")
    x, w, d_out = (jnp.asarray(a) for a in draw(seed))

    def gradients(key):
        _, vjp = jax.vjp(lambda a, b: quantized.int8_einsum("te,ef->tf", a, b, key), x, w)
        return [np.asarray(g) for g in vjp(d_out)]

    first, again = gradients(jax.random.key(seed)), gradients(jax.random.key(seed))
    other, nearest = gradients(jax.random.key(seed + 1)), gradients(None)
    for a, b, c, d in zip(first, again, other, nearest):
        np.testing.assert_array_equal(a, b)
        assert np.mean(a != c) > 0.5, np.mean(a != c)
        assert np.mean(a != d) > 0.5, np.mean(a != d)


def test_a_sum_past_int32_is_refused():
    """A weight gradient over more tokens than an int32 sum of int8 products holds exactly is
    refused by name, before anything runs."""
    x = jax.ShapeDtypeStruct((quantized.MAX_SUM + 1, 4), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((4, 4), jnp.float32)

    def loss(a, b):
        return jnp.sum(quantized.int8_einsum("te,ef->tf", a, b).astype(jnp.float32))

    with pytest.raises(ValueError, match="133144"):
        jax.eval_shape(jax.grad(loss, argnums=1), x, w)


def test_stochastic_rounding_stays_in_int8_at_the_peak():
    """At a row's peak (127 steps, or an ulp past it) with the largest uniform draw below 1,
    ``floor(steps + u)`` is 128: it must come out 127, not wrapped to -128; and -127 an ulp past
    with ``u = 0`` comes out -127, not -128 (a symmetric range)."""
    top = np.float32(np.nextafter(np.float32(1), np.float32(0)))
    steps = jnp.asarray([127.0, np.nextafter(np.float32(127), np.float32(128)), 126.5, -127.0])
    assert np.array_equal(quantized.stochastic_round(steps, top), [127, 127, 127, -126])
    below = jnp.asarray([-127.0, np.nextafter(np.float32(-127), np.float32(-128))], jnp.float32)
    assert np.array_equal(quantized.stochastic_round(below, 0.0), [-127, -127])


# --- Every layout against one device, under StepOptions(quantize="int8") ------------------------

ROWS = 8
DENSE = {}
MOE = {"num_experts": 4, "experts_per_token": 2}
LAYOUTS = {
    "fsdp=8": (DENSE, dict(mesh=dew.MeshSpec(fsdp=8))),
    "fsdp=2,tensor=4": (DENSE, dict(mesh=dew.MeshSpec(fsdp=2, tensor=4))),
    # The tensor rings in int8, sequence-parallel activations (dew.parallel.tensor_ring).
    "fsdp=2,tensor=4,rings": (
        DENSE,
        dict(
            mesh=dew.MeshSpec(fsdp=2, tensor=4),
            options=dict(tensor_scheme="ring", sequence_parallel=True),
        ),
    ),
    "sequence=4": (DENSE, dict(mesh=dew.MeshSpec(fsdp=2, sequence=4))),
    "expert=2": (MOE, dict(mesh=dew.MeshSpec(expert=2, fsdp=4))),
    "stage=2": (DENSE, dict(mesh=dew.MeshSpec(stage=2, fsdp=4, microbatches=2))),
    "accumulation=2": (
        DENSE,
        dict(mesh=dew.MeshSpec(fsdp=2, data=1), devices=jax.devices()[:2], accumulation=2),
    ),
}
# Every layout's forward quantizes the rows one device quantizes, with the same scales (tensor
# splits o's and down's summed width, and its devices take each scale's peak over the group),
# and differs only where float32's rounding (another order of a sum) moves a value across an
# int8 rounding boundary: a step of one entry, a small part of int8's own error. The gradients
# are rounded stochastically with draws of each layout's own shapes, and the weight gradients
# scaled over each device's own tokens: they differ by the rounding's noise.


def one_step(objective, params, key, batch, keys=(), options=None, **trainer_args):
    """``(loss, gradients)`` of one int8 step from ``params``, and of the same step under each of
    ``keys`` (the state's key, which the int8 rounding draws from). ``options``: more
    ``StepOptions`` than ``quantize="int8"``, by name."""
    if "mesh" not in trainer_args:  # one device
        trainer_args.update(mesh=dew.MeshSpec(), devices=jax.devices()[:1])
    trainer = dew.Trainer(
        objective,
        recording(optax.sgd(0.1)),
        key,
        layout=dew.Layout(min_shard=1),
        options=dew.StepOptions(quantize="int8", **(options or {})),
        **trainer_args,
    )
    rows = len(batch)
    step = trainer.train_step(rows)
    runs = []
    for k in (key, *keys):
        copy = jax.random.wrap_key_data(np.asarray(jax.random.key_data(k)))  # the step donates
        state = host_state(trainer, params).replace(key=jax.device_put(copy, jax.devices()[0]))
        state, metrics = step(state, trainer.device_batch(batch, rows))
        runs.append(
            (float(metrics["loss"]), jax.tree_util.tree_map(np.asarray, state.opt_state[0]))
        )
    return runs


@pytest.fixture(scope="module")
def references(module_seed):
    """One device, per model: its initial weights, int8 steps with the run's key and another, and
    float32's loss and gradients (``jax.value_and_grad`` of the objective's loss)."""
    key, batch = seeded_key(module_seed), fresh_batch(ROWS, module_seed)
    made = {}

    def of(model):
        name = "moe" if model else "dense"
        if name not in made:
            objective = tiny_objective(**model)
            params = jax.jit(objective.model.init)(key)
            same, other = one_step(
                objective, params, key, batch, keys=(seeded_key(module_seed, 1),)
            )
            loss, grads = jax.jit(jax.value_and_grad(objective.loss))(params, batch)
            made[name] = dict(
                objective=objective,
                params=params,
                int8=same,
                other_key=other,
                float=(float(loss), jax.tree_util.tree_map(np.asarray, grads)),
            )
        return made[name]

    return key, batch, of


@pytest.mark.parametrize("name", LAYOUTS)
def test_every_layout_is_one_device_in_int8(name, references, module_seed):
    """Each layout's first step under ``quantize="int8"`` against one device's. The loss is
    within a quarter of int8's own error (one device's int8 loss against its float32 loss, at
    least 1e-4 of the loss) of one device's (measured: 0 to 0.05 of it; tensor with each
    device's own scales, 0.85 to 2.7 of it).
    The gradients differ by the stochastic rounding:
    by less than twice the spread of one device's between two keys (measured: 0.98 to 1.4 of
    it), and they are int8's (away from float32's by a third of it at least: not the float
    matmuls)."""
    print(f"seed {module_seed}")
    key, batch, of = references
    model, trainer_args = LAYOUTS[name]
    ref = of(model)
    loss, grads = one_step(ref["objective"], ref["params"], key, batch, **trainer_args)[0]
    one_loss, one_grads = ref["int8"]
    float_loss, float_grads = ref["float"]
    # int8's own error in the loss, floored at 1e-4 of it: errors of many entries can cancel in
    # one scalar by chance (measured 2.8e-5 to 2.3e-4 of the loss).
    int8_error = max(abs(one_loss - float_loss), 1e-4 * abs(one_loss))
    print(f"{name}: loss {abs(loss - one_loss) / int8_error:.3g} of int8's error from one's")
    assert abs(loss - one_loss) <= 0.25 * int8_error + 1e-6, (loss, one_loss, float_loss)
    spread = relative_error(ref["other_key"][1], one_grads)
    error = relative_error(grads, one_grads)
    print(f"{name}: gradients {error:.3g} from one device's, two keys' spread {spread:.3g}")
    assert error < 2 * spread, (error, spread)
    assert relative_error(grads, float_grads) > spread / 3, "float32 matmuls, not int8"


def matmuls(hlo: str) -> list[tuple[str, str, str]]:
    """``(output, left, right)`` element types of every dot and convolution of compiled HLO text
    (operands named, their types read off the lines that define them)."""
    types = dict(re.findall(r"(%[\w.-]+) = \(?(\w+)\[", hlo))
    found = re.findall(r"= (\w+)\[[^\]]*\]\S* (?:dot|convolution)\((%[\w.-]+), (%[\w.-]+)", hlo)
    return [(out, types.get(a), types.get(b)) for out, a, b in found]


def test_lora_on_an_int8_base_multiplies_w8a8_under_int8_only(seed):
    """A LoRA step on an int8 base (``base_dtype="int8"``): under ``quantize="int8"`` the
    compiled step multiplies s8 x s8 into s32 (the base's stored int8 against int8 activations,
    forward and input gradient); under ``"bfloat16"`` none (weight-only: the int8 base cast to
    the activations' dtype). The adapters' matmuls stay float."""
    print(f"seed {seed}")
    objective = tiny_objective(lora=dict(rank=2, base_dtype="int8"))
    counts = {}
    for precision in ("bfloat16", "int8"):
        trainer = dew.Trainer(
            objective,
            optax.sgd(0.1),
            seeded_key(seed),
            mesh=dew.MeshSpec(),
            devices=jax.devices()[:1],
            options=dew.StepOptions(quantize=precision),
        )
        dots = matmuls(trainer.compiled_step(ROWS).as_text())
        counts[precision] = dots.count(("s32", "s8", "s8"))
        assert ("f32", "f32", "f32") in dots, "the adapters' matmuls"
    # The layer loop's bodies: 7 projections' forwards, their recompute (all but down's, which
    # the backward does not need) and their 7 input gradients; no weight gradient.
    assert counts == {"bfloat16": 0, "int8": 7 + 6 + 7}, counts


def test_project_routes_each_kind_of_weight(seed):
    """``quantized.project``: an array by ``int8_einsum``, a ``Quantized`` base by
    ``frozen_int8_einsum`` (its stored integers, not requantized), an ``Adapted`` one's base
    likewise with its adapters added in float."""
    print(f"seed {seed}")
    from dew.nn.lora import Adapted

    x, w, _ = draw(seed)
    x, w = jnp.asarray(x), jnp.asarray(w)
    base = Quantized(*quantize(w, out_dims=(1,)))
    np.testing.assert_array_equal(
        quantized.project("te,ef->tf", x, w), quantized.int8_einsum("te,ef->tf", x, w)
    )
    np.testing.assert_array_equal(
        quantized.project("te,ef->tf", x, base), quantized.frozen_int8_einsum("te,ef->tf", x, base)
    )
    rng = np.random.default_rng(seed)
    a = jnp.asarray(rng.standard_normal((x.shape[1], 3)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((3, w.shape[1])), jnp.float32)
    adapted = Adapted(base, a, b, scale=2.5)
    expected = quantized.frozen_int8_einsum("te,ef->tf", x, base) + 2.5 * (x @ a) @ b
    np.testing.assert_allclose(
        quantized.project("te,ef->tf", x, adapted), expected, rtol=1e-5, atol=1e-5
    )


def test_the_tensor_rings_run_int8_and_auto_picks_them():
    """``tensor_scheme="ring"`` with ``quantize="int8"`` passes the checks, and ``"auto"`` on
    TPU picks the rings for int8 as for bfloat16 (the plain pairs on CPU). An unknown
    ``quantize`` names the choices."""
    int8 = dew.StepOptions(quantize="int8")
    dew.StepOptions(tensor_scheme="ring", quantize="int8").check({"tensor": 4}, 16)
    assert dew.StepOptions().resolve({"tensor": 4}, "tpu", 16).tensor_scheme == "ring"
    assert int8.resolve({"tensor": 4}, "tpu", 16).tensor_scheme == "ring"
    assert int8.resolve({"tensor": 4}, "cpu", 16).tensor_scheme == "plain"
    assert int8.in_effect({})[
        "quantize"
    ] == "int8" and "quantize" not in dew.StepOptions().in_effect({})
    with pytest.raises(ValueError, match="unknown quantize 'int4'; expected one of bfloat16, int8"):
        dew.StepOptions(quantize="int4")


def test_the_flag_sets_the_option_and_the_mfu_line_names_its_peak():
    """``dew train --quantize int8`` gives ``StepOptions(quantize="int8")`` (bfloat16 without
    it); an int8 step's MFU says it divides by the bf16 peak, and a line without MFU (a CPU's)
    says nothing of a peak."""
    from dew.cli.flags import step_options
    from dew.cli.main import build_parser
    from dew.training.tracking import INT8_PEAK_NOTE, speed_text

    parser = build_parser()
    assert step_options(parser.parse_args(["train", "--quantize", "int8"])).quantize == "int8"
    assert step_options(parser.parse_args(["train"])).quantize == "bfloat16"
    speed = dict(tokens=1000, flops_per_token=1e9, devices=1, causal_flops_per_token=9e8)
    line = speed_text(0.25, peak=1e13, peak_note=INT8_PEAK_NOTE, **speed)
    assert line.endswith("MFU 40.0% PaLM, 36.0% causal-halved of the bf16 peak"), line
    assert parse_log_line(f"step 3: loss 1.0000, {line}")["mfu"] == 40.0
    assert "peak" not in speed_text(0.25, peak=None, peak_note=INT8_PEAK_NOTE, **speed)


def test_remat_policies_keep_the_int8_output_not_its_int32_sums():
    """Under ``remat="dots"`` and ``"attention"`` an int8 projection's backward keeps its output
    in the activations' dtype (2 bytes an entry for bfloat16), as for a bfloat16 matmul, not the
    int32 sums behind it (4 bytes); ``"full"`` keeps neither."""
    from jax._src.ad_checkpoint import saved_residuals

    from dew.models.causal_transformer import REMAT_POLICIES

    x, w = jnp.ones((64, 32), jnp.bfloat16), jnp.ones((32, 48), jnp.float32)

    def layer(x, w):
        return jnp.sum(jnp.sin(quantized.int8_einsum("te,ef->tf", x, w)))

    for policy, kept in (("dots", True), ("attention", True), ("full", False)):
        saved = [
            str(aval)
            for aval, _ in saved_residuals(
                jax.checkpoint(layer, policy=REMAT_POLICIES[policy]), x, w
            )
        ]
        assert ("bfloat16[64,48]" in saved) == kept, (policy, saved)
        assert not any(a.startswith("int32") for a in saved), (policy, saved)


# --- The tensor rings in int8 (dew.parallel.tensor_ring) ---------------------------------------

RING = 4  # a tensor group of 4: the devices before and after each one differ
# Both activation variants, attention's einsums (a transposed output, two summed labels in the
# exit) and the MLP's (tokens flattened): columns of two weights, then the row.
RING_CASES = {
    "sequence_parallel-attention": (True, "bse,ehd->bhsd", "bhsd,hde->bse"),
    "whole-attention": (False, "bse,ehd->bhsd", "bhsd,hde->bse"),
    "sequence_parallel-mlp": (True, "te,ef->tf", "tf,fe->te"),
    "whole-mlp": (False, "te,ef->tf", "tf,fe->te"),
}
# Label sizes: 12 blocked positions (3 a device), 16 channels of width, 8 heads (2 a device).
RING_SIZES = dict(b=2, s=12, t=24, e=16, h=8, d=3, f=32)


def ring_region(shards, spec_in, spec_out):
    """A Megatron region as the model runs one: enter, two column projections, their product
    through tanh, the row projection, leave."""
    from dew.parallel import tensor_ring

    region = tensor_ring.Region(shards)

    def f(x, wa, wb, wo):
        a, b = region.columns(spec_in, region.enter(x), (wa, wb))
        return region.leave(region.row(spec_out, jnp.tanh(a) * b, wo))

    return f


def ring_arrays(name, seed):
    """``x``, the three weights and the output's gradient, float32, whole. Per-token magnitudes
    of ``x`` and of the gradient apart by 50x, and per-channel ones of the weights by 20x, so a
    scale over the wrong devices (or axis) changes most integers."""
    _, spec_in, spec_out = RING_CASES[name]
    rng = np.random.default_rng(seed)
    x_l, wa_l, _ = spec_labels(spec_in)
    _, wo_l, out_l = spec_labels(spec_out)

    def varied(labels, kept):
        shape = [RING_SIZES[label] for label in labels]
        spread = [RING_SIZES[label] if label in kept else 1 for label in labels]
        return rng.standard_normal(shape) * np.exp(rng.uniform(-2, 2, spread))

    arrays = (
        varied(x_l, x_l[:-1]),
        varied(wa_l, wa_l[1:]),
        varied(wa_l, wa_l[1:]),
        varied(wo_l, wo_l[-1]),
        varied(out_l, out_l[:-1]),
    )
    return [a.astype(np.float32) for a in arrays]


def ring_program(name, ring=True):
    """``(x, wa, wb, wo, d_out) -> (out, dx, dwa, dwb, dwo)`` over a tensor group of ``RING``
    under ``shard_map`` (``quantize="int8"``, no key: the gradients round to nearest), the
    region's weights split as the model splits them (heads, or the MLP's width)."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from dew.parallel.shards import Shards

    sequence_parallel, spec_in, spec_out = RING_CASES[name]
    options = dew.StepOptions(quantize="int8", sequence_parallel=sequence_parallel)
    shards = Shards(axis_sizes={"tensor": RING}, options=options, tensor_ring=ring)
    f = ring_region(shards, spec_in, spec_out)

    def local(x, wa, wb, wo, d_out):
        out, vjp = jax.vjp(f, x, wa, wb, wo)
        return (out, *vjp(d_out))

    blocked = spec_labels(spec_in)[0].index("s" if "s" in spec_in else "t")
    x_spec = P(*[None] * blocked, "tensor") if sequence_parallel else P()
    w_specs = (P(None, "tensor"), P(None, "tensor"), P("tensor"))
    mesh = Mesh(np.array(jax.devices()[:RING]), ("tensor",))
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(x_spec, *w_specs, x_spec),
        out_specs=(x_spec, x_spec, *w_specs),
        check_vma=False,
    )


@pytest.mark.parametrize("name", RING_CASES)
def test_the_int8_rings_are_one_device_to_float_rounding(name, seed):
    """The int8 rings' region (``tensor_scheme="ring"``: the entry's input and the exit's
    output gradient passed round as int8 with their scales), its output and the gradients of
    its input and of its three weights, against one device's int8 projections (no tensor
    split: ``int8_einsum`` on the whole weights, the formula of the tests above). Rounded to
    nearest, every device quantizes the values one device quantizes, with the same scales (the
    exit's per-token and per-channel peaks over the group, the entry's input-gradient peaks over
    it): only the float sums of the partial products differ, within 1e-5 (measured 2e-8 to 1e-7;
    a scale taken over one device's width instead of the group's: 1e-3 and more)."""
    print(f"seed {seed}")
    _, spec_in, spec_out = RING_CASES[name]
    x, wa, wb, wo, d_out = ring_arrays(name, seed)
    one = ring_region(
        dew.parallel.Shards(options=dew.StepOptions(quantize="int8")), spec_in, spec_out
    )

    @jax.jit
    def one_device(x, wa, wb, wo, d_out):
        out, vjp = jax.vjp(one, x, wa, wb, wo)
        return (out, *vjp(d_out))

    expected = one_device(x, wa, wb, wo, d_out)
    found = jax.jit(ring_program(name))(x, wa, wb, wo, d_out)
    for what, a, e in zip(("out", "dx", "dwa", "dwb", "dwo"), found, expected, strict=True):
        error = relative_error(a, e)
        print(f"{name}: {what} {error:.3g} from one device's")
        assert error < 1e-5, (what, error)
    # Not the float matmuls: int8's error from float32's is far above the bound.
    floats = jax.jit(ring_region(dew.parallel.Shards(), spec_in, spec_out))(x, wa, wb, wo)
    assert relative_error(found[0], floats) > 1e-3


def ppermute_bytes(fn, *args) -> dict:
    """``{dtype: operand bytes}`` of the ``ppermute`` s of ``fn``'s jaxpr, every nested jaxpr
    walked (custom derivatives' forwards and backwards, ``shard_map``, ``jit``)."""
    found = {}

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "ppermute":
                for var in eqn.invars:
                    dtype = np.dtype(var.aval.dtype).name
                    found[dtype] = found.get(dtype, 0) + var.aval.size * var.aval.dtype.itemsize
            for value in eqn.params.values():
                for inner in value if isinstance(value, (list, tuple)) else [value]:
                    inner = getattr(inner, "jaxpr", inner)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


@pytest.mark.parametrize("name", ["sequence_parallel-attention", "sequence_parallel-mlp"])
def test_the_int8_rings_move_int8(name):
    """With sequence-parallel activations, ``A`` tokens x ``E`` channels, on a group of ``n``:
    the entry's forward ring passes each block's integers and per-token float32 scales, ``(n -
    1)`` blocks of ``A / n (E + 4)`` bytes (about half of bfloat16's ``2 A E / n``), and the
    exit's backward ring the output gradient's two int8 operands (per token for ``dh``, per
    channel for ``dw``) and its per-token scales, ``A / n (2 E + 4)``; the exit's forward and the
    entry's backward rings sum partial products, float (float32 here: ``4 A E / n`` each). A
    ring that passed a float block would show float bytes above those two sums."""
    x, wa, wb, wo, d_out = ring_arrays(name, 0)
    found = ppermute_bytes(ring_program(name), x, wa, wb, wo, d_out)
    tokens, width, n = x.size // x.shape[-1], x.shape[-1], RING
    assert found == {
        "int8": (n - 1) * tokens // n * ((width + 4) + (2 * width + 4)),
        "float32": 2 * (n - 1) * tokens // n * width * 4,
    }, found


# --- Rounding keys: a layer's and a microbatch's own ---------------------------------------------


def twin_layers(params):
    """``params`` with layer 1 a copy of layer 0 and both layers' row projections (o, down)
    zero: each layer adds nothing to the residual stream, so both see the same input and the
    same output gradient, and their o and down weight gradients are the same numbers before
    the int8 rounding draws its noise."""

    def twin(path, w):
        names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
        if "layers" not in names:
            return w
        w = np.asarray(w).copy()
        w[1] = w[0]
        if names[-1] in ("o", "down"):
            w[:] = 0
        return w

    return jax.tree_util.tree_map_with_path(twin, params)


def test_layers_microbatches_and_devices_draw_rounding_noise_of_their_own(references, module_seed):
    """Through two equal layers that see the same input, the o and down weight gradients (the
    same numbers before rounding) differ between the layers: their keys are the step's folded
    with the layer's number. Under accumulation=2 with two equal microbatches, their sum
    differs from twice the first's (one microbatch alone, whose number, 0, is folded in as the
    first's is), which it would equal bit for bit if both drew the same noise (every value and
    scale is then exactly doubled); so does the sum of two fsdp devices holding equal rows
    (their index over the token axes folded in, 0 on one device). The same key gives the same
    numbers (a replayed run)."""
    print(f"seed {module_seed}")
    key, batch, of = references
    ref = of(DENSE)
    params = twin_layers(jax.tree_util.tree_map(np.asarray, ref["params"]))
    # One device on the batch (the references' program, read back from the compilation cache),
    # and on the batch twice over two microbatches or two devices.
    twice = np.concatenate([batch, batch])
    (_, summed), (_, replayed) = one_step(
        ref["objective"], params, key, twice, keys=(key,), accumulation=2
    )
    ((_, alone),) = one_step(ref["objective"], params, key, batch)
    devices = dict(mesh=dew.MeshSpec(fsdp=2), devices=jax.devices()[:2])
    ((_, split),) = one_step(ref["objective"], params, key, twice, **devices)
    layers = summed["params"]["layers"]
    for path in (("attn", "o"), ("mlp", "down")):
        grads = layers[path[0]][path[1]]
        assert np.abs(grads[0]).max() > 0, path
        differ = np.mean(grads[0] != grads[1])
        print(f"{path}: layers differ in {differ:.3f} of entries")
        assert differ > 0.5, (path, differ)
        first = alone["params"]["layers"][path[0]][path[1]]
        differ = np.mean(grads != first)
        print(f"{path}: two microbatches' sum differs from twice one's in {differ:.3f}")
        assert differ > 0.5, (path, differ)
        differ = np.mean(split["params"]["layers"][path[0]][path[1]] != first)
        print(f"{path}: two fsdp devices' sum differs from twice one's in {differ:.3f}")
        assert differ > 0.5, (path, differ)
    for a, b in zip(jax.tree_util.tree_leaves(summed), jax.tree_util.tree_leaves(replayed)):
        np.testing.assert_array_equal(a, b)
