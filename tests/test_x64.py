"""64-bit mode (``jax_enable_x64``): Dew's kernels, model and training step (on one layout per
mesh axis) run under it, keep float32 weights and int32 indices, and compute what they compute in
32-bit mode.

The flag is global to a process and changes every default dtype, so each mode runs in a
subprocess of its own (this file run as ``python -m tests.test_x64``): the flag never leaks into
the other tests. Both subprocesses start together on 8 simulated CPU devices and run the same
computations on the same seed, PRNG key and tokens, then pickle their results; the tests compare
them. The 64-bit one also runs the kernels against a float64 reference.
"""

from __future__ import annotations

import functools
import os
import pickle
import subprocess
import sys
import traceback
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
TOLERANCE = 1e-5
# A worker still running after this long has hung (each needs about 40 s of CPU time, several
# times that in wall time on a loaded machine): the test fails rather than wait on.
WORKER_TIMEOUT_S = 600
KEY_DTYPE = "key"  # how the worker records a PRNG key leaf's dtype

# name: (batch, q_len, kv_len, heads, kv_heads, head_dim, causal, sm_scale, mosaic). mosaic None:
# Pallas' generic interpreter, blocks of 16, so both cases have several blocks, masked and
# unmasked ones, and a padded tail. Else the Mosaic kernels in TPU interpret mode, blocks of 128
# x 32 (two query blocks, the second padded), under those `platform.tuned` overrides: the fused
# backward with keys computed 8 at a time, and the two-kernel backward. The forward's and the
# fused backward's index maps read step tables; their index arithmetic must stay int32 too. The
# Mosaic cases have the fewest heads that are GQA, 2 over 1: the TPU interpreter runs every step
# of the grid, one per head, at several times the cost of the rest of the case.
KERNEL_CASES = {
    "causal-gqa": (1, 40, 40, 8, 2, 16, True, None, None),
    "full-gqa-q-shorter": (2, 17, 40, 4, 2, 16, False, 0.3, None),
    "mosaic-causal-gqa-pieces": (
        1,
        136,
        152,
        2,
        1,
        16,
        True,
        None,
        {"block_k_compute": 8, "backward_block_k_compute": 8},
    ),
    "mosaic-causal-gqa-two-kernel": (1, 136, 152, 2, 1, 16, True, None, {"fused_backward": False}),
}
# Segment ids and a window add index arithmetic of their own: per-tile minimum and maximum ids in
# the step tables, window bounds in the index maps, masks built from positions, and without ids
# the traced offset of the half of a masked piece a strip computes. Traced only (no run: the
# cases above check the numbers; a 64-bit value shows in the program before it runs), each
# forward and backward with a window, with ids (a pair of them, unequal lengths, for the
# two-kernel Mosaic backward) or without, at the cases' query blocks and tunings.
# name: (kernel, q_len, kv_len, ids, window, platform.tuned overrides).
MASKED_KERNEL_CASES = {
    "generic-ids-window": ("generic", 40, 40, True, 9, {}),
    "mosaic-ids-window-pieces": ("mosaic", 136, 136, True, 40, {"block_k_compute": 8}),
    "mosaic-window-half-pieces": ("mosaic", 136, 136, False, 40, {"block_k_compute": 32}),
    "mosaic-ids-pair-window-two-kernel": ("mosaic", 136, 152, True, 40, {"fused_backward": False}),
}
# The Mosaic kernels compiled for a v5e chip under x64 (libtpu, compile only): a kernel's body
# is not in `_wide_values`' walk (its static ref indices and constants are Python scalars, 64-bit
# under x64, which Mosaic folds), but a traced 64-bit scalar inside one fails Mosaic's lowering
# ("Only i1 and i32 scalars are supported"). Forward and backward, bfloat16, 512 tokens of 4
# heads of 128 over 2 kv heads, blocks of 256 (small kernels: short compiles).
# name: (window, segment ids, platform.tuned overrides).
TPU_COMPILE_CASES = {
    "causal": (None, False, {}),
    # Keys 128 at a time: a strip computes the half of a masked piece it sees.
    "window-half-pieces": (300, False, {"block_k_compute": 128}),
    "ids-window-two-kernel": (300, True, {"fused_backward": False}),
}
MODEL_IMPLS = ("xla", "pallas")


