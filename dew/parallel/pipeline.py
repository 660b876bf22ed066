"""Pipeline parallelism over the ``stage`` axis: 1F1B schedules of lock-step ticks, run inside the
caller's ``jax.shard_map`` by one ``lax.scan``.

The schedule. ``S`` stages, ``M`` microbatches. Time runs in ticks, the same on every device; at
each tick every stage does one of: nothing (``.``), the forward of one microbatch (``F m``) or its
backward (``B m``). An activation made at tick ``t`` reaches the next stage for tick ``t + 1``,
and so does a gradient going back. Stage ``s`` runs ``S - s - 1`` warm-up forwards, then
alternates one forward and one backward, then runs the cool-down backwards (PipeDream-flush,
"1F1B"). ``schedule_1f1b(4, 8).table()``:

    tick     0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15 16 17 18 19 20 21
    stage 0 F0 F1 F2 F3  .  .  . B0 F4 B1 F5 B2 F6 B3 F7 B4  . B5  . B6  . B7
    stage 1  . F0 F1 F2  .  . B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5  . B6  . B7  .
    stage 2  .  . F0 F1  . B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6  . B7  .  .
    stage 3  .  .  . F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7  .  .  .

A step takes ``2 (M + S - 1)`` ticks and each stage is idle ``2 (S - 1)`` of them, so with a
forward and a backward of equal cost the bubble (idle share of the step) is
``(S - 1) / (M + S - 1)``: 3/11 above. ``schedule_gpipe`` (every forward, then every backward)
has the same ticks and bubble; what it loses is memory.

Lock-step has a price when a backward costs more than a forward (it does: it recomputes the
forward, then runs the backward proper, about ``3x`` a forward). Each tick ends with a
``ppermute`` between neighbours, so a tick lasts as long as its slowest stage, and after warm-up
every tick of ``schedule_1f1b`` has some stage running a backward: ``Schedule.step_time(1, 3)``
is 58 above against the 44 of ``(M + S - 1) (1 + 3)``, a bubble of 45%, not 27%.
``schedule_1f1b_phased`` fixes that: ticks alternate between forward ticks and backward ticks
(even and odd columns), so each lasts one forward or one backward, and a tick where every stage
idles costs nothing. A hop now takes two ticks, so stage ``s`` warms up with ``2 (S - s - 1)``
forwards. ``schedule_1f1b_phased(4, 8).table()``:

    tick     0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27
    stage 0 F0  . F1  . F2  . F3  . F4  . F5  . F6 B0 F7 B1  . B2  . B3  . B4  . B5  . B6  . B7
    stage 1  .  . F0  . F1  . F2  . F3  . F4 B0 F5 B1 F6 B2 F7 B3  . B4  . B5  . B6  . B7  .  .
    stage 2  .  .  .  . F0  . F1  . F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5  . B6  . B7  .  .  .  .
    stage 3  .  .  .  .  .  . F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7  .  .  .  .  .  .

Its step time is ``(M + S - 1) (forward + backward)`` whatever their ratio (44 above), so its
bubble is ``(S - 1) / (M + S - 1)`` of the step; the price is memory, about twice 1F1B's
inputs held (below), still flat in ``M``.

What each tick sends, per device: one ``lax.ppermute`` over ``stage``, ``s -> s + 1``, of the
activation ``[rows_m, ...]`` of the forward it just ran, in the activation's dtype; and one,
``s -> s - 1``, of the gradient of its input from the backward it just ran, same shape and dtype.
Both sit outside the branch that picks the work, so every device sends them every tick, zeros
when it ran no such work; a phased schedule sends only the forward one after a forward tick and
the backward one after a backward tick. So a step sends ``2 (M + S - 1)`` of each per device
(``M + 2 S - 2`` phased), ``M`` of which carry a microbatch across each stage boundary. Nothing
else crosses ``stage``: no weight is gathered over it.

Memory. A forward stores only its input ``x_in`` (the activation that came from stage
``s - 1``); the backward recomputes the stage from it under ``jax.vjp`` and frees it. Received
activations wait in a ring buffer of ``input_slots`` entries, microbatch ``m`` in slot
``m mod input_slots`` from the tick it arrives to its backward; gradients from stage ``s + 1``
wait in a ring of ``grad_slots`` until their backward. ``Schedule`` computes both from the
table, as the widest range of microbatches alive at once on a stage. Stage ``s`` keeps at most
``S - s`` microbatches between forward and backward (``held_inputs``) under ``schedule_1f1b``
and ``2 (S - s) - 1`` under ``schedule_1f1b_phased``; their input rings need ``S`` and
``2 S - 2`` slots (stage 1 also holds what arrived and waits for its forward), their gradient
rings 1, whatever ``M``: a step's temporary memory is flat in ``M``. GPipe's input ring needs
``M``.

In the library. ``Trainer(mesh=MeshSpec(stage=S, microbatches=M),
options=StepOptions(pipeline_schedule=...))`` runs ``pipeline_gradients`` in its step
(``dew.training.step._pipelined_gradients``) with one of
``SCHEDULES``, the layers split over ``stage`` by the layout (``check_layout``) and a ``stage_fn``
from ``LMObjective.stage_loss_sum``; evaluation runs ``pipeline_forward``. docs/distributed.md
explains the choices.

Layout: the schedules (``Schedule``, ``schedule_1f1b``, ``schedule_1f1b_phased``,
``schedule_gpipe``, ``SCHEDULES``, ``bubble_formula``), ``check_layout``, ``_schedule``, which
builds every schedule's tables, then the runner (``pipeline_gradients``, ``pipeline_forward``) and
its helpers. It is one module because the schedules, their tables and the runner that executes them
are one idea: the runner reads the schedule's arrays tick by tick, and split apart each half would
need the other to be read.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dew.checks import positive_int
from dew.layout import weight_dimensions

__all__ = [
    "AXIS",
    "BACKWARD",
    "FORWARD",
    "IDLE",
    "SCHEDULES",
    "Schedule",
    "bubble_formula",
    "check_layout",
    "pipeline_forward",
    "pipeline_gradients",
    "schedule_1f1b",
    "schedule_1f1b_phased",
    "schedule_gpipe",
]

AXIS = "stage"

# What a stage does at a tick: the index of the branch `pipeline_gradients` runs.
IDLE, FORWARD, BACKWARD = 0, 1, 2


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    """A static pipeline schedule: what every stage does at every tick.

    ``kind``: ``[ticks, stages]`` int32, ``IDLE``, ``FORWARD`` or ``BACKWARD``; ``micro``: the
    same shape, the microbatch of that work (-1 when idle). ``period``: how many ticks one
    iteration of ``pipeline_gradients``' scan runs (1, or 2 for ``schedule_1f1b_phased``: a
    forward tick then a backward tick). Every other field is derived from these by
    ``_schedule``:

    - ``arrive_forward[t, s]``: the microbatch whose activation stage ``s`` receives at the end
      of tick ``t`` (stage ``s - 1`` ran its forward at ``t``), else -1.
    - ``arrive_backward[t, s]``: the microbatch whose input gradient stage ``s`` receives at the
      end of tick ``t`` (stage ``s + 1`` ran its backward at ``t``), else -1.
    - ``held_inputs[s]``: the most microbatches stage ``s`` has forwarded and not yet backwarded
      at any one tick (stage 0 keeps no activation for them: it recomputes from ``inputs_m``).
    - ``input_slots``, ``grad_slots``: the ring buffers' sizes. Microbatch ``m`` lives in slot
      ``m mod slots`` from the end of the tick it arrives to its backward; the sizes are the
      widest range of microbatches alive at once on any stage, so two alive never share a slot.
    """

    name: str
    stages: int
    microbatches: int
    period: int
    kind: np.ndarray
    micro: np.ndarray
    arrive_forward: np.ndarray
    arrive_backward: np.ndarray
    held_inputs: np.ndarray
    input_slots: int
    grad_slots: int

    @property
    def ticks(self) -> int:
        return self.kind.shape[0]

    def step_time(self, forward: float = 1.0, backward: float = 1.0) -> float:
        """The step's compute time when a forward takes ``forward`` and a backward ``backward``:
        ticks are lock-step (each ends with a ``ppermute`` between neighbours), so a tick lasts
        as long as its slowest stage's work, and a tick where every stage idles costs nothing."""
        cost = np.array([0.0, forward, backward])[self.kind]
        return float(cost.max(axis=1).sum())

    def bubble(self, forward: float = 1.0, backward: float = 1.0) -> float:
        """The idle share of a stage's step time: ``1 - M (forward + backward) / step_time``."""
        busy = self.microbatches * (forward + backward)
        return 1.0 - busy / self.step_time(forward, backward)

    @property
    def bubble_fraction(self) -> float:
        """``bubble()`` with a forward and a backward of equal cost: ``(S - 1) / (M + S - 1)``
        for every schedule here."""
        return self.bubble(1.0, 1.0)

    def table(self) -> str:
        """The schedule as text: one row per stage, one column per tick, ``F3`` the forward of
        microbatch 3, ``B3`` its backward, ``.`` idle."""
        width = max(2, len(str(self.ticks - 1)), len(str(self.microbatches - 1)) + 1)
        label = len(f"stage {self.stages - 1}")

        def cell(kind, m):
            text = {IDLE: ".", FORWARD: f"F{m}", BACKWARD: f"B{m}"}[int(kind)]
            return text.rjust(width)

        header = " ".join(str(t).rjust(width) for t in range(self.ticks))
        lines = ["tick".ljust(label) + " " + header]
        for s in range(self.stages):
            cells = (cell(k, m) for k, m in zip(self.kind[:, s], self.micro[:, s]))
            lines.append(f"stage {s}".ljust(label) + " " + " ".join(cells))
        return "\n".join(lines)


