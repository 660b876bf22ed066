"""TPU slices by their Cloud names, as devices this machine can compile for.

``target("v5p-64")`` is a ``Target``: the slice's chips, hosts, and each chip's memory and peak
FLOP/s. ``Target.devices()`` returns its devices from ``libtpu`` (the optional extra ``tpu``,
``pip install -e ".[tpu]"``) without a TPU attached: a step lowered on them compiles with the real
TPU compiler, so its ``memory_analysis()`` and HLO are the slice's (``dew.planning``).

Names follow Cloud TPU's accelerator types:

- ``v4-N`` and ``v5p-N``: N counts TensorCores, two per chip; JAX sees one device per chip
  (megacore), so ``v5p-64`` is 32 chips, 32 devices, 8 hosts of 4 chips.
- ``v5e-N`` (Cloud's ``v5litepod-N``) and ``v6e-N``: N counts chips, one TensorCore each;
  ``v5e-8`` is one host of 8 chips, larger slices are hosts of 4.
- A raw topology, ``v5p:4x4x4`` or ``v5e:4x8``: the chips along each torus dimension.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
from functools import cached_property

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Generation:
    """One TPU chip generation.

    ``hbm_bytes`` and ``peak_bf16_flops`` are per chip (per JAX device), as Cloud TPU's system
    architecture pages give them: https://cloud.google.com/tpu/docs/v4,
    https://cloud.google.com/tpu/docs/v5e, https://cloud.google.com/tpu/docs/v5p and
    https://cloud.google.com/tpu/docs/v6e. The pages write "GB"; the HBM stacks are binary sizes,
    so the table holds GiB. The runtime keeps a little of it for itself, so a plan that fits by
    less than a few hundred MiB is tight.
    """

    name: str
    device_kind: str  # what jax.Device.device_kind says on this chip
    dims: int  # torus dimensions: 3 (v4, v5p) or 2 (v5e, v6e)
    cores_per_chip: int  # TensorCores a Cloud name counts per chip (2 for megacore chips)
    hbm_bytes: int
    peak_bf16_flops: float
    # Chips one host holds in a slice larger than one host, along each dimension.
    host_bounds: tuple[int, int, int]
    # The largest slice that is one host (its chips), and the largest slice there is.
    single_host_chips: int
    max_chips: int
    # What the TPU compiler lets one program use of a chip's HBM (arguments, temporaries and code
    # together), as libtpu 0.0.42.1 states it when it refuses a program ("exceeds available HBM
    # (15.75G)", to 0.01 GiB): the runtime keeps the rest.
    usable_hbm_bytes: int = 0
    # What a chip can send over its inter-chip links a second, all of them at once: half the
    # "bidirectional ICI bandwidth per chip" of Cloud TPU's pages (v5e 400 GB/s, v5p 1,200 GB/s,
    # v6e 800 GB/s; v4: six links of 400 Gb/s each way, 600 GB/s). ``dew plan`` divides exposed
    # wire bytes by it: a lower bound on their time, since a ring on one torus axis sends on two
    # of the chip's 4 (2-D) or 6 (3-D) links (docs/planning.md).
    ici_send_bytes_per_s: float = 0.0


GENERATIONS = {
    "v4": Generation(
        "v4", "TPU v4", 3, 2, 32 * GIB, 275e12, (2, 2, 1), 4, 4096, int(30.75 * GIB), 300e9
    ),
    "v5e": Generation(
        "v5e", "TPU v5 lite", 2, 1, 16 * GIB, 197e12, (2, 2, 1), 8, 256, int(15.75 * GIB), 200e9
    ),
    "v5p": Generation(
        "v5p", "TPU v5", 3, 2, 95 * GIB, 459e12, (2, 2, 1), 4, 6144, int(95.74 * GIB), 600e9
    ),
    "v6e": Generation(
        "v6e", "TPU v6 lite", 2, 1, 32 * GIB, 918e12, (2, 2, 1), 8, 256, int(31.25 * GIB), 400e9
    ),
}
ALIASES = {"v5litepod": "v5e", "v5lite": "v5e"}

# Two-dimensional slices by chip count (Cloud TPU's v5e and v6e pages).
_FLAT_SHAPES = {
    1: (1, 1),
    4: (2, 2),
    8: (2, 4),
    16: (4, 4),
    32: (4, 8),
    64: (8, 8),
    128: (8, 16),
    256: (16, 16),
}
# Three-dimensional slices smaller than one 4x4x4 cube (Cloud TPU's v4 and v5p pages); from 64
# chips on, a slice is whole cubes: every dimension a multiple of 4.
_SMALL_CUBOIDS = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4)}


def _cuboid(chips: int) -> tuple[int, int, int] | None:
    """The slice of ``chips`` chips Cloud TPU builds from whole 4x4x4 cubes: the most balanced
    ``4a x 4b x 4c`` (smallest largest side, then largest smallest side), sides ascending; or
    ``None``. Matches the shapes Cloud's v5p page lists (``v5p-640`` is ``4x4x20``)."""
    if chips in _SMALL_CUBOIDS:
        return _SMALL_CUBOIDS[chips]
    if chips % 64:
        return None
    cubes = chips // 64
    best = None
    for a in range(1, cubes + 1):
        for b in range(a, cubes + 1):
            if cubes % (a * b) or cubes // (a * b) < b:
                continue
            sides = (a, b, cubes // (a * b))
            key = (max(sides), -min(sides))
            if best is None or key < best[0]:
                best = (key, sides)
    return None if best is None else tuple(4 * s for s in best[1])


def _shape_for_chips(gen: Generation, chips: int) -> tuple[int, ...] | None:
    if chips > gen.max_chips:
        return None
    return _FLAT_SHAPES.get(chips) if gen.dims == 2 else _cuboid(chips)


def _valid_shape(gen: Generation, shape: tuple[int, ...]) -> bool:
    if len(shape) != gen.dims or math.prod(shape) > gen.max_chips:
        return False
    if gen.dims == 2:
        return tuple(sorted(shape)) in _FLAT_SHAPES.values()
    if math.prod(shape) < 64:
        return tuple(sorted(shape)) in {tuple(sorted(s)) for s in _SMALL_CUBOIDS.values()}
    return all(side % 4 == 0 for side in shape)


def _type_sizes(gen: Generation) -> list[int]:
    """The N of every ``<gen>-N`` this module knows, ascending."""
    if gen.dims == 2:
        chips = list(_FLAT_SHAPES)
    else:
        chips = [*_SMALL_CUBOIDS, *range(64, gen.max_chips + 1, 64)]
    return [c * gen.cores_per_chip for c in chips if c <= gen.max_chips]


@dataclasses.dataclass(frozen=True)
class Target:
    """A TPU slice: its generation and the chips along each torus dimension.

    ``name`` is what it was asked for as (``"v5p-64"`` or ``"v5p:2x4x4"``).
    """

    name: str
    generation: Generation
    shape: tuple[int, ...]

    @property
    def chips(self) -> int:
        """Chips in the slice, which is also its JAX devices."""
        return math.prod(self.shape)

    @property
    def topology(self) -> str:
        """``libtpu``'s name for the slice, e.g. ``"v5p:2x4x4"``."""
        return f"{self.generation.name}:{'x'.join(map(str, self.shape))}"

    @property
    def cloud_type(self) -> str:
        """Cloud TPU's accelerator type, e.g. ``"v5p-64"`` or ``"v5litepod-8"``."""
        gen = self.generation
        prefix = "v5litepod" if gen.name == "v5e" else gen.name
        return f"{prefix}-{self.chips * gen.cores_per_chip}"

    @property
    def chips_per_host(self) -> tuple[int, ...]:
        gen = self.generation
        if self.chips <= gen.single_host_chips:
            return self.shape + (1,) * (3 - len(self.shape))
        return gen.host_bounds

    @property
    def hosts(self) -> int:
        return self.chips // math.prod(self.chips_per_host)

    @property
    def hbm_bytes(self) -> int:
        """Memory of one chip (one device)."""
        return self.generation.hbm_bytes

    @property
    def usable_bytes(self) -> int:
        """What the TPU compiler lets one program use of a chip's memory (``Generation``)."""
        return self.generation.usable_hbm_bytes

    @property
    def ici_send_bytes_per_s(self) -> float:
        """What one chip can send over its inter-chip links a second (``Generation``)."""
        return self.generation.ici_send_bytes_per_s

    def describe(self) -> str:
        hosts = f"{self.hosts} host" + ("s" if self.hosts > 1 else "")
        return (
            f"{self.name}: {self.topology}, {self.chips} chips ({self.generation.device_kind}, "
            f"{self.hbm_bytes / GIB:.0f} GiB each), {hosts}"
        )

    @cached_property
    def _devices(self) -> list:
        require_libtpu()
        from jax.experimental import topologies

        shape3 = self.shape + (1,) * (3 - len(self.shape))
        # Whole cubes (and the 16x16 v5e/v6e slice) close their torus; smaller slices do not.
        if self.generation.dims == 3:
            wrap = (self.chips >= 64,) * 3
        else:
            wrap = tuple(side == 16 for side in shape3[:2]) + (False,)
        devices = topologies.get_topology_desc(
            topology_name=self.topology,
            platform="tpu",
            chip_config_name="megacore" if self.generation.cores_per_chip == 2 else "default",
            chips_per_host_bounds=self.chips_per_host,
            num_slices=1,
            wrap=wrap,
        ).devices
        if len(devices) != self.chips:
            raise RuntimeError(
                f"libtpu gave {len(devices)} devices for {self.topology}, expected {self.chips}"
            )
        # Host by host, as jax.devices() lists a real pod's (dew.mesh nests axes on that order).
        return sorted(devices, key=lambda d: (d.process_index, d.id))

    def devices(self) -> list:
        """The slice's devices (compile-only: a step lowered on them compiles for this slice and
        cannot run), host by host. Needs ``libtpu`` (``pip install -e '.[tpu]'``)."""
        return list(self._devices)


# What libtpu needs to hear before it loads, to compile for a slice with no TPU attached: not to
# probe the Cloud metadata server for the TPU it runs on (it warns at length when there is none),
# and to let several processes load it (its lock file otherwise admits one at a time).
COMPILE_ONLY_ENVIRONMENT = {
    "TPU_SKIP_MDS_QUERY": "1",
    "TPU_WORKER_HOSTNAMES": "localhost",
    "TPU_ACCELERATOR_TYPE": "v5litepod-8",
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
}


def compile_only_environment() -> None:
    """Sets ``COMPILE_ONLY_ENVIRONMENT`` where the environment does not say otherwise. For a
    process that only compiles for TPU (``dew plan``, the tests); not for one that trains on a
    TPU, whose libtpu must find the TPU it runs on. Call it before ``libtpu`` loads."""
    for name, value in COMPILE_ONLY_ENVIRONMENT.items():
        os.environ.setdefault(name, value)


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message names the extra that brings it."""


def require_libtpu() -> None:
    """Raises ``MissingExtra`` naming the extra when ``libtpu`` is not installed."""
    if importlib.util.find_spec("libtpu") is None:
        raise MissingExtra(
            "compiling for a TPU slice needs libtpu, the TPU compiler: pip install -e '.[tpu]' "
            "(it runs on a machine with no TPU)"
        )


_TYPE = re.compile(r"^(v\d+[a-z]*)-(\d+)$")
_TOPOLOGY = re.compile(r"^(v\d+[a-z]*):(\d+(?:x\d+)*)$")


def _generation(name: str, asked: str) -> Generation:
    key = ALIASES.get(name, name)
    if key not in GENERATIONS:
        known = ", ".join([*GENERATIONS, *ALIASES])
        raise ValueError(f"unknown TPU generation {name!r} in {asked!r}; known: {known}")
    return GENERATIONS[key]


def valid_types(generation: str) -> list[str]:
    """Every ``<generation>-N`` this module accepts, smallest first."""
    gen = _generation(generation, generation)
    return [f"{gen.name}-{n}" for n in _type_sizes(gen)]


def target(spec: str) -> Target:
    """The slice named ``spec``: a Cloud TPU type (``"v5p-64"``, ``"v5e-8"``,
    ``"v5litepod-16"``, ``"v6e-256"``, ``"v4-32"``) or a raw topology (``"v5p:4x4x4"``).

    Raises ``ValueError`` naming the valid sizes when ``spec`` is not a slice there is."""
    if not isinstance(spec, str):
        raise TypeError(f"a TPU target is a string such as 'v5p-64', got {type(spec).__name__}")
    text = spec.strip().lower()
    if m := _TYPE.match(text):
        gen = _generation(m.group(1), spec)
        n = int(m.group(2))
        chips, rest = divmod(n, gen.cores_per_chip)
        shape = None if rest else _shape_for_chips(gen, chips)
        if shape is None:
            counts = (
                "TensorCores, two per chip" if gen.cores_per_chip == 2 else "chips, one core each"
            )
            sizes = _type_sizes(gen)
            shown = ", ".join(f"{gen.name}-{s}" for s in sizes[:12])
            more = f", ... up to {gen.name}-{sizes[-1]}" if len(sizes) > 12 else ""
            raise ValueError(
                f"{spec!r} is not a {gen.name} slice: the N in {gen.name}-N counts {counts}; "
                f"valid: {shown}{more}"
            )
        return Target(spec, gen, shape)
    if m := _TOPOLOGY.match(text):
        gen = _generation(m.group(1), spec)
        shape = tuple(int(s) for s in m.group(2).split("x"))
        if not _valid_shape(gen, shape):
            if gen.dims == 2:
                rule = "one of " + ", ".join("x".join(map(str, s)) for s in _FLAT_SHAPES.values())
            else:
                rule = (
                    "3 sides: 2x2x1, 2x2x2, 2x2x4, 2x4x4, or whole 4x4x4 cubes (every side a "
                    f"multiple of 4), at most {gen.max_chips} chips"
                )
            raise ValueError(f"{spec!r} is not a {gen.name} topology: it must be {rule}")
        return Target(spec, gen, shape)
    raise ValueError(
        f"{spec!r} is not a TPU target: give a Cloud TPU type such as v5e-8, v5p-64, v6e-16 or "
        "v4-32, or a topology such as v5p:4x4x4"
    )
