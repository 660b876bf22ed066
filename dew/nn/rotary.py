"""Rotary position embedding (RoPE), rotating pairs ``(x[i], x[i + d/2])`` of each head.

This is the "rotate half" convention of Hugging Face's Llama (``rotate_half``), not the interleaved
pairs ``(x[2i], x[2i + 1])`` of Meta's original code: pair ``i`` turns by ``position * freq[i]``
with ``freq[i] = theta ** (-i / (d/2))``.

Llama 3 rescales the low frequencies (``Llama3Scaling``, the ``"llama3"`` rope type of
Hugging Face's ``config.json``): wavelengths longer than ``original_max_position_embeddings /
low_freq_factor`` are stretched by ``factor``, those shorter than ``original / high_freq_factor``
kept, and the ones between interpolated smoothly.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

DEFAULT_THETA = 10000.0


@dataclasses.dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3's frequency scaling (``rope_scaling`` with ``rope_type: "llama3"`` in
    ``config.json``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"rope scaling {name} must be a number above 0, got {value!r}")
        if not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"rope scaling high_freq_factor {self.high_freq_factor} must be above "
                f"low_freq_factor {self.low_freq_factor}"
            )
        original = self.original_max_position_embeddings
        if isinstance(original, bool) or not isinstance(original, int) or original < 1:
            raise ValueError(
                f"rope scaling original_max_position_embeddings must be a positive integer, "
                f"got {original!r}"
            )

    @classmethod
    def of(cls, value) -> Llama3Scaling | None:
        """``value`` as a ``Llama3Scaling``: one already, a dict of its four fields (a
        ``rope_type``/``type`` key, if present, must be ``"llama3"``), or ``None``."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(
                f"rope_scaling must be None, a Llama3Scaling or a dict of its fields, got "
                f"{type(value).__name__}"
            )
        fields = {f.name for f in dataclasses.fields(cls)}
        kind = value.get("rope_type", value.get("type", "llama3"))
        if kind != "llama3":
            raise ValueError(f"rope_scaling rope_type {kind!r} is not supported; Dew has 'llama3'")
        unknown = sorted(set(value) - fields - {"rope_type", "type"})
        missing = sorted(fields - set(value))
        if unknown or missing:
            raise ValueError(
                f"rope_scaling needs exactly {', '.join(sorted(fields))}"
                + (f"; missing {', '.join(missing)}" if missing else "")
                + (f"; unknown {', '.join(unknown)}" if unknown else "")
            )
        return cls(**{name: value[name] for name in fields})

    def as_config(self) -> dict:
        """The ``rope_scaling`` entry of a Hugging Face ``config.json``."""
        return {"rope_type": "llama3", **dataclasses.asdict(self)}


def frequencies(
    head_dim: int, theta: float = DEFAULT_THETA, scaling: Llama3Scaling | None = None
) -> jax.Array:
    """float32 ``[head_dim / 2]``: the angle per position of each rotated pair.

    Computed in float32 in the order Hugging Face's ``_compute_llama3_parameters`` uses, so that
    a converted model turns by the same angles."""
    half = head_dim // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    if scaling is None:
        return freqs
    original = scaling.original_max_position_embeddings
    low_wavelen = original / scaling.low_freq_factor
    high_wavelen = original / scaling.high_freq_factor
    wavelen = 2 * math.pi / freqs
    # Long wavelengths (low frequencies) are stretched by `factor`; short ones are kept.
    scaled = jnp.where(wavelen > low_wavelen, freqs / scaling.factor, freqs)
    smooth = (original / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(medium, smoothed, scaled)


# The layouts of q and k (and of attention's arrays: ``dew.nn.attention`` takes these). The
# kernels keep their own copy (``dew.kernels.attention.LAYOUTS``): they import nothing of Dew's.
LAYOUTS = ("bshd", "bhsd")


def rotate(
    x: jax.Array,
    positions: jax.Array,
    base: float = DEFAULT_THETA,
    scaling: Llama3Scaling | None = None,
    layout: str = "bshd",
) -> jax.Array:
    """``x``: ``[batch, seq, heads, head_dim]`` (``layout="bshd"``) or ``[batch, heads, seq,
    head_dim]`` (``"bhsd"``, the attention kernels' layout), head_dim even; ``positions``:
    integers ``[seq]`` (every row alike) or ``[batch, seq]`` (each row its own: packed documents,
    whose positions restart at each document). ``base``: theta of the frequencies;
    ``scaling``: Llama 3's frequency scaling, or ``None``.

    Positions are explicit so that a device holding a slice of the sequence rotates by its own
    offsets. Computed in float32, returned in ``x``'s dtype; the gradient is the rotation back
    (by the negated angles), in the cotangent's dtype.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"rotate: layout must be one of {LAYOUTS}; got {layout!r}")
    if positions.ndim not in (1, 2):
        raise ValueError(
            f"rotate: positions must be [seq] or [batch, seq], got shape {positions.shape}"
        )
    freqs = frequencies(x.shape[-1], base, scaling)
    angles = positions.astype(jnp.float32)[..., None] * freqs  # [(batch,) seq, half]
    if positions.ndim == 1:
        angles = angles[None]
    # Whole head_dim rows: [cos, cos] and [sin, sin], broadcast over the heads (and the batch
    # for positions shared by every row).
    heads_at = 2 if layout == "bshd" else 1
    cos = jnp.expand_dims(jnp.tile(jnp.cos(angles), 2), heads_at)
    sin = jnp.expand_dims(jnp.tile(jnp.sin(angles), 2), heads_at)
    return _rotate(x, cos, sin)


@jax.custom_vjp
def _rotate(x, cos, sin):
    # x * [cos, cos] + [-x2, x1] * [sin, sin] is [x1 cos - x2 sin, x2 cos + x1 sin] to the bit.
    return (x.astype(jnp.float32) * cos + _turn_halves(x) * sin).astype(x.dtype)


def _rotate_forward(x, cos, sin):
    return _rotate(x, cos, sin), (cos, sin)


def _rotate_backward(residuals, grad):
    # A rotation's transpose is the rotation back. Angles are not trained: no gradient for them.
    cos, sin = residuals
    return _rotate(grad, cos, -sin), None, None


_rotate.defvjp(_rotate_forward, _rotate_backward)


def _turn_halves(x: jax.Array) -> jax.Array:
    """``[x1, x2] -> [-x2, x1]`` over the last axis, in float32, exact.

    A matmul with a signed permutation, not slices and a concatenate: on a TPU the slices became
    ``[..., head_dim / 2]`` arrays in HBM around the rotation, forward and backward (at head_dim
    64 a lane dimension of 32, padded to 128), which cost more than the rotation itself. Each
    output is one input times +-1, so the product is exact in any precision that keeps ``x``
    (HIGHEST: float32 inputs are not rounded to bfloat16 on a TPU)."""
    d = x.shape[-1]
    half = d // 2
    # turn[i, j] = 1 where i == j - half (j >= half), -1 where i == j + half (j < half).
    turn = jnp.eye(d, k=half, dtype=x.dtype) - jnp.eye(d, k=-half, dtype=x.dtype)
    return jnp.einsum(
        "...i,ij->...j",
        x,
        turn,
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
