"""Attention benchmark: Dew's Pallas flash attention against the kernels a user would otherwise use.

    python bench/attention.py [--rows 8192:128 4096:128:gqa 8192:128:docs300 ...] [--sweep]
        [--json FILE]

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
and cuDNN ``[batch, seq, heads, head_dim]``. Each program takes and returns its arrays laid out
in memory as the compiler picks (``Layout.AUTO``), and its inputs are put in those layouts before
the clock starts: at head_dim 64 the TPU kernels read ``[..., seq, 64]`` tiled to 128 lanes,
where an array made outside is not, so until 2026-12-06 every d64 cell also timed a copy of each
input and output. Splash attention takes no logit scale: its q is
scaled before the clock starts (as a model folds it into the query projection). JAX's flash
attention takes no grouped K/V: it gets K/V repeated to every query head, inside the clock (what
a model calling it has to do).

Packed documents and windows (issue 53): a row ``SEQ:HEAD_DIM:docsN`` gives every contestant the
same segment ids, documents of random lengths with a mean of N tokens (uniform from 1 to 2N - 1,
one draw per row of the batch, ids increasing); ``SEQ:HEAD_DIM:windowW`` a sliding window of the
W most recent keys. Dew takes them as ``segment_ids`` and ``window``, splash as ``SegmentIds``
and a ``LocalMask((W - 1, 0))``, JAX flash as its ``SegmentIds`` (no window: "n/a"), XLA as a
mask. Those rows count the FLOPs of the visible (query, key) pairs, and also time Dew at each
of ``MASKED_DEW_BLOCKS`` (its best is the cell); a window row also times Dew's plain causal
forward ("dew-causal") and prints the window's time over it. The checks run the masks too: Dew
in float32 against the float64 reference, and every contestant in bfloat16, so a contestant
whose mask differs from Dew's shows there. Splash's blocks of 2048 need
``LIBTPU_INIT_ARGS=--xla_tpu_scoped_vmem_limit_kib=98304``.

A failure (a check off its tolerance or raising, a timed call raising) is reported where it
happens and the script goes on; it ends with the list of failures and exit status 1 when there
was one. A contestant that runs out of memory gets "OOM" in its cell, not a failure; one that
cannot take a row's mask gets "n/a".
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
from jax.experimental.layout import Format, Layout  # noqa: E402

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
    documents: int = 0  # mean document length of the packed rows' segment ids; 0: none
    window: int = 0  # a sliding window of this many keys; 0: none

    @classmethod
    def parse(cls, text: str) -> "Row":
        """``SEQ:HEAD_DIM[:gqa][:full][:docsN][:windowW]`` (``full``: no causal mask; ``docsN``:
        packed documents of mean length N; ``windowW``: a window of W keys)."""
        usage = (
            "a row is SEQ:HEAD_DIM[:gqa][:full][:docsN][:windowW], e.g. 8192:128, 4096:128:gqa "
            f"or 8192:128:docs300; got {text!r}"
        )
        parts = text.split(":")
        try:
            seq, head_dim = int(parts[0]), int(parts[1])
            numbers = {
                name: int(flag[len(name) :])
                for flag in parts[2:]
                for name in ("docs", "window")
                if flag.startswith(name)
            }
        except (IndexError, ValueError):
            raise argparse.ArgumentTypeError(usage) from None
        flags = {f for f in parts[2:] if not f.startswith(("docs", "window"))}
        if flags - {"gqa", "full"}:
            raise argparse.ArgumentTypeError(f"unknown row flags {flags - {'gqa', 'full'}}")
        if any(n < 1 for n in numbers.values()):
            raise argparse.ArgumentTypeError(f"docsN and windowW take N, W >= 1; {usage}")
        if "window" in numbers and "full" in flags:
            raise argparse.ArgumentTypeError(f"a window needs a causal row; {usage}")
        return cls(
            seq,
            head_dim,
            "gqa" in flags,
            "full" not in flags,
            numbers.get("docs", 0),
            numbers.get("window", 0),
        )

    @property
    def masked(self) -> bool:
        """Segment ids or a window: the rows issue 53 added."""
        return bool(self.documents or self.window)

    def shape(self, tokens: int, channels: int) -> tuple[int, int, int]:
        """(batch, heads, kv_heads)."""
        batch = max(1, tokens // self.seq)
        if self.grouped:
            return batch, GQA_HEADS, GQA_KV_HEADS
        heads = max(1, channels // self.head_dim)
        return batch, heads, heads

    def label(self) -> str:
        extra = (" gqa 32/8" if self.grouped else "") + ("" if self.causal else " non-causal")
        extra += f" docs {self.documents}" if self.documents else ""
        extra += f" window {self.window}" if self.window else ""
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
CPU_ROWS = (
    Row(256, 64),
    Row(256, 64, grouped=True),
    Row(128, 128, causal=False),
    Row(256, 64, documents=40),
    Row(256, 64, window=64),
)
# Issue 53's rows (--masked): packed documents of mean length 300, a window of 1024 at 8192 keys.
MASKED_ROWS = (
    Row(2048, 128, documents=300),
    Row(8192, 128, documents=300),
    Row(8192, 128, window=1024),
)


def forward_flops(row: Row, batch: int, heads: int, ids=None) -> float:
    """A forward's FLOPs: ``4 head_dim`` a visible (query, key) pair (two matmuls). Causal rows
    count half the square (as JAX's and splash's benchmarks do); rows with segment ids
    (``ids``, ``[batch, seq]``) or a window count their visible pairs exactly."""
    if not row.masked:
        full = 4.0 * batch * heads * row.seq * row.seq * row.head_dim
        return full / 2 if row.causal else full
    return 4.0 * heads * row.head_dim * visible_pairs(row, batch, ids)


def visible_pairs(row: Row, batch: int, ids=None) -> int:
    """The (query, key) pairs a causal row with segment ids and/or a window lets through."""
    seen = np.minimum(np.arange(1, row.seq + 1), row.window or row.seq)  # per query, no ids
    if ids is None:
        return int(batch * seen.sum())
    total = 0
    for ids_row in np.asarray(ids):
        starts = np.flatnonzero(np.diff(ids_row, prepend=ids_row[0] - 1))
        for length in np.diff(np.append(starts, row.seq)):
            total += int(np.minimum(np.arange(1, length + 1), row.window or length).sum())
    return total


def document_ids(seed: int, batch: int, seq: int, mean: int) -> np.ndarray:
    """int32 ``[batch, seq]``: each row packs documents of lengths drawn uniformly from
    ``[1, 2 mean)``, numbered in order (the last one cut at ``seq``)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(batch):
        lengths = []
        while sum(lengths) < seq:
            lengths.append(int(rng.integers(1, 2 * mean)))
        rows.append(np.repeat(np.arange(len(lengths)), lengths)[:seq])
    return np.asarray(rows, np.int32)


