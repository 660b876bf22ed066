"""int8 matmuls in training: ``einsum(spec, x, w)`` multiplied as int8 x int8 -> int32, in the
forward and in both gradients (``StepOptions(quantize="int8")``).

For an einsum of an input ``x`` and a weight ``w`` (``"te,ef->tf"``: ``x`` ``[tokens, in]``,
``w`` ``[in, out]``; any labels, each of ``w``'s named by ``x`` (summed over) or by the output,
not both), every matmul runs on integers, each operand with one float32 scale per row of what it
keeps (``int8.quantize``: ``scale = max |row| * float32(1 / 127)``, ``q = round(v / scale)``)::

    forward  qx, sx = quantize(x)  per token (over the summed labels), round to nearest
             qw, sw = quantize(w)  per output channel (over the summed labels), to nearest
             out    = (qx @ qw)[int32] * sx[t] * sw[f]
    dx       g      = d_out * sw[f]                   the weight's scale moved onto the gradient
             qg, sg = quantize(g)  per token (over the output channels), stochastically
             dx     = (qg @ qw^T)[int32] * sg[t]      the forward's int8 weight, reused
    dw       h      = d_out * sx[t]                   the input's scale moved onto the gradient
             qh, sh = quantize(h)  per output channel (over the tokens), stochastically
             dw     = (qx^T @ qh)[int32] * sh[f]      the forward's int8 input, reused

Each scale sits on a dimension its matmul keeps, so it leaves the integer sum: the matmul is
exact in int32 and the scales multiply its result in float32. The gradients are those of the
forward with ``x`` and ``w`` replaced by their dequantized values (the straight-through
estimator: no gradient through the rounding or the scales). A weight gradient sums over tokens,
so its gradient operand cannot be scaled per token; it is scaled per output channel instead,
with the forward input's per-token scale folded into it (as Qwix does with its residuals).

Stochastic rounding (``q = floor(v / scale + u)``, ``u`` uniform in ``[0, 1)``): unbiased, so the
rounding of many small gradients does not add up to a drift, as rounding to nearest does. It is
on the two gradient operands only (AQT's and Qwix's choice): the forward rounds to nearest. The
noise comes from ``key`` (``rounding_keys``): without one the gradients round to nearest too.

The keys of a training step. The step's key (the run's key folded with the step) is folded with
the device's index over the axes that split the tokens, the microbatch's number, the layer's
number in the model (``fold_key``: ``dew.training.step``, ``dew.models.causal_transformer``),
then each projection's name (``rounding_keys``): no two matmuls of a step draw the same noise, and
the same seed draws the same noise again. Rounding stays unbiased whatever the draws; what the
keys decide is which errors are independent. The rule across devices: **every value one device
rounds once is rounded once, or alike on every device that holds a copy of it, and values no
other device holds draw noise of their own.**

- Values the devices of a group hold alike are rounded from the same key over the same shape,
  so every copy rounds alike, as one device's one value: under ``tensor``, a row projection's
  output gradient with whole activations (the same on every device of the group), or one
  gathered before it is rounded (the plain pairs with sequence-parallel activations).
- Values a device holds alone fold its index into the key first (``gradient_keys(key,
  own=axis)``), so that they draw independently, as one device's draws over the whole array
  do: a column projection's output channels under ``tensor``, and in the tensor rings a block
  of tokens each device rounds before it travels (``dew.parallel.tensor_ring``: rounded once,
  where it is, then passed round as int8). Over the token axes each device's tokens are its
  own: the step's fold of the device's index does it.

Under a tensor split (``Int8Projections(split="tensor")``) a row-parallel projection's summed
width, and a column-parallel one's output channels, are split over devices: the scales that
reduce over them take their peak over the group (a ``pmax`` of one number a row), so each device
quantizes as one device holding the whole width does. The pieces (``quantize_input``,
``quantize_weight``, ``product``; ``input_operand``, ``input_product``; ``weight_operand``,
``weight_product``) are public so that ``dew.parallel.tensor_ring``'s rings run the same
formulas block by block. ``int8_ragged_dot`` is the same for an MoE layer's grouped matmuls (a
scale per expert and output channel), and ``frozen_int8_einsum`` for a LoRA run's frozen int8
base (W8A8: its stored integers and scales, no weight gradient).

The int32 sums are exact while ``127 * 127 * n`` fits int32 (``n`` the summed length: at most
``MAX_SUM`` = 133,144 tokens a weight gradient; ``int8_einsum`` refuses more).

It is one module, near 500 lines, because the three matmuls (``int8_einsum``,
``int8_ragged_dot``, ``frozen_int8_einsum``) and the tensor rings share one set of scale, rounding
and key rules, which must not drift apart; the docstrings are most of its length.
"""

