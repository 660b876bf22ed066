"""Layouts against each other, and the shard_map engine against the GSPMD baseline, side by side.

    results = benchmark.compare(ModelSize(), ["data=8", "fsdp=8", "data=2,fsdp=4"])
    print(benchmark.table(results))

Each contestant is one layout and one engine (``Trainer(..., engine=...)``) training the same
model, loss and optimizer, and one more row, ``engine="one_device"``: the same model and global
batch on one device, a plain ``jit`` with no mesh to split over (on simulated CPU devices, which
share the machine's cores, the compute limit). For each it measures:

- ``step_ms``: the median wall time of one training step, blocked until the new state and the loss
  are ready;
- ``compile_s``: trace, lower and compile of the step;
- ``state_bytes_per_device``: the bytes of the train state (weights, optimizer moments, EMA, key)
  that one device holds, the most any device holds;
- ``temp_bytes_per_device``: the compiled step's temporary memory (``memory_analysis()``);
- ``wire_bytes``: bytes one device sends per step, read from the compiled step's HLO by
  ``dew.collectives.hlo_collectives`` (the same reader for both engines, so they compare
  byte for byte); ``collectives``: the collective calls the compiled step runs.

Each result also records ``sequence_parallel``: whether the step kept the activations between
blocks split over positions (asked with ``sequence_parallel=True``, and in effect: the shard_map
engine on a tensor axis above 1); and ``sequence_scheme``: how the shard_map step's attention
spanned a ``sequence`` axis above 1 (``"ring"`` or ``"all_to_all"``, ``dew.parallel.sequence``;
``None`` elsewhere). On such a layout ``compare`` runs one shard_map contestant per scheme asked,
and the GSPMD baseline once; a row's ``name`` (``"sequence=8 (all_to_all)"``) tells them apart, and
each scheme's ratios are against its layout's GSPMD row and the one-device row.

Pipelines. A layout with ``stage > 1`` is written ``stage=4,microbatches=8`` (its row's
``layout``), and ``compare`` runs one shard_map contestant per pipeline schedule asked
(``pipeline_schedules``; ``Result.pipeline_schedule``, the row named ``"stage=4,microbatches=8
(1f1b)"``). Each also records ``bubble_formula``, ``(S - 1) / (M + S - 1)``, and
``bubble_measured``, the idle share of its step measured from two step times: its own, ``T(M)``,
and ``T(2M)`` of a twin contestant run in the same rounds with twice the microbatches and twice the
batch (so the same rows per microbatch; ``double_step_ms``). A step of ``M`` microbatches takes
``T(M) = M c + b`` with ``c`` the time one more microbatch adds and ``b`` what does not grow with
``M`` (the bubble, and the optimizer update and gradient sums around it), so ``c = T(2M) - T(M)``
over ``M`` and ``bubble_measured = 1 - M c / T(M) = 2 - T(2M) / T(M)``, the median of that over
the rounds. On devices that compute in parallel it is the share of the step a stage idles (plus
the step's fixed work); simulated CPU devices share the machine's cores, so an idle stage lends
them to the busy ones and hides most of its bubble there.

The machines this runs on are shared and noisy, so times are only compared as ratios measured in
one run. The contestants take turns, ``steps`` steps each per round; the engines of a layout run
back to back (their order alternates), and the order of the layouts (the one-device row among
them) rotates every round. A time ratio is the median over rounds of the ratio of the two
contestants' steps in that round, so the load of other processes, which drifts on the scale of
seconds, mostly falls on both sides of each ratio. ``warmup`` rounds are run first and not counted.
Bytes do not depend on the clock and are exact.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dew.checks import nonnegative_int, positive_int
from dew.collectives import hlo_collectives
from dew.layout import Layout
from dew.mesh import MeshSpec
from dew.parallel import pipeline
from dew.parallel.sequence import SCHEMES
from dew.training.step import ENGINES
from dew.training.trainer import Trainer

__all__ = [
    "ONE_DEVICE",
    "Contestant",
    "ModelSize",
    "Result",
    "DepthCheck",
    "Target",
    "compare",
    "compile_depth",
    "layout_name",
    "measured_bubble",
    "row_name",
    "state_bytes_per_device",
    "table",
    "targets",
    "targets_table",
]

# The engine name of the one-device row.
ONE_DEVICE = "one_device"
DEFAULT_ENGINES = ("shard_map", "gspmd")

# The limits docs/benchmarks.md states; ``targets`` checks them.
VS_GSPMD_TIME = 1.05  # shard_map step time / the pinned GSPMD baseline's
VS_ONE_DEVICE_TIME = 1.10  # shard_map step time / the one-device row's
VS_GSPMD_WIRE = 1.0  # shard_map wire bytes / GSPMD's
BASELINE_WIRE = 2.0  # GSPMD's wire bytes / shard_map's at fsdp: the baseline is no strawman
# A fully sharded state holds at most 1/n of the data-parallel one, plus this much for the small
# weights that stay whole and the optimizer's step count.
STATE_SLACK = 0.02
DEPTH_LIMIT = 1.5


@dataclasses.dataclass(frozen=True)
class ModelSize:
    """The benchmarked decoder (``causal_transformer``, byte vocabulary) and its batch.

    The default is larger than the notebook's example: 4,262,144 weights, 4096 tokens a step;
    8 heads of 32, so that the heads, the MLP width (1024) and the vocabulary split over up to 8
    tensor devices.
    """

    layers: int = 4
    width: int = 256
    heads: int = 8
    seq_len: int = 128
    batch: int = 32
    vocab: int = 256
    # A mixture of experts: ``moe`` holds ``build``'s MoE arguments (``num_experts``,
    # ``experts_per_token``, ``moe_every``, ``capacity_factor``); empty for a dense model.
    moe: tuple = ()

    def __post_init__(self):
        for name in ("layers", "width", "heads", "seq_len", "batch", "vocab"):
            positive_int(f"ModelSize.{name}", getattr(self, name))
        object.__setattr__(self, "moe", tuple(sorted(dict(self.moe).items())))

    def objective(self):
        """The ``LMObjective`` of this model (raises ``ValueError`` on sizes the model refuses)."""
        from dew import models
        from dew.objectives.lm import LMObjective

        model = models.build(
            "causal_transformer",
            vocab_size=self.vocab,
            emb_features=self.width,
            num_layers=self.layers,
            num_heads=self.heads,
            max_seq_len=self.seq_len,
            **dict(self.moe),
        )
        return LMObjective(model, self.seq_len)


@dataclasses.dataclass(frozen=True)
class Result:
    """One layout and engine's measurements (see the module docstring)."""

    layout: str
    engine: str
    step_ms: float
    compile_s: float
    state_bytes_per_device: int
    temp_bytes_per_device: int
    wire_bytes: int
    collectives: int
    steps_timed: int
    round_ms: tuple[float, ...] = ()  # the median step of each timed round, in round order
    sequence_parallel: bool = False  # sequence-parallel activations were in effect
    # The shard_map step's attention scheme over a sequence axis above 1; None elsewhere.
    sequence_scheme: str | None = None
    # Over a stage axis above 1: the microbatches (every engine's row), and for the shard_map
    # step its schedule, the formula's bubble, the measured one and the 2M twin's step time (see
    # the module docstring); None elsewhere.
    microbatches: int | None = None
    pipeline_schedule: str | None = None
    bubble_formula: float | None = None
    bubble_measured: float | None = None
    double_step_ms: float | None = None

    @property
    def name(self) -> str:
        """The layout, and the sequence scheme and pipeline schedule where there are:
        ``row_name``."""
        return row_name(self.layout, self.sequence_scheme, self.pipeline_schedule)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


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