def schedule_1f1b(stages: int, microbatches: int) -> Schedule:
    """PipeDream-flush (1F1B) in unit ticks: stage ``s`` runs ``min(S - s - 1, M)`` warm-up
    forwards, then alternates one forward and one backward, then the remaining backwards; in a
    tick some stages run forwards while others run backwards.

    Ticks: ``2 (M + S - 1)``, each stage idle ``2 (S - 1)`` of them; stage ``s`` holds at most
    ``min(S - s, M)`` microbatches' inputs; the input ring needs at most ``S`` slots and the
    gradient ring 1. Step time ``2 (M + S - 1) max(forward, backward)`` once every stage is busy.
    """
    stages = positive_int("stages", stages)
    microbatches = positive_int("microbatches", microbatches)
    orders = [_one_forward_one_backward(stages - s - 1, microbatches) for s in range(stages)]
    return _schedule("1f1b", stages, microbatches, orders, period=1)


def schedule_1f1b_phased(stages: int, microbatches: int) -> Schedule:
    """1F1B in phases: ticks alternate between forward ticks (every stage runs a forward or
    idles) and backward ticks, so a tick lasts one forward or one backward, never the longer of
    the two. Stage ``s`` runs ``min(2 (S - s - 1), M)`` warm-up forwards (a hop now takes two
    ticks each way), then one forward and one backward per phase, then the remaining backwards.

    Ticks: ``2 (M + 2 S - 2)`` (the ones where every stage idles cost nothing); step time
    ``(M + S - 1) (forward + backward)`` whatever their ratio, so the bubble is
    ``(S - 1) / (M + S - 1)`` of the step. Stage ``s`` holds at most ``min(2 (S - s) - 1, M)``
    microbatches' inputs, flat in ``M`` but about twice ``schedule_1f1b``'s.
    """
    stages = positive_int("stages", stages)
    microbatches = positive_int("microbatches", microbatches)
    orders = [_one_forward_one_backward(2 * (stages - s - 1), microbatches) for s in range(stages)]
    return _schedule("1f1b-phased", stages, microbatches, orders, period=2)


