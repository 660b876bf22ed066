"""Forward kernel: one query block against all key blocks it sees, with an online softmax.

Each program of the grid ``(q_blocks, batch, heads)`` holds one ``[block_q, head_dim]`` query block
and walks the key/value blocks of its kv head (``head // group``: grouped queries read the shared
K/V in place, never a repeated copy). It keeps a running row maximum ``m``, a running row sum
``row_sum`` and an unnormalised accumulator; each new key block rescales them by
``exp2(m_old - m_new)``. Key blocks wholly visible to the query block run without a mask; the
diagonal and the padded tail run with one. With a window or segment ids every visited key block
runs with its mask (`_forward_kernel_masked`): the blocks inside the window's band and, with ids,
those from the first to the last whose id range meets the query block's.

Logits are kept in base 2: ``s = (q . k) * sm_scale * log2(e)``, so ``exp2(s - m)`` is the
softmax numerator. The saved residual is ``lse = m + log2(row_sum)`` per row, ``+inf`` for a row
that sees no key (so that the backward's ``exp2(s - lse)`` is exactly 0 there, never NaN).
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import segments
from .loop import block_loop
from .tiling import Tiling, block_index, index_div
from .varying import out_struct

LOG2_E = math.log2(math.e)


def dot(a, b, contract: tuple[int, int]):
    """2-D matmul accumulated in float32. HIGHEST precision keeps float32 inputs off TF32 on
    GPU (the Triton lowering maps DEFAULT to TF32); for bfloat16 it changes nothing."""
    return lax.dot_general(
        a,
        b,
        (((contract[0],), (contract[1],)), ((), ())),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )


def _forward_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *, tiling: Tiling, scale: float):
    q_block = tiling.q_block_of_program(pl.program_id(0))
    q = q_ref[...]  # [block_q, head_dim], input dtype
    block_q, block_k = tiling.block_q, tiling.block_k

    def visit(kv_block, carry, masked: bool):
        acc, m, row_sum = carry
        keys = pl.ds(kv_block * block_k, block_k)
        k = k_ref[keys, :]
        v = v_ref[keys, :]
        s = dot(q, k, (1, 1)) * scale  # [block_q, block_k], base-2 logits
        if masked:
            s = jnp.where(tiling.mask(q_block, kv_block), s, -jnp.inf)
        return _online_softmax(s, v, carry)

    n_full, n_visit = tiling.kv_range(q_block)
    carry = _start(block_q, q.shape[-1])
    carry = block_loop(0, n_full, functools.partial(visit, masked=False), carry)
    carry = block_loop(n_full, n_visit, functools.partial(visit, masked=True), carry)
    _finish(carry, o_ref, lse_ref)


def _forward_kernel_masked(q_ref, k_ref, v_ref, *refs, tiling: Tiling, scale: float):
    """The forward with a window or segment ids: every key block a query block sees by position
    (`Tiling.kv_bounds`) and, with segment ids, from the first to the last whose ids can meet its
    own (``bounds_ref``: `kernels.segments.block_bounds`) is computed, with its mask."""
    *ids_refs, o_ref, lse_ref = refs
    q_block = tiling.q_block_of_program(pl.program_id(0))
    q = q_ref[...]
    block_q, block_k = tiling.block_q, tiling.block_k
    lo, hi = tiling.kv_bounds(q_block)
    if ids_refs:
        q_ids_ref, kv_ids_ref, bounds_ref = ids_refs  # [block_q], [kv_padded], [2]
        q_ids = q_ids_ref[...]
        lo, hi = jnp.maximum(lo, bounds_ref[0]), jnp.minimum(hi, bounds_ref[1])

    def visit(kv_block, carry):
        keys = pl.ds(kv_block * block_k, block_k)
        s = dot(q, k_ref[keys, :], (1, 1)) * scale
        visible = tiling.mask(q_block, kv_block)
        if ids_refs:
            visible = jnp.logical_and(visible, q_ids[:, None] == kv_ids_ref[keys][None, :])
        return _online_softmax(jnp.where(visible, s, -jnp.inf), v_ref[keys, :], carry)

    _finish(block_loop(lo, hi, visit, _start(block_q, q.shape[-1])), o_ref, lse_ref)


def _start(block_q: int, head_dim: int):
    """The online softmax's carry before any key: accumulator, running maximum, running sum."""
    return (
        jnp.zeros((block_q, head_dim), jnp.float32),
        jnp.full((block_q,), -jnp.inf, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )


def _online_softmax(s, v, carry):
    """The carry after the (masked) base-2 logits ``s`` ``[block_q, block_k]`` of a key block
    and its values ``v``."""
    acc, m, row_sum = carry
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    # A row that has seen only masked keys still has m = -inf, and exp2(-inf - (-inf)) is
    # NaN; subtracting 0 for it keeps its p and rescale at exactly 0.
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp2(s - m_safe[:, None])
    rescale = jnp.exp2(m - m_safe)
    row_sum = rescale * row_sum + jnp.sum(p, axis=1)
    acc = rescale[:, None] * acc + dot(p.astype(v.dtype), v, (1, 0))
    return acc, m_new, row_sum


def _finish(carry, o_ref, lse_ref):
    acc, m, row_sum = carry
    sees_nothing = row_sum == 0.0  # only rows with no visible key: a visible key adds exp2(0) = 1
    o_ref[...] = (acc / jnp.where(sees_nothing, 1.0, row_sum)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(sees_nothing, jnp.inf, m + jnp.log2(row_sum))


def segment_specs(segment_ids, tiling: Tiling, rows_first: bool):
    """The Triton kernels' segment-id inputs and their BlockSpecs (grids ``(blocks, batch,
    heads)``): the ids of the program's own block, the other side's ids whole, and the program's
    block bounds ``[lo, hi)`` on the other side (`kernels.segments.block_bounds`). ``rows_first``:
    programs over query blocks (forward, dq), else over key blocks (dk/dv)."""
    q_ids, kv_ids = segment_ids
    q_ranges = segments.tile_ranges(q_ids, tiling.block_q)
    kv_ranges = segments.tile_ranges(kv_ids, tiling.block_k)
    if rows_first:
        own, other, block, of_program = q_ids, kv_ids, tiling.block_q, tiling.q_block_of_program
        bounds = segments.block_bounds(*q_ranges, *kv_ranges)
    else:
        own, other, block, of_program = kv_ids, q_ids, tiling.block_k, lambda j: j
        bounds = segments.block_bounds(*kv_ranges, *q_ranges)
    specs = [
        pl.BlockSpec((None, block), lambda i, b, h: block_index(b, of_program(i))),
        pl.BlockSpec((None, other.shape[1]), lambda i, b, h: block_index(b, 0)),
        pl.BlockSpec((None, None, 2), lambda i, b, h: block_index(b, of_program(i), 0)),
    ]
    return [own, other, jnp.stack(bounds, axis=-1)], specs


def forward(
    q,
    k,
    v,
    *,
    tiling: Tiling,
    scale: float,
    interpret: bool,
    compiler_params,
    segment_ids=None,
):
    """Padded inputs -> (o, lse).

    q: [batch, q_padded, heads, head_dim]; k, v: [batch, kv_padded, kv_heads, head_dim];
    segment_ids: None or padded ``(q_ids, kv_ids)``, int32 [batch, q_padded], [batch,
    kv_padded]. Returns o like q and lse float32 [batch, heads, q_padded] (base-2, scaled
    logits).
    """
    batch, q_padded, heads, head_dim = q.shape
    kv_padded, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    block_q = tiling.block_q
    # Grid (q_blocks, batch, heads): the query blocks of one head are launched next to each
    # other, so they read its K/V from L2 rather than from HBM.
    q_spec = pl.BlockSpec(
        (None, block_q, None, head_dim),
        lambda i, b, h: block_index(b, tiling.q_block_of_program(i), h, 0),
    )
    kv_spec = pl.BlockSpec(
        (None, kv_padded, None, head_dim), lambda i, b, h: block_index(b, 0, index_div(h, group), 0)
    )
    lse_spec = pl.BlockSpec(
        (None, None, block_q), lambda i, b, h: block_index(b, h, tiling.q_block_of_program(i))
    )
    kernel, ids, id_specs = _forward_kernel, [], []
    if segment_ids is not None or tiling.window is not None:
        kernel = _forward_kernel_masked
        if segment_ids is not None:
            ids, id_specs = segment_specs(segment_ids, tiling, rows_first=True)
    return pl.pallas_call(
        functools.partial(kernel, tiling=tiling, scale=scale),
        grid=(tiling.q_blocks, batch, heads),
        in_specs=[q_spec, kv_spec, kv_spec, *id_specs],
        out_specs=[q_spec, lse_spec],
        out_shape=[
            out_struct(q.shape, q.dtype, like=q),
            out_struct((batch, heads, q_padded), jnp.float32, like=q),
        ],
        interpret=interpret,
        compiler_params=compiler_params,
        name="dew_flash_attention_forward",
    )(q, k, v, *ids)