@dataclasses.dataclass(frozen=True)
class Target:
    """One target of docs/benchmarks.md: ``measured <= limit`` is met. A ``stretch`` goal is
    reported, but missing it is not a failure."""

    name: str
    measured: float
    limit: float
    stretch: bool = False

    @property
    def met(self) -> bool:
        return self.measured <= self.limit


def layout_name(mesh_shape: dict, microbatches: int | None = None) -> str:
    """``{"data": 2, "fsdp": 4, ...}`` -> ``"data=2,fsdp=4"`` (axes of size 1 left out), and
    ``",microbatches=M"`` after them when ``microbatches`` is given."""
    parts = [f"{axis}={size}" for axis, size in mesh_shape.items() if size > 1]
    if microbatches is not None:
        parts.append(f"microbatches={microbatches}")
    return ",".join(parts) or "data=1"


def row_name(layout: str, sequence_scheme: str | None, pipeline_schedule: str | None = None) -> str:
    """``("sequence=8", "all_to_all")`` -> ``"sequence=8 (all_to_all)"``, ``("stage=4,
    microbatches=8", None, "1f1b")`` -> ``"stage=4,microbatches=8 (1f1b)"``; the layout alone when
    both are ``None``. Tells a layout's shard_map contestants apart in the table and the
    targets."""
    variants = [v for v in (sequence_scheme, pipeline_schedule) if v is not None]
    return f"{layout} ({', '.join(variants)})" if variants else layout