class TrainerLayout(NamedTuple):
    """One training-step layout: ``dew.MeshSpec`` and ``dew.StepOptions`` keyword arguments (the
    worker builds them: ``dew`` is imported only once the worker has set its mode), and overrides
    of ``tiny_objective``."""

    mesh: dict
    options: dict = {}
    model: dict = {}


# One layout per mesh axis, each on all 8 devices with a global batch of 8 rows (``data`` takes
# the devices the named axis leaves). tiny_objective's 4 heads, MLP 128 and vocabulary 64 split
# over tensor 4; its 16 positions over sequence 4; stage 2 leaves data 4, so 2 rows a device, one
# for each of the 2 microbatches. The expert axis needs an MoE model.
TRAINER_LAYOUTS = {
    "data": TrainerLayout({}),
    "fsdp": TrainerLayout({"fsdp": 8}),
    "tensor": TrainerLayout({"tensor": 4}),
    "sequence-ring": TrainerLayout({"sequence": 4}),
    "sequence-all_to_all": TrainerLayout({"sequence": 2}, {"sequence_scheme": "all_to_all"}),
    "expert": TrainerLayout({"expert": 4}, model={"num_experts": 4, "experts_per_token": 2}),
    "stage": TrainerLayout({"stage": 2, "microbatches": 2}),
}
# Layouts that also compare `Trainer.gradients` (a second compile, so one layout only). Every
# layout compares the step's moves of the weights (new - initial), which an error in the gradient
# changes by its own relative size; the new weights, only by that size times |move| / |weights|.
GRADIENT_LAYOUTS = ("fsdp",)
TRAINER_ROWS = 8


# ---- the worker: runs in a subprocess, in one mode ------------------------------------------


def _wide_values(jaxpr) -> list[str]:
    """'where dtype' for every 64-bit value of `jaxpr`: its inputs and outputs (literals too: an
    index map may return a bare 0), every equation's, and those of its closed sub-jaxprs (loops,
    custom_vjp, the calls around the kernels) and of the index maps of its BlockSpecs. Not a
    kernel's body (an open jaxpr): `TPU_COMPILE_CASES` compile those."""

    def wide(where, variables):
        for var in variables:
            dtype = getattr(getattr(var, "aval", None), "dtype", None)
            if dtype is not None and np.dtype(dtype).itemsize == 8:
                yield f"{where} {np.dtype(dtype).name}"

    found = [*wide("input", (*jaxpr.constvars, *jaxpr.invars)), *wide("output", jaxpr.outvars)]
    for eqn in jaxpr.eqns:
        found += wide(str(eqn.primitive), (*eqn.invars, *eqn.outvars))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                inner = getattr(sub, "jaxpr", None)
                if inner is not None:
                    found += _wide_values(getattr(inner, "jaxpr", inner))
                for block in getattr(sub, "block_mappings", ()):
                    found += _wide_values(block.index_map_jaxpr.jaxpr)
    return found


def _forward_backward(attend):
    """(q, k, v, do) -> (out, dq, dk, dv) of ``attend(q, k, v)``."""

    def run(q, k, v, do):
        out, vjp = jax.vjp(attend, q, k, v)
        return (out, *vjp(do))

    return run


def _kernel_case(rng, batch, q_len, kv_len, heads, kv_heads, dim, causal, sm_scale, mosaic) -> dict:
    from dew.kernels import flash_attention, platform
    from tests.test_kernels import reference_attention

    q, do = (rng.standard_normal((batch, q_len, heads, dim)).astype(np.float32) for _ in "qo")
    k, v = (rng.standard_normal((batch, kv_len, kv_heads, dim)).astype(np.float32) for _ in "kv")
    if mosaic is None:
        blocks, tuning = dict(block_q=16, block_k=16), {}
    else:
        blocks, tuning = dict(block_q=128, block_k=32, interpret="tpu"), mosaic
    kernel = _forward_backward(
        lambda q, k, v: flash_attention(q, k, v, causal=causal, sm_scale=sm_scale, **blocks)
    )
    reference_scale = 1 / np.sqrt(dim) if sm_scale is None else sm_scale
    reference = _forward_backward(
        lambda q, k, v: reference_attention(q, k, v, causal=causal, sm_scale=reference_scale)
    )
    with platform.tuned(**tuning):
        got = jax.jit(kernel)(q, k, v, do)
        wide = _wide_values(jax.make_jaxpr(kernel)(q, k, v, do).jaxpr)
    want = jax.jit(reference)(*(x.astype(np.float64) for x in (q, k, v, do)))
    return {
        "got": [np.asarray(x) for x in got],
        "got_dtypes": [str(x.dtype) for x in got],
        "want": [np.asarray(x) for x in want],
        "want_dtypes": [str(x.dtype) for x in want],
        "wide": wide,
    }


