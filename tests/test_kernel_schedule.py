"""The Mosaic kernels' step tables (`dew.kernels.schedule`) against a brute-force loop over rows and
keys. Pure numpy: no kernel runs.

A kernel's last grid dimension walks its table: the forward one step per (query block, key block)
pair holding a visible (row, key) pair, each query block's key blocks in one run; the fused
backward, per kv head, each key block's visible query blocks in one run, head by head over the
group. ``FIRST``/``LAST`` open and close a run's output block, ``MASKED`` asks for the mask,
``EMPTY`` computes nothing (a block no row sees still writes its output). What the tables must
say is written here from the causal formula alone: real query row ``i`` sees real key ``j`` iff
``j <= i + kv_len - q_len`` (every real key when not causal), and with a window ``W`` also
``i + kv_len - q_len - j < W``; padded rows and keys (beyond the lengths, up to whole blocks) see
nothing.

The segment-id tables (`dew.kernels.segments`: tile ranges, the fetch steps, the Triton block
bounds) are checked against loops over the ids too.
"""

from collections import defaultdict

import jax.numpy as jnp
import numpy as np
import pytest

from dew.kernels import segments
from dew.kernels.schedule import (
    EMPTY,
    FIRST,
    FRESH,
    LAST,
    MASKED,
    backward_steps,
    forward_steps,
    visible_blocks,
)
from dew.kernels.tiling import Tiling


def sees(tiling: Tiling, row: int, key: int) -> bool:
    """Whether query row ``row`` attends to key ``key`` (padded positions included: never)."""
    if row >= tiling.q_len or key >= tiling.kv_len:
        return False
    position = row + tiling.kv_len - tiling.q_len  # the row's own position among the keys
    if tiling.window is not None and position - key >= tiling.window:
        return False
    return not tiling.causal or key <= position


def sees_by_position(tiling: Tiling, row: int, key: int) -> bool:
    """`sees` for any row position, a padded row's too (a padded query row is computed, and
    sliced off after): a real key within the causal limit and the window."""
    position = row + tiling.kv_len - tiling.q_len
    if key >= tiling.kv_len or (tiling.window is not None and position - key >= tiling.window):
        return False
    return not tiling.causal or key <= position


def brute_force_pairs(tiling: Tiling):
    """``(seen, masked)``: sets of (q block, key block) pairs holding a visible (row, key) pair,
    and those where a real row does not see a key position of the block (a padded key included),
    by looping over every row and key of every block pair."""
    seen, masked = set(), set()
    for i in range(tiling.q_blocks):
        for j in range(tiling.kv_blocks):
            for row in range(i * tiling.block_q, (i + 1) * tiling.block_q):
                for key in range(j * tiling.block_k, (j + 1) * tiling.block_k):
                    if sees(tiling, row, key):
                        seen.add((i, j))
                    elif row < tiling.q_len:
                        masked.add((i, j))
    return seen, masked


def runs(owner) -> dict:
    """``{owner: [steps]}`` of a walk, checking that each owner's steps are one contiguous run
    (its output block is opened once and closed once)."""
    steps = defaultdict(list)
    for t, o in enumerate(owner):
        steps[o].append(t)
    for o, ts in steps.items():
        assert ts == list(range(ts[0], ts[-1] + 1)), f"block {o}'s steps {ts} are not one run"
    return steps


def check_flags(flags, steps: dict, *, empty: set, masked_steps: set, fresh_steps=frozenset()):
    """FIRST exactly on each run's first step, LAST on its last; EMPTY exactly on the runs of the
    blocks in ``empty``, one step each; MASKED exactly on the computed steps in ``masked_steps``,
    FRESH on those in ``fresh_steps``."""
    for o, ts in steps.items():
        for t in ts:
            assert bool(flags[t] & FIRST) == (t == ts[0]), (o, t, flags[t])
            assert bool(flags[t] & LAST) == (t == ts[-1]), (o, t, flags[t])
            assert bool(flags[t] & EMPTY) == (o in empty), (o, t, flags[t])
        if o in empty:
            assert len(ts) == 1, (o, ts)
    for t, f in enumerate(flags):
        assert not f & ~(FIRST | LAST | MASKED | EMPTY | FRESH), (t, f)
        assert bool(f & FRESH) == (t in fresh_steps), (t, f)
        if not f & EMPTY:
            assert bool(f & MASKED) == (t in masked_steps), (t, f)