def state_bytes_per_device(state) -> int:
    """The bytes of ``state``'s arrays that one device holds: the most any device holds."""
    per_device: dict = {}
    for leaf in jax.tree_util.tree_leaves(state):
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        for shard in leaf.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values(), default=0)


class Contestant:
    """One layout and engine: its trainer, compiled step, live state, batch and step times.

    ``engine=ONE_DEVICE`` is the one-device row: the GSPMD step (a plain ``jit``) on a mesh of the
    first device alone, whatever ``mesh`` says. ``sequence_parallel`` is the ``Trainer``'s (in
    effect only for the shard_map engine on a tensor axis above 1); so is ``sequence_scheme`` (in
    effect only for the shard_map engine on a sequence axis above 1; the other engines are built
    with the default, which every model accepts), and ``pipeline_schedule`` (in effect only for
    the shard_map engine on a stage axis above 1).

    c = Contestant(size.objective(), size, MeshSpec(fsdp=8), "shard_map")
    c.prepare(); c.compile()
    seconds = c.run(steps=3)      # wall time of each step
    result = c.result()           # after some run()s
    """

    def __init__(
        self,
        objective,
        size: ModelSize,
        mesh: MeshSpec,
        engine: str,
        min_shard: int = Layout().min_shard,
        seed: int = 0,
        sequence_parallel: bool = False,
        sequence_scheme: str = "ring",
        pipeline_schedule: str = "1f1b",
    ):
        one_device = engine == ONE_DEVICE
        scheme_applies = engine == "shard_map" and mesh.sequence > 1
        schedule_applies = engine == "shard_map" and mesh.stage > 1
        self.trainer = Trainer(
            objective,
            optax.adamw(1e-3),
            key=jax.random.key(seed),
            mesh=MeshSpec() if one_device else mesh,
            layout=Layout(min_shard=min_shard),
            engine="gspmd" if one_device else engine,
            devices=jax.devices()[:1] if one_device else None,
            sequence_parallel=sequence_parallel,
            sequence_scheme=sequence_scheme if scheme_applies else "ring",
            pipeline_schedule=pipeline_schedule if schedule_applies else "1f1b",
        )
        self.trainer.check_batch(size.batch)
        self.size = size
        self.seed = seed
        mesh_shape = dict(self.trainer.mesh.shape)
        self.microbatches = self.trainer.microbatches if mesh_shape["stage"] > 1 else None
        self.layout = layout_name(mesh_shape, self.microbatches)
        # Contestants of one group (a mesh, whatever its microbatches) run back to back.
        self.group = (layout_name(mesh_shape), one_device)
        self.engine = engine
        self.sequence_parallel = (
            self.trainer.sequence_parallel
            and self.trainer.engine == "shard_map"
            and self.trainer.mesh.shape["tensor"] > 1
        )
        self.sequence_scheme = sequence_scheme if scheme_applies else None
        self.pipeline_schedule = pipeline_schedule if schedule_applies else None
        self.name = row_name(self.layout, self.sequence_scheme, self.pipeline_schedule)
        # The shard_map pipeline's twin at twice the microbatches and batch (``compare`` sets
        # it), whose step time gives ``bubble_measured``.
        self.twin: Contestant | None = None
        self.times: list[float] = []
        self.rounds: list[float] = []

    def prepare(self) -> None:
        """The live state and a fixed random batch. Its small compile also warms JAX up, which a
        step's compile time would otherwise pay for in whichever contestant comes first."""
        trainer, size = self.trainer, self.size
        self.state = trainer.init_state()
        self.state_bytes = state_bytes_per_device(self.state)
        rows = np.random.default_rng(self.seed).integers(
            0, size.vocab, (size.batch, size.seq_len + 1)
        )
        self.batch = trainer.device_batch(rows.astype(np.int32), size.batch)

    def compile(self) -> None:
        """Traces, lowers and compiles the step (timed), and reads its memory and collectives."""
        trainer, size = self.trainer, self.size
        began = time.perf_counter()
        self.compiled = trainer.compiled_step(size.batch)
        self.compile_s = time.perf_counter() - began
        self.temp_bytes = int(self.compiled.memory_analysis().temp_size_in_bytes)
        self.report = hlo_collectives(self.compiled, trainer.mesh)

    def run(self, steps: int, record: bool = True) -> list[float]:
        """Runs ``steps`` steps (after ``prepare`` and ``compile``); the wall time of each, in
        seconds, also kept for ``result`` when ``record``."""
        times = []
        for _ in range(steps):
            began = time.perf_counter()
            self.state, metrics = self.compiled(self.state, self.batch)
            jax.block_until_ready((self.state, metrics))
            times.append(time.perf_counter() - began)
        loss = metrics["loss"]
        if not np.isfinite(float(loss)):
            raise FloatingPointError(f"{self.name} {self.engine}: the loss is {float(loss)}")
        if record:
            self.times.extend(times)
            self.rounds.append(statistics.median(times))
        return times

    def result(self) -> Result:
        if not self.times:
            raise ValueError(f"{self.name} {self.engine}: no timed steps yet; call run() first")
        bubble = {}
        if self.pipeline_schedule is not None:
            stages = self.trainer.mesh.shape["stage"]
            count = self.microbatches * self.trainer.accumulation
            bubble["bubble_formula"] = pipeline.bubble_formula(stages, count)
        if self.twin is not None and self.twin.times:
            bubble["bubble_measured"] = statistics.median(
                measured_bubble(one, two) for one, two in zip(self.rounds, self.twin.rounds)
            )
            bubble["double_step_ms"] = 1e3 * statistics.median(self.twin.times)
        return Result(
            layout=self.layout,
            engine=self.engine,
            step_ms=1e3 * statistics.median(self.times),
            compile_s=self.compile_s,
            state_bytes_per_device=self.state_bytes,
            temp_bytes_per_device=self.temp_bytes,
            wire_bytes=self.report.wire_bytes(),
            collectives=self.report.count(),
            steps_timed=len(self.times),
            round_ms=tuple(1e3 * t for t in self.rounds),
            sequence_parallel=self.sequence_parallel,
            sequence_scheme=self.sequence_scheme,
            microbatches=self.microbatches,
            pipeline_schedule=self.pipeline_schedule,
            **bubble,
        )

    def release(self) -> None:
        self.state = self.batch = self.compiled = None