def _masked_kernel_case(kernel, q_len, kv_len, ids, window, tuning) -> list[str]:
    """The 64-bit values of the forward and backward of a call with a window, and segment ids
    where ``ids`` (a traced int32 input, as a step passes them)."""
    from dew.kernels import flash_attention, platform

    q, do = (jax.ShapeDtypeStruct((1, q_len, 2, 16), jnp.float32) for _ in "qo")
    k, v = (jax.ShapeDtypeStruct((1, kv_len, 1, 16), jnp.float32) for _ in "kv")
    id_inputs = [jax.ShapeDtypeStruct((1, n), jnp.int32) for n in (q_len, kv_len)]
    if kernel == "generic":
        blocks = dict(block_q=16, block_k=16)
    else:  # key blocks of whole lanes: Mosaic reads the key ids as [8, block_k] blocks
        blocks = dict(block_q=128, block_k=128, interpret="tpu")

    def run(q, k, v, do, q_ids, kv_ids):
        segment_ids = None
        if ids:
            segment_ids = q_ids if q_len == kv_len else (q_ids, kv_ids)

        def attend(q, k, v):
            return flash_attention(
                q, k, v, causal=True, segment_ids=segment_ids, window=window, **blocks
            )

        return _forward_backward(attend)(q, k, v, do)

    with platform.tuned(**tuning):
        return _wide_values(jax.make_jaxpr(run)(q, k, v, do, *id_inputs).jaxpr)


def _masked_kernel_results(seed: int) -> dict:
    """Per case: the 64-bit values of its program (nothing runs: `seed` is not used)."""
    return {name: _masked_kernel_case(*case) for name, case in MASKED_KERNEL_CASES.items()}


