"""Causal multi-head self-attention with grouped queries, and the attention functions it can use.

Attention functions take ``(q, k, v, *, causal, segment_ids=None, window=None)`` and return
``(out, lse)``: the output and the log-sum-exp of each query's logits, so that partial softmaxes
over blocks of keys can be merged (``"cudnn"`` returns ``lse=None``: cuDNN's statistics have no
gradient path, see ``resolve``; it refuses segment ids). ``segment_ids`` and ``window`` are
``dew.kernels.flash_attention``'s.

``CHOICES`` are the values of a model's ``attention_impl``: the functions of ``IMPLEMENTATIONS`` and
``"auto"``, which ``resolve`` turns into one of them for the devices a step is compiled for.

Each function names its output ``OUT_NAME`` (and the Pallas kernels their lse ``LSE_NAME``) with
``jax.ad_checkpoint.checkpoint_name``, so that a remat policy can save them (the model's
``remat="attention"``).

Weights: ``q`` ``[embed, heads, head_dim]``, ``k`` and ``v`` ``[embed, kv_heads, head_dim]``,
``o`` ``[heads, head_dim, embed]``. Heads are a dimension of their own so a layout can split them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from dew.nn import rotary
from dew.nn.param import PLAIN, Param, Projections, normal

# The residuals' names (the Pallas kernels and the ring use the same strings).
OUT_NAME = "attention_out"
LSE_NAME = "attention_lse"


def xla_attention(q, k, v, *, causal: bool = True, segment_ids=None, window=None):
    """Plain-JAX attention, with the log-sum-exp of each query's logits.

    ``q``: ``[batch, q_len, heads, d]``; ``k``, ``v``: ``[batch, kv_len, kv_heads, d]``.

    Softmax in float32 over the logits ``q . k / sqrt(d)`` (masked to keys ``j <= i`` when
    ``causal``); a query head ``h`` attends with kv head ``h // (heads // kv_heads)``, without
    repeating K/V in memory. ``segment_ids`` (None, int32 ``[batch, seq]``, or a pair
    ``(q_ids, kv_ids)``) keeps each query to the keys of its own id, ``window`` (causal only) to
    keys ``i - j < window``: ``dew.kernels.flash_attention``'s masks. A row that sees no key
    gives zeros and ``lse = -inf``, and no gradient.

    Returns:
      ``(out, lse)``: ``out`` ``[batch, q_len, heads, d]`` in ``q``'s dtype, and ``lse`` float32
      ``[batch, heads, q_len]``, the natural log of each row's sum of exponentiated (masked) logits.
      Two calls on disjoint sets of keys merge into the call on all of them:
      ``lse = logaddexp(lse1, lse2)``, ``out = exp(lse1 - lse) out1 + exp(lse2 - lse) out2`` (with
      ``lse`` broadcast over ``d``), which is what ring attention does block by block.
    """
    b, s, h, d = q.shape
    kv_heads = k.shape[2]
    groups = h // kv_heads
    qg = q.reshape(b, s, kv_heads, groups, d)
    logits = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=jnp.float32)
    logits = logits / math.sqrt(d)
    if causal:
        mask = jnp.tril(jnp.ones((s, k.shape[1]), bool))
        logits = jnp.where(mask, logits, -jnp.inf)
    if segment_ids is None and window is None:
        # jax.nn.softmax rather than exp(logits - lse): the output keeps the bits it always had.
        weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
        lse = jax.nn.logsumexp(logits, axis=-1)
    else:
        weights, lse = _masked_softmax(logits, _visible(segment_ids, window, causal, s, k.shape[1]))
        weights = weights.astype(v.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", weights, v, preferred_element_type=jnp.float32)
    lse = lse.reshape(b, h, s)
    out = out.reshape(b, s, h, d).astype(q.dtype)
    return checkpoint_name(out, OUT_NAME), checkpoint_name(lse, LSE_NAME)


def _visible(segment_ids, window, causal: bool, q_len: int, kv_len: int):
    """bool, broadcastable to the logits ``[batch, kv_heads, group, q_len, kv_len]``: same ids,
    within the window (as the causal mask here: query ``i`` at position ``i``)."""
    if window is not None and not causal:
        raise ValueError(f"xla_attention: window={window} needs causal=True")
    visible = jnp.ones((1, 1, 1, q_len, kv_len), bool)
    if window is not None:
        gap = jnp.arange(q_len)[:, None] - jnp.arange(kv_len)[None, :]
        visible = visible & (gap < window)
    if segment_ids is not None:
        q_ids, kv_ids = (
            segment_ids if isinstance(segment_ids, (tuple, list)) else (segment_ids,) * 2
        )
        visible = visible & (q_ids[:, None, None, :, None] == kv_ids[:, None, None, None, :])
    return visible


def _masked_softmax(logits, visible):
    """``(weights, lse)`` of logits masked to ``visible``, with zeros (and ``lse = -inf``, no
    gradient) on rows that see no key, where softmax would give NaN."""
    logits = jnp.where(visible, logits, -jnp.inf)
    sees = jnp.any(logits > -jnp.inf, axis=-1, keepdims=True)
    safe = jnp.where(sees, logits, 0.0)
    weights = jnp.where(sees, jax.nn.softmax(safe, axis=-1), 0.0)
    lse = jnp.where(sees[..., 0], jax.nn.logsumexp(safe, axis=-1), -jnp.inf)
    return weights, lse


def pallas_attention(
    q, k, v, *, causal: bool = True, segment_ids=None, window=None, interpret=None
):
    """Dew's Pallas flash attention kernel (``dew.kernels.flash_attention_forward``), on this
    device's local shard: ``(out, lse)`` as ``xla_attention`` returns them, both
    differentiable. The kernels follow the devices the step is compiled for (the mesh's): Mosaic
    on TPU, Triton on GPU, the Pallas interpreter on CPU (``interpret``: as the kernel's)."""
    from dew.kernels import flash_attention_forward

    return flash_attention_forward(
        q, k, v, causal=causal, segment_ids=segment_ids, window=window, interpret=interpret
    )


def pallas_tpu_interpret_attention(q, k, v, *, causal: bool = True, segment_ids=None, window=None):
    """``pallas_attention`` with the Mosaic TPU kernels in TPU interpret mode, on any backend:
    the TPU code path, run on CPU (slow; for tests)."""
    return pallas_attention(
        q, k, v, causal=causal, segment_ids=segment_ids, window=window, interpret="tpu"
    )


def cudnn_attention(q, k, v, *, causal: bool = True, segment_ids=None, window=None):
    """cuDNN's fused flash attention, ``jax.nn.dot_product_attention(..., implementation="cudnn")``:
    GPU only, bfloat16 or float16, head_dim a multiple of 8 up to ``CUDNN_MAX_HEAD_DIM``. A
    ``window`` is cuDNN's sliding window (``local_window_size=(window - 1, 0)``: the ``window``
    most recent keys, the query's own included). ``segment_ids`` are refused (a ``ValueError``):
    JAX 0.10.2's ``jax.nn.dot_product_attention`` takes none (only per-row lengths; its private
    cuDNN module's packed layout wants sorted ids and a static document count).

    Returns ``(out, None)``: cuDNN's softmax statistics come without a gradient path for them, so
    a caller that needs the lse (ring attention, which merges blocks) cannot use it; ``resolve``
    refuses that pairing before anything is compiled."""
    if segment_ids is not None:
        raise ValueError(f"attention_impl 'cudnn' cannot run this call: {CUDNN_NO_SEGMENTS}")
    window_size = None if window is None else (window - 1, 0)
    out = jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, local_window_size=window_size, implementation="cudnn"
    )
    return checkpoint_name(out, OUT_NAME), None


IMPLEMENTATIONS = {
    "xla": xla_attention,
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
    impl: str, platform: str, dtype, head_dim: int, needs_lse: bool = False, segmented: bool = False
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

    ``"auto"``: on TPU the Mosaic Pallas kernels; on GPU cuDNN where it takes the call
    (``cudnn_refusal`` is ``None``), else the Triton Pallas kernels where they take it (float32 or
    bfloat16, head_dim a power of two from 16 to 256), else XLA; XLA on CPU (and wherever the
    kernels do not take the dtype). Any other name is returned as is, except ``"cudnn"`` where
    cuDNN cannot run the call: a ``ValueError`` saying why, raised while tracing, before anything
    is compiled.
    """
    if impl not in CHOICES:
        raise ValueError(f"unknown attention_impl {impl!r}; expected one of {', '.join(CHOICES)}")
    refusal = cudnn_refusal(platform, dtype, head_dim, needs_lse, segmented)
    if impl == "cudnn" and refusal is not None:
        raise ValueError(f"attention_impl 'cudnn' cannot run this step: {refusal}")
    if impl != "auto":
        return impl
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
    attend=xla_attention,
    *,
    rope_theta: float = rotary.DEFAULT_THETA,
    rope_scaling: rotary.Llama3Scaling | None = None,
    projections: Projections = PLAIN,
) -> jax.Array:
    """``x``: ``[batch, seq, embed]`` -> ``[batch, seq, embed]``, causal, rotary positions.

    ``positions``: ``[seq]``, the global positions of ``x``'s tokens. ``attend``: an attention
    function ``(q, k, v, *, causal) -> (out, lse)`` (``IMPLEMENTATIONS``, or one spanning a
    sequence axis, ``dew.parallel.sequence.attention``). ``rope_theta``, ``rope_scaling``: the
    rotary frequencies (``dew.nn.rotary``); q and k are rotated here, before ``attend``, so a
    sequence split rotates each device's positions by the same frequencies. ``projections``: how
    ``q``, ``k``, ``v`` (columns, one input) and ``o`` (the row) run (``dew.nn.param.Projections``;
    a tensor region's, ``dew.parallel.tensor_ring.Region``, may take ``x`` as this device's
    positions and return them).
    """
    rope = dict(base=rope_theta, scaling=rope_scaling)
    q, k, v = projections.columns("bse,ehd->bshd", x, (p["q"], p["k"], p["v"]))
    q = rotary.rotate(q, positions, **rope)
    k = rotary.rotate(k, positions, **rope)
    out, _ = attend(q, k, v, causal=True)
    return projections.row("bshd,hde->bse", out, p["o"])