# ---- contestants -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One way to run a contestant: ``label`` names its blocks; ``make(row, sm_scale)`` returns
    ``attend(q, k, v, segment_ids=None) -> out`` on the contestant's layout (``segment_ids``
    ``[batch, seq]`` int32 on the rows with documents), or None where it cannot take the row's
    mask; ``context`` is entered while it is traced (Dew's tuning overrides)."""

    label: str
    make: object
    context: object = contextlib.nullcontext
    masked_rows_only: bool = False  # timed only on rows with segment ids or a window


def _dew(interpret=None, layout="bhsd", masked_rows_only=False, window=True, **tuning):
    """Dew's kernels under ``tuning`` (`kernels.platform.tuned`); ``masked_rows_only``: only on
    rows with segment ids or a window; ``window=False``: the row without its window (the plain
    causal forward a window row is measured against)."""

    def make(row, sm_scale):
        return functools.partial(
            flash_attention,
            causal=row.causal,
            window=(row.window or None) if window else None,
            layout=layout,
            interpret=interpret,
        )

    label = ",".join(f"{k}={v}" for k, v in tuning.items()) or "defaults"
    context = functools.partial(kernel_platform.tuned, **tuning)
    return Candidate(label, make, context, masked_rows_only)


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
        if row.window:
            return None  # JAX flash has no sliding window

        def attend(q, k, v, segment_ids=None):
            group = q.shape[1] // k.shape[1]
            if group > 1:  # no grouped K/V: repeated to every query head
                k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
            seq = q.shape[2]
            blocks = sizes if seq >= block else None
            ids = None if segment_ids is None else jax_flash.SegmentIds(segment_ids, segment_ids)
            return jax_flash.flash_attention(
                q,
                k,
                v,
                segment_ids=ids,
                causal=row.causal,
                sm_scale=sm_scale,
                block_sizes=blocks,
            )

        return attend

    return Candidate(f"{block}" + (f"/{block_k}" if block_k != block else ""), make)


def _splash(block_q: int, block_kv: int, compute: int, fused: bool, interpret: bool = False):
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    def make(row, sm_scale):
        del sm_scale  # splash takes q pre-scaled (see the module's docstring)
        cache = {}

        def attend(q, k, v, segment_ids=None):
            heads, seq = q.shape[1], q.shape[2]
            if (heads, seq) not in cache:
                one = splash.CausalMask((seq, seq)) if row.causal else splash.FullMask((seq, seq))
                if row.window:  # the window's W keys: W - 1 before the query, none after
                    one = splash.LocalMask((seq, seq), (row.window - 1, 0), offset=0)
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
            args = (q, k, v)
            if segment_ids is not None:  # the kernel's fourth argument
                args += (splash.SegmentIds(segment_ids, segment_ids),)
            if interpret:  # TPU interpret mode mis-sizes a vmapped splash grid: one call a row
                rows = [jax.tree.map(lambda x, n=n: x[n], args) for n in range(q.shape[0])]
                return jnp.stack([cache[heads, seq](*one) for one in rows])
            return jax.vmap(cache[heads, seq])(*args)

        return attend

    fused_label = ",fused bwd" if fused else ""
    return Candidate(f"{block_q}x{block_kv}/{compute}{fused_label}", make)


def _dot_product_attention(implementation: str):
    """``jax.nn.dot_product_attention``: the window as its ``local_window_size``, segment ids
    as a mask (cuDNN takes none: "n/a")."""

    def make(row, sm_scale):
        if row.documents and implementation == "cudnn":
            return None

        def attend(q, k, v, segment_ids=None):
            mask = None
            if segment_ids is not None:
                mask = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
            return jax.nn.dot_product_attention(
                q,
                k,
                v,
                mask=mask,
                is_causal=row.causal,
                scale=sm_scale,
                local_window_size=(row.window - 1, 0) if row.window else None,
                implementation=implementation,
            )

        return attend

    return make


_xla = _dot_product_attention("xla")
_cudnn = _dot_product_attention("cudnn")


@dataclasses.dataclass(frozen=True)
class Contestant:
    name: str
    layout: str  # "bhsd" or "bshd": the layout its inputs are made in
    candidates: tuple
    prescaled: bool = False  # q arrives multiplied by sm_scale
    window_rows_only: bool = False  # timed only on rows with a window (dew-causal)


def tpu_contestants(sweep: bool, interpret: bool) -> list[Contestant]:
    """Each kernel at the blocks that measured best on a v5e chip
    (docs/results/attention-kernels.md), or with ``sweep`` a wider set. ``interpret``: TPU
    interpret mode (the CPU's dry run)."""
    dew_interp = "tpu" if interpret else None
    if interpret:  # toy sizes: blocks that split them, nothing more
        dew = (_dew(dew_interp, block_q=128, block_k=128),)
        dew_causal = (_dew(dew_interp, window=False, block_q=128, block_k=128),)
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
    if not interpret:
        # Rows with segment ids or a window: Dew at more blocks (shorter ones skip more), and
        # splash at 512 too.
        dew += tuple(_dew(dew_interp, masked_rows_only=True, **t) for t in MASKED_DEW_BLOCKS)
        splash += (_splash(512, 512, 512, True),)
        dew_causal = (_dew(dew_interp, window=False),)
    return [
        Contestant("dew", "bhsd", dew),
        Contestant("jax-flash", "bhsd", flash),
        Contestant("splash", "bhsd", splash, prescaled=True),
        Contestant("xla", "bshd", (Candidate("-", _xla),)),
        # On a window row, Dew's causal forward without the window (the target: the window's
        # forward at most 0.3x of it); on other rows nothing.
        Contestant("dew-causal", "bhsd", dew_causal, window_rows_only=True),
    ]


# Dew's blocks tried beside its defaults on rows with segment ids or a window (query and key
# blocks; keys computed 512 at a time where the block holds more, or as given): shorter blocks
# and pieces follow a window's band and documents' edges more closely, for more grid steps.
MASKED_DEW_BLOCKS = (
    dict(block_q=512, block_k=1024),
    dict(block_q=512, block_k=512),
    dict(block_q=256, block_k=512),
    dict(block_q=512, block_k=1024, block_k_compute=256, backward_block_k_compute=256),
)


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
    dict(forward_heads=4),  # the most a step took before 2026-12-07
    dict(block_q_compute=None),
)