from __future__ import annotations

import dataclasses
import zlib
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from dew.nn.int8 import QMAX, Quantized
from dew.nn.lora import Adapted
from dew.nn.param import Projections, spec_labels

# The longest sum an int32 accumulator holds for every int8 operand: 127 * 127 * n < 2**31.
MAX_SUM = (2**31 - 1) // (QMAX * QMAX)


def _axes(labels: str, summed: str) -> tuple[int, ...]:
    return tuple(i for i, label in enumerate(labels) if label in summed)


def _kept(labels: str, summed: str) -> str:
    return "".join(label for label in labels if label not in summed)


def _onto(scale: jax.Array, labels: str, target: str) -> jax.Array:
    """``scale`` (dimensions ``labels``) transposed and reshaped to broadcast against an array of
    dimensions ``target``."""
    order = [label for label in target if label in labels]
    scale = jnp.transpose(scale, [labels.index(label) for label in order])
    return scale.reshape([scale.shape[order.index(t)] if t in order else 1 for t in target])


def quantize_stochastic(
    v: jax.Array, summed: tuple[int, ...], key, axis: str | None = None
) -> tuple[jax.Array, jax.Array]:
    """``(q, scale)`` of ``v``: ``int8.quantize``'s scale over the dimensions ``summed`` (one per
    row of the rest, squeezed), ``q = clip(floor(v / scale + u), -127, 127)`` with ``u =
    jax.random.uniform(key, v.shape)``: ``E[q * scale] = v``. ``key=None``: rounds to nearest,
    as ``int8.quantize``. ``axis``: a mesh axis the rows are split over (a ``tensor`` group's
    parts of a summed width): the peak is the largest over it (``pmax``), so every device scales
    a row as one device holding all of it does."""
    v32 = v.astype(jnp.float32)
    peak = jnp.max(jnp.abs(v32), axis=summed, keepdims=True)
    if axis is not None:
        peak = jax.lax.pmax(peak, axis)
    scale = _scale(peak)
    if key is None:
        q = jnp.clip(jnp.round(v32 / scale), -QMAX, QMAX).astype(jnp.int8)
    else:
        q = stochastic_round(v32 / scale, jax.random.uniform(key, v.shape, jnp.float32))
    return q, jnp.squeeze(scale, axis=summed)


def stochastic_round(steps: jax.Array, u: jax.Array) -> jax.Array:
    """int8 ``floor(steps + u)`` clipped to ``[-127, 127]``: ``steps`` at a peak can sit an ulp
    past 127 (``peak * float32(1 / 127)`` below ``peak / 127``), and ``u`` near 1 takes even 127
    itself to 128, which int8 would wrap to -128."""
    return jnp.clip(jnp.floor(steps + u), -QMAX, QMAX).astype(jnp.int8)


def _labels(spec: str) -> tuple[str, str, str, str]:
    x, w, out = spec_labels(spec)
    if any((label in x) == (label in out) for label in w) or any(
        label not in w and label not in out for label in x
    ):
        raise ValueError(
            f"einsum {spec!r}: an int8 matmul takes a weight each of whose dimensions is named "
            "by exactly one of x and the output, and an x whose other dimensions the output keeps"
        )
    return x, w, out, "".join(label for label in w if label in x)


# The name of an int8 projection's output (in the activations' dtype), by which the model's remat
# policies that keep the weight matmuls' outputs ("dots", "attention") keep it: else they keep
# the int32 sums behind it, twice its bytes in bfloat16.
OUT_NAME = "int8_projection"


def _int_matmul(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.int32)


def quantize_input(spec: str, x: jax.Array, inner: str | None = None):
    """``(qx, sx)``: ``x`` quantized per token over the summed labels, to nearest; ``sx`` has
    ``x``'s other dimensions. ``inner``: the axis the summed labels are split over (a
    row-parallel projection), whose devices' peaks the scales take (``quantize_stochastic``)."""
    x_l, _, _, summed = _labels(spec)
    return quantize_stochastic(x, _axes(x_l, summed), None, inner)


