"""64-bit mode (``jax_enable_x64``): Dew's kernels, model and training step run under it, keep
float32 weights and int32 indices, and compute what they compute in 32-bit mode.

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

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
TOLERANCE = 1e-5
# A worker still running after this long has hung (each needs about 15 s of CPU time): the
# test fails rather than wait on.
WORKER_TIMEOUT_S = 300
KEY_DTYPE = "key"  # how the worker records a PRNG key leaf's dtype

# name: (batch, q_len, kv_len, heads, kv_heads, head_dim, causal, sm_scale); blocks of 16, so
# both cases have several blocks, masked and unmasked ones, and a padded tail.
KERNEL_CASES = {
    "causal-gqa": (1, 40, 40, 8, 2, 16, True, None),
    "full-gqa-q-shorter": (2, 17, 40, 4, 2, 16, False, 0.3),
}
MODEL_IMPLS = ("xla", "pallas")


# ---- the worker: runs in a subprocess, in one mode ------------------------------------------


def _wide_values(jaxpr) -> list[str]:
    """'where dtype' for every 64-bit value of `jaxpr`: its inputs and outputs (literals too: an
    index map may return a bare 0), every equation's, and those of its sub-jaxprs (pallas
    kernels, loops, custom_vjp) and of the index maps of its BlockSpecs."""

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


def _kernel_case(rng, batch, q_len, kv_len, heads, kv_heads, dim, causal, sm_scale) -> dict:
    from dew.kernels import flash_attention
    from tests.test_kernels import reference_attention

    q, do = (rng.standard_normal((batch, q_len, heads, dim)).astype(np.float32) for _ in "qo")
    k, v = (rng.standard_normal((batch, kv_len, kv_heads, dim)).astype(np.float32) for _ in "kv")
    kernel = _forward_backward(
        lambda q, k, v: flash_attention(
            q, k, v, causal=causal, sm_scale=sm_scale, block_q=16, block_k=16
        )
    )
    reference_scale = 1 / np.sqrt(dim) if sm_scale is None else sm_scale
    reference = _forward_backward(
        lambda q, k, v: reference_attention(q, k, v, causal=causal, sm_scale=reference_scale)
    )
    got = jax.jit(kernel)(q, k, v, do)
    want = jax.jit(reference)(*(x.astype(np.float64) for x in (q, k, v, do)))
    return {
        "got": [np.asarray(x) for x in got],
        "got_dtypes": [str(x.dtype) for x in got],
        "want": [np.asarray(x) for x in want],
        "want_dtypes": [str(x.dtype) for x in want],
        "wide": _wide_values(jax.make_jaxpr(kernel)(q, k, v, do).jaxpr),
    }


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


def _trainer_results(seed: int) -> dict:
    """A `dew.Trainer` over MeshSpec(fsdp=8): the state's dtypes before and after one step, the
    gradients and loss of a batch, and the step's loss and new weights."""
    import dew
    from tests.helpers import fresh_batch, smooth_optimizer, tiny_objective

    trainer = dew.Trainer(
        tiny_objective(),
        smooth_optimizer(),
        jax.random.key(5),
        mesh=dew.MeshSpec(fsdp=8),
        layout=dew.Layout(min_shard=1),
    )
    rows = 8
    state = trainer.init_state()
    batch = trainer.device_batch(fresh_batch(rows, seed), rows)
    state_dtypes = _dtypes(state)
    grads, loss = trainer.gradients(state.params, batch)
    grads = {p: np.asarray(g) for p, g in _leaves(grads)}
    new_state, step_metrics = trainer.train_step(rows)(state, batch)
    step_loss = step_metrics["loss"]
    return {
        "state_dtypes": state_dtypes,
        "new_state_dtypes": _dtypes(new_state),
        "loss": np.asarray(loss),
        "grads": grads,
        "step_loss": np.asarray(step_loss),
        "new_params": {p: np.asarray(x) for p, x in _leaves(new_state.params)},
    }


def run_worker(x64: bool, seed: int, out: Path) -> None:
    """Runs every part in this process's mode; a part that raises records its traceback, so that
    the others still run and each test reports its own failure."""
    jax.config.update("jax_enable_x64", x64)
    parts = {f"model-{impl}": functools.partial(_model_results, impl=impl) for impl in MODEL_IMPLS}
    parts["trainer"] = _trainer_results
    if x64:
        parts["kernel"] = _kernel_results
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
    # Both workers alike. Optimisation level 0 cuts XLA's CPU compile time, which dominates here.
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


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
    # Index math stays int32 and nothing is widened: no 64-bit value in the program at all.
    assert not result["wide"], f"{case} (seed {seed}): 64-bit values {sorted(set(result['wide']))}"
    for name, got, want in zip(("out", "dq", "dk", "dv"), result["got"], result["want"]):
        assert np.all(np.isfinite(got)), f"{case} {name} (seed {seed}): non-finite values"
        error = _relative_error(got, want)
        assert error < TOLERANCE, f"{case} {name} (seed {seed}): relative error {error:.3g}"


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


def test_training_step_under_x64_keeps_dtypes_and_matches_32_bit_mode(runs, seed):
    wide, narrow = (_part(runs, x64, "trainer", seed) for x64 in (True, False))
    for when in ("state_dtypes", "new_state_dtypes"):
        dtypes = wide[when]
        assert set(dtypes.values()) <= {"float32", "int32", KEY_DTYPE}, f"{when} (seed {seed})"
        assert dtypes == narrow[when], f"{when} (seed {seed}): x64 {dtypes} != {narrow[when]}"
    assert wide["state_dtypes"][".step"] == "int32", f"seed {seed}"
    for name in ("loss", "step_loss"):
        assert wide[name].dtype == np.float32, f"{name} (seed {seed}): {wide[name].dtype}"
        error = _relative_error(wide[name], narrow[name])
        assert error < TOLERANCE, f"{name} (seed {seed}): relative error {error:.3g}"
    _assert_trees_close(wide["grads"], narrow["grads"], "grad", seed)
    _assert_trees_close(wide["new_params"], narrow["new_params"], "new params", seed)


if __name__ == "__main__":
    _, x64_flag, seed_arg, out_arg = sys.argv
    run_worker(x64_flag == "1", int(seed_arg), Path(out_arg))
