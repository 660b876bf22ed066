"""Planning a run for a TPU slice you don't have: compile the real step for it, read what it needs.

    from dew import planning, targets
    rows = planning.plan(targets.target("v5e-8"), objective, ["fsdp=8", "tensor=8"], batch=16)

For each layout, the step (the same code that trains) is lowered on ``jax.ShapeDtypeStruct`` s
laid out over the slice's compile-only devices (``dew.targets``) and compiled by the TPU compiler
in ``libtpu``; nothing runs. A ``PlanRow`` holds what the compiled executable says:

- memory per device (``PlanRow`` says what each field means, the same in every row): ``state``
  (the training state this layout gives a device: weights, optimizer state, EMA), ``temp``
  (everything the step allocates while it runs: the heap of the TPU compiler's buffer
  assignment, ``dew.training.step_memory``), ``total`` (all the program needs: arguments + outputs -
  donated (aliased) + temp + the program's code) and ``hbm``, the chip's memory; ``fits`` when
  the TPU compiler accepted it and the total is within what the compiler lets a program use.
  The compiler checks the program against the chip's memory and refuses one that does not fit,
  which makes the row ``over by X GiB`` past that (it states both figures when it refuses).
  ``compiled.memory_analysis()``'s temporaries stay beside it (``analysis_temp_bytes``): on
  libtpu 0.0.42.1 they count the heap's fragmentation twice, and read gigabytes above what the
  chip holds at the edge (GPT-2 small at 20 x 1024 tokens on one v5e: 18.7 GiB against a 13.3
  GiB heap; the chip runs it);
- the collectives XLA kept, per device per step, read from the compiled HLO by
  ``dew.collectives.hlo_collectives`` with every loop's trip count (so no TPU row is
  approximate), as wire bytes under the ring formulas and counts per op, and those bytes split
  into overlapped (compute scheduled beside the collective) and exposed
  (``dew.collectives.overlap.hlo_overlap``);
- how long the compile took.

``search`` enumerates the layouts a model and a slice allow and compiles the most promising first
(see its docstring for the rule). Beside the layout it makes the model's own choices that a
compile decides (``SEARCH_DIMENSIONS``: the recompute policy ``remat``), the preferred value of
each first, until one fits; ``dew.training.remat_choice.choose_remat`` makes the same choice for
a ``Trainer`` whose model says ``remat="auto"``. A compiled step's memory is read by
``dew.training.step_memory``.

Layout: ``PlanRow`` and ``plan_layout``, the compile that fills one row; the choices a compile
decides (``Dimension``, ``SEARCH_DIMENSIONS``, ``plan_choices``, ``choice_text``) and ``plan``,
which makes them for every layout and engine; the communication schemes (``scheme_variants``,
``SchemeChoice``, ``plan_schemes``); the search that decides which layouts to compile
(``candidate_meshes``, ``search``, ``search_summary``); and the table that prints the rows
(``row_cells``, ``format_table``). They are one module because they are one path from ``dew plan``'s
flags to its output, each part a few functions that make or read rows.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from typing import Any, Callable, Iterable, Sequence

import jax
import optax

from dew.collectives.report import format_bytes
from dew.layout import Layout
from dew.mesh import AXES, MeshSpec
from dew.models import lora
from dew.parallel import fsdp
from dew.parallel.options import AUTO as SCHEME_AUTO
from dew.parallel.options import StepOptions
from dew.targets import GIB, Target
from dew.training.remat_choice import REMAT_ORDER
from dew.training.step_memory import measure_step

__all__ = [
    "PlanRow",
    "Dimension",
    "SEARCH_DIMENSIONS",
    "STATE_ORDER",
    "REMAT_ORDER",
    "plan",
    "plan_layout",
    "plan_choices",
    "candidate_meshes",
    "choices",
    "search",
    "search_summary",
    "plan_schemes",
    "scheme_variants",
    "SchemeChoice",
    "SUM_DTYPE_ORDER",
    "choice_text",
    "format_table",
    "weight_count",
]


def weight_count(model) -> int:
    """The model's weights (elements), from its declared shapes (nothing is allocated)."""
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    return sum(math.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(shapes))


