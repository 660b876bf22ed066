"""One module per parallelism technique; the step engine (``dew.training.step``) composes them.

- ``shards``: ``Shards``, the step's split as code on one device sees it, and ``ONE_DEVICE``.
- ``gradients``: the one rule that says which axes each weight's gradient is summed over.
- ``fsdp``: gather a layer's weights over ``fsdp`` just before it runs (the gradients come back
  reduce-scattered as the transpose of that gather).
- ``data``: sum gradients over the axes ``gradients`` names and the loss over the token axes.
- ``vocabulary``: with the vocabulary split over fsdp, the embedding, head and loss move the
  group's tokens rather than gather the table (when the tokens are fewer than its rows).
- ``tensor``: Megatron's conjugate pairs around attention and the MLP, the vocabulary-parallel
  embedding and cross-entropy, shared kv heads, and what a layout must split over ``tensor``.
- ``tensor_ring``: the same regions' entry and exit as collective matmuls (rings of ``ppermute``
  over ``tensor``, each block's matmul beside the next block's transfer), ``tensor_scheme="ring"``.
- ``sequence``: positions split in zigzag order; attention over every device's positions by a
  ring of K/V blocks (``ppermute``) or by trading positions for heads (``all_to_all``).
- ``expert``: mixture-of-experts layers with experts split over ``expert``; token copies travel
  to their experts and back by ``all_to_all``.
- ``pipeline``: the ``stage`` axis: each stage runs its contiguous run of layers on a 1F1B schedule
  of microbatches, activations forward and their gradients back by ``ppermute``.
- ``gspmd_kernel``: the GSPMD baseline's attention kernel in a ``shard_map`` over the rows and
  heads (XLA cannot partition a kernel's custom call), as a user's GSPMD code runs it.

Code inside the step sees a ``Shards``: the sizes of the mesh axes and the ``PartitionSpec`` of
every parameter. ``ONE_DEVICE`` (every axis of size 1, nothing split) makes the same code run on
one device without a collective, which is the reference every layout is tested against. The GSPMD
baseline compiles that same global view, with ``pinned_activations`` set: every block's input is
constrained to the batch split, as MaxText-style GSPMD models do, so XLA's partitioner keeps
activations split by rows rather than inventing a split of the model width.
"""

from __future__ import annotations

from dew.parallel.shards import ONE_DEVICE, Shards

__all__ = ["ONE_DEVICE", "Shards"]
