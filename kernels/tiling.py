"""Static tiling of one attention call: block sizes, padded lengths, the causal alignment, and
which blocks a kernel visits.

Causal alignment is bottom-right (the FlashAttention-2 convention): query row ``i`` sees key
column ``j`` iff ``j <= i + (kv_len - q_len)``. The queries are read as the last ``q_len``
positions of a ``kv_len``-long sequence. With ``q_len == kv_len`` this is the usual lower
triangle, identical to ``jax.nn.dot_product_attention(..., is_causal=True)``; with
``q_len > kv_len`` the first ``q_len - kv_len`` rows see no key at all (their output and
gradients are zeros). A sliding ``window`` ``W`` (causal only) keeps the ``W`` most recent of
those keys, the row's own position included: ``i + (kv_len - q_len) - j < W``.

Segment ids are not part of a tiling: they are data, and their block skipping is decided while
the kernels run (`kernels.segments`). Everything here is positions.

The loop-bound helpers take traced ``int32`` block indices (from ``pl.program_id`` or a loop
counter) and use only ops the Triton lowering accepts (``lax.div`` on non-negative values,
``jnp.maximum``/``jnp.minimum``). ``lax.div`` is one op where Python ``//`` on a traced scalar is
a floor division with sign corrections (a remainder, two signs and a select).

All index arithmetic of the kernels is ``INDEX_DTYPE`` (int32), with ``jax_enable_x64`` on or
off: grid indices are int32 in either mode, but a Python int given to a ``lax`` op, returned by
a BlockSpec index map or starting a loop carry becomes int64 under x64 (and ``lax`` ops do not
promote). So each goes through `as_index` (`index_div`, `block_index`, `block_loop`) first.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax import lax

INDEX_DTYPE = np.dtype(np.int32)


def as_index(x):
    """`x` (a Python int, or a traced integer scalar) as an ``INDEX_DTYPE`` scalar."""
    return jnp.asarray(x, INDEX_DTYPE)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def index_div(a, b):
    """``a // b`` for a traced non-negative ``a`` and a positive ``b``: ``lax.div`` truncates,
    which is the floor for these, in one op."""
    return lax.div(as_index(a), as_index(b))


def block_index(*indices):
    """A BlockSpec index map's result: each block index as ``INDEX_DTYPE`` (a literal 0 returned
    as is would be an int64 under x64)."""
    return tuple(as_index(i) for i in indices)


def _traced_cdiv(a, b: int):
    """ceil(a / b) for a traced non-negative int32 ``a``."""
    return index_div(a + (b - 1), b)


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Geometry of one call. All fields are static Python ints or bools (hashable)."""

    q_len: int
    kv_len: int
    block_q: int
    block_k: int
    causal: bool
    # Sliding window (causal only): row i sees keys j with i + offset - j < window. None: no
    # window (`kernels.attention` turns a window no row can reach past, >= kv_len, into None).
    window: int | None = None

    @property
    def q_blocks(self) -> int:
        return cdiv(self.q_len, self.block_q)

    @property
    def kv_blocks(self) -> int:
        return cdiv(self.kv_len, self.block_k)

    @property
    def q_padded(self) -> int:
        return self.q_blocks * self.block_q

    @property
    def kv_padded(self) -> int:
        return self.kv_blocks * self.block_k

    @property
    def offset(self) -> int:
        """Bottom-right alignment: row ``i`` sees keys ``j <= i + offset``."""
        return self.kv_len - self.q_len

    def q_block_of_program(self, program):
        """Query block handled by grid index `program`. Causal rows near the end see the most
        keys, so they are launched first: the GPU's last wave then holds short programs."""
        return self.q_blocks - 1 - program if self.causal else program

    def visible(self, rows, cols):
        """bool, broadcast of ``rows`` and ``cols`` (traced int32 positions): the (row, key)
        pairs attended by position (key in range, causal, window)."""
        visible = cols < self.kv_len
        if self.causal:
            visible = jnp.logical_and(visible, cols <= rows + self.offset)
        if self.window is not None:
            visible = jnp.logical_and(visible, cols > rows + self.offset - self.window)
        return visible

    def mask(self, q_block, kv_block):
        """bool[block_q, block_k]: which (row, key) pairs of this block pair are attended."""
        rows = q_block * self.block_q + jnp.arange(self.block_q, dtype=INDEX_DTYPE)[:, None]
        cols = kv_block * self.block_k + jnp.arange(self.block_k, dtype=INDEX_DTYPE)[None, :]
        return self.visible(rows, cols)

    def kv_range(self, q_block):
        """(n_full, n_visit) for a query block: key blocks ``[0, n_full)`` need no mask, key
        blocks ``[n_full, n_visit)`` need one, blocks from ``n_visit`` on are never seen."""
        full_by_length = self.kv_len // self.block_k  # key blocks with no padded tail
        if not self.causal:
            return as_index(full_by_length), as_index(self.kv_blocks)
        last_row_limit = (q_block + 1) * self.block_q - 1 + self.offset
        n_visit = _traced_cdiv(jnp.maximum(last_row_limit + 1, 0), self.block_k)
        n_visit = jnp.minimum(n_visit, self.kv_blocks)
        first_row_limit = q_block * self.block_q + self.offset
        n_full = index_div(jnp.maximum(first_row_limit + 1, 0), self.block_k)
        n_full = jnp.minimum(jnp.minimum(n_full, full_by_length), n_visit)
        return n_full, n_visit

    def kv_bounds(self, q_block):
        """``(lo, hi)``: the key blocks ``[lo, hi)`` a query block sees any key of, by position,
        the window's left edge included (``kv_range``'s ``n_visit`` is ``hi``). The kernels that
        take a window or segment ids visit this range with a mask on every block."""
        _, hi = self.kv_range(q_block)
        if self.window is None:
            return as_index(0), hi
        # The block's first row sees keys from first_row + offset - window + 1 on; later rows
        # see later ones.
        first_key = q_block * self.block_q + self.offset - self.window + 1
        lo = jnp.minimum(index_div(jnp.maximum(first_key, 0), self.block_k), hi)
        return lo, hi

    def q_bounds(self, kv_block):
        """``(lo, hi)``: the query blocks ``[lo, hi)`` that see any key of a key block, by
        position (``q_range``'s ``first`` is ``lo``; without a window ``hi`` is ``q_blocks``)."""
        lo, _ = self.q_range(kv_block)
        if self.window is None:
            return lo, as_index(self.q_blocks)
        # Row r sees the block's last key while r + offset - window < last_key: rows
        # r < last_key - offset + window.
        last_key = (kv_block + 1) * self.block_k - 1
        hi = _traced_cdiv(jnp.maximum(last_key - self.offset + self.window, 0), self.block_q)
        hi = jnp.maximum(jnp.minimum(hi, self.q_blocks), lo)
        return lo, hi

    def q_range(self, kv_block):
        """(first, first_full) for a key block: query blocks ``[first, first_full)`` need a mask,
        query blocks ``[first_full, q_blocks)`` need none, blocks before ``first`` see none of
        these keys."""
        # q_blocks if this key block holds padded keys, else 0. Arithmetic rather than a select:
        # Pallas' Triton lowering (JAX 0.10) types a select of two constants as i1.
        is_tail = (kv_block + 1) * self.block_k > self.kv_len
        tail_bound = is_tail.astype(INDEX_DTYPE) * self.q_blocks
        if not self.causal:
            return as_index(0), tail_bound
        first_key = kv_block * self.block_k
        first = index_div(jnp.maximum(first_key - self.offset, 0), self.block_q)
        first = jnp.minimum(first, self.q_blocks)
        last_key = first_key + self.block_k - 1
        first_full = _traced_cdiv(jnp.maximum(last_key - self.offset, 0), self.block_q)
        first_full = jnp.maximum(jnp.maximum(first_full, tail_bound), first)
        first_full = jnp.minimum(first_full, self.q_blocks)
        return first, first_full
