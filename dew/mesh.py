"""The device mesh: six named axes, and how many devices each one takes.

Axes, in mesh order:

- ``data``: a slice of the batch, whole weights.
- ``expert``: a subset of the experts of each MoE layer.
- ``fsdp``: a slice of the batch and 1/n of each large weight.
- ``tensor``: a Megatron split of heads, MLP width and vocabulary.
- ``sequence``: a slice of the positions.
- ``stage``: a contiguous run of layers (a pipeline: ``dew.parallel.pipeline``).

``data`` takes whatever devices the other axes leave over. ``microbatches`` is not an axis: it is
how many pipeline microbatches a step's batch is cut into when ``stage > 1``.

Named groups of axes (torchtitan's ``dp_shard_cp``-style names), defined here once; code says which
group it means:

- ``BATCH_AXES``: the axes a batch's rows are split over (``data``, ``expert``, ``fsdp``).
- ``TOKEN_AXES``: the axes that split the tokens, rows and positions (the batch axes and
  ``sequence``). The loss averages over them and gradients are summed over them
  (``dew.parallel.gradients``).

Device order is not axis order. ``dict(mesh.shape)`` lists the axes in ``AXES`` order, but the
devices behind them nest as ``DEVICE_NESTING`` (outermost first): ``tensor`` (the chattiest axis,
collectives inside every layer) innermost, on neighbouring device ids, then ``sequence``,
``expert``, ``fsdp``; ``data`` (one all-reduce a step) outermost, then ``stage``.
``jax.devices()`` lists each process's devices together, so a tensor group stays inside one
process where the sizes allow, and only ``data`` (then ``stage``) crosses processes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from dew.checks import comma_names, positive_int

AXES = ("data", "expert", "fsdp", "tensor", "sequence", "stage")
"""The mesh's six axis names, in mesh order: the order of ``dict(mesh.shape)`` and of
``MeshSpec.shape``. The devices behind them nest in ``DEVICE_NESTING``'s order."""
# The axes a batch's rows are split over, in mesh order.
BATCH_AXES = ("data", "expert", "fsdp")
# The axes that split the tokens (rows, then positions), in mesh order.
TOKEN_AXES = ("data", "expert", "fsdp", "sequence")
# How the devices nest, outermost first: device ids run fastest along ``tensor``.
DEVICE_NESTING = ("data", "stage", "fsdp", "expert", "sequence", "tensor")


