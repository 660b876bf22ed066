"""The cached forward of a ``CausalTransformer``: a prompt prefilled into a KV cache, then one
token at a time read against it (``dew.generation`` samples from it).

The cache is fixed in size: ``k`` and ``v`` ``[layers, rows, kv_heads, length, head_dim]``, in the
activations' dtype and the attention kernels' layout (``bhsd``, one layer at a time). Each row's
prompt is left-padded to the same ``prompt`` slots, so a row's tokens hold the slots
``pad, pad + 1, ...`` and every row writes its ``t``-th new token at the one slot ``prompt + t``;
a token's rotary position is its slot less its row's padding (so a prompt starts at position 0,
as it would alone). A query sees the keys of its own row from its ``pad`` slot up to its own slot
(and, with ``attention_window`` ``W``, only the ``W`` most recent): never a padding slot, never a
slot not yet written.

``prefill`` runs the prompt through the layers with the model's own attention (``attention_for``:
the Pallas kernels where the model's ``attention_impl`` takes them; ``"auto"``'s choice for a
model trained with cuDNN, which takes no segment ids), the padding a segment of its own that no
prompt token attends to, and writes every layer's rotated ``k`` and ``v`` into the
cache; ``decode`` runs one new token a row, writing its ``k`` and ``v`` at its slot and attending
over the cache (``dew.nn.attention.masked_attention`` with the mask above). Both run on one
device's shards under the step's ``Shards`` (the weights gathered over fsdp per layer, the heads,
MLP and vocabulary split over ``tensor`` as in training: ``dew.parallel.tensor``'s regions), or on
whole weights with ``ONE_DEVICE``. The model's layer functions are the training forward's
(``rms_norm``, the projections of a tensor region, ``rotary.rotate``, ``swiglu``), so a LoRA
model's adapters (``dew.nn.lora.Adapted``) and an int8 base (``dew.nn.int8.Quantized``) run as
they trained.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from dew.nn import attention, mlp, norm, rotary
from dew.parallel import ONE_DEVICE, Shards, ragged, tensor, tensor_ring


class Cache(NamedTuple):
    """``k``, ``v``: ``[layers, rows, kv_heads, length, head_dim]`` (this device's rows and kv
    heads); ``pads``: int32 ``[rows]``, the padding slots before each row's prompt."""

    k: jax.Array
    v: jax.Array
    pads: jax.Array


def kv_heads_here(model, shards: Shards = ONE_DEVICE) -> int:
    """The kv heads a device's cache holds: ``kv_heads / tensor``, or the one head its query
    heads share when there are fewer kv heads than tensor devices."""
    t = shards.size(tensor.AXIS)
    return max(model.kv_heads // t, 1)


def empty_cache(model, rows: int, length: int, pads: jax.Array, shards=ONE_DEVICE) -> Cache:
    """A cache of zeros for ``rows`` rows of ``length`` slots (``pads`` int32 ``[rows]``)."""
    shape = (model.num_layers, rows, kv_heads_here(model, shards), length, model.head_dim)
    dtype = jnp.dtype(model.dtype)
    return Cache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), pads.astype(jnp.int32))


def check_model(model) -> None:
    """``ValueError`` for a model the cached forward does not run (a mixture of experts)."""
    if model.num_experts:
        raise ValueError(
            f"generation runs dense models; this one has {model.num_experts} experts in its "
            "MoE layers, whose cached forward Dew does not have"
        )


def visible(pads: jax.Array, first: int | jax.Array, count: int, length: int, window=None):
    """bool ``[rows, count, length]``: the cache slots each of ``count`` queries at slots
    ``first, first + 1, ...`` sees: its row's slots from ``pads`` up to its own (the ``window``
    most recent of them, with a window)."""
    query = first + jnp.arange(count)[:, None]  # [count, 1]
    slot = jnp.arange(length)[None, :]  # [1, length]
    mask = (slot <= query)[None] & (slot >= pads[:, None, None])
    if window is not None:
        mask = mask & (slot > query - window)[None]
    return mask


def positions_of(pads: jax.Array, first: int | jax.Array, count: int) -> jax.Array:
    """int32 ``[rows, count]``: the rotary positions of slots ``first, ...`` (a slot less its row's
    padding; 0 for a padding slot)."""
    slots = first + jnp.arange(count)[None, :]
    return jnp.maximum(slots - pads[:, None], 0).astype(jnp.int32)


