"""LoRA (Hu et al. 2021, https://arxiv.org/abs/2106.09685): a frozen weight plus a trainable
low-rank update, as ``dew.nn.param.project`` takes it.

For a weight ``W`` of the einsum ``spec`` (``x`` first), the adapted layer computes

    out = einsum(spec, x, W) + (alpha / R) einsum(einsum(x, A), B)

with ``A`` ``[*in_dims, R]`` (``W``'s dimensions that ``x`` names: the ones the matmul sums over)
and ``B`` ``[R, *out_dims]`` (``W``'s dimensions the output names). For Dew's weights:

    q, k, v   W [embed, heads, head_dim]  "bse,ehd->bhsd"  A [embed, R]            B [R, heads, hd]
    o         W [heads, head_dim, embed]  "bhsd,hde->bse"  A [heads, head_dim, R]  B [R, embed]
    gate, up  W [embed, mlp]              "te,ef->tf"      A [embed, R]            B [R, mlp]
    down      W [mlp, embed]              "tf,fe->te"      A [mlp, R]              B [R, embed]

``W`` is frozen: it passes through ``lax.stop_gradient``, so the backward computes the input
gradient through it and never its own gradient. ``A`` and ``B`` are cast to ``x``'s dtype, as
``project`` casts a weight; ``x A`` is scaled by ``alpha / R`` before ``B``, the smaller of the two
tensors. Under a tensor split the update needs no collective of its own: a column-parallel ``W``
(q, k, v, gate, up: its output dimension split) has ``B`` split alike and ``A`` whole, and a
row-parallel one (o, down: its input split) has ``A`` split alike and ``B`` whole, whose partial
``x A B`` the region's closing sum adds up with the base's (``dew.models.lora`` says which adapter
gradients are then partial over ``tensor``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from dew.nn.param import project, spec_labels


def _rank_label(*labels: str) -> str:
    used = set("".join(labels))
    return next(c for c in "rzyxwvutsqponmlkjigfedcba" if c not in used)


def lora_einsums(spec: str) -> tuple[str, str]:
    """The two einsums of the update for a weight of ``spec``: ``x A`` and ``(x A) B``.

    ``"bse,ehd->bhsd"`` -> ``("bse,er->bsr", "bsr,rhd->bhsd")``. ``ValueError`` when a label of
    the weight is named by both ``x`` and the output, or by neither (a batched weight, such as
    an MoE layer's experts: not a matrix LoRA adapts)."""
    x, w, out = spec_labels(spec)
    inputs = "".join(label for label in w if label in x)
    outputs = "".join(label for label in w if label in out)
    if any((label in x) == (label in out) for label in w):
        raise ValueError(
            f"einsum {spec!r}: LoRA adapts a weight each of whose dimensions is named by exactly "
            "one of x and the output"
        )
    r = _rank_label(x, w, out)
    kept = "".join(label for label in x if label not in inputs)
    return f"{x},{inputs}{r}->{kept}{r}", f"{kept}{r},{r}{outputs}->{out}"


@dataclasses.dataclass(frozen=True)
class Adapted:
    """A frozen weight and its LoRA adapter, as ``project`` takes them.

    Attributes:
      base: the frozen weight: an array, or a weight object of its own (``dew.nn.int8.Quantized``).
      a: ``[*in_dims, R]``; b: ``[R, *out_dims]`` (the module's docstring).
      scale: ``alpha / R``.
      key, rate: ``None``, or a PRNG key and a float32 scalar: the update's input then goes
        through dropout of that rate (PEFT's ``lora_dropout``: each entry of ``x`` zeroed with
        probability ``rate``, the rest divided by ``1 - rate``, for the update alone; the base
        sees ``x`` whole). The key decides the mask, so a recomputed layer draws the same one;
        a rate of 0 (evaluation) drops nothing. Both are leaves, not settings, so a training
        step and an evaluation share one tree structure.
    """

    base: Any
    a: jax.Array
    b: jax.Array
    scale: float
    key: Any = None
    rate: Any = None

    def einsum(self, spec: str, x: jax.Array) -> jax.Array:
        """``einsum(spec, x, W) + scale * einsum(einsum(dropout(x), A), B)``, in ``x``'s dtype;
        no gradient reaches ``W``."""
        base = self.base
        if not hasattr(base, "einsum"):
            base = jax.lax.stop_gradient(base)
        into, out_of = lora_einsums(spec)
        dropped = x
        if self.key is not None:
            keep = jax.random.bernoulli(self.key, 1.0 - self.rate, x.shape)
            dropped = jnp.where(keep, x / (1.0 - self.rate), 0).astype(x.dtype)
        update = project(into, dropped, self.a) * jnp.asarray(self.scale, x.dtype)
        return project(spec, x, base) + project(out_of, update, self.b)


jax.tree_util.register_dataclass(
    Adapted, data_fields=["base", "a", "b", "key", "rate"], meta_fields=["scale"]
)