@dataclasses.dataclass(frozen=True)
class PlanRow:
    """One layout's compiled step on one target, per device. Bytes are exact (from XLA).

    Each field means one thing in every row; a number the row cannot know is ``None``:

    - ``remat``: the model's recompute policy; ``choices``: the value of each of
      ``SEARCH_DIMENSIONS`` the row was compiled with (``{"remat": "dots"}``).
    - ``state_bytes``: the training state one device holds in this layout (weights, optimizer
      state, EMA, step), from the layout's shardings; known once the ``Trainer`` accepted it.
    - ``argument_bytes``: everything the step takes, the state and this device's rows of the
      batch (``memory_analysis()``); compiled rows only.
    - ``temp_bytes``: what the step allocates while it runs: the heap of the TPU compiler's buffer
      assignment (``step_memory.heap_bytes``); compiled rows only (``None`` also where the
      compiler wrote no buffer assignment: ``step_memory.compile_measured``).
    - ``analysis_temp_bytes``: ``memory_analysis().temp_size_in_bytes``, the same program's
      temporaries as that analysis counts them: above the heap on libtpu 0.0.42.1 (it counts
      the heap's fragmentation twice); shown, never used for the verdict. Compiled rows only.
    - ``total_bytes``: all the program needs on one device, by the compiler's count: arguments +
      outputs - donated (aliased) + temporaries (the heap; ``analysis_temp_bytes`` where the heap
      is unknown) + code when it compiled, the need it stated when it refused the step.
    - ``hbm_bytes``: the chip's memory (the target's, in every row).
    - ``usable_bytes``: the part of it the TPU compiler lets a program use: the figure it states
      in a refusal, else the target's (``Target.usable_bytes``); it keeps some for itself.
    - ``wire_bytes``, ``collectives``: the collectives XLA kept; compiled rows only.
    - ``overlapped_wire_bytes``, ``exposed_wire_bytes``: ``wire_bytes`` split by what the TPU
      compiler scheduled beside each collective (``dew.collectives.overlap.hlo_overlap``):
      compute between its start and its done, or nothing; the two add up to ``wire_bytes``.
      Compiled rows only.
    - ``ici_send_bytes_per_s``: what a chip of the target can send over its links a second
      (``Target.ici_send_bytes_per_s``); ``exposed_s``, the exposed bytes over it: the least time
      they stall the step (docs/planning.md, "Exposed time").

    ``error`` is set when the layout was refused before compiling (a ``ValueError`` naming the
    rule) or the compiler failed; ``refused`` when the TPU compiler refused the step for not
    fitting the chip. Neither kind of row ``fits``.
    """

    target: str
    mesh: str  # the layout as asked, e.g. "fsdp=8"
    axis_sizes: dict
    engine: str
    options: str
    hbm_bytes: int
    remat: str = ""  # the model's recompute policy (what each layer keeps for the backward)
    choices: dict = dataclasses.field(default_factory=dict)  # dimension -> value compiled
    state_bytes: int | None = None
    argument_bytes: int | None = None
    temp_bytes: int | None = None
    analysis_temp_bytes: int | None = None
    total_bytes: int | None = None
    usable_bytes: int | None = None
    wire_bytes: int | None = None
    overlapped_wire_bytes: int | None = None
    exposed_wire_bytes: int | None = None
    collectives: dict = dataclasses.field(default_factory=dict)  # op -> calls per step
    ici_send_bytes_per_s: float | None = None
    compile_s: float = 0.0
    approximate: bool = False
    error: str | None = None
    # The TPU compiler's message when it refused the step for not fitting the chip.
    refused: str | None = None

    @property
    def limit_bytes(self) -> int:
        """What a program may use on the chip: ``usable_bytes`` where known, else ``hbm_bytes``."""
        return self.usable_bytes if self.usable_bytes is not None else self.hbm_bytes

    @property
    def fits(self) -> bool:
        """The compiler accepted the step, and all it needs (temporaries included) is within
        what the compiler lets a program use."""
        return (
            self.error is None
            and self.refused is None
            and self.total_bytes is not None
            and self.total_bytes <= self.limit_bytes
        )

    @property
    def spare_bytes(self) -> int | None:
        """What a row that fits leaves of ``limit_bytes``; ``None`` for one that does not."""
        return self.limit_bytes - self.total_bytes if self.fits else None

    @property
    def verdict(self) -> str:
        """``fits``, ``over by X GiB`` (what the program needs past what the compiler lets it
        use), or ``error`` for a layout refused before compiling."""
        if self.error is not None:
            return "error"
        if self.fits:
            return "fits"
        return f"over by {(self.total_bytes - self.limit_bytes) / GIB:.2f} GiB"

    @property
    def exposed_s(self) -> float | None:
        """``exposed_wire_bytes`` over ``ici_send_bytes_per_s``: seconds a step waits, at least,
        for the collectives nothing runs beside."""
        if self.exposed_wire_bytes is None or not self.ici_send_bytes_per_s:
            return None
        return self.exposed_wire_bytes / self.ici_send_bytes_per_s

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["fits"] = self.fits
        out["spare_bytes"] = self.spare_bytes
        out["exposed_s"] = self.exposed_s
        return out


def mesh_text(spec: MeshSpec) -> str:
    """``MeshSpec(fsdp=2, tensor=4)`` -> ``"fsdp=2,tensor=4"`` (``"data"`` for all data)."""
    parts = [f"{a}={getattr(spec, a)}" for a in AXES[1:] if getattr(spec, a) > 1]
    if spec.microbatches is not None:
        parts.append(f"microbatches={spec.microbatches}")
    return ",".join(parts) or "data"


