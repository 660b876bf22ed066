"""Causal multi-head self-attention with grouped queries, and the attention functions it can use.

Attention functions take ``(q, k, v, *, causal, segment_ids=None, window=None)`` in the model's
layout, ``LAYOUT = "bhsd"`` (q ``[batch, heads, seq, head_dim]``, k and v ``[batch, kv_heads,
seq, head_dim]``: the Pallas kernels' own layout, so no transpose sits around them), and return
``(out, lse)``: the output (``[batch, heads, seq, head_dim]``) and the log-sum-exp of each
query's logits (``[batch, heads, seq]``), so that partial softmaxes over blocks of keys can be
merged (``"cudnn"`` returns ``lse=None``: cuDNN's statistics have no gradient path, see
``resolve``). ``segment_ids``: ``None``, int32 ``[batch, seq]`` (self-attention), or a pair
``(q_ids [batch, q_len], kv_ids [batch, kv_len])``: a query attends only to keys of its own id
(packed documents). ``window``: ``None`` or ``W >= 1``: a query attends to at most the ``W`` most
recent keys, itself included (sliding-window attention). Both combine with ``causal``. They are
passed on only when set, so an attention function without them still runs a model without them.

``CHOICES`` are the values of a model's ``attention_impl``: the functions of ``IMPLEMENTATIONS`` and
``"auto"``, which ``resolve`` turns into one of them for the devices a step is compiled for.

Each function names its output ``OUT_NAME`` (and the Pallas kernels their lse ``LSE_NAME``) with
``jax.ad_checkpoint.checkpoint_name``, and ``self_attention`` names the rotated q and k
``ROTATED_NAME``, so that a remat policy can save them (the model's ``remat="attention"``).

Weights: ``q`` ``[embed, heads, head_dim]``, ``k`` and ``v`` ``[embed, kv_heads, head_dim]``,
``o`` ``[heads, head_dim, embed]``. Heads are a dimension of their own so a layout can split them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from dew.nn import rotary
from dew.nn.param import PLAIN, Param, Projections, normal

# The residuals' names (the Pallas kernels and the ring use the same strings).
OUT_NAME = "attention_out"
LSE_NAME = "attention_lse"
ROTATED_NAME = "attention_rotated"  # q and k after the rotation: what the attention call takes
# The model's attention layout: the kernels' own (``dew.kernels``' ``layout="bhsd"``).
LAYOUT = "bhsd"
LAYOUTS = rotary.LAYOUTS  # what xla_attention takes: the layouts rotary rotates


def segment_pair(segment_ids):
    """``(q_ids, kv_ids)`` int32 ``[batch, len]`` of ``segment_ids`` (one array for
    self-attention, or the pair), or ``None``."""
    if segment_ids is None:
        return None
    if isinstance(segment_ids, (tuple, list)):
        q_ids, kv_ids = segment_ids
    else:
        q_ids = kv_ids = segment_ids
    return jnp.asarray(q_ids, jnp.int32), jnp.asarray(kv_ids, jnp.int32)


def check_window(window) -> None:
    """ValueError naming ``window`` unless it is ``None`` or an integer ``>= 1``."""
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1
    ):
        raise ValueError(
            f"window must be None or an integer >= 1 (the keys a query sees), got {window!r}"
        )


def visible(q_len: int, kv_len: int, *, causal: bool, segment_ids=None, window=None):
    """bool ``[batch or 1, q_len, kv_len]``: which keys each query attends to. ``causal``: keys
    ``j <= i + kv_len - q_len`` (the kernels' bottom-right alignment; the lower triangle when the
    lengths are equal); ``window`` ``W``: keys ``j > i + kv_len - q_len - W`` as well (the ``W``
    most recent, the query's own included); ``segment_ids``: keys of the query's id. ``None``
    where nothing is masked."""
    check_window(window)
    if window is not None and not causal:
        raise ValueError(f"attention: window={window} needs causal=True")
    i = jnp.arange(q_len)[:, None] + (kv_len - q_len)
    j = jnp.arange(kv_len)[None, :]
    mask = None
    if causal:
        mask = j <= i
    if window is not None:
        near = j > i - window
        mask = near if mask is None else mask & near
    mask = None if mask is None else mask[None]
    pair = segment_pair(segment_ids)
    if pair is not None:
        same = pair[0][:, :, None] == pair[1][:, None, :]
        mask = same if mask is None else mask & same
    return mask


def xla_attention(
    q, k, v, *, causal: bool = True, segment_ids=None, window=None, layout: str = "bshd"
):
    """Plain-JAX attention, with the log-sum-exp of each query's logits.

    ``layout="bshd"``: ``q`` ``[batch, q_len, heads, d]``; ``k``, ``v`` ``[batch, kv_len,
    kv_heads, d]``; ``"bhsd"`` (the model's, ``LAYOUT``): ``q`` ``[batch, heads, q_len, d]``, ``k``,
    ``v`` ``[batch, kv_heads, kv_len, d]``. The einsums read either directly: no transpose.

    Softmax in float32 over the logits ``q . k / sqrt(d)``, masked by ``visible`` (``causal``,
    ``window``, ``segment_ids``: the module doc); a query head ``h`` attends with kv head
    ``h // (heads // kv_heads)``, without repeating K/V in memory. A query that sees no key (only
    possible with a pair of segment ids) gets zeros, ``lse = -inf`` and zero gradients, as the
    kernels give.

    Returns:
      ``(out, lse)``: ``out`` like ``q``, in ``q``'s dtype, and ``lse`` float32
      ``[batch, heads, q_len]``, the natural log of each row's sum of exponentiated (masked) logits.
      Two calls on disjoint sets of keys merge into the call on all of them:
      ``lse = logaddexp(lse1, lse2)``, ``out = exp(lse1 - lse) out1 + exp(lse2 - lse) out2`` (with
      ``lse`` broadcast over ``d``), which is what ring attention does block by block.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"xla_attention: layout must be one of {LAYOUTS}; got {layout!r}")
    q_len, kv_len = (q.shape[1], k.shape[1]) if layout == "bshd" else (q.shape[2], k.shape[2])
    mask = visible(q_len, kv_len, causal=causal, segment_ids=segment_ids, window=window)
    # Without segment ids or a window every row sees a key: the plain softmax, whose bits the
    # output always had.
    plain = segment_ids is None and window is None
    out, lse = masked_attention(q, k, v, mask, layout=layout, every_row_sees_a_key=plain)
    return checkpoint_name(out, OUT_NAME), checkpoint_name(lse, LSE_NAME)


