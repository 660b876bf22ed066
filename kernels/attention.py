"""The public entry points: `flash_attention` (out), `flash_attention_forward` (out and the
log-sum-exp) and `flash_attention_backward` (dq, dk, dv from out, lse and their cotangents).
Each checks its inputs, picks the target (`kernels.platform`: Mosaic TPU kernels, Triton GPU
kernels, or either in an interpreter) and block sizes and pads lengths to whole blocks; the first
two tie the forward and backward kernels with `jax.custom_vjp`, the third runs the backward
kernels alone (for a ring attention that merges blocks and writes its own backward). Both kernel
families take the same padded arrays and return the same base-2 ``lse``, so everything here is
shared.

Only the numbers of rows are padded (with zeros), never heads or head_dim; the kernels mask
padded keys, padded query rows are sliced off the output, and their cotangent is zero. When the
lengths are multiples of the blocks no copy is made. Segment ids (`kernels.segments`) are checked
here, padded with their last id, and travel beside q, k, v through the custom_vjps (no cotangent);
a window is checked here and becomes part of the static `Tiling`.

Layout: the checks and the choice of blocks (`check_inputs`, `_choose_block`, `_Config`, `_config`);
the three entry points; the layout swap and the padding (`_as_bshd`, `_pad_rows`,
`_padded_attention`); the calls into a target's kernels (`_run_forward`, `_run_backward`); the two
custom_vjps (`_attention`, `_attention_with_lse`); and the padded forward and backward that the last
two entry points call (`_padded_forward`, `_padded_backward`). It is one module because the three
entry points share the input checks, the block choice and the padding, which must agree between a
forward and the backward that later reads its residuals.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from . import backward as _backward
from . import forward as _forward
from . import mosaic_backward as _mosaic_backward
from . import mosaic_forward as _mosaic_forward
from . import mosaic_fused_backward as _mosaic_fused_backward
from . import segments as _segments
from .platform import (
    LANES,
    SUBLANES,
    choose_target,
    compile_device,
    default_blocks,
    mosaic_tuning,
    tpu_generation,
)
from .schedule import MAX_STEPS, forward_steps
from .tiling import Tiling, cdiv
from .varying import match_varying

SUPPORTED_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16))

# Smallest block of the GPU kernels: Triton's tensor-core dot needs every matmul dimension >= 16.
# Interpret mode keeps the same floor so that a block size means the same thing there.
MIN_BLOCK = 16
# Triton tensors must have power-of-two sizes, so head_dim must be one (no head padding here).
TRITON_HEAD_DIMS = (16, 32, 64, 128, 256)
MOSAIC_TARGETS = ("mosaic", "mosaic_interpret")


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _shapes(q, k, v) -> str:
    return (
        f"q {tuple(q.shape)} {np.dtype(q.dtype).name}, k {tuple(k.shape)} "
        f"{np.dtype(k.dtype).name}, v {tuple(v.shape)} {np.dtype(v.dtype).name}"
    )


def check_inputs(q, k, v, target: str) -> None:
    """ValueError, naming the shapes, for anything the kernels cannot take on `target`."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise ValueError(f"flash_attention: {name} must be an array, got {type(x).__name__}")
    if len(q.shape) != 4 or len(k.shape) != 4 or len(v.shape) != 4:
        raise ValueError(
            "flash_attention expects q [batch, q_len, heads, head_dim] and k, v "
            f"[batch, kv_len, kv_heads, head_dim]; got {_shapes(q, k, v)}"
        )
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(
            f"flash_attention: k and v must have the same shape; got {_shapes(q, k, v)}"
        )
    batch, q_len, heads, head_dim = q.shape
    if k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(
            f"flash_attention: q and k, v must agree on batch and head_dim; got {_shapes(q, k, v)}"
        )
    kv_len, kv_heads = k.shape[1], k.shape[2]
    if min(batch, q_len, kv_len, heads, kv_heads, head_dim) < 1:
        raise ValueError(
            f"flash_attention: every dimension must be at least 1; got {_shapes(q, k, v)}"
        )
    if heads % kv_heads:
        raise ValueError(
            f"flash_attention: heads ({heads}) must be a multiple of kv_heads ({kv_heads}); "
            f"got {_shapes(q, k, v)}"
        )
    dtypes = {np.dtype(q.dtype), np.dtype(k.dtype), np.dtype(v.dtype)}
    if len(dtypes) != 1:
        raise ValueError(
            f"flash_attention: q, k and v must share one dtype; got {_shapes(q, k, v)}"
        )
    if np.dtype(q.dtype) not in SUPPORTED_DTYPES:
        raise ValueError(f"flash_attention takes float32 or bfloat16; got {_shapes(q, k, v)}")
    if target == "triton" and head_dim not in TRITON_HEAD_DIMS:
        raise ValueError(
            f"flash_attention on GPU (Triton) needs head_dim in {TRITON_HEAD_DIMS}; got head_dim "
            f"{head_dim} from {_shapes(q, k, v)}"
        )


