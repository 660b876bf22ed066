"""Mosaic TPU forward kernel: an online softmax over the visible block pairs only.

Grid ``(batch, heads / n, steps)``, the last dimension sequential: it walks `kernels.schedule`'s
table of the (query block, key block) pairs that hold a visible (row, key) pair, each query
block's key blocks in a run. The step ``(b, h, t)`` holds the ``[n, block_q, head_dim]`` query
blocks of the ``n`` heads from ``h * n`` (``Tuning.heads_per_step``: up to 4 on v5e) and the
``[block_k, head_dim]`` key and value blocks of their kv heads (query head ``i`` reads kv head
``i // group``: grouped queries read the shared K/V in place), and adds the key block to each
query block's running maximum ``m``, running sum ``l`` and unnormalised float32 accumulator, in
VMEM scratch; the run's last step writes ``out`` and ``lse``. A run that starts on a pair without a
mask writes the three from its first piece rather than adding that piece to zeros: on a v5e chip,
without the zeroing step (768 vector stores a run at two heads of 1024 rows), the forward was 1.2%
faster at 4096 keys without a mask and 0.7% at 8192 causal keys. Several heads a step make the grid
shorter and its DMAs longer: on a v5e chip 4 heads of 512 rows were 6-7% faster than one.

Inside a step the key block is computed ``block_k_compute`` keys at a time, and each piece
``block_q_compute`` query rows at a time (both unrolled): a large block keeps the DMAs long and
the grid short, a smaller computed strip keeps the ``[block_q_compute, block_k_compute]`` float32
logits small. They are held in the core's 64 vector registers as far as they fit and spilled to
VMEM past that; a store of a spilled register is half the forward's bundles at whole 512-row
blocks, so strips of 256 rows were 1.7-5.5% faster on a v5e chip from 4096 keys on (no
different at 2048), though each strip loads the piece's K and V into the MXUs again. Only pairs
the table marks ``MASKED`` (the causal diagonal, a padded key tail) build a mask, and within them
a piece no row sees is skipped.

Numerics (`kernels.mosaic`): base-2 logits ``s = (q . k) * sm_scale * log2(e)``, ``m`` and ``l``
kept lane-dense (``[block_q, 128]``, every lane equal), ``lse = m + log2(l)``, ``+inf`` for a row
that sees no key (its output is 0).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import mosaic
from .schedule import EMPTY, FIRST, LAST, MASKED, forward_steps
from .tiling import Tiling, index_div
from .varying import out_struct


def _attend(
    q, k_ref, v_ref, acc_ref, m_ref, l_ref, *, keys, masked_at, tiling, scale, rows, fresh=False
):
    """One piece of keys (``keys``: a static slice of the key block) added to the online softmax
    of one head's query block, ``rows`` query rows at a time (unrolled). ``masked_at``: None, or
    ``(q_block, first_key)`` of the piece for its mask; ``scale``: turns ``q . k`` into base-2
    logits; ``fresh``: the run's first piece, unmasked (`_update`)."""
    for first_row in range(0, q.shape[0], rows):
        strip = pl.ds(first_row, rows)
        mask = None if masked_at is None else (masked_at[0], first_row, masked_at[1])
        _update(
            q[first_row : first_row + rows],
            k_ref,
            v_ref,
            acc_ref.at[strip],
            m_ref.at[strip],
            l_ref.at[strip],
            keys=keys,
            mask=mask,
            tiling=tiling,
            scale=scale,
            fresh=fresh,
        )


def _update(q, k_ref, v_ref, acc_ref, m_ref, l_ref, *, keys, mask, tiling, scale, fresh=False):
    """The online softmax of ``q``'s rows (``[rows, head_dim]``) after one piece of keys;
    ``mask``: None, or ``(q_block, first_row, first_key)`` placing the rows and keys for
    `piece_mask`. ``fresh``: the piece starts the run and has no mask, so the statistics and
    the accumulator are written from it alone, not read (nothing zeroed them)."""
    k = k_ref[keys, :]
    s = mosaic.dot(q, k, (1, 1)) * scale  # [rows, piece], float32
    if fresh:  # every row sees every key of an unmasked piece: its maximum is finite
        m_next = jnp.broadcast_to(jnp.max(s, axis=1, keepdims=True), m_ref.shape)
        p = jnp.exp2(s - mosaic.lanes_to(m_next, s.shape[1]))
        l_ref[...] = jnp.broadcast_to(jnp.sum(p, axis=1, keepdims=True), l_ref.shape)
        v = v_ref[keys, :]
        acc_ref[...] = mosaic.dot(p.astype(v.dtype), v, (1, 0))
        m_ref[...] = m_next
        return
    if mask is not None:
        q_block, first_row, first_key = mask
        visible = mosaic.piece_mask(tiling, q_block, first_key, s.shape, first_row=first_row)
        s = jnp.where(visible, s, -jnp.inf)
    m_prev = m_ref[...]  # [rows, LANES]
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    # A row that has seen only masked keys still has m = -inf, and exp2(-inf - (-inf)) is NaN;
    # subtracting 0 for it keeps its p and rescale at exactly 0.
    m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
    p = jnp.exp2(s - mosaic.lanes_to(m_safe, s.shape[1]))
    rescale = jnp.exp2(m_prev - m_safe)
    l_ref[...] = rescale * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
    v = v_ref[keys, :]
    acc_ref[...] = mosaic.lanes_to(rescale, acc_ref.shape[1]) * acc_ref[...] + mosaic.dot(
        p.astype(v.dtype), v, (1, 0)
    )
    m_ref[...] = m_next