def masked_attention(q, k, v, mask, *, layout: str = LAYOUT, every_row_sees_a_key: bool = False):
    """``(out, lse)`` of attention whose visible pairs are ``mask`` (bool ``[batch or 1, q_len,
    kv_len]``, or ``None``: all), in ``layout``: ``xla_attention``'s computation for a mask made
    elsewhere (the ring's blocks make theirs from global positions). A row that sees no key gives
    zeros and ``lse = -inf`` with zero gradients; ``every_row_sees_a_key=True`` promises it
    cannot happen and takes ``jax.nn.softmax``."""
    heads_at = 2 if layout == "bshd" else 1
    b, h, d = q.shape[0], q.shape[heads_at], q.shape[3]
    s = q.shape[3 - heads_at]
    kv_heads = k.shape[heads_at]
    groups = h // kv_heads
    if layout == "bshd":
        qg = q.reshape(b, s, kv_heads, groups, d)
        scores, mix = "bqkgd,bskd->bkgqs", "bkgqs,bskd->bqkgd"
    else:
        qg = q.reshape(b, kv_heads, groups, s, d)
        scores, mix = "bkgqd,bksd->bkgqs", "bkgqs,bksd->bkgqd"
    logits = jnp.einsum(scores, qg, k, preferred_element_type=jnp.float32)
    logits = logits / math.sqrt(d)
    if mask is not None:
        logits = jnp.where(mask[:, None, None], logits, -jnp.inf)
    if every_row_sees_a_key:
        weights = jax.nn.softmax(logits, axis=-1)
        lse = jax.nn.logsumexp(logits, axis=-1)
    else:
        peak = jnp.max(logits, axis=-1, keepdims=True)
        peak = lax.stop_gradient(jnp.where(jnp.isfinite(peak), peak, 0.0))
        exps = jnp.exp(logits - peak)
        total = jnp.sum(exps, axis=-1, keepdims=True)
        seen = total > 0
        safe = jnp.where(seen, total, 1.0)  # no log(0), no 0 * inf in the gradient
        weights = exps / safe
        lse = jnp.where(seen, jnp.log(safe) + peak, -jnp.inf)[..., 0]
    out = jnp.einsum(mix, weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(q.shape).astype(q.dtype), lse.reshape(b, h, s)


def _set(**kwargs) -> dict:
    """The keyword arguments that are set (not ``None``): a kernel without segment ids or
    windows is then called as before they existed."""
    return {name: value for name, value in kwargs.items() if value is not None}


def pallas_attention(
    q, k, v, *, causal: bool = True, segment_ids=None, window=None, interpret=None
):
    """Dew's Pallas flash attention kernel (``dew.kernels.flash_attention_forward``,
    ``layout="bhsd"``), on this device's local shard: ``(out, lse)`` as ``xla_attention``
    returns them, both differentiable. The kernels follow the devices the step is compiled for
    (the mesh's): Mosaic on TPU, Triton on GPU, the Pallas interpreter on CPU (``interpret``: as
    the kernel's). ``segment_ids`` and ``window`` go to the kernels, which skip the blocks they
    mask wholly."""
    from dew.kernels import flash_attention_forward

    return flash_attention_forward(
        q,
        k,
        v,
        causal=causal,
        interpret=interpret,
        layout=LAYOUT,
        **_set(segment_ids=segment_ids, window=window),
    )


def pallas_tpu_interpret_attention(q, k, v, *, causal: bool = True, segment_ids=None, window=None):
    """``pallas_attention`` with the Mosaic TPU kernels in TPU interpret mode, on any backend:
    the TPU code path, run on CPU (slow; for tests)."""
    return pallas_attention(
        q, k, v, causal=causal, segment_ids=segment_ids, window=window, interpret="tpu"
    )


def cudnn_attention(q, k, v, *, causal: bool = True, segment_ids=None, window=None):
    """cuDNN's fused flash attention, ``jax.nn.dot_product_attention(..., implementation="cudnn")``:
    GPU only, bfloat16 or float16, head_dim a multiple of 8 up to ``CUDNN_MAX_HEAD_DIM``.

    JAX's public API takes ``[batch, seq, heads, d]`` only, so this one path transposes the
    model's ``bhsd`` arrays in and out. A ``window`` is cuDNN's sliding window
    (``local_window_size=(window - 1, 0)``: the ``window`` most recent keys, the query's own
    included). ``segment_ids`` are refused (a ``ValueError``): JAX 0.10.2's
    ``jax.nn.dot_product_attention`` takes none (only per-row lengths; its private cuDNN module's
    packed layout wants sorted ids and a static document count).

    Returns ``(out, None)``: cuDNN's softmax statistics come without a gradient path for them, so
    a caller that needs the lse (ring attention, which merges blocks) cannot use it; ``resolve``
    refuses that pairing before anything is compiled."""
    if segment_ids is not None:
        raise ValueError(f"attention_impl 'cudnn' cannot run this call: {CUDNN_NO_SEGMENTS}")
    local = None if window is None else (window - 1, 0)
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    out = jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, local_window_size=local, implementation="cudnn"
    )
    return checkpoint_name(jnp.swapaxes(out, 1, 2), OUT_NAME), None


