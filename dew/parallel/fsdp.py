"""Fully sharded data parallelism: each device holds 1/n of every large weight.

Forward: ``all_gather`` a layer's weight shards over ``fsdp`` just before the layer runs, inside the
layer scan, so only one layer's weights are whole at a time. Backward: autodiff transposes that
gather into a ``psum_scatter`` over ``fsdp``, which sums the gradient over the fsdp group's slices
of the batch and leaves each device the gradient of its own shard. The step engine runs each layer
under ``jax.checkpoint``, so the backward gathers again rather than keeping gathered weights alive.

Bytes per weight of ``W`` bytes on ``n`` devices, per device and per gather: it receives and sends
``(n - 1) / n * W`` (ring all-gather); the reduce-scatter of its gradient moves the same.
"""

from __future__ import annotations

from typing import Any

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

AXIS = "fsdp"


def gather(tree: Any, specs: Any, shards) -> Any:
    """Undo the fsdp split of every leaf of ``tree`` whose spec names ``fsdp``.

    Args:
      tree: local weight shards.
      specs: ``PartitionSpec`` tree matching ``tree`` (the layout of the full weights), or ``None``.
      shards: the step's ``Shards``; on an fsdp axis of size 1 nothing is gathered.
    """
    if specs is None or shards.size(AXIS) == 1:
        return tree

    def whole(x, spec):
        for dim, entry in enumerate(tuple(spec)):
            names = entry if isinstance(entry, tuple) else (entry,)
            if AXIS in names:
                # Ring all-gather: each device sends and receives (n-1)/n of the whole weight.
                return lax.all_gather(x, AXIS, axis=dim, tiled=True)
        return x

    return jax.tree_util.tree_map(whole, tree, specs)


def is_split(spec: P) -> bool:
    """Whether a weight of this spec is split over fsdp (so its gradient arrives reduce-scattered)."""
    return any(AXIS in (e if isinstance(e, tuple) else (e,)) for e in tuple(spec))
