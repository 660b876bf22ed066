"""Rings of ``ppermute`` s that pass one block at a time round a group of devices on a named
axis, and the rings over ``fsdp``.

Any axis's ring: ``ring_pairs`` (who sends to whom), ``block`` (block ``b`` of ``n`` of an array)
and ``scatter_ring`` (a reduce-scatter as a running sum passed round the ring, each device adding
its part of the block that reaches it), each collective on the axis its caller names:
``dew.parallel.fsdp_matmul``'s weight-gradient ring runs on ``fsdp``, ``dew.parallel.tensor_ring``'s
collective matmuls on ``tensor``.

Over ``fsdp``: ``ring_gather`` is an all-gather and ``ring_scatter`` a reduce-scatter, written as
``n - 1`` ``ppermute`` s each, the same bytes, ``(n - 1) / n`` of the whole
(``StepOptions(fsdp_scheme="ring")``, docs in ``dew.parallel.fsdp``). ``dew.parallel.fsdp`` and
``dew.parallel.fsdp_matmul`` both build on them; neither imports the other for them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

AXIS = "fsdp"


def ring_pairs(n: int) -> list[tuple[int, int]]:
    """The ``ppermute`` pairs of a ring of ``n`` devices (on whichever axis the ``ppermute``
    names): index ``i`` sends to ``i + 1``."""
    return [(i, (i + 1) % n) for i in range(n)]


def block(a: jax.Array, dim: int, b, n: int) -> jax.Array:
    """Block ``b`` (traced, taken mod ``n``) of ``n`` of ``a`` along ``dim``."""
    k = a.shape[dim] // n
    return lax.dynamic_slice_in_dim(a, (b % n) * k, k, axis=dim)


def scatter_ring(partial_block, n: int, axis: str) -> jax.Array:
    """``psum_scatter`` over ``axis`` (``n`` devices) of ``partial_block(b)``, this device's part
    of block ``b`` (traced, any integer: taken mod ``n`` by ``block``), as ``n - 1`` ``ppermute``
    s round the ring: the running sum of block ``b`` starts on device ``b + 1``; each device
    adds its own part of the block that reaches it and passes the sum on, the next part computed
    while the sum travels, until it reaches device ``b`` from ``b - 1``. Each step moves one
    block: a ring reduce-scatter's bytes. (The blocks are summed in another order than
    ``psum_scatter``'s: float rounding only.)"""
    i = lax.axis_index(axis)
    total = partial_block(i - 1)
    for s in range(1, n):
        total = lax.ppermute(total, axis, ring_pairs(n)) + partial_block(i - 1 - s)
    return total


def ring_gather(x: jax.Array, dim: int, n: int) -> jax.Array:
    """``all_gather(x, "fsdp", axis=dim, tiled=True)`` as ``n - 1`` ``ppermute`` s round the
    ring: at step ``s`` device ``i`` receives the shard of device ``i - s`` and writes it at block
    ``i - s``. Each moves one shard: ``(n - 1) / n`` of the whole, a ring all-gather's bytes."""
    i = lax.axis_index(AXIS)
    k = x.shape[dim]
    whole = jnp.zeros((*x.shape[:dim], n * k, *x.shape[dim + 1 :]), x.dtype)
    whole = lax.dynamic_update_slice_in_dim(whole, x, i * k, axis=dim)
    for s in range(1, n):
        # Pass on the block written last (read back from ``whole``, not the piece as it
        # arrived): each send then waits for the write before it, so one piece at a time is in
        # flight, where forwarding arrivals let the scheduler start the whole chain at once and
        # hold all n - 1 (v5p-64, Llama-3.1-8B, fsdp=32: 61 pieces, 220 MiB, measured 2026-12-04).
        sent = lax.dynamic_slice_in_dim(whole, ((i - s + 1) % n) * k, k, axis=dim)
        piece = lax.ppermute(sent, AXIS, ring_pairs(n))
        whole = lax.dynamic_update_slice_in_dim(whole, piece, ((i - s) % n) * k, axis=dim)
    return whole


def ring_scatter(x: jax.Array, dim: int, n: int) -> jax.Array:
    """``psum_scatter(x, "fsdp", scatter_dimension=dim, tiled=True)`` as ``n - 1`` ``ppermute`` s
    round the ring (``scatter_ring`` of ``x``'s own blocks): each step moves one block, ``1 / n``
    of ``x``."""
    return scatter_ring(lambda b: block(x, dim, b, n), n, AXIS)
