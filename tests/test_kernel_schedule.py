"""The Mosaic kernels' step tables (`dew.kernels.schedule`) against a brute-force loop over rows and
keys. Pure numpy: no kernel runs.

A kernel's last grid dimension walks its table: the forward one step per (query block, key block)
pair holding a visible (row, key) pair, each query block's key blocks in one run; the fused
backward, per kv head, each key block's visible query blocks in one run, head by head over the
group. ``FIRST``/``LAST`` open and close a run's output block, ``MASKED`` asks for the mask,
``EMPTY`` computes nothing (a block no row sees still writes its output). What the tables must
say is written here from the causal formula alone: real query row ``i`` sees real key ``j`` iff
``j <= i + kv_len - q_len`` (every real key when not causal); padded rows and keys (beyond the
lengths, up to whole blocks) see nothing.
"""

from collections import defaultdict

import numpy as np
import pytest

from dew.kernels.schedule import (
    EMPTY,
    FIRST,
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
    return not tiling.causal or key <= row + tiling.kv_len - tiling.q_len


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


def check_flags(flags, steps: dict, *, empty: set, masked_steps: set):
    """FIRST exactly on each run's first step, LAST on its last; EMPTY exactly on the runs of the
    blocks in ``empty``, one step each; MASKED exactly on the computed steps in ``masked_steps``."""
    for o, ts in steps.items():
        for t in ts:
            assert bool(flags[t] & FIRST) == (t == ts[0]), (o, t, flags[t])
            assert bool(flags[t] & LAST) == (t == ts[-1]), (o, t, flags[t])
            assert bool(flags[t] & EMPTY) == (o in empty), (o, t, flags[t])
        if o in empty:
            assert len(ts) == 1, (o, ts)
    for t, f in enumerate(flags):
        assert not f & ~(FIRST | LAST | MASKED | EMPTY), (t, f)
        if not f & EMPTY:
            assert bool(f & MASKED) == (t in masked_steps), (t, f)


def check_forward(tiling: Tiling):
    seen, masked = brute_force_pairs(tiling)
    steps = forward_steps(tiling)
    for table in steps.tables():
        assert table.dtype == np.int32 and table.flags["C_CONTIGUOUS"] and len(table) == len(steps)
    q_block, kv_block, head, flags = (np.asarray(t).tolist() for t in steps.tables())
    assert set(head) == {0}
    computed = [(i, j) for i, j, f in zip(q_block, kv_block, flags) if not f & EMPTY]
    # Each visible pair exactly once; nothing else computed (no pair masked whole).
    assert sorted(computed) == sorted(seen), (sorted(computed), sorted(seen))
    assert steps.computed_pairs() == len(seen)
    # Every query block has one run (its output is written once), in block order.
    by_block = runs(q_block)
    assert list(by_block) == list(range(tiling.q_blocks))
    empty = set(range(tiling.q_blocks)) - {i for i, _ in seen}  # query blocks seeing no key
    masked_steps = {t for t, pair in enumerate(zip(q_block, kv_block)) if pair in masked}
    check_flags(flags, by_block, empty=empty, masked_steps=masked_steps)
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
    # q_len, kv_len, block_q, block_k, causal
    pytest.param(37, 37, 16, 8, True, id="causal-square-odd"),
    pytest.param(37, 53, 16, 8, True, id="causal-q37-kv53"),
    pytest.param(53, 21, 8, 16, True, id="causal-q53-kv21-rows-see-nothing"),
    pytest.param(40, 40, 8, 24, True, id="causal-block_k-not-block_q"),
    pytest.param(29, 45, 16, 16, False, id="full-padded-tails"),
    pytest.param(1, 1, 8, 8, True, id="one-row-one-key"),
]


@pytest.mark.parametrize("q_len,kv_len,block_q,block_k,causal", TILINGS)
def test_forward_steps_visit_each_visible_pair_once(q_len, kv_len, block_q, block_k, causal):
    check_forward(Tiling(q_len, kv_len, block_q, block_k, causal))


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("q_len,kv_len,block_q,block_k,causal", TILINGS)
def test_backward_steps_visit_each_visible_pair_once_per_head(
    q_len, kv_len, block_q, block_k, causal, group
):
    check_backward(Tiling(q_len, kv_len, block_q, block_k, causal), group)


def test_random_tilings(seed):
    # Fifty tilings drawn from the seed: lengths 1 to 70, blocks of 8 to 32 rows, causal or not,
    # groups of 1 to 3 query heads.
    rng = np.random.default_rng(seed)
    for _ in range(50):
        q_len, kv_len = (int(n) for n in rng.integers(1, 71, size=2))
        block_q, block_k = (int(b) for b in rng.choice([8, 16, 24, 32], size=2))
        tiling = Tiling(q_len, kv_len, block_q, block_k, bool(rng.integers(2)))
        try:
            check_forward(tiling)
            check_backward(tiling, int(rng.integers(1, 4)))
        except AssertionError as error:
            raise AssertionError(f"{tiling} (seed {seed}): {error}") from error


def test_visible_blocks_are_the_brute_force_pairs():
    for q_len, kv_len, causal in [(37, 53, True), (53, 21, True), (29, 45, False), (64, 64, True)]:
        tiling = Tiling(q_len, kv_len, 16, 8, causal)
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
