"""Mosaic TPU forward kernel: one query block against one key block per grid step, with an online
softmax whose statistics live in VMEM scratch across the key blocks.

Grid ``(batch, heads, q_blocks, kv_blocks)``; the last dimension is sequential. The step
``(b, h, i, j)`` holds the ``[block_q, head_dim]`` query block ``i`` of head ``h`` and the
``[block_k, head_dim]`` key and value blocks ``j`` of its kv head ``h // group`` (grouped queries
read the shared K/V in place). Per query row it keeps, in float32 scratch, the running maximum
``m``, the running sum ``l`` and the unnormalised accumulator, and writes ``out`` and ``lse`` at
the last key block.

As in `kernels/forward.py`: base-2 logits ``s = (q . k) * sm_scale * log2(e)``; key blocks that
the query block sees entirely run without a mask, the diagonal and the padded tail with one;
``lse = m + log2(l)``, ``+inf`` for a row that sees no key. Key blocks past the diagonal are not
computed, and their steps fetch key block 0, which the next query block reads first.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .mosaic import compiler_params, dot, heads_major, interpret_mode, mask
from .tiling import Tiling, block_index, index_div
from .varying import out_struct


def _attend_block(
    q_ref, k_ref, v_ref, acc_ref, m_ref, l_ref, *, tiling, scale, q_block, kv_block, masked: bool
):
    """One key block's update of the online softmax of one query block."""
    s = dot(q_ref[...], k_ref[...], (1, 1)) * scale  # [block_q, block_k], base-2 logits
    if masked:
        s = jnp.where(mask(tiling, q_block, kv_block), s, -jnp.inf)
    m = m_ref[...]  # [block_q, 1]
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    # A row that has seen only masked keys still has m = -inf, and exp2(-inf - (-inf)) is NaN;
    # subtracting 0 for it keeps its p and rescale at exactly 0.
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp2(s - m_safe)
    rescale = jnp.exp2(m - m_safe)
    l_ref[...] = rescale * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
    v = v_ref[...]
    acc_ref[...] = rescale * acc_ref[...] + dot(p.astype(v.dtype), v, (1, 0))
    m_ref[...] = m_new


def _forward_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, acc_ref, m_ref, l_ref, *, tiling, scale):
    q_block, kv_block = pl.program_id(2), pl.program_id(3)

    @pl.when(kv_block == 0)
    def _start():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)

    attend = functools.partial(
        _attend_block,
        q_ref,
        k_ref,
        v_ref,
        acc_ref,
        m_ref,
        l_ref,
        tiling=tiling,
        scale=scale,
        q_block=q_block,
        kv_block=kv_block,
    )
    n_full, n_visit = tiling.kv_range(q_block)
    pl.when(kv_block < n_full)(functools.partial(attend, masked=False))
    pl.when(jnp.logical_and(kv_block >= n_full, kv_block < n_visit))(
        functools.partial(attend, masked=True)
    )

    @pl.when(kv_block == tiling.kv_blocks - 1)
    def _finish():
        row_sum = l_ref[...]
        # Only rows with no visible key have l = 0: a visible key adds exp2(0) = 1.
        sees_nothing = row_sum == 0.0
        o_ref[...] = (acc_ref[...] / jnp.where(sees_nothing, 1.0, row_sum)).astype(o_ref.dtype)
        lse = jnp.where(sees_nothing, jnp.inf, m_ref[...] + jnp.log2(row_sum))  # [block_q, 1]
        lse_ref[...] = lse.T  # stored as a row (kernels/mosaic.py)


def visited_kv_block(tiling: Tiling, q_block, kv_block):
    """The key block a forward or dq step fetches: ``kv_block`` when the query block sees any of
    it, else block 0, which the next query block reads first (a skipped step fetches nothing the
    kernel does not use; a run of them fetches it once)."""
    if not tiling.causal:
        return kv_block
    _, n_visit = tiling.kv_range(q_block)
    return jnp.where(kv_block < n_visit, kv_block, 0)


def forward(q, k, v, *, tiling: Tiling, scale: float, interpret: bool):
    """Padded inputs -> (o, lse), as `kernels.forward.forward`.

    q: [batch, q_padded, heads, head_dim]; k, v: [batch, kv_padded, kv_heads, head_dim].
    Returns o like q and lse float32 [batch, heads, q_padded] (base-2, scaled logits).
    ``interpret``: TPU interpret mode rather than Mosaic's compiler.
    """
    batch, q_padded, heads, head_dim = q.shape
    group = heads // k.shape[2]
    block_q, block_k = tiling.block_q, tiling.block_k
    q_spec = pl.BlockSpec(
        (None, None, block_q, head_dim), lambda b, h, i, j: block_index(b, h, i, 0)
    )
    kv_spec = pl.BlockSpec(
        (None, None, block_k, head_dim),
        lambda b, h, i, j: block_index(b, index_div(h, group), visited_kv_block(tiling, i, j), 0),
    )
    lse_spec = pl.BlockSpec((None, None, 1, block_q), lambda b, h, i, j: block_index(b, h, 0, i))
    qt, kt, vt = heads_major(q), heads_major(k), heads_major(v)
    o, lse = pl.pallas_call(
        functools.partial(_forward_kernel, tiling=tiling, scale=scale),
        grid=(batch, heads, tiling.q_blocks, tiling.kv_blocks),
        in_specs=[q_spec, kv_spec, kv_spec],
        out_specs=[q_spec, lse_spec],
        out_shape=[
            out_struct(qt.shape, q.dtype, like=qt),
            out_struct((batch, heads, 1, q_padded), jnp.float32, like=qt),
        ],
        scratch_shapes=[
            pltpu.VMEM((block_q, head_dim), jnp.float32),
            pltpu.VMEM((block_q, 1), jnp.float32),
            pltpu.VMEM((block_q, 1), jnp.float32),
        ],
        interpret=interpret_mode(interpret),
        compiler_params=compiler_params(),
        name="dew_flash_attention_forward",
    )(qt, kt, vt)
    return heads_major(o), lse[:, :, 0]
