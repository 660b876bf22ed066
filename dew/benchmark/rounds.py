"""The contestants taking turns: ``compare`` (layouts and engines side by side) and
``compile_depth`` (one step's compile time at two depths).

Who runs. ``compare`` runs every layout with every engine, then the one-device row
(``ONE_DEVICE``). The step options asked apply to the shard_map engine where the layout has the
axis each one needs (``options_for``): ``sequence_parallel`` on a ``tensor`` axis above 1, a
sequence scheme on a ``sequence`` axis above 1, a pipeline schedule on a ``stage`` axis above 1.
Such a layout gets one shard_map contestant per scheme and per schedule asked, and its GSPMD
baseline once, with the default options (the only ones a GSPMD engine takes); a row's ``name``
(``"sequence=8 (all_to_all)"``) tells them apart. Each contestant's ``Trainer`` checks its
options against its mesh (``StepOptions.check``) before anything compiles.

Pipelines. A layout with ``stage > 1`` is written ``stage=4,microbatches=8``. Each of its
shard_map contestants records ``bubble_formula``, ``(S - 1) / (M + S - 1)``, and
``bubble_measured``, the idle share of its step measured from two step times: its own, ``T(M)``,
and ``T(2M)`` of a twin run in the same rounds with twice the microbatches and twice the batch (so
the same rows per microbatch; ``double_step_ms``). A step of ``M`` microbatches takes ``T(M) = M c
+ b``, with ``c`` the time one more microbatch adds and ``b`` what does not grow with ``M`` (the
bubble, and the optimizer update and gradient sums around it), so ``bubble_measured = 1 - M c /
T(M) = 2 - T(2M) / T(M)``, the median over the rounds. On devices that compute in parallel it is
the share of the step a stage idles (plus the step's fixed work); simulated CPU devices share the
machine's cores, so an idle stage lends them to the busy ones and hides most of its bubble there.

Turns. The machines this runs on are shared and noisy, so times are only compared as ratios
measured in one run. The contestants take turns, ``steps`` steps each per round; the contestants of
a mesh run back to back (their order alternating), and the order of the meshes (the one-device row
among them) rotates every round. A time ratio (``dew.benchmark.ratios``) is the median over rounds
of the ratio of two contestants' steps in that round, so the load of other processes, which
drifts on the scale of seconds, mostly falls on both sides of each ratio. ``warmup`` rounds run
first and are not counted. Bytes do not depend on the clock and are exact.

Sharing the devices. Only the contestant whose turn it is holds device memory: each builds its
state and parks it in host memory (``Contestant.prepare``), and a turn puts the state and batch
on the devices, runs the steps and parks the new state again (``Contestant.run``; the copies are
not timed). So the contestants need, at once, the device memory of the largest alone, not the
sum of their states: eight GPT-2-small contestants (1.4 GiB of state each) on one 16 GiB chip.
The compiled steps stay. A contestant that does not fit even alone (the compiler refuses its
step, or building its state or running a step raises ``RESOURCE_EXHAUSTED``) leaves the rounds,
its memory freed, and its row is a ``DidNotFit``: what it needed and what the device has; the
others run on. Any other error propagates.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
from typing import Callable, Sequence

import jax

from dew.benchmark.measure import (
    COMPILE,
    ONE_DEVICE,
    PREPARE,
    RUN,
    Contestant,
    DidNotFit,
    ModelSize,
    Result,
    out_of_memory,
    variant_text,
)
from dew.checks import nonnegative_int, positive_int
from dew.layout import Layout
from dew.mesh import MeshSpec
from dew.parallel.options import StepOptions
from dew.parallel.pipeline import SCHEDULES
from dew.parallel.sequence import SCHEMES
from dew.training.step import ENGINES

DEFAULT_ENGINES = ("shard_map", "gspmd")


@dataclasses.dataclass(frozen=True)
class DepthCheck:
    """Compile time of the same step at two depths (medians over alternating compiles)."""

    layout: str
    engine: str
    shallow_layers: int
    deep_layers: int
    shallow_s: float
    deep_s: float

    @property
    def ratio(self) -> float:
        return self.deep_s / self.shallow_s


def options_for(asked: StepOptions, mesh: MeshSpec, engine: str) -> StepOptions:
    """The part of ``asked`` that takes effect with ``engine`` on ``mesh``: for the shard_map
    engine, ``sequence_parallel`` where ``tensor > 1``, the scheme where ``sequence > 1``, the
    schedule where ``stage > 1``, the default elsewhere; for the GSPMD engines (and the one-device
    row) the default. What is left, the ``Trainer`` checks (a ring inside a pipeline, positions
    that do not split over tensor)."""
    default = StepOptions()
    if engine != "shard_map":
        return default
    return StepOptions(
        sequence_parallel=asked.sequence_parallel and mesh.tensor > 1,
        sequence_scheme=asked.sequence_scheme if mesh.sequence > 1 else default.sequence_scheme,
        pipeline_schedule=(
            asked.pipeline_schedule if mesh.stage > 1 else default.pipeline_schedule
        ),
    )


def _asked_options(
    sequence_parallel: bool, sequence_schemes: Sequence[str], pipeline_schedules: Sequence[str]
) -> list[StepOptions]:
    """Every scheme with every schedule, each a ``StepOptions`` (which checks the names)."""
    if not sequence_schemes:
        raise ValueError(f"no sequence schemes; expected some of {', '.join(SCHEMES)}")
    if not pipeline_schedules:
        raise ValueError(f"no pipeline schedules; expected some of {', '.join(SCHEDULES)}")
    return [
        StepOptions(sequence_parallel, scheme, schedule)
        for scheme in sequence_schemes
        for schedule in pipeline_schedules
    ]


def _mesh_specs(layouts: Sequence[MeshSpec | str]) -> list[MeshSpec]:
    if not layouts:
        raise ValueError("no layouts to compare; give at least one, e.g. ['fsdp=8']")
    specs = []
    for layout in layouts:
        if isinstance(layout, str):
            layout = MeshSpec.parse(layout)
        elif not isinstance(layout, MeshSpec):
            raise ValueError(f"a layout is a MeshSpec or text like 'data=2,fsdp=4', got {layout!r}")
        specs.append(layout)
    return specs


def _twin(c: Contestant, objective, min_shard: int, seed: int) -> Contestant:
    """``c``'s pipeline at twice the microbatches and twice the batch (the same rows per
    microbatch): ``T(2M)`` for ``bubble_measured``. It runs in ``c``'s group, and is no row."""
    twin = Contestant(
        objective,
        dataclasses.replace(c.size, batch=2 * c.size.batch),
        dataclasses.replace(c.trainer.mesh_spec, microbatches=2 * c.microbatches),
        c.engine,
        min_shard,
        seed,
        c.options,
        c.variant,
    )
    twin.group = c.group
    c.twin = twin
    return twin