def check_forward(tiling: Tiling, segmented: bool = False):
    seen, masked = brute_force_pairs(tiling)
    steps = forward_steps(tiling, segmented=segmented)
    for table in steps.tables():
        assert table.dtype == np.int32 and table.flags["C_CONTIGUOUS"] and len(table) == len(steps)
    q_block, kv_block, head, flags = (np.asarray(t).tolist() for t in steps.tables())
    assert set(head) == {0}
    computed = [(i, j) for i, j, f in zip(q_block, kv_block, flags) if not f & EMPTY]
    # Each visible pair exactly once; nothing else computed (no pair masked whole).
    assert sorted(computed) == sorted(seen), (sorted(computed), sorted(seen))
    assert steps.computed_pairs() == len(seen)
    # Every query block has one run (its output is written once), in block order. A run starts
    # fresh where every row of its query block, padded ones too, sees the first key of its first
    # key block; a causal run walks from its diagonal back where that start is fresh, else
    # forward from its first key block where that one is, else from the diagonal back; any
    # other run forward. With segment ids every run walks forward and none starts fresh.
    by_block = runs(q_block)
    assert list(by_block) == list(range(tiling.q_blocks))
    empty = set(range(tiling.q_blocks)) - {i for i, _ in seen}  # query blocks seeing no key

    def fresh_from(i, j):
        rows = range(i * tiling.block_q, (i + 1) * tiling.block_q)
        return all(sees_by_position(tiling, row, j * tiling.block_k) for row in rows)

    fresh_steps = set()
    for i, ts in by_block.items():
        if i in empty:
            continue
        order = [kv_block[t] for t in ts]
        ascending = sorted(order)
        backward = (
            not segmented
            and tiling.causal
            and (fresh_from(i, ascending[-1]) or not fresh_from(i, ascending[0]))
        )
        assert order == (ascending[::-1] if backward else ascending), (i, order)
        if not segmented and fresh_from(i, order[0]):
            fresh_steps.add(ts[0])
    masked_steps = {t for t, pair in enumerate(zip(q_block, kv_block)) if pair in masked}
    check_flags(flags, by_block, empty=empty, masked_steps=masked_steps, fresh_steps=fresh_steps)
    return steps


def check_backward(tiling: Tiling, group: int):
    seen, masked = brute_force_pairs(tiling)
    steps = backward_steps(tiling, group)
    for table in steps.tables():
        assert table.dtype == np.int32 and table.flags["C_CONTIGUOUS"] and len(table) == len(steps)
    q_block, kv_block, head, flags = (np.asarray(t).tolist() for t in steps.tables())
    computed = [(i, j, h) for i, j, h, f in zip(q_block, kv_block, head, flags) if not f & EMPTY]
    # Each visible pair once for each query head of the group, nothing else.
    want = [(i, j, h) for (i, j) in seen for h in range(group)]
    assert sorted(computed) == sorted(want)
    assert steps.computed_pairs() == group * len(seen)
    # Every key block has one run (dk and dv are written once), in block order.
    by_block = runs(kv_block)
    assert list(by_block) == list(range(tiling.kv_blocks))
    empty = set(range(tiling.kv_blocks)) - {j for _, j in seen}  # key blocks no row sees
    masked_steps = {t for t, pair in enumerate(zip(q_block, kv_block)) if pair in masked}
    check_flags(flags, by_block, empty=empty, masked_steps=masked_steps)
    return steps


TILINGS = [
    # q_len, kv_len, block_q, block_k, causal[, window]
    pytest.param((37, 37, 16, 8, True), id="causal-square-odd"),
    pytest.param((37, 53, 16, 8, True), id="causal-q37-kv53"),
    pytest.param((53, 21, 8, 16, True), id="causal-q53-kv21-rows-see-nothing"),
    pytest.param((40, 40, 8, 24, True), id="causal-block_k-not-block_q"),
    pytest.param((29, 45, 16, 16, False), id="full-padded-tails"),
    pytest.param((1, 1, 8, 8, True), id="one-row-one-key"),
    pytest.param((64, 64, 8, 8, True, 1), id="window-1"),
    pytest.param((64, 64, 16, 8, True, 16), id="window-a-block"),
    pytest.param((37, 53, 8, 16, True, 20), id="window-q37-kv53"),
    pytest.param((53, 21, 8, 8, True, 5), id="window-q53-kv21-rows-see-nothing"),
]


