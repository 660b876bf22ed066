"""Mosaic TPU backward in one kernel: dk, dv and dq from one pass over the visible block pairs.

The two-kernel backward (`kernels.mosaic_backward`) recomputes the logits and ``dO . v^T`` in
each of its kernels: seven block matmuls a pair. Here one kernel does the five a pair needs,

    s^T  = k q^T           p^T = exp2(s^T - lse)        dv += p^T dO
    dp^T = v dO^T          ds^T = p^T (dp^T - delta)    dk += ds^T q      dq += (ds^T)^T k

(base-2 logits and ``lse`` as the forward saves them; ``delta = rowsum(dO * O) - d_lse``, float32),
and keeps dq for all of a kv head's query rows in float32 VMEM across the walk, so nothing is
summed in HBM. That costs ``group * q_padded * head_dim * 4`` bytes of VMEM (4 MiB at 8k rows,
head_dim 128, no grouping), which `kernels.attention` checks before choosing this kernel; past it,
the two-kernel backward runs.

``delta`` is computed in the kernel, each step, from the O block it reads beside dO's. Computed
once in XLA it is a pass of its own over O and dO in HBM: at 16k tokens x 2048 channels in
bfloat16, 128 MiB, at least 0.16 ms at a v5e's 819 GB/s. In the kernel its products and sums take
VPU slots in the bundles the MXUs' work already fills (compiled for v5e, 1% more bundles at 4096
keys without a mask), and the O block's DMA runs behind the compute.

Grid ``(batch, kv_heads, steps)``, the last dimension sequential: it walks `kernels.schedule`'s
table, each key block's visible query blocks in a run, head by head over the ``group`` query
heads that share the kv head. dk and dv of a key block accumulate in float32 scratch over its run
and are written at its end; dq is written once, at the walk's last step, as one block holding
the group's heads whole. Inside a step the key block is computed ``backward_block_k_compute``
keys at a time (unrolled), and only pairs marked ``MASKED`` build a mask. With segment ids
(`kernels.segments`) a step whose blocks' id ranges cannot meet computes nothing and fetches the
next computed step's blocks, a piece whose ids cannot meet the query block's is skipped, and every
piece computed masks the pairs of unequal ids.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import mosaic, segments
from .schedule import EMPTY, FIRST, LAST, backward_steps
from .tiling import Tiling
from .varying import out_struct

# Scoped VMEM the kernel needs beside its dq accumulator and dq block, at the largest blocks the
# platform's defaults and the benchmark's sweep use (1024 x 2048, head_dim up to 256):
# double-buffered q, dO, O, k, v, dk and dv blocks, float32 dk and dv scratch, and the [piece,
# block_q] float32 temporaries of the logits, probabilities and their gradients.
WORKING_BYTES = 24 << 20


def dq_bytes(tiling: Tiling, group: int, head_dim: int, itemsize: int) -> int:
    """VMEM held for dq across a kv head's walk: the float32 accumulator and the double-buffered
    output block in the inputs' dtype."""
    rows = group * tiling.q_blocks * tiling.block_q * head_dim
    return rows * (4 + 2 * itemsize)


def delta_row(o, do):
    """``rowsum(o * do)`` of a query block (``[block_q, head_dim]`` each) as a float32 row
    ``[1, block_q]``, the layout the keys-first logits broadcast it in. The products of two
    bfloat16 values are exact in float32."""
    products = o.astype(jnp.float32) * do.astype(jnp.float32)
    return jnp.sum(products, axis=1, keepdims=True).T


