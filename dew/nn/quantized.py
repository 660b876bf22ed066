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

The int32 sums are exact while ``127 * 127 * n`` fits int32 (``n`` the summed length: at most
``MAX_SUM`` = 133,144 tokens a weight gradient; ``int8_einsum`` refuses more).
"""

from __future__ import annotations

import zlib
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from dew.nn.int8 import QMAX, Quantized, quantize
from dew.nn.param import spec_labels

# The longest sum an int32 accumulator holds for every int8 operand: 127 * 127 * n < 2**31.
MAX_SUM = (2**31 - 1) // (QMAX * QMAX)

# The precisions a step's projections multiply in (``StepOptions.quantize``).
QUANTIZE_CHOICES = ("bfloat16", "int8")


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


def quantize_stochastic(v: jax.Array, summed: tuple[int, ...], key) -> tuple[jax.Array, jax.Array]:
    """``(q, scale)`` of ``v``: ``int8.quantize``'s scale over the dimensions ``summed`` (one per
    row of the rest, squeezed), ``q = clip(floor(v / scale + u), -127, 127)`` with ``u =
    jax.random.uniform(key, v.shape)``: ``E[q * scale] = v``. ``key=None``: rounds to nearest,
    as ``int8.quantize``."""
    kept = tuple(d for d in range(v.ndim) if d not in summed)
    if key is None:
        return quantize(v, out_dims=kept)
    v32 = v.astype(jnp.float32)
    peak = jnp.max(jnp.abs(v32), axis=summed, keepdims=True)
    scale = jnp.where(peak > 0, peak * jnp.float32(1.0 / QMAX), jnp.ones_like(peak))
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


def _int_matmul(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.int32)


def _forward(spec, x, w, qw=None, sw=None):
    x_l, w_l, out_l, summed = _labels(spec)
    qx, sx = quantize(x, out_dims=_axes(x_l, _kept(x_l, summed)))
    if qw is None:
        qw, sw = quantize(w, out_dims=_axes(w_l, _kept(w_l, summed)))
    acc = _int_matmul(spec, qx, qw).astype(jnp.float32)
    out = acc * _onto(sx, _kept(x_l, summed), out_l) * _onto(sw, _kept(w_l, summed), out_l)
    return out.astype(x.dtype), (qx, sx, qw, sw)


def _input_gradient(spec, d_out, qw, sw, key, dtype):
    """``dx`` from the forward's int8 weight: ``d_out`` times the weight's scale, quantized per
    token over the output channels (the module docstring)."""
    x_l, w_l, out_l, summed = _labels(spec)
    w_out = _kept(w_l, summed)
    g = d_out.astype(jnp.float32) * _onto(sw, w_out, out_l)
    qg, sg = quantize_stochastic(g, _axes(out_l, w_out), key)
    acc = _int_matmul(f"{out_l},{w_l}->{x_l}", qg, qw).astype(jnp.float32)
    return (acc * _onto(sg, _kept(out_l, w_out), x_l)).astype(dtype)


def _weight_gradient(spec, d_out, qx, sx, key, dtype):
    """``dw`` from the forward's int8 input: ``d_out`` times the input's per-token scale,
    quantized per output channel over the tokens (the module docstring)."""
    x_l, w_l, out_l, summed = _labels(spec)
    tokens = _kept(x_l, summed)
    count = int(np.prod([d_out.shape[out_l.index(t)] for t in tokens]))
    if count > MAX_SUM:
        raise ValueError(
            f"einsum {spec!r}: an int8 weight gradient sums {count} tokens, more than an int32 "
            f"sum of int8 products holds exactly ({MAX_SUM}); use more microbatches"
        )
    h = d_out.astype(jnp.float32) * _onto(sx, tokens, out_l)
    qh, sh = quantize_stochastic(h, _axes(out_l, tokens), key)
    acc = _int_matmul(f"{x_l},{out_l}->{w_l}", qx, qh).astype(jnp.float32)
    return (acc * _onto(sh, _kept(out_l, tokens), w_l)).astype(dtype)


def _split(key):
    """The two gradients' keys from ``key`` (key data, or ``None``: both round to nearest)."""
    if key is None:
        return None, None
    dx_key, dw_key = jax.random.split(jax.random.wrap_key_data(key))
    return dx_key, dw_key


# The output is in x's dtype, and so is its gradient: dx takes d_out's dtype, dw the weight's
# (a static argument: a residual must be an array).
@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _einsum(spec, w_dtype, x, w, key):
    return _forward(spec, x, w)[0]


def _einsum_fwd(spec, w_dtype, x, w, key):
    out, (qx, sx, qw, sw) = _forward(spec, x, w)
    return out, (qx, sx, qw, sw, key)


def _einsum_bwd(spec, w_dtype, residuals, d_out):
    qx, sx, qw, sw, key = residuals
    dx_key, dw_key = _split(key)
    dx = _input_gradient(spec, d_out, qw, sw, dx_key, d_out.dtype)
    dw = _weight_gradient(spec, d_out, qx, sx, dw_key, w_dtype)
    return dx, dw, None


_einsum.defvjp(_einsum_fwd, _einsum_bwd)


def int8_einsum(spec: str, x: jax.Array, w: jax.Array, key=None) -> jax.Array:
    """``jnp.einsum(spec, x, w)`` in ``x``'s dtype, multiplied in int8 (the module docstring);
    its gradient ``dx`` in ``x``'s dtype and ``dw`` in ``w``'s.

    Args:
      spec: a two-operand einsum, ``x`` first, ``w``'s dimensions each named by exactly one of
        ``x`` (summed over) and the output (``"bse,ehd->bhsd"``, ``"tf,fe->te"``).
      key: ``None`` (both gradients round to nearest) or a PRNG key (typed, or its key data):
        the two gradients' stochastic rounding draws ``u`` from ``jax.random.split(key)``'s
        first key (``dx``) and second (``dw``), each ``jax.random.uniform(k, shape)`` of the
        gradient operand it rounds.
    """
    if key is not None and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return _einsum(spec, jnp.dtype(w.dtype).name, x, w, key)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _frozen_einsum(spec, x, qw, sw, key):
    return _forward(spec, x, None, qw, sw)[0]


def _frozen_fwd(spec, x, qw, sw, key):
    return _forward(spec, x, None, qw, sw)[0], (qw, sw, key)


def _frozen_bwd(spec, residuals, d_out):
    qw, sw, key = residuals
    dx = _input_gradient(spec, d_out, qw, sw, _split(key)[0], d_out.dtype)
    return dx, None, None, None


_frozen_einsum.defvjp(_frozen_fwd, _frozen_bwd)


def frozen_int8_einsum(spec: str, x: jax.Array, weight: Quantized, key=None) -> jax.Array:
    """W8A8 for a frozen int8 weight (``dew.nn.int8.Quantized``, its scale per output channel):
    ``int8_einsum``'s forward and input gradient on the stored int8 values, no weight gradient."""
    if key is not None and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    values = jax.lax.stop_gradient(weight.values)
    scale = jax.lax.stop_gradient(weight.scale).astype(jnp.float32)
    return _frozen_einsum(spec, x, values, scale, key)


def rounding_keys(key, name: str, count: int):
    """``count`` keys for the matmuls of the projection ``name`` (``"attention.columns"``...):
    ``key`` folded with ``crc32(name)``, then with ``0 .. count - 1``; ``None`` for ``None``."""
    if key is None:
        return (None,) * count
    base = jax.random.fold_in(key, zlib.crc32(name.encode()) & 0x7FFFFFFF)
    return tuple(jax.random.fold_in(base, i) for i in range(count))