def quantize_weight(spec: str, w: jax.Array, inner: str | None = None):
    """``(qw, sw)``: ``w`` quantized per output channel over the summed labels, to nearest;
    ``sw`` has ``w``'s output dimensions. ``inner`` as ``quantize_input``'s."""
    _, w_l, _, summed = _labels(spec)
    return quantize_stochastic(w, _axes(w_l, summed), None, inner)


def product(spec: str, qx, sx, qw, sw, dtype) -> jax.Array:
    """The forward from its operands: ``(qx @ qw)[int32] * sx * sw`` in ``dtype``. ``qx`` and
    ``sx`` may be a block of the input's tokens (``dew.parallel.tensor_ring`` multiplies block by
    block): the product is then that block's."""
    x_l, w_l, out_l, summed = _labels(spec)
    acc = _int_matmul(spec, qx, qw).astype(jnp.float32)
    out = acc * _onto(sx, _kept(x_l, summed), out_l) * _onto(sw, _kept(w_l, summed), out_l)
    return out.astype(dtype)


def _forward(spec, x, w, inner, qw=None, sw=None):
    """The forward; ``inner``: the axis the summed labels are split over (row-parallel), whose
    devices' peaks the scales take (``quantize_stochastic``)."""
    qx, sx = quantize_input(spec, x, inner)
    if qw is None:
        qw, sw = quantize_weight(spec, w, inner)
    out = product(spec, qx, sx, qw, sw, x.dtype)
    return checkpoint_name(out, OUT_NAME), (qx, sx, qw, sw)


def input_operand(spec: str, d_out: jax.Array, sw: jax.Array, key, outer: str | None = None):
    """``(qg, sg)``: ``dx``'s gradient operand, ``d_out`` times the weight's scale ``sw``,
    quantized per token over the output channels (stochastically from ``key``, to nearest for
    ``None``); ``sg`` has ``d_out``'s token dimensions. ``outer``: the axis the output channels
    are split over (column-parallel), whose devices' peaks the scales take."""
    _, w_l, out_l, summed = _labels(spec)
    w_out = _kept(w_l, summed)
    g = d_out.astype(jnp.float32) * _onto(sw, w_out, out_l)
    return quantize_stochastic(g, _axes(out_l, w_out), key, outer)


def input_product(spec: str, qg, sg, qw, dtype) -> jax.Array:
    """``dx = (qg @ qw^T)[int32] * sg`` in ``dtype`` (``qg`` and ``sg`` may be a block of
    tokens: ``dx`` is then that block's)."""
    x_l, w_l, out_l, summed = _labels(spec)
    acc = _int_matmul(f"{out_l},{w_l}->{x_l}", qg, qw).astype(jnp.float32)
    return (acc * _onto(sg, _kept(out_l, _kept(w_l, summed)), x_l)).astype(dtype)


def _input_gradient(spec, d_out, qw, sw, key, dtype, outer):
    """``dx`` from the forward's int8 weight: ``d_out`` times the weight's scale, quantized per
    token over the output channels (the module docstring); ``outer``: the axis those are split
    over (column-parallel), whose devices' peaks the scales take."""
    qg, sg = input_operand(spec, d_out, sw, key, outer)
    return input_product(spec, qg, sg, qw, dtype)


def weight_operand(spec: str, d_out: jax.Array, sx: jax.Array, key, axis: str | None = None):
    """``(qh, sh)``: ``dw``'s gradient operand, ``d_out`` times the input's per-token scale
    ``sx`` (of ``d_out``'s tokens), quantized per output channel over the tokens
    (stochastically from ``key``); ``sh`` has ``d_out``'s output-channel dimensions. ``axis``:
    a mesh axis the tokens are split over (a ring's blocks), whose devices' peaks the scales
    take, so each device quantizes its tokens as one device holding all of them does."""
    x_l, _, out_l, summed = _labels(spec)
    tokens = _kept(x_l, summed)
    h = d_out.astype(jnp.float32) * _onto(sx, tokens, out_l)
    return quantize_stochastic(h, _axes(out_l, tokens), key, axis)


