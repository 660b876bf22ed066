"""Fsdp weight gradients summed as they are computed: the ring reduce-scatter fused with the
weight-gradient matmul (the collective matmul of GSPMD's partitioner and of the ``shard_map``
docs), for ``StepOptions(fsdp_scheme="ring")``.

A layer's matrix split over fsdp reaches its matmul still split (``RingSplit``: device ``i``'s
block ``i`` of ``n`` along the split dimension), and ``RingSplit.einsum`` runs

    forward   W = ring_gather(shard)            n - 1 ppermutes of a shard: (n - 1) / n W
              out = einsum(x, W)
    backward  dx = einsum(d_out, W)             W kept from the forward
              dW: total = dW block (i - 1)      each block from x and d_out alone
                  for s in 1 .. n - 1:          n - 1 ppermutes of a block: (n - 1) / n W
                    total = ppermute(total) + dW block (i - 1 - s)

Device ``i`` computes the block of the weight gradient the running sum it holds is for, adds it,
and passes the sum on; after ``n - 1`` steps it holds the sum of its own block over the fsdp
group (``ring.ring_scatter``'s order). No device ever holds the whole weight gradient: a block,
the one arriving and the one leaving, where the gather's transpose (``fsdp._gather_summed``)
receives the whole gradient (with bfloat16 activations, the matmul's bfloat16 output converted
to float32: 224 MiB for a Llama-3.1-8B MLP matrix) and scatters it (measured 2026-12-04). Each
block's matmul is the piece the next ``ppermute`` runs beside. The bytes are the ring
reduce-scatter's, in the dtype of the sums (``StepOptions.gradient_sum_dtype``, else the
weight's). The blocks come from float32 matmuls of the activations (``preferred_element_type``),
so the sum starts from each device's unrounded gradient.

Every einsum this takes names the split dimension's label in ``x`` (a contraction: a block of
``dW`` needs that block of ``x``'s columns) or in the output (a block of ``d_out``), not both.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from dew.nn.param import spec_labels
from dew.parallel.ring import AXIS, block, ring_gather, scatter_ring


def _weight_gradient_block(spec, x, d_out, w_dim: int, b, n: int, dtype):
    """Block ``b`` of this device's ``d einsum(spec, x, W) / dW`` along ``W``'s ``w_dim``: from
    ``x`` and ``d_out`` alone (the einsum is linear in ``W``), one matmul of ``1 / n`` of the
    work, in float32, cast to ``dtype`` (the sum's)."""
    x_labels, w_labels, out_labels = spec_labels(spec)
    label = w_labels[w_dim]
    if label in x_labels:
        x = block(x, x_labels.index(label), b, n)
    else:
        d_out = block(d_out, out_labels.index(label), b, n)
    grad = jnp.einsum(
        f"{x_labels},{out_labels}->{w_labels}", x, d_out, preferred_element_type=jnp.float32
    )
    return grad.astype(dtype)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6, 7))
def _ring_einsum(x, shard, spec: str, dim: int, n: int, also_sum: tuple, sum_dtype, weight_dtype):
    """``einsum(spec, x, ring_gather(shard))``; its backward sums the weight's gradient round
    the ring as it computes it (the module docstring), in ``sum_dtype``, and returns it in
    ``weight_dtype``, the shard's."""
    return _ring_einsum_fwd(x, shard, spec, dim, n, also_sum, sum_dtype, weight_dtype)[0]


def _ring_einsum_fwd(x, shard, spec, dim, n, also_sum, sum_dtype, weight_dtype):
    whole = ring_gather(shard, dim, n).astype(x.dtype)
    return jnp.einsum(spec, x, whole), (x, whole)


def _ring_einsum_bwd(spec, dim, n, also_sum, sum_dtype, weight_dtype, residuals, d_out):
    x, whole = residuals
    x_labels, w_labels, out_labels = spec_labels(spec)
    dx = jnp.einsum(f"{out_labels},{w_labels}->{x_labels}", d_out, whole).astype(x.dtype)
    return dx, ring_weight_gradient(spec, x, d_out, dim, n, also_sum, sum_dtype, weight_dtype)