def gpu_contestants() -> list[Contestant]:
    dew = Candidate(
        "defaults",
        lambda row, scale: functools.partial(
            flash_attention, causal=row.causal, window=row.window or None
        ),
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


def reference(q, k, v, do, *, causal: bool, sm_scale: float, segment_ids=None, window=0):
    """Softmax attention and its q, k, v gradients for the cotangent ``do``, in float64 numpy,
    from the formulas: ``p = softmax(sm_scale q k^T)`` (bottom-right causal mask; with
    ``segment_ids`` ``[batch, seq]`` only keys of the query's id, with ``window`` only the
    ``window`` most recent keys), ``out = p v``, ``dv = p^T do``, ``ds = p * (do v^T -
    rowsum(do * out))``, ``dq = sm_scale ds k``, ``dk = sm_scale ds^T q``; grouped K/V serve
    ``heads // kv_heads`` query heads each. Arrays ``[batch, seq, heads, head_dim]``; rows must
    see at least one key."""
    q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
    group = q.shape[2] // k.shape[2]
    kk, vv = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, kk) * sm_scale
    q_len, kv_len = q.shape[1], k.shape[1]
    position = np.arange(q_len)[:, None] + (kv_len - q_len)  # of each query among the keys
    visible = np.ones((1, 1, q_len, kv_len), bool)
    if causal:
        visible = visible & (np.arange(kv_len)[None, :] <= position)
    if window:
        visible = visible & (position - np.arange(kv_len)[None, :] < window)
    if segment_ids is not None:
        ids = np.asarray(segment_ids)
        visible = visible & (ids[:, None, :, None] == ids[:, None, None, :])
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