def _layers(model, params, x, cache: Cache, first, shards: Shards, prefill: bool):
    """The decoder layers over ``x`` ``[rows, count, embed]`` at slots ``first, ...``; returns
    ``(x, cache)`` with those slots' ``k`` and ``v`` written in every layer."""
    count, length = x.shape[1], cache.k.shape[3]
    positions = positions_of(cache.pads, first, count)
    rope = dict(base=model.rope_theta, scaling=model.rope_scaling, layout=attention.LAYOUT)
    region = tensor_ring.region(shards)
    shared_kv = model.kv_heads < shards.size(tensor.AXIS)
    window = model.attention_window
    if prefill:
        # cuDNN takes no segment ids: a model trained with it prefills with what "auto" picks.
        chooser = model
        if model.attention_impl == "cudnn":
            chooser = dataclasses.replace(model, attention_impl="auto")
        impl = chooser.attention_for(ragged.compiled_platform(), seq_len=count, segmented=True)
        attend = attention.IMPLEMENTATIONS[impl]
        # The padding is a document of its own (id 0): no prompt token attends to it.
        segments = (jnp.arange(count)[None, :] >= cache.pads[:, None]).astype(jnp.int32)
        extra = {"segment_ids": segments, **({} if window is None else {"window": window})}
    else:
        mask = visible(cache.pads, first, count, length, window)

    def layer(carry, weights):
        x, k_all, v_all = carry
        layer_shards, index = weights
        w = shards.gather(layer_shards, "params", "layers", stacked=True)
        attn = w["attn"]
        if shared_kv:
            attn = {
                **attn,
                "k": tensor.shared_kv_heads(attn["k"], shards),
                "v": tensor.shared_kv_heads(attn["v"], shards),
            }
        h = region.enter(norm.rms_norm(w["attn_norm"], x, model.rms_norm_eps))
        q, k, v = region.columns("bse,ehd->bhsd", h, (attn["q"], attn["k"], attn["v"]))
        q = rotary.rotate(q, positions, **rope)
        k = rotary.rotate(k, positions, **rope)
        at = (index, 0, 0, first, 0)
        k_all = lax.dynamic_update_slice(k_all, k[None].astype(k_all.dtype), at)
        v_all = lax.dynamic_update_slice(v_all, v[None].astype(v_all.dtype), at)
        if prefill:
            out, _ = attend(q, k, v, causal=True, **extra)
        else:
            keys = lax.dynamic_index_in_dim(k_all, index, 0, keepdims=False)
            values = lax.dynamic_index_in_dim(v_all, index, 0, keepdims=False)
            out, _ = attention.masked_attention(
                q, keys.astype(q.dtype), values.astype(q.dtype), mask
            )
        x = x + region.leave(region.row("bhsd,hde->bse", out, attn["o"]))
        h = region.enter(norm.rms_norm(w["mlp_norm"], x, model.rms_norm_eps))
        x = x + region.leave(mlp.swiglu(w["mlp"], h, region))
        return (x, k_all, v_all), None

    layers = params["params"]["layers"]
    index = jnp.arange(model.num_layers)
    (x, k, v), _ = lax.scan(layer, (x, cache.k, cache.v), (layers, index))
    return x, cache._replace(k=k, v=v)


def _logits(model, params, x, shards: Shards) -> jax.Array:
    """float32 ``[rows, vocab]`` of the last position of ``x``, the whole vocabulary on every
    device (gathered over ``tensor`` where the head splits it)."""
    logits = model.head(params, x[:, -1:], shards)[:, 0]
    if logits.shape[-1] != model.vocab_size:
        logits = lax.all_gather(logits, tensor.AXIS, axis=1, tiled=True)
    return logits


def prefill(model, params, tokens: jax.Array, cache: Cache, shards: Shards = ONE_DEVICE):
    """``tokens`` int32 ``[rows, prompt]`` (left-padded by ``cache.pads``) into the cache's first
    ``prompt`` slots; returns ``(logits, cache)``: float32 ``[rows, vocab]``, the next token's
    logits after each prompt. ``params`` as ``CausalTransformer.apply`` takes them (a LoRA
    model's ``lora.combine`` of base and adapters)."""
    params, shards = model.share_embedding(params, shards, tokens.size)
    x = model.embed(params, tokens, shards)
    x, cache = _layers(model, params, x, cache, 0, shards, prefill=True)
    return _logits(model, params, x, shards), cache


def decode(model, params, tokens: jax.Array, slot, cache: Cache, shards: Shards = ONE_DEVICE):
    """One new token a row, ``tokens`` int32 ``[rows]``, at the cache slot ``slot`` (a scalar,
    traced or not); returns ``(logits, cache)`` as ``prefill``."""
    params, shards = model.share_embedding(params, shards, tokens.size)
    x = model.embed(params, tokens[:, None], shards)
    x, cache = _layers(model, params, x, cache, slot, shards, prefill=False)
    return _logits(model, params, x, shards), cache