def model_xla_attention(q, k, v, *, causal: bool = True, segment_ids=None, window=None):
    """``xla_attention`` in the model's layout (``LAYOUT``)."""
    return xla_attention(
        q, k, v, causal=causal, segment_ids=segment_ids, window=window, layout=LAYOUT
    )


# The model's attention functions, each in its layout (``LAYOUT``).
IMPLEMENTATIONS = {
    "xla": model_xla_attention,
    "pallas": pallas_attention,
    "pallas_tpu_interpret": pallas_tpu_interpret_attention,
    "cudnn": cudnn_attention,
}
# What ``attention_impl`` takes: an implementation, or "auto" (``resolve``).
CHOICES = (*IMPLEMENTATIONS, "auto")

# What cuDNN's flash attention takes through JAX (its cudnn fused_attention_stablehlo module:
# half-precision inputs, head_dim a multiple of 8, at most 128 before Hopper and 256 from it; 128
# here, which every cuDNN-capable GPU takes, so the rule needs no device kind).
CUDNN_DTYPES = ("bfloat16", "float16")
CUDNN_MAX_HEAD_DIM = 128
CUDNN_NO_SEGMENTS = (
    "jax.nn.dot_product_attention (JAX 0.10.2) takes no segment ids for packed documents "
    "(use attention 'pallas' or 'auto', which runs the Pallas kernels with them)"
)


