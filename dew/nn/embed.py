"""Token embedding table, also used (transposed) as the output head when tied."""

import jax
import jax.numpy as jnp

from dew.nn.param import Param, normal


def embed_params(vocab: int, features: int) -> dict:
    # Standard deviation 1/sqrt(features): as the (tied) output head it gives logits of unit scale
    # on normalized inputs (measured against GPT-2's 0.02: docs/benchmarks.md, "Choices in the
    # model").
    return {"embedding": Param((vocab, features), ("vocab", "embed"), normal(features**-0.5))}


def embed(p: dict, tokens: jax.Array, dtype) -> jax.Array:
    """``tokens``: ``[batch, seq]`` integers -> ``[batch, seq, embed]``."""
    return jnp.take(p["embedding"], tokens, axis=0).astype(dtype)


def unembed(p: dict, x: jax.Array) -> jax.Array:
    """``x``: ``[batch, seq, embed]`` -> float32 logits ``[batch, seq, vocab]``."""
    return jnp.einsum(
        "bse,ve->bsv", x, p["embedding"].astype(x.dtype), preferred_element_type=jnp.float32
    )
