"""Fully sharded data parallelism: each device holds 1/n of every large weight.

Forward: ``all_gather`` a layer's weight shards over ``fsdp`` just before the layer runs, inside the
layer scan, so only one layer's weights are whole at a time. All of the layer's split weights of
one dtype travel in one ``all_gather`` (a bucket: their local shards flattened and concatenated).
Backward: autodiff transposes that gather into one ``psum_scatter`` over ``fsdp``, which sums the
layer's gradients over the fsdp group's slices of the batch and leaves each device the gradient of
its own shards. The step engine runs each layer under ``jax.checkpoint``, so the backward gathers
again rather than keeping gathered weights alive.

Bytes per bucket of ``W`` bytes (the whole weights it carries) on ``n`` devices, per device and per
gather: it receives and sends ``(n - 1) / n * W`` (ring all-gather); the reduce-scatter of its
gradients moves the same. Bucketing changes the number of collectives, not their bytes.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

AXIS = "fsdp"


def split_dim(spec: P) -> int | None:
    """The dimension a weight of this spec is split on over fsdp, or ``None`` if it is not."""
    for dim, entry in enumerate(tuple(spec)):
        if AXIS in (entry if isinstance(entry, tuple) else (entry,)):
            return dim
    return None


def is_split(spec: P) -> bool:
    """Whether a weight of this spec is split over fsdp (so its gradient arrives reduce-scattered)."""
    return split_dim(spec) is not None


def gather(tree: Any, specs: Any, shards) -> Any:
    """Undo the fsdp split of every leaf of ``tree`` whose spec names ``fsdp``.

    The split leaves are gathered in one ``all_gather`` per dtype; the other leaves pass through.

    Args:
      tree: local weight shards.
      specs: ``PartitionSpec`` tree matching ``tree`` (the layout of the full weights), or ``None``.
      shards: the step's ``Shards``; on an fsdp axis of size 1 nothing is gathered.

    Returns:
      ``tree`` with each split leaf whole along its split dimension (``n`` times its local size
      there, device ``i``'s shard at block ``i``), as a tiled ``all_gather`` of that leaf would give.
    """
    if specs is None or shards.size(AXIS) == 1:
        return tree
    n = shards.size(AXIS)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    dims = [split_dim(spec) for spec in treedef.flatten_up_to(specs)]
    buckets: dict[Any, list[int]] = {}
    for i, (leaf, dim) in enumerate(zip(leaves, dims)):
        if dim is not None:
            buckets.setdefault(jnp.dtype(leaf.dtype), []).append(i)

    out = list(leaves)
    for idx in buckets.values():
        flat = jnp.concatenate([leaves[i].reshape(-1) for i in idx])
        # One ring all-gather for the whole bucket, rather than one per weight: at small sizes the
        # number of collectives decides the step time (each is a barrier across the devices), and
        # the bytes are the same: each device sends and receives (n-1)/n of the bucket's whole
        # weights. Its transpose is one psum_scatter of their gradients, moving as much.
        gathered = lax.all_gather(flat, AXIS)  # [n, local elements of the bucket], device-major
        start = 0
        for i in idx:
            local, dim = leaves[i].shape, dims[i]
            columns = gathered[:, start : start + leaves[i].size].reshape(n, *local)
            start += leaves[i].size
            # [n, ..., local[dim], ...] -> [..., n, local[dim], ...] -> [..., n * local[dim], ...]
            whole = jnp.moveaxis(columns, 0, dim)
            out[i] = whole.reshape(*local[:dim], n * local[dim], *local[dim + 1 :])
    return jax.tree_util.tree_unflatten(treedef, out)
