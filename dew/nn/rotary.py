"""Rotary position embedding (RoPE), rotating pairs ``(x[i], x[i + d/2])`` of each head."""

import jax
import jax.numpy as jnp


def rotate(x: jax.Array, positions: jax.Array, base: float = 10000.0) -> jax.Array:
    """``x``: ``[batch, seq, heads, head_dim]`` (head_dim even); ``positions``: ``[seq]`` integers.

    Positions are explicit so that a device holding a slice of the sequence rotates by its own
    offsets.
    """
    half = x.shape[-1] // 2
    freqs = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[:, None] * freqs[None, :]  # [seq, half]
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