def with_ids(attend):
    """``attend`` as ``(q, k, v[, segment_ids]) -> out``: the ids, where a row has them, as its
    ``segment_ids`` (every contestant's keyword)."""

    def run(q, k, v, *ids):
        return attend(q, k, v, segment_ids=ids[0]) if ids else attend(q, k, v)

    return run


def forward_and_backward(attend):
    """(q, k, v, do[, segment_ids]) -> (out, dq, dk, dv): what a training step runs."""

    def run(q, k, v, do, *ids):
        out, vjp = jax.vjp(lambda q, k, v: with_ids(attend)(q, k, v, *ids), q, k, v)
        return (out, *vjp(do))

    return run


def run_contestant(contestant, candidate, row, inputs, sm_scale, segment_ids=None):
    """(out, dq, dk, dv) of one candidate on [batch, seq, heads, head_dim] ``inputs``, returned in
    that layout and float32 (dq of a pre-scaled q turned back into the gradient of q); None
    where the candidate cannot take the row's mask."""
    attend = candidate.make(row, sm_scale)
    if attend is None:
        return None
    q, k, v, do = (to_layout(contestant.layout, x) for x in inputs)
    if contestant.prescaled:
        q = (q.astype(jnp.float32) * sm_scale).astype(q.dtype)
    ids = () if segment_ids is None else (jnp.asarray(segment_ids),)
    with candidate.context():
        got = jax.jit(forward_and_backward(attend))(q, k, v, do, *ids)
    out, dq, dk, dv = (to_layout(contestant.layout, x).astype(jnp.float32) for x in got)
    if contestant.prescaled:
        dq = dq * sm_scale
    return out, dq, dk, dv