def cudnn_refusal(
    platform: str, dtype, head_dim: int, needs_lse: bool = False, segmented: bool = False
) -> str | None:
    """Why cuDNN attention cannot run this call (a sentence naming the values), or ``None``."""
    if platform != "gpu":
        return f"it runs on GPU only, and this step is compiled for {platform!r} devices"
    name = np.dtype(dtype).name
    if name not in CUDNN_DTYPES:
        return f"it takes {' or '.join(CUDNN_DTYPES)} activations, not {name}"
    if head_dim % 8 or head_dim > CUDNN_MAX_HEAD_DIM:
        return f"it takes head_dim a multiple of 8 up to {CUDNN_MAX_HEAD_DIM}, not {head_dim}"
    if needs_lse:
        return (
            "ring attention merges blocks by their log-sum-exp, which cuDNN attention does not "
            "give a gradient for (use sequence_scheme='all_to_all', or attention 'pallas' or "
            "'auto', which runs the Pallas kernels on a ring)"
        )
    if segmented:
        return CUDNN_NO_SEGMENTS
    return None


def _pallas_fits(platform: str, dtype, head_dim: int) -> bool:
    from dew.kernels.attention import SUPPORTED_DTYPES, TRITON_HEAD_DIMS

    if np.dtype(dtype) not in SUPPORTED_DTYPES:
        return False
    return platform != "gpu" or head_dim in TRITON_HEAD_DIMS


def resolve(
    impl: str,
    platform: str,
    dtype,
    head_dim: int,
    needs_lse: bool = False,
    segmented: bool = False,
    windowed_ring: bool = False,
) -> str:
    """The implementation (a key of ``IMPLEMENTATIONS``) a choice runs as; pure, for tests.

    Args:
      impl: a name in ``CHOICES``.
      platform: what the step is compiled for: ``"cpu"``, ``"gpu"`` or ``"tpu"``
        (``dew.parallel.ragged.compiled_platform()`` inside the step).
      dtype: the activations' (q, k, v's) dtype; head_dim: their last dimension.
      needs_lse: the call merges blocks by their log-sum-exp (ring attention over a sequence
        axis above 1).
      segmented: the call takes segment ids (packed documents), which cuDNN does not.
      windowed_ring: the call is a ring's with a sliding window longer than a zigzag chunk,
        whose blocks only XLA's take (``dew.parallel.sequence.window_refusal``; a window within
        a chunk runs as a halo exchange, with any attention).

    ``"auto"``: on TPU the Mosaic Pallas kernels; on GPU cuDNN where it takes the call
    (``cudnn_refusal`` is ``None``), else the Triton Pallas kernels where they take it (float32 or
    bfloat16, head_dim a power of two from 16 to 256), else XLA; XLA on CPU, wherever the kernels
    do not take the dtype, and on a ring with a window beyond a chunk. Any other name is returned
    as is, except ``"cudnn"`` where cuDNN cannot run the call: a ``ValueError`` saying why, raised
    while tracing, before anything is compiled.
    """
    if impl not in CHOICES:
        raise ValueError(f"unknown attention_impl {impl!r}; expected one of {', '.join(CHOICES)}")
    refusal = cudnn_refusal(platform, dtype, head_dim, needs_lse, segmented)
    if impl == "cudnn" and refusal is not None:
        raise ValueError(f"attention_impl 'cudnn' cannot run this step: {refusal}")
    if impl != "auto":
        return impl
    if windowed_ring:
        return "xla"
    if platform == "gpu" and refusal is None:
        return "cudnn"
    if platform in ("gpu", "tpu") and _pallas_fits(platform, dtype, head_dim):
        return "pallas"
    return "xla"


