"""What the Mosaic TPU kernels share: their layout, the causal mask, the grid's semantics and the
interpret-mode switch.

Layout. The public arrays are ``[batch, seq, heads, head_dim]``; a Mosaic block's last two
dimensions must be a multiple of (8, 128) or whole, and a block of one head of that layout is
``[block, 1 of heads, head_dim]``: one row of sublanes, refused. So the kernels take
``[batch, heads, seq, head_dim]`` (one XLA transpose of q, k, v in, and of the results out), whose
blocks ``[block, head_dim]`` are a multiple of 8 rows by the whole head_dim. Per-row statistics
(lse, delta) travel as rows, ``[batch, heads, 1, seq]`` with ``[1, block_q]`` blocks: a column
``[seq, 1]`` would be tiled (8, 128) in HBM, 128 times its size, and the dk/dv kernel reads these
blocks at every step. So block_q is a multiple of 128 (lanes), or the whole length. The forward
and dq kernels transpose a row block to the column their ``[block_q, block_k]`` logits need, once
per step; the dk/dv kernel computes the logits transposed, ``[block_k, block_q]``, where the rows
broadcast as they are.

Grids. Every kernel's last grid dimension walks the blocks it reduces over (key blocks for the
forward and dq, query blocks of the group's heads for dk/dv) and is ``"arbitrary"`` (sequential:
float32 accumulators live in VMEM scratch across it); the others are ``"parallel"`` (a megacore
chip, v4 or v5p, splits them over its two TensorCores).

Skipping. A block pair with no visible (row, key) pair is not computed (``pl.when`` on the block
indices, from `kernels.tiling.Tiling`), and its grid step's index map names a block the kernel
needs next instead of the skipped one, so the pipeline fetches nothing it will not use.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import tpu as pltpu

from .tiling import INDEX_DTYPE, Tiling


def heads_major(x):
    """``[batch, seq, heads, head_dim]`` -> ``[batch, heads, seq, head_dim]`` (and back)."""
    return jnp.swapaxes(x, 1, 2)


def as_rows(x):
    """Per-row statistics ``[batch, heads, seq]`` -> ``[batch, heads, 1, seq]``."""
    return x[:, :, None, :]


def dot(a, b, contract: tuple[int, int]):
    """2-D matmul accumulated in float32. float32 inputs at full precision (HIGHEST: several
    bfloat16 MXU passes); bfloat16 inputs at DEFAULT, since Mosaic refuses an fp32 contract
    precision on bfloat16 operands ("Bad lhs type")."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else lax.Precision.DEFAULT
    return lax.dot_general(
        a,
        b,
        (((contract[0],), (contract[1],)), ((), ())),
        precision=precision,
        preferred_element_type=jnp.float32,
    )


def mask(tiling: Tiling, q_block, kv_block, keys_first: bool = False):
    """bool ``[block_q, block_k]`` (``[block_k, block_q]`` when ``keys_first``): the visible
    (row, key) pairs of a block pair. 2-D iotas: Mosaic lays vectors out in (sublane, lane) tiles
    and has no cheap 1-D to 2-D reshape."""
    shape = (tiling.block_k, tiling.block_q) if keys_first else (tiling.block_q, tiling.block_k)
    row_dim, col_dim = (1, 0) if keys_first else (0, 1)
    rows = q_block * tiling.block_q + lax.broadcasted_iota(INDEX_DTYPE, shape, row_dim)
    cols = kv_block * tiling.block_k + lax.broadcasted_iota(INDEX_DTYPE, shape, col_dim)
    visible = cols < tiling.kv_len
    if tiling.causal:
        visible = jnp.logical_and(visible, cols <= rows + tiling.offset)
    return visible


def compiler_params():
    """Grid semantics shared by the three kernels: three parallel dimensions, then the
    sequential reduction over blocks."""
    return pltpu.CompilerParams(
        dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
    )


def interpret_mode(interpret: bool):
    """``pallas_call``'s ``interpret=``: TPU interpret mode (TPU semantics, run on the CPU) or
    compiled by Mosaic."""
    return pltpu.InterpretParams() if interpret else False