def ring_weight_gradient(spec, x, d_out, dim, n, also_sum, sum_dtype, weight_dtype):
    """This device's block (along ``dim``) of ``d einsum(spec, x, W) / dW`` summed over fsdp
    (and ``also_sum``), each block computed as its running sum passes round the ring (the module
    docstring), in ``sum_dtype``; returned in ``weight_dtype``. ``x`` and ``d_out`` are this
    device's whole operands (``dew.parallel.tensor_ring`` passes the positions its tensor ring
    gathered)."""
    dtype = jnp.dtype(sum_dtype)
    # The running sum of block b starts on device b + 1 and reaches device b after n - 1 steps;
    # each step moves one block, 1 / n of the weight, in ``dtype``.
    total = scatter_ring(
        lambda b: _weight_gradient_block(spec, x, d_out, dim, b, n, dtype), n, AXIS
    )
    if also_sum:
        # This device's block, 1 / n of the gradient, summed over the other devices holding it.
        total = lax.psum(total, also_sum)
    return total.astype(weight_dtype)


_ring_einsum.defvjp(_ring_einsum_fwd, _ring_einsum_bwd)


@dataclasses.dataclass(frozen=True)
class RingSplit:
    """A weight still split over fsdp as it reaches its matmul (``fsdp.gather`` with
    ``in_matmuls``, under ``Shards.fsdp_ring``).

    Attributes:
      shard: this device's block of the weight along ``dim`` (the weight's dtype).
      dim: the dimension the weight is split on; ``n`` the fsdp size.
      also_sum: axes the gradient's block is ``psum``med over after the ring (``Shards.loop_sums``).
      sum_dtype: the dtype of the sums (``StepOptions.gradient_sum_dtype``); ``None``: the
        weight's.
    """

    shard: jax.Array
    dim: int
    n: int
    also_sum: tuple[str, ...] = ()
    sum_dtype: str | None = None

    def einsum(self, spec: str, x: jax.Array) -> jax.Array:
        """``jnp.einsum(spec, x, W.astype(x.dtype))`` of the whole weight ``W``, gathered round
        the ring, whose gradient is summed round it as each block is computed (the module
        docstring). ``spec`` names two operands, ``x`` first."""
        x_labels, w_labels, out_labels = spec_labels(spec)
        label = w_labels[self.dim]
        if (label in x_labels) == (label in out_labels):
            raise ValueError(
                f"einsum {spec!r}: the weight's split dimension {self.dim} ({label!r}) must be "
                "named by exactly one of x and the output"
            )
        weight_dtype = self.shard.dtype.name
        sum_dtype = self.sum_dtype or weight_dtype
        return _ring_einsum(
            x, self.shard, spec, self.dim, self.n, self.also_sum, sum_dtype, weight_dtype
        )

    def whole(self, dtype) -> jax.Array:
        """The whole weight in ``dtype``, gathered round the fsdp ring (no custom gradient: for a
        caller that writes its own backward with ``gradient``, as ``dew.parallel.tensor_ring``
        does, gathering the weight once for all the blocks of its ring)."""
        return ring_gather(self.shard, self.dim, self.n).astype(dtype)

    def gradient(self, spec: str, x: jax.Array, d_out: jax.Array) -> "RingSplit":
        """The cotangent of this ``RingSplit`` for ``einsum(spec, x, W)`` with output gradient
        ``d_out``: its shard's gradient, summed round the fsdp ring as it is computed
        (``ring_weight_gradient``)."""
        weight_dtype = self.shard.dtype.name
        grad = ring_weight_gradient(
            spec,
            x,
            d_out,
            self.dim,
            self.n,
            self.also_sum,
            self.sum_dtype or weight_dtype,
            weight_dtype,
        )
        return dataclasses.replace(self, shard=grad)


jax.tree_util.register_dataclass(
    RingSplit, data_fields=["shard"], meta_fields=["dim", "n", "also_sum", "sum_dtype"]
)
