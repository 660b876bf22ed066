"""Causal multi-head self-attention with grouped queries, and the attention functions it can use.

Attention functions take ``(q, k, v, *, causal)`` and return ``(out, lse)``: the output and the
log-sum-exp of each query's logits, so that partial softmaxes over blocks of keys can be merged.

Weights: ``q`` ``[embed, heads, head_dim]``, ``k`` and ``v`` ``[embed, kv_heads, head_dim]``,
``o`` ``[heads, head_dim, embed]``. Heads are a dimension of their own so a layout can split them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from dew.nn import rotary
from dew.nn.param import Param, normal


def xla_attention(q, k, v, *, causal: bool = True):
    """Plain-JAX attention, with the log-sum-exp of each query's logits.

    ``q``: ``[batch, q_len, heads, d]``; ``k``, ``v``: ``[batch, kv_len, kv_heads, d]``.

    Softmax in float32 over the logits ``q . k / sqrt(d)`` (masked to keys ``j <= i`` when
    ``causal``); a query head ``h`` attends with kv head ``h // (heads // kv_heads)``, without
    repeating K/V in memory.

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
    # jax.nn.softmax rather than exp(logits - lse): the output keeps the bits it always had.
    weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", weights, v, preferred_element_type=jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1).reshape(b, h, s)
    return out.reshape(b, s, h, d).astype(q.dtype), lse


def pallas_attention(q, k, v, *, causal: bool = True, interpret=None):
    """Dew's Pallas flash attention kernel (``dew.kernels.flash_attention_forward``), on this
    device's local shard: ``(out, lse)`` as ``xla_attention`` returns them, both
    differentiable. The kernels follow the devices the step is compiled for (the mesh's): Mosaic
    on TPU, Triton on GPU, the Pallas interpreter on CPU (``interpret``: as the kernel's)."""
    from dew.kernels import flash_attention_forward

    return flash_attention_forward(q, k, v, causal=causal, interpret=interpret)


def pallas_tpu_interpret_attention(q, k, v, *, causal: bool = True):
    """``pallas_attention`` with the Mosaic TPU kernels in TPU interpret mode, on any backend:
    the TPU code path, run on CPU (slow; for tests)."""
    return pallas_attention(q, k, v, causal=causal, interpret="tpu")


IMPLEMENTATIONS = {
    "xla": xla_attention,
    "pallas": pallas_attention,
    "pallas_tpu_interpret": pallas_tpu_interpret_attention,
}


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


def self_attention(p: dict, x: jax.Array, positions: jax.Array, attend=xla_attention) -> jax.Array:
    """``x``: ``[batch, seq, embed]`` -> ``[batch, seq, embed]``, causal, rotary positions.

    ``positions``: ``[seq]``, the global positions of ``x``'s tokens. ``attend``: an attention
    function ``(q, k, v, *, causal) -> (out, lse)`` (``IMPLEMENTATIONS``, or one spanning a
    sequence axis, ``dew.parallel.sequence.attention``).
    """
    q = rotary.rotate(jnp.einsum("bse,ehd->bshd", x, p["q"].astype(x.dtype)), positions)
    k = rotary.rotate(jnp.einsum("bse,ehd->bshd", x, p["k"].astype(x.dtype)), positions)
    v = jnp.einsum("bse,ehd->bshd", x, p["v"].astype(x.dtype))
    out, _ = attend(q, k, v, causal=True)
    return jnp.einsum("bshd,hde->bse", out, p["o"].astype(x.dtype))
