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
keys at a time (unrolled), and only pairs marked ``MASKED`` build a mask.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import mosaic
from .schedule import FIRST, LAST, backward_steps
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
):
    """One piece of keys (``keys``, a static slice of the key block) against one query block:
    its share of dk, dv and of the query block's dq."""
    k_ref, v_ref, dk_acc, dv_acc, dq_acc = refs
    k = k_ref[keys, :]
    s_t = mosaic.dot(k, q, (1, 1)) * scale  # [piece, block_q], base-2 logits
    if masked_at is not None:
        q_block, first_key = masked_at
        visible = mosaic.piece_mask(tiling, q_block, first_key, s_t.shape, keys_first=True)
        s_t = jnp.where(visible, s_t, -jnp.inf)
    p_t = jnp.exp2(s_t - lse)  # the lse row broadcasts over the keys
    dv_acc[keys, :] += mosaic.dot(p_t.astype(do.dtype), do, (1, 0))
    ds_t = p_t * (mosaic.dot(v_ref[keys, :], do, (1, 1)) - delta)
    ds_t = ds_t.astype(q.dtype)
    dk_acc[keys, :] += mosaic.dot(ds_t, q, (1, 0))
    dq_acc[head, q_rows, :] += mosaic.dot(ds_t, k, (0, 0))


def _backward_kernel(
    q_table,
    kv_table,
    head_table,
    flags_table,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    o_ref,
    lse_ref,
    *refs,
    tiling: Tiling,
    scale: float,
    sm_scale: float,
    piece: int,
    steps: int,
    has_d_lse: bool,
):
    d_lse_ref = refs[0] if has_d_lse else None
    dq_ref, dk_ref, dv_ref, dk_acc, dv_acc, dq_acc = refs[1:] if has_d_lse else refs
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

    def make_attend():
        q_rows = pl.ds(pl.multiple_of(q_block * tiling.block_q, 8), tiling.block_q)
        do = do_ref[...]
        delta = delta_row(o_ref[...], do)  # [1, block_q]
        if d_lse_ref is not None:
            delta = delta - d_lse_ref[...]
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
        )

    mosaic.for_each_piece(
        make_attend, flags=flags, tiling=tiling, q_block=q_block, kv_block=kv_block, piece=piece
    )

    @pl.when((flags & LAST) != 0)
    def _finish_key_block():
        dk_ref[...] = (dk_acc[...] * sm_scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)

    @pl.when(t == steps - 1)
    def _finish_walk():
        dq_ref[...] = (dq_acc[...] * sm_scale).astype(dq_ref.dtype)


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
):
    """Padded residuals and cotangent -> (dq, dk, dv), as `kernels.mosaic_backward.backward`.

    q, o, do: [batch, q_padded, heads, head_dim]; k, v: [batch, kv_padded, kv_heads, head_dim];
    lse: float32 [batch, heads, q_padded] (base 2, as the forward saves it); d_lse: None or
    float32 [batch, heads, q_padded], the cotangent of the natural-log lse (0 on padded rows).
    """
    batch, q_padded, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    block_q, block_k = tiling.block_q, tiling.block_k
    piece = tuning.backward_piece(block_k)
    steps = backward_steps(tiling, group)
    qt, kt, vt, dot_, ot = (mosaic.heads_major(x) for x in (q, k, v, do, o))
    # [batch, heads, 1, q_padded] each: the lse and, where it is given, the lse's cotangent
    rows = [mosaic.as_rows(lse)] + ([] if d_lse is None else [mosaic.as_rows(d_lse)])

    def q_index(b, g, t, q_table, kv_table, head_table, flags_table):
        return mosaic.index(b, g * group + head_table[t], q_table[t], 0)

    def rows_index(b, g, t, q_table, kv_table, head_table, flags_table):
        return mosaic.index(b, g * group + head_table[t], 0, q_table[t])

    def kv_index(b, g, t, q_table, kv_table, head_table, flags_table):
        return mosaic.index(b, g, kv_table[t], 0)

    def dq_index(b, g, t, q_table, kv_table, head_table, flags_table):
        return mosaic.index(b, g, 0, 0)

    q_spec = pl.BlockSpec((None, None, block_q, head_dim), q_index)
    rows_spec = pl.BlockSpec((None, None, 1, block_q), rows_index)
    kv_spec = pl.BlockSpec((None, None, block_k, head_dim), kv_index)
    dq_spec = pl.BlockSpec((None, group, q_padded, head_dim), dq_index)
    pairs = batch * kv_heads * steps.computed_pairs()
    itemsize = q.dtype.itemsize
    dq, dk, dv = pl.pallas_call(
        functools.partial(
            _backward_kernel,
            tiling=tiling,
            scale=scale,
            sm_scale=sm_scale,
            piece=piece,
            steps=len(steps),
            has_d_lse=d_lse is not None,
        ),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(batch, kv_heads, len(steps)),
            in_specs=[q_spec, kv_spec, kv_spec, q_spec, q_spec] + [rows_spec] * len(rows),
            out_specs=[dq_spec, kv_spec, kv_spec],
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
    )(*(jnp.asarray(table) for table in steps.tables()), qt, kt, vt, dot_, ot, *rows)
    return mosaic.heads_major(dq), mosaic.heads_major(dk), mosaic.heads_major(dv)


def fits(tiling: Tiling, group: int, head_dim: int, itemsize: int, tuning: mosaic.Tuning) -> bool:
    """Whether the fused kernel's dq stays within the tuning's VMEM (beside its working set)."""
    if not tuning.fused_backward:
        return False
    limit = tuning.vmem_limit_bytes
    if limit is None:
        return False
    return WORKING_BYTES + dq_bytes(tiling, group, head_dim, itemsize) <= limit