def _turn_order(groups: list[list[Contestant]], round_: int) -> list[Contestant]:
    """Who runs when in round ``round_``: a group's contestants back to back, their order
    reversed every other round; the groups' order rotating by one every round."""
    shift = round_ % len(groups)
    return [
        c
        for group in groups[shift:] + groups[:shift]
        for c in (group if round_ % 2 == 0 else group[::-1])
    ]


def compare(
    size: ModelSize,
    layouts: Sequence[MeshSpec | str],
    engines: Sequence[str] = DEFAULT_ENGINES,
    *,
    one_device: bool = True,
    steps: int = 1,
    repeats: int = 3,
    warmup: int = 0,
    min_shard: int = Layout().min_shard,
    seed: int = 0,
    sequence_parallel: bool = False,
    sequence_schemes: Sequence[str] = ("ring",),
    pipeline_schedules: Sequence[str] = ("1f1b",),
    variants: Sequence[dict] = ({},),
    log: Callable[[str], None] | None = print,
) -> list[Result | DidNotFit]:
    """Measures every layout with every engine: one ``Result`` each (for the shard_map engine, one
    per sequence scheme on a sequence axis and per pipeline schedule on a stage axis), layouts
    outer, engines inner, schemes then schedules innermost; then the one-device row. A
    contestant that ran out of device memory has a ``DidNotFit`` in its place (the module
    docstring says when), and the others still run.

    Args:
      size: the model and batch.
      layouts: ``MeshSpec`` s or their text (``"data=2,fsdp=4"``), on all of JAX's devices.
      engines: some of ``dew.training.step.ENGINES`` (default: ``shard_map`` and ``gspmd``).
      one_device: also run the model and global batch on one device (``engine="one_device"``).
      steps: steps each contestant runs per turn.
      repeats: timed rounds; ``step_ms`` is the median of ``steps * repeats`` steps.
      warmup: rounds run first and not timed.
      min_shard: the ``Layout``'s: weights with fewer elements stay whole.
      seed: weights and the (fixed, random) batch.
      sequence_parallel: ``StepOptions.sequence_parallel`` for the shard_map step on the layouts
        with ``tensor > 1`` (``seq_len`` must divide by their tensor size); ``Result`` records
        where it was in effect.
      sequence_schemes: some of ``dew.parallel.sequence.SCHEMES`` (default: ``ring``): on a
        layout with ``sequence > 1``, one shard_map contestant per scheme
        (``Result.sequence_scheme``).
      pipeline_schedules: some of ``dew.parallel.pipeline.SCHEDULES`` (default: ``1f1b``): on a
        layout with ``stage > 1`` (which must give ``microbatches``), one shard_map contestant
        per schedule, each with its twin at twice the microbatches and batch
        (``Result.bubble_measured``; the twins are not rows of their own).
      variants: the model's choices to compare, each a dict of ``build`` arguments
        (``{"remat": "dots"}``, ``{"attention_impl": "cudnn", "dtype": "bfloat16"}``): every
        layout, engine and the one-device row once per variant (``Result.variant``); ratios
        compare rows of the same variant. Default: the model as ``size`` gives it.

    Every argument is checked (sizes, layouts against the device count, each contestant's options
    against its mesh, the batch against each layout's batch split) before anything is compiled.
    """
    positive_int("steps", steps)
    positive_int("repeats", repeats)
    nonnegative_int("warmup", warmup)
    if not engines:
        raise ValueError(f"no engines to compare; expected some of {', '.join(ENGINES)}")
    for engine in engines:  # the Trainer checks too, but would take ONE_DEVICE for an engine here
        if engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r}; expected one of {', '.join(ENGINES)}")
    asked = _asked_options(sequence_parallel, sequence_schemes, pipeline_schedules)
    specs = _mesh_specs(layouts)
    log = log or (lambda line: None)
    if not variants:
        raise ValueError("no model variants to compare; give at least one ({} is the model)")
    contestants, twins = [], []
    for overrides in variants:
        objective = size.objective(**overrides)
        # Named from the model built, so a row says what ran, not what was asked.
        built = {k: getattr(objective.model, k) for k in overrides}
        variant = variant_text(built) if len(variants) > 1 else ""
        these = [
            Contestant(objective, size, spec, engine, min_shard, seed, options, variant)
            for spec in specs
            for engine in engines
            # Each distinct set of options once: a scheme does nothing without a sequence axis.
            for options in dict.fromkeys(options_for(a, spec, engine) for a in asked)
        ]
        twins += [
            _twin(c, objective, min_shard, seed) for c in these if c.pipeline_schedule is not None
        ]
        if one_device:
            these.append(
                Contestant(
                    objective, size, MeshSpec(), ONE_DEVICE, min_shard, seed, variant=variant
                )
            )
        contestants += these
    names = [(c.name, c.engine) for c in contestants]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        named = ", ".join(f"{name} ({engine})" for name, engine in duplicates)
        raise ValueError(f"layouts (and engines, sequence schemes) given twice: {named}")

    everyone = contestants + twins
    width = max(16, *(len(c.name) for c in everyone))
    labels = {c: c.name + (" (2x batch)" if c in twins else "") for c in everyone}
    unfit: dict[Contestant, DidNotFit] = {}  # the rows of those that did not fit
    out: set[Contestant] = set()  # out of the rounds: did not fit, or the twin of one

    def attempt(c: Contestant, action: Callable[[], object], failed_at: str) -> bool:
        """``action()``, True; False when it ran out of device memory: ``c`` (and its twin) are
        then out of the rounds and their memory freed, and ``c``'s row is a ``DidNotFit``."""
        try:
            action()
            return True
        except jax.errors.JaxRuntimeError as error:
            if not out_of_memory(error):
                raise
            unfit[c] = c.did_not_fit(error, failed_at)
        log(f"dropped  {labels[c]:<{width}} {c.engine:<14} {unfit[c].verdict}")
        _drop(c, out)
        return False

    for c in everyone:
        if attempt(c, c.prepare, PREPARE) and attempt(c, c.compile, COMPILE):
            log(f"compiled {labels[c]:<{width}} {c.engine:<14} in {c.compile_s:6.2f} s")
    # A mesh's contestants (its engines, schemes, schedules and their twins) run back to back.
    group_keys = list(dict.fromkeys(c.group for c in everyone))
    groups = [[c for c in everyone if c.group == key] for key in group_keys]
    for round_ in range(warmup + repeats):
        line: list[str] = []
        for c in _turn_order(groups, round_):
            if c not in out:
                attempt(c, functools.partial(_turn, c, steps, round_ >= warmup, line), RUN)
        kind = "warm-up" if round_ < warmup else f"{round_ - warmup + 1}/{repeats}"
        log(f"round {kind} (ms): " + ", ".join(line))
    results = [unfit[c] if c in unfit else c.result() for c in contestants]
    for c in everyone:
        c.release()
    return results