def weight_product(spec: str, qx, qh, sh, dtype) -> jax.Array:
    """``dw = (qx^T @ qh)[int32] * sh`` in ``dtype``, summed over all the tokens of ``qx`` and
    ``qh``; refused (``ValueError``) past ``MAX_SUM`` tokens, more than int32 sums exactly."""
    x_l, w_l, out_l, summed = _labels(spec)
    tokens = _kept(x_l, summed)
    count = int(np.prod([qh.shape[out_l.index(t)] for t in tokens]))
    if count > MAX_SUM:
        raise ValueError(
            f"einsum {spec!r}: an int8 weight gradient sums {count} tokens, more than an int32 "
            f"sum of int8 products holds exactly ({MAX_SUM}); use more microbatches"
        )
    acc = _int_matmul(f"{x_l},{out_l}->{w_l}", qx, qh).astype(jnp.float32)
    return (acc * _onto(sh, _kept(out_l, tokens), w_l)).astype(dtype)


def _weight_gradient(spec, d_out, qx, sx, key, dtype):
    """``dw`` from the forward's int8 input: ``d_out`` times the input's per-token scale,
    quantized per output channel over the tokens (the module docstring)."""
    qh, sh = weight_operand(spec, d_out, sx, key)
    return weight_product(spec, qx, qh, sh, dtype)


def gradient_keys(key, own: str | None = None):
    """The two gradients' keys ``(dx, dw)``: ``jax.random.split(key)`` (``key`` typed or key
    data; ``None``: ``(None, None)``, both round to nearest). ``own``: a mesh axis whose
    devices round values of their own (the columns' output channels under ``tensor``, a ring's
    block of tokens): ``key`` is folded with the device's index on it first, so that their
    draws are independent, as one device's over the whole array are (the module docstring's
    rule)."""
    if key is None:
        return None, None
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)
    if own is not None:
        key = jax.random.fold_in(key, jax.lax.axis_index(own))
    dx_key, dw_key = jax.random.split(key)
    return dx_key, dw_key


def fold_key(key, index):
    """``key`` (key data, or ``None``) folded with ``index`` (an int, or a traced integer
    scalar), as key data; ``None`` for ``None``. The step folds its rounding key with each
    microbatch's number and each layer's (``Shards.rounding_key``), so that they draw
    independent noise."""
    if key is None:
        return None
    return jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(key), index))


# The output is in x's dtype, and so is its gradient: dx takes d_out's dtype, dw the weight's
# (a static argument: a residual must be an array).
@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _einsum(spec, w_dtype, inner, outer, x, w, key):
    return _forward(spec, x, w, inner)[0]


def _einsum_fwd(spec, w_dtype, inner, outer, x, w, key):
    out, (qx, sx, qw, sw) = _forward(spec, x, w, inner)
    return out, (qx, sx, qw, sw, key)


def _einsum_bwd(spec, w_dtype, inner, outer, residuals, d_out):
    qx, sx, qw, sw, key = residuals
    dx_key, dw_key = gradient_keys(key, outer)
    dx = _input_gradient(spec, d_out, qw, sw, dx_key, d_out.dtype, outer)
    dw = _weight_gradient(spec, d_out, qx, sx, dw_key, w_dtype)
    return dx, dw, None


_einsum.defvjp(_einsum_fwd, _einsum_bwd)


def int8_einsum(
    spec: str, x: jax.Array, w: jax.Array, key=None, inner: str | None = None, outer=None
) -> jax.Array:
    """``jnp.einsum(spec, x, w)`` in ``x``'s dtype, multiplied in int8 (the module docstring);
    its gradient ``dx`` in ``x``'s dtype and ``dw`` in ``w``'s.

    Args:
      spec: a two-operand einsum, ``x`` first, ``w``'s dimensions each named by exactly one of
        ``x`` (summed over) and the output (``"bse,ehd->bhsd"``, ``"tf,fe->te"``).
      key: ``None`` (both gradients round to nearest) or a PRNG key (typed, or its key data):
        the two gradients' stochastic rounding draws ``u`` from ``jax.random.split(key)``'s
        first key (``dx``) and second (``dw``), each ``jax.random.uniform(k, shape)`` of the
        gradient operand it rounds.
      inner: ``None``, or the mesh axis ``x`` 's and ``w`` 's summed dimensions are split over
        (a row-parallel projection under ``tensor``): the forward's scales are the largest over
        it, as on one device.
      outer: ``None``, or the mesh axis the output channels are split over (column-parallel):
        ``dx`` 's per-token scales are the largest over it, as on one device.
    """
    if key is not None and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return _einsum(spec, jnp.dtype(w.dtype).name, inner, outer, x, w, key)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _frozen_einsum(spec, inner, outer, x, qw, sw, key):
    return _forward(spec, x, None, inner, qw, sw)[0]