def schedule_gpipe(stages: int, microbatches: int) -> Schedule:
    """GPipe: every stage runs all ``M`` forwards, then all ``M`` backwards. Same ticks and bubble
    as ``schedule_1f1b``, but every stage holds all ``M`` microbatches' inputs (the comparison
    for memory)."""
    stages = positive_int("stages", stages)
    microbatches = positive_int("microbatches", microbatches)
    order = [(FORWARD, m) for m in range(microbatches)]
    order += [(BACKWARD, m) for m in range(microbatches)]
    return _schedule("gpipe", stages, microbatches, [order] * stages, period=1)


# The schedules ``StepOptions(pipeline_schedule=...)`` names. "1f1b" (the default) keeps at
# most S microbatches' inputs on a stage; "1f1b_phased" reaches the formula's bubble in wall time
# when a backward costs more than a forward, for about twice the inputs held; "gpipe" holds all
# M, and is there to compare memory with.
SCHEDULES = {
    "1f1b": schedule_1f1b,
    "1f1b_phased": schedule_1f1b_phased,
    "gpipe": schedule_gpipe,
}


def bubble_formula(stages: int, microbatches: int) -> float:
    """``(S - 1) / (M + S - 1)``: the idle share of a step of ``M`` microbatches over ``S``
    stages when a stage's forward and backward of a microbatch take a fixed time and nothing else
    does (every schedule here, phased 1F1B whatever the forward/backward ratio)."""
    stages = positive_int("stages", stages)
    microbatches = positive_int("microbatches", microbatches)
    return (stages - 1) / (microbatches + stages - 1)