def options_text(options: StepOptions, axis_sizes: dict) -> str:
    """The options that shape a step on ``axis_sizes``, as ``"sequence_parallel=True"``."""
    return ", ".join(f"{k}={v}" for k, v in options.in_effect(axis_sizes).items())


def _as_spec(mesh) -> MeshSpec:
    if isinstance(mesh, MeshSpec):
        return mesh
    if isinstance(mesh, str):
        return MeshSpec.parse(mesh)
    raise TypeError(f"a layout is a MeshSpec or text such as 'fsdp=8', got {type(mesh).__name__}")


def _trainer(target, objective, optimizer, spec, *, engine, layout, options, accumulation):
    from dew.training.trainer import Trainer

    return Trainer(
        objective,
        optimizer,
        key=jax.random.key(0),
        mesh=spec,
        layout=layout,
        accumulation=accumulation,
        engine=engine,
        devices=target.devices(),
        options=options if engine == "shard_map" else StepOptions(),
    )


def plan_layout(
    target: Target,
    objective,
    mesh,
    batch: int,
    *,
    optimizer: optax.GradientTransformation | None = None,
    engine: str = "shard_map",
    layout: Layout = Layout(),
    options: StepOptions = StepOptions(),
    accumulation: int = 1,
    chosen: dict | None = None,
) -> PlanRow:
    """Compiles ``objective``'s training step on global batches of ``batch`` rows for ``target``
    on the layout ``mesh`` (a ``MeshSpec`` or ``"fsdp=8"``) and reads its memory, collectives and
    compile time.

    ``objective``'s model must leave nothing to choose (no ``"auto"``: ``plan_choices`` makes
    those choices, a compile each). ``optimizer`` defaults to ``dew train``'s
    (``dew.training.optimizer.default_optimizer``: AdamW, two float32 moments per weight). A
    layout the ``Trainer`` refuses (a size that does not divide, an option the mesh gives no axis
    for) gives a row with its ``error`` rather than raising. ``chosen``: the
    ``SEARCH_DIMENSIONS`` values the row records as its ``choices``.
    """
    from dew.collectives import hlo_collectives
    from dew.collectives.overlap import hlo_overlap

    unresolved = [name for name, value in _model_choices(objective).items() if value == AUTO]
    if unresolved:
        raise ValueError(
            f"plan_layout compiles one step; the model leaves {', '.join(unresolved)} to "
            "choose ('auto'): plan() and plan_choices() choose it"
        )
    spec = _as_spec(mesh)
    if optimizer is None:
        from dew.training.optimizer import default_optimizer

        optimizer = default_optimizer()
    row = dict(
        target=target.name,
        mesh=mesh_text(spec),
        axis_sizes={},
        engine=engine,
        options="",
        hbm_bytes=target.hbm_bytes,
        remat=getattr(objective.model, "remat", ""),
        choices=dict(chosen or {}),
        usable_bytes=target.usable_bytes or None,
        ici_send_bytes_per_s=target.ici_send_bytes_per_s or None,
    )
    try:
        row["axis_sizes"] = spec.shape(target.chips)
        data = row["axis_sizes"]["data"]
        if data > 1:  # the devices the other axes leave, named: "data=2,fsdp=4"
            row["mesh"] = f"data={data}" if row["mesh"] == "data" else f"data={data},{row['mesh']}"
        if engine == "shard_map":
            # What the step runs: "auto" made its choice for the target's chips, as the
            # Trainer makes it.
            resolved = options.resolve(row["axis_sizes"], "tpu", *_ring_facts(objective))
            row["options"] = options_text(resolved, row["axis_sizes"])
        trainer = _trainer(
            target,
            objective,
            optimizer,
            spec,
            engine=engine,
            layout=layout,
            options=options,
            accumulation=accumulation,
        )
        trainer.check_batch(batch, objective.seq_len)
    except ValueError as error:
        return PlanRow(**row, error=str(error))
    start = time.perf_counter()
    try:
        memory, compiled = measure_step(trainer, batch)
    except Exception as error:  # noqa: BLE001  (the compiler's own failure is the row's result)
        seconds = time.perf_counter() - start
        return PlanRow(**row, error=f"{type(error).__name__}: {error}", compile_s=seconds)
    if compiled is None:  # refused for memory: the need and the limit it stated
        row["usable_bytes"] = memory.usable_bytes
        return PlanRow(
            **row,
            state_bytes=_state_bytes(trainer),
            total_bytes=memory.total_bytes,
            compile_s=memory.compile_s,
            refused=memory.refused,
        )
    report = hlo_collectives(compiled, trainer.mesh)
    overlap = hlo_overlap(compiled, trainer.mesh)
    counts: dict[str, int] = {}
    for r in report.rows:
        counts[r.op] = counts.get(r.op, 0) + r.count
    return PlanRow(
        **row,
        state_bytes=_state_bytes(trainer),
        argument_bytes=memory.argument_bytes,
        temp_bytes=memory.temp_bytes,
        analysis_temp_bytes=memory.analysis_temp_bytes,
        total_bytes=memory.total_bytes,
        wire_bytes=sum(r.wire_bytes for r in report.rows),
        overlapped_wire_bytes=overlap.overlapped_wire_bytes,
        exposed_wire_bytes=overlap.exposed_wire_bytes,
        collectives=counts,
        compile_s=memory.compile_s,
        approximate=any(r.approximate for r in report.rows),
    )