def _frozen_fwd(spec, inner, outer, x, qw, sw, key):
    return _forward(spec, x, None, inner, qw, sw)[0], (qw, sw, key)


def _frozen_bwd(spec, inner, outer, residuals, d_out):
    qw, sw, key = residuals
    dx_key = gradient_keys(key, outer)[0]
    dx = _input_gradient(spec, d_out, qw, sw, dx_key, d_out.dtype, outer)
    return dx, None, None, None


_frozen_einsum.defvjp(_frozen_fwd, _frozen_bwd)


def frozen_int8_einsum(
    spec: str, x: jax.Array, weight: Quantized, key=None, inner: str | None = None, outer=None
) -> jax.Array:
    """W8A8 for a frozen int8 weight (``dew.nn.int8.Quantized``, its scale per output channel,
    taken over the whole weight when it was stored): ``int8_einsum``'s forward and input
    gradient on the stored int8 values (``inner``, ``outer`` as there), no weight gradient."""
    if key is not None and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    values = jax.lax.stop_gradient(weight.values)
    scale = jax.lax.stop_gradient(weight.scale).astype(jnp.float32)
    return _frozen_einsum(spec, inner, outer, x, values, scale, key)


def _scale(peak: jax.Array) -> jax.Array:
    """``int8.quantize``'s scale of a row whose largest magnitude is ``peak``."""
    return jnp.where(peak > 0, peak * jnp.float32(1.0 / QMAX), jnp.ones_like(peak))


def _groups(group_sizes: jax.Array, rows: int) -> jax.Array:
    """Each row's group (``len(group_sizes)`` for the rows past their sum)."""
    return jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(rows), side="right")


def _ragged_forward(x, w, group_sizes, inner):
    qx, sx = quantize_stochastic(x, (1,), None, inner)
    qw, sw = quantize_stochastic(w, (1,), None, inner)  # [groups, out]: per expert and channel
    acc = jax.lax.ragged_dot(qx, qw, group_sizes, preferred_element_type=jnp.int32)
    row_sw = jnp.concatenate([sw, jnp.ones_like(sw[:1])])[_groups(group_sizes, x.shape[0])]
    out = acc.astype(jnp.float32) * sx[:, None] * row_sw
    return out.astype(x.dtype), (qx, sx, qw, sw, row_sw)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _ragged(w_dtype, inner, outer, x, w, group_sizes, key):
    return _ragged_forward(x, w, group_sizes, inner)[0]


def _ragged_fwd(w_dtype, inner, outer, x, w, group_sizes, key):
    out, (qx, sx, qw, sw, row_sw) = _ragged_forward(x, w, group_sizes, inner)
    return out, (qx, sx, qw, row_sw, group_sizes, key)


def _ragged_bwd(w_dtype, inner, outer, residuals, d_out):
    qx, sx, qw, row_sw, group_sizes, key = residuals
    dx_key, dw_key = gradient_keys(key, outer)
    groups = qw.shape[0]
    g = d_out.astype(jnp.float32) * row_sw
    qg, sg = quantize_stochastic(g, (1,), dx_key, outer)
    acc = jax.lax.ragged_dot(
        qg, jnp.swapaxes(qw, 1, 2), group_sizes, preferred_element_type=jnp.int32
    )
    dx = (acc.astype(jnp.float32) * sg[:, None]).astype(d_out.dtype)
    # dw[e] = x_e^T h_e over expert e's rows: h scaled per expert and output channel over them.
    h = d_out.astype(jnp.float32) * sx[:, None]
    row_group = _groups(group_sizes, h.shape[0])
    peak = jax.ops.segment_max(jnp.abs(h), row_group, num_segments=groups + 1)
    sh = _scale(jnp.maximum(peak, 0.0))  # a group with no rows: segment_max gives -inf
    if dw_key is None:
        qh = jnp.clip(jnp.round(h / sh[row_group]), -QMAX, QMAX).astype(jnp.int8)
    else:
        qh = stochastic_round(h / sh[row_group], jax.random.uniform(dw_key, h.shape))
    numbers = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([0], [0]), ([], [])),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[],
    )
    acc = jax.lax.ragged_dot_general(qx, qh, group_sizes, numbers, preferred_element_type=jnp.int32)
    dw = (acc.astype(jnp.float32) * sh[:groups, None, :]).astype(w_dtype)
    return dx, dw, None, None