@pytest.mark.parametrize("segmented", [False, True], ids=["positions", "segment-ids"])
@pytest.mark.parametrize("tiling", TILINGS)
def test_forward_steps_visit_each_visible_pair_once(tiling, segmented):
    check_forward(Tiling(*tiling), segmented)


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("tiling", TILINGS)
def test_backward_steps_visit_each_visible_pair_once_per_head(tiling, group):
    check_backward(Tiling(*tiling), group)


def test_random_tilings(seed):
    # Fifty tilings drawn from the seed: lengths 1 to 70, blocks of 8 to 32 rows, causal or not,
    # causal ones with a window of 1 to 40 keys one time in two, groups of 1 to 3 query heads.
    rng = np.random.default_rng(seed)
    for _ in range(50):
        q_len, kv_len = (int(n) for n in rng.integers(1, 71, size=2))
        block_q, block_k = (int(b) for b in rng.choice([8, 16, 24, 32], size=2))
        causal = bool(rng.integers(2))
        window = int(rng.integers(1, 41)) if causal and rng.integers(2) else None
        tiling = Tiling(q_len, kv_len, block_q, block_k, causal, window)
        try:
            check_forward(tiling)
            check_forward(tiling, segmented=True)
            check_backward(tiling, int(rng.integers(1, 4)))
        except AssertionError as error:
            raise AssertionError(f"{tiling} (seed {seed}): {error}") from error


def test_visible_blocks_are_the_brute_force_pairs(seed):
    rng = np.random.default_rng(seed)
    drawn = []
    for _ in range(60):  # unequal lengths and blocks, rows before the first key, windows of 1
        q_len, kv_len = (int(n) for n in rng.integers(1, 90, size=2))
        block_q, block_k = (int(b) for b in rng.choice([8, 16, 24], size=2))
        causal = bool(rng.integers(2))
        window = int(rng.integers(1, 50)) if causal and rng.integers(2) else None
        drawn.append((q_len, kv_len, causal, window, block_q, block_k))
    for q_len, kv_len, causal, window, block_q, block_k in [
        (37, 53, True, None, 16, 8),
        (53, 21, True, None, 16, 8),
        (29, 45, False, None, 16, 8),
        (64, 64, True, None, 16, 8),
        (64, 64, True, 9, 16, 8),
        (64, 64, True, 1, 8, 8),
        *drawn,
    ]:
        tiling = Tiling(q_len, kv_len, block_q, block_k, causal, window)
        seen, masked = brute_force_pairs(tiling)
        got_seen, got_whole = visible_blocks(tiling)
        pairs = {(int(i), int(j)) for i, j in zip(*np.nonzero(got_seen))}
        whole = {(int(i), int(j)) for i, j in zip(*np.nonzero(got_whole))}
        assert pairs == seen, tiling
        assert whole == seen - masked, tiling


def test_the_tables_skip_what_a_causal_square_never_sees():
    # A causal 64 x 64 square in 16 x 16 blocks: 10 of its 16 block pairs are visible, the 4 on
    # the diagonal masked; the backward walks them for each of 2 heads.
    tiling = Tiling(64, 64, 16, 16, True)
    forward = check_forward(tiling)
    assert len(forward) == 10 and forward.computed_pairs() == 10
    assert int(np.sum((forward.flags & MASKED) != 0)) == 4
    backward = check_backward(tiling, 2)
    assert len(backward) == 20
    # Rows before the first key (q_len > kv_len): a query block that sees nothing gets one EMPTY
    # step, which writes its zeros and lse.
    forward = check_forward(Tiling(40, 8, 8, 8, True))
    assert forward.flags.tolist()[:4] == [FIRST | LAST | EMPTY] * 4