def _turn(c: Contestant, steps: int, record: bool, line: list[str]) -> None:
    """``c``'s turn (``Contestant.run``), the median of its steps added to the round's ``line``."""
    times = c.run(steps, record=record)
    line.append(f"{c.name} {c.engine} {1e3 * statistics.median(times):.0f}")


def _drop(c: Contestant, out: set) -> None:
    """Takes ``c``, which did not fit, out of the rounds, with its pipeline twin (measured only
    for ``c``'s bubble). A twin that did not fit forgets its steps, so its pipeline's row has no
    measured bubble rather than one from fewer rounds than its own step time."""
    for gone in (c, c.twin):
        if gone is not None:
            out.add(gone)
            gone.release()
    c.times.clear()
    c.rounds.clear()


def compile_depth(
    size: ModelSize,
    layout: MeshSpec | str,
    deep_layers: int = 16,
    *,
    engine: str = "shard_map",
    repeats: int = 1,
    min_shard: int = Layout().min_shard,
    seed: int = 0,
    options: StepOptions = StepOptions(),
) -> DepthCheck:
    """Compile time of the step at ``size.layers`` and at ``deep_layers`` layers, alternating.

    Each compile uses a fresh ``Trainer`` (nothing cached between them); medians of ``repeats``
    each. ``options``: those asked, of which the layout takes what it has the axes for
    (``options_for``, as ``compare``); ``DepthCheck.layout`` names the scheme and schedule that
    took effect, as ``row_name``.
    """
    positive_int("deep_layers", deep_layers)
    positive_int("repeats", repeats)
    spec = _mesh_specs([layout])[0]
    options = options_for(options, spec, engine)
    deep_size = dataclasses.replace(size, layers=deep_layers)
    objectives = (size.objective(), deep_size.objective())
    shallow, deep = [], []
    settings = (engine, min_shard, seed, options)
    Contestant(objectives[0], size, spec, *settings).prepare()  # warms JAX up
    for _ in range(repeats):
        for objective, times in zip(objectives, (shallow, deep)):
            contestant = Contestant(objective, size, spec, *settings)
            contestant.compile()
            times.append(contestant.compile_s)
            contestant.release()
    return DepthCheck(
        layout=contestant.name,
        engine=engine,
        shallow_layers=size.layers,
        deep_layers=deep_layers,
        shallow_s=statistics.median(shallow),
        deep_s=statistics.median(deep),
    )