def check_layout(param_specs, logical_axes, stage_size: int) -> None:
    """Raises ``ValueError`` unless every ``layers`` dimension is split over ``stage`` (and
    nothing else is) when ``stage_size > 1``: each stage runs the contiguous run of layers it
    holds, and the embedding, norms and head it reads whole."""
    if stage_size == 1:
        return
    for where, names, spec, name, mesh_axes, _ in weight_dimensions(param_specs, logical_axes):
        right = mesh_axes == (AXIS,) if name == "layers" else AXIS not in mesh_axes
        if not right:
            raise ValueError(
                f"stage {stage_size}: weight {where} (logical axes {names}) has spec {spec}; "
                f"the pipeline needs each 'layers' dimension split over {AXIS!r} alone, and "
                f"nothing else split over it: give the Layout the rule ('layers', {AXIS!r}) "
                "first, as dew.layout.DEFAULT_RULES does"
            )


def _one_forward_one_backward(warm: int, microbatches: int) -> list:
    """A stage's work in order: ``warm`` forwards, then forward and backward alternating, then
    the remaining backwards; a list of ``(kind, m)``."""
    warm = min(warm, microbatches)
    order = [(FORWARD, m) for m in range(warm)]
    for m in range(microbatches - warm):
        order += [(FORWARD, warm + m), (BACKWARD, m)]
    return order + [(BACKWARD, m) for m in range(microbatches - warm, microbatches)]


