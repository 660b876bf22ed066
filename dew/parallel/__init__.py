"""One module per parallelism technique; the step engine (``dew.training.step``) composes them.

- ``fsdp``: gather a layer's weights over ``fsdp`` just before it runs (the gradients come back
  reduce-scattered as the transpose of that gather).
- ``data``: sum gradients over the batch axes and average the loss over them.
- ``tensor``: Megatron's conjugate pairs, the vocabulary-parallel embedding and cross-entropy
  (building blocks, not yet wired into the decoder).

Code inside the step sees a ``Shards``: the sizes of the mesh axes and the ``PartitionSpec`` of
every parameter. ``ONE_DEVICE`` (every axis of size 1, nothing split) makes the same code run on
one device without a collective, which is the reference every layout is tested against. The GSPMD
baseline compiles that same global view, with ``pinned_activations`` set: every block's input is
constrained to the batch split, as MaxText-style GSPMD models do, so XLA's partitioner keeps
activations split by rows rather than inventing a split of the model width.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class Shards:
    """How the step is split, as code running on one device's shards sees it.

    Attributes:
      axis_sizes: mesh axis name -> size; empty on one device.
      param_specs: tree of ``PartitionSpec`` shaped like the parameters, or ``None`` when every
        weight is whole.
      pinned_activations: the GSPMD baseline only (code that runs on the global arrays): the
        sharding ``pin`` constrains activations to; ``None`` leaves them alone.
    """

    axis_sizes: Mapping[str, int] = dataclasses.field(default_factory=dict)
    param_specs: Any = None
    pinned_activations: Any = None

    def size(self, *axes: str) -> int:
        """The number of devices spanned by ``axes`` (1 for axes this step does not have)."""
        return math.prod(self.axis_sizes.get(a, 1) for a in axes)

    def spec_of(self, *path: str, stacked: bool = False) -> Any:
        """The spec subtree at ``path`` of the parameters; ``stacked`` drops the leading layers
        dim."""
        specs = self.param_specs
        if specs is None:
            return None
        for key in path:
            specs = specs[key]
        if stacked:
            specs = jax.tree_util.tree_map(
                lambda s: P(*tuple(s)[1:]), specs, is_leaf=lambda x: isinstance(x, P)
            )
        return specs

    def gather(self, tree: Any, *path: str, stacked: bool = False) -> Any:
        """The weights ``tree`` (found at ``path`` in the parameters) with their fsdp split undone.

        ``stacked=True`` for one layer's slice of the stacked ``layers`` weights.
        """
        from dew.parallel import fsdp

        return fsdp.gather(tree, self.spec_of(*path, stacked=stacked), self)

    def pin(self, x: jax.Array) -> jax.Array:
        """``x`` (activations ``[rows, ...]``) constrained to ``pinned_activations``; else ``x``."""
        if self.pinned_activations is None:
            return x
        return jax.lax.with_sharding_constraint(x, self.pinned_activations)


ONE_DEVICE = Shards()