def measured_bubble(step_m: float, step_2m: float) -> float:
    """The idle share of a pipeline step of ``M`` microbatches that took ``step_m``, when the same
    pipeline with ``2M`` microbatches of the same size took ``step_2m``: ``2 - step_2m /
    step_m`` (``T(M) = M c + b``: the ``M`` more microbatches cost ``M c = step_2m - step_m``,
    the rest of ``step_m`` is the bubble and the step's fixed work). ``(S - 1) / (M + S - 1)``
    for ``T(M) = (M + S - 1) c``."""
    return 2.0 - step_2m / step_m


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


def _check_schemes(sequence_schemes: Sequence[str]) -> list[str]:
    schemes = list(sequence_schemes)
    if not schemes:
        raise ValueError(f"no sequence schemes; expected some of {', '.join(SCHEMES)}")
    for scheme in schemes:
        if scheme not in SCHEMES:
            raise ValueError(
                f"unknown sequence scheme {scheme!r}; expected one of {', '.join(SCHEMES)}"
            )
    return schemes


def _check_pipeline_schedules(pipeline_schedules: Sequence[str]) -> list[str]:
    schedules = list(pipeline_schedules)
    names = ", ".join(pipeline.SCHEDULES)
    if not schedules:
        raise ValueError(f"no pipeline schedules; expected some of {names}")
    for schedule in schedules:
        if schedule not in pipeline.SCHEDULES:
            raise ValueError(f"unknown pipeline schedule {schedule!r}; expected one of {names}")
    return schedules