def _tpu_compile_results(seed: int) -> dict:
    """Per case: None where the kernels compiled for v5e under x64, else the error; no case
    when libtpu is not installed (nothing runs: `seed` is not used)."""
    import importlib.util

    if importlib.util.find_spec("libtpu") is None:
        return {}
    from dew.kernels import flash_attention, platform
    from dew.targets import target

    mesh = jax.sharding.Mesh(target("v5e-1").devices(), ("x",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    q = jax.ShapeDtypeStruct((1, 512, 4, 128), jnp.bfloat16, sharding=replicated)
    kv = jax.ShapeDtypeStruct((1, 512, 2, 128), jnp.bfloat16, sharding=replicated)
    ids = jax.ShapeDtypeStruct((1, 512), jnp.int32, sharding=replicated)
    results = {}
    for name, (window, segmented, tuning) in TPU_COMPILE_CASES.items():

        def run(q, k, v, do, ids):
            segment_ids = ids if segmented else None

            def attend(q, k, v):
                return flash_attention(q, k, v, causal=True, segment_ids=segment_ids, window=window)

            return _forward_backward(attend)(q, k, v, do)

        try:
            with jax.set_mesh(mesh), platform.tuned(block_q=256, block_k=256, **tuning):
                jax.jit(run).lower(q, kv, kv, q, ids).compile()
            results[name] = None
        except Exception as error:  # noqa: BLE001 - the test reports it
            results[name] = f"{type(error).__name__}: {str(error)[:2000]}"
    return results


def _kernel_results(seed: int) -> dict:
    """Per case: the kernel's (out, dq, dk, dv), the float64 reference's, their dtypes, and the
    64-bit values of the kernel's program. Runs under x64 only (float64 is the reference)."""
    rng = np.random.default_rng(seed)
    return {name: _kernel_case(rng, *case) for name, case in KERNEL_CASES.items()}


def _dtype_name(x) -> str:
    return KEY_DTYPE if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else str(x.dtype)


def _dtypes(tree) -> dict[str, str]:
    return {jax.tree_util.keystr(p): _dtype_name(x) for p, x in jax.tree.leaves_with_path(tree)}


def _model_results(seed: int, impl: str) -> dict:
    """With attention ``impl``: the weights' dtypes, the logits' dtype, and loss and gradients of
    the mean cross-entropy on one device (through the kernels' backward for "pallas")."""
    from tests.helpers import fresh_batch, tiny_objective

    tokens = jnp.asarray(fresh_batch(2, seed))
    objective = tiny_objective(attention_impl=impl, num_kv_heads=2)
    params = objective.model.init(jax.random.key(0))
    loss, grads = jax.jit(jax.value_and_grad(objective.loss))(params, tokens)
    logits = jax.eval_shape(objective.model.apply, params, tokens[:, :-1])
    return {
        "param_dtypes": _dtypes(params),
        "logits_dtype": str(logits.dtype),
        "loss": np.asarray(loss),
        "grads": {p: np.asarray(g) for p, g in _leaves(grads)},
    }


def _leaves(tree):
    return [(jax.tree_util.keystr(p), x) for p, x in jax.tree.leaves_with_path(tree)]


# {model overrides: the initial state of the first trainer of that model, on the host}. The same
# model and key give the same state (values and dtypes) on every mesh, so later trainers take it
# rather than compile an initialisation of their own, nearly as costly as compiling their step.
_initial_states: dict[tuple, object] = {}


def _initial_state(trainer, model: dict):
    """`trainer.init_state()`, from the host copy of another layout's when it has one."""
    name = tuple(sorted(model.items()))
    if name not in _initial_states:
        state = trainer.init_state()
        # Key data, not the typed key: a plain array, which the step's donation cannot delete.
        _initial_states[name] = jax.device_get(state.replace(key=jax.random.key_data(state.key)))
        return state
    host = _initial_states[name]
    key = jax.random.wrap_key_data(host.key, impl=jax.random.key_impl(trainer.key))
    return jax.device_put(host.replace(key=key), trainer.state_shardings)


def _trainer_results(seed: int, layout: str) -> dict:
    """A `dew.Trainer` over the TRAINER_LAYOUTS entry `layout`: the state's dtypes before and
    after one step, the weights before and after it, and the step's loss; for GRADIENT_LAYOUTS
    also the gradients and loss of the batch from `Trainer.gradients`."""
    import dew
    from tests.helpers import fresh_batch, smooth_optimizer, tiny_objective

    spec = TRAINER_LAYOUTS[layout]
    trainer = dew.Trainer(
        tiny_objective(**spec.model),
        smooth_optimizer(),
        jax.random.key(5),
        mesh=dew.MeshSpec(**spec.mesh),
        layout=dew.Layout(min_shard=1),
        options=dew.StepOptions(**spec.options),
    )
    state = _initial_state(trainer, spec.model)
    batch = trainer.device_batch(fresh_batch(TRAINER_ROWS, seed), TRAINER_ROWS)
    # Read before the step, which may donate the state's buffers.
    results = {
        "state_dtypes": _dtypes(state),
        "params": {p: np.asarray(x) for p, x in _leaves(state.params)},
    }
    if layout in GRADIENT_LAYOUTS:
        grads, loss = trainer.gradients(state.params, batch)
        results["grads"] = {p: np.asarray(g) for p, g in _leaves(grads)}
        results["loss"] = np.asarray(loss)
    new_state, step_metrics = trainer.train_step(TRAINER_ROWS)(state, batch)
    results["new_state_dtypes"] = _dtypes(new_state)
    results["step_loss"] = np.asarray(step_metrics["loss"])
    results["new_params"] = {p: np.asarray(x) for p, x in _leaves(new_state.params)}
    return results


def run_worker(x64: bool, seed: int, out: Path) -> None:
    """Runs every part in this process's mode; a part that raises records its traceback, so that
    the others still run and each test reports its own failure."""
    jax.config.update("jax_enable_x64", x64)
    parts = {f"model-{impl}": functools.partial(_model_results, impl=impl) for impl in MODEL_IMPLS}
    for layout in TRAINER_LAYOUTS:
        parts[f"trainer-{layout}"] = functools.partial(_trainer_results, layout=layout)
    if x64:
        parts["kernel"] = _kernel_results
        parts["masked-kernel"] = _masked_kernel_results
        parts["tpu-compile"] = _tpu_compile_results
    results = {"default_int": str(jnp.asarray(1).dtype), "devices": jax.device_count()}
    for name, part in parts.items():
        try:
            results[name] = part(seed)
        except Exception:  # noqa: BLE001 - reported by the test of that part, with its traceback
            results[name] = {"error": traceback.format_exc()}
    with open(out, "wb") as f:
        pickle.dump(results, f)


# ---- the tests: run both workers, compare -------------------------------------------------


def _worker_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "JAX_ENABLE_X64"}  # each sets its own
    # Both workers alike: 8 devices, compiled as cheaply as the suite's (tests/conftest.py).
    from tests.helpers import child_env

    flags = child_env()["XLA_FLAGS"]
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count=8 {flags}"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


# One worker runs every test of this module: its module fixture runs a costly subprocess once.
pytestmark = pytest.mark.xdist_group("x64")


@pytest.fixture(scope="module")
def runs(module_seed, tmp_path_factory) -> dict[bool, dict]:
    """{x64: the worker's results}, both workers run at once."""
    folder = tmp_path_factory.mktemp("x64")
    started = {}
    try:
        for x64 in (True, False):
            out = folder / f"x64_{x64}.pkl"
            command = [sys.executable, "-m", "tests.test_x64", str(int(x64)), str(module_seed), out]
            process = subprocess.Popen(
                [str(c) for c in command],
                cwd=ROOT,
                env=_worker_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            started[x64] = (process, out)
        results = {}
        for x64, (process, out) in started.items():
            try:
                output, _ = process.communicate(timeout=WORKER_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"the x64={x64} worker ran past {WORKER_TIMEOUT_S} s")
            if process.returncode != 0:
                pytest.fail(f"the x64={x64} worker exited {process.returncode}:\n{output[-4000:]}")
            with open(out, "rb") as f:
                results[x64] = pickle.load(f)
    finally:
        for process, _ in started.values():
            if process.poll() is None:
                process.kill()
                process.wait()
    return results


def _part(runs, x64: bool, name: str, seed: int) -> dict:
    result = runs[x64][name]
    if "error" in result:
        pytest.fail(f"x64={x64}, {name} (seed {seed}) raised:\n{result['error']}")
    return result


def _relative_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def _assert_trees_close(got: dict, want: dict, what: str, seed: int) -> None:
    assert got.keys() == want.keys(), f"{what} (seed {seed}): {sorted(got)} != {sorted(want)}"
    for path, expected in want.items():
        error = _relative_error(got[path], expected)
        assert error < TOLERANCE, f"{what}{path} (seed {seed}): relative error {error:.3g}"


def test_the_workers_ran_in_their_modes(runs, seed):
    # Without this the comparisons below could pass by comparing 32-bit mode with itself.
    assert runs[True]["default_int"] == "int64", f"seed {seed}: x64 worker not in 64-bit mode"
    assert runs[False]["default_int"] == "int32", f"seed {seed}: x32 worker in 64-bit mode"
    assert runs[True]["devices"] == runs[False]["devices"] == 8


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_flash_attention_under_x64_matches_float64_reference(runs, seed, case):
    result = _part(runs, True, "kernel", seed)[case]
    assert result["got_dtypes"] == ["float32"] * 4, f"{case} (seed {seed}): {result['got_dtypes']}"
    # The reference really is float64, or it would not be one.
    assert result["want_dtypes"] == ["float64"] * 4, f"{case} (seed {seed})"
    for name, got, want in zip(("out", "dq", "dk", "dv"), result["got"], result["want"]):
        assert np.all(np.isfinite(got)), f"{case} {name} (seed {seed}): non-finite values"
        error = _relative_error(got, want)
        assert error < TOLERANCE, f"{case} {name} (seed {seed}): relative error {error:.3g}"
    # Index math stays int32 and nothing is widened: no 64-bit value outside the kernels' bodies.
    assert not result["wide"], f"{case} (seed {seed}): 64-bit values {sorted(result['wide'])}"


@pytest.mark.parametrize("case", MASKED_KERNEL_CASES)
def test_flash_attention_with_a_window_and_ids_holds_no_64_bit_value_under_x64(runs, seed, case):
    wide = _part(runs, True, "masked-kernel", seed)[case]
    assert not wide, f"{case} (seed {seed}): 64-bit values {sorted(wide)}"


@pytest.mark.parametrize("case", TPU_COMPILE_CASES)
def test_the_mosaic_kernels_compile_for_tpu_under_x64(runs, seed, case):
    compiled = _part(runs, True, "tpu-compile", seed)
    if not compiled:
        pytest.skip("libtpu is not installed (the test extra brings it)")
    assert compiled[case] is None, f"{case}: {compiled[case]}"


@pytest.mark.parametrize("impl", MODEL_IMPLS)
def test_model_under_x64_keeps_float32_and_matches_32_bit_mode(runs, seed, impl):
    wide, narrow = (_part(runs, x64, f"model-{impl}", seed) for x64 in (True, False))
    dtypes = set(wide["param_dtypes"].values())
    assert dtypes == {"float32"}, f"{impl} (seed {seed}): weights {wide['param_dtypes']}"
    assert wide["logits_dtype"] == "float32", f"{impl} (seed {seed}): {wide['logits_dtype']}"
    assert wide["loss"].dtype == np.float32, f"{impl} (seed {seed}): loss {wide['loss'].dtype}"
    for path, grad in wide["grads"].items():
        assert grad.dtype == np.float32, f"{impl} grad{path} (seed {seed}): {grad.dtype}"
    error = _relative_error(wide["loss"], narrow["loss"])
    assert error < TOLERANCE, f"{impl} loss (seed {seed}): relative error {error:.3g}"
    _assert_trees_close(wide["grads"], narrow["grads"], f"{impl} grad", seed)


def _moves(result: dict) -> dict:
    """{path: new - initial weights} of a trainer part, in float64 (exact for float32 inputs)."""
    return {
        path: np.asarray(new, np.float64) - np.asarray(result["params"][path], np.float64)
        for path, new in result["new_params"].items()
    }


@pytest.mark.parametrize("layout", TRAINER_LAYOUTS)
def test_training_step_under_x64_keeps_dtypes_and_matches_32_bit_mode(runs, seed, layout):
    wide, narrow = (_part(runs, x64, f"trainer-{layout}", seed) for x64 in (True, False))
    for when in ("state_dtypes", "new_state_dtypes"):
        dtypes = wide[when]
        allowed = {"float32", "int32", KEY_DTYPE}
        assert set(dtypes.values()) <= allowed, f"{layout} {when} (seed {seed}): {dtypes}"
        assert dtypes == narrow[when], f"{layout} {when} (seed {seed}): x64 {dtypes} != x32"
    assert wide["state_dtypes"][".step"] == "int32", f"{layout} (seed {seed})"
    losses = ("step_loss", "loss") if layout in GRADIENT_LAYOUTS else ("step_loss",)
    for name in losses:
        assert wide[name].dtype == np.float32, f"{layout} {name} (seed {seed}): {wide[name].dtype}"
        error = _relative_error(wide[name], narrow[name])
        assert error < TOLERANCE, f"{layout} {name} (seed {seed}): relative error {error:.3g}"
    if layout in GRADIENT_LAYOUTS:
        _assert_trees_close(wide["grads"], narrow["grads"], f"{layout} grad", seed)
    _assert_trees_close(wide["params"], narrow["params"], f"{layout} initial params", seed)
    _assert_trees_close(wide["new_params"], narrow["new_params"], f"{layout} new params", seed)
    # A step that moved nothing would make the comparison of the moves vacuous.
    moves = _moves(wide)
    assert any(np.any(move != 0) for move in moves.values()), f"{layout} (seed {seed}): no move"
    _assert_trees_close(moves, _moves(narrow), f"{layout} move of params", seed)


if __name__ == "__main__":
    _, x64_flag, seed_arg, out_arg = sys.argv
    run_worker(x64_flag == "1", int(seed_arg), Path(out_arg))