# ----------------------------------------------------------------------------- choices

# A model field set to this is chosen by a compile: ``plan_choices`` in a plan, ``choose_remat``
# in a ``Trainer``.
AUTO = "auto"


@dataclasses.dataclass(frozen=True)
class Dimension:
    """A choice of the model's that a compile decides, made beside the layout.

    ``name``: the model field; ``order``: its values, the preferred first, tried when the model
    says ``"auto"`` (a model that sets the field fixes it: that value alone); ``preference``:
    why that order, in words (``dew plan`` says it when it explains a choice).
    """

    name: str
    order: tuple
    preference: str

    def values(self, objective) -> tuple:
        """The values to compile for ``objective``'s model, the preferred first."""
        value = getattr(objective.model, self.name)
        return self.order if value == AUTO else (value,)

    def apply(self, objective, value):
        """``objective`` with its model's field set to ``value``."""
        model = dataclasses.replace(objective.model, **{self.name: value})
        return dataclasses.replace(objective, model=model)


# What plan and search choose beside the layout, in order of precedence: a candidate is one value
# of each, compiled in ``itertools.product``'s order (every value of the last dimension with the
# first's preferred value, then the next), until one fits. Adding a dimension is one line.
SEARCH_DIMENSIONS = (Dimension("remat", REMAT_ORDER, "least recomputation first"),)


def _dimensions(objective) -> tuple[Dimension, ...]:
    """The ``SEARCH_DIMENSIONS`` ``objective``'s model has a field for."""
    return tuple(d for d in SEARCH_DIMENSIONS if hasattr(objective.model, d.name))


def _model_choices(objective) -> dict:
    return {d.name: getattr(objective.model, d.name) for d in _dimensions(objective)}


def choices(objective) -> list[tuple[dict, Any]]:
    """``(values, objective)`` of every candidate ``objective`` leaves to choose, in the order to
    compile them (the preferred first); one candidate when the model fixes every dimension."""
    dimensions = _dimensions(objective)
    out = []
    for values in itertools.product(*(d.values(objective) for d in dimensions)):
        candidate = objective
        for dimension, value in zip(dimensions, values):
            candidate = dimension.apply(candidate, value)
        out.append((dict(zip((d.name for d in dimensions), values)), candidate))
    return out


# The training state's precision, when a search chooses it (``states``), the preferred first:
# float32 weights and AdamW moments (12 bytes a weight), then bfloat16 weights (float32 masters
# of the vectors: ``dew.training.optimizer``) and bfloat16 moments (6 bytes a weight).
STATE_ORDER = ("float32", "bfloat16")


def with_state(objective, state: str):
    """``(objective, optimizer)`` whose weights and AdamW moments are in ``state``'s dtype."""
    from dew.training.optimizer import adamw

    model = dataclasses.replace(objective.model, param_dtype=state)
    return dataclasses.replace(objective, model=model), adamw(1e-3, moments_dtype=state)


def plan_choices(
    target: Target,
    objective,
    mesh,
    batch: int,
    *,
    on_row: Callable[[PlanRow], None] | None = None,
    states: Sequence[str] | None = None,
    **settings,
) -> list[PlanRow]:
    """``plan_layout`` for each of ``objective``'s ``choices`` in order, until one fits: the rows
    compiled, the first that fits last (every candidate's when none fits). A layout refused before
    compiling is refused for every candidate: one row. ``states``: the state precisions to try
    (``STATE_ORDER``'s names), each with every choice, in order; ``None`` keeps the model's and
    ``settings``' optimizer. ``settings`` go to ``plan_layout``."""
    rows = []
    for state in states or (None,):
        for values, candidate in choices(objective):
            if state is not None:
                candidate, optimizer = with_state(candidate, state)
                settings = {**settings, "optimizer": optimizer}
                values = {"state": state, **values}
            row = plan_layout(target, candidate, mesh, batch, chosen=values, **settings)
            rows.append(row)
            if on_row is not None:
                on_row(row)
            if row.fits or row.error is not None:
                return rows
    return rows


def _values_text(row: PlanRow) -> str:
    return ", ".join(f"{name} {value}" for name, value in row.choices.items())