# Where the device count comes from, for an error that a layout does not fit it.
DEVICE_COUNT_HINT = (
    "simulated CPU devices are set before JAX starts (dew's --cpu-devices N, or "
    "dew.training.runtime.prepare_process(cpu_devices=N) in Python); on accelerators, the "
    "count is the devices JAX sees (jax.devices())"
)


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """How many devices each mesh axis takes; ``data`` gets the rest.

    ``MeshSpec(fsdp=8)`` on eight devices is fully sharded; ``MeshSpec(fsdp=4)`` on eight devices is
    ``data 2 x fsdp 4``. The product of the axes but ``data`` must divide the device count.

    Attributes:
      fsdp, expert, tensor, sequence, stage: devices on each axis (default 1; the module's
        docstring says what each splits).
      data: the data-parallel size expected, checked against the devices the others leave;
        ``None`` (the default): whatever they leave.
      microbatches: pipeline microbatches per step, only with ``stage > 1`` (below).

    ``microbatches``: with ``stage = S > 1``, the ``M >= S`` pipeline microbatches each device's
    rows are cut into (consecutive rows; with ``accumulation = A`` the pipeline runs ``A x M`` of
    them, see ``dew.training.step``). The pipeline's idle share is ``(S - 1) / (M + S - 1)``, so a
    larger ``M`` idles less but runs smaller matmuls; the rows a device holds per step must divide
    by ``A x M``. A mesh can be built without it (``build_mesh`` does not read it); the ``Trainer``
    asks for it when ``stage > 1``, because no default suits every batch.

    Raises:
      ValueError: a size below 1, ``microbatches`` without ``stage > 1`` or below ``stage``;
        ``shape`` (the ``Trainer`` calls it): the axes do not divide the devices, or ``data``
        is not what they leave.

    Examples:
        >>> from dew import MeshSpec
        >>> MeshSpec(fsdp=2, tensor=2).shape(8)
        {'data': 2, 'expert': 1, 'fsdp': 2, 'tensor': 2, 'sequence': 1, 'stage': 1}
        >>> MeshSpec.parse("stage=2,microbatches=4") == MeshSpec(stage=2, microbatches=4)
        True
    """

    fsdp: int = 1
    expert: int = 1
    tensor: int = 1
    sequence: int = 1
    stage: int = 1
    # Optional: the data-parallel size you expect; checked against the devices left over.
    data: int | None = None
    # Pipeline microbatches per step (per accumulation microbatch), with stage > 1 only.
    microbatches: int | None = None

    def __post_init__(self):
        if self.data is not None:
            positive_int("MeshSpec.data", self.data)
        for name in AXES[1:]:
            positive_int(f"MeshSpec.{name}", getattr(self, name))
        if self.microbatches is not None:
            positive_int("MeshSpec.microbatches", self.microbatches)
            if self.stage == 1:
                raise ValueError(
                    f"MeshSpec(microbatches={self.microbatches}) needs stage > 1: microbatches "
                    "are what a pipeline over the stage axis runs (use accumulation to cut a "
                    "batch without one)"
                )
            if self.microbatches < self.stage:
                raise ValueError(
                    f"MeshSpec(stage={self.stage}, microbatches={self.microbatches}): microbatches "
                    f"must be at least stage {self.stage}, or some stage never has work while "
                    "the others run"
                )

    @property
    def model_devices(self) -> int:
        """Devices one copy of the data-parallel group spans: the product of every axis but
        ``data``."""
        return math.prod(getattr(self, name) for name in AXES[1:])

    def shape(self, device_count: int) -> dict[str, int]:
        """The size of every axis, ``data`` included, on ``device_count`` devices, in ``AXES``
        order.

        Raises:
          ValueError: ``model_devices`` does not divide ``device_count``, or ``data`` was given
            and is not what is left.
        """
        if device_count % self.model_devices:
            named = " x ".join(f"{n} {getattr(self, n)}" for n in AXES[1:] if getattr(self, n) > 1)
            raise ValueError(
                f"{named} = {self.model_devices} devices does not divide the {device_count} "
                f"devices available; {DEVICE_COUNT_HINT}"
            )
        data = device_count // self.model_devices
        if self.data is not None and self.data != data:
            raise ValueError(
                f"mesh asks for data={self.data}, but {device_count} devices over "
                f"{self.model_devices} per model copy leave data={data}"
            )
        return {"data": data, **{name: getattr(self, name) for name in AXES[1:]}}

    @classmethod
    def parse(cls, text: str) -> "MeshSpec":
        """Reads ``"fsdp=4,tensor=2"`` (``--mesh``'s form); ``data=N`` is kept and checked
        against the device count; ``"stage=4,microbatches=8"`` sets the pipeline's microbatches;
        ``""`` is ``MeshSpec()``.

        Raises:
          ValueError: an entry that is not ``AXIS=SIZE`` with a known axis, an axis given twice,
            a size that is not an integer, or what the constructor refuses.
        """
        sizes = {}
        names = (*AXES, "microbatches")
        # "" (no axis given) is the default layout; an empty entry between commas is a typo.
        for part in comma_names("mesh", text) if text.strip() else ():
            name, sep, value = part.partition("=")
            name = name.strip()
            if not sep or name not in names:
                raise ValueError(
                    f"mesh entry {part!r} is not AXIS=SIZE with AXIS one of {', '.join(AXES)} "
                    "(or microbatches=M)"
                )
            if name in sizes:
                raise ValueError(
                    f"mesh {text!r} gives {name} twice ({name}={sizes[name]} and {part}); give "
                    "each axis once, with the size it should have"
                )
            try:
                sizes[name] = int(value)
            except ValueError:
                raise ValueError(
                    f"mesh entry {part!r}: size {value.strip()!r} is not an integer"
                ) from None
        return cls(**sizes)


def build_mesh(spec: MeshSpec = MeshSpec(), devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with axes ``data, expert, fsdp, tensor, sequence, stage`` over ``devices``
    (default: all of them, host by host: ordered by process, then id).

    The devices, in that order or the order given, fill ``DEVICE_NESTING`` (``tensor`` fastest,
    ``data`` slowest), so a tensor group is consecutive devices and a data group strides over
    everything else. With only ``data`` and ``fsdp`` above 1 this is the plain reshape in ``AXES``
    order. Host by host matters on a TPU pod, whose device ids run over the chips' coordinates
    rather than host by host (on a ``4x4x4`` slice ids 2 and 3 are on the second host): ordered by
    id alone, a tensor group of 4 would span two hosts.

    Axes are ``Auto``: inside a ``shard_map`` every axis is manual anyway, and outside it (the GSPMD
    baseline, ``device_put``) XLA may propagate shardings freely.
    """
    if devices is None:
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    devices = list(devices)
    shape = spec.shape(len(devices))
    nested = np.asarray(devices, dtype=object).reshape(tuple(shape[a] for a in DEVICE_NESTING))
    grid = nested.transpose(tuple(DEVICE_NESTING.index(a) for a in AXES))
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))