def _forward_kernel(
    q_table,
    kv_table,
    head_table,
    flags_table,
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    lse_ref,
    acc_ref,
    m_ref,
    l_ref,
    *,
    tiling: Tiling,
    scale: float,
    block_k_compute: int,
    rows: int,
    group: int,
):
    del head_table
    t = pl.program_id(2)
    flags = flags_table[t]
    q_block, kv_block = q_table[t], kv_table[t]
    heads = q_ref.shape[0]  # the step's query heads; query head j reads kv head j // group
    first = (flags & FIRST) != 0
    # A run that starts on an unmasked pair writes its statistics from its first piece
    # (`_update`'s ``fresh``); one that starts masked, or computes nothing, starts from zeros.
    fresh_start = first & ((flags & (MASKED | EMPTY)) == 0)

    @pl.when(first & ~fresh_start)
    def _start():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)

    def make_attend():
        def attend(**piece):
            for j in range(heads):
                _attend(
                    q_ref[j],
                    k_ref.at[j // group],
                    v_ref.at[j // group],
                    acc_ref.at[j],
                    m_ref.at[j],
                    l_ref.at[j],
                    tiling=tiling,
                    scale=scale,
                    rows=rows,
                    **piece,
                )

        return attend

    mosaic.for_each_piece(
        make_attend,
        flags=flags,
        tiling=tiling,
        q_block=q_block,
        kv_block=kv_block,
        piece=block_k_compute,
        fresh_first=fresh_start,
    )

    @pl.when((flags & LAST) != 0)
    def _finish():
        for j in range(heads):
            row_sum = l_ref[j]
            # Only rows with no visible key have l = 0: a visible key adds exp2(0) = 1.
            sees_nothing = row_sum == 0.0
            inverse = 1.0 / jnp.where(sees_nothing, 1.0, row_sum)
            o_ref[j] = (acc_ref[j] * mosaic.lanes_to(inverse, o_ref.shape[-1])).astype(o_ref.dtype)
            lse = jnp.where(sees_nothing, jnp.inf, m_ref[j] + jnp.log2(row_sum))
            lse_ref[j] = lse[:, :1].T  # stored as a row (kernels/mosaic.py)


def forward(q, k, v, *, tiling: Tiling, scale: float, interpret: bool, tuning: mosaic.Tuning):
    """Padded inputs -> (o, lse), as `kernels.forward.forward`.

    q: [batch, q_padded, heads, head_dim]; k, v: [batch, kv_padded, kv_heads, head_dim].
    Returns o like q and lse float32 [batch, heads, q_padded] (base-2, scaled logits).
    ``interpret``: TPU interpret mode rather than Mosaic's compiler.
    """
    batch, q_padded, heads, head_dim = q.shape
    group = heads // k.shape[2]
    block_q, block_k = tiling.block_q, tiling.block_k
    block_k_compute = tuning.piece(block_k)
    rows = tuning.rows(block_q)
    steps = forward_steps(tiling)
    # A step computes `per_step` query heads over the kv heads they read (one, or per_step //
    # group): fewer, longer steps, whose DMAs and fixed cost serve several heads.
    per_step = tuning.heads_per_step(heads, group, block_q)
    kv_per_step = max(1, per_step // group)

    def q_index(b, h, t, q_table, kv_table, head_table, flags_table):
        return mosaic.index(b, h, q_table[t], 0)

    def kv_index(b, h, t, q_table, kv_table, head_table, flags_table):
        return mosaic.index(b, index_div(h * per_step, group * kv_per_step), kv_table[t], 0)

    def lse_index(b, h, t, q_table, kv_table, head_table, flags_table):
        return mosaic.index(b, h, 0, q_table[t])

    q_spec = pl.BlockSpec((None, per_step, block_q, head_dim), q_index)
    kv_spec = pl.BlockSpec((None, kv_per_step, block_k, head_dim), kv_index)
    lse_spec = pl.BlockSpec((None, per_step, 1, block_q), lse_index)
    qt, kt, vt = mosaic.heads_major(q), mosaic.heads_major(k), mosaic.heads_major(v)
    pairs = batch * heads * steps.computed_pairs()
    itemsize = q.dtype.itemsize
    o, lse = pl.pallas_call(
        functools.partial(
            _forward_kernel,
            tiling=tiling,
            scale=scale,
            block_k_compute=block_k_compute,
            rows=rows,
            group=group,
        ),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(batch, heads // per_step, len(steps)),
            in_specs=[q_spec, kv_spec, kv_spec],
            out_specs=[q_spec, lse_spec],
            scratch_shapes=[
                pltpu.VMEM((per_step, block_q, head_dim), jnp.float32),
                pltpu.VMEM((per_step, block_q, mosaic.LANES), jnp.float32),
                pltpu.VMEM((per_step, block_q, mosaic.LANES), jnp.float32),
            ],
        ),
        out_shape=[
            out_struct(qt.shape, q.dtype, like=qt),
            out_struct((batch, heads, 1, q_padded), jnp.float32, like=qt),
        ],
        interpret=mosaic.interpret_mode(interpret),
        compiler_params=tuning.compiler_params(3),
        cost_estimate=pl.CostEstimate(
            flops=4 * pairs * block_q * block_k * head_dim,
            transcendentals=pairs * block_q * block_k,
            bytes_accessed=itemsize * (2 * qt.size + pairs * 2 * block_k * head_dim),
        ),
        name="dew_flash_attention_forward",
    )(*(jnp.asarray(table) for table in steps.tables()), qt, kt, vt)
    return mosaic.heads_major(o), lse[:, :, 0]