def _schedule(name: str, stages: int, microbatches: int, orders: list, period: int) -> Schedule:
    """Run each stage's ``orders[s]`` (a list of ``(kind, m)``) in order, as early as its inputs
    allow: ``F(s, m)`` a tick after ``F(s - 1, m)``; ``B(s, m)`` a tick after ``B(s + 1, m)``, or
    after ``F(s, m)`` on the last stage. With ``period`` 2, even ticks run only forwards and odd
    ticks only backwards. Returns the table with its derived fields."""
    done = {}  # (kind, s, m) -> tick
    nexts = [0] * stages
    kinds, micros = [], []
    while any(nexts[s] < len(orders[s]) for s in range(stages)) or len(kinds) % period:
        t = len(kinds)
        allowed = (FORWARD, BACKWARD) if period == 1 else ((FORWARD,), (BACKWARD,))[t % 2]
        row_kind, row_micro = [IDLE] * stages, [-1] * stages
        for s in range(stages):
            if nexts[s] == len(orders[s]):
                continue
            kind, m = orders[s][nexts[s]]
            if kind == FORWARD:
                need = None if s == 0 else (FORWARD, s - 1, m)
            elif s == stages - 1:
                need = (FORWARD, s, m)
            else:
                need = (BACKWARD, s + 1, m)
            if kind in allowed and (need is None or done.get(need, t) < t):
                row_kind[s], row_micro[s] = kind, m
        for s in range(stages):
            if row_kind[s] != IDLE:
                done[(row_kind[s], s, row_micro[s])] = t
                nexts[s] += 1
        kinds.append(row_kind)
        micros.append(row_micro)
        if t >= period and not np.any(np.asarray(kinds[-period - 1 :]) != IDLE):
            raise AssertionError(f"{name} schedule of {stages} stages deadlocks at tick {t}")

    kind = np.asarray(kinds, np.int32)
    micro = np.asarray(micros, np.int32)
    ticks = len(kinds)
    arrive_forward = np.full((ticks, stages), -1, np.int32)
    arrive_backward = np.full((ticks, stages), -1, np.int32)
    arrive_forward[:, 1:] = np.where(kind[:, :-1] == FORWARD, micro[:, :-1], -1)
    arrive_backward[:, :-1] = np.where(kind[:, 1:] == BACKWARD, micro[:, 1:], -1)

    forward_at, backward_at = np.zeros((2, stages, microbatches), np.int64)
    for (k, s, m), t in done.items():
        (forward_at if k == FORWARD else backward_at)[s, m] = t
    tick = np.arange(ticks)[:, None]
    held = np.array(
        [
            ((forward_at[s] <= tick) & (tick < backward_at[s])).sum(axis=1).max()
            for s in range(stages)
        ],
        np.int32,
    )
    # A microbatch's slot is written at the end of the tick its message arrives and read up to
    # its backward. Stage 0 reads its inputs from the microbatches and the last stage starts its
    # backward from the loss: neither receives anything into that ring.
    input_slots = max(
        [_spread(forward_at[s - 1], backward_at[s], ticks) for s in range(1, stages)], default=1
    )
    grad_slots = max(
        [_spread(backward_at[s + 1], backward_at[s], ticks) for s in range(stages - 1)], default=1
    )
    return Schedule(
        name,
        stages,
        microbatches,
        period,
        kind,
        micro,
        arrive_forward,
        arrive_backward,
        held,
        input_slots,
        grad_slots,
    )


def _spread(written: np.ndarray, last_read: np.ndarray, ticks: int) -> int:
    """The widest range of microbatches ``m`` alive at once, alive at tick ``t`` meaning
    ``written[m] <= t < last_read[m]``: written by the end of ``t`` and read after it. A ring of
    that many slots, ``m`` in slot ``m mod slots``, never overwrites a microbatch still to be
    read. (At least 1.)"""
    widest = 1
    for t in range(ticks):
        alive = np.flatnonzero((written <= t) & (t < last_read))
        if alive.size:
            widest = max(widest, int(alive[-1] - alive[0]) + 1)
    return widest


