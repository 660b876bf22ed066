"""Mosaic TPU backward kernels: dq, and dk/dv, each accumulating over a sequential grid dimension.

The math is `kernels/backward.py`'s: with base-2 logits ``s = (q . k) * sm_scale * log2(e)`` and
the forward's base-2 ``lse``, ``p = exp2(s - lse)``; with ``delta = rowsum(dO * O) - d_lse``
(float32, computed once in XLA), ``ds = p * (dO . v - delta)`` and

    dq = sm_scale * ds @ k        grid (batch, heads, q_blocks, kv_blocks): the step (b, h, i, j)
                                  adds key block j's share to query block i's float32 scratch;
    dk = sm_scale * ds^T @ q      grid (batch, kv_heads, kv_blocks, group * q_blocks): the step
    dv = p^T @ dO                 (b, g, j, t) adds query block t % q_blocks of the group's head
                                  g * group + t // q_blocks to key block j's dk and dv scratch.

The dk/dv kernel computes ``s^T = k @ q^T`` (``[block_k, block_q]``): the lse and delta row
blocks broadcast over its rows as they are, and ``p^T @ dO``, ``ds^T @ q`` are plain matmuls.
Each program owns its output block (no atomics); under grouped queries one dk/dv program walks
all ``group`` query heads of its kv head. Block pairs with no visible (row, key) pair are not
computed; their steps fetch the next block the kernel needs instead (`kernels/mosaic.py`). A row
that saw no key has ``lse = +inf``, so ``p = 0`` and it contributes nothing.

With a window or segment ids the masked kernels run (`_dq_kernel_masked`, `_dkdv_kernel_masked`):
a block pair is computed, with its mask, where its rows see its keys by position
(`Tiling.kv_bounds`, `q_bounds`) and, with ids, where the two blocks' id ranges meet (SMEM
tables, `kernels.segments`); a pair skipped by its ids still fetches its blocks.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import mosaic, segments
from .mosaic import Tuning, as_rows, dot, heads_major, interpret_mode, mask
from .tiling import Tiling, as_index, block_index, index_div
from .varying import out_struct


def _probabilities(s, lse, visible):
    """``p = exp2(s - lse)`` of one block pair (float32), 0 where ``visible`` (None: everywhere
    visible) is False. ``s`` is ``[block_q, block_k]`` with an lse column, or transposed with an
    lse row."""
    if visible is not None:
        s = jnp.where(visible, s, -jnp.inf)
    return jnp.exp2(s - lse)


def _dq_kernel(*refs, tiling, scale, sm_scale, segmented: bool = False):
    if segmented or tiling.window is not None:
        return _dq_kernel_masked(
            *refs, tiling=tiling, scale=scale, sm_scale=sm_scale, segmented=segmented
        )
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, acc_ref = refs
    q_block, kv_block = pl.program_id(2), pl.program_id(3)

    @pl.when(kv_block == 0)
    def _start():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def attend(masked: bool):
        k = k_ref[...]
        s = dot(q_ref[...], k, (1, 1)) * scale  # [block_q, block_k]
        visible = mask(tiling, q_block, kv_block) if masked else None
        p = _probabilities(s, lse_ref[...].T, visible)  # the row blocks, as columns
        ds = p * (dot(do_ref[...], v_ref[...], (1, 1)) - delta_ref[...].T)
        acc_ref[...] += dot(ds.astype(k.dtype), k, (1, 0))

    n_full, n_visit = tiling.kv_range(q_block)
    pl.when(kv_block < n_full)(functools.partial(attend, False))
    pl.when(jnp.logical_and(kv_block >= n_full, kv_block < n_visit))(
        functools.partial(attend, True)
    )

    @pl.when(kv_block == tiling.kv_blocks - 1)
    def _finish():
        dq_ref[...] = (acc_ref[...] * sm_scale).astype(dq_ref.dtype)


def _dq_kernel_masked(*refs, tiling, scale, sm_scale, segmented: bool):
    """The dq kernel with a window or segment ids: the key blocks a query block sees by position
    (`Tiling.kv_bounds`) and, with segment ids, whose id range meets its own (SMEM tables,
    ``[batch * blocks]``) are computed, every one with its mask."""
    b, q_block, kv_block = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    lo, hi = tiling.kv_bounds(q_block)
    visits = jnp.logical_and(kv_block >= lo, kv_block < hi)
    if segmented:  # the range tables come first, the ids' blocks after the inputs
        q_lo, q_hi, kv_lo, kv_hi, *refs = refs
        q_tile, kv_tile = b * tiling.q_blocks + q_block, b * tiling.kv_blocks + kv_block
        meets = segments.overlaps(q_lo[q_tile], q_hi[q_tile], kv_lo[kv_tile], kv_hi[kv_tile])
        visits = jnp.logical_and(visits, meets)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *ids_refs, dq_ref, acc_ref = refs

    @pl.when(kv_block == 0)
    def _start():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(visits)
    def _attend():
        k = k_ref[...]
        s = dot(q_ref[...], k, (1, 1)) * scale  # [block_q, block_k]
        visible = mask(tiling, q_block, kv_block)
        if ids_refs:
            q_ids_ref, kv_ids_ref = ids_refs  # [block_q, LANES], [8, block_k]
            kv_ids = kv_ids_ref[0:1, :]
            same = mosaic.lanes_to(q_ids_ref[...], kv_ids.shape[1]) == kv_ids
            visible = jnp.logical_and(visible, same)
        p = _probabilities(s, lse_ref[...].T, visible)
        ds = p * (dot(do_ref[...], v_ref[...], (1, 1)) - delta_ref[...].T)
        acc_ref[...] += dot(ds.astype(k.dtype), k, (1, 0))

    @pl.when(kv_block == tiling.kv_blocks - 1)
    def _finish():
        dq_ref[...] = (acc_ref[...] * sm_scale).astype(dq_ref.dtype)


def visited_kv_block(tiling: Tiling, q_block, kv_block):
    """The key block a dq step fetches: ``kv_block`` when the query block sees any of it, else
    block 0, which the next query block reads first (a skipped step fetches nothing the kernel
    does not use; a run of them fetches it once). With a window: the nearest block in the
    query block's range (`Tiling.kv_bounds`): its first before it, its last (in VMEM already)
    after it. Blocks skipped by segment ids are still fetched."""
    if tiling.window is not None:
        lo, hi = tiling.kv_bounds(q_block)
        return jnp.clip(kv_block, lo, jnp.maximum(hi - 1, lo))
    if not tiling.causal:
        return kv_block
    _, n_visit = tiling.kv_range(q_block)
    return jnp.where(kv_block < n_visit, kv_block, as_index(0))


def _split_step(tiling: Tiling, step):
    """A dk/dv step -> (head within the group, query block): steps walk each head's blocks."""
    head = index_div(step, tiling.q_blocks)
    return head, as_index(step) - head * tiling.q_blocks