def _attend(
    q,
    do,
    lse,
    delta,
    refs,
    *,
    keys,
    q_rows,
    head,
    masked_at,
    tiling: Tiling,
    scale: float,
    same_id=None,
):
    """One piece of keys (``keys``, a static slice of the key block) against one query block:
    its share of dk, dv and of the query block's dq. ``same_id``: None, or ``same_id(keys)``
    gives bool ``[piece, block_q]``, the pairs of equal segment ids."""
    k_ref, v_ref, dk_acc, dv_acc, dq_acc = refs
    k = k_ref[keys, :]
    s_t = mosaic.dot(k, q, (1, 1)) * scale  # [piece, block_q], base-2 logits
    if masked_at is not None or same_id is not None:
        visible = None
        if masked_at is not None:
            q_block, first_key = masked_at
            visible = mosaic.piece_mask(tiling, q_block, first_key, s_t.shape, keys_first=True)
        if same_id is not None:
            ids = same_id(keys)
            visible = ids if visible is None else jnp.logical_and(visible, ids)
        s_t = jnp.where(visible, s_t, -jnp.inf)
    p_t = jnp.exp2(s_t - lse)  # the lse row broadcasts over the keys
    dv_acc[keys, :] += mosaic.dot(p_t.astype(do.dtype), do, (1, 0))
    ds_t = p_t * (mosaic.dot(v_ref[keys, :], do, (1, 1)) - delta)
    ds_t = ds_t.astype(q.dtype)
    dk_acc[keys, :] += mosaic.dot(ds_t, q, (1, 0))
    dq_acc[head, q_rows, :] += mosaic.dot(ds_t, k, (0, 0))


def _backward_kernel(
    *refs,
    tiling: Tiling,
    scale: float,
    sm_scale: float,
    piece: int,
    steps: int,
    has_d_lse: bool,
    segmented: bool,
):
    # Scalar prefetch: the step tables (and with segment ids `segments_for_backward`'s), then
    # q, k, v, dO, O, lse (and d_lse, and the ids' blocks), dq, dk, dv, and the scratch.
    n_tables = 4 + (5 if segmented else 0)
    tables, refs = refs[:n_tables], refs[n_tables:]
    q_table, kv_table, head_table, flags_table = tables[:4]
    q_ref, k_ref, v_ref, do_ref, o_ref, lse_ref = refs[:6]
    refs = refs[6:]
    d_lse_ref, refs = (refs[0], refs[1:]) if has_d_lse else (None, refs)
    ids_refs, refs = (refs[:2], refs[2:]) if segmented else (None, refs)
    dq_ref, dk_ref, dv_ref, dk_acc, dv_acc, dq_acc = refs
    t = pl.program_id(2)
    flags = flags_table[t]
    q_block, kv_block, head = q_table[t], kv_table[t], head_table[t]

    @pl.when(t == 0)
    def _start_walk():
        dq_acc[...] = jnp.zeros(dq_acc.shape, jnp.float32)

    @pl.when((flags & FIRST) != 0)
    def _start_key_block():
        dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
        dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

    skip = {}
    if segmented:
        skip = _segments(tables[4:], tiling, piece, q_block, kv_block)

    def make_attend():
        q_rows = pl.ds(pl.multiple_of(q_block * tiling.block_q, 8), tiling.block_q)
        do = do_ref[...]
        delta = delta_row(o_ref[...], do)  # [1, block_q]
        if d_lse_ref is not None:
            delta = delta - d_lse_ref[...]
        same_id = {}
        if segmented:
            kv_ids_ref, q_ids_ref = ids_refs
            q_ids = q_ids_ref[0:1, :]  # [1, block_q]

            def ids_match(keys):  # [piece, block_q]: the keys' ids across lanes, the queries' row
                return mosaic.lanes_to(kv_ids_ref[keys, :], q_ids.shape[1]) == q_ids

            same_id = {"same_id": ids_match}
        return functools.partial(
            _attend,
            q_ref[...],
            do,
            lse_ref[...],  # [1, block_q], base 2
            delta,
            (k_ref, v_ref, dk_acc, dv_acc, dq_acc),
            q_rows=q_rows,
            head=head,
            tiling=tiling,
            scale=scale,
            **same_id,
        )

    mosaic.for_each_piece(
        make_attend,
        flags=flags,
        tiling=tiling,
        q_block=q_block,
        kv_block=kv_block,
        piece=piece,
        **skip,
    )

    @pl.when((flags & LAST) != 0)
    def _finish_key_block():
        dk_ref[...] = (dk_acc[...] * sm_scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)

    @pl.when(t == steps - 1)
    def _finish_walk():
        dq_ref[...] = (dq_acc[...] * sm_scale).astype(dq_ref.dtype)


