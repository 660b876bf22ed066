"""Attention benchmark: Dew's Pallas flash attention against XLA's and cuDNN's.

    python bench/attention.py

On a GPU it first checks the kernels (outputs and q/k/v gradients) against XLA attention on
fresh random inputs, then times forward and forward+backward, bfloat16, causal, head_dim 64 and
128, sequence 1k to 16k, with batch x heads sized so that every row holds 16k tokens x 2048
channels (enough programs to fill an H100/H200). It prints one table of medians (ms and TFLOP/s,
each call timed to `block_until_ready`) and stops starting new rows once `--budget-s` (default
270 s) has passed, so it ends within 5 minutes.

On CPU it runs the same code on tiny sizes in interpret mode, only to show that it works; those
numbers mean nothing.

A failure (a correctness check off its tolerance or raising, a timed call raising) is reported
where it happens and the script goes on to the next case; it ends with the list of failures and
exit status 1 when there was one. ``--skip-checks`` goes straight to the timings.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback

# Let XLA's reference attention use most of the GPU for its [seq, seq] logits.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dew.kernels import flash_attention  # noqa: E402

TOKENS_PER_ROW = 16384  # batch * seq
CHANNELS = 2048  # heads * head_dim
GPU_SEQS = (1024, 2048, 4096, 8192, 16384)
GPU_HEAD_DIMS = (64, 128)
CPU_SEQS = (128, 256)
CPU_HEAD_DIMS = (64,)
CPU_TOKENS, CPU_CHANNELS = 256, 128


def attention_fn(impl: str, causal: bool = True):
    if impl == "pallas":
        return lambda q, k, v: flash_attention(q, k, v, causal=causal)
    return lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation=impl
    )


def forward_and_backward(attend):
    """(q, k, v, do) -> (out, dq, dk, dv): what a training step runs."""

    def run(q, k, v, do):
        out, vjp = jax.vjp(attend, q, k, v)
        return (out, *vjp(do))

    return run


def random_inputs(key, batch, q_len, kv_len, heads, kv_heads, head_dim, dtype):
    kq, kk, kv, kd = jax.random.split(key, 4)
    return (
        jax.random.normal(kq, (batch, q_len, heads, head_dim), dtype),
        jax.random.normal(kk, (batch, kv_len, kv_heads, head_dim), dtype),
        jax.random.normal(kv, (batch, kv_len, kv_heads, head_dim), dtype),
        jax.random.normal(kd, (batch, q_len, heads, head_dim), dtype),
    )


def relative_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


# ---- correctness -------------------------------------------------------------------------------


def xla_reference(q, k, v, *, causal):
    """XLA attention with Dew's bottom-right causal alignment, written as an explicit mask so
    that it also holds for q_len != kv_len."""
    q_len, kv_len = q.shape[1], k.shape[1]
    mask = None
    if causal:
        mask = jnp.arange(kv_len)[None, :] <= jnp.arange(q_len)[:, None] + (kv_len - q_len)
        mask = mask[None, None]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")


def check_case(key, batch, q_len, kv_len, heads, kv_heads, head_dim, dtype, causal):
    q, k, v, do = random_inputs(key, batch, q_len, kv_len, heads, kv_heads, head_dim, dtype)
    got = jax.jit(forward_and_backward(attention_fn("pallas", causal)))(q, k, v, do)
    as32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
    with jax.default_matmul_precision("highest"):  # no TF32 in the reference, forward or back
        want = jax.jit(forward_and_backward(lambda q, k, v: xla_reference(q, k, v, causal=causal)))(
            *as32
        )
    errors = {}
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        g = np.asarray(g.astype(jnp.float32))
        errors[name] = relative_error(g, w) if np.all(np.isfinite(g)) else float("nan")
    return errors


def run_checks(on_gpu: bool) -> bool:
    if on_gpu:
        cases = [  # batch, q_len, kv_len, heads, kv_heads, head_dim, dtype, causal
            (2, 1024, 1024, 8, 2, 64, jnp.bfloat16, True),
            (1, 1000, 1000, 4, 4, 128, jnp.bfloat16, True),
            (1, 256, 1024, 4, 2, 128, jnp.bfloat16, True),
            (1, 512, 512, 4, 2, 64, jnp.float32, True),
            (1, 300, 300, 4, 4, 64, jnp.float32, False),
        ]
    else:
        cases = [
            (1, 128, 128, 4, 2, 64, jnp.bfloat16, True),
            (1, 100, 100, 2, 2, 32, jnp.float32, False),
            (1, 40, 90, 2, 1, 32, jnp.float32, True),
        ]
    tolerance = {jnp.bfloat16: 2e-2, jnp.float32: 1e-5}
    print(
        "correctness: Pallas kernels against XLA attention (float32, highest precision), "
        "fresh random inputs, relative error (Frobenius)"
    )
    print(
        f"  {'batch':>5} {'q_len':>6} {'kv_len':>6} {'heads':>5} {'kv':>3} {'dim':>4} "
        f"{'dtype':>8} {'causal':>6}   {'out':>8} {'dq':>8} {'dk':>8} {'dv':>8}  result"
    )
    all_ok = True
    key = jax.random.key(int(time.time_ns()) % (2**31))
    for case in cases:
        key, sub = jax.random.split(key)
        batch, q_len, kv_len, heads, kv_heads, head_dim, dtype, causal = case
        head = (
            f"  {batch:>5} {q_len:>6} {kv_len:>6} {heads:>5} {kv_heads:>3} {head_dim:>4} "
            f"{jnp.dtype(dtype).name:>8} {str(causal):>6}   "
        )
        try:
            errors = check_case(sub, *case)
        except Exception as error:  # report and go on: the table is still worth printing
            traceback.print_exc(file=sys.stderr)
            print(head + f"error: {type(error).__name__}: {str(error).splitlines()[0][:80]}")
            all_ok = False
            continue
        ok = all(e < tolerance[dtype] for e in errors.values())  # False for NaN
        all_ok &= ok
        print(
            head
            + " ".join(f"{errors[n]:8.1e}" for n in ("out", "dq", "dk", "dv"))
            + f"  {'ok' if ok else 'FAIL'} (< {tolerance[dtype]:g})"
        )
    return all_ok


# ---- timing ------------------------------------------------------------------------------------


def median_seconds(fn, args, target_s: float = 0.5) -> float:
    """Median wall time of fn(*args) to block_until_ready, after a compile-and-warm-up call."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - start
    times = [first]
    for _ in range(max(2, min(20, int(target_s / max(first, 1e-6))))):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def causal_forward_flops(batch, seq, heads, head_dim) -> float:
    # Two matmuls (q k^T and p v) of 2 * seq * seq * head_dim flops each, halved by the mask.
    return 2.0 * batch * heads * seq * seq * head_dim