def choice_text(rows: Sequence[PlanRow]) -> str:
    """Why ``plan_choices`` stopped where it did, from the rows it compiled for one layout:
    ``"data=1 (shard_map): remat attention, the first that fits (remat least recomputation
    first: remat none over by 1.25 GiB); 614.0 MiB to spare of the 15.8 GiB the compiler lets a
    program use"``."""
    last = rows[-1]
    where = f"{last.mesh} ({last.engine})"
    preferences = [f"{d.name} {d.preference}" for d in SEARCH_DIMENSIONS if d.name in last.choices]
    if "state" in last.choices:
        preferences.insert(0, "state float32 weights and moments first")
    order = "; ".join(preferences)
    tried = [f"{_values_text(r)} {r.verdict}" for r in rows[:-1]]
    if last.error is not None:
        return f"{where}: refused before compiling (every candidate alike)"
    if not last.fits:
        tried.append(f"{_values_text(last)} {last.verdict}")
        return f"{where}: nothing fits ({order}: {', '.join(tried)})"
    before = f": {', '.join(tried)}" if tried else ""
    return (
        f"{where}: {_values_text(last)}, the first that fits ({order}{before}); "
        f"{format_bytes(last.spare_bytes)} to spare of the {format_bytes(last.limit_bytes)} "
        "the compiler lets a program use"
    )


def plan(
    target: Target,
    objective,
    meshes: Iterable,
    batch: int,
    *,
    engines: Sequence[str] = ("shard_map",),
    on_row: Callable[[PlanRow], None] | None = None,
    on_choice: Callable[[list[PlanRow]], None] | None = None,
    states: Sequence[str] | None = None,
    **settings,
) -> list[PlanRow]:
    """``plan_choices`` for every layout in ``meshes`` and every engine in ``engines`` (e.g.
    ``("shard_map", "gspmd")`` for the pinned GSPMD baseline beside each), in that order: one
    row each, or a row per candidate compiled where the model leaves a choice (``"auto"``).
    ``on_row`` sees each row as it is done, ``on_choice`` the rows of each choice made (for
    ``choice_text``). ``settings`` go to ``plan_layout``."""
    rows = []
    for mesh in meshes:
        for engine in engines:
            compiled = plan_choices(
                target,
                objective,
                mesh,
                batch,
                engine=engine,
                on_row=on_row,
                states=states,
                **settings,
            )
            rows += compiled
            if on_choice is not None and len(choices(objective)) * len(states or (0,)) > 1:
                on_choice(compiled)
    return rows


# ----------------------------------------------------------------------------- schemes

# The dtypes of the gradient sums a search tries, the preferred first: each weight's own (float32
# sums of float32 weights add no rounding to one device's gradient), then bfloat16 (half the sums'
# bytes and their whole-gradient temporaries), only for a layout where nothing fits in the first.
SUM_DTYPE_ORDER = (None, "bfloat16")


def _ring_facts(objective) -> tuple[int | None, bool]:
    """``(seq_len, tensor_ringable)`` of ``objective`` for ``StepOptions.resolve``, as the
    ``Trainer`` gives them: a LoRA model whose adapters (or int8 base) cover every region keeps
    the tensor pairs."""
    config = getattr(getattr(objective, "model", None), "lora", None)
    ringable = config is None or lora.some_region_unadapted(config)
    return getattr(objective, "seq_len", None), ringable


def scheme_variants(options: StepOptions, axis_sizes: dict, objective=None) -> list[StepOptions]:
    """The steps a search compiles for the communication ``options`` leave open on a TPU slice's
    mesh of ``axis_sizes`` for ``objective``: the rule's choice (``StepOptions.resolve``) first,
    then, for each scheme left ``"auto"`` whose rule chose its rings, the same step with that one
    scheme's plain collectives instead (the fsdp gathers, the tensor pairs). A scheme the user
    named is kept in every variant."""
    resolved = options.resolve(axis_sizes, "tpu", *_ring_facts(objective))
    variants = [resolved]
    alternatives = (("fsdp_scheme", "gather"), ("tensor_scheme", "plain"))
    for name, plain in alternatives:
        if getattr(options, name) == SCHEME_AUTO and getattr(resolved, name) == "ring":
            variants.append(dataclasses.replace(resolved, **{name: plain}))
    return variants


def _scheme_rank(row: PlanRow) -> tuple:
    """Those that fit first, then the least exposed communication, then the least memory."""
    unknown = math.inf
    return (
        not row.fits,
        unknown if row.exposed_wire_bytes is None else row.exposed_wire_bytes,
        unknown if row.total_bytes is None else row.total_bytes,
    )


@dataclasses.dataclass(frozen=True)
class SchemeChoice:
    """What ``plan_schemes`` chose for one layout: ``chosen``, of ``tried`` (the row each
    variant's choices ended on, in the order compiled), the one that fits with the least exposed
    communication."""

    chosen: PlanRow
    tried: tuple[PlanRow, ...]

    def reason(self) -> str:
        """``"fsdp=8: fsdp ring, the least exposed communication of the steps that fit (fsdp
        ring: 112.2 MiB exposed, 0.6 ms; fsdp gather: 3.5 GiB exposed, 18.5 ms)"``."""

        def described(row: PlanRow) -> str:
            if not row.fits:
                return f"{schemes_text(row)}: {row.verdict}"
            time = f", {seconds_text(row.exposed_s)}" if row.exposed_s is not None else ""
            return f"{schemes_text(row)}: {_bytes(row.exposed_wire_bytes)} exposed{time}"

        why = "of the steps that fit" if self.chosen.fits else "none fits"
        return (
            f"{self.chosen.mesh}: {schemes_text(self.chosen)}, the least exposed "
            f"communication {why} ({'; '.join(described(r) for r in self.tried)})"
        )


