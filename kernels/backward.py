"""Backward kernels: dq, and dk/dv, both recomputing the probabilities from the saved lse.

With base-2 logits ``s = (q . k) * sm_scale * log2(e)`` and the forward's ``lse``, the softmax is
recomputed blockwise as ``p = exp2(s - lse)`` (no second online pass needed). With
``delta = rowsum(dO * O) - d_lse`` (computed once in float32, outside the kernels, and read by
both; ``d_lse`` is the cotangent of the natural-log lse, zero when there is none) the gradient of
the natural-log logits is ``ds = p * (dO . v - delta)``, and

    dq = sm_scale * ds @ k        (one program per query block: loops over key blocks)
    dk = sm_scale * ds^T @ q      (one program per key block: loops over query blocks,
    dv = p^T @ dO                  and over the ``group`` query heads that share its kv head)

Splitting dq from dk/dv lets each program own its output block: no atomics, no second pass.
A row that saw no key has ``lse = +inf``, so ``p = 0`` and it contributes nothing.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl

from .forward import dot, segment_specs
from .loop import block_loop
from .tiling import Tiling, block_index, index_div
from .varying import out_struct


def _dq_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dq_ref,
    *,
    tiling: Tiling,
    scale: float,
    sm_scale: float,
):
    q_block = tiling.q_block_of_program(pl.program_id(0))
    q = q_ref[...]
    do = do_ref[...]
    lse = lse_ref[...]
    delta = delta_ref[...]
    block_k = tiling.block_k

    def visit(kv_block, dq, masked: bool):
        keys = pl.ds(kv_block * block_k, block_k)
        k = k_ref[keys, :]
        v = v_ref[keys, :]
        s = dot(q, k, (1, 1)) * scale
        if masked:
            s = jnp.where(tiling.mask(q_block, kv_block), s, -jnp.inf)
        p = jnp.exp2(s - lse[:, None])
        ds = p * (dot(do, v, (1, 1)) - delta[:, None])
        return dq + dot(ds.astype(k.dtype), k, (1, 0))

    n_full, n_visit = tiling.kv_range(q_block)
    dq = jnp.zeros(q.shape, jnp.float32)
    dq = block_loop(0, n_full, functools.partial(visit, masked=False), dq)
    dq = block_loop(n_full, n_visit, functools.partial(visit, masked=True), dq)
    dq_ref[...] = (dq * sm_scale).astype(dq_ref.dtype)


def _dq_kernel_masked(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, tiling: Tiling, scale, sm_scale
):
    """The dq kernel with a window or segment ids: the key blocks of
    `kernels.forward._forward_kernel_masked`, each with its mask."""
    *ids_refs, dq_ref = refs
    q_block = tiling.q_block_of_program(pl.program_id(0))
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    block_k = tiling.block_k
    lo, hi = tiling.kv_bounds(q_block)
    if ids_refs:
        q_ids_ref, kv_ids_ref, bounds_ref = ids_refs
        q_ids = q_ids_ref[...]
        lo, hi = jnp.maximum(lo, bounds_ref[0]), jnp.minimum(hi, bounds_ref[1])

    def visit(kv_block, dq):
        keys = pl.ds(kv_block * block_k, block_k)
        k = k_ref[keys, :]
        s = dot(q, k, (1, 1)) * scale
        visible = tiling.mask(q_block, kv_block)
        if ids_refs:
            visible = jnp.logical_and(visible, q_ids[:, None] == kv_ids_ref[keys][None, :])
        p = jnp.exp2(jnp.where(visible, s, -jnp.inf) - lse[:, None])
        ds = p * (dot(do, v_ref[keys, :], (1, 1)) - delta[:, None])
        return dq + dot(ds.astype(k.dtype), k, (1, 0))

    dq = block_loop(lo, hi, visit, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * sm_scale).astype(dq_ref.dtype)


def _dkdv_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dk_ref,
    dv_ref,
    *,
    tiling: Tiling,
    group: int,
    scale: float,
    sm_scale: float,
):
    kv_block = pl.program_id(0)
    k = k_ref[...]  # [block_k, head_dim]
    v = v_ref[...]
    block_q = tiling.block_q

    def visit(q_block, carry, head, masked: bool):
        dk, dv = carry
        rows = pl.ds(q_block * block_q, block_q)
        q = q_ref[rows, head, :]
        do = do_ref[rows, head, :]
        lse = lse_ref[head, rows]
        delta = delta_ref[head, rows]
        s = dot(q, k, (1, 1)) * scale
        if masked:
            s = jnp.where(tiling.mask(q_block, kv_block), s, -jnp.inf)
        p = jnp.exp2(s - lse[:, None])  # [block_q, block_k]
        dv = dv + dot(p.astype(do.dtype), do, (0, 0))
        ds = p * (dot(do, v, (1, 1)) - delta[:, None])
        dk = dk + dot(ds.astype(q.dtype), q, (0, 0))
        return dk, dv

    first, first_full = tiling.q_range(kv_block)

    def one_head(head, carry):
        carry = block_loop(
            first, first_full, functools.partial(visit, head=head, masked=True), carry
        )
        return block_loop(
            first_full, tiling.q_blocks, functools.partial(visit, head=head, masked=False), carry
        )

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = block_loop(0, group, one_head, (zeros, zeros))
    dk_ref[...] = (dk * sm_scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dkdv_kernel_masked(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    *refs,
    tiling: Tiling,
    group: int,
    scale: float,
    sm_scale: float,
):
    """The dk/dv kernel with a window or segment ids: for each head of the group, the query
    blocks that see the key block by position (`Tiling.q_bounds`) and, with segment ids, from
    the first to the last whose ids can meet its own, each with its mask."""
    *ids_refs, dk_ref, dv_ref = refs
    kv_block = pl.program_id(0)
    k, v = k_ref[...], v_ref[...]
    block_q = tiling.block_q
    lo, hi = tiling.q_bounds(kv_block)
    if ids_refs:
        kv_ids_ref, q_ids_ref, bounds_ref = ids_refs
        kv_ids = kv_ids_ref[...]
        lo, hi = jnp.maximum(lo, bounds_ref[0]), jnp.minimum(hi, bounds_ref[1])

    def visit(q_block, carry, head):
        dk, dv = carry
        rows = pl.ds(q_block * block_q, block_q)
        q = q_ref[rows, head, :]
        do = do_ref[rows, head, :]
        s = dot(q, k, (1, 1)) * scale
        visible = tiling.mask(q_block, kv_block)
        if ids_refs:
            visible = jnp.logical_and(visible, q_ids_ref[rows][:, None] == kv_ids[None, :])
        p = jnp.exp2(jnp.where(visible, s, -jnp.inf) - lse_ref[head, rows][:, None])
        dv = dv + dot(p.astype(do.dtype), do, (0, 0))
        ds = p * (dot(do, v, (1, 1)) - delta_ref[head, rows][:, None])
        dk = dk + dot(ds.astype(q.dtype), q, (0, 0))
        return dk, dv

    def one_head(head, carry):
        return block_loop(lo, hi, functools.partial(visit, head=head), carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = block_loop(0, group, one_head, (zeros, zeros))
    dk_ref[...] = (dk * sm_scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


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
    compiler_params,
    d_lse=None,
    segment_ids=None,
):
    """Padded residuals and cotangent -> (dq, dk, dv), each like its input.

    q, o, do: [batch, q_padded, heads, head_dim]; k, v: [batch, kv_padded, kv_heads, head_dim];
    lse: float32 [batch, heads, q_padded] (base 2, as the forward saves it). Padded query rows must
    carry do = 0 (they do: the cotangent of the slice that drops them is zero there).
    d_lse: None, or float32 [batch, heads, q_padded], the cotangent of the natural-log lse (0 on
    padded rows). Since d lse / d s = p for the natural-log logits s, it adds p * d_lse to ds,
    which is ``delta - d_lse`` in place of ``delta``: no base-2 factor, because ds is the
    gradient of the natural-log logits whatever base the kernels exponentiate in.
    segment_ids: None or padded ``(q_ids, kv_ids)``: with them, or with a window, the masked
    kernels run (`_dq_kernel_masked`, `_dkdv_kernel_masked`).
    """
    batch, q_padded, heads, head_dim = q.shape
    kv_padded, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    block_q, block_k = tiling.block_q, tiling.block_k
    # delta = rowsum(dO * O): one fused elementwise pass in XLA, float32.
    delta = jnp.einsum("bqhd,bqhd->bhq", do.astype(jnp.float32), o.astype(jnp.float32))
    if d_lse is not None:
        delta = delta - d_lse

    # Grids put the block index first (fastest-launched), as in the forward.
    q_block_spec = pl.BlockSpec(
        (None, block_q, None, head_dim),
        lambda i, b, h: block_index(b, tiling.q_block_of_program(i), h, 0),
    )
    kv_whole_spec = pl.BlockSpec(
        (None, kv_padded, None, head_dim), lambda i, b, h: block_index(b, 0, index_div(h, group), 0)
    )
    row_block_spec = pl.BlockSpec(
        (None, None, block_q), lambda i, b, h: block_index(b, h, tiling.q_block_of_program(i))
    )
    masked = segment_ids is not None or tiling.window is not None
    dq_kernel, dkdv_kernel = (
        (_dq_kernel_masked, _dkdv_kernel_masked)
        if masked
        else (
            _dq_kernel,
            _dkdv_kernel,
        )
    )
    dq_ids, dq_id_specs, dkdv_ids, dkdv_id_specs = [], [], [], []
    if segment_ids is not None:
        dq_ids, dq_id_specs = segment_specs(segment_ids, tiling, rows_first=True)
        dkdv_ids, dkdv_id_specs = segment_specs(segment_ids, tiling, rows_first=False)
    dq = pl.pallas_call(
        functools.partial(dq_kernel, tiling=tiling, scale=scale, sm_scale=sm_scale),
        grid=(tiling.q_blocks, batch, heads),
        in_specs=[
            q_block_spec,
            kv_whole_spec,
            kv_whole_spec,
            q_block_spec,
            row_block_spec,
            row_block_spec,
            *dq_id_specs,
        ],
        out_specs=q_block_spec,
        out_shape=out_struct(q.shape, q.dtype, like=q),
        interpret=interpret,
        compiler_params=compiler_params,
        name="dew_flash_attention_dq",
    )(q, k, v, do, lse, delta, *dq_ids)

    # One program per (key block, batch, kv head); it sees all query rows of its `group` heads.
    # Key block j = 0 sees the most query rows under a causal mask; it is launched first.
    q_group_spec = pl.BlockSpec(
        (None, q_padded, group, head_dim), lambda j, b, g: block_index(b, 0, g, 0)
    )
    rows_group_spec = pl.BlockSpec((None, group, q_padded), lambda j, b, g: block_index(b, g, 0))
    kv_block_spec = pl.BlockSpec(
        (None, block_k, None, head_dim), lambda j, b, g: block_index(b, j, g, 0)
    )
    dk, dv = pl.pallas_call(
        functools.partial(dkdv_kernel, tiling=tiling, group=group, scale=scale, sm_scale=sm_scale),
        grid=(tiling.kv_blocks, batch, kv_heads),
        in_specs=[
            q_group_spec,
            kv_block_spec,
            kv_block_spec,
            q_group_spec,
            rows_group_spec,
            rows_group_spec,
            *dkdv_id_specs,
        ],
        out_specs=[kv_block_spec, kv_block_spec],
        out_shape=[out_struct(k.shape, k.dtype, like=k), out_struct(v.shape, v.dtype, like=v)],
        interpret=interpret,
        compiler_params=compiler_params,
        name="dew_flash_attention_dkdv",
    )(q, k, v, do, lse, delta, *dkdv_ids)
    return dq, dk, dv