# ---- checks ------------------------------------------------------------------------------------


def _mask_label(causal: bool, documents: int, window: int) -> str:
    if documents:
        return f"docs {documents}"
    if window:
        return f"window {window}"
    return "causal" if causal else "full"


def _check_inputs(key, case, dtype):
    """``(row, inputs, segment_ids, reference)`` of one check case ``(batch, seq, heads,
    kv_heads, head_dim, causal[, documents, window])``."""
    batch, seq, heads, kv_heads, head_dim, causal, documents, window = (*case, 0, 0)[:8]
    row = Row(seq, head_dim, causal=causal, documents=documents, window=window)
    inputs = random_inputs(key, batch, seq, heads, kv_heads, head_dim, dtype)
    ids = None
    if documents:
        ids = document_ids(int(jax.random.randint(key, (), 0, 2**31 - 1)), batch, seq, documents)
    want = reference(
        *inputs, causal=causal, sm_scale=1 / math.sqrt(head_dim), segment_ids=ids, window=window
    )
    return row, inputs, ids, want


def _case_head(case) -> str:
    batch, seq, heads, kv_heads, head_dim, causal, documents, window = (*case, 0, 0)[:8]
    mask = _mask_label(causal, documents, window)
    return f"    {batch:>5} {seq:>5} {heads:>5} {kv_heads:>3} {head_dim:>4} {mask:>11}  "


def run_checks(contestants, backend: str, seed: int) -> list[str]:
    """Dew's kernels in float32 at small shapes, then every contestant in bfloat16, against the
    float64 reference; the rows with segment ids (``docs``) and a window included. Returns the
    failures."""
    failures = []
    on_cpu = backend == "cpu"
    dew = contestants[0]
    f32_cases = [  # batch, seq, heads, kv_heads, head_dim, causal[, documents, window]
        (1, 200, 4, 2, 64, True),
        (2, 129, 2, 2, 128, True),
        (1, 300, 4, 1, 128, False),
        (2, 300, 4, 2, 64, True, 40, 0),
        (1, 300, 2, 1, 128, True, 0, 70),
    ]
    if not on_cpu:
        f32_cases += [
            (1, 1024, 4, 2, 128, True),
            (1, 4096, 2, 2, 128, True),
            (2, 2048, 4, 2, 128, True, 300, 0),
            (1, 4096, 2, 2, 128, True, 0, 1024),
        ]
    print(f"checks: seed {seed}; relative error (Frobenius) against float64 numpy attention")
    # On a TPU chip the gradients measured 2.5e-5 to 2.9e-5 from float64 (v5e, 2026-12-05), the
    # output 1e-6; the cause is not found (tests/test_on_tpu.py, KERNEL_GRAD_TOL).
    grad_tol = 1e-5 if backend != "tpu" else 5e-5
    print(f"  Dew's kernels, float32 inputs (tolerance: out 1e-5, gradients {grad_tol:g}):")
    print(
        f"    {'batch':>5} {'seq':>5} {'heads':>5} {'kv':>3} {'dim':>4} {'mask':>11}  "
        f"{'out':>8} {'dq':>8} {'dk':>8} {'dv':>8}"
    )
    key = jax.random.key(seed)
    # Float32 inputs at full precision: a TPU's default float32 matmul is one bfloat16 pass.
    with jax.default_matmul_precision("highest"):
        for case in f32_cases:
            key, sub = jax.random.split(key)
            row, inputs, ids, want = _check_inputs(sub, case, jnp.float32)
            sm_scale = 1 / math.sqrt(row.head_dim)
            try:
                got = run_contestant(dew, dew.candidates[0], row, inputs, sm_scale, ids)
            except Exception as error:
                traceback.print_exc(file=sys.stderr)
                print(_case_head(case) + f"error: {type(error).__name__}")
                failures.append(f"dew float32 {case}: {type(error).__name__}")
                continue
            errors = [relative_error(g, w) for g, w in zip(got, want)]
            ok = errors[0] < 1e-5 and all(e < grad_tol for e in errors[1:])
            line = " ".join(f"{e:8.1e}" for e in errors) + ("  ok" if ok else "  FAIL")
            print(_case_head(case) + line)
            if not ok:
                failures.append(f"dew float32 {case}: errors {errors}")

    bf16_cases = [  # batch, seq, heads, kv_heads, head_dim, causal[, documents, window]
        (1, 256, 4, 4, 64, True),
        (1, 256, 8, 2, 128, True),
        (1, 128, 2, 2, 128, False),
        (2, 256, 4, 4, 128, True, 40, 0),
        (1, 256, 4, 4, 128, True, 0, 64),
    ]
    if not on_cpu:
        bf16_cases = [
            (1, 2048, 8, 2, 128, True),
            (2, 1024, 4, 4, 64, True),
            (1, 2048, 4, 4, 128, False),
            (2, 2048, 8, 8, 128, True, 300, 0),
            (1, 4096, 4, 4, 128, True, 0, 1024),
        ]
    checked = [c for c in contestants if not c.window_rows_only]
    print("  every contestant, bfloat16 inputs, out dq dk dv (Dew's tolerance 2e-2):")
    print(
        f"    {'batch':>5} {'seq':>5} {'heads':>5} {'kv':>3} {'dim':>4} {'mask':>11}  "
        + "  ".join(f"{c.name:>35}" for c in checked)
    )
    for case in bf16_cases:
        key, sub = jax.random.split(key)
        row, inputs, ids, want = _check_inputs(sub, case, jnp.bfloat16)
        sm_scale = 1 / math.sqrt(row.head_dim)
        cells = []
        for contestant in checked:
            try:
                got = run_contestant(
                    contestant, contestant.candidates[0], row, inputs, sm_scale, ids
                )
                if got is None:
                    cells.append(f"{'n/a':>35}")
                    continue
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
        print(_case_head(case) + "  ".join(f"{c:>35}" for c in cells), flush=True)
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