_ragged.defvjp(_ragged_fwd, _ragged_bwd)


def int8_ragged_dot(
    x: jax.Array, w: jax.Array, group_sizes: jax.Array, key=None, inner=None, outer=None
) -> jax.Array:
    """``lax.ragged_dot(x, w, group_sizes)`` (``x`` ``[rows, in]``, ``w`` ``[groups, in, out]``:
    an MoE layer's experts) in int8, as ``int8_einsum``: ``x`` per row, ``w`` per expert and
    output channel; ``dx`` per row and ``dw`` per expert and output channel over the expert's
    rows, both rounded stochastically from ``key`` (``jax.random.split(key)``, as there);
    ``inner``, ``outer`` as there."""
    if key is not None and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    if x.shape[0] > MAX_SUM:
        raise ValueError(
            f"an int8 expert weight gradient may sum {x.shape[0]} rows, more than an int32 sum "
            f"of int8 products holds exactly ({MAX_SUM}); use more microbatches"
        )
    return _ragged(jnp.dtype(w.dtype).name, inner, outer, x, w, group_sizes, key)


def rounding_keys(key, name: str, count: int):
    """``count`` keys for the matmuls of the projection ``name``: ``key`` (typed, or key data)
    folded with ``crc32(name)``, then with ``0 .. count - 1``; ``None`` s for ``None``."""
    if key is None:
        return (None,) * count
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)
    base = jax.random.fold_in(key, zlib.crc32(name.encode()) & 0x7FFFFFFF)
    return tuple(jax.random.fold_in(base, i) for i in range(count))


@dataclasses.dataclass(frozen=True)
class _Int8Base:
    """A LoRA adapter's frozen base, multiplied in int8 (``project``)."""

    base: Any
    key: Any
    inner: str | None
    outer: str | None

    def einsum(self, spec: str, x: jax.Array) -> jax.Array:
        return project(spec, x, self.base, self.key, self.inner, self.outer)


def project(spec: str, x: jax.Array, w: Any, key=None, inner=None, outer=None) -> jax.Array:
    """``dew.nn.param.project`` in int8: a weight array by ``int8_einsum``; a frozen int8 weight
    (``dew.nn.int8.Quantized``) by ``frozen_int8_einsum`` (W8A8); a LoRA ``Adapted`` weight's
    base as either of those (a float base's gradient is never taken), its adapters in ``x``'s
    dtype, as they are small and trained in float. ``key``: the gradients' rounding; ``inner``,
    ``outer``: ``int8_einsum``'s."""
    if isinstance(w, Adapted):
        base = _Int8Base(w.base, key, inner, outer)
        return dataclasses.replace(w, base=base).einsum(spec, x)
    if isinstance(w, Quantized):
        return frozen_int8_einsum(spec, x, w, key, inner, outer)
    if hasattr(w, "einsum"):
        raise ValueError(f"an int8 projection takes an array or an int8 base, not {type(w)}")
    return int8_einsum(spec, x, w, key, inner, outer)


@dataclasses.dataclass(frozen=True)
class Int8Projections(Projections):
    """A layer's projections in int8 (``dew.nn.param.Projections``): each ``project`` above,
    with a rounding key of its own from ``key`` (the step's, as key data; ``None``: the
    gradients round to nearest), folded with the projection's kind, spec and place.

    ``split``: the mesh axis a Megatron region splits its width over (``tensor``, when above
    1), or ``None``: the columns' output channels and the row's summed width are split there,
    and their scales are taken over the whole width (a ``pmax`` of a scale a row), so every
    layout quantizes as one device does."""

    key: Any = None
    split: str | None = None

    def columns(self, spec, x, weights):
        keys = rounding_keys(self.key, f"columns {spec}", len(weights))
        return tuple(project(spec, x, w, k, outer=self.split) for w, k in zip(weights, keys))

    def row(self, spec, h, weight):
        key = rounding_keys(self.key, f"row {spec}", 1)[0]
        return project(spec, h, weight, key, inner=self.split)

    def experts(self, x, weight, group_sizes, name=""):
        """``name``: ``"gate"``, ``"up"`` (columns) or ``"down"`` (the row)."""
        key = rounding_keys(self.key, f"experts {name}", 1)[0]
        if name == "down":
            return int8_ragged_dot(x, weight, group_sizes, key, inner=self.split)
        return int8_ragged_dot(x, weight, group_sizes, key, outer=self.split)