def schemes_text(row: PlanRow) -> str:
    """The schemes a row's step ran, named for each axis it has: ``"fsdp ring, tensor
    plain"`` (from its ``options``, which name a scheme only where it is not the plain one)."""
    parts = []
    for axis, ring, plain in (
        ("fsdp", "fsdp_scheme=ring", "gather"),
        ("tensor", "tensor_scheme=ring", "plain"),
    ):
        if row.axis_sizes.get(axis, 1) > 1:
            parts.append(f"{axis} {'ring' if ring in row.options else plain}")
    return ", ".join(parts) or "no fsdp or tensor axis"


def plan_schemes(
    target: Target,
    objective,
    mesh,
    batch: int,
    *,
    options: StepOptions = StepOptions(),
    engines: Sequence[str] = ("shard_map",),
    sum_dtypes: Sequence[str | None] | None = None,
    on_scheme: Callable[[SchemeChoice], None] | None = None,
    **settings,
) -> list[PlanRow]:
    """``plan`` of one layout for each of its ``scheme_variants`` (the GSPMD baseline once,
    beside the first) and, where none fits, again with each further gradient-sum dtype of
    ``sum_dtypes`` (``None``: ``options``' own alone): every row compiled. ``on_scheme`` sees the
    ``SchemeChoice`` where there was more than one step to choose from. ``settings`` go to
    ``plan``."""
    spec = _as_spec(mesh)
    axis_sizes = spec.shape(target.chips)
    rows: list[PlanRow] = []
    tried: list[PlanRow] = []
    baseline = [e for e in engines if e != "shard_map"]
    for sum_dtype in sum_dtypes or (options.gradient_sum_dtype,):
        asked = dataclasses.replace(options, gradient_sum_dtype=sum_dtype)
        for variant in scheme_variants(asked, axis_sizes, objective):
            run = [e for e in engines if e == "shard_map" or e in baseline]
            baseline = []  # the GSPMD rows once a layout: they take no options
            compiled = plan(
                target, objective, [spec], batch, engines=run, options=variant, **settings
            )
            rows += compiled
            ours = [r for r in compiled if r.engine == "shard_map"]
            if ours:
                tried.append(ours[-1])
        if any(r.fits for r in tried):
            break
    if on_scheme is not None and len(tried) > 1:
        on_scheme(SchemeChoice(min(tried, key=_scheme_rank), tuple(tried)))
    return rows


