"""``Shards``: how the step is split, as code running on one device's shards sees it.

Every function of ``dew.parallel`` and every model takes one. ``ONE_DEVICE`` (every axis of size 1,
nothing split) makes the same code run on one device without a collective, which is the reference
every layout is tested against.

The named groups of axes live in ``dew.mesh`` (``BATCH_AXES``, ``TOKEN_AXES``); ``Shards`` says
which of a group this step actually splits over (``batch_axes()``, ``token_axes()``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax
from jax.sharding import PartitionSpec as P

from dew.mesh import AXES, BATCH_AXES, TOKEN_AXES
from dew.parallel import fsdp
from dew.parallel.options import StepOptions

__all__ = ["BATCH_AXES", "ONE_DEVICE", "Shards", "TOKEN_AXES"]


@dataclasses.dataclass(frozen=True)
class Shards:
    """How the step is split, as code running on one device's shards sees it.

    Attributes:
      axis_sizes: mesh axis name -> size; empty on one device.
      param_specs: tree of ``PartitionSpec`` shaped like the parameters, or ``None`` when every
        weight is whole.
      pinned_activations: the GSPMD baseline only (code that runs on the global arrays): the
        sharding ``pin`` constrains activations to; ``None`` leaves them alone.
      options: the ``StepOptions`` (sequence-parallel activations, the sequence scheme, the
        pipeline schedule), checked against the mesh by the ``Trainer``.
      microbatches: over a ``stage`` axis of size > 1, the pipeline microbatches each
        accumulation microbatch's rows are cut into (``MeshSpec.microbatches``); 1 elsewhere.
      fsdp_scatter_stages: the group sizes the fsdp gradient sum runs in, outermost first
        (``dew.parallel.fsdp.scatter_stages`` of the mesh: two on a 3-D TPU torus that fsdp
        fills, where one reduce-scatter would be compiled as an all-reduce); ``()``: one
        ``psum_scatter`` over the axis.
      fsdp_tpu_layout: the fsdp gradient sums laid out for the TPU compiler
        (``dew.parallel.fsdp.scatter_along``; set by the ``Trainer`` on TPU devices); elsewhere
        each gradient is scattered along its own split dimension, with no transpose.
      fsdp_ring: the fsdp gathers and their gradient sums run as rings of ``ppermute`` s
        (``StepOptions(fsdp_scheme="ring")``: on a 3-D TPU torus the compiler overlaps those
        with compute, and no ``all_gather``); it replaces ``fsdp_scatter_stages``. ``False``:
        ``all_gather`` and ``psum_scatter``.
      tensor_ring: the Megatron regions' entry and exit run as collective matmuls, rings of
        ``ppermute`` s over ``tensor`` (``StepOptions(tensor_scheme="ring")``,
        ``dew.parallel.tensor_ring``); ``False``: ``dew.parallel.tensor``'s pairs.
      loop_sums: the axes beyond ``fsdp`` the layer loop's gathers sum their weights' gradients
        over, inside the loop (``dew.parallel.fsdp.loop_sum_axes``, set by the step engine);
        ``dew.parallel.gradients.sum_axes`` leaves them out of the step's tail for those weights.
      rounding_key: under ``StepOptions(quantize="int8")``, the key (key data) that the int8
        gradients' stochastic rounding draws from (``dew.nn.quantized``): the training step's,
        folded with the device's index over the token axes, then with the microbatch's number
        and the layer's as the step reaches them; ``None`` outside a training step (the
        gradients then round to nearest).
    """

    axis_sizes: Mapping[str, int] = dataclasses.field(default_factory=dict)
    param_specs: Any = None
    pinned_activations: Any = None
    options: StepOptions = StepOptions()
    microbatches: int = 1
    fsdp_scatter_stages: tuple[int, ...] = ()
    fsdp_tpu_layout: bool = False
    fsdp_ring: bool = False
    tensor_ring: bool = False
    loop_sums: tuple[str, ...] = ()
    rounding_key: Any = None

    def size(self, *axes: str) -> int:
        """The number of devices spanned by ``axes`` (1 for axes this step does not have)."""
        return math.prod(self.axis_sizes.get(a, 1) for a in axes)

    def split_over(self, group: tuple[str, ...]) -> tuple[str, ...]:
        """The axes of ``group`` this step splits over (sizes above 1), in mesh order."""
        return tuple(a for a in AXES if a in group and self.size(a) > 1)

    def batch_axes(self) -> tuple[str, ...]:
        """The axes splitting the batch's rows here (``BATCH_AXES`` of size > 1), in mesh order."""
        return self.split_over(BATCH_AXES)

    def token_axes(self) -> tuple[str, ...]:
        """The axes splitting the tokens here (``TOKEN_AXES`` of size > 1), in mesh order: the
        loss averages over them and gradients are summed over them."""
        return self.split_over(TOKEN_AXES)

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

    def gather(
        self,
        tree: Any,
        *path: str,
        stacked: bool = False,
        in_matmuls: tuple[str, ...] = (),
        int8: Any = None,
    ) -> Any:
        """The weights ``tree`` (found at ``path`` in the parameters) with their fsdp split undone.

        ``stacked=True`` for one layer's slice of the stacked ``layers`` weights, inside the
        layer loop: its backward also sums the split weights' gradients over ``loop_sums``.
        ``in_matmuls``: keys of ``tree`` whose weights only an einsum takes
        (``dew.nn.param.project``); under ``fsdp_ring`` those stay split until it. ``int8``: the
        int8 projections' weights, gathered as int8 (``dew.parallel.fsdp.gather``).
        """
        also_sum = self.loop_sums if stacked else ()
        specs = self.spec_of(*path, stacked=stacked)
        return fsdp.gather(tree, specs, self, also_sum, in_matmuls, int8)

    def pin(self, x: jax.Array) -> jax.Array:
        """``x`` (activations ``[rows, ...]``) constrained to ``pinned_activations``; else ``x``."""
        if self.pinned_activations is None:
            return x
        return jax.lax.with_sharding_constraint(x, self.pinned_activations)


ONE_DEVICE = Shards()
