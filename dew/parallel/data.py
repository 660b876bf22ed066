"""Data parallelism: every device of the batch axes computes on its own rows of the batch.

The loss each device computes is its rows' share of the global mean (its sum divided by the global
token count), so gradients need summing, not averaging, over the batch axes:

- a weight split over ``fsdp`` already arrives summed over ``fsdp`` (the reduce-scatter that
  transposes its gather), so it is ``psum``med over ``data`` only, at 1/n of its size;
- a weight that stays whole is ``psum``med over every batch axis at once.

Each group is summed once per step, after the layer loop: at small sizes the number of collectives
decides the step time (docs/design.md), so one sum of all gradients beats one per layer. The jaxpr
holds a ``psum`` per array of a group; XLA combines them into one all-reduce when it compiles the
step.
Bytes, per device, ring all-reduce of ``G`` bytes over ``n`` devices: ``2 (n - 1) / n * G``.
"""

from __future__ import annotations

from typing import Any

import jax
from jax import lax

from dew.mesh import BATCH_AXES
from dew.parallel import fsdp


def batch_axes(shards) -> tuple[str, ...]:
    """The batch axes this step actually splits over (sizes above 1), in mesh order."""
    return tuple(a for a in BATCH_AXES if shards.size(a) > 1)


def sum_gradients(grads: Any, specs: Any, shards) -> Any:
    """Sums each device's gradient contribution over the batch axes (see the module docstring)."""
    axes = batch_axes(shards)
    if not axes or specs is None:
        return grads
    leaves, treedef = jax.tree_util.tree_flatten(grads)
    spec_leaves = treedef.flatten_up_to(specs)
    groups: dict[tuple[str, ...], list[int]] = {}
    for i, spec in enumerate(spec_leaves):
        remaining = tuple(a for a in axes if not (a == fsdp.AXIS and fsdp.is_split(spec)))
        groups.setdefault(remaining, []).append(i)
    out = list(leaves)
    for remaining, idx in groups.items():
        if remaining:
            # One all-reduce once compiled: 2 (n-1)/n of the group's bytes per device.
            summed = lax.psum([leaves[i] for i in idx], remaining)
            for i, g in zip(idx, summed):
                out[i] = g
    return jax.tree_util.tree_unflatten(treedef, out)


def sum_over_batch(x: jax.Array, shards) -> jax.Array:
    """``psum`` of a small value (a loss, a token count) over the batch axes."""
    axes = batch_axes(shards)
    return lax.psum(x, axes) if axes else x
