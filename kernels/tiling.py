"""Static tiling of one attention call: block sizes, padded lengths, the causal alignment, and
which blocks a kernel visits.

Causal alignment is bottom-right (the FlashAttention-2 convention): query row ``i`` sees key
column ``j`` iff ``j <= i + (kv_len - q_len)``. The queries are read as the last ``q_len``
positions of a ``kv_len``-long sequence. With ``q_len == kv_len`` this is the usual lower
triangle, identical to ``jax.nn.dot_product_attention(..., is_causal=True)``; with
``q_len > kv_len`` the first ``q_len - kv_len`` rows see no key at all (their output and
gradients are zeros).

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

    def mask(self, q_block, kv_block):
        """bool[block_q, block_k]: which (row, key) pairs of this block pair are attended."""
        rows = q_block * self.block_q + jnp.arange(self.block_q, dtype=INDEX_DTYPE)[:, None]
        cols = kv_block * self.block_k + jnp.arange(self.block_k, dtype=INDEX_DTYPE)[None, :]
        visible = cols < self.kv_len
        if self.causal:
            visible = jnp.logical_and(visible, cols <= rows + self.offset)
        return visible

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
