"""What the Mosaic TPU kernels share: their layout, the position mask of a piece of keys (causal,
window, padded keys), lane-dense row statistics, the tuning beside the blocks, the grid's semantics
and the interpret-mode switch.

Layout. The public arrays are ``[batch, seq, heads, head_dim]``; a Mosaic block's last two
dimensions must be a multiple of (8, 128) or whole, and a block of one head of that layout is
``[block, 1 of heads, head_dim]``: one row of sublanes, refused. So the kernels take
``[batch, heads, seq, head_dim]`` (``layout="bhsd"`` at the entry points, else one XLA transpose
each way), whose blocks ``[block, head_dim]`` are a multiple of 8 rows by the whole head_dim.
Per-row statistics (lse, delta) travel as rows, ``[batch, heads, 1, seq]`` with ``[1, block_q]``
blocks: a column ``[seq, 1]`` would be tiled (8, 128) in HBM, 128 times its size. So block_q is a
multiple of 128 (lanes), or the whole length. Inside the forward the running max and sum are
lane-dense, ``[block_q, 128]`` with every lane equal (``lanes_to`` widens them to a block).

Grids. Every kernel's last grid dimension walks `kernels.schedule`'s table of the block pairs it
computes and is ``"arbitrary"`` (sequential: float32 accumulators live in VMEM scratch across
it); the others are ``"parallel"`` (a megacore chip, v4 or v5p, splits them over its two
TensorCores).
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .schedule import EMPTY, MASKED
from .tiling import INDEX_DTYPE, Tiling, as_index

LANES = 128
# The most logits a forward step computes over its heads (`Tuning.heads_per_step`): heads x block_q
# x block_k, each 128 lanes of head_dim past the first counted again. The step's code is unrolled
# over its heads, strips and pieces, so its size goes as this product: compiled for v5e, 4 heads at
# 512 x 2048, 8 at 512 x 1024 and 16 at 512 x 512 (causal, 8192 keys, d128) are 36,502, 37,126 and
# 38,886 bundles, twice the product 71,979 (8 heads at 512 x 2048) and 73,371 (16 at 512 x 1024),
# past the 65,232 of v5e's largest instruction overlay: a kernel split across overlays reloads its
# code every step (4 heads of 1024 x 2048 without a mask, 79,477 bundles as the kernel is today,
# ran at two thirds of the speed on a v5e chip). Within it more heads a step are faster on a v5e
# chip: a window of 1024 at 8192 keys, 512 x 512, 1.290 ms at 4 heads, 1.161 at 8, 1.101 at 16
# (docs/kernels.md).
FORWARD_LOGITS = 4 * 512 * 2048


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
    return tiling.visible(rows, cols)


def index(*indices):
    """A BlockSpec index map's result, each index int32 (`kernels.tiling.block_index`)."""
    return tuple(as_index(i) for i in indices)