def test_a_window_skips_the_blocks_left_of_every_rows_window():
    # 64 x 64 causal in 8 x 8 blocks with a window of 16: query block i sees key blocks i - 2
    # (its first rows' windows reach into it), i - 1 and i; blocks left of those are not walked.
    # The window's edge and the diagonal are masked, the block between them is whole.
    steps = check_forward(Tiling(64, 64, 8, 8, True, 16))
    pairs = set(zip(steps.q_block.tolist(), steps.kv_block.tolist()))
    assert pairs == {(i, j) for i in range(8) for j in range(max(0, i - 2), i + 1)}
    whole = {
        (i, j) for i, j, f in zip(steps.q_block, steps.kv_block, steps.flags) if not f & MASKED
    }
    assert whole == {(i, i - 1) for i in range(1, 8)}


# ---- segment ids: the tables the kernels skip tiles by ---------------------------------------


def random_ids(rng, batch: int, length: int):
    """Ids of documents of random lengths one after another, a row in increasing order, the next
    with its labels shuffled, and so on."""
    rows = []
    for b in range(batch):
        lengths = []
        while sum(lengths) < length:
            lengths.append(int(rng.integers(1, 20)))
        labels = np.arange(len(lengths)) if b % 2 == 0 else rng.permutation(len(lengths))
        rows.append(np.repeat(labels, lengths)[:length])
    return np.asarray(rows, np.int32)


def test_tile_ranges_and_block_bounds_against_loops(seed):
    # The smallest and largest id of each tile; for each query tile the key tiles from the first
    # to the last holding one of its ids' range, found by comparing every pair of ids.
    rng = np.random.default_rng(seed)
    q_ids, kv_ids = random_ids(rng, 4, 48), random_ids(rng, 4, 64)
    q_lo, q_hi = (np.asarray(x) for x in segments.tile_ranges(jnp.asarray(q_ids), 8))
    kv_lo, kv_hi = (np.asarray(x) for x in segments.tile_ranges(jnp.asarray(kv_ids), 16))
    lo, hi = (np.asarray(x) for x in segments.block_bounds(q_lo, q_hi, kv_lo, kv_hi))
    for b in range(4):
        for i in range(6):
            tile = q_ids[b, 8 * i : 8 * i + 8]
            assert (q_lo[b, i], q_hi[b, i]) == (tile.min(), tile.max()), (seed, b, i)
            meets = [
                j
                for j in range(4)
                if any(tile.min() <= x <= tile.max() for x in kv_ids[b, 16 * j : 16 * j + 16])
                or any(
                    kv_ids[b, 16 * j : 16 * j + 16].min()
                    <= x
                    <= kv_ids[b, 16 * j : 16 * j + 16].max()
                    for x in tile
                )
            ]
            want = (meets[0], meets[-1] + 1) if meets else (0, 0)
            assert (lo[b, i], hi[b, i]) == want, (seed, b, i, meets)


def test_a_tile_pair_skipped_by_its_id_ranges_holds_no_pair_of_equal_ids(seed):
    # Correctness of the skipping, for ids in any order: wherever two tiles' ranges are disjoint
    # no query id equals a key id of the other tile; where ranges meet the kernels mask.
    rng = np.random.default_rng(seed)
    ids = np.concatenate([random_ids(rng, 2, 64), rng.integers(0, 5, (2, 64), dtype=np.int32)])
    lo, hi = (np.asarray(x) for x in segments.tile_ranges(jnp.asarray(ids), 8))
    meets = np.asarray(segments.overlaps(lo[:, :, None], hi[:, :, None], lo[:, None], hi[:, None]))
    tiles = ids.reshape(4, 8, 8)
    equal = (tiles[:, :, :, None, None] == tiles[:, None, None, :, :]).any(axis=(2, 4))
    assert not (equal & ~meets).any(), seed


@pytest.mark.parametrize(
    "computes,want",
    [
        ([1, 1, 1], [0, 1, 2]),
        ([0, 0, 1, 0, 1, 0, 0], [2, 2, 2, 4, 4, 4, 4]),
        ([1, 0, 0, 0], [0, 0, 0, 0]),
        ([0, 0, 0], [0, 0, 0]),
    ],
)
def test_a_skipped_step_fetches_what_the_next_computed_step_reads(computes, want):
    # A skipped step's index maps read the blocks of the next computed step (one early copy);
    # past the last computed step, those of the last (in VMEM already); with none, step 0's.
    got = segments.fetch_steps(jnp.asarray([computes], bool))
    assert np.asarray(got).tolist() == [want]
