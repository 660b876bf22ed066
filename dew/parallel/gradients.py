"""The one rule that decides every gradient sum.

Each device differentiates its own share of the loss (its tokens' sum over the global token count),
so after the local backward a weight's gradient holds only the part its tokens contributed. It is
then ``psum``med over:

- the axes that split the tokens (``TOKEN_AXES``: data, expert, fsdp, sequence; those of size > 1),
- minus the axes whose gather's transpose already summed it: ``fsdp`` for a weight split over fsdp
  (the transpose of its ``all_gather`` is a ``psum_scatter`` over fsdp), and ``Shards.loop_sums``
  (``data``, when each layer runs once a step) for such a weight gathered in the layer loop
  (``summed_in_loop``): its gather's transpose sums its shard over those axes too, layer by layer,
  inside the loop (``dew.parallel.fsdp``),
- minus the axes the weight is split on as its own: experts over ``expert``, layers over
  ``stage``; every device of such an axis holds a different part, whose gradient is already whole
  (the expert all-to-all brought it every token routed to it; a pipeline stage ran every
  microbatch through its own layers),
- plus ``tensor`` for a weight replicated over tensor that saw different activations on each device
  of the tensor group (``partial_over_tensor``): norm scales under sequence-parallel activations,
  kv heads shared by fewer devices than the tensor axis. A weight split over tensor, or replicated
  over it with the same activations everywhere, comes out of the conjugate pairs of
  ``dew.parallel.tensor`` whole, with nothing to add,
- plus ``stage`` (when its size is above 1) for a weight not split over ``stage``: the embedding,
  the final norm and the head are whole on every stage, but only the first stage (the embedding
  lookup) and the last (final norm, head, loss) use them, so each stage holds its part of their
  gradient (zeros on the stages between) and the sum over ``stage`` is the whole of it.

``stage`` does not split tokens (every stage sees every microbatch), so it is not a token axis.
"""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

from dew.mesh import AXES
from dew.parallel import fsdp, tensor
from dew.parallel.pipeline import AXIS as STAGE
from dew.parallel.shards import Shards


def spec_axes(spec: P | None) -> frozenset[str]:
    """Every mesh axis ``spec`` names, in any dimension (``None``: a whole weight, none)."""
    named = set()
    for entry in tuple(spec or ()):
        named.update(entry if isinstance(entry, tuple) else (entry,))
    named.discard(None)
    return frozenset(named)


def sum_axes(
    spec: P | None,
    shards: Shards,
    *,
    partial_over_tensor: bool = False,
    summed_in_loop: bool = False,
) -> tuple[str, ...]:
    """The axes a weight's gradient is ``psum``med over after the local backward, in mesh order.

    Args:
      spec: the weight's ``PartitionSpec`` (of the whole weight); ``None`` for a whole weight.
      shards: the step's ``Shards`` (only ``axis_sizes`` is read).
      partial_over_tensor: the weight is replicated over ``tensor`` but each device of the tensor
        group saw different activations, so its gradient is partial over ``tensor`` too.
      summed_in_loop: the weight is one of the layer loop's, gathered with ``Shards.gather(...,
        stacked=True)``; if it is split over fsdp, its gather's transpose summed it over
        ``shards.loop_sums`` as well.

    Returns:
      A tuple of axis names of size > 1, in ``AXES`` order; empty when nothing is left to sum.

    Raises:
      ValueError: ``partial_over_tensor`` for a weight whose spec splits it over ``tensor`` (each
        device holds its own part; there is nothing replicated to be partial).
    """
    named = spec_axes(spec)
    if partial_over_tensor and tensor.AXIS in named:
        raise ValueError(
            f"partial_over_tensor=True for a weight split over {tensor.AXIS!r} (spec {spec}): "
            "a weight split over tensor is not replicated over it"
        )
    summed = set(shards.token_axes())
    # Every axis the spec names leaves the sum: fsdp because its gather's transpose (a
    # psum_scatter) already summed it; expert and stage because each device holds its own part.
    summed -= named
    if summed_in_loop and fsdp.AXIS in named:
        summed -= set(shards.loop_sums)
    if partial_over_tensor and shards.size(tensor.AXIS) > 1:
        summed.add(tensor.AXIS)
    # A weight every stage holds whole is used by some stages only (the embedding by the first,
    # the head by the last): the stages' parts add up to its gradient.
    if shards.size(STAGE) > 1 and STAGE not in named:
        summed.add(STAGE)
    return tuple(a for a in AXES if a in summed)