def row_ids(row, batch: int, key):
    """The segment ids a row with documents times every contestant on (None for the others)."""
    if not row.documents:
        return None
    seed = int(jax.random.randint(key, (), 0, 2**31 - 1))
    return document_ids(seed, batch, row.seq, row.documents)


def time_row(row, contestants, tokens, channels, calls, key, threads, ids=None) -> list[Cell]:
    """Every candidate of every contestant on one row, forward and forward+backward: traced one
    at a time (Dew's overrides are process-wide), compiled in ``threads`` threads, then timed
    round robin, by the wall clock (`median_seconds_round_robin`) and, off the CPU, on the
    device (`device_seconds_round_robin`). ``ids``: the row's segment ids (`row_ids`). A
    candidate that cannot take the row's mask gets an "n/a" cell."""
    batch, heads, kv_heads = row.shape(tokens, channels)
    sm_scale = 1 / math.sqrt(row.head_dim)
    inputs = random_inputs(key, batch, row.seq, heads, kv_heads, row.head_dim, jnp.bfloat16)
    extra = () if ids is None else (jnp.asarray(ids),)
    jobs = []
    for contestant in contestants:
        if contestant.window_rows_only and not row.window:
            continue
        q, k, v, do = (to_layout(contestant.layout, x) for x in inputs)
        if contestant.prescaled:
            q = (q.astype(jnp.float32) * sm_scale).astype(q.dtype)
        for candidate in contestant.candidates:
            if candidate.masked_rows_only and not row.masked:
                continue
            if candidate.make(row, sm_scale) is None:
                for mode in ("fwd", "fwd+bwd"):
                    jobs.append(
                        (Cell(contestant.name, candidate.label, mode, error="n/a"), None, None)
                    )
                continue
            for mode in ("fwd", "fwd+bwd"):
                cell = Cell(contestant.name, candidate.label, mode)
                try:
                    # A fresh attend for each program: splash builds its kernel (and its mask's
                    # arrays) at the first trace, and a kernel built in one trace and closed over
                    # by another compiles with those arrays as inputs the call does not pass
                    # ("compiled for 9 inputs but called with 4", on the chip).
                    attend = candidate.make(row, sm_scale)
                    fn, args = (
                        (with_ids(attend), (q, k, v, *extra))
                        if mode == "fwd"
                        else (forward_and_backward(attend), (q, k, v, do, *extra))
                    )
                    fn = named(fn, f"bench_cell_{len(jobs)}")
                    with candidate.context():
                        lowered = jax.jit(fn, in_shardings=AUTO, out_shardings=AUTO).lower(*args)
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
        (f"jit_bench_cell_{n}", cell, program, laid_out(program, args))
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