def _factorizations(n: int, slots: int) -> Iterable[tuple[int, ...]]:
    """Every way to write ``n`` as an ordered product of ``slots`` positive integers."""
    if slots == 1:
        yield (n,)
        return
    for first in range(1, n + 1):
        if n % first == 0:
            for rest in _factorizations(n // first, slots - 1):
                yield (first, *rest)


def candidate_meshes(
    target: Target,
    objective,
    batch: int,
    *,
    layout: Layout = Layout(),
    options: StepOptions = StepOptions(),
    accumulation: int = 1,
) -> list[MeshSpec]:
    """Every layout of the six axes over ``target``'s devices that the ``Trainer`` accepts for
    ``objective`` on batches of ``batch`` rows: each size divides what it splits (heads, kv heads,
    MLP width and vocabulary over tensor; experts over expert; layers over stage; positions over
    sequence; rows over the batch axes), checked by building the ``Trainer`` itself. A pipeline
    gets ``microbatches = stage`` (its least); ``expert`` above 1 only for an MoE model.

    ``options`` apply where the mesh has their axis (``sequence_parallel`` only with tensor,
    a non-ring scheme only with sequence), so one call enumerates both kinds of layout.
    """
    return [spec for spec, _ in _accepted(target, objective, batch, layout, options, accumulation)]


def _accepted(target, objective, batch, layout, options, accumulation):
    """``(spec, trainer)`` of each layout ``candidate_meshes`` keeps, the trainer built once."""
    for sizes in _factorizations(target.chips, len(AXES)):
        shape = dict(zip(AXES, sizes))
        if shape["expert"] > 1 and not getattr(objective.model, "num_experts", 0):
            continue
        spec = MeshSpec(
            **{a: shape[a] for a in AXES[1:]},
            microbatches=shape["stage"] if shape["stage"] > 1 else None,
        )
        try:
            trainer = _trainer(
                target,
                objective,
                optax.adamw(1e-3),
                spec,
                engine="shard_map",
                layout=layout,
                options=_options_for(options, shape),
                accumulation=accumulation,
            )
            trainer.check_batch(batch, objective.seq_len)
        except ValueError:
            continue
        yield spec, trainer


def _options_for(options: StepOptions, shape: dict) -> StepOptions:
    return StepOptions(
        sequence_parallel=options.sequence_parallel and shape["tensor"] > 1,
        sequence_scheme=options.sequence_scheme if shape["sequence"] > 1 else "ring",
        pipeline_schedule=options.pipeline_schedule if shape["stage"] > 1 else "1f1b",
        fsdp_scheme=(
            options.fsdp_scheme
            if 1 < shape["fsdp"] <= fsdp.RING_MAX and shape["stage"] == 1
            else "gather"
        ),
        gradient_sum_dtype=options.gradient_sum_dtype,
        # The tensor rings where a tensor axis has them and no pipeline refuses them.
        tensor_scheme=(
            options.tensor_scheme if shape["tensor"] > 1 and shape["stage"] == 1 else "plain"
        ),
    )


def _state_bytes(trainer) -> int:
    """Bytes of the training state one device holds in ``trainer``'s layout (no compile)."""
    total = 0
    for leaf, sharding in zip(
        jax.tree_util.tree_leaves(trainer._abstract_state),
        jax.tree_util.tree_leaves(trainer.state_shardings),
    ):
        shard = sharding.shard_shape(leaf.shape)
        total += math.prod(shard) * leaf.dtype.itemsize
    return total


# ``search`` compiles at most this many layouts for each one it is asked to find that fits.
SEARCH_COMPILES_PER_LAYOUT = 4


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A layout ``search`` considered, with what it knew before compiling."""

    mesh: MeshSpec
    state_bytes: int  # the state one device holds (weights, optimizer, EMA)
    traced_wire_bytes: int  # the step's collectives as its jaxpr asks for them


def search(
    target: Target,
    objective,
    batch: int,
    *,
    max_layouts: int = 4,
    engines: Sequence[str] = ("shard_map",),
    layout: Layout = Layout(),
    options: StepOptions = StepOptions(),
    accumulation: int = 1,
    on_row: Callable[[PlanRow], None] | None = None,
    on_candidates: Callable[[list[Candidate]], None] | None = None,
    on_choice: Callable[[list[PlanRow]], None] | None = None,
    on_scheme: Callable[[SchemeChoice], None] | None = None,
    optimizer: optax.GradientTransformation | None = None,
    states: Sequence[str] | None = None,
    sum_dtypes: Sequence[str | None] | None = None,
) -> list[PlanRow]:
    """Finds the layouts of ``candidate_meshes``, compiles them until ``max_layouts`` fit and
    returns their rows, those that fit first, then by exposed wire bytes per device (fewest
    first: ``_rank``).

    Where ``objective``'s model leaves a choice (``"auto"``: the ``SEARCH_DIMENSIONS``, e.g.
    ``remat``), each layout is compiled with its candidates in their order until one fits
    (``plan_choices``); the layouts are traced and ordered with the preferred candidate. Where
    ``options`` leave the fsdp scheme to choose (``"auto"``), each layout is compiled with each
    scheme that can run on it, and the one that fits with the least exposed communication is
    its choice (``plan_schemes``, ``on_scheme``); ``sum_dtypes`` (``SUM_DTYPE_ORDER``) are the
    gradient sums' dtypes tried, the next only where nothing fits in the one before.

    Which to compile, in order (each number exact, none needs a compile):

    1. Drop the layouts whose state alone (weights, optimizer moments, EMA: the shard each device
       holds) passes the chip's memory: they cannot fit, whatever the step does.
    2. Trace each remaining step (seconds, not minutes) and order them by the wire bytes per device
       its jaxpr asks for; ties go to the smaller state.
    3. Compile them in that order until ``max_layouts`` of them fit (a row of any engine that
       fits), and at most ``SEARCH_COMPILES_PER_LAYOUT * max_layouts`` of them: the fewest bytes
       often come with the largest state (a deep pipeline), which the step's temporaries can
       take past the chip, and the compiler refuses such a step in about a second.

    The jaxpr's bytes are what the code asks for; the compiled rows say what XLA kept, and are
    what the result is ranked by.
    """
    from dew.collectives import collectives

    candidates = []
    preferred = choices(objective)[0][1]  # traced in the layouts' order: nothing to choose
    for spec, trainer in _accepted(target, preferred, batch, layout, options, accumulation):
        state = _state_bytes(trainer)
        if state > target.hbm_bytes:
            continue
        report = collectives(trainer.train_step(batch), *trainer.step_arguments(batch))
        candidates.append(Candidate(spec, state, sum(r.wire_bytes for r in report.rows)))
    candidates.sort(key=lambda c: (c.traced_wire_bytes, c.state_bytes))
    if on_candidates is not None:
        on_candidates(candidates)
    rows, fitting = [], 0
    for c in candidates[: SEARCH_COMPILES_PER_LAYOUT * max_layouts]:
        if fitting == max_layouts:
            break
        step_options = _options_for(options, c.mesh.shape(target.chips))
        compiled = plan_schemes(
            target,
            objective,
            c.mesh,
            batch,
            options=step_options,
            engines=engines,
            sum_dtypes=sum_dtypes,
            on_scheme=on_scheme,
            on_row=on_row,
            on_choice=on_choice,
            layout=layout,
            accumulation=accumulation,
            optimizer=optimizer,
            states=states,
        )
        rows += compiled
        fitting += any(row.fits for row in compiled)
    return sorted(rows, key=_rank)


def search_summary(rows: Sequence[PlanRow]) -> str:
    """What a search chose and why, in one line: the best of ``rows`` (``_rank``: those that fit
    first, then fewest wire bytes per step, then least memory) with the choices it was compiled
    with."""
    fitting = [r for r in rows if r.fits]
    if not fitting:
        return f"search: none of the {len(rows)} steps compiled fits"
    best = min(fitting, key=_rank)
    values = f", {_values_text(best)}" if best.choices else ""
    options = f", {best.options}" if best.options else ""
    exposed = _bytes(best.exposed_wire_bytes)
    if best.exposed_s is not None:
        exposed += f", {seconds_text(best.exposed_s)}"
    return (
        f"search chose {best.mesh} ({best.engine}{values}{options}): of the {len(fitting)} "
        f"steps that fit, the fewest exposed wire bytes per step ({exposed}), then the fewest "
        f"wire bytes ({_bytes(best.wire_bytes)}), then the least memory "
        f"({_bytes(best.total_bytes)} of {format_bytes(best.limit_bytes)}); each layout's "
        "choices are the first that fit in their order, its scheme the least exposed (above)"
    )


def _rank(row: PlanRow) -> tuple:
    """Those that fit first, then fewest exposed wire bytes (the communication nothing hides),
    then fewest wire bytes, then least memory; unknowns last."""
    unknown = math.inf
    return (
        not row.fits,
        unknown if row.exposed_wire_bytes is None else row.exposed_wire_bytes,
        unknown if row.wire_bytes is None else row.wire_bytes,
        unknown if row.total_bytes is None else row.total_bytes,
    )


COLUMNS = (
    "layout",
    "engine",
    "remat",
    "state",
    "temp",
    "temp (analysis)",
    "total",
    "hbm",
    "verdict",
    "wire/step",
    "overlapped/exposed",
    "ops",
    "compile",
)


def _ops_text(counts: dict) -> str:
    return " ".join(f"{op}:{n}" for op, n in sorted(counts.items())) or "-"


def _bytes(n: int | None) -> str:
    return "-" if n is None else format_bytes(n)


def seconds_text(seconds: float) -> str:
    """``0.0123`` -> ``"12.3 ms"``."""
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _overlap_text(row: PlanRow) -> str:
    """``"3.9 GiB / 2.6 GiB (13.0 ms)"``: the wire bytes run beside compute, then those run
    alone, and their time at the chip's link bandwidth (``PlanRow.exposed_s``)."""
    if row.overlapped_wire_bytes is None or row.exposed_wire_bytes is None:
        return "-"
    time = f" ({seconds_text(row.exposed_s)})" if row.exposed_s is not None else ""
    return f"{_bytes(row.overlapped_wire_bytes)} / {_bytes(row.exposed_wire_bytes)}{time}"


