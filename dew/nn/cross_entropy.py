"""The output head and its cross-entropy over chunks of tokens: no ``[tokens, vocab]`` logits.

For tokens ``t`` with final activations ``x_t`` ``[embed]``, target ids ``y_t`` and weights
``w_t``, and the head's table ``E`` ``[vocab, embed]`` (the tied embedding, or an untied kernel's
``.T``)::

    loss = sum_t w_t (logsumexp_v(x_t . E_v) - x_t . E_{y_t})

A plain head writes the logits of every token, ``[tokens, vocab]`` float32 (3.3 GB at 16k tokens
of GPT-2's 50,304 ids, 8.4 GB for Llama 3's 128,256), and their gradient after them. Here a
``scan`` takes ``chunk`` tokens at a time: a chunk's logits ``[chunk, vocab]`` are made, reduced to
its loss and, when the loss is differentiated, turned at once into its gradients::

    dlogits = w (softmax - onehot(y))    dx = dlogits E    dE += dlogits^T x

so the largest temporary is one chunk's logits. The gradients come out of the forward (as Liger
Kernel's fused linear cross-entropy makes them) and the backward only scales them by the loss's
cotangent, one number: forward and backward together run the plain head's three matmuls, and no
logits are recomputed. ``dE`` adds up in float32 across the chunks and is returned in ``E``'s own
dtype; pass the weights as stored (float32) and the matmuls' ``dtype`` apart, so the gradient is not
rounded to bfloat16 on its way back.

With the vocabulary split over a mesh ``axis`` (tensor, or fsdp in ``dew.parallel.vocabulary``),
``table`` is this device's slice ``[vocab / n, embed]`` (device ``i`` holds ids ``[i vocab/n,
(i+1) vocab/n)``) and the softmax's sums run over the devices: a ``pmax`` of ``[chunk]`` and one
``psum`` of ``[chunk, 2]`` float32 a chunk, the only collectives, ``2 (n - 1) / n x 12`` bytes
sent per token in all. ``dx`` is then this slice's part of the activations' gradient; the caller's
region (``tensor.enter``, or the fsdp ``all_gather`` of the rows) sums it over ``axis``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

# The largest chunk of float32 logits ``auto_chunk`` aims at. On one v5e chip, GPT-2 small's step
# at 16 x 1024 tokens took 170 ms in chunks of 1,264 tokens (254 MB of logits), 166 ms in chunks of
# 2,048 or 4,096 and 165 ms at once (docs/results/one-chip.md, "GPT-2 small").
CHUNK_BYTES = 512 * 2**20
# Chunks of several are a multiple of this many tokens: the logits' rows fill whole MXU tiles.
# Chunks of 2,344 tokens (7 under the budget) took 141.9 ms a GPT-2 small step on v5e, chunks of
# 2,048 (8) 139.0 ms (2026-12-05; the history of docs/benchmarks.md).
CHUNK_ALIGN = 128
# What one more chunk costs, in tokens: a chunk reads and writes the float32 table gradient
# (8 vocab x embed bytes), a token takes three matmuls with the table (6 vocab x embed flops), so
# one chunk costs about (8 / HBM bytes/s) / (6 / matmul flop/s) tokens, some 250 on a v5e
# (819 GB/s, about 150 TFLOP/s achieved) and as many on an H100: the sizes do not enter it.
CHUNK_COST_TOKENS = 256


def auto_chunk(tokens: int, vocab_local: int) -> int:
    """Tokens per chunk: all ``tokens`` when their float32 logits ``[tokens, vocab_local]`` fit in
    ``CHUNK_BYTES``; else the multiple of ``CHUNK_ALIGN`` that fits and costs least, counting the
    padded last chunk's tokens and ``CHUNK_COST_TOKENS`` a chunk (16 x 1024 tokens of a 50,304
    vocabulary: 8 chunks of 2,048). A vocabulary so large that ``CHUNK_ALIGN`` tokens do not fit
    takes the most multiples of 8 that do."""
    most = CHUNK_BYTES // (vocab_local * 4)
    if tokens <= most:
        return tokens
    if most < CHUNK_ALIGN:
        return max(8, most // 8 * 8)

    def cost(size: int) -> tuple[int, int]:
        chunks = -(-tokens // size)
        return chunks * size + chunks * CHUNK_COST_TOKENS, -size

    return min(range(CHUNK_ALIGN, most + 1, CHUNK_ALIGN), key=cost)


def loss_sum(
    x: jax.Array,
    table: jax.Array,
    targets: jax.Array,
    weights: jax.Array | None = None,
    *,
    chunk: int | None = None,
    dtype=None,
    axis: str | None = None,
    sum_cotangent: bool = False,
) -> jax.Array:
    """``sum_t w_t (logsumexp(x_t E^T) - x_t . E_{y_t})``, a float32 scalar.

    Args:
      x: ``[..., embed]`` final activations (any leading shape: ``[rows, seq, embed]``).
      table: ``[vocab, embed]``, or this device's ``[vocab / n, embed]`` when ``axis`` splits it.
      targets: ``x``'s leading shape of integer ids in ``[0, vocab)``.
      weights: ``x``'s leading shape of float32 multipliers of each token's loss (a loss mask);
        ``None``: every token counts once. They receive no gradient.
      chunk: tokens per chunk; ``None``: ``auto_chunk``. A chunk larger than the tokens is all of
        them; a last chunk short of ``chunk`` is padded with tokens of weight 0.
      dtype: the matmuls' input dtype (they accumulate in float32); default ``x``'s.
      axis: the mesh axis the vocabulary is split over, or ``None``.
      sum_cotangent: the loss's cotangent is ``psum``-ed over ``axis`` before it scales the
        gradients (4 bytes): for a caller that counts the loss on one device of the group while
        every device's slice contributed to it (``dew.parallel.vocabulary``). ``False``: each
        device's cotangent is the whole loss's, as under ``tensor``, where the loss is the same on
        every device and each counts it.
    """
    lead = x.shape[:-1]
    if targets.shape != lead:
        raise ValueError(f"loss_sum: targets {targets.shape} must be x {x.shape} less its last dim")
    if table.ndim != 2 or table.shape[1] != x.shape[-1]:
        raise ValueError(f"loss_sum: table {table.shape} must be [vocab, {x.shape[-1]}]")
    if weights is not None and weights.shape != lead:
        raise ValueError(f"loss_sum: weights {weights.shape} must be targets' {lead}")
    tokens = math.prod(lead)
    chunk = auto_chunk(tokens, table.shape[0]) if chunk is None else min(int(chunk), tokens)
    if chunk < 1:
        raise ValueError(f"loss_sum: chunk must be a positive number of tokens, got {chunk}")
    weights = jnp.ones(lead, jnp.float32) if weights is None else weights.astype(jnp.float32)
    # The static arguments, hashable: the gradients' dtypes ride along for the backward.
    config = (chunk, jnp.dtype(dtype or x.dtype), axis, sum_cotangent, x.dtype, table.dtype)
    return _loss_sum(config, x.reshape(tokens, -1), table, targets.reshape(tokens), weights.ravel())


def _chunks(config, x, targets, weights):
    """``[chunks, chunk, ...]`` views of the tokens, the last chunk padded with weight 0."""
    chunk = config[0]
    tokens = x.shape[0]
    count = -(-tokens // chunk)
    pad = count * chunk - tokens
    if pad:
        x = jnp.pad(x, ((0, pad), (0, 0)))
        targets = jnp.pad(targets, (0, pad))
        weights = jnp.pad(weights, (0, pad))
    return (
        x.reshape(count, chunk, x.shape[-1]),
        targets.reshape(count, chunk),
        weights.reshape(count, chunk),
    )


def _chunk_softmax(config, x_c, table_c, targets_c):
    """A chunk's float32 ``logits`` ``[chunk, vocab_local]``, ``lse`` ``[chunk]`` over the whole
    vocabulary, and ``local``/``mine``: each target's index in this slice, and whether it is
    here."""
    axis = config[2]
    vocab_local = table_c.shape[0]
    logits = jnp.einsum("te,ve->tv", x_c, table_c, preferred_element_type=jnp.float32)
    # The shift is for stability only (the lse is exact for any shift), so it carries no gradient.
    shift = jnp.max(logits, axis=-1)
    start = 0
    if axis is not None:
        # All-reduce (max) of [chunk] float32: 2 (n - 1) / n x 4 chunk bytes sent.
        shift = lax.pmax(shift, axis)
        start = lax.axis_index(axis) * vocab_local
    local = targets_c.astype(jnp.int32) - start
    mine = (local >= 0) & (local < vocab_local)
    picked = jnp.take_along_axis(logits, jnp.where(mine, local, 0)[:, None], axis=-1)[:, 0]
    sums = jnp.stack(
        [jnp.sum(jnp.exp(logits - shift[:, None]), -1), jnp.where(mine, picked - shift, 0.0)], -1
    )
    if axis is not None:
        # One all-reduce of [chunk, 2] float32 for both sums: 2 (n - 1) / n x 8 chunk bytes sent.
        sums = lax.psum(sums, axis)
    lse = shift + jnp.log(sums[:, 0])
    target_logit = shift + sums[:, 1]
    return logits, lse, target_logit, local, mine


def _forward(config, x, table, targets, weights, with_gradients: bool):
    """``(loss, (d_x, d_table))`` (``(loss, None)`` without gradients): one chunk directly, or a
    ``scan`` over the chunks whose carry adds up ``d_table`` in float32."""
    dtype = config[1]
    table_c = table.astype(dtype)
    x_chunks, target_chunks, weight_chunks = _chunks(config, x.astype(dtype), targets, weights)

    def one_chunk(x_c, targets_c, weights_c):
        logits, lse, target_logit, local, mine = _chunk_softmax(config, x_c, table_c, targets_c)
        loss = jnp.sum(weights_c * (lse - target_logit))
        if not with_gradients:
            return loss, None, None
        onehot = (jnp.arange(logits.shape[-1]) == local[:, None]) & mine[:, None]
        d_logits = (weights_c[:, None] * (jnp.exp(logits - lse[:, None]) - onehot)).astype(dtype)
        d_x = jnp.einsum("tv,ve->te", d_logits, table_c, preferred_element_type=jnp.float32)
        d_table = jnp.einsum("tv,te->ve", d_logits, x_c, preferred_element_type=jnp.float32)
        return loss, d_x, d_table

    if x_chunks.shape[0] == 1:
        # No loop: under GSPMD (one chunk there: ``CausalTransformer.head_loss_sum``) the
        # partitioner reduce-scatters d_table to the table's split as it does a plain head's.
        loss, d_x, d_table = one_chunk(x_chunks[0], target_chunks[0], weight_chunks[0])
    else:

        def step(carry, chunk_in):
            total, d_table = carry
            loss, d_x, d_table_c = one_chunk(*chunk_in)
            return (total + loss, None if d_table is None else d_table + d_table_c), d_x

        d_table = jnp.zeros(table.shape, jnp.float32) if with_gradients else None
        carry = (jnp.zeros((), jnp.float32), d_table)
        (loss, d_table), d_x = lax.scan(step, carry, (x_chunks, target_chunks, weight_chunks))
    if not with_gradients:
        return loss, None
    return loss, (d_x.reshape(-1, x.shape[-1])[: x.shape[0]], d_table)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _loss_sum(config, x, table, targets, weights):
    return _forward(config, x, table, targets, weights, with_gradients=False)[0]


def _loss_sum_fwd(config, x, table, targets, weights):
    total, (d_x, d_table) = _forward(config, x, table, targets, weights, with_gradients=True)
    return total, (d_x, d_table, targets, weights)


def _loss_sum_bwd(config, residuals, g):
    d_x, d_table, targets, weights = residuals
    _, _, axis, sum_cotangent, x_dtype, table_dtype = config
    if sum_cotangent:
        # All-reduce of the loss's cotangent, one float32: 2 (n - 1) / n x 4 bytes sent.
        g = lax.psum(g, axis)
    zeros = jax.tree_util.tree_map(_zero_cotangent, (targets, weights))
    return ((g * d_x).astype(x_dtype), (g * d_table).astype(table_dtype), *zeros)


def _zero_cotangent(a):
    if jnp.issubdtype(a.dtype, jnp.integer):
        return jnp.zeros(a.shape, jax.dtypes.float0)
    return jnp.zeros_like(a)


_loss_sum.defvjp(_loss_sum_fwd, _loss_sum_bwd)