def _variants(spec: MeshSpec, engine: str, schemes: list[str], schedules: list[str]):
    """``(sequence scheme, pipeline schedule)`` of each contestant of ``engine`` on ``spec``: one
    per scheme over a sequence axis and per schedule over a stage axis, for the shard_map engine;
    one otherwise."""
    if engine != "shard_map":
        return [("ring", "1f1b")]
    return [
        (scheme, schedule)
        for scheme in (schemes if spec.sequence > 1 else ["ring"])
        for schedule in (schedules if spec.stage > 1 else ["1f1b"])
    ]


def _twin(c: Contestant, objective, size: ModelSize, spec: MeshSpec, options) -> Contestant:
    """``c``'s pipeline at twice the microbatches and twice the batch (the same rows per
    microbatch): ``T(2M)`` for ``bubble_measured``."""
    twin = Contestant(
        objective,
        dataclasses.replace(size, batch=2 * size.batch),
        dataclasses.replace(spec, microbatches=2 * c.microbatches),
        "shard_map",
        *options,
        sequence_scheme=c.sequence_scheme or "ring",
        pipeline_schedule=c.pipeline_schedule,
    )
    twin.group = c.group
    c.twin = twin
    return twin


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
    log: Callable[[str], None] | None = print,
) -> list[Result]:
    """Measures every layout with every engine; one ``Result`` each (one per sequence scheme for
    the shard_map engine on a sequence axis above 1), layouts outer, engines inner (schemes
    innermost), then the one-device row.

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
      sequence_parallel: ``Trainer(sequence_parallel=...)`` for every contestant (in effect for the
        shard_map engine on layouts with ``tensor > 1``; ``seq_len`` must divide by their tensor
        size).
      sequence_schemes: some of ``dew.parallel.sequence.SCHEMES`` (default: ``ring``): on a
        layout with ``sequence > 1``, one shard_map contestant per scheme, each recording it in
        ``Result.sequence_scheme``; layouts without a sequence axis run the shard_map step once.
      pipeline_schedules: some of ``dew.parallel.pipeline.SCHEDULES`` (default: ``1f1b``): on a
        layout with ``stage > 1`` (which must give ``microbatches``), one shard_map contestant
        per schedule, each with its twin at twice the microbatches and batch, run in the same
        rounds, for ``Result.bubble_measured`` (the twins are not rows of their own).
      log: called with a line of progress; ``None`` for quiet.

    Every argument is checked (sizes, layouts against the device count, the batch against each
    layout's batch split) before anything is compiled.
    """
    positive_int("steps", steps)
    positive_int("repeats", repeats)
    nonnegative_int("warmup", warmup)
    for engine in engines:
        if engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r}; expected one of {', '.join(ENGINES)}")
    if not engines:
        raise ValueError(f"no engines to compare; expected some of {', '.join(ENGINES)}")
    schemes = _check_schemes(sequence_schemes)
    schedules = _check_pipeline_schedules(pipeline_schedules)
    specs = _mesh_specs(layouts)
    log = log or (lambda line: None)
    objective = size.objective()
    options = (min_shard, seed, sequence_parallel)
    planned = [
        (spec, engine, scheme, schedule)
        for spec in specs
        for engine in engines
        for scheme, schedule in _variants(spec, engine, schemes, schedules)
    ]
    contestants, twins = [], []
    for spec, engine, scheme, schedule in planned:
        c = Contestant(
            objective,
            size,
            spec,
            engine,
            *options,
            sequence_scheme=scheme,
            pipeline_schedule=schedule,
        )
        contestants.append(c)
        if c.pipeline_schedule is not None:
            twins.append(_twin(c, objective, size, spec, options))
    if one_device:
        contestants.append(Contestant(objective, size, MeshSpec(), ONE_DEVICE, min_shard, seed))
    names = [(c.name, c.engine) for c in contestants]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        named = ", ".join(f"{name} ({engine})" for name, engine in duplicates)
        raise ValueError(f"layouts (and engines, sequence schemes) given twice: {named}")

    everyone = contestants + twins
    width = max(16, *(len(c.name) for c in everyone))
    for c in everyone:
        c.prepare()
        c.compile()
        label = c.name + (" (2x batch)" if c in twins else "")
        log(f"compiled {label:<{width}} {c.engine:<14} in {c.compile_s:6.2f} s")
    # A mesh's contestants (its engines, schemes, schedules and their twins) run back to back.
    layouts_in_order = list(dict.fromkeys(c.group for c in everyone))
    groups = [[c for c in everyone if c.group == key] for key in layouts_in_order]
    for round_ in range(warmup + repeats):
        # A layout's engines back to back, the first one alternating; the layouts' order rotating.
        shift = round_ % len(groups)
        order = [
            c
            for group in groups[shift:] + groups[:shift]
            for c in (group if round_ % 2 == 0 else group[::-1])
        ]
        line = []
        for c in order:
            times = c.run(steps, record=round_ >= warmup)
            line.append(f"{c.name} {c.engine} {1e3 * statistics.median(times):.0f}")
        kind = "warm-up" if round_ < warmup else f"{round_ - warmup + 1}/{repeats}"
        log(f"round {kind} (ms): " + ", ".join(line))
    results = [c.result() for c in contestants]
    for c in everyone:
        c.release()
    return results