def row_cells(row: PlanRow) -> tuple[str, ...]:
    """One row of ``format_table``'s text: each column means the same in every row, ``-`` where
    the row cannot know it (a step the compiler refused has no temporaries or collectives)."""
    layout = row.mesh + (f" ({row.options})" if row.options else "")
    wire = _bytes(row.wire_bytes) + ("*" if row.approximate else "")
    compiled = row.error is None and row.refused is None
    return (
        layout,
        row.engine,
        row.remat or "-",
        _bytes(row.state_bytes),
        _bytes(row.temp_bytes),
        _bytes(row.analysis_temp_bytes),
        _bytes(row.total_bytes),
        format_bytes(row.hbm_bytes),
        row.verdict,
        wire,
        _overlap_text(row),
        _ops_text(row.collectives) if compiled else "-",
        f"{row.compile_s:.0f} s" if row.error is None or row.compile_s else "-",
    )


def format_table(rows: Sequence[PlanRow]) -> str:
    """The rows as an aligned text table, errors listed under it."""
    cells = [COLUMNS] + [row_cells(r) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c[i].ljust(widths[i]) for i in range(len(COLUMNS))).rstrip() for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for r in rows:
        if r.error is not None:
            lines.append(f"{r.mesh} ({r.engine}): {r.error}")
    for r in rows:
        if r.refused is not None:
            lines.append(
                f"{r.mesh} ({r.engine}): the TPU compiler refused it (it lets a program use "
                f"{_bytes(r.usable_bytes)} of the chip's {format_bytes(r.hbm_bytes)}): {r.refused}"
            )
    if any(r.approximate for r in rows):
        lines.append("* approximate: a loop whose trip count the HLO does not give")
    return "\n".join(lines)