def pipeline_gradients(
    stage_fn: Callable,
    params,
    microbatches,
    schedule: Schedule,
    *,
    activation: jax.ShapeDtypeStruct,
    axis: str = AXIS,
    loss_scale: float = 1.0,
    has_aux: bool = False,
):
    """This stage's gradients and loss over ``microbatches``, run by ``schedule``: call it inside
    a ``jax.shard_map`` (``check_vma=False``) whose mesh has ``axis`` of ``schedule.stages``.

    ``stage_fn(params, x_in, inputs_m) -> (y, loss_m)``: this device's stage on one microbatch
    (it reads its stage as ``lax.axis_index(axis)``, and may use collectives over other mesh
    axes). ``x_in``: the activation from stage ``s - 1``, ``activation``'s shape and dtype (zeros
    on stage 0, which reads ``inputs_m`` instead); ``y``: the same shape and dtype, sent on to
    stage ``s + 1`` (the last stage's is dropped); ``loss_m``: a float32 scalar, this stage's
    share of the loss (0 on all stages but the last, unless they add a loss of their own). With
    ``has_aux=True`` it returns ``(y, loss_m, aux_m)``, ``aux_m`` a pytree of arrays (statistics
    such as an MoE layer's router counts) that is summed over this stage's forwards and carries
    no gradient.

    ``params``: this device's parameters (its stage's layers, and whatever else ``stage_fn``
    reads); ``microbatches``: a pytree whose leaves are ``[M, ...]``, leaf ``[m]`` being
    ``inputs_m``. ``activation``: a ``jax.ShapeDtypeStruct`` of one microbatch's ``x_in``, e.g.
    ``[rows / M, seq, embed]`` in the compute dtype (``stage_fn`` cannot say it before it has an
    ``x_in`` to trace with).

    Returns ``(grads, loss_sum)`` (``(grads, loss_sum, aux_sum)`` with ``has_aux``): ``grads``
    (``params``' structure and dtypes) is the gradient, with respect to this device's ``params``,
    of ``loss_scale`` times the sum of every stage's ``loss_m`` over the microbatches;
    ``loss_sum`` is ``sum_m loss_m`` on this stage (float32, not scaled); ``aux_sum`` is
    ``sum_m aux_m`` on this stage. Nothing is summed across devices: the caller sums each
    weight's gradient over the axes that need it, and ``loss_sum`` over ``axis`` if it wants the
    loss everywhere.

    A ``lax.scan`` runs ``schedule.period`` ticks per step. Each forward keeps only ``x_in`` (in
    a ring of ``schedule.input_slots`` entries); each backward recomputes ``stage_fn`` under
    ``jax.vjp`` with cotangents ``(dy, loss_scale)``, ``dy`` the gradient of ``y`` from stage
    ``s + 1`` (zeros on the last stage), in ``y``'s dtype. Every device of a stage takes the same
    branch at every tick, so ``stage_fn`` may run collectives over any axis but ``axis``.
    """
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a Schedule, got {type(schedule).__name__}")
    stages = lax.axis_size(axis)
    if stages != schedule.stages:
        raise ValueError(
            f"schedule is for {schedule.stages} stages but axis {axis!r} has {stages} devices"
        )
    _check_microbatches(microbatches, schedule.microbatches, "the schedule's")
    activation = jax.ShapeDtypeStruct(activation.shape, activation.dtype)
    aux_shapes = _check_stage_fn(stage_fn, params, microbatches, activation, has_aux)
    run_stage = stage_fn if has_aux else (lambda p, x, i: (*stage_fn(p, x, i), ()))

    stage = lax.axis_index(axis)
    zeros = jnp.zeros(activation.shape, activation.dtype)
    no_aux = jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), aux_shapes)
    scale = jnp.asarray(loss_scale, jnp.float32)
    to_next = [(s, s + 1) for s in range(stages - 1)]
    to_previous = [(s, s - 1) for s in range(1, stages)]

    def forward(x_in, inputs_m, dy, grads, loss, aux):
        y, loss_m, aux_m = run_stage(params, x_in, inputs_m)
        aux = jax.tree_util.tree_map(jnp.add, aux, aux_m)
        return y, zeros, grads, loss + loss_m, aux

    def backward(x_in, inputs_m, dy, grads, loss, aux):
        _, pullback = jax.vjp(lambda p, x: run_stage(p, x, inputs_m)[:2], params, x_in)
        d_params, dx = pullback((dy, scale))
        return zeros, dx, jax.tree_util.tree_map(jnp.add, grads, d_params), loss, aux

    def idle(x_in, inputs_m, dy, grads, loss, aux):
        return zeros, zeros, grads, loss, aux

    branches = {IDLE: idle, FORWARD: forward, BACKWARD: backward}
    period = schedule.period
    # What each tick of a period may run (1F1B-phased: forwards, then backwards): only those
    # branches are compiled there, and only the ppermutes they feed are sent.
    present = [sorted({IDLE, *schedule.kind[i::period].ravel().tolist()}) for i in range(period)]

    def tick(carry, row, kinds):
        inputs, dys, grads, loss, aux = carry
        kind, micro, arrive_forward, arrive_backward = (r[stage] for r in row)
        m = jnp.maximum(micro, 0)
        inputs_m = _index(microbatches, m)
        x_in = lax.dynamic_index_in_dim(inputs, m % schedule.input_slots, keepdims=False)
        dy = lax.dynamic_index_in_dim(dys, m % schedule.grad_slots, keepdims=False)
        branch = jnp.asarray([kinds.index(k) if k in kinds else 0 for k in range(3)])[kind]
        send_next, send_previous, grads, loss, aux = lax.switch(
            branch, [branches[k] for k in kinds], x_in, inputs_m, dy, grads, loss, aux
        )
        # Every device, every tick, outside the switch: the activation of the forward just run
        # goes to s + 1 and the input gradient of the backward just run to s - 1, each
        # `activation`-sized ([rows_m, ...] in its dtype), zeros where the device ran none.
        if FORWARD in kinds:
            from_previous = lax.ppermute(send_next, axis, to_next)
            inputs = _store(inputs, from_previous, arrive_forward, schedule.input_slots)
        if BACKWARD in kinds:
            from_next = lax.ppermute(send_previous, axis, to_previous)
            dys = _store(dys, from_next, arrive_backward, schedule.grad_slots)
        return inputs, dys, grads, loss, aux

    def run_period(carry, rows):
        for i in range(period):
            carry = tick(carry, tuple(r[i] for r in rows), present[i])
        return carry, None

    carry = (
        jnp.zeros((schedule.input_slots, *activation.shape), activation.dtype),
        jnp.zeros((schedule.grad_slots, *activation.shape), activation.dtype),
        jax.tree_util.tree_map(jnp.zeros_like, params),
        jnp.zeros((), jnp.float32),
        no_aux,
    )
    tables = (schedule.kind, schedule.micro, schedule.arrive_forward, schedule.arrive_backward)
    rows = tuple(jnp.asarray(t).reshape(-1, period, stages) for t in tables)
    (_, _, grads, loss, aux), _ = lax.scan(run_period, carry, rows)
    return (grads, loss, aux) if has_aux else (grads, loss)


