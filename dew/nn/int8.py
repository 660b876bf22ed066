"""Weight-only int8: a frozen matrix stored as int8 with one float32 scale per output channel.

    q, scale = quantize(w, out_dims=(1, 2))  # w [embed, heads, head_dim]: scale [heads, head_dim]
    w_back   = dequantize(q, scale, out_dims=(1, 2))
    out      = project(spec, x, Quantized(q, scale))

Symmetric, per output channel (an output channel is one index of the dimensions the matmul's output
names; the rest, the input dimensions, are reduced over): ``scale = max |w| / 127`` over the
channel's entries (times the float32 ``1 / 127``) and ``q = round(w / scale)`` in ``[-127, 127]``,
so ``|q * scale - w| <= scale / 2`` for every entry (a channel of zeros gets ``scale = 1`` and ``q =
0``). ``Quantized.einsum`` multiplies ``x`` by the int8 matrix cast to ``x``'s dtype and scales the
output channels after the matmul (in float32): the same as the matmul with the dequantized matrix,
up to rounding, without a dequantized copy of the matrix. Weight-only: activations, gradients and
the matmul stay in ``x``'s dtype; a ``Quantized`` weight is frozen (no gradient reaches its values
or its scales). Under ``StepOptions(quantize="int8")`` the model's projections multiply it W8A8
instead (``dew.nn.quantized.frozen_int8_einsum``)."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dew.nn.param import spec_labels

# The largest magnitude an int8 value takes: symmetric, so -128 is never used.
QMAX = 127


def _input_axes(ndim: int, out_dims: Sequence[int]) -> tuple[int, ...]:
    return tuple(d for d in range(ndim) if d not in tuple(d % ndim for d in out_dims))


def quantize(w, out_dims: Sequence[int], xp=jnp):
    """``(q, scale)`` of ``w``: int8 ``q`` of ``w``'s shape and float32 ``scale`` of the shape of
    ``w``'s ``out_dims`` (the module's docstring). ``xp``: ``jnp`` (on device) or ``numpy`` (on
    the host, as ``dew.models.hf`` quantizes a box it has read)."""
    w32 = xp.asarray(w).astype(xp.float32)
    reduced = _input_axes(w32.ndim, out_dims)
    peak = xp.max(xp.abs(w32), axis=reduced, keepdims=True)
    # Times the float32 reciprocal, not over 127: XLA turns a division by a constant into that
    # product, so the host (numpy) and the device agree bit for bit.
    scale = xp.where(peak > 0, peak * xp.float32(1.0 / QMAX), xp.ones_like(peak))
    q = xp.clip(xp.round(w32 / scale), -QMAX, QMAX).astype(xp.int8)
    return q, xp.squeeze(scale, axis=reduced).astype(xp.float32)


def dequantize(q, scale, out_dims: Sequence[int], dtype=jnp.float32):
    """``q * scale`` in ``dtype``, ``scale`` broadcast over ``q``'s input dimensions."""
    reduced = _input_axes(q.ndim, out_dims)
    expanded = jnp.expand_dims(jnp.asarray(scale, jnp.float32), reduced)
    return (q.astype(jnp.float32) * expanded).astype(dtype)


def host_quantize(w: np.ndarray, out_dims: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """``quantize`` on the host, in numpy (float32 arithmetic, as on device)."""
    return quantize(np.asarray(w), out_dims, xp=np)


@dataclasses.dataclass(frozen=True)
class Quantized:
    """A frozen weight in int8 as ``dew.nn.param.project`` takes it.

    Attributes:
      values: int8, the weight's shape.
      scale: float32, the shape of the weight's output dimensions (those the einsum's output
        names), one per output channel.
    """

    values: jax.Array
    scale: jax.Array

    def einsum(self, spec: str, x: jax.Array) -> jax.Array:
        """``einsum(spec, x, dequantize(values, scale))`` in ``x``'s dtype: the int8 matrix cast
        to ``x``'s dtype (exact: int8 fits bfloat16's 8 bits), the matmul in ``x``'s dtype, each
        output channel times its scale in float32, rounded to ``x``'s dtype. Nothing flows back
        to ``values`` or ``scale``."""
        x_labels, w_labels, out_labels = spec_labels(spec)
        out_w = "".join(label for label in w_labels if label in out_labels)
        values = jax.lax.stop_gradient(self.values)
        scale = jax.lax.stop_gradient(self.scale)
        if scale.ndim != len(out_w):
            raise ValueError(
                f"einsum {spec!r}: a scale of shape {scale.shape} for the output dimensions "
                f"{out_w!r} of a weight of shape {values.shape}"
            )
        # The matmul in x's dtype, as every other weight's (XLA:CPU has no bfloat16 matmul with
        # a float32 output); the scales in float32 on its output.
        out = jnp.einsum(spec, x, values.astype(x.dtype)).astype(jnp.float32)
        out = jnp.einsum(f"{out_labels},{out_w}->{out_labels}", out, scale.astype(jnp.float32))
        return out.astype(x.dtype)


jax.tree_util.register_dataclass(Quantized, data_fields=["values", "scale"], meta_fields=[])
