"""The block pairs a Mosaic kernel visits, in order: tables its grid walks through scalar prefetch.

A causal square visits about half of its ``q_blocks x kv_blocks`` block pairs. A grid over all of
them spends a step (its fixed cost, and a pipeline turn) on each skipped pair; on a v5e chip a
grid step costs about 0.35 us, and at 8k tokens with 1024-row blocks the 28 skipped pairs of 64
are a tenth of the forward. So the kernels' last grid dimension walks a list of the pairs that
hold a visible (row, key) pair, and their index maps read the blocks to fetch from it
(``PrefetchScalarGridSpec``: the tables sit in SMEM before the first step).

Each table is int32, one entry a step, and the same for every (batch, head): a block pair is
visible or not by position alone. ``FIRST``/``LAST`` mark the first and last step of a run of
steps that accumulate into one output block (the forward: one query block's key blocks; the
dk/dv kernel: one key block's query blocks, over the heads of its group); ``MASKED`` a pair that
holds an invisible (row, key) pair (the causal diagonal, a window's edge, a padded key tail);
``EMPTY`` a step that computes nothing and only opens and closes its output block: a query block
with no visible key (rows before the first key, ``q_len > kv_len``) still writes its zeros and
``lse``; ``FRESH`` (the forward) a run's first step whose key block's first key every row of the
query block sees, padded rows included, so that its first piece can write the run's statistics
rather than add to zeros. Segment ids skip more steps while the kernels run (`kernels.segments`),
out of these.

Only real rows and keys decide visibility (rows ``< q_len``, keys ``< kv_len``): padded query
rows are sliced off, and they compute finite values on the pairs the real rows visit.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .tiling import Tiling

FIRST = 1
LAST = 2
MASKED = 4
EMPTY = 8
FRESH = 16
# The most steps a table holds: four int32 tables of this length take 256 KiB of a TensorCore's
# 1 MiB of SMEM (pltpu.get_tpu_info_for_chip, v4 to v6e). 16k causal pairs is a 180k-token
# square at 1024-row blocks.
MAX_STEPS = 16384


def visible_blocks(tiling: Tiling) -> tuple[np.ndarray, np.ndarray]:
    """``(seen, whole)``, bool ``[q_blocks, kv_blocks]``: the block pairs holding a visible
    (row, key) pair, and those where every real row sees every real key (no mask needed; a
    padded key tail always needs one).

    From each block's corners, ``O(q_blocks x kv_blocks)``: row ``r`` sees keys ``c`` with
    ``r + offset - window < c <= r + offset`` (each bound where it applies), a band whose edges
    rise with ``r``. So a block of real rows ``[r0, r1]`` and real keys ``[c0, c1]`` holds a
    visible pair where some row's band meets ``[c0, c1]``: ``r1 + offset >= c0`` (its last row
    reaches the first key) and ``r0 + offset - window < c1`` (its first row's band has not left
    the last key); and every row sees every key where the first row sees the last key
    (``c1 <= r0 + offset``) and the last row still sees the first (``c0 > r1 + offset -
    window``). (A dense ``q_len x kv_len`` mask, as ``_visible`` draws it, would take 32 GB at
    ``MAX_STEPS``'s 180k tokens.)"""
    q_blocks, kv_blocks = np.arange(tiling.q_blocks), np.arange(tiling.kv_blocks)
    r0 = (q_blocks * tiling.block_q)[:, None]
    r1 = np.minimum(r0 + tiling.block_q, tiling.q_len) - 1  # the last real row
    c0 = (kv_blocks * tiling.block_k)[None, :]
    c1 = np.minimum(c0 + tiling.block_k, tiling.kv_len) - 1  # the last real key
    seen = (r0 < tiling.q_len) & (c0 < tiling.kv_len)
    whole = c0 + tiling.block_k <= tiling.kv_len  # no padded key
    if tiling.causal:
        seen = seen & (r1 + tiling.offset >= c0)
        whole = whole & (c1 <= r0 + tiling.offset)
    if tiling.window is not None:
        seen = seen & (r0 + tiling.offset - tiling.window < c1)
        whole = whole & (c0 > r1 + tiling.offset - tiling.window)
    return seen, seen & whole


def _visible(tiling: Tiling, rows, cols):
    """`Tiling.visible` in numpy: the (row, key) pairs attended by position, padded rows too."""
    visible = cols < tiling.kv_len
    if tiling.causal:
        visible = visible & (cols <= rows + tiling.offset)
    if tiling.window is not None:
        visible = visible & (cols > rows + tiling.offset - tiling.window)
    return visible


@dataclasses.dataclass(frozen=True)
class Steps:
    """One kernel's walk: ``q_block[t]``, ``kv_block[t]``, ``head[t]`` (the query head within a
    kv head's group; 0 for the forward) and ``flags[t]`` (``FIRST | LAST | MASKED | EMPTY |
    FRESH``), int32 arrays of one length, the number of grid steps."""

    q_block: np.ndarray
    kv_block: np.ndarray
    head: np.ndarray
    flags: np.ndarray

    def __len__(self) -> int:
        return len(self.flags)

    def tables(self):
        return self.q_block, self.kv_block, self.head, self.flags

    def computed_pairs(self) -> int:
        """Block pairs computed: the steps that are not ``EMPTY``."""
        return int(np.sum((self.flags & EMPTY) == 0))


def _steps(rows: list[tuple[int, int, int, int]]) -> Steps:
    table = np.asarray(rows, np.int32).reshape(-1, 4)
    return Steps(*(np.ascontiguousarray(table[:, c]) for c in range(4)))


def forward_steps(tiling: Tiling, segmented: bool = False) -> Steps:
    """The forward's walk: query blocks in order, each one's visible key blocks in a run (a query
    block that sees no key gets one ``EMPTY`` step, so it still writes its output). A run's first
    step is ``FRESH`` where every row of the block sees that key block's first key. A causal run
    starts on its diagonal and walks back where that start is fresh (the diagonal block holds
    every row's own key, and under a window as long as a block the keys nearest it), else from
    key block 0 where that one is (a query block longer than the key blocks, whose first rows do
    not reach the diagonal's first key); ascending, a windowed run would start on its edge,
    which the block's last rows do not reach.

    ``segmented`` (the walk of a call with segment ids): every run ascends and none is
    ``FRESH``, since segment ids may skip a run's first step while the kernel runs, and with
    nothing to start fresh the descending walk was 3% slower on the chip (documents of mean 300
    at 8192 keys, 512 x 1024 blocks: 1.160 ms against 1.126)."""
    seen, whole = visible_blocks(tiling)
    rows = []
    for i in range(tiling.q_blocks):
        keys = np.flatnonzero(seen[i])
        if len(keys) == 0:
            rows.append((i, 0, 0, FIRST | LAST | EMPTY))
            continue
        block_rows = np.arange(i * tiling.block_q, (i + 1) * tiling.block_q)

        def sees_first_key(j):
            return bool(np.all(_visible(tiling, block_rows, int(j) * tiling.block_k)))

        if segmented:
            fresh = False
        else:
            if tiling.causal and (sees_first_key(keys[-1]) or not sees_first_key(keys[0])):
                keys = keys[::-1]
            fresh = sees_first_key(keys[0])
        for n, j in enumerate(keys):
            flags = (FIRST if n == 0 else 0) | (LAST if n == len(keys) - 1 else 0)
            flags |= 0 if whole[i, j] else MASKED
            flags |= FRESH if n == 0 and fresh else 0
            rows.append((i, int(j), 0, flags))
    return _steps(rows)


def backward_steps(tiling: Tiling, group: int) -> Steps:
    """The fused backward's walk for one kv head: each key block in order, and for it the query
    blocks that see it, head by head over the ``group`` query heads that share it (``FIRST`` and
    ``LAST`` bound a key block's run). A key block no row sees (none under bottom-right causal
    alignment; a non-causal call has none either) gets one ``EMPTY`` step, so it writes its zero
    dk and dv."""
    seen, whole = visible_blocks(tiling)
    rows = []
    for j in range(tiling.kv_blocks):
        queries = np.flatnonzero(seen[:, j])
        run = [(int(i), h) for h in range(group) for i in queries]
        if not run:
            rows.append((0, j, 0, FIRST | LAST | EMPTY))
            continue
        for n, (i, h) in enumerate(run):
            flags = (FIRST if n == 0 else 0) | (LAST if n == len(run) - 1 else 0)
            flags |= 0 if whole[i, j] else MASKED
            rows.append((i, j, h, flags))
    return _steps(rows)