def pipeline_forward(
    stage_fn: Callable,
    params,
    microbatches,
    *,
    activation: jax.ShapeDtypeStruct,
    axis: str = AXIS,
    has_aux: bool = False,
):
    """The forward alone (evaluation): ``sum_m loss_m`` on this stage (and ``sum_m aux_m`` with
    ``has_aux``), ``stage_fn``, ``microbatches`` and ``activation`` as ``pipeline_gradients``
    takes them, inside the caller's ``shard_map``.

    ``M + S - 1`` ticks under one ``lax.scan``: at tick ``t`` stage ``s`` runs the forward of
    microbatch ``t - s`` (idles when there is none) and sends its output to ``s + 1`` by one
    ``ppermute`` of ``activation``'s size. Nothing is kept for a backward: a stage holds one
    activation at a time, whatever ``M``.
    """
    stages = lax.axis_size(axis)
    count = _check_microbatches(microbatches, None, "the")
    activation = jax.ShapeDtypeStruct(activation.shape, activation.dtype)
    aux_shapes = _check_stage_fn(stage_fn, params, microbatches, activation, has_aux)
    run_stage = stage_fn if has_aux else (lambda p, x, i: (*stage_fn(p, x, i), ()))
    stage = lax.axis_index(axis)
    zeros = jnp.zeros(activation.shape, activation.dtype)
    no_aux = jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), aux_shapes)
    to_next = [(s, s + 1) for s in range(stages - 1)]

    def tick(carry, t):
        x_in, loss, aux = carry
        m = t - stage
        inputs_m = _index(microbatches, jnp.clip(m, 0, count - 1))
        y, loss_m, aux_m = lax.cond(
            (m >= 0) & (m < count),
            lambda: run_stage(params, x_in, inputs_m),
            lambda: (zeros, jnp.zeros((), jnp.float32), no_aux),
        )
        aux = jax.tree_util.tree_map(jnp.add, aux, aux_m)
        return (lax.ppermute(y, axis, to_next), loss + loss_m, aux), None

    carry = (zeros, jnp.zeros((), jnp.float32), no_aux)
    (_, loss, aux), _ = lax.scan(tick, carry, jnp.arange(count + stages - 1))
    return (loss, aux) if has_aux else loss


