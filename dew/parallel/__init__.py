"""One module per parallelism technique; the step engine (``dew.training.step``) composes them.

- ``fsdp``: gather a layer's weights over ``fsdp`` just before it runs (the gradients come back
  reduce-scattered as the transpose of that gather).
- ``data``: sum gradients over the batch axes and average the loss over them.

Code inside the step sees a ``Shards``: the sizes of the mesh axes and the ``PartitionSpec`` of every
parameter. ``ONE_DEVICE`` (every axis of size 1, nothing split) makes the same code run on one device
without a collective, which is the reference every layout is tested against, and the global view the
GSPMD baseline compiles.
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
      param_specs: tree of ``PartitionSpec`` shaped like the parameters, or ``None`` when every weight
        is whole.
    """

    axis_sizes: Mapping[str, int] = dataclasses.field(default_factory=dict)
    param_specs: Any = None

    def size(self, *axes: str) -> int:
        """The number of devices spanned by ``axes`` (1 for axes this step does not have)."""
        return math.prod(self.axis_sizes.get(a, 1) for a in axes)

    def spec_of(self, *path: str, stacked: bool = False) -> Any:
        """The spec subtree at ``path`` of the parameters; ``stacked`` drops the leading layers dim."""
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


ONE_DEVICE = Shards()
