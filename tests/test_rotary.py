"""``dew.nn.rotary.rotate`` and its gradient against the rotation written pair by pair."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn import rotary


def rotated_pairs(x, positions, freqs, sign=1.0):
    """float64 loops: pair ``(i, i + d/2)`` of a head turned by ``sign * position * freqs[i]``."""
    x = np.asarray(x, np.float64)
    half = x.shape[-1] // 2
    out = np.empty_like(x)
    for s, position in enumerate(np.asarray(positions)):
        for i in range(half):
            angle = sign * float(position) * float(freqs[i])
            a, b = x[:, s, :, i], x[:, s, :, i + half]
            out[:, s, :, i] = a * np.cos(angle) - b * np.sin(angle)
            out[:, s, :, i + half] = b * np.cos(angle) + a * np.sin(angle)
    return out


def halves_rotation(x, positions):
    """The textbook form on halves ``[x1 cos - x2 sin, x2 cos + x1 sin]``, float32 inside."""
    half = x.shape[-1] // 2
    angles = positions.astype(jnp.float32)[:, None] * rotary.frequencies(x.shape[-1])[None, :]
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


@pytest.mark.parametrize("scaled", [False, True])
def test_rotate_and_its_gradient_turn_each_pair(seed, scaled):
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    scaling = rotary.Llama3Scaling(4.0, 1.0, 4.0, 8) if scaled else None
    x = rng.standard_normal((2, 9, 3, 16)).astype(np.float32)
    grad = rng.standard_normal(x.shape).astype(np.float32)
    positions = np.arange(9) + rng.integers(0, 100)
    freqs = np.asarray(rotary.frequencies(16, 500.0, scaling), np.float64)

    out, vjp = jax.vjp(lambda x: rotary.rotate(x, jnp.asarray(positions), 500.0, scaling), x)
    np.testing.assert_allclose(out, rotated_pairs(x, positions, freqs), rtol=1e-5, atol=1e-5)
    # The gradient of a rotation is the rotation back: each pair turned by the negated angle.
    (dx,) = vjp(jnp.asarray(grad))
    np.testing.assert_allclose(
        dx, rotated_pairs(grad, positions, freqs, -1.0), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rotate_is_the_halves_formula_to_the_bit(seed, dtype):
    """The whole-row form (a signed permutation by matmul) against the textbook one on halves: the
    same float32 products and sums, so the same bits, forward and backward."""
    print(f"seed {seed}")
    key_x, key_g = jax.random.split(jax.random.key(seed))
    x = (3 * jax.random.normal(key_x, (2, 37, 3, 64))).astype(dtype)
    grad = jax.random.normal(key_g, x.shape).astype(dtype)
    positions = jnp.arange(37) + 5

    out, vjp = jax.vjp(lambda x: rotary.rotate(x, positions), x)
    want, want_vjp = jax.vjp(lambda x: halves_rotation(x, positions), x)
    assert out.dtype == dtype and vjp(grad)[0].dtype == dtype
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
    np.testing.assert_array_equal(
        np.asarray(vjp(grad)[0], np.float32), np.asarray(want_vjp(grad)[0], np.float32)
    )