def _choose_block(name: str, requested, default: int, length: int, target: str) -> int:
    """The block along one length: ``requested`` (or the target's default) checked against the
    target's rule, and shrunk to the length rounded up when longer (it would only add padding).

    GPU kernels and the generic interpreter: a power of two >= 16 (Triton's tensors), shrunk to
    the length rounded up to a power of two. Mosaic (and TPU interpret mode): the TPU tiling rule
    (`kernels.platform`), shrunk to the length rounded up to a multiple of 8.
    """
    if requested is None:
        requested = default
    is_int = isinstance(requested, (int, np.integer)) and not isinstance(requested, bool)
    if target in MOSAIC_TARGETS:
        return _mosaic_block(name, requested if is_int else None, requested, length)
    if not (is_int and _is_power_of_two(int(requested)) and requested >= MIN_BLOCK):
        raise ValueError(
            f"flash_attention: {name} must be a power of two >= {MIN_BLOCK}; got {requested!r}"
        )
    return min(int(requested), max(MIN_BLOCK, 1 << (length - 1).bit_length()))


def _mosaic_block(name: str, block: int | None, given, length: int) -> int:
    """A Mosaic block: the last two dimensions of a TPU block are a multiple of (8, 128), or the
    whole dimension. block_q and block_k are the rows (sublanes) of the [block, head_dim] blocks,
    so multiples of 8; block_q is also the lanes of the lse and delta row blocks [1, block_q], so
    a multiple of 128 unless one block covers the whole query length."""
    whole = cdiv(length, SUBLANES) * SUBLANES
    if block is None or block < SUBLANES or block % SUBLANES:
        raise ValueError(
            f"flash_attention on TPU (Mosaic): {name} must be a positive multiple of {SUBLANES} "
            f"(the rows of a [{name}, head_dim] block, which Mosaic tiles in (8, 128) sublanes "
            f"and lanes); got {name}={given!r}"
        )
    if name == "block_q" and block < whole and block % LANES:
        raise ValueError(
            f"flash_attention on TPU (Mosaic): block_q must be a multiple of {LANES} (the lanes "
            f"of the lse and delta blocks [1, block_q], tiled (8, 128)) or cover q_len in one "
            f"block (>= {whole}); got block_q={given!r} for q_len {length}"
        )
    return min(block, whole)


@dataclasses.dataclass(frozen=True)
class _Config:
    tiling: Tiling
    sm_scale: float
    target: str  # a name in kernels.platform.TARGETS
    num_warps: int | None
    num_stages: int | None
    tuning: object = None  # kernels.mosaic.Tuning on the Mosaic targets
    segmented: bool = False  # the call takes segment ids (their values are data, not config)

    @property
    def scale(self) -> float:
        """Multiplier turning q . k into base-2 logits."""
        return self.sm_scale * _forward.LOG2_E

    def compiler_params(self):
        """The GPU kernels' launch parameters (Triton), None in the generic interpreter."""
        if self.target != "triton":
            return None
        from jax.experimental.pallas import triton as pallas_triton  # GPU only

        return pallas_triton.CompilerParams(num_warps=self.num_warps, num_stages=self.num_stages)