def compile_depth(
    size: ModelSize,
    layout: MeshSpec | str,
    deep_layers: int = 16,
    *,
    engine: str = "shard_map",
    repeats: int = 1,
    min_shard: int = Layout().min_shard,
    seed: int = 0,
    sequence_parallel: bool = False,
    sequence_scheme: str = "ring",
) -> DepthCheck:
    """Compile time of the step at ``size.layers`` and at ``deep_layers`` layers, alternating.

    Each compile uses a fresh ``Trainer`` (nothing cached between them); medians of ``repeats``
    each. ``sequence_parallel``: as ``compare``'s; ``sequence_scheme``: the scheme of a shard_map
    step on a sequence axis above 1 (``DepthCheck.layout`` then names it, as ``row_name``).
    """
    positive_int("deep_layers", deep_layers)
    positive_int("repeats", repeats)
    spec = _mesh_specs([layout])[0]
    deep_size = dataclasses.replace(size, layers=deep_layers)
    objectives = (size.objective(), deep_size.objective())
    shallow, deep = [], []
    _check_schemes([sequence_scheme])
    options = (min_shard, seed, sequence_parallel, sequence_scheme)
    Contestant(objectives[0], size, spec, engine, *options).prepare()  # warms JAX up
    for _ in range(repeats):
        for objective, times in zip(objectives, (shallow, deep)):
            contestant = Contestant(objective, size, spec, engine, *options)
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


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def table(results: Sequence[Result]) -> str:
    """The results as a text table, then each layout's ratios against GSPMD and one device (a row
    per shard_map contestant: per sequence scheme on a sequence axis, per pipeline schedule on a
    stage axis), then each pipeline's bubble, measured and by the formula."""
    header = (
        "layout",
        "engine",
        "step ms",
        "compile s",
        "state MiB/dev",
        "temp MiB/dev",
        "wire MiB/step",
        "collectives",
    )
    body = [
        (
            r.name,
            r.engine,
            f"{r.step_ms:.0f}",
            f"{r.compile_s:.2f}",
            _mib(r.state_bytes_per_device),
            _mib(r.temp_bytes_per_device),
            _mib(r.wire_bytes),
            str(r.collectives),
        )
        for r in results
    ]
    lines = _render(header, body, right_from=2)
    ratios = layout_ratios(results)
    if ratios:
        lines += [
            "",
            "ratios of each layout's shard_map step (below 1: shard_map is faster, moves fewer "
            "bytes, needs less memory; times: median over rounds of the ratio within a round)",
        ]
        lines += _render(
            (
                "layout",
                "time / gspmd",
                "time / one device",
                "gspmd time / one device",
                "wire / gspmd",
                "temp / gspmd",
            ),
            [
                (layout, *(_ratio_text(r.get(k)) for k in _RATIO_KEYS))
                for layout, r in ratios.items()
            ],
            right_from=1,
        )
    piped = [r for r in results if r.bubble_formula is not None]
    if piped:
        lines += [
            "",
            "pipeline bubble: the idle share of a step, measured as 2 - T(2M) / T(M) with T(2M) "
            "the step time at twice the microbatches and batch (same rows per microbatch), "
            "against (S - 1) / (M + S - 1)",
        ]
        lines += _render(
            ("layout", "microbatches", "step ms", "step ms at 2M", "measured", "formula"),
            [
                (
                    r.name,
                    str(r.microbatches),
                    f"{r.step_ms:.0f}",
                    "-" if r.double_step_ms is None else f"{r.double_step_ms:.0f}",
                    "-" if r.bubble_measured is None else f"{r.bubble_measured:.3f}",
                    f"{r.bubble_formula:.3f}",
                )
                for r in piped
            ],
            right_from=1,
        )
    return "\n".join(lines)