def short_error(error: Exception) -> str:
    text = f"{type(error).__name__}: {str(error)}"
    if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower():
        return "OOM"
    return "error"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--budget-s",
        type=float,
        default=270.0,
        help="start no new row after this many seconds (default 270)",
    )
    parser.add_argument("--seqs", type=int, nargs="*", help="sequence lengths to time")
    parser.add_argument("--head-dims", type=int, nargs="*", help="head sizes to time")
    parser.add_argument(
        "--skip-checks",
        action="store_true",
        help="skip the correctness checks against XLA attention (time only)",
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()

    backend = jax.default_backend()
    on_gpu = backend == "gpu"
    device = jax.devices()[0]
    print(
        f"device: {getattr(device, 'device_kind', device.platform)} ({backend}), "
        f"jax {jax.__version__}"
    )
    if not on_gpu:
        print(
            "no GPU: interpret mode on tiny sizes, only to show the script works; "
            "the timings mean nothing"
        )
    failures = []
    if args.skip_checks:
        print("correctness checks skipped (--skip-checks)")
    elif not run_checks(on_gpu):
        failures.append("correctness checks (see the table above)")

    seqs = tuple(args.seqs or (GPU_SEQS if on_gpu else CPU_SEQS))
    head_dims = tuple(args.head_dims or (GPU_HEAD_DIMS if on_gpu else CPU_HEAD_DIMS))
    tokens, channels = (TOKENS_PER_ROW, CHANNELS) if on_gpu else (CPU_TOKENS, CPU_CHANNELS)
    impls = ("pallas", "xla", "cudnn")
    dtype = jnp.bfloat16

    print()
    print(
        f"timing: bfloat16, causal, batch * seq = {tokens} tokens, heads * head_dim = "
        f"{channels}; medians; fwd+bwd = forward and the q/k/v gradients "
        f"(counted as 3.5x the forward's flops)"
    )
    header = (
        f"{'impl':<7} {'dim':>4} {'seq':>6} {'batch x heads':>13} "
        f"{'fwd ms':>9} {'fwd TFLOP/s':>11} {'fwd+bwd ms':>11} {'fwd+bwd TFLOP/s':>15}"
    )
    print(header)
    print("-" * len(header))
    key = jax.random.key(0)
    for seq in seqs:
        for head_dim in head_dims:
            batch, heads = max(1, tokens // seq), max(1, channels // head_dim)
            key, sub = jax.random.split(key)
            q, k, v, do = random_inputs(sub, batch, seq, seq, heads, heads, head_dim, dtype)
            flops = causal_forward_flops(batch, seq, heads, head_dim)
            for impl in impls:
                label = f"{impl:<7} {head_dim:>4} {seq:>6} {f'{batch} x {heads}':>13} "
                if impl == "cudnn" and not on_gpu:
                    print(label + f"{'n/a (needs a GPU)':>49}")
                    continue
                if time.perf_counter() - start > args.budget_s:
                    print(label + f"{'skipped (time budget)':>49}")
                    continue
                cells = []
                attend = attention_fn(impl)
                for fn, fn_args, fn_flops in (
                    (jax.jit(attend), (q, k, v), flops),
                    (jax.jit(forward_and_backward(attend)), (q, k, v, do), 3.5 * flops),
                ):
                    try:
                        seconds = median_seconds(fn, fn_args)
                        cells.append((f"{seconds * 1e3:.3f}", f"{fn_flops / seconds / 1e12:.3g}"))
                    except Exception as error:  # report it and go on to the next cell
                        traceback.print_exc(file=sys.stderr)
                        cells.append((short_error(error), "-"))
                        failures.append(
                            f"{impl} head_dim {head_dim} seq {seq}: {type(error).__name__}: "
                            f"{str(error).splitlines()[0][:100] if str(error) else ''}"
                        )
                (fwd_ms, fwd_tf), (both_ms, both_tf) = cells
                print(label + f"{fwd_ms:>9} {fwd_tf:>11} {both_ms:>11} {both_tf:>15}", flush=True)
            del q, k, v, do
    print(f"\ntotal {time.perf_counter() - start:.0f} s; {len(failures)} failure(s)")
    for failure in failures:
        print(f"  FAILED: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