def _segments(tables, tiling: Tiling, piece: int, q_block, kv_block) -> dict:
    """`mosaic.for_each_piece`'s ``step_seen`` and ``piece_seen`` of a step with segment ids:
    the step computes where its fetch table names itself (`segments.fetch_steps`), a piece where
    its id range meets the query block's (SMEM tables)."""
    fetch, q_lo, q_hi, kv_lo, kv_hi = tables
    b, t = pl.program_id(0), pl.program_id(2)
    pieces = tiling.block_k // piece
    q_tile = b * tiling.q_blocks + q_block

    def piece_seen(n):
        kv_tile = b * tiling.kv_blocks * pieces + kv_block * pieces + n
        return segments.overlaps(q_lo[q_tile], q_hi[q_tile], kv_lo[kv_tile], kv_hi[kv_tile])

    return {"step_seen": fetch[b * pl.num_programs(2) + t] == t, "piece_seen": piece_seen}


def segments_for_backward(ids, steps, tiling: Tiling, piece: int):
    """The fused backward's segment tables (``fetch, q_lo, q_hi, kv_lo, kv_hi``: flat int32,
    per batch row: the step each step fetches, and the id ranges of the query blocks and the key
    pieces) and the ids' blocks' arrays (key ids across lanes, query ids as rows), from padded
    ``(q_ids, kv_ids)``."""
    q_ids, kv_ids = ids
    q_lo, q_hi = segments.tile_ranges(q_ids, tiling.block_q)
    kv_lo, kv_hi = segments.tile_ranges(kv_ids, piece)
    kv_block_lo, kv_block_hi = segments.tile_ranges(kv_ids, tiling.block_k)
    computes = segments.overlaps(
        q_lo[:, steps.q_block],
        q_hi[:, steps.q_block],
        kv_block_lo[:, steps.kv_block],
        kv_block_hi[:, steps.kv_block],
    ) & jnp.asarray((steps.flags & EMPTY) == 0)
    tables = [segments.fetch_steps(computes), q_lo, q_hi, kv_lo, kv_hi]
    return [segments.flat(x) for x in tables], [segments.lanes(kv_ids), segments.rows(q_ids)]


