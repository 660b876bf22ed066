"""Fully sharded data parallelism: each device holds 1/n of every large weight.

Forward: ``all_gather`` a layer's weight shards over ``fsdp`` just before the layer runs, inside the
layer scan, so only one layer's weights are whole at a time. A layer's small split weights of one
dtype travel together in one ``all_gather`` (a bucket: their local shards flattened and
concatenated), up to ``BUCKET_BYTES`` of whole weights; a larger weight travels alone.
Backward: autodiff transposes that gather into one ``psum_scatter`` over ``fsdp``, which sums the
layer's gradients over the fsdp group's slices of the batch and leaves each device the gradient of
its own shards. The step engine runs each layer under ``jax.checkpoint``, so the backward gathers
again rather than keeping gathered weights alive.

Bytes per bucket of ``W`` bytes (the whole weights it carries) on ``n`` devices, per device and per
gather: it receives and sends ``(n - 1) / n * W`` (ring all-gather); the reduce-scatter of its
gradients moves the same. Bucketing changes the number of collectives, not their bytes.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

AXIS = "fsdp"

# Split weights of one dtype are packed into one all_gather until the whole weights it carries would
# pass this many bytes; a larger weight travels alone. Each collective is a barrier across the
# devices, so at small sizes fewer of them make a faster step; but a bucket's weights are copied out
# of the gathered buffer, so it costs its bytes again in temporary memory, which is what large
# weights cannot afford. Measured: docs/benchmarks.md, "How finely fsdp gathers".
BUCKET_BYTES = 4 * 2**20


def split_dim(spec: P) -> int | None:
    """The dimension a weight of this spec is split on over fsdp, or ``None`` if it is not."""
    for dim, entry in enumerate(tuple(spec)):
        if AXIS in (entry if isinstance(entry, tuple) else (entry,)):
            return dim
    return None


def is_split(spec: P) -> bool:
    """Whether a weight of this spec is split over fsdp (so its gradient arrives
    reduce-scattered)."""
    return split_dim(spec) is not None


def buckets(sizes: Sequence[int], limit: int) -> list[list[int]]:
    """Indices of weights whose gathered sizes (bytes) are ``sizes``, packed in order into buckets
    of at most ``limit`` bytes; a weight above ``limit`` is a bucket of its own."""
    packed: list[list[int]] = []
    total = limit + 1
    for i, size in enumerate(sizes):
        if total + size > limit:
            packed.append([])
            total = 0
        packed[-1].append(i)
        total += size
    return packed


def gather(tree: Any, specs: Any, shards) -> Any:
    """Undo the fsdp split of every leaf of ``tree`` whose spec names ``fsdp``.

    The split leaves of one dtype travel in as few ``all_gather`` s as fit ``BUCKET_BYTES`` of whole
    weights each (``buckets``); the other leaves pass through.

    Args:
      tree: local weight shards.
      specs: ``PartitionSpec`` tree matching ``tree`` (the layout of the full weights), or ``None``.
      shards: the step's ``Shards``; on an fsdp axis of size 1 nothing is gathered.

    Returns:
      ``tree`` with each split leaf whole along its split dimension (``n`` times its local size
      there, device ``i``'s shard at block ``i``), as a tiled ``all_gather`` of that leaf would
      give.
    """
    if specs is None or shards.size(AXIS) == 1:
        return tree
    n = shards.size(AXIS)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    dims = [split_dim(spec) for spec in treedef.flatten_up_to(specs)]
    by_dtype: dict[Any, list[int]] = {}
    for i, (leaf, dim) in enumerate(zip(leaves, dims)):
        if dim is not None:
            by_dtype.setdefault(jnp.dtype(leaf.dtype), []).append(i)

    out = list(leaves)
    for idx in by_dtype.values():
        whole_bytes = [n * leaves[i].size * leaves[i].dtype.itemsize for i in idx]
        for bucket in buckets(whole_bytes, BUCKET_BYTES):
            members = [idx[b] for b in bucket]
            if len(members) == 1:
                (i,) = members
                # (n-1)/n of the whole weight in, as much out; no copy: it lands in place.
                out[i] = lax.all_gather(leaves[i], AXIS, axis=dims[i], tiled=True)
                continue
            flat = jnp.concatenate([leaves[i].reshape(-1) for i in members])
            # One ring all-gather for the bucket: each device sends and receives (n-1)/n of its
            # whole weights, as one gather per weight would, in one barrier instead of several.
            # Its transpose is one psum_scatter of their gradients, moving as much.
            gathered = lax.all_gather(flat, AXIS)  # [n, local elements of the bucket], device-major
            start = 0
            for i in members:
                local, dim = leaves[i].shape, dims[i]
                columns = gathered[:, start : start + leaves[i].size].reshape(n, *local)
                start += leaves[i].size
                # [n, ..., local[dim], ...] -> [..., n, local[dim], ...]
                #   -> [..., n * local[dim], ...]
                whole = jnp.moveaxis(columns, 0, dim)
                out[i] = whole.reshape(*local[:dim], n * local[dim], *local[dim + 1 :])
    return jax.tree_util.tree_unflatten(treedef, out)