def visited_q_block(tiling: Tiling, kv_block, q_block):
    """The query block a dk/dv step fetches: ``q_block`` when it sees any of the key block, else
    the first that does, which the head's next computed step reads (skipped steps come before
    it). The clamp keeps the index in range for a key block no row sees (none: the last row sees
    every key, bottom-right alignment). With a window, steps past the last query block that sees
    the key block fetch that block again (in VMEM already)."""
    if tiling.window is not None:
        lo, hi = tiling.q_bounds(kv_block)
        lo = jnp.minimum(lo, tiling.q_blocks - 1)
        return jnp.clip(q_block, lo, jnp.maximum(hi - 1, lo))
    if not tiling.causal:
        return q_block
    first, _ = tiling.q_range(kv_block)
    first = jnp.minimum(first, tiling.q_blocks - 1)
    return jnp.where(q_block < first, first, q_block)


def _dkdv_kernel(*refs, tiling, scale, sm_scale, steps: int, segmented: bool = False):
    if segmented or tiling.window is not None:
        return _dkdv_kernel_masked(
            *refs, tiling=tiling, scale=scale, sm_scale=sm_scale, steps=steps, segmented=segmented
        )
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, dk_acc, dv_acc = refs
    kv_block, step = pl.program_id(2), pl.program_id(3)
    _, q_block = _split_step(tiling, step)

    @pl.when(step == 0)
    def _start():
        dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
        dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

    def attend(masked: bool):
        q, do = q_ref[...], do_ref[...]
        s_t = dot(k_ref[...], q, (1, 1)) * scale  # [block_k, block_q]
        visible = mask(tiling, q_block, kv_block, keys_first=True) if masked else None
        p_t = _probabilities(s_t, lse_ref[...], visible)  # lse row [1, block_q]
        dv_acc[...] += dot(p_t.astype(do.dtype), do, (1, 0))
        ds_t = p_t * (dot(v_ref[...], do, (1, 1)) - delta_ref[...])
        dk_acc[...] += dot(ds_t.astype(q.dtype), q, (1, 0))

    first, first_full = tiling.q_range(kv_block)
    pl.when(jnp.logical_and(q_block >= first, q_block < first_full))(
        functools.partial(attend, True)
    )
    pl.when(q_block >= first_full)(functools.partial(attend, False))

    @pl.when(step == steps - 1)
    def _finish():
        dk_ref[...] = (dk_acc[...] * sm_scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def _dkdv_kernel_masked(*refs, tiling, scale, sm_scale, steps: int, segmented: bool):
    """The dk/dv kernel with a window or segment ids: as `_dq_kernel_masked`, transposed."""
    b, kv_block, step = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    _, q_block = _split_step(tiling, step)
    lo, hi = tiling.q_bounds(kv_block)
    visits = jnp.logical_and(q_block >= lo, q_block < hi)
    if segmented:  # the range tables come first, the ids' blocks after the inputs
        q_lo, q_hi, kv_lo, kv_hi, *refs = refs
        q_tile, kv_tile = b * tiling.q_blocks + q_block, b * tiling.kv_blocks + kv_block
        meets = segments.overlaps(q_lo[q_tile], q_hi[q_tile], kv_lo[kv_tile], kv_hi[kv_tile])
        visits = jnp.logical_and(visits, meets)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *ids_refs, dk_ref, dv_ref = refs[:-2]
    dk_acc, dv_acc = refs[-2:]

    @pl.when(step == 0)
    def _start():
        dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
        dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

    @pl.when(visits)
    def _attend():
        q, do = q_ref[...], do_ref[...]
        s_t = dot(k_ref[...], q, (1, 1)) * scale  # [block_k, block_q]
        visible = mask(tiling, q_block, kv_block, keys_first=True)
        if ids_refs:
            kv_ids_ref, q_ids_ref = ids_refs  # [block_k, LANES], [8, block_q]
            q_ids = q_ids_ref[0:1, :]
            same = mosaic.lanes_to(kv_ids_ref[...], q_ids.shape[1]) == q_ids
            visible = jnp.logical_and(visible, same)
        p_t = _probabilities(s_t, lse_ref[...], visible)
        dv_acc[...] += dot(p_t.astype(do.dtype), do, (1, 0))
        ds_t = p_t * (dot(v_ref[...], do, (1, 1)) - delta_ref[...])
        dk_acc[...] += dot(ds_t.astype(q.dtype), q, (1, 0))

    @pl.when(step == steps - 1)
    def _finish():
        dk_ref[...] = (dk_acc[...] * sm_scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


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
    tuning: Tuning,
    d_lse=None,
    segment_ids=None,
):
    """Padded residuals and cotangent -> (dq, dk, dv), as `kernels.backward.backward`.

    q, o, do: [batch, q_padded, heads, head_dim]; k, v: [batch, kv_padded, kv_heads, head_dim];
    lse: float32 [batch, heads, q_padded] (base 2, as the forward saves it); d_lse: None or
    float32 [batch, heads, q_padded], the cotangent of the natural-log lse (0 on padded rows);
    segment_ids: None or padded ``(q_ids, kv_ids)``.
    ``interpret``: TPU interpret mode rather than Mosaic's compiler; ``tuning``: its VMEM limit
    (the long blocks' dk/dv kernel needs more than the compiler's default 16 MiB).
    """
    batch, _, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    block_q, block_k = tiling.block_q, tiling.block_k
    delta = jnp.einsum(
        "bqhd,bqhd->bhq",
        do.astype(jnp.float32),
        o.astype(jnp.float32),
        precision=lax.Precision.HIGHEST,  # a TPU's default would round them to bfloat16
    )
    if d_lse is not None:
        delta = delta - d_lse
    qt, kt, vt, dot_ = (heads_major(x) for x in (q, k, v, do))
    lse, delta = as_rows(lse), as_rows(delta)  # [batch, heads, 1, q_padded]
    segmented = segment_ids is not None
    tables, dq_ids, dkdv_ids = [], [], []
    if segmented:
        q_ids, kv_ids = segment_ids
        tables = [
            segments.flat(x)
            for x in (
                *segments.tile_ranges(q_ids, block_q),
                *segments.tile_ranges(kv_ids, block_k),
            )
        ]
        dq_ids = [segments.lanes(q_ids), segments.rows(kv_ids)]
        dkdv_ids = [segments.lanes(kv_ids), segments.rows(q_ids)]

    def call(kernel, grid, in_specs, out_specs, scratch_shapes, **kwargs):
        """A pallas_call over ``grid``: with segment ids, its four range tables as scalar
        prefetch (the index maps then take them too, and ignore them)."""
        common = dict(
            interpret=interpret_mode(interpret),
            compiler_params=tuning.compiler_params(4),
            **kwargs,
        )
        if not segmented:
            return pl.pallas_call(
                kernel,
                grid=grid,
                in_specs=in_specs,
                out_specs=out_specs,
                scratch_shapes=scratch_shapes,
                **common,
            )
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(tables),
            grid=grid,
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=scratch_shapes,
        )
        return lambda *args: pl.pallas_call(kernel, grid_spec=grid_spec, **common)(*tables, *args)

    q_spec = pl.BlockSpec(
        (None, None, block_q, head_dim), lambda b, h, i, j, *_: block_index(b, h, i, 0)
    )
    rows_spec = pl.BlockSpec(
        (None, None, 1, block_q), lambda b, h, i, j, *_: block_index(b, h, 0, i)
    )
    kv_spec = pl.BlockSpec(
        (None, None, block_k, head_dim),
        lambda b, h, i, j, *_: block_index(
            b, index_div(h, group), visited_kv_block(tiling, i, j), 0
        ),
    )
    id_specs = []
    if segmented:
        id_specs = [
            pl.BlockSpec(
                (None, block_q, segments.LANES), lambda b, h, i, j, *_: block_index(b, i, 0)
            ),
            pl.BlockSpec(
                (None, segments.SUBLANES, block_k),
                lambda b, h, i, j, *_: block_index(b, 0, visited_kv_block(tiling, i, j)),
            ),
        ]
    dq = call(
        functools.partial(
            _dq_kernel, tiling=tiling, scale=scale, sm_scale=sm_scale, segmented=segmented
        ),
        (batch, heads, tiling.q_blocks, tiling.kv_blocks),
        [q_spec, kv_spec, kv_spec, q_spec, rows_spec, rows_spec, *id_specs],
        q_spec,
        [pltpu.VMEM((block_q, head_dim), jnp.float32)],
        out_shape=out_struct(qt.shape, q.dtype, like=qt),
        name="dew_flash_attention_dq",
    )(qt, kt, vt, dot_, lse, delta, *dq_ids)

    steps = group * tiling.q_blocks

    def q_head_and_block(b, g, j, t):
        head, i = _split_step(tiling, t)
        return b, g * group + head, visited_q_block(tiling, j, i)

    q_group_spec = pl.BlockSpec(
        (None, None, block_q, head_dim),
        lambda b, g, j, t, *_: block_index(*q_head_and_block(b, g, j, t), 0),
    )

    def rows_index(b, g, j, t, *_):
        b, h, i = q_head_and_block(b, g, j, t)
        return block_index(b, h, 0, i)

    rows_group_spec = pl.BlockSpec((None, None, 1, block_q), rows_index)
    kv_block_spec = pl.BlockSpec(
        (None, None, block_k, head_dim), lambda b, g, j, t, *_: block_index(b, g, j, 0)
    )
    id_specs = []
    if segmented:
        id_specs = [
            pl.BlockSpec(
                (None, block_k, segments.LANES), lambda b, g, j, t, *_: block_index(b, j, 0)
            ),
            pl.BlockSpec(
                (None, segments.SUBLANES, block_q),
                lambda b, g, j, t, *_: block_index(b, 0, q_head_and_block(b, g, j, t)[2]),
            ),
        ]
    dk, dv = call(
        functools.partial(
            _dkdv_kernel,
            tiling=tiling,
            scale=scale,
            sm_scale=sm_scale,
            steps=steps,
            segmented=segmented,
        ),
        (batch, kv_heads, tiling.kv_blocks, steps),
        [
            q_group_spec,
            kv_block_spec,
            kv_block_spec,
            q_group_spec,
            rows_group_spec,
            rows_group_spec,
            *id_specs,
        ],
        [kv_block_spec, kv_block_spec],
        [pltpu.VMEM((block_k, head_dim), jnp.float32)] * 2,
        out_shape=[out_struct(kt.shape, k.dtype, like=kt), out_struct(vt.shape, v.dtype, like=vt)],
        name="dew_flash_attention_dkdv",
    )(qt, kt, vt, dot_, lse, delta, *dkdv_ids)
    return heads_major(dq), heads_major(dk), heads_major(dv)