def backward(
    q,
    k,
    v,
    o,
    lse,
    do,
    *,
    tiling: Tiling,
    scale: float,
    sm_scale: float,
    interpret: bool,
    tuning: mosaic.Tuning,
    d_lse=None,
    segment_ids=None,
):
    """Padded residuals and cotangent -> (dq, dk, dv), as `kernels.mosaic_backward.backward`.

    q, o, do: [batch, q_padded, heads, head_dim]; k, v: [batch, kv_padded, kv_heads, head_dim];
    lse: float32 [batch, heads, q_padded] (base 2, as the forward saves it); d_lse: None or
    float32 [batch, heads, q_padded], the cotangent of the natural-log lse (0 on padded rows);
    segment_ids: None or padded ``(q_ids, kv_ids)``.
    """
    batch, q_padded, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    block_q, block_k = tiling.block_q, tiling.block_k
    piece = tuning.backward_piece(block_k)
    steps = backward_steps(tiling, group)
    n_steps = len(steps)
    qt, kt, vt, dot_, ot = (mosaic.heads_major(x) for x in (q, k, v, do, o))
    # [batch, heads, 1, q_padded] each: the lse and, where it is given, the lse's cotangent
    rows = [mosaic.as_rows(lse)] + ([] if d_lse is None else [mosaic.as_rows(d_lse)])
    segment_tables, id_blocks = [], []
    if segment_ids is not None:
        segment_tables, id_blocks = segments_for_backward(segment_ids, steps, tiling, piece)

    def fetched(b, t, tables):
        """The step whose input blocks step t reads (with segment ids: its fetch table's)."""
        return tables[4][b * n_steps + t] if segment_tables else t

    def q_index(b, g, t, *tables):
        f = fetched(b, t, tables)
        return mosaic.index(b, g * group + tables[2][f], tables[0][f], 0)

    def rows_index(b, g, t, *tables):
        f = fetched(b, t, tables)
        return mosaic.index(b, g * group + tables[2][f], 0, tables[0][f])

    def kv_index(b, g, t, *tables):
        return mosaic.index(b, g, tables[1][fetched(b, t, tables)], 0)

    def kv_out_index(b, g, t, *tables):
        return mosaic.index(b, g, tables[1][t], 0)

    def dq_index(b, g, t, *tables):
        return mosaic.index(b, g, 0, 0)

    q_spec = pl.BlockSpec((None, None, block_q, head_dim), q_index)
    rows_spec = pl.BlockSpec((None, None, 1, block_q), rows_index)
    kv_spec = pl.BlockSpec((None, None, block_k, head_dim), kv_index)
    kv_out_spec = pl.BlockSpec((None, None, block_k, head_dim), kv_out_index)
    dq_spec = pl.BlockSpec((None, group, q_padded, head_dim), dq_index)
    id_specs = []
    if segment_tables:
        id_specs = [
            pl.BlockSpec(
                (None, block_k, segments.LANES),
                lambda b, g, t, *tables: mosaic.index(b, tables[1][fetched(b, t, tables)], 0),
            ),
            pl.BlockSpec(
                (None, segments.SUBLANES, block_q),
                lambda b, g, t, *tables: mosaic.index(b, 0, tables[0][fetched(b, t, tables)]),
            ),
        ]
    pairs = batch * kv_heads * steps.computed_pairs()  # with segment ids, at most this many
    itemsize = q.dtype.itemsize
    dq, dk, dv = pl.pallas_call(
        functools.partial(
            _backward_kernel,
            tiling=tiling,
            scale=scale,
            sm_scale=sm_scale,
            piece=piece,
            steps=n_steps,
            has_d_lse=d_lse is not None,
            segmented=segment_ids is not None,
        ),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4 + len(segment_tables),
            grid=(batch, kv_heads, n_steps),
            in_specs=[q_spec, kv_spec, kv_spec, q_spec, q_spec]
            + [rows_spec] * len(rows)
            + id_specs,
            out_specs=[dq_spec, kv_out_spec, kv_out_spec],
            scratch_shapes=[
                pltpu.VMEM((block_k, head_dim), jnp.float32),
                pltpu.VMEM((block_k, head_dim), jnp.float32),
                pltpu.VMEM((group, q_padded, head_dim), jnp.float32),
            ],
        ),
        out_shape=[
            out_struct(qt.shape, q.dtype, like=qt),
            out_struct(kt.shape, k.dtype, like=kt),
            out_struct(vt.shape, v.dtype, like=vt),
        ],
        interpret=mosaic.interpret_mode(interpret),
        compiler_params=tuning.compiler_params(3),
        cost_estimate=pl.CostEstimate(
            flops=10 * pairs * block_q * block_k * head_dim,
            transcendentals=pairs * block_q * block_k,
            bytes_accessed=itemsize * (4 * kt.size + 2 * qt.size + pairs * 3 * block_q * head_dim),
        ),
        name="dew_flash_attention_backward",
    )(
        *(jnp.asarray(table) for table in steps.tables()),
        *segment_tables,
        qt,
        kt,
        vt,
        dot_,
        ot,
        *rows,
        *id_blocks,
    )
    return mosaic.heads_major(dq), mosaic.heads_major(dk), mosaic.heads_major(dv)


def fits(tiling: Tiling, group: int, head_dim: int, itemsize: int, tuning: mosaic.Tuning) -> bool:
    """Whether the fused kernel's dq stays within the tuning's VMEM (beside its working set)."""
    if not tuning.fused_backward:
        return False
    limit = tuning.vmem_limit_bytes
    if limit is None:
        return False
    return WORKING_BYTES + dq_bytes(tiling, group, head_dim, itemsize) <= limit
