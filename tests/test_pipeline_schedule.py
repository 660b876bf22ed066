"""The pipeline schedule over ``stage`` (dew/parallel/pipeline.py): the 1F1B table's properties,
gradients equal to one device's, temporary memory flat in the number of microbatches, and the
collectives a step sends over ``stage``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from dew.collectives import collectives
from dew.parallel import pipeline
from dew.parallel.pipeline import (
    BACKWARD,
    FORWARD,
    IDLE,
    pipeline_gradients,
    schedule_1f1b,
    schedule_1f1b_phased,
    schedule_gpipe,
)
from tests.helpers import relative_error

GRID = [
    (s, m) for s in (1, 2, 3, 4, 6) for m in sorted({1, max(s - 1, 1), s, s + 1, 2 * s + 1, 8 * s})
]


def ticks_of(schedule):
    """``{(kind, stage, m): tick}``, asserting that each stage runs each F(m) and B(m) once."""
    found = {}
    for t in range(schedule.ticks):
        for s in range(schedule.stages):
            kind, m = int(schedule.kind[t, s]), int(schedule.micro[t, s])
            if kind == IDLE:
                assert m == -1, (t, s, m)
                continue
            assert (kind, s, m) not in found, f"{schedule.name}: {(kind, s, m)} runs twice"
            found[(kind, s, m)] = t
    expected = {
        (k, s, m)
        for k in (FORWARD, BACKWARD)
        for s in range(schedule.stages)
        for m in range(schedule.microbatches)
    }
    assert set(found) == expected, f"{schedule.name}: missing {expected - set(found)}"
    return found


MAKERS = [schedule_1f1b, schedule_1f1b_phased, schedule_gpipe]


@pytest.mark.parametrize("make", MAKERS)
@pytest.mark.parametrize("stages,microbatches", GRID)
def test_schedule_dependencies_ticks_and_bubble(make, stages, microbatches):
    schedule = make(stages, microbatches)
    S, M = stages, microbatches
    at = ticks_of(schedule)
    for s in range(S):
        for m in range(M):
            if s > 0:
                assert at[(FORWARD, s, m)] > at[(FORWARD, s - 1, m)], (s, m)
            if s < S - 1:
                assert at[(BACKWARD, s, m)] > at[(BACKWARD, s + 1, m)], (s, m)
            else:
                assert at[(BACKWARD, s, m)] > at[(FORWARD, s, m)], (s, m)
    formula = (S - 1) / (M + S - 1)
    assert schedule.bubble_fraction == pytest.approx(formula, abs=1e-12)
    if make is schedule_1f1b_phased:
        assert schedule.ticks == 2 * (M + 2 * S - 2)
        assert not np.any(schedule.kind[0::2] == BACKWARD)
        assert not np.any(schedule.kind[1::2] == FORWARD)
    else:
        assert schedule.ticks == 2 * (M + S - 1)
        idle = (schedule.kind == IDLE).sum(axis=0)
        assert idle.tolist() == [2 * (S - 1)] * S
    for forward, backward in [(1.0, 2.0), (1.0, 3.0)]:
        ideal = (M + S - 1) * (forward + backward)
        if make is schedule_1f1b and S > 1 and M >= S:
            # Lock-step: the first S ticks run only forwards, every later one a backward.
            slow = S * forward + (schedule.ticks - S) * backward
            assert schedule.step_time(forward, backward) == slow
            assert schedule.bubble(forward, backward) > formula
        elif make is not schedule_1f1b:
            assert schedule.step_time(forward, backward) == ideal
            assert schedule.bubble(forward, backward) == pytest.approx(formula, abs=1e-12)


WARM_UPS = {
    schedule_1f1b: lambda S, s: S - s - 1,
    schedule_1f1b_phased: lambda S, s: 2 * (S - s - 1),
}


@pytest.mark.parametrize("make", [schedule_1f1b, schedule_1f1b_phased])
@pytest.mark.parametrize("stages,microbatches", GRID)
def test_1f1b_order_and_inputs_held(make, stages, microbatches):
    """Stage s: its warm-up forwards, then forward and backward alternate, then the cool-down
    backwards; at most warm-up + 1 microbatches forwarded and not yet backwarded (S - s for
    1F1B), so the rings stay within S slots (2 S - 2 phased) whatever M."""
    S, M = stages, microbatches
    schedule = make(S, M)
    at = ticks_of(schedule)
    for s in range(S):
        done = sorted((t, k, m) for (k, stage, m), t in at.items() if stage == s)
        kinds = "".join("F" if k == FORWARD else "B" for _, k, _ in done)
        warm = min(WARM_UPS[make](S, s), M)
        assert kinds == "F" * warm + "FB" * (M - warm) + "B" * warm, (s, kinds)
        assert [m for _, k, m in done if k == FORWARD] == list(range(M))
        assert [m for _, k, m in done if k == BACKWARD] == list(range(M))
        held = max(
            sum(at[(FORWARD, s, m)] <= t < at[(BACKWARD, s, m)] for m in range(M))
            for t in range(schedule.ticks)
        )
        assert held == schedule.held_inputs[s] == min(warm + 1, M), (s, held)
    bound = S if make is schedule_1f1b else max(2 * S - 2, 1)
    assert schedule.input_slots <= bound and schedule.grad_slots == 1
    gpipe = schedule_gpipe(S, M)
    assert gpipe.held_inputs.tolist() == [M] * S
    assert gpipe.input_slots == (M if S > 1 else 1)


@pytest.mark.parametrize("make", MAKERS)
@pytest.mark.parametrize("stages,microbatches", [(2, 5), (4, 4), (4, 9), (6, 13)])
def test_ring_buffers_hold_every_message_until_read(make, stages, microbatches):
    """Replays the rings as pipeline_gradients fills them: at each tick a stage reads its slot
    (the forward's input, the backward's input and gradient), then the arrivals of the tick are
    written; every read must find the microbatch it wants."""
    schedule = make(stages, microbatches)
    for s in range(stages):
        inputs, grads = {}, {}
        for t in range(schedule.ticks):
            kind, m = int(schedule.kind[t, s]), int(schedule.micro[t, s])
            if kind != IDLE and s > 0:
                assert inputs.get(m % schedule.input_slots) == m, (schedule.name, s, t, m)
            if kind == BACKWARD and s < stages - 1:
                assert grads.get(m % schedule.grad_slots) == m, (schedule.name, s, t, m)
            if schedule.arrive_forward[t, s] >= 0:
                arrived = int(schedule.arrive_forward[t, s])
                inputs[arrived % schedule.input_slots] = arrived
            if schedule.arrive_backward[t, s] >= 0:
                arrived = int(schedule.arrive_backward[t, s])
                grads[arrived % schedule.grad_slots] = arrived


def test_docstring_draws_the_tables():
    for make in (schedule_1f1b, schedule_1f1b_phased):
        table = make(4, 8).table()
        indented = "\n".join("    " + line for line in table.splitlines())
        assert indented in pipeline.__doc__, table
    assert "3/11" in pipeline.__doc__ and schedule_1f1b(4, 8).bubble_fraction == 3 / 11
    assert schedule_1f1b(4, 8).step_time(1, 3) == 58 and "is 58 above" in pipeline.__doc__
    assert schedule_1f1b_phased(4, 8).step_time(1, 3) == 44 and "(44 above)" in pipeline.__doc__


@pytest.mark.parametrize("make", MAKERS)
@pytest.mark.parametrize("stages,microbatches", [(0, 4), (2, 0), (2.0, 4), (True, 4)])
def test_schedule_refuses_bad_sizes(make, stages, microbatches):
    with pytest.raises(ValueError, match="must be an integer >= 1"):
        make(stages, microbatches)


# ---- the schedule run: a toy model split over stage ----------------------------------------

FEATURES, WIDTH, OUTPUTS, LAYERS_PER_STAGE = 5, 8, 3, 2


def toy_params(stages, seed):
    rng = np.random.default_rng(seed)
    return {
        "embed": rng.normal(size=(FEATURES, WIDTH)).astype(np.float32) / 2,
        "layers": rng.normal(size=(stages * LAYERS_PER_STAGE, WIDTH, WIDTH)).astype(np.float32) / 3,
        "bias": rng.normal(size=(stages * LAYERS_PER_STAGE, WIDTH)).astype(np.float32) / 4,
        "head": rng.normal(size=(WIDTH, OUTPUTS)).astype(np.float32) / 3,
    }


def toy_data(microbatches, rows, seed):
    rng = np.random.default_rng((seed, 1))
    return {
        "features": rng.normal(size=(microbatches, rows, FEATURES)).astype(np.float32),
        "targets": rng.normal(size=(microbatches, rows, OUTPUTS)).astype(np.float32),
    }


def center(x, axis_name):
    """``x`` minus its mean over the rows of every device of ``axis_name`` (a collective inside
    the stage, when ``axis_name`` is given); over the local rows of one device otherwise."""
    if axis_name is None:
        return x - x.mean(axis=0)
    total = lax.psum(x.sum(axis=0), axis_name)
    return x - total / lax.psum(x.shape[0], axis_name)


def layer_run(layers, bias, x, data_axis):
    for w, b in zip(layers, bias):
        x = center(jnp.tanh(x @ w + b), data_axis)
    return x


@jax.jit  # one compiled program: op by op, each layer's small ops would run (and compile) apart
def reference(params, data):
    """The whole network on one device: sum over microbatches of the squared error."""

    def loss(p):
        def one(features, targets):
            x = layer_run(p["layers"], p["bias"], features @ p["embed"], None)
            return jnp.sum((x @ p["head"] - targets) ** 2)

        return jnp.sum(jax.vmap(one)(data["features"], data["targets"]))

    return jax.value_and_grad(loss)(params)


def toy_stage_fn(stages, data_axis=None):
    def stage_fn(p, x_in, inputs_m):
        s = lax.axis_index("stage")
        x = lax.cond(s == 0, lambda: inputs_m["features"] @ p["embed"], lambda: x_in)
        x = layer_run(p["layers"], p["bias"], x, data_axis)
        loss = lax.cond(
            s == stages - 1,
            lambda: jnp.sum((x @ p["head"] - inputs_m["targets"]) ** 2),
            lambda: jnp.zeros((), jnp.float32),
        )
        return x, loss

    return stage_fn


PARAM_SPECS = {"embed": P(), "layers": P("stage"), "bias": P("stage"), "head": P()}


def pipelined(mesh, schedule, rows_per_device, loss_scale=1.0, dtype=jnp.float32):
    """The jitted ``(params, data) -> (grads, loss)`` of the toy model run by ``schedule`` over
    ``mesh`` (``stage``, and ``data`` splitting the rows when the mesh has it)."""
    data_axis = "data" if "data" in mesh.axis_names else None
    stages = mesh.shape["stage"]
    stage_fn = toy_stage_fn(stages, data_axis)
    if dtype != jnp.float32:
        inner = stage_fn

        def stage_fn(p, x_in, inputs_m):
            y, loss = inner(p, x_in.astype(jnp.float32), inputs_m)
            return y.astype(dtype), loss

    activation = jax.ShapeDtypeStruct((rows_per_device, WIDTH), dtype)
    token_axes = (data_axis,) if data_axis else ()

    def local(params, data):
        grads, loss = pipeline_gradients(
            stage_fn, params, data, schedule, activation=activation, loss_scale=loss_scale
        )
        # The caller's sums: over the axes splitting the rows, and over stage for the weights
        # every stage holds (only the first and last stage's are not zero).
        grads = {
            name: lax.psum(g, token_axes + (() if PARAM_SPECS[name] == P("stage") else ("stage",)))
            for name, g in grads.items()
        }
        return grads, lax.psum(loss, token_axes + ("stage",))

    data_spec = P(None, data_axis)
    mapped = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(PARAM_SPECS, {"features": data_spec, "targets": data_spec}),
        out_specs=(PARAM_SPECS, P()),
        check_vma=False,
    )
    return jax.jit(mapped)


def stage_mesh(shape, names):
    count = int(np.prod(shape))
    return Mesh(np.array(jax.devices()[:count]).reshape(shape), names)


@pytest.mark.parametrize(
    "make,shape,names,microbatches",
    [
        (schedule_1f1b, (2,), ("stage",), 2),
        (schedule_1f1b, (2,), ("stage",), 5),
        (schedule_1f1b, (4,), ("stage",), 4),
        (schedule_1f1b, (4,), ("stage",), 9),
        (schedule_1f1b, (2, 4), ("data", "stage"), 5),
        (schedule_1f1b_phased, (4,), ("stage",), 9),
        (schedule_1f1b_phased, (2, 4), ("data", "stage"), 4),
    ],
)
def test_pipeline_matches_one_device(make, shape, names, microbatches, seed):
    """Loss and every gradient of the pipelined toy model equal one device's, to 1e-5: on 2 and
    4 stages, M = S and M > S, and with a psum over data inside the stages."""
    mesh = stage_mesh(shape, names)
    stages, data = mesh.shape["stage"], dict(mesh.shape).get("data", 1)
    rows = 3
    params = toy_params(stages, seed)
    batch = toy_data(microbatches, rows * data, seed)
    loss_scale = 1.0 / (microbatches * rows * data)
    grads, loss = pipelined(mesh, make(stages, microbatches), rows, loss_scale)(params, batch)
    expected_loss, expected_grads = reference(params, batch)
    expected_grads = jax.tree_util.tree_map(lambda g: g * loss_scale, expected_grads)
    assert relative_error(loss, expected_loss) < 1e-5, (seed, float(loss), float(expected_loss))
    for name in params:
        error = relative_error(grads[name], expected_grads[name])
        assert error < 1e-5, (seed, name, error)


# ---- memory: flat in M for 1F1B, growing for GPipe -----------------------------------------

MEMORY_ROWS, MEMORY_WIDTH = 512, 256


def temp_bytes(make, microbatches):
    stages = 2
    mesh = stage_mesh((stages,), ("stage",))

    def stage_fn(p, x_in, inputs_m):
        s = lax.axis_index("stage")
        x = lax.cond(s == 0, lambda: inputs_m @ p["embed"], lambda: x_in)
        x = jnp.tanh(x @ p["layers"][0])
        loss = lax.cond(s == stages - 1, lambda: jnp.sum(x**2), lambda: jnp.zeros((), jnp.float32))
        return x, loss

    schedule = make(stages, microbatches)
    activation = jax.ShapeDtypeStruct((MEMORY_ROWS, MEMORY_WIDTH), jnp.float32)
    specs = {"embed": P(), "layers": P("stage")}

    def local(params, inputs):
        grads, loss = pipeline_gradients(stage_fn, params, inputs, schedule, activation=activation)
        return grads, loss[None]

    mapped = jax.shard_map(
        local, mesh=mesh, in_specs=(specs, P()), out_specs=(specs, P("stage")), check_vma=False
    )
    f32 = jnp.float32
    args = (
        {
            "embed": jax.ShapeDtypeStruct((FEATURES, MEMORY_WIDTH), f32),
            "layers": jax.ShapeDtypeStruct((stages, MEMORY_WIDTH, MEMORY_WIDTH), f32),
        },
        jax.ShapeDtypeStruct((microbatches, MEMORY_ROWS, FEATURES), f32),
    )
    compiled = jax.jit(mapped).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_temporary_memory_is_flat_in_microbatches():
    """At S = 2, M = 4 against M = 16: the 1F1B rings hold at most 2 S - 2 inputs whatever M,
    so their temporary memory does not move; GPipe's holds M, so it grows by at least 12
    activations."""
    activation = MEMORY_ROWS * MEMORY_WIDTH * 4
    temp = {
        make.__name__: {m: temp_bytes(make, m) for m in (4, 16)}
        for make in (schedule_1f1b, schedule_1f1b_phased, schedule_gpipe)
    }
    for name in ("schedule_1f1b", "schedule_1f1b_phased"):
        assert temp[name][16] <= 1.25 * temp[name][4], temp
        assert temp[name][16] - temp[name][4] < activation, temp
    gpipe = temp["schedule_gpipe"]
    assert gpipe[16] - gpipe[4] >= (16 - 4) * activation, temp


# ---- collectives over stage -----------------------------------------------------------------


@pytest.mark.parametrize(
    "make,dtype",
    [
        (schedule_1f1b, jnp.float32),
        (schedule_1f1b, jnp.bfloat16),
        (schedule_1f1b_phased, jnp.float32),
    ],
)
def test_stage_collectives_are_two_ppermutes_per_scan_step(make, dtype):
    """Per scan step (a tick; a forward and a backward tick phased) one ppermute each way, each
    of one activation [rows_m, width] in its dtype; nothing gathered over stage. (The caller's
    psums of the shared weights' gradients and of the loss are the only other collectives over
    stage.)"""
    mesh = stage_mesh((2, 4), ("data", "stage"))
    rows, microbatches = 3, 6
    schedule = make(4, microbatches)
    scan_steps = schedule.ticks // schedule.period
    fn = pipelined(mesh, schedule, rows, dtype=dtype)
    f32 = jnp.float32
    params = {
        name: jax.ShapeDtypeStruct(np.shape(value), f32) for name, value in toy_params(4, 0).items()
    }
    data = {
        name: jax.ShapeDtypeStruct((microbatches, rows * 2, width), f32)
        for name, width in (("features", FEATURES), ("targets", OUTPUTS))
    }
    report = collectives(fn, params, data)
    over_stage = [row for row in report.rows if "stage" in row.axes]
    activation_bytes = rows * WIDTH * jnp.dtype(dtype).itemsize
    (ppermute,) = [row for row in over_stage if row.op == "ppermute"]
    assert ppermute.axes == ("stage",), report
    assert ppermute.count == 2 * scan_steps, report
    assert ppermute.operand_bytes == 2 * scan_steps * activation_bytes, report
    assert ppermute.wire_bytes == ppermute.operand_bytes, report
    # The only other collectives over stage are the caller's psums: embed's and head's
    # gradients and the loss, each over (data, stage).
    others = [(row.op, row.axes, row.count) for row in over_stage if row.op != "ppermute"]
    assert others == [("psum", ("data", "stage"), 3)], report


# ---- refusals, at trace time ---------------------------------------------------------------


def trace_toy(schedule, *, stages=4, microbatches=4, stage_fn=None, loss_dtype=None):
    """Traces (compiles nothing) the toy pipeline on a mesh of ``stages``, with ``microbatches``
    of data, and ``stage_fn`` in place of the toy's if given."""
    mesh = stage_mesh((stages,), ("stage",))
    stage_fn = stage_fn or toy_stage_fn(stages)
    if loss_dtype is not None:
        inner = stage_fn

        def stage_fn(p, x_in, inputs_m):
            y, loss = inner(p, x_in, inputs_m)
            return y, loss.astype(loss_dtype)

    def local(params, data):
        grads, loss = pipeline_gradients(
            stage_fn,
            params,
            data,
            schedule,
            activation=jax.ShapeDtypeStruct((3, WIDTH), jnp.float32),
        )
        return grads, loss[None]

    mapped = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(PARAM_SPECS, P()),
        out_specs=(PARAM_SPECS, P("stage")),
        check_vma=False,
    )
    params = {
        name: jax.ShapeDtypeStruct(np.shape(value), jnp.float32)
        for name, value in toy_params(stages, 0).items()
    }
    data = {
        "features": jax.ShapeDtypeStruct((microbatches, 3, FEATURES), jnp.float32),
        "targets": jax.ShapeDtypeStruct((microbatches, 3, OUTPUTS), jnp.float32),
    }
    return jax.eval_shape(mapped, params, data)


def test_pipeline_refuses_a_schedule_for_other_stages():
    with pytest.raises(ValueError, match="schedule is for 2 stages but axis 'stage' has 4"):
        trace_toy(schedule_1f1b(2, 4))


def test_pipeline_refuses_microbatches_the_schedule_does_not_have():
    with pytest.raises(ValueError, match=r"4 microbatches, got leading dimensions \[5\]"):
        trace_toy(schedule_1f1b(4, 4), microbatches=5)


def test_pipeline_refuses_an_activation_stage_fn_does_not_make():
    def widening(p, x_in, inputs_m):
        return jnp.concatenate([x_in, x_in], axis=-1), jnp.zeros((), jnp.float32)

    with pytest.raises(ValueError, match=r"y is float32\[3, 16\] but .* is float32\[3, 8\]"):
        trace_toy(schedule_1f1b(4, 4), stage_fn=widening)


def test_pipeline_refuses_a_loss_that_is_not_float32():
    with pytest.raises(ValueError, match=r"float32 scalar, got bfloat16\[\]"):
        trace_toy(schedule_1f1b(4, 4), loss_dtype=jnp.bfloat16)
