"""A decoder-only language model in plain JAX, read top to bottom.

tokens -> embedding -> num_layers x [RMSNorm -> causal self-attention (rotary, grouped queries)
-> +, RMSNorm -> SwiGLU MLP -> +] -> RMSNorm -> logits through the (tied) embedding table.

The layers' weights are stacked on a leading ``layers`` dimension and run under ``lax.scan``, so
compile time does not grow with depth. Each layer body runs under ``jax.checkpoint`` saving nothing:
the backward recomputes the layer, gathers of fsdp-split weights included, so only one layer's whole
weights are ever alive (gather forward, gather again backward, scatter the gradients).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from dew.checks import positive_int
from dew.nn import attention, embed, mlp, norm
from dew.nn.param import Param, init_params, logical_axes, normal
from dew.parallel import ONE_DEVICE, Shards

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def resolve_dtype(name: str):
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPES)}")
    return DTYPES[name]


@dataclasses.dataclass(frozen=True)
class CausalTransformer:
    """Configuration and functions of the decoder.

    Args:
      vocab_size, emb_features, num_layers, num_heads, max_seq_len: the usual sizes.
      dtype: activations' dtype (``"float32"``, ``"bfloat16"``, ``"float16"``); softmax, norms and
        the loss run in float32 regardless.
      attention_impl: ``"xla"`` (plain JAX) or ``"pallas"`` (``dew.kernels.flash_attention``).
      num_kv_heads: heads of K and V (grouped-query attention); default ``num_heads``.
      mlp_features: hidden width of the SwiGLU MLP; default ``4 * emb_features``.
      tie_embeddings: the output head is the embedding table transposed (default) or a weight of
        its own.
      param_dtype: the weights' dtype.
    """

    vocab_size: int
    emb_features: int
    num_layers: int
    num_heads: int
    max_seq_len: int
    dtype: str = "float32"
    attention_impl: str = "xla"
    num_kv_heads: int | None = None
    mlp_features: int | None = None
    tie_embeddings: bool = True
    param_dtype: str = "float32"

    def __post_init__(self):
        for name in ("vocab_size", "emb_features", "num_layers", "num_heads", "max_seq_len"):
            value = getattr(self, name)
            positive_int(name, value)
        resolve_dtype(self.dtype)
        resolve_dtype(self.param_dtype)
        if self.attention_impl not in attention.IMPLEMENTATIONS:
            raise ValueError(
                f"unknown attention_impl {self.attention_impl!r}; expected one of "
                f"{', '.join(attention.IMPLEMENTATIONS)}"
            )
        if self.emb_features % self.num_heads:
            raise ValueError(
                f"emb_features {self.emb_features} does not split over num_heads {self.num_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"head_dim {self.head_dim} (emb_features / num_heads) must be even for rotary "
                "positions"
            )
        if self.kv_heads < 1 or self.num_heads % self.kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.kv_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.emb_features // self.num_heads

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def hidden(self) -> int:
        return 4 * self.emb_features if self.mlp_features is None else self.mlp_features

    def declare(self) -> dict:
        """The tree of ``Param`` declarations, under ``{"params": ...}``."""
        # GPT-2's scaling of the residual branches' output projections by 1/sqrt(2 * layers).
        out_scale = (2 * self.num_layers) ** -0.5
        layer = {
            "attn_norm": norm.rms_norm_params(self.emb_features),
            "attn": attention.attention_params(
                self.emb_features, self.num_heads, self.kv_heads, self.head_dim, out_scale
            ),
            "mlp_norm": norm.rms_norm_params(self.emb_features),
            "mlp": mlp.mlp_params(self.emb_features, self.hidden, out_scale),
        }
        params = {
            "embed_tokens": embed.embed_params(self.vocab_size, self.emb_features),
            "layers": jax.tree_util.tree_map(
                lambda p: p.stacked(self.num_layers), layer, is_leaf=lambda x: isinstance(x, Param)
            ),
            "final_norm": norm.rms_norm_params(self.emb_features),
        }
        if not self.tie_embeddings:
            params["lm_head"] = {
                "kernel": Param(
                    (self.emb_features, self.vocab_size),
                    ("embed", "vocab"),
                    normal(self.emb_features**-0.5),
                )
            }
        return {"params": params}

    def logical_axes(self) -> dict:
        return logical_axes(self.declare())

    def init(self, key: jax.Array) -> dict:
        """Initial weights; they depend on ``key`` alone."""
        return init_params(self.declare(), key, resolve_dtype(self.param_dtype))

    def apply(self, params: dict, tokens: jax.Array, shards: Shards = ONE_DEVICE) -> jax.Array:
        """``tokens`` ``[batch, seq]`` -> float32 logits ``[batch, seq, vocab]``.

        ``params`` are the shards this device holds; ``shards`` says how they are split. With
        ``ONE_DEVICE`` the weights are whole and no collective runs.
        """
        dtype = resolve_dtype(self.dtype)
        p = params["params"]
        positions = jnp.arange(tokens.shape[1])
        table = shards.gather(p["embed_tokens"], "params", "embed_tokens")
        x = embed.embed(table, tokens, dtype)

        def layer(x, layer_shards):
            x = shards.pin(x)
            w = shards.gather(layer_shards, "params", "layers", stacked=True)
            x = x + attention.self_attention(
                w["attn"], norm.rms_norm(w["attn_norm"], x), positions, self.attention_impl
            )
            x = x + mlp.swiglu(w["mlp"], norm.rms_norm(w["mlp_norm"], x))
            return x, None

        layer = jax.checkpoint(
            layer, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False
        )
        x, _ = lax.scan(layer, x, p["layers"])
        x = shards.pin(x)
        x = norm.rms_norm(shards.gather(p["final_norm"], "params", "final_norm"), x)
        if self.tie_embeddings:
            return embed.unembed(table, x)
        head = shards.gather(p["lm_head"], "params", "lm_head")["kernel"]
        return jnp.einsum("bse,ev->bsv", x, head.astype(dtype), preferred_element_type=jnp.float32)