def _check_window(window, causal: bool, kv_len: int) -> int | None:
    """The window as the tiling keeps it: None, or an int ``1 <= window < kv_len`` (a window of
    ``kv_len`` keys or more hides none: the causal call, unchanged). ValueError otherwise."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
        raise ValueError(
            f"flash_attention: window must be None or an int >= 1 (the most recent keys a query "
            f"sees, itself included); got {window!r}"
        )
    if not causal:
        raise ValueError(
            f"flash_attention: window={window} needs causal=True: a window is the {window} most "
            "recent keys up to each query's own position"
        )
    return int(window) if window < kv_len else None


def _config(
    q, k, v, *, causal, sm_scale, block_q, block_k, interpret, segment_ids=None, window=None
):
    """Checks the inputs and arguments (ValueError before any kernel is traced) and fixes the
    target, tiling and launch parameters of one call; ``(config, ids)``, ``ids`` the segment
    ids as ``(q_ids, kv_ids)`` or None."""
    target = choose_target(interpret)
    check_inputs(q, k, v, target)
    if not isinstance(causal, (bool, np.bool_)):
        raise ValueError(f"flash_attention: causal must be a bool, got {causal!r}")
    ids = _segments.check(segment_ids, q.shape[0], int(q.shape[1]), int(k.shape[1]))
    window = _check_window(window, bool(causal), int(k.shape[1]))
    head_dim = q.shape[3]
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    elif (
        isinstance(sm_scale, bool)
        or not isinstance(sm_scale, (int, float, np.floating, np.integer))
        or not math.isfinite(sm_scale)
    ):
        raise ValueError(
            f"flash_attention: sm_scale must be a finite Python number, got {sm_scale!r}"
        )
    q_len, kv_len = int(q.shape[1]), int(k.shape[1])
    defaults = default_blocks(target, head_dim, q.dtype, causal, window)
    tiling = Tiling(
        q_len=q_len,
        kv_len=kv_len,
        block_q=_choose_block("block_q", block_q, defaults.block_q, q_len, target),
        block_k=_choose_block("block_k", block_k, defaults.block_k, kv_len, target),
        causal=bool(causal),
        window=window,
    )
    tuning = None
    if target in MOSAIC_TARGETS:
        tuning = mosaic_tuning(tpu_generation(compile_device().device_kind))
        steps = len(forward_steps(tiling))
        if steps > MAX_STEPS:
            raise ValueError(
                f"flash_attention on TPU (Mosaic): q_len {q_len} and kv_len {kv_len} at block_q "
                f"{tiling.block_q} and block_k {tiling.block_k} make {steps} visible block "
                f"pairs, more than the {MAX_STEPS} the kernels' step tables hold in SMEM; pass "
                "larger block_q and block_k"
            )
        if ids is not None:
            _check_mosaic_segments(tiling, tuning, int(q.shape[0]), steps)
    config = _Config(
        tiling=tiling,
        sm_scale=float(sm_scale),
        target=target,
        num_warps=defaults.num_warps,
        num_stages=defaults.num_stages,
        tuning=tuning,
        segmented=ids is not None,
    )
    return config, ids


def _check_mosaic_segments(tiling: Tiling, tuning, batch: int, steps: int) -> None:
    """With segment ids, the Mosaic forward reads the key ids as ``[8, block_k]`` rows: block_k
    is their lanes, a multiple of 128 unless one block covers the keys; and its per-row tables
    (`kernels.segments`) must fit SMEM beside the step tables."""
    whole = cdiv(tiling.kv_len, SUBLANES) * SUBLANES
    if tiling.block_k < whole and tiling.block_k % LANES:
        raise ValueError(
            f"flash_attention on TPU (Mosaic) with segment_ids: block_k must be a multiple of "
            f"{LANES} (the lanes of the [8, block_k] key-id blocks) or cover kv_len in one block "
            f"(>= {whole}); got block_k={tiling.block_k} for kv_len {tiling.kv_len}"
        )
    strips = tiling.q_padded // tuning.rows(tiling.block_q)
    pieces = tiling.kv_padded // tuning.piece(tiling.block_k)
    entries = batch * (steps + 2 * strips + 2 * pieces)
    if entries > _segments.MAX_TABLE_ENTRIES:
        raise ValueError(
            f"flash_attention on TPU (Mosaic) with segment_ids: batch {batch} at q_len "
            f"{tiling.q_len}, kv_len {tiling.kv_len} (block_q {tiling.block_q}, block_k "
            f"{tiling.block_k}) needs {entries} entries of per-row skip tables, more than the "
            f"{_segments.MAX_TABLE_ENTRIES} they may take in SMEM; call with fewer rows at a "
            "time or larger blocks"
        )


def flash_attention(
    q,
    k,
    v,
    *,
    causal: bool = True,
    segment_ids=None,
    window: int | None = None,
    sm_scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    interpret: bool | str | None = None,
    layout: str = "bshd",
):
    """Softmax attention, ``softmax(sm_scale * q k^T [masked]) v``, as Pallas kernels.

    Args:
      q: [batch, q_len, heads, head_dim], float32 or bfloat16.
      k, v: [batch, kv_len, kv_heads, head_dim], same dtype; ``heads`` a multiple of
        ``kv_heads`` (query head ``h`` reads kv head ``h // (heads // kv_heads)``).
      causal: mask with bottom-right alignment: query ``i`` sees keys ``j <= i + kv_len - q_len``
        (the lower triangle when the lengths are equal). Default True; False: every key.
      segment_ids: None (the default); int32 ``[batch, seq]`` (self-attention, ``q_len ==
        kv_len``); or a pair ``(q_ids, kv_ids)``, int32 ``[batch, q_len]`` and ``[batch,
        kv_len]``: a query attends only to keys with its own id (packed documents), on top of
        ``causal`` and ``window``.
        Tiles whose ids cannot meet are skipped while the kernels run (`kernels.segments`);
        ids in any order give the same results, increasing ids skip the most.
      window: None (the default), or an int ``W >= 1`` (causal only): a query attends to at most
        the ``W`` most recent keys, itself included: ``i + kv_len - q_len - j < W`` (Mistral's,
        Gemma's local attention; splash's ``LocalMask``). Blocks outside every row's window are
        not visited. ``W >= kv_len`` is the causal call.
      sm_scale: logit scale, default ``1 / sqrt(head_dim)``.
      block_q, block_k: rows of queries and of keys per block, default by target, TPU
        generation, head_dim and dtype (`kernels.platform.default_blocks`). GPU kernels and the
        generic interpreter: powers of two >= 16; Mosaic: multiples of 8 (TPU tiling). Shrunk
        to the length rounded up (to a power of two; to a multiple of 8) when larger.
      interpret: the target (`kernels.platform.choose_target`), from the devices the call is
        compiled for (the mesh's inside ``shard_map``, else the default backend's): None runs
        the Mosaic kernels on TPU, the Triton kernels on GPU and the generic Pallas interpreter
        on CPU; False compiles (TPU or GPU); True runs the generic interpreter (any backend);
        ``"tpu"`` runs the Mosaic kernels in TPU interpret mode (any backend: the tests).
      layout: ``"bshd"`` (the shapes above; the default) or ``"bhsd"``: q ``[batch, heads,
        q_len, head_dim]``, k and v ``[batch, kv_heads, kv_len, head_dim]``, out likewise. The
        Mosaic kernels' own layout (and JAX's TPU kernels'): no transpose is made around them.

    Returns:
      [batch, q_len, heads, head_dim] (``"bhsd"``: [batch, heads, q_len, head_dim]) in the dtype
      of q. Softmax statistics and all matmul accumulation are float32. A row that sees no key
      (``q_len > kv_len``, or a query id no key has) gives zeros and zero gradients (its lse, in
      `flash_attention_forward`, is ``-inf``). Differentiable in q, k and v: its forward and
      backward are the kernels of `flash_attention_forward` and `flash_attention_backward`.

    Raises:
      ValueError: before any kernel is traced, naming the shapes: arrays that are not 4-D, k and
        v of different shapes, a batch or head_dim q and k disagree on, ``heads`` not a multiple
        of ``kv_heads``, a dtype other than float32 or bfloat16 (or q, k, v of different
        dtypes), a head_dim the Triton kernels cannot take, bad segment ids, a window without
        ``causal``, a block size the target cannot take, or an unknown ``layout``.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from dew.kernels import flash_attention
        >>> q = jax.random.normal(jax.random.key(0), (2, 256, 8, 64), jnp.bfloat16)
        >>> k = v = jax.random.normal(jax.random.key(1), (2, 256, 2, 64), jnp.bfloat16)
        >>> out = flash_attention(q, k, v, causal=True, window=128)  # GQA: 4 query heads a kv head
        >>> out.shape, out.dtype
        ((2, 256, 8, 64), dtype(bfloat16))
    """
    q, k, v = _as_bshd(layout, q, k, v)
    config, ids = _config(
        q,
        k,
        v,
        causal=causal,
        sm_scale=sm_scale,
        block_q=block_q,
        block_k=block_k,
        interpret=interpret,
        segment_ids=segment_ids,
        window=window,
    )
    return _as_bshd(layout, _padded_attention(q, k, v, ids, config=config))[0]


def flash_attention_forward(
    q,
    k,
    v,
    *,
    causal: bool = True,
    segment_ids=None,
    window: int | None = None,
    sm_scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    interpret: bool | str | None = None,
    layout: str = "bshd",
):
    """`flash_attention` returning its softmax statistics too: ``(out, lse)``.

    Arguments as `flash_attention`'s. ``lse`` is float32 ``[batch, heads, q_len]``: the natural
    log of each query row's sum of ``exp(sm_scale * q . k)`` over the keys it sees, ``-inf`` for a
    row that sees none (its ``out`` is zeros). Attention over two disjoint sets of keys merges
    into attention over both: ``lse = logaddexp(lse1, lse2)``, ``out = exp(lse1 - lse) out1 +
    exp(lse2 - lse) out2`` (a ring attention's per-block step).

    Differentiable in q, k and v through both outputs (the cotangent of ``lse`` enters the
    backward kernels as ``delta - d_lse``). A ring attention that writes its own backward calls
    `flash_attention_backward` per block instead. Raises what `flash_attention` raises.

    Examples:
        >>> from dew.kernels import flash_attention_forward
        >>> out, lse = flash_attention_forward(q, k, v)  # q, k, v as in flash_attention's
        >>> lse.shape, lse.dtype
        ((2, 8, 256), dtype('float32'))
    """
    q, k, v = _as_bshd(layout, q, k, v)
    config, ids = _config(
        q,
        k,
        v,
        causal=causal,
        sm_scale=sm_scale,
        block_q=block_q,
        block_k=block_k,
        interpret=interpret,
        segment_ids=segment_ids,
        window=window,
    )
    out, lse = _padded_forward(q, k, v, ids, config=config)
    return _as_bshd(layout, out)[0], lse


def flash_attention_backward(
    q,
    k,
    v,
    out,
    lse,
    d_out,
    d_lse=None,
    *,
    causal: bool = True,
    segment_ids=None,
    window: int | None = None,
    sm_scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    interpret: bool | str | None = None,
    layout: str = "bshd",
):
    """The backward kernels of `flash_attention_forward`: ``(dq, dk, dv)`` for the cotangents
    ``d_out`` of ``out`` and ``d_lse`` of ``lse``.

    Args:
      q, k, v: the forward's inputs; causal, segment_ids, window, sm_scale, block_q, block_k,
        interpret: its arguments (a ring attention passes each block's ``(q_ids, kv_ids)``).
      out: ``[batch, q_len, heads, head_dim]``, q's dtype: the attention output.
      lse: float32 ``[batch, heads, q_len]``, natural log, ``-inf`` for rows that see no key.
      d_out: like ``out``: the cotangent of ``out``.
      d_lse: None (no cotangent on ``lse``, the same as zeros), or float32
        ``[batch, heads, q_len]``: the cotangent of the natural-log ``lse``. Its (finite) value
        on a row that sees no key is ignored (that row's probabilities are all 0).

    ``out`` and ``lse`` need not come from this call's keys: the probabilities are recomputed as
    ``p = exp(sm_scale * q . k - lse)`` and the logits' gradient as ``ds = p * (d_out . v -
    delta)`` with ``delta = rowsum(d_out * out) - d_lse`` (``d lse / d logit = p``), computed once
    in float32 for both kernels. So given the merged ``out`` and ``lse`` of attention over
    several blocks of keys and their cotangents, a call on one block returns that block's share of
    ``dq`` and its ``dk``, ``dv`` (ring attention's backward), ``d_lse``'s part included, in one
    pass of the two kernels.

    Returns:
      ``(dq, dk, dv)``, each with its input's shape and dtype.

    Raises:
      ValueError: what `flash_attention` raises, and ``out``, ``lse``, ``d_out`` or ``d_lse``
        whose shape or dtype is not the one above.

    Examples:
        >>> from dew.kernels import flash_attention_backward, flash_attention_forward
        >>> out, lse = flash_attention_forward(q, k, v)
        >>> dq, dk, dv = flash_attention_backward(q, k, v, out, lse, d_out=jnp.ones_like(out))
        >>> dk.shape == k.shape
        True
    """
    q, k, v, out, d_out = _as_bshd(layout, q, k, v, out, d_out)
    config, ids = _config(
        q,
        k,
        v,
        causal=causal,
        sm_scale=sm_scale,
        block_q=block_q,
        block_k=block_k,
        interpret=interpret,
        segment_ids=segment_ids,
        window=window,
    )
    _check_residuals(q, out, lse, d_out, d_lse)
    grads = _padded_backward(q, k, v, out, lse, d_out, d_lse, ids, config=config)
    return _as_bshd(layout, *grads)


LAYOUTS = ("bshd", "bhsd")


def _as_bshd(layout: str, *xs):
    """``layout`` "bhsd" arrays as "bshd" (and back: the swap is its own inverse); "bshd" ones as
    they are. Under jit the kernels' own swap to heads-major (`kernels.mosaic.heads_major`) and
    this one cancel: XLA folds a transpose of a transpose."""
    if layout not in LAYOUTS:
        raise ValueError(f"flash_attention: layout must be one of {LAYOUTS}; got {layout!r}")
    if layout == "bshd":
        return xs
    for x in xs:
        if len(getattr(x, "shape", ())) != 4:
            raise ValueError(
                f"flash_attention with layout 'bhsd' takes rank-4 arrays; got shape "
                f"{tuple(getattr(x, 'shape', ()))}"
            )
    return tuple(jnp.swapaxes(x, 1, 2) for x in xs)


def _check_residuals(q, out, lse, d_out, d_lse) -> None:
    batch, q_len, heads, _ = q.shape
    rows = ((batch, heads, q_len), np.dtype(jnp.float32))
    want = {
        "out": (tuple(q.shape), np.dtype(q.dtype)),
        "d_out": (tuple(q.shape), np.dtype(q.dtype)),
        "lse": rows,
        "d_lse": rows,
    }
    given = [("out", out), ("lse", lse), ("d_out", d_out)]
    if d_lse is not None:
        given.append(("d_lse", d_lse))
    for name, x in given:
        shape, dtype = want[name]
        got = (tuple(x.shape), np.dtype(x.dtype))
        if got != (shape, dtype):
            raise ValueError(
                f"flash_attention_backward: {name} must be {shape} {dtype.name} for q "
                f"{tuple(q.shape)} {np.dtype(q.dtype).name}; got {got[0]} {got[1].name}"
            )


def _pad_rows(x, rows: int):
    if x.shape[1] == rows:
        return x
    # lax.pad with a zero of x's own dtype: jnp.pad's fill is a Python 0, an int64 under x64,
    # and the program then holds no 64-bit value at all (tests/test_x64.py checks that).
    no_pad = (0, 0, 0)
    return lax.pad(x, jnp.zeros((), x.dtype), (no_pad, (0, rows - x.shape[1], 0), no_pad, no_pad))


def _pad_ids(ids, tiling: Tiling):
    """Segment ids ``(q_ids, kv_ids)`` padded to whole blocks (`kernels.segments.pad`), or None."""
    if ids is None:
        return None
    q_ids, kv_ids = ids
    return _segments.pad(q_ids, tiling.q_padded), _segments.pad(kv_ids, tiling.kv_padded)


def _varying(ids, *xs):
    """`match_varying` of ``xs`` and the segment ids (None or a pair): ``(xs, ids)``."""
    matched = match_varying(*xs, *(() if ids is None else ids))
    return matched[: len(xs)], (None if ids is None else tuple(matched[len(xs) :]))


@functools.partial(jax.jit, static_argnames=("config",))
def _padded_attention(q, k, v, ids, *, config: _Config):
    tiling = config.tiling
    (q, k, v), ids = _varying(ids, q, k, v)
    o = _attention(
        _pad_rows(q, tiling.q_padded),
        _pad_rows(k, tiling.kv_padded),
        _pad_rows(v, tiling.kv_padded),
        _pad_ids(ids, tiling),
        config,
    )
    return o[:, : tiling.q_len]


# Kernels' lse is base 2 of base-2 logits, +inf for rows that see no key (so the backward's
# exp2(s - lse) is exactly 0 there); the public lse is natural, -inf for those rows (so that a
# merge gives them weight 0).
LN_2 = math.log(2.0)


def _natural_lse(lse2):
    return jnp.where(lse2 == jnp.inf, -jnp.inf, lse2 * LN_2)


def _base2_lse(lse):
    return jnp.where(lse == -jnp.inf, jnp.inf, lse * _forward.LOG2_E)


def _run_forward(q, k, v, ids, config: _Config):
    # Only a call with segment ids passes them: the kernels' code without is as it was.
    extra = {} if ids is None else {"segment_ids": ids}
    if config.target in MOSAIC_TARGETS:
        return _mosaic_forward.forward(
            q,
            k,
            v,
            tiling=config.tiling,
            scale=config.scale,
            interpret=config.target == "mosaic_interpret",
            tuning=config.tuning,
            **extra,
        )
    return _forward.forward(
        q,
        k,
        v,
        tiling=config.tiling,
        scale=config.scale,
        interpret=config.target == "interpret",
        compiler_params=config.compiler_params(),
        **extra,
    )


def _run_backward(q, k, v, o, lse2, do, ids, config: _Config, d_lse=None):
    kwargs = dict(tiling=config.tiling, scale=config.scale, sm_scale=config.sm_scale, d_lse=d_lse)
    if ids is not None:
        kwargs["segment_ids"] = ids
    if config.target in MOSAIC_TARGETS:
        interpret = config.target == "mosaic_interpret"
        if _fused_backward_fits(q, k, config):
            return _mosaic_fused_backward.backward(
                q, k, v, o, lse2, do, interpret=interpret, tuning=config.tuning, **kwargs
            )
        return _mosaic_backward.backward(
            q, k, v, o, lse2, do, interpret=interpret, tuning=config.tuning, **kwargs
        )
    return _backward.backward(
        q,
        k,
        v,
        o,
        lse2,
        do,
        interpret=config.target == "interpret",
        compiler_params=config.compiler_params(),
        **kwargs,
    )


def _fused_backward_fits(q, k, config: _Config) -> bool:
    """The one-kernel Mosaic backward where its dq (all of a kv head's query rows, float32)
    fits in VMEM beside its working set and its step table fits in SMEM; else the two kernels."""
    group = q.shape[2] // k.shape[2]
    steps = len(_mosaic_fused_backward.backward_steps(config.tiling, group))
    if steps > MAX_STEPS:
        return False
    if config.segmented:  # its per-row tables in SMEM (`kernels.segments`)
        tiling = config.tiling
        pieces = tiling.kv_padded // config.tuning.backward_piece(tiling.block_k)
        entries = q.shape[0] * (steps + 2 * tiling.q_blocks + 2 * pieces)
        if entries > _segments.MAX_TABLE_ENTRIES:
            return False
    return _mosaic_fused_backward.fits(
        config.tiling, group, q.shape[3], q.dtype.itemsize, config.tuning
    )


# The names the forward's residuals carry, so that a remat policy can save them
# (``jax.checkpoint_policies.save_only_these_names``): with both saved, the backward does not run
# the forward kernel again (dew.models.causal_transformer's ``remat="attention"``; the same strings
# as dew.nn.attention.OUT_NAME and LSE_NAME, which this standalone package does not import).
OUT_NAME = "attention_out"
LSE_NAME = "attention_lse"


def _named_residuals(o, lse):
    return checkpoint_name(o, OUT_NAME), checkpoint_name(lse, LSE_NAME)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, ids, config: _Config):
    return _run_forward(q, k, v, ids, config)[0]


def _attention_fwd(q, k, v, ids, config: _Config):
    o, lse = _run_forward(q, k, v, ids, config)
    o, lse = _named_residuals(o, lse)
    return o, (q, k, v, o, lse, ids)


def _attention_bwd(config: _Config, residuals, do):
    q, k, v, o, lse, ids = residuals
    return (*_run_backward(q, k, v, o, lse, do, ids, config), None)


_attention.defvjp(_attention_fwd, _attention_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention_with_lse(q, k, v, ids, config: _Config):
    o, lse2 = _run_forward(q, k, v, ids, config)
    return o, _natural_lse(lse2)


def _attention_with_lse_fwd(q, k, v, ids, config: _Config):
    o, lse2 = _run_forward(q, k, v, ids, config)
    o, lse2 = _named_residuals(o, lse2)
    return (o, _natural_lse(lse2)), (q, k, v, o, lse2, ids)


def _attention_with_lse_bwd(config: _Config, residuals, cotangents):
    do, d_lse = cotangents
    q, k, v, o, lse2, ids = residuals
    return (*_run_backward(q, k, v, o, lse2, do, ids, config, d_lse=d_lse), None)


_attention_with_lse.defvjp(_attention_with_lse_fwd, _attention_with_lse_bwd)


@functools.partial(jax.jit, static_argnames=("config",))
def _padded_forward(q, k, v, ids, *, config: _Config):
    tiling = config.tiling
    (q, k, v), ids = _varying(ids, q, k, v)
    o, lse = _attention_with_lse(
        _pad_rows(q, tiling.q_padded),
        _pad_rows(k, tiling.kv_padded),
        _pad_rows(v, tiling.kv_padded),
        _pad_ids(ids, tiling),
        config,
    )
    return o[:, : tiling.q_len], lse[:, :, : tiling.q_len]


@functools.partial(jax.jit, static_argnames=("config",))
def _padded_backward(q, k, v, o, lse, do, d_lse, ids, *, config: _Config):
    tiling = config.tiling
    if d_lse is None:
        (q, k, v, o, lse, do), ids = _varying(ids, q, k, v, o, lse, do)
    else:
        (q, k, v, o, lse, do, d_lse), ids = _varying(ids, q, k, v, o, lse, do, d_lse)
        # Padded query rows: p = 0 there whatever d_lse is; zeros keep delta finite.
        d_lse = _pad_row_stats(d_lse, tiling, 0.0)
    # Padded query rows get lse = +inf: p = exp2(s - inf) = 0, they add nothing to dk, dv.
    lse2 = _pad_row_stats(_base2_lse(lse), tiling, jnp.inf)
    dq, dk, dv = _run_backward(
        _pad_rows(q, tiling.q_padded),
        _pad_rows(k, tiling.kv_padded),
        _pad_rows(v, tiling.kv_padded),
        _pad_rows(o, tiling.q_padded),
        lse2,
        _pad_rows(do, tiling.q_padded),
        _pad_ids(ids, tiling),
        config,
        d_lse=d_lse,
    )
    return dq[:, : tiling.q_len], dk[:, : tiling.kv_len], dv[:, : tiling.kv_len]


def _pad_row_stats(x, tiling: Tiling, fill: float):
    """Per-row statistics ``[batch, heads, q_len]`` -> ``[batch, heads, q_padded]``, the padded
    rows set to ``fill``."""
    if tiling.q_padded == tiling.q_len:
        return x
    pad = (0, tiling.q_padded - tiling.q_len, 0)
    return lax.pad(x, jnp.array(fill, x.dtype), ((0, 0, 0), (0, 0, 0), pad))