def lanes_to(x, width: int):
    """A lane-dense ``[rows, 128]`` statistic (every lane equal) as ``[rows, width]``: whole
    copies side by side where ``width`` is a multiple of 128 (no broadcast across lanes), a
    slice below 128, a broadcast of one lane otherwise."""
    if width % LANES == 0:
        return x if width == LANES else jnp.tile(x, (1, width // LANES))
    if width < LANES:
        return x[:, :width]
    return jnp.broadcast_to(x[:, :1], (x.shape[0], width))


def piece_mask(
    tiling: Tiling, q_block, first_key, shape, keys_first: bool = False, first_row: int = 0
):
    """bool ``shape``: the visible (row, key) pairs of query block ``q_block``'s rows from
    ``first_row`` on against the keys from ``first_key`` on; ``shape`` is ``[rows, keys]``, or
    ``[keys, rows]`` when ``keys_first``. 2-D iotas: Mosaic has no cheap 1-D to 2-D reshape."""
    row_dim, col_dim = (1, 0) if keys_first else (0, 1)
    first = q_block * tiling.block_q + first_row
    rows = first + lax.broadcasted_iota(INDEX_DTYPE, shape, row_dim)
    cols = first_key + lax.broadcasted_iota(INDEX_DTYPE, shape, col_dim)
    return tiling.visible(rows, cols)


def piece_is_seen(
    tiling: Tiling, q_block, first_key, piece: int, first_row: int = 0, rows: int | None = None
):
    """Whether a real row of ``q_block`` (of its rows ``[first_row, first_row + rows)``; None:
    the whole block) sees a key of the piece ``[first_key, first_key + piece)``, by position.
    Without a window, whether it sees ``first_key``: a row that sees a key sees every key before
    it. A window also needs the piece's last key within the first row's window (later rows'
    windows start later)."""
    seen = first_key < tiling.kv_len
    if tiling.causal:
        if rows is None:
            last_row = jnp.minimum((q_block + 1) * tiling.block_q, tiling.q_len) - 1
        else:
            last_row = jnp.minimum(q_block * tiling.block_q + first_row + rows, tiling.q_len) - 1
        seen = jnp.logical_and(seen, first_key <= last_row + tiling.offset)
    if tiling.window is not None:
        row = q_block * tiling.block_q + first_row
        seen = jnp.logical_and(seen, first_key + piece - 1 > row + tiling.offset - tiling.window)
    return seen


@dataclasses.dataclass(frozen=True)
class Tuning:
    """How the Mosaic kernels run, beside their blocks (`kernels.platform.mosaic_tuning` picks it
    per TPU generation).

    - ``block_k_compute``: keys computed at a time inside the forward's key block (None: the
      whole block); ``backward_block_k_compute`` the same for the backward's key block.
    - ``block_q_compute``: query rows the forward computes at a time against each piece of keys
      (None: the whole query block). Fewer rows keep the ``[rows, piece]`` float32 logits
      closer to the 64 vector registers, so fewer of them are spilled to VMEM and read back;
      each strip loads the piece's K and V into the MXUs again.
    - ``forward_heads``: the most query heads a forward step computes (`heads_per_step`).
    - ``fused_backward``: one backward kernel (dq accumulated in VMEM beside dk and dv) where
      its VMEM allows, rather than a dq kernel and a dk/dv kernel.
    - ``vmem_limit_bytes``: the kernels' scoped VMEM (None: the compiler's default).
    """

    block_k_compute: int | None = None
    backward_block_k_compute: int | None = None
    block_q_compute: int | None = None
    forward_heads: int = 1
    fused_backward: bool = True
    vmem_limit_bytes: int | None = None

    @staticmethod
    def _piece(block: int, piece: int | None) -> int:
        if piece is None or piece >= block or block % piece or piece % 8:
            return block
        return piece

    def piece(self, block_k: int) -> int:
        return self._piece(block_k, self.block_k_compute)

    def backward_piece(self, block_k: int) -> int:
        return self._piece(block_k, self.backward_block_k_compute)

    def rows(self, block_q: int) -> int:
        """The forward's query rows a strip: ``block_q_compute`` where it splits the block into
        whole 16-row parts (a bfloat16 vector register packs 16 rows), else the whole block."""
        rows = self.block_q_compute
        if rows is None or rows >= block_q or block_q % rows or rows % 16:
            return block_q
        return rows

    def heads_per_step(
        self, heads: int, group: int, block_q: int, block_k: int, head_dim: int
    ) -> int:
        """Query heads one forward step computes: the most, up to ``forward_heads``, that divide
        ``heads``, keep the step within ``FORWARD_LOGITS`` (heads x block_q x block_k x
        ceil(head_dim / 128)), and share their kv heads whole (the count divides the ``group``
        of query heads a kv head serves, or ``group`` divides it)."""
        lanes = -(-head_dim // LANES)
        fits = [
            n
            for n in range(1, min(self.forward_heads, heads) + 1)
            if heads % n == 0
            and (n == 1 or n * block_q * block_k * lanes <= FORWARD_LOGITS)
            and (group % n == 0 or n % group == 0)
        ]
        return max(fits)

    def compiler_params(self, dims: int, vmem_limit_bytes: int | None = None):
        """Parallel grid dimensions, then the sequential walk of `kernels.schedule`."""
        return pltpu.CompilerParams(
            dimension_semantics=("parallel",) * (dims - 1) + ("arbitrary",),
            vmem_limit_bytes=vmem_limit_bytes or self.vmem_limit_bytes,
        )


def for_each_piece(
    make_attend,
    *,
    flags,
    tiling: Tiling,
    q_block,
    kv_block,
    piece: int,
    piece_seen=None,
    step_seen=None,
):
    """One step's work over its key block, ``piece`` keys at a time (unrolled): nothing on an
    ``EMPTY`` step; on a pair the table does not mark ``MASKED``, every piece without a mask; on
    one it does, each piece some row sees, with its mask.

    ``make_attend()`` is called inside the branch that runs (what it reads up front, it reads
    there only) and returns ``attend(keys=, masked_at=)``: ``keys`` a static slice of the key
    block, ``masked_at`` None or ``(q_block, first_key)`` of the piece for `piece_mask`.
    Segment ids (`kernels.segments`) skip more, while the kernel runs: ``step_seen``, a traced
    bool, computes the step at all; ``piece_seen(n)``, a traced bool, computes its piece ``n``
    (``attend`` applies the ids' mask itself)."""

    def run(masked: bool):
        attend = make_attend()
        for n in range(tiling.block_k // piece):
            keys = pl.ds(n * piece, piece)
            ids_seen = None if piece_seen is None else piece_seen(n)
            if not masked:
                if ids_seen is None:
                    attend(keys=keys, masked_at=None)
                else:
                    pl.when(ids_seen)(functools.partial(attend, keys=keys, masked_at=None))
                continue
            first_key = kv_block * tiling.block_k + n * piece
            seen = piece_is_seen(tiling, q_block, first_key, piece)
            if ids_seen is not None:
                seen = jnp.logical_and(seen, ids_seen)
            pl.when(seen)(functools.partial(attend, keys=keys, masked_at=(q_block, first_key)))

    by_mask(run, flags=flags, step_seen=step_seen)


def by_mask(run, *, flags, step_seen=None):
    """``run(masked)`` on a step that computes: ``run(False)`` on a pair the table does not mark
    ``MASKED``, ``run(True)`` on one it does; nothing on an ``EMPTY`` step, or where
    ``step_seen`` (None, or a traced bool: segment ids' skip) is false."""
    computes = (flags & EMPTY) == 0
    if step_seen is not None:
        computes = jnp.logical_and(computes, step_seen)
    masked = (flags & MASKED) != 0
    pl.when(computes & ~masked)(functools.partial(run, False))
    pl.when(computes & masked)(functools.partial(run, True))


def interpret_mode(interpret: bool):
    """``pallas_call``'s ``interpret=``: TPU interpret mode (TPU semantics, run on the CPU) or
    compiled by Mosaic."""
    return pltpu.InterpretParams() if interpret else False