def attention_params(
    features: int, heads: int, kv_heads: int, head_dim: int, out_scale: float
) -> dict:
    std = 1.0 / math.sqrt(features)
    return {
        "q": Param((features, heads, head_dim), ("embed", "heads", "head_dim"), normal(std)),
        "k": Param((features, kv_heads, head_dim), ("embed", "kv_heads", "head_dim"), normal(std)),
        "v": Param((features, kv_heads, head_dim), ("embed", "kv_heads", "head_dim"), normal(std)),
        "o": Param(
            (heads, head_dim, features),
            ("heads", "head_dim", "embed"),
            normal(out_scale / math.sqrt(heads * head_dim)),
        ),
    }


def self_attention(
    p: dict,
    x: jax.Array,
    positions: jax.Array,
    attend=model_xla_attention,
    *,
    rope_theta: float = rotary.DEFAULT_THETA,
    rope_scaling: rotary.Llama3Scaling | None = None,
    segment_ids: jax.Array | None = None,
    window: int | None = None,
    projections: Projections = PLAIN,
) -> jax.Array:
    """``x``: ``[batch, seq, embed]`` -> ``[batch, seq, embed]``, causal, rotary positions.

    ``positions``: the rotary positions of ``x``'s tokens, ``[seq]`` (every row alike: their
    global positions) or ``[batch, seq]`` (per row: packed documents). ``attend``: an attention
    function in the model's layout (``IMPLEMENTATIONS``, or one spanning a sequence axis,
    ``dew.parallel.sequence.attention``). ``rope_theta``, ``rope_scaling``: the rotary
    frequencies (``dew.nn.rotary``); q and k are rotated here, before ``attend``, so a sequence
    split rotates each device's positions by the same frequencies. ``segment_ids`` (int32
    ``[batch, seq]``) and ``window``: passed to ``attend`` when set (the module doc).
    ``projections``: how ``q``, ``k``, ``v`` (columns, one input) and ``o`` (the row) run
    (``dew.nn.param.Projections``; a tensor region's, ``dew.parallel.tensor_ring.Region``, may
    take ``x`` as this device's positions and return them).

    The projections write the kernels' layout directly (``bse,ehd->bhsd``), the rotation applies
    there, and the output projection reads it (``bhsd,hde->bse``): no transpose of q, k, v or the
    output around the attention call.
    """
    rope = dict(base=rope_theta, scaling=rope_scaling, layout=LAYOUT)
    q, k, v = projections.columns("bse,ehd->bhsd", x, (p["q"], p["k"], p["v"]))
    q = checkpoint_name(rotary.rotate(q, positions, **rope), ROTATED_NAME)
    k = checkpoint_name(rotary.rotate(k, positions, **rope), ROTATED_NAME)
    out, _ = attend(q, k, v, causal=True, **_set(segment_ids=segment_ids, window=window))
    return projections.row("bhsd,hde->bse", out, p["o"])