_RATIO_KEYS = ("time_vs_gspmd", "time_vs_one_device", "gspmd_vs_one_device", "wire", "temp")


def _ratio_text(value: float | None) -> str:
    if value is None:
        return "-"
    return "inf" if math.isinf(value) else f"{value:.3f}" if value < 0.1 else f"{value:.2f}"


def _render(header, body, right_from: int) -> list[str]:
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]

    def line(cells):
        return "  ".join(
            c.rjust(w) if i >= right_from else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()

    return [line(header), line(tuple("-" * w for w in widths))] + [line(row) for row in body]


def _ratio(a: float, b: float) -> float:
    if b == 0:
        return 1.0 if a == 0 else math.inf
    return a / b


def _time_ratio(a: Result, b: Result) -> float:
    """``a``'s step time over ``b``'s: the median of the rounds' ratios when both ran the same
    rounds, else the ratio of the medians."""
    if a.round_ms and len(a.round_ms) == len(b.round_ms):
        return statistics.median(x / y for x, y in zip(a.round_ms, b.round_ms))
    return _ratio(a.step_ms, b.step_ms)


def layout_ratios(results: Sequence[Result]) -> dict[str, dict[str, float]]:
    """``Result.name`` (the layout, with its sequence scheme where it has one) -> that shard_map
    step's ratios, where the other side ran:

    ``time_vs_gspmd``, ``wire``, ``temp`` (shard_map / gspmd), ``time_vs_one_device`` (shard_map /
    the one-device row), ``gspmd_vs_one_device``. Every scheme of a layout is compared with the
    layout's one GSPMD row.
    """
    gspmd_rows = {r.layout: r for r in results if r.engine == "gspmd"}
    one = next((r for r in results if r.engine == ONE_DEVICE), None)
    ratios: dict[str, dict[str, float]] = {}
    for r in results:
        if r.engine != "shard_map":
            continue
        found = ratios.setdefault(r.name, {})
        gspmd = gspmd_rows.get(r.layout)
        if gspmd is not None:
            found["time_vs_gspmd"] = _time_ratio(r, gspmd)
            found["wire"] = _ratio(r.wire_bytes, gspmd.wire_bytes)
            found["temp"] = _ratio(r.temp_bytes_per_device, gspmd.temp_bytes_per_device)
        if one is not None:
            found["time_vs_one_device"] = _time_ratio(r, one)
            if gspmd is not None:
                found["gspmd_vs_one_device"] = _time_ratio(gspmd, one)
    return ratios


def targets(results: Sequence[Result], depth: DepthCheck | None = None) -> list[Target]:
    """The targets of docs/benchmarks.md that ``results`` (and ``depth``) measure.

    Per layout (per layout and sequence scheme, named as ``row_name``), of its shard_map step:

    - step time / the pinned GSPMD baseline's <= 1.05, and / the one-device row's <= 1.10;
    - wire bytes / GSPMD's <= 1;
    - GSPMD's wire bytes / its own <= 2 (the baseline is no strawman);
    - stretch goals: step time <= GSPMD's and <= 1.05 x one device's; temporary memory <= GSPMD's.

    And: a fully sharded layout (``fsdp=n``, nothing else) holds at most 1/n of the state of the
    pure data-parallel layout (``data=n``) per device, plus 2%: measured as
    ``state(fsdp=n) / (state(data=n) / n)`` against ``1.02``; compile time at
    ``depth.deep_layers`` / at ``depth.shallow_layers`` <= 1.5.
    """
    found = []
    ours_by_name = {r.name: r for r in results if r.engine == "shard_map"}
    gspmd_rows = {r.layout: r for r in results if r.engine == "gspmd"}
    for name, r in layout_ratios(results).items():
        if "time_vs_gspmd" in r:
            found.append(
                Target(f"{name}: step time shard_map / gspmd", r["time_vs_gspmd"], VS_GSPMD_TIME)
            )
        if "time_vs_one_device" in r:
            found.append(
                Target(
                    f"{name}: step time shard_map / one device",
                    r["time_vs_one_device"],
                    VS_ONE_DEVICE_TIME,
                )
            )
        if "wire" in r:
            ours = ours_by_name[name]
            theirs = gspmd_rows[ours.layout]
            found.append(Target(f"{name}: wire bytes shard_map / gspmd", r["wire"], VS_GSPMD_WIRE))
            found.append(
                Target(
                    f"{name}: wire bytes gspmd / shard_map",
                    _ratio(theirs.wire_bytes, ours.wire_bytes),
                    BASELINE_WIRE,
                )
            )
            found.append(
                Target(f"{name}: step time shard_map / gspmd", r["time_vs_gspmd"], 1.0, True)
            )
            found.append(Target(f"{name}: temp memory shard_map / gspmd", r["temp"], 1.0, True))
        if "time_vs_one_device" in r:
            found.append(
                Target(
                    f"{name}: step time shard_map / one device",
                    r["time_vs_one_device"],
                    1.05,
                    True,
                )
            )
    state = {}
    for r in results:
        state.setdefault(r.layout, r.state_bytes_per_device)
    for layout, fsdp_bytes in state.items():
        if layout.startswith("fsdp=") and "," not in layout:
            n = int(layout.split("=")[1])
            data_bytes = state.get(f"data={n}")
            if data_bytes:
                found.append(
                    Target(
                        f"{layout}: state per device / (data={n}'s / {n})",
                        fsdp_bytes / (data_bytes / n),
                        1.0 + STATE_SLACK,
                    )
                )
    if depth is not None:
        found.append(
            Target(
                f"{depth.layout} {depth.engine}: compile time {depth.deep_layers} layers / "
                f"{depth.shallow_layers} layers",
                depth.ratio,
                DEPTH_LIMIT,
            )
        )
    return sorted(found, key=lambda t: t.stretch)


def targets_table(found: Sequence[Target]) -> str:
    body = [
        (
            ("stretch: " if t.stretch else "") + t.name,
            f"{t.measured:.3f}",
            f"<= {t.limit:g}",
            "met" if t.met else ("not yet" if t.stretch else "MISSED"),
        )
        for t in found
    ]
    return "\n".join(_render(("target", "measured", "limit", ""), body, right_from=1))