def _index(microbatches, m: jax.Array):
    """Microbatch ``m`` of every leaf of ``microbatches`` (leaves ``[M, ...]``)."""
    return jax.tree_util.tree_map(
        lambda leaf: lax.dynamic_index_in_dim(leaf, m, keepdims=False), microbatches
    )


def _check_microbatches(microbatches, expected: int | None, whose: str) -> int:
    """The common leading dimension of ``microbatches``' leaves; ValueError unless they all
    have one (equal to ``expected`` when given)."""
    leaves = jax.tree_util.tree_leaves(microbatches)
    lengths = sorted({leaf.shape[0] if leaf.ndim else None for leaf in leaves}, key=str)
    if len(lengths) != 1 or lengths[0] is None or (expected is not None and lengths != [expected]):
        wanted = f"{whose} {expected} microbatches" if expected is not None else "microbatches"
        raise ValueError(
            f"microbatches' leaves must all have a leading dimension of {wanted}, got leading "
            f"dimensions {lengths}"
        )
    return lengths[0]


def _store(ring: jax.Array, value: jax.Array, micro: jax.Array, slots: int) -> jax.Array:
    """``ring`` with ``value`` in slot ``micro mod slots``, or ``ring`` as it was when ``micro``
    is -1 (nothing arrived). Writes one slot either way, never the whole ring."""
    slot = jnp.maximum(micro, 0) % slots
    kept = lax.dynamic_index_in_dim(ring, slot, keepdims=False)
    return lax.dynamic_update_index_in_dim(ring, jnp.where(micro >= 0, value, kept), slot, 0)


def _check_stage_fn(stage_fn, params, microbatches, activation, has_aux=False):
    """ValueError unless ``stage_fn`` maps an ``activation`` to an ``activation`` and a float32
    scalar loss (and, with ``has_aux``, a pytree of arrays), checked by tracing it on the first
    microbatch. Returns the aux pytree's shapes (``()`` without ``has_aux``)."""
    first = jax.tree_util.tree_map(lambda leaf: leaf[0], microbatches)
    out = jax.eval_shape(stage_fn, params, activation, first)
    size = 3 if has_aux else 2
    if not (isinstance(out, tuple) and len(out) == size):
        wanted = "(y, loss_m, aux_m) with has_aux=True" if has_aux else "(y, loss_m)"
        raise ValueError(f"stage_fn must return {wanted}, got {out}")
    y, loss = out[:2]
    if (y.shape, y.dtype) != (activation.shape, activation.dtype):
        raise ValueError(
            f"stage_fn's y is {y.dtype}{list(y.shape)} but the activation it receives is "
            f"{activation.dtype}{list(activation.shape)}; they must match"
        )
    if (loss.shape, loss.dtype) != ((), jnp.float32):
        raise ValueError(
            f"stage_fn's loss_m must be a float32 scalar, got {loss.dtype}{list(loss.shape)}"
        )
    return out[2] if has_aux else ()
