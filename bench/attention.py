"""Attention benchmark: Dew's Pallas flash attention against the kernels a user would otherwise use.

    python bench/attention.py [--rows 8192:128 4096:128:gqa ...] [--sweep] [--json FILE]

Contestants, by backend:

- TPU: Dew's Mosaic kernels; JAX's Pallas TPU flash attention
  (``jax.experimental.pallas.ops.tpu.flash_attention``); splash attention
  (``...ops.tpu.splash_attention``); XLA (``jax.nn.dot_product_attention(implementation="xla")``).
  Each of the three kernels runs at several block sizes (``CANDIDATES``; ``--sweep`` tries more)
  and each cell of the table is the contestant's best, with the blocks that gave it.
- GPU: Dew's Triton kernels, cuDNN and XLA (``jax.nn.dot_product_attention``).
- CPU: the TPU contestants in TPU interpret mode at toy sizes, only to show the script works; its
  numbers mean nothing.

First the checks (``--skip-checks`` skips them): Dew's kernels in float32 against a float64
reference written from attention's formulas (numpy: out, and the gradients of q, k and v), at
small shapes with grouped queries, odd lengths and no mask; then, on bfloat16 inputs, the error of
every contestant against the same reference, side by side. Then one table of forward and
forward+backward TFLOP/s: bfloat16, batch x seq = 16k tokens, heads x head_dim = 2048 (a
grouped-query row: 32 query heads over 8 kv heads, d128), the median of ``--calls`` calls, the
calls of a row's cells taken in turn (round robin). Each call is timed twice over: by the wall
clock to ``block_until_ready``, and on the device, from a `jax.profiler` trace of another round of
calls (TPU and GPU; the CPU's trace has no device plane). The TFLOP/s count the device time where
every cell of the row has one (else the row counts wall times): a wall time also holds the host's
dispatch and wait, 0.7-1.0 ms a call on the lent v5e machine for every contestant alike, which
pulls a row's ratios toward 1; the ratios by wall time are printed beside. A causal forward
counts ``2 * batch * heads * seq^2 * head_dim`` FLOPs (half of the square), a non-causal one
twice that, forward+backward 3.5 times the forward.

Every contestant gets the inputs in its own layout, made before the clock starts: JAX's TPU
kernels and Dew's Mosaic kernels ``[batch, heads, seq, head_dim]`` (Dew's ``layout="bhsd"``), XLA
and cuDNN ``[batch, seq, heads, head_dim]``. Splash attention takes no logit scale: its q is
scaled before the clock starts (as a model folds it into the query projection). JAX's flash
attention takes no grouped K/V: it gets K/V repeated to every query head, inside the clock (what
a model calling it has to do).

A failure (a check off its tolerance or raising, a timed call raising) is reported where it
happens and the script goes on; it ends with the list of failures and exit status 1 when there
was one. A contestant that runs out of memory gets "OOM" in its cell, not a failure.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import functools
import glob
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback

# Let XLA's reference attention use most of a GPU for its [seq, seq] logits.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dew.kernels import flash_attention  # noqa: E402
from dew.kernels import platform as kernel_platform  # noqa: E402

TOKENS = 16384  # batch * seq
CHANNELS = 2048  # heads * head_dim
GQA_HEADS, GQA_KV_HEADS = 32, 8
CPU_TOKENS, CPU_CHANNELS = 512, 256


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the table: a sequence length, a head size, grouped queries or not, causal or
    not; ``batch`` and ``heads`` follow from the tokens and channels of the run."""

    seq: int
    head_dim: int
    grouped: bool = False
    causal: bool = True

    @classmethod
    def parse(cls, text: str) -> "Row":
        """``SEQ:HEAD_DIM[:gqa][:full]`` (``full``: no causal mask)."""
        parts = text.split(":")
        try:
            seq, head_dim = int(parts[0]), int(parts[1])
        except (IndexError, ValueError):
            raise argparse.ArgumentTypeError(
                f"a row is SEQ:HEAD_DIM[:gqa][:full], e.g. 8192:128 or 4096:128:gqa; got {text!r}"
            ) from None
        flags = set(parts[2:])
        if flags - {"gqa", "full"}:
            raise argparse.ArgumentTypeError(f"unknown row flags {flags - {'gqa', 'full'}}")
        return cls(seq, head_dim, "gqa" in flags, "full" not in flags)

    def shape(self, tokens: int, channels: int) -> tuple[int, int, int]:
        """(batch, heads, kv_heads)."""
        batch = max(1, tokens // self.seq)
        if self.grouped:
            return batch, GQA_HEADS, GQA_KV_HEADS
        heads = max(1, channels // self.head_dim)
        return batch, heads, heads

    def label(self) -> str:
        extra = (" gqa 32/8" if self.grouped else "") + ("" if self.causal else " non-causal")
        return f"{self.seq}, {self.head_dim}{extra}"


TPU_ROWS = (
    Row(2048, 128),
    Row(4096, 128),
    Row(8192, 128),
    Row(2048, 64),
    Row(8192, 64),
    Row(4096, 128, grouped=True),
    Row(4096, 128, causal=False),
)
GPU_ROWS = tuple(Row(s, d) for s in (1024, 2048, 4096, 8192, 16384) for d in (64, 128))
CPU_ROWS = (Row(256, 64), Row(256, 64, grouped=True), Row(128, 128, causal=False))


def forward_flops(row: Row, batch: int, heads: int) -> float:
    full = 4.0 * batch * heads * row.seq * row.seq * row.head_dim
    return full / 2 if row.causal else full


# ---- contestants -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One way to run a contestant: ``label`` names its blocks; ``make(row, sm_scale)`` returns
    ``attend(q, k, v) -> out`` on the contestant's layout; ``context`` is entered while it is
    traced (Dew's tuning overrides)."""

    label: str
    make: object
    context: object = contextlib.nullcontext


def _dew(interpret=None, layout="bhsd", **tuning):
    def make(row, sm_scale):
        return functools.partial(
            flash_attention, causal=row.causal, layout=layout, interpret=interpret
        )

    label = ",".join(f"{k}={v}" for k, v in tuning.items()) or "defaults"
    return Candidate(label, make, functools.partial(kernel_platform.tuned, **tuning))


def _jax_flash(block: int, block_k: int | None = None):
    from jax.experimental.pallas.ops.tpu import flash_attention as jax_flash

    block_k = block_k or block
    sizes = jax_flash.BlockSizes(
        block_q=block,
        block_k_major=block,
        block_k=block_k,
        block_b=1,
        block_q_major_dkv=block,
        block_k_major_dkv=block,
        block_k_dkv=block_k,
        block_q_dkv=block,
        block_k_major_dq=block,
        block_k_dq=block_k,
        block_q_dq=block,
    )

    def make(row, sm_scale):
        def attend(q, k, v):
            group = q.shape[1] // k.shape[1]
            if group > 1:  # no grouped K/V: repeated to every query head
                k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
            seq = q.shape[2]
            blocks = sizes if seq >= block else None
            return jax_flash.flash_attention(
                q, k, v, causal=row.causal, sm_scale=sm_scale, block_sizes=blocks
            )

        return attend

    return Candidate(f"{block}" + (f"/{block_k}" if block_k != block else ""), make)


def _splash(block_q: int, block_kv: int, compute: int, fused: bool, interpret: bool = False):
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    def make(row, sm_scale):
        del sm_scale  # splash takes q pre-scaled (see the module's docstring)
        cache = {}

        def attend(q, k, v):
            heads, seq = q.shape[1], q.shape[2]
            if (heads, seq) not in cache:
                one = splash.CausalMask((seq, seq)) if row.causal else splash.FullMask((seq, seq))
                bq, bkv, bc = (min(b, seq) for b in (block_q, block_kv, compute))
                sizes = splash.BlockSizes(
                    block_q=bq,
                    block_kv=bkv,
                    block_kv_compute=bc,
                    block_q_dkv=bq,
                    block_kv_dkv=bkv,
                    block_kv_dkv_compute=bc,
                    block_q_dq=None if fused else bq,
                    block_kv_dq=None if fused else bkv,
                    use_fused_bwd_kernel=fused,
                )
                cache[heads, seq] = splash.make_splash_mha_single_device(
                    splash.MultiHeadMask([one] * heads), block_sizes=sizes
                )
            if interpret:  # TPU interpret mode mis-sizes a vmapped splash grid: one call a row
                return jnp.stack([cache[heads, seq](*x) for x in zip(q, k, v)])
            return jax.vmap(cache[heads, seq])(q, k, v)

        return attend

    fused_label = ",fused bwd" if fused else ""
    return Candidate(f"{block_q}x{block_kv}/{compute}{fused_label}", make)


def _xla(row, sm_scale):
    return functools.partial(
        jax.nn.dot_product_attention, is_causal=row.causal, scale=sm_scale, implementation="xla"
    )


def _cudnn(row, sm_scale):
    return functools.partial(
        jax.nn.dot_product_attention, is_causal=row.causal, scale=sm_scale, implementation="cudnn"
    )


@dataclasses.dataclass(frozen=True)
class Contestant:
    name: str
    layout: str  # "bhsd" or "bshd": the layout its inputs are made in
    candidates: tuple
    prescaled: bool = False  # q arrives multiplied by sm_scale


def tpu_contestants(sweep: bool, interpret: bool) -> list[Contestant]:
    """Each kernel at the blocks that measured best on a v5e chip (docs/kernels.md), or with
    ``sweep`` a wider set. ``interpret``: TPU interpret mode (the CPU's dry run)."""
    dew_interp = "tpu" if interpret else None
    if interpret:  # toy sizes: blocks that split them, nothing more
        dew = (_dew(dew_interp, block_q=128, block_k=128),)
        flash = (_jax_flash(128),)
        splash = (_splash(128, 128, 128, False, True), _splash(128, 128, 128, True, True))
    elif sweep:
        dew = tuple(_dew(dew_interp, **t) for t in DEW_SWEEP)
        flash = (_jax_flash(512), _jax_flash(1024), _jax_flash(1024, 512), _jax_flash(2048, 512))
        splash = tuple(
            _splash(bq, bkv, c, fused)
            for bq, bkv, c in ((512, 512, 512), (1024, 1024, 512), (1024, 1024, 1024))
            for fused in (False, True)
        ) + (_splash(2048, 2048, 512, True), _splash(1024, 2048, 512, True))
    else:
        dew = (_dew(dew_interp),)
        flash = (_jax_flash(1024),)
        splash = (_splash(1024, 1024, 512, True), _splash(2048, 2048, 512, True))
    return [
        Contestant("dew", "bhsd", dew),
        Contestant("jax-flash", "bhsd", flash),
        Contestant("splash", "bhsd", splash, prescaled=True),
        Contestant("xla", "bshd", (Candidate("-", _xla),)),
    ]


# Dew's tunings tried by --sweep (kernels.platform.tuned's fields; blocks as block_q, block_k).
DEW_SWEEP = (
    dict(),
    dict(block_q=256, block_k=256),
    dict(block_q=512, block_k=512),
    dict(block_q=1024, block_k=1024, block_k_compute=512, backward_block_k_compute=512),
    dict(block_q=1024, block_k=1024, block_k_compute=256, backward_block_k_compute=256),
    dict(block_q=1024, block_k=2048, block_k_compute=512, backward_block_k_compute=512),
    dict(block_q=2048, block_k=2048, block_k_compute=512, backward_block_k_compute=512),
    dict(fused_backward=False),
    dict(forward_heads=1),
    dict(block_q_compute=None),
)


def gpu_contestants() -> list[Contestant]:
    dew = Candidate(
        "defaults", lambda row, scale: functools.partial(flash_attention, causal=row.causal)
    )
    return [
        Contestant("dew", "bshd", (dew,)),
        Contestant("xla", "bshd", (Candidate("-", _xla),)),
        Contestant("cudnn", "bshd", (Candidate("-", _cudnn),)),
    ]


# ---- inputs and the reference ------------------------------------------------------------------


def random_inputs(key, batch, seq, heads, kv_heads, head_dim, dtype, kv_seq=None):
    """q, k, v, do in the [batch, seq, heads, head_dim] layout."""
    kv_seq = kv_seq or seq
    kq, kk, kv, kd = jax.random.split(key, 4)
    return (
        jax.random.normal(kq, (batch, seq, heads, head_dim), dtype),
        jax.random.normal(kk, (batch, kv_seq, kv_heads, head_dim), dtype),
        jax.random.normal(kv, (batch, kv_seq, kv_heads, head_dim), dtype),
        jax.random.normal(kd, (batch, seq, heads, head_dim), dtype),
    )


def reference(q, k, v, do, *, causal: bool, sm_scale: float):
    """Softmax attention and its q, k, v gradients for the cotangent ``do``, in float64 numpy,
    from the formulas: ``p = softmax(sm_scale q k^T)`` (bottom-right causal mask), ``out = p v``,
    ``dv = p^T do``, ``ds = p * (do v^T - rowsum(do * out))``, ``dq = sm_scale ds k``, ``dk =
    sm_scale ds^T q``; grouped K/V serve ``heads // kv_heads`` query heads each. Arrays
    ``[batch, seq, heads, head_dim]``; rows must see at least one key."""
    q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
    group = q.shape[2] // k.shape[2]
    kk, vv = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, kk) * sm_scale
    if causal:
        q_len, kv_len = q.shape[1], k.shape[1]
        visible = np.arange(kv_len)[None, :] <= np.arange(q_len)[:, None] + (kv_len - q_len)
        s = np.where(visible, s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    out = np.einsum("bhqk,bkhd->bqhd", p, vv)
    delta = np.einsum("bqhd,bqhd->bhq", do, out)
    ds = p * (np.einsum("bqhd,bkhd->bhqk", do, vv) - delta[..., None])
    dq = np.einsum("bhqk,bkhd->bqhd", ds, kk) * sm_scale

    def per_kv_head(x):  # [batch, kv_len, heads, d] -> summed over each group
        return x.reshape(*x.shape[:2], k.shape[2], group, x.shape[3]).sum(axis=3)

    dk = per_kv_head(np.einsum("bhqk,bqhd->bkhd", ds, q) * sm_scale)
    dv = per_kv_head(np.einsum("bhqk,bqhd->bkhd", p, do))
    return out, dq, dk, dv


def relative_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if not np.all(np.isfinite(got)):
        return float("nan")
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def to_layout(layout: str, x):
    return jnp.swapaxes(x, 1, 2) if layout == "bhsd" else x


def forward_and_backward(attend):
    """(q, k, v, do) -> (out, dq, dk, dv): what a training step runs."""

    def run(q, k, v, do):
        out, vjp = jax.vjp(attend, q, k, v)
        return (out, *vjp(do))

    return run


def run_contestant(contestant, candidate, row, inputs, sm_scale):
    """(out, dq, dk, dv) of one candidate on [batch, seq, heads, head_dim] ``inputs``, returned in
    that layout and float32 (dq of a pre-scaled q turned back into the gradient of q)."""
    q, k, v, do = (to_layout(contestant.layout, x) for x in inputs)
    if contestant.prescaled:
        q = (q.astype(jnp.float32) * sm_scale).astype(q.dtype)
    with candidate.context():
        got = jax.jit(forward_and_backward(candidate.make(row, sm_scale)))(q, k, v, do)
    out, dq, dk, dv = (to_layout(contestant.layout, x).astype(jnp.float32) for x in got)
    if contestant.prescaled:
        dq = dq * sm_scale
    return out, dq, dk, dv


# ---- checks ------------------------------------------------------------------------------------


def run_checks(contestants, backend: str, seed: int) -> list[str]:
    """Dew's kernels in float32 at small shapes, then every contestant in bfloat16, against the
    float64 reference. Returns the failures."""
    failures = []
    on_cpu = backend == "cpu"
    dew = contestants[0]
    f32_cases = [  # batch, seq, heads, kv_heads, head_dim, causal
        (1, 200, 4, 2, 64, True),
        (2, 129, 2, 2, 128, True),
        (1, 300, 4, 1, 128, False),
    ]
    if not on_cpu:
        f32_cases += [(1, 1024, 4, 2, 128, True), (1, 4096, 2, 2, 128, True)]
    print(f"checks: seed {seed}; relative error (Frobenius) against float64 numpy attention")
    # On a TPU chip the gradients measured 2.5e-5 to 2.9e-5 from float64 (v5e, 2026-12-05), the
    # output 1e-6; the cause is not found (tests/test_on_tpu.py, KERNEL_GRAD_TOL).
    grad_tol = 1e-5 if backend != "tpu" else 5e-5
    print(f"  Dew's kernels, float32 inputs (tolerance: out 1e-5, gradients {grad_tol:g}):")
    print(
        f"    {'batch':>5} {'seq':>5} {'heads':>5} {'kv':>3} {'dim':>4} {'causal':>6}  "
        f"{'out':>8} {'dq':>8} {'dk':>8} {'dv':>8}"
    )
    key = jax.random.key(seed)
    # Float32 inputs at full precision: a TPU's default float32 matmul is one bfloat16 pass.
    with jax.default_matmul_precision("highest"):
        for case in f32_cases:
            key, sub = jax.random.split(key)
            batch, seq, heads, kv_heads, head_dim, causal = case
            row = Row(seq, head_dim, causal=causal)
            inputs = random_inputs(sub, batch, seq, heads, kv_heads, head_dim, jnp.float32)
            sm_scale = 1 / math.sqrt(head_dim)
            want = reference(*inputs, causal=causal, sm_scale=sm_scale)
            head = (
                f"    {batch:>5} {seq:>5} {heads:>5} {kv_heads:>3} {head_dim:>4} {str(causal):>6}  "
            )
            try:
                got = run_contestant(dew, dew.candidates[0], row, inputs, sm_scale)
            except Exception as error:
                traceback.print_exc(file=sys.stderr)
                print(head + f"error: {type(error).__name__}")
                failures.append(f"dew float32 {case}: {type(error).__name__}")
                continue
            errors = [relative_error(g, w) for g, w in zip(got, want)]
            ok = errors[0] < 1e-5 and all(e < grad_tol for e in errors[1:])
            print(head + " ".join(f"{e:8.1e}" for e in errors) + ("  ok" if ok else "  FAIL"))
            if not ok:
                failures.append(f"dew float32 {case}: errors {errors}")

    bf16_cases = [  # batch, seq, heads, kv_heads, head_dim, causal
        (1, 256, 4, 4, 64, True),
        (1, 256, 8, 2, 128, True),
        (1, 128, 2, 2, 128, False),
    ]
    if not on_cpu:
        bf16_cases = [
            (1, 2048, 8, 2, 128, True),
            (2, 1024, 4, 4, 64, True),
            (1, 2048, 4, 4, 128, False),
        ]
    print("  every contestant, bfloat16 inputs, out dq dk dv (Dew's tolerance 2e-2):")
    names = [c.name for c in contestants]
    print(
        f"    {'batch':>5} {'seq':>5} {'heads':>5} {'kv':>3} {'dim':>4} {'causal':>6}  "
        + "  ".join(f"{n:>35}" for n in names)
    )
    for case in bf16_cases:
        key, sub = jax.random.split(key)
        batch, seq, heads, kv_heads, head_dim, causal = case
        row = Row(seq, head_dim, causal=causal)
        inputs = random_inputs(sub, batch, seq, heads, kv_heads, head_dim, jnp.bfloat16)
        sm_scale = 1 / math.sqrt(head_dim)
        want = reference(*inputs, causal=causal, sm_scale=sm_scale)
        cells = []
        for contestant in contestants:
            try:
                got = run_contestant(contestant, contestant.candidates[0], row, inputs, sm_scale)
                errors = [relative_error(g, w) for g, w in zip(got, want)]
                cells.append(" ".join(f"{e:8.1e}" for e in errors))
                if contestant.name == "dew" and not all(e < 2e-2 for e in errors):
                    failures.append(f"dew bfloat16 {case}: errors {errors}")
            except Exception as error:
                print(
                    f"    {contestant.name} {case}: {type(error).__name__}: "
                    f"{str(error).splitlines()[0][:150] if str(error) else ''}",
                    file=sys.stderr,
                )
                cells.append(f"{short_error(error):>35}")
                if contestant.name == "dew":
                    failures.append(f"dew bfloat16 {case}: {type(error).__name__}")
        print(
            f"    {batch:>5} {seq:>5} {heads:>5} {kv_heads:>3} {head_dim:>4} {str(causal):>6}  "
            + "  ".join(f"{c:>35}" for c in cells),
            flush=True,
        )
    return failures


# ---- timing ------------------------------------------------------------------------------------


def short_error(error: Exception) -> str:
    text = f"{type(error).__name__}: {error}"
    if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower() or "OOM" in text:
        return "OOM"
    return "error"


def median_seconds_round_robin(programs, calls: int) -> list:
    """The median wall time of ``calls`` calls of each ``(fn, args)`` in ``programs`` (the
    exception, for one whose call raised), each call to ``block_until_ready``. Every program is
    warmed up first, then the calls go round the programs in turn, so a drift of the machine's
    speed during the row lands on every contestant alike: on a v5e chip, cells timed one after
    another each in a burst of 10 once put a whole row 10-40% above every other run of it."""
    live = []
    for fn, args in programs:
        try:
            jax.block_until_ready(fn(*args))
            live.append((fn, args))
        except Exception as error:
            live.append(error)
    times = [[] for _ in programs]
    for _ in range(calls):
        for n, program in enumerate(live):
            if isinstance(program, Exception):
                continue
            fn, args = program
            start = time.perf_counter()
            try:
                jax.block_until_ready(fn(*args))
            except Exception as error:
                live[n] = error
                continue
            times[n].append(time.perf_counter() - start)
    return [
        program if isinstance(program, Exception) else statistics.median(ts)
        for program, ts in zip(live, times)
    ]


def device_seconds_round_robin(programs, calls: int) -> list:
    """The median device time of ``calls`` calls of each ``(name, fn, args)`` in ``programs``,
    taken round robin under `jax.profiler.trace`: the durations of the device's "XLA Modules"
    events named ``name`` (``jax.jit`` of a function named ``f`` compiles a module ``jit_f``).
    None for a program the trace holds no such event of (a backend whose trace has no device
    plane, as the CPU's; or a call that raised).

    The wall time of one call waited on with ``block_until_ready`` also holds the host's
    dispatch and the wait's round trip: on the lent v5e machine 0.7-1.0 ms a call, for every
    contestant alike (splash's non-causal 4096 d128 forward: 4.28 ms wall, 3.57 ms on the
    device), which pulls every ratio of a row toward 1. The device time is the kernels' own."""
    trace_dir = tempfile.mkdtemp(prefix="dew-attention-trace-")
    try:
        with jax.profiler.trace(trace_dir):
            for _ in range(calls):
                for _, fn, args in programs:
                    try:
                        jax.block_until_ready(fn(*args))
                    except Exception:  # its wall time already reported it; no event is left
                        pass
        durations = module_seconds(trace_dir)
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)
    return [
        statistics.median(durations[name]) if durations.get(name) else None
        for name, _, _ in programs
    ]


def module_seconds(trace_dir: str) -> dict[str, list[float]]:
    """``{module name: [seconds, ...]}``: every program a device ran in the trace under
    ``trace_dir`` (its "XLA Modules" events; the name without its ``(fingerprint)``)."""
    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        return {}
    found: dict[str, list[float]] = {}
    for plane in jax.profiler.ProfileData.from_file(paths[0]).planes:
        if not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            if line.name != "XLA Modules":
                continue
            for event in line.events:
                name = event.name.split("(", 1)[0]
                found.setdefault(name, []).append(event.duration_ns / 1e9)
    return found


def named(fn, name: str):
    """``fn`` under the name ``name``: ``jax.jit`` of it compiles a module ``jit_<name>``."""

    @functools.wraps(fn)
    def run(*args):
        return fn(*args)

    run.__name__ = run.__qualname__ = name
    return run


@dataclasses.dataclass
class Cell:
    contestant: str
    candidate: str
    mode: str  # "fwd" or "fwd+bwd"
    seconds: float | None = None  # median wall time of a call
    error: str | None = None
    device_seconds: float | None = None  # median device time (None where the trace has none)

    @property
    def time(self) -> float | None:
        """What the table counts: the device time where there is one, else the wall time."""
        return self.device_seconds or self.seconds


def time_row(row, contestants, tokens, channels, calls, key, threads) -> list[Cell]:
    """Every candidate of every contestant on one row, forward and forward+backward: traced one
    at a time (Dew's overrides are process-wide), compiled in ``threads`` threads, then timed
    round robin, by the wall clock (`median_seconds_round_robin`) and, off the CPU, on the
    device (`device_seconds_round_robin`)."""
    batch, heads, kv_heads = row.shape(tokens, channels)
    sm_scale = 1 / math.sqrt(row.head_dim)
    inputs = random_inputs(key, batch, row.seq, heads, kv_heads, row.head_dim, jnp.bfloat16)
    jobs = []
    for contestant in contestants:
        q, k, v, do = (to_layout(contestant.layout, x) for x in inputs)
        if contestant.prescaled:
            q = (q.astype(jnp.float32) * sm_scale).astype(q.dtype)
        for candidate in contestant.candidates:
            for mode in ("fwd", "fwd+bwd"):
                cell = Cell(contestant.name, candidate.label, mode)
                try:
                    attend = candidate.make(row, sm_scale)
                    fn, args = (
                        (attend, (q, k, v))
                        if mode == "fwd"
                        else (forward_and_backward(attend), (q, k, v, do))
                    )
                    fn = named(fn, f"bench_cell_{len(jobs)}")
                    with candidate.context():
                        lowered = jax.jit(fn).lower(*args)
                    jobs.append((cell, lowered, args))
                except Exception as error:
                    print(
                        f"  {row.label()} {contestant.name} {candidate.label} {mode}: "
                        f"{type(error).__name__}: {str(error)[:300]}",
                        file=sys.stderr,
                    )
                    cell.error = short_error(error)
                    jobs.append((cell, None, None))
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        compiled = list(pool.map(lambda job: _compile(*job), jobs))
    timed = [
        (f"jit_bench_cell_{n}", cell, program, args)
        for n, ((cell, _, args), program) in enumerate(zip(jobs, compiled))
        if program is not None
    ]
    seconds = median_seconds_round_robin([(program, args) for _, _, program, args in timed], calls)
    for (_, cell, _, _), result in zip(timed, seconds):
        if isinstance(result, Exception):
            print(
                f"  {row.label()} {cell.contestant} {cell.candidate} {cell.mode}: "
                f"{type(result).__name__}: {str(result)[:300]}",
                file=sys.stderr,
            )
            cell.error = short_error(result)
        else:
            cell.seconds = result
    if jax.default_backend() != "cpu":  # the CPU's trace has no device plane
        ran = [(name, program, args) for name, cell, program, args in timed if cell.seconds]
        cells = [cell for _, cell, _, _ in timed if cell.seconds]
        count_device_times(cells, device_seconds_round_robin(ran, calls), row.label())
    return [cell for cell, _, _ in jobs]


def count_device_times(cells, device_seconds, label: str) -> None:
    """Sets each cell's ``device_seconds``, all of the row's or none: a row whose cells had some
    device times and some not would compare one contestant's device time with another's wall
    time, so such a row keeps its wall times alone (and says so)."""
    if all(t is not None for t in device_seconds):
        for cell, seconds in zip(cells, device_seconds):
            cell.device_seconds = seconds
    elif any(t is not None for t in device_seconds):
        missing = [
            f"{c.contestant} {c.candidate} {c.mode}"
            for c, t in zip(cells, device_seconds)
            if t is None
        ]
        print(f"  {label}: no device time for {', '.join(missing)}; the row counts wall times")


def _compile(cell, lowered, args):
    if lowered is None:
        return None
    try:
        return lowered.compile()
    except Exception as error:
        print(
            f"  compile {cell.contestant} {cell.candidate} {cell.mode}: "
            f"{type(error).__name__}: {str(error)[:300]}",
            file=sys.stderr,
        )
        cell.error = short_error(error)
        return None


def dew_ratio(cells, mode, seconds) -> float | None:
    """Dew's speed over the fastest other kernel's (``seconds(cell)`` of each one's best cell by
    that measure), or None where either is missing."""

    def fastest(names):
        times = [seconds(c) for c in cells if c.contestant in names and c.mode == mode]
        times = [t for t in times if t]
        return min(times) if times else None

    dew, others = fastest({"dew"}), fastest({"jax-flash", "splash", "cudnn"})
    return others / dew if dew and others else None


def best(cells, contestant, mode):
    timed = [c for c in cells if c.contestant == contestant and c.mode == mode and c.time]
    if timed:
        return min(timed, key=lambda c: c.time)
    failed = [c for c in cells if c.contestant == contestant and c.mode == mode]
    return failed[0] if failed else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=Row.parse, nargs="*", help="SEQ:HEAD_DIM[:gqa][:full]")
    parser.add_argument("--seqs", type=int, nargs="*", help="with --head-dims: causal rows")
    parser.add_argument("--head-dims", type=int, nargs="*", help="with --seqs: causal rows")
    parser.add_argument("--sweep", action="store_true", help="time more blocks per kernel")
    parser.add_argument("--calls", type=int, default=10, help="timed calls per cell (median)")
    parser.add_argument("--threads", type=int, default=8, help="compile threads")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="start no new row after this many seconds (default 420)",
    )
    parser.add_argument("--skip-checks", action="store_true", help="time only")
    parser.add_argument("--json", help="write every cell here (JSON lines)")
    parser.add_argument(
        "--seed", type=int, default=None, help="the checks' inputs (default: fresh)"
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()

    backend = jax.default_backend()
    device = jax.devices()[0]
    print(
        f"device: {getattr(device, 'device_kind', device.platform)} ({backend}), "
        f"jax {jax.__version__}, {os.environ.get('LIBTPU_INIT_ARGS', '')}"
    )
    tokens, channels = (CPU_TOKENS, CPU_CHANNELS) if backend == "cpu" else (TOKENS, CHANNELS)
    if backend == "gpu":
        contestants, rows = gpu_contestants(), GPU_ROWS
    else:
        contestants, rows = tpu_contestants(args.sweep, interpret=backend == "cpu"), TPU_ROWS
    if backend == "cpu":
        rows = CPU_ROWS
        print(
            "no accelerator: the TPU contestants in TPU interpret mode at toy sizes, only to "
            "show that the script works; the timings mean nothing"
        )
    if args.rows:
        rows = tuple(args.rows)
    elif args.seqs or args.head_dims:
        rows = tuple(Row(s, d) for s in args.seqs or (2048,) for d in args.head_dims or (128,))
    failures = []
    interpret = contextlib.nullcontext()
    if backend == "cpu":
        from jax.experimental.pallas import tpu as pltpu

        interpret = pltpu.force_tpu_interpret_mode()
    with interpret:
        seed = args.seed if args.seed is not None else int(time.time_ns() % (2**31))
        if args.skip_checks:
            print("checks skipped (--skip-checks)")
        else:
            failures += run_checks(contestants, backend, seed)
        failures += run_table(rows, contestants, tokens, channels, args, start)
    print(f"\ntotal {time.perf_counter() - start:.0f} s; {len(failures)} failure(s)")
    for failure in failures:
        print(f"  FAILED: {failure}")
    return 1 if failures else 0


def run_table(rows, contestants, tokens, channels, args, start) -> list[str]:
    names = [c.name for c in contestants]
    print()
    print(
        f"timing: bfloat16, batch * seq = {tokens} tokens, heads * head_dim = {channels} "
        f"(gqa: {GQA_HEADS} heads over {GQA_KV_HEADS}); median of {args.calls} calls, round "
        "robin; TFLOP/s (fwd+bwd counted as 3.5x the forward) of each call's device time where "
        "the backend's profile has one (TPU, GPU), else its wall time; each cell the "
        "contestant's best candidate; the 'wall' ratios are those of the wall times"
    )
    for c in contestants:
        print(f"  {c.name} candidates: {', '.join(x.label for x in c.candidates)}")
    header = (
        f"{'seq, head_dim':<24}"
        + "".join(f"{n + ' ' + m:>18}" for m in ("fwd", "fwd+bwd") for n in names)
        + f"{'dew/best fwd':>14}{'dew/best f+b':>14}{'wall fwd':>10}{'wall f+b':>10}"
    )
    print(header)
    print("-" * len(header))
    failures = []
    key = jax.random.key(0)
    out = open(args.json, "a") if args.json else None
    for row in rows:
        if time.perf_counter() - start > args.budget_s:
            print(f"{row.label():<24}skipped (time budget)")
            continue
        key, sub = jax.random.split(key)
        cells = time_row(row, contestants, tokens, channels, args.calls, sub, args.threads)
        batch, heads, _ = row.shape(tokens, channels)
        flops = forward_flops(row, batch, heads)
        line, ratios = f"{row.label():<24}", []
        for mode, scale in (("fwd", 1.0), ("fwd+bwd", 3.5)):
            tflops = {}
            for name in names:
                cell = best(cells, name, mode)
                if cell is not None and cell.time:
                    tflops[name] = scale * flops / cell.time / 1e12
                    line += f"{tflops[name]:>18.1f}"
                else:
                    line += f"{(cell.error if cell else None) or '-':>18}"
                    if name == "dew" and cell is not None and cell.error != "OOM":
                        failures.append(f"dew {row.label()} {mode}: {cell.error}")
            ratios.append(dew_ratio(cells, mode, lambda c: c.time))
        wall = [dew_ratio(cells, mode, lambda c: c.seconds) for mode in ("fwd", "fwd+bwd")]
        line += "".join(f"{r:>14.2f}" if r else f"{'-':>14}" for r in ratios)
        line += "".join(f"{r:>10.2f}" if r else f"{'-':>10}" for r in wall)
        print(line, flush=True)
        for mode in ("fwd", "fwd+bwd"):
            print(
                "    best: "
                + ", ".join(
                    f"{n} {best(cells, n, mode).candidate}" for n in names if best(cells, n, mode)
                )
                + f" ({mode})"
            )
        if args.sweep:
            for cell in cells:
                value = f"{cell.seconds * 1e3:.3f} ms wall" if cell.seconds else cell.error
                if cell.device_seconds:
                    value += f", {cell.device_seconds * 1e3:.3f} ms device"
                print(f"      {cell.contestant:<10} {cell.mode:<8} {cell.candidate:<70} {value}")
        if out:
            for cell in cells:
                scale = 1.0 if cell.mode == "fwd" else 3.5
                out.write(
                    json.dumps(
                        {
                            "row": dataclasses.asdict(row),
                            "batch": batch,
                            "heads": heads,
                            **dataclasses.asdict(cell),
                            "tflops": scale * flops / cell.time / 1e12 if cell.time else None,
                        }
                    )
                    + "\n"
                )
            out.flush()
    return failures


if __name__ == "__main__":
    sys.exit(main())
