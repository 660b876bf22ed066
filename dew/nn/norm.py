"""RMSNorm: ``x / rms(x) * scale`` over the last (embed) dimension, computed in float32."""

import jax
import jax.numpy as jnp

from dew.nn.param import Param, ones


def rms_norm_params(features: int) -> dict:
    return {"scale": Param((features,), ("embed",), ones)}


def rms_norm(p: dict, x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """``x``: ``[..., embed]``; returns the same shape and dtype."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * p["scale"].astype(jnp.float32)).astype(x.dtype)
