"""The targets of docs/benchmarks.md, every limit in one table (``TARGETS``), and a run judged
against them.

``targets`` measures each line of ``TARGETS`` on a run's results (and its depth check); a target
is met when ``measured <= limit``. A stretch goal is reported but missing it is no failure;
``missed`` is what fails ``dew bench --check``: the targets, not stretch goals, that are not met.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Sequence

from dew.benchmark.measure import DidNotFit, Result, fitted, row_name
from dew.benchmark.ratios import layout_ratios
from dew.benchmark.rounds import DepthCheck

# The measures that are not a ratio of one shard_map row (``layout_ratios``' keys are).
FSDP_STATE = "fsdp_state"
COMPILE_DEPTH = "compile_depth"


@dataclasses.dataclass(frozen=True)
class Threshold:
    """One line of the targets table.

    Attributes:
      measure: what is measured: a key of ``dew.benchmark.ratios.layout_ratios`` (checked on every
        shard_map row that has it), ``FSDP_STATE`` (each ``fsdp=n`` layout run with ``data=n``)
        or ``COMPILE_DEPTH`` (the depth check).
      compares: what over what, the target's name after its subject; ``{n}``, ``{deep}`` and
        ``{shallow}`` are filled in from the measure.
      limit: ``measured <= limit`` meets it.
      why: what the limit holds the code to.
      stretch: a goal beyond the target: reported, and missing it fails nothing.
    """

    measure: str
    compares: str
    limit: float
    why: str
    stretch: bool = False

    def judge(self, subject: str, measured: float, **fields) -> Target:
        name = f"{subject}: {self.compares.format(**fields)}"
        return Target(name, measured, self.limit, self.stretch)


TARGETS: tuple[Threshold, ...] = (
    Threshold(
        "time_vs_gspmd",
        "step time shard_map / gspmd",
        1.05,
        "explicit collectives cost no time against XLA's partitioner on the same shardings, "
        "activations pinned (the strongest plain-JAX baseline); 5% for a shared machine's noise",
    ),
    Threshold(
        "time_vs_one_device",
        "step time shard_map / one device",
        1.10,
        "splitting the step costs at most 10% over the same arithmetic on one device (on "
        "simulated devices sharing the cores, the compute limit)",
    ),
    Threshold(
        "wire",
        "wire bytes shard_map / gspmd",
        1.0,
        "the hand-placed collectives send no more bytes than XLA's plan for the same layout",
    ),
    Threshold(
        "gspmd_wire",
        "wire bytes gspmd / shard_map",
        2.0,
        "the baseline is no strawman: a GSPMD plan sending over twice our bytes is not the plan "
        "a GSPMD user would run",
    ),
    Threshold(
        "time_vs_gspmd",
        "step time shard_map / gspmd",
        1.0,
        "no slower than the baseline at all",
        stretch=True,
    ),
    Threshold(
        "temp",
        "temp memory shard_map / gspmd",
        1.0,
        "no more temporary memory than the baseline",
        stretch=True,
    ),
    Threshold(
        "time_vs_one_device",
        "step time shard_map / one device",
        1.05,
        "within 5% of one device's arithmetic",
        stretch=True,
    ),
    Threshold(
        FSDP_STATE,
        "state per device / (data={n}'s / {n})",
        1.02,
        "fsdp=n holds 1/n of data=n's state per device, plus 2% for the small weights that stay "
        "whole (below min_shard) and the optimizer's step count",
    ),
    Threshold(
        COMPILE_DEPTH,
        "compile time {deep} layers / {shallow} layers",
        1.5,
        "the layers run in a scan, so a deeper model compiles in about the same time",
    ),
)


@dataclasses.dataclass(frozen=True)
class Target:
    """One target measured on a run: ``measured <= limit`` is met. A ``stretch`` goal is
    reported, but missing it is not a failure."""

    name: str
    measured: float
    limit: float
    stretch: bool = False

    @property
    def met(self) -> bool:
        return self.measured <= self.limit

    @property
    def verdict(self) -> str:
        """``met``, ``not yet`` (a stretch goal missed) or ``MISSED`` (a target missed)."""
        return "met" if self.met else ("not yet" if self.stretch else "MISSED")


def targets(results: Sequence[Result | DidNotFit], depth: DepthCheck | None = None) -> list[Target]:
    """Every line of ``TARGETS`` that ``results`` (and ``depth``) measure: the targets first,
    then the stretch goals; each in the order of the rows (per row, the order of ``TARGETS``),
    then the fsdp state, then the depth check. A contestant that did not fit measures nothing."""
    found = []
    for name, measured in layout_ratios(results).items():
        found += [t.judge(name, measured[t.measure]) for t in TARGETS if t.measure in measured]
    for layout, n, measured in _fsdp_state_ratios(results):
        found += [t.judge(layout, measured, n=n) for t in TARGETS if t.measure == FSDP_STATE]
    if depth is not None:
        subject = f"{depth.layout} {depth.engine}"
        fields = dict(deep=depth.deep_layers, shallow=depth.shallow_layers)
        found += [
            t.judge(subject, depth.ratio, **fields) for t in TARGETS if t.measure == COMPILE_DEPTH
        ]
    return sorted(found, key=lambda t: t.stretch)


def missed(found: Sequence[Target]) -> list[Target]:
    """The targets of ``found`` that are not met, stretch goals left out: what fails
    ``dew bench --check``."""
    return [t for t in found if not t.stretch and not t.met]


def _fsdp_state_ratios(results: Sequence[Result | DidNotFit]) -> Iterator[tuple[str, int, float]]:
    """``(layout, n, state(fsdp=n) / (state(data=n) / n))`` for each fully sharded layout
    (``fsdp=n``, nothing else) run beside ``data=n``: at most 1 plus what stays whole."""
    state: dict[tuple[str, str], int] = {}
    for r in fitted(results):
        state.setdefault((r.layout, r.variant), r.state_bytes_per_device)
    for (layout, variant), fsdp_bytes in state.items():
        if layout.startswith("fsdp=") and "," not in layout:
            n = int(layout.split("=")[1])
            data_bytes = state.get((f"data={n}", variant))
            if data_bytes:
                yield row_name(layout, None, None, variant), n, fsdp_bytes / (data_bytes / n)
