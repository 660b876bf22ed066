"""Data parallelism: every device of the token axes computes on its own tokens of the batch.

The loss each device computes is its tokens' share of the global mean (their sum divided by the
global token count), so gradients need summing, not averaging. Which axes each weight's gradient is
summed over is one rule, ``dew.parallel.gradients.sum_axes``; for today's layouts:

- a weight split over ``fsdp`` already arrives summed over ``fsdp`` (the reduce-scatter that
  transposes its gather); a layer's weight also over ``data`` when each layer runs once a step
  (``Shards.loop_sums``: its gather's transpose ``psum``s its shard over data, inside the layer
  loop, as GSPMD sums inside the backward); otherwise it is ``psum``med over ``data`` here, at 1/n
  of its size;
- a weight that stays whole is ``psum``med over every batch axis at once.

Weights with the same sum axes form a group, summed once per step, after the layer loop: at small
sizes the number of collectives decides the step time (docs/design.md), so one sum of all whole
gradients beats one per layer. The jaxpr holds a ``psum`` per array of a group; XLA combines them
into one all-reduce when it compiles the step.
Bytes, per device, ring all-reduce of ``G`` bytes over ``n`` devices: ``2 (n - 1) / n * G``, ``G``
counted in the dtype the sum runs in (each weight's, or ``StepOptions.gradient_sum_dtype``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from dew.mesh import TOKEN_AXES
from dew.parallel.gradients import sum_axes
from dew.parallel.shards import Shards


def sum_gradients(
    grads: Any,
    specs: Any,
    shards: Shards,
    partial_over_tensor: Any = None,
    summed_in_loop: Any = None,
) -> Any:
    """Sums each device's gradient contribution over the axes ``sum_axes`` names for it.

    Args:
      grads: this device's gradients, shaped like the (local) parameters.
      specs: ``PartitionSpec`` tree matching ``grads``; ``None`` when every weight is whole.
      shards: the step's ``Shards``.
      partial_over_tensor: a tree of bools matching ``grads`` (``sum_axes``'s flag per weight), or
        ``None`` when no weight is partial over ``tensor``.
      summed_in_loop: a tree of bools matching ``grads``: the layer loop's weights
        (``sum_axes``'s flag), or ``None`` for none.

    Returns:
      ``grads`` with each leaf summed: one ``psum`` per group of leaves with the same sum axes,
      in ``shards.options.gradient_sum_dtype`` when it is set (each leaf cast back to its own
      dtype after).
    """
    leaves, treedef = jax.tree_util.tree_flatten(grads)
    spec_leaves = [None] * len(leaves) if specs is None else treedef.flatten_up_to(specs)
    partial = (
        [False] * len(leaves)
        if partial_over_tensor is None
        else treedef.flatten_up_to(partial_over_tensor)
    )
    in_loop = (
        [False] * len(leaves) if summed_in_loop is None else treedef.flatten_up_to(summed_in_loop)
    )
    groups: dict[tuple[str, ...], list[int]] = {}
    for i, (spec, part, loop) in enumerate(zip(spec_leaves, partial, in_loop)):
        axes = sum_axes(spec, shards, partial_over_tensor=bool(part), summed_in_loop=bool(loop))
        groups.setdefault(axes, []).append(i)
    out = list(leaves)
    sum_dtype = shards.options.gradient_sum_dtype
    for axes, idx in groups.items():
        if axes:
            parts = [leaves[i] for i in idx]
            if sum_dtype is not None:  # StepOptions.gradient_sum_dtype: summed in that dtype
                parts = [g.astype(jnp.dtype(sum_dtype)) for g in parts]
            # One all-reduce once compiled: 2 (n-1)/n of the group's bytes per device.
            summed = lax.psum(parts, axes)
            for i, g in zip(idx, summed):
                out[i] = g.astype(leaves[i].dtype)
    return jax.tree_util.tree_unflatten(treedef, out)


def sum_loss(x: Any, shards: Shards) -> Any:
    """``psum`` of the loss and the objective's statistics (small values: a scalar, a few counts)
    over every axis that holds a part of them: the token axes, each device adding its tokens'
    share, and ``stage``, each stage adding what its layers (and, last, its head) added.

    ``x``: any pytree of arrays; an empty one moves nothing."""
    axes = shards.split_over((*TOKEN_AXES, "stage"))
    if not axes or not jax.tree_util.tree_leaves(x):
        return x
    return lax.psum(x, axes)