# Every program takes and returns its arrays in the layouts the compiler picks, and its inputs are
# laid out so before the clock starts: at head_dim 64 a kernel's ``[..., seq, 64]`` arrays are
# tiled to 128 lanes in HBM, where an array made outside is not, and each program would otherwise
# time a copy of every input and output (Dew's, JAX flash's and splash's alike).
AUTO = Format(Layout.AUTO)


def laid_out(program, args):
    """``args`` in the layouts the compiled ``program`` takes them in."""
    return tuple(jax.device_put(x, f) for x, f in zip(args, program.input_formats[0]))


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


def window_ratios(cells) -> str:
    """A window row's line: Dew's time with the window over its time on the plain causal row
    (dew-causal), forward and forward+backward (issue 53's target: the forward at most 0.3)."""
    parts = []
    for mode in ("fwd", "fwd+bwd"):
        window, causal = best(cells, "dew", mode), best(cells, "dew-causal", mode)
        if window and causal and window.time and causal.time:
            ratio = f"{window.time / causal.time:.3f} ({window.time * 1e3:.3f} / "
            parts.append(f"{mode} {ratio}{causal.time * 1e3:.3f} ms)")
        else:
            parts.append(f"{mode} -")
    return "dew window / dew causal: " + ", ".join(parts) + " (target: fwd <= 0.3)"


def best(cells, contestant, mode):
    timed = [c for c in cells if c.contestant == contestant and c.mode == mode and c.time]
    if timed:
        return min(timed, key=lambda c: c.time)
    failed = [c for c in cells if c.contestant == contestant and c.mode == mode]
    return failed[0] if failed else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rows",
        type=Row.parse,
        nargs="*",
        help="SEQ:HEAD_DIM[:gqa][:full][:docsN][:windowW]",
    )
    parser.add_argument(
        "--masked",
        action="store_true",
        help="time issue 53's rows: packed documents (2048 and 8192, d128) and a window of 1024 "
        "at 8192 keys (with --rows: after them)",
    )
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
    if args.rows or args.masked:
        rows = tuple(args.rows or ()) + (MASKED_ROWS if args.masked else ())
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
        key, sub, ids_key = jax.random.split(key, 3)
        batch, heads, _ = row.shape(tokens, channels)
        ids = row_ids(row, batch, ids_key)
        cells = time_row(row, contestants, tokens, channels, args.calls, sub, args.threads, ids)
        flops = forward_flops(row, batch, heads, ids)
        # dew-causal runs the row without its window: its FLOPs are the causal square's.
        plain = dataclasses.replace(row, window=0)
        flops_of = {"dew-causal": forward_flops(plain, batch, heads, ids)}
        line, ratios = f"{row.label():<24}", []
        for mode, scale in (("fwd", 1.0), ("fwd+bwd", 3.5)):
            tflops = {}
            for name in names:
                cell = best(cells, name, mode)
                if cell is not None and cell.time:
                    tflops[name] = scale * flops_of.get(name, flops) / cell.time / 1e12
                    line += f"{tflops[name]:>18.1f}"
                else:
                    line += f"{(cell.error if cell else None) or '-':>18}"
                    if name == "dew" and cell is not None and cell.error not in ("OOM", "n/a"):
                        failures.append(f"dew {row.label()} {mode}: {cell.error}")
            ratios.append(dew_ratio(cells, mode, lambda c: c.time))
        wall = [dew_ratio(cells, mode, lambda c: c.seconds) for mode in ("fwd", "fwd+bwd")]
        line += "".join(f"{r:>14.2f}" if r else f"{'-':>14}" for r in ratios)
        line += "".join(f"{r:>10.2f}" if r else f"{'-':>10}" for r in wall)
        print(line, flush=True)
        if row.window:
            print("    " + window_ratios(cells))
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
