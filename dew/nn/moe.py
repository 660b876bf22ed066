"""Mixture of experts: a router sends each token to ``k`` of ``E`` SwiGLU experts.

    logits = x @ router                      [tokens, E], float32
    probs = softmax(logits)                  float32
    weights, ids = top_k(probs, k)           weights renormalised to sum to 1 per token
    y = sum_j weights[:, j] * expert[ids[:, j]](x)

Each token is copied ``k`` times; the copies are sorted by expert and every expert's SwiGLU runs
as one grouped matmul (``jax.lax.ragged_dot``) over its run of copies. Where the experts live is
``dew.parallel.expert``'s business: on one device all of them are here; over an ``expert`` axis
each device holds ``E / n`` and the copies travel to them by ``all_to_all``.

Two losses keep the router healthy, both added to the objective's loss (averaged over the MoE
layers, then weighted by ``router_aux_weight`` and ``router_z_weight``):

- load balance (Switch Transformer): ``E * sum_e f_e * P_e``, ``f_e`` the fraction of the
  ``tokens * k`` copies routed to expert ``e`` (no gradient), ``P_e`` the mean router
  probability of ``e``. It is 1 for a uniform router and ``E`` when every token picks one expert.
- router z-loss (ST-MoE): the mean of ``logsumexp(logits) ** 2``, which keeps logits small.

Both are statistics of the whole microbatch, not of one device's tokens: the counts behind ``f``
are summed over the devices splitting the tokens, and each device contributes ``E * sum_e f_e *
(its sum of P_e)``, which is linear in its own tokens, so the devices' contributions add up to the
one-device value and so do their gradients.

Capacity. ``capacity_factor=None`` is dropless: every copy reaches its expert. With a factor
``c``, each row of the batch is a routing group and an expert takes at most ``ceil(c * seq * k /
E)`` copies from a row, in order of position (earlier positions first; at one position, a token's
first choice before its second). A dropped copy contributes nothing; a token all of whose copies
are dropped passes through on the residual alone. The kept copies' weights are not renormalised.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from dew.nn.param import PLAIN, Param, Projections, normal


class RouterStats(NamedTuple):
    """Sums a microbatch's MoE layers add up on one device (float32 scalars; zeros when dense).

    ``load_balance`` and ``z_loss`` are this device's contributions, which summed over the devices
    splitting the tokens and divided by the microbatch's token count give the losses above;
    ``dropped`` and ``routed`` count token copies."""

    load_balance: jax.Array
    z_loss: jax.Array
    dropped: jax.Array
    routed: jax.Array

    @classmethod
    def zeros(cls) -> "RouterStats":
        zero = jnp.zeros((), jnp.float32)
        return cls(zero, zero, zero, zero)

    def __add__(self, other: "RouterStats") -> "RouterStats":
        return RouterStats(*(a + b for a, b in zip(self, other)))


def moe_params(features: int, hidden: int, num_experts: int, out_scale: float) -> dict:
    """The router ``[embed, E]`` (its expert dimension has no logical name: the router is never
    split over experts) and ``E`` stacked SwiGLU experts."""
    return {
        "router": {
            "kernel": Param((features, num_experts), ("embed", None), normal(features**-0.5))
        },
        "experts": {
            "gate": Param(
                (num_experts, features, hidden),
                ("experts", "embed", "mlp"),
                normal(1.0 / math.sqrt(features)),
            ),
            "up": Param(
                (num_experts, features, hidden),
                ("experts", "embed", "mlp"),
                normal(1.0 / math.sqrt(features)),
            ),
            "down": Param(
                (num_experts, hidden, features),
                ("experts", "mlp", "embed"),
                normal(out_scale / math.sqrt(hidden)),
            ),
        },
    }


def route(kernel: jax.Array, x: jax.Array, k: int):
    """The router on ``x`` ``[tokens, embed]``.

    Returns:
      ``(ids, weights, probs, lse)``: ``ids`` ``[tokens, k]`` int32 experts, best first;
      ``weights`` ``[tokens, k]`` float32, their probabilities renormalised to sum to 1;
      ``probs`` ``[tokens, E]`` float32; ``lse`` ``[tokens]`` the logits' logsumexp.
    """
    logits = jnp.dot(x.astype(jnp.float32), kernel.astype(jnp.float32))
    probs = jax.nn.softmax(logits, axis=-1)
    top, ids = lax.top_k(probs, k)
    return ids, top / jnp.sum(top, axis=-1, keepdims=True), probs, jax.nn.logsumexp(logits, -1)


def expert_counts(ids: jax.Array, num_experts: int) -> jax.Array:
    """``[E]`` float32: how many of ``ids`` (any shape) name each expert."""
    return jnp.sum(jax.nn.one_hot(ids.reshape(-1), num_experts, dtype=jnp.float32), axis=0)


def capacity(tokens: int, k: int, num_experts: int, factor: float) -> int:
    """Copies an expert takes from a routing group of ``tokens`` tokens: ``ceil(factor * tokens *
    k / E)``, at least 1."""
    return max(1, math.ceil(factor * tokens * k / num_experts))


def within_capacity(ids: jax.Array, num_experts: int, limit: int) -> jax.Array:
    """Which copies an expert keeps: ``ids`` ``[groups, tokens, k]`` -> bool of that shape.

    In each group, copy ``(t, j)`` is kept when fewer than ``limit`` copies before it (earlier
    positions first, then earlier choices) went to its expert.
    """
    groups, tokens, k = ids.shape
    flat = ids.reshape(groups, tokens * k)
    seen = jnp.cumsum(jax.nn.one_hot(flat, num_experts, dtype=jnp.int32), axis=1)
    rank = jnp.take_along_axis(seen, flat[..., None], axis=-1)[..., 0] - 1
    return (rank < limit).reshape(groups, tokens, k)


def grouped_swiglu(
    experts: dict, x: jax.Array, group_sizes: jax.Array, projections: Projections = PLAIN
) -> jax.Array:
    """Runs the experts on copies sorted by expert.

    Args:
      experts: ``gate``, ``up`` ``[G, embed, hidden]``, ``down`` ``[G, hidden, embed]``.
      x: ``[copies, embed]``, the first ``group_sizes[0]`` for expert 0, the next for expert 1...
      group_sizes: ``[G]`` int32; rows past their sum (padding, dropped copies) come out zero.
      projections: how the grouped matmuls run (``Projections.experts``: in ``x``'s dtype, or in
        int8 under ``StepOptions(quantize="int8")``).

    Returns ``[copies, embed]`` in ``x``'s dtype. One ``ragged_dot`` per matmul: a grouped GEMM on
    GPU and TPU; XLA:CPU lowers it to a dense product masked per group (``G`` times the work).
    """
    gate = projections.experts(x, experts["gate"], group_sizes, "gate")
    up = projections.experts(x, experts["up"], group_sizes, "up")
    return projections.experts(jax.nn.silu(gate) * up, experts["down"], group_sizes, "down")


def sort_into_groups(groups: jax.Array, num_groups: int) -> tuple[jax.Array, jax.Array]:
    """``(order, sizes)`` for ``groups`` ``[n]`` int32 in ``[0, num_groups]`` (``num_groups``:
    no group): ``groups[order]`` is ascending (stable) and ``sizes[g]`` counts group ``g``."""
    order = jnp.argsort(groups, stable=True)
    sizes = jnp.zeros((num_groups,), jnp.int32).at[groups].add(1, mode="drop")
    return order, sizes


def unsort(sorted_rows: jax.Array, order: jax.Array) -> jax.Array:
    """The inverse of ``rows[order]``."""
    return jnp.zeros_like(sorted_rows).at[order].set(sorted_rows)
