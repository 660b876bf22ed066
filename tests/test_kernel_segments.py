"""Segment ids and sliding windows in every attention kernel, against float64 references written
here: one from the rule (loops over rows and keys: a query sees a key of its own id, at or before
its position, within the window), and one that runs each document alone.

The kernels run in interpret mode: the Mosaic TPU kernels in TPU interpret mode (the fused
backward, and the two-kernel one), the Triton GPU kernels in Pallas' interpreter, and
``dew.nn.attention.xla_attention``. One set of inputs (``packed``, from the module's seed) serves
every case: 4 rows of 256 positions, 2 query heads over 1 kv head, head_dim 64, float32, blocks
of 128, of which

- row 0 packs documents of random lengths, ids increasing, with a document of one token and one
  that spans several blocks;
- row 1 is all one document;
- row 2 holds row 0's documents in another order under shuffled ids (not sorted);
- row 3 splits at the block boundary, so the pair (query block 1, key block 0) shares no id and
  its whole step is skipped.

Interpret mode compiles slowly, so each case is one compile of forward and backward, and the
Mosaic cases compute pieces and strips of 64 inside the blocks of 128, which the ids skip too;
the forward alone also runs with more pieces than strips (32 keys against 64 rows, and v5e's
defaults on two rows of 4096 positions), and forward and backward on rows reordered so that row
0 is the one split at the block boundary.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dew.kernels.attention as attention_module
from dew.kernels import (
    flash_attention,
    flash_attention_backward,
    flash_attention_forward,
    mosaic_backward,
    mosaic_forward,
    mosaic_fused_backward,
    platform,
)
from dew.nn.attention import xla_attention
from tests.test_kernels import run_fast_compiled

BATCH, SEQ, HEADS, KV_HEADS, HEAD_DIM = 4, 256, 2, 1, 64
BLOCK = 128
SCALE = 1 / np.sqrt(HEAD_DIM)
# Pieces of keys and strips of query rows the Mosaic kernels compute at a time (and skip by ids).
PIECES = dict(block_k_compute=64, backward_block_k_compute=64, block_q_compute=64)
TOLERANCE = 1e-5  # float32 against float64, relative (Frobenius)


# ---- the references ------------------------------------------------------------------------


def visibility(q_ids, kv_ids, q_len, kv_len, window):
    """bool ``[batch, q_len, kv_len]``, by a loop over queries: causal (bottom-right: query ``i``
    sits at position ``i + kv_len - q_len``), within ``window`` keys, and (ids given) the same
    id."""
    batch = 1 if q_ids is None else len(q_ids)
    visible = np.zeros((batch, q_len, kv_len), bool)
    keys = np.arange(kv_len)
    for b in range(batch):
        for i in range(q_len):
            position = i + kv_len - q_len
            sees = keys <= position
            if window is not None:
                sees &= position - keys < window
            if q_ids is not None:
                sees &= np.asarray(kv_ids[b]) == q_ids[b][i]
            visible[b, i] = sees
    return visible


def reference(q, k, v, do, d_lse, visible):
    """`reference_with` at this module's scale, ``1 / sqrt(HEAD_DIM)``."""
    return reference_with(q, k, v, do, d_lse, visible, SCALE)


def reference_with(q, k, v, do, d_lse, visible, scale):
    """``(out, lse, dq, dk, dv)`` of softmax attention in float64 numpy, from the formulas:
    ``p = softmax(s)`` over the visible keys (all zeros on a row that sees none, whose lse is
    -inf), ``out = p v``, ``lse = log sum exp s``; for the cotangents ``do`` and ``d_lse``:
    ``ds = p * (do v^T - rowsum(do * out) + d_lse)``, ``dq = scale ds k``, ``dk = scale ds^T q``,
    ``dv = p^T do``, each kv head summing its group's query heads."""
    q, k, v, do, d_lse = (np.asarray(x, np.float64) for x in (q, k, v, do, d_lse))
    group = q.shape[2] // k.shape[2]
    kk, vv = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    s = np.where(visible[:, None], np.einsum("bqhd,bkhd->bhqk", q, kk) * scale, -np.inf)
    top = s.max(axis=-1, keepdims=True)
    weights = np.exp(s - np.where(np.isfinite(top), top, 0.0))
    total = weights.sum(axis=-1, keepdims=True)
    p = weights / np.where(total == 0, 1.0, total)
    with np.errstate(divide="ignore"):
        lse = np.where(total == 0, -np.inf, top + np.log(total))[..., 0]
    out = np.einsum("bhqk,bkhd->bqhd", p, vv)
    delta = np.einsum("bqhd,bqhd->bhq", do, out) - d_lse
    ds = p * (np.einsum("bqhd,bkhd->bhqk", do, vv) - delta[..., None])
    dq = np.einsum("bhqk,bkhd->bqhd", ds, kk) * scale

    def per_kv_head(x):
        return x.reshape(*x.shape[:2], k.shape[2], group, x.shape[3]).sum(axis=3)

    dk = per_kv_head(np.einsum("bhqk,bqhd->bkhd", ds, q) * scale)
    dv = per_kv_head(np.einsum("bhqk,bqhd->bkhd", p, do))
    return out, lse, dq, dk, dv


def documents(ids_row):
    """The ``(start, stop)`` of each run of equal ids in a row."""
    edges = [0] + [n for n in range(1, len(ids_row)) if ids_row[n] != ids_row[n - 1]]
    return list(zip(edges, edges[1:] + [len(ids_row)]))


def each_document_alone(inputs, ids, window):
    """The reference run on each document of each row alone (its own short causal sequence, no
    ids), put back in place: ``(out, lse, dq, dk, dv)`` of the whole batch."""
    q, k, v, do, d_lse = (np.asarray(x, np.float64) for x in inputs)
    got = [np.zeros_like(q), np.zeros(d_lse.shape), np.zeros_like(q), np.zeros_like(k)]
    got.append(np.zeros_like(v))
    for b, row in enumerate(ids):
        for start, stop in documents(row):
            one = slice(start, stop)
            alone = reference(
                q[b : b + 1, one],
                k[b : b + 1, one],
                v[b : b + 1, one],
                do[b : b + 1, one],
                d_lse[b : b + 1, :, one],
                visibility(None, None, stop - start, stop - start, window),
            )
            for whole, part in zip(got, alone):
                if whole.ndim == 3:  # lse: [batch, heads, seq]
                    whole[b, :, one] = part[0]
                else:
                    whole[b, one] = part[0]
    return tuple(got)


# ---- the inputs ----------------------------------------------------------------------------


def random_lengths(rng, total: int, low: int, high: int) -> list[int]:
    """Lengths drawn from ``[low, high)`` until they reach ``total``, the last one cut to fit."""
    lengths = []
    while sum(lengths) < total:
        lengths.append(int(rng.integers(low, high)))
    lengths[-1] -= sum(lengths) - total
    return lengths


def packed_ids(rng):
    """The four rows of the module docstring."""
    head = random_lengths(rng, int(rng.integers(30, 80)), 2, 30)
    head.insert(int(rng.integers(len(head) + 1)), 1)  # a document of one token
    # From before position 128 to past it, leaving the rest of the row at least 2 tokens.
    long = int(rng.integers(BLOCK + 20, min(BLOCK + 60, SEQ - sum(head) - 1)))
    lengths = head + [long] + random_lengths(rng, SEQ - sum(head) - long, 2, 40)
    ordered = np.repeat(np.arange(len(lengths)), lengths)
    order = rng.permutation(len(lengths))
    shuffled = np.repeat(rng.permutation(len(lengths)) + 7, np.asarray(lengths)[order])
    halves = np.repeat([0, 1, 2, 3], [50, 78, 100, 28])  # no document across position 128
    ids = np.stack([ordered, np.full(SEQ, 5), shuffled, halves]).astype(np.int32)
    assert ids[0, BLOCK - 1] == ids[0, BLOCK] and 1 in np.bincount(ids[0]), lengths
    return ids


@pytest.fixture(scope="module")
def packed(module_seed):
    rng = np.random.default_rng(module_seed)

    def draw(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    q, do = draw(BATCH, SEQ, HEADS, HEAD_DIM), draw(BATCH, SEQ, HEADS, HEAD_DIM)
    k, v = draw(BATCH, SEQ, KV_HEADS, HEAD_DIM), draw(BATCH, SEQ, KV_HEADS, HEAD_DIM)
    d_lse = draw(BATCH, HEADS, SEQ)
    return (q, k, v, do, d_lse), packed_ids(rng)


def relative_error(got, want):
    return np.linalg.norm(got - want) / np.linalg.norm(want)


def assert_matches(got, want, what):
    """out, lse, dq, dk, dv within TOLERANCE; lse -inf exactly where the reference's is."""
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        g = np.asarray(g, np.float64)
        finite = np.isfinite(w)
        assert np.array_equal(np.isfinite(g), finite), f"{name} ({what}): -inf rows differ"
        error = relative_error(g[finite], w[finite])
        assert error < TOLERANCE, f"{name} ({what}): relative error {error:.3g}"


# ---- the kernels ---------------------------------------------------------------------------

KERNELS = {
    # name: flash_attention_forward's interpret, platform.tuned overrides
    "mosaic": ("tpu", PIECES),
    "mosaic-two-kernel-backward": ("tpu", dict(PIECES, fused_backward=False)),
    "triton": (True, {}),
}


def run_kernel(kernel, inputs, segment_ids, window, q_len=SEQ, also=None):
    """``(out, lse, dq, dk, dv)`` of `flash_attention_forward` and its vjp for the cotangents
    ``(do, d_lse)``, as float64 numpy; the queries are the last ``q_len`` positions. ``also``:
    None, or a function ``also(attend, q, k, v, do, d_lse, out, lse)`` (``attend`` the entry
    points' shared arguments) whose results are computed in the same compile and returned after
    those five."""
    interpret, tuning = KERNELS[kernel]
    q, k, v, do, d_lse = inputs
    q, do, d_lse = q[:, -q_len:], do[:, -q_len:], d_lse[:, :, -q_len:]

    def forward_and_backward(q, k, v, do, d_lse, segment_ids):
        kwargs = dict(
            causal=True,
            segment_ids=segment_ids,
            window=window,
            block_q=BLOCK,
            block_k=BLOCK,
            interpret=interpret,
        )
        (out, lse), vjp = jax.vjp(functools.partial(flash_attention_forward, **kwargs), q, k, v)
        extra = () if also is None else also(kwargs, q, k, v, do, d_lse, out, lse)
        return (out, lse, *vjp((do, d_lse))), extra

    with platform.tuned(**tuning):
        got, extra = run_fast_compiled(forward_and_backward, q, k, v, do, d_lse, segment_ids)
    got = [np.asarray(x, np.float64) for x in got]
    return got if also is None else (got, jax.tree.map(lambda x: np.asarray(x, np.float64), extra))


@pytest.fixture
def computed(monkeypatch):
    """Counts the (strip, piece) pairs the Mosaic forward computes (`mosaic_forward._update`)
    and the keys of those pieces ("forward keys": a strip may compute half a piece), the pieces
    its fused backward computes (`mosaic_fused_backward._attend`) and the block pairs the
    two-kernel backward computes (`mosaic_backward._probabilities`, in dq and in dk/dv)."""
    jax.clear_caches()
    counts = {"forward": 0, "forward keys": 0, "backward": 0, "two-kernel backward": 0}

    def add(name, n):
        jax.debug.callback(lambda: counts.__setitem__(name, counts[name] + n))

    def counted(name, compute):
        def wrapper(*args, **kwargs):
            add(name, 1)
            if name == "forward":
                add("forward keys", kwargs["keys"].size)
            return compute(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(mosaic_forward, "_update", counted("forward", mosaic_forward._update))
    monkeypatch.setattr(
        mosaic_fused_backward, "_attend", counted("backward", mosaic_fused_backward._attend)
    )
    monkeypatch.setattr(
        mosaic_backward,
        "_probabilities",
        counted("two-kernel backward", mosaic_backward._probabilities),
    )
    yield counts
    jax.clear_caches()


def tiles_meeting(ids, q_tile: int, kv_tile: int, window):
    """How many (query tile, key tile) pairs of ``ids`` (self-attention) hold a pair the causal
    mask and the window let through, and whose id ranges meet: what a kernel computing
    ``q_tile`` x ``kv_tile`` tiles inside blocks of ``BLOCK`` must compute, per head. The pair's
    block pair must hold such a pair too (a whole step is skipped on its blocks' ranges)."""
    position = np.arange(SEQ)
    sees = (position[None, :] <= position[:, None]) & (
        True if window is None else position[:, None] - position[None, :] < window
    )
    count = 0
    for row in ids:

        def ranges_meet(rows, keys):
            return row[rows].min() <= row[keys].max() and row[keys].min() <= row[rows].max()

        for r in range(0, SEQ, q_tile):
            for c in range(0, SEQ, kv_tile):
                rows, keys = slice(r, r + q_tile), slice(c, c + kv_tile)
                block_rows = slice(r // BLOCK * BLOCK, r // BLOCK * BLOCK + BLOCK)
                block_keys = slice(c // BLOCK * BLOCK, c // BLOCK * BLOCK + BLOCK)
                by_position = sees[block_rows, keys].any()  # pieces skip on the block's rows
                count += bool(
                    by_position
                    and ranges_meet(block_rows, block_keys)
                    and ranges_meet(rows, keys)
                    and (window is None or sees[rows, keys].any() or q_tile == BLOCK)
                )
    return count


@pytest.mark.parametrize(
    "kernel,window",
    [
        # A window of a block and 2 keys: the first row of a 64-row strip (and of a block) then
        # sees back to the last key of a 64-key piece, which a skip one key too early would miss.
        ("mosaic", BLOCK + 2),
        ("triton", BLOCK),
    ],
)
def test_packed_documents_match_the_reference_and_each_document_alone(
    packed, computed, seed, kernel, window
):
    # Forward and backward (with a cotangent on lse) of the four packed rows: against the
    # float64 reference with the block-diagonal causal mask, and against each document run
    # alone. The Mosaic kernels must compute exactly the tiles whose ids can meet (strips of 64
    # query rows against pieces of 64 keys in the forward, whole query blocks against pieces in
    # the fused backward): fewer than the causal mask alone. (The two-kernel backward's are the
    # pair test's.)
    # With the Triton kernels (the cheaper to interpret) flash_attention, whose custom_vjp
    # carries the ids on its own, runs beside, for the cotangent do.
    inputs, ids = packed

    def plain(kwargs, q, k, v, do, *_):
        out, vjp = jax.vjp(functools.partial(flash_attention, **kwargs), q, k, v)
        return out, *vjp(do)

    also = plain if kernel == "triton" else None
    got = run_kernel(kernel, inputs, jnp.asarray(ids), window, also=also)
    got, plain_got = got if also else (got, None)
    visible = visibility(ids, ids, SEQ, SEQ, window)
    assert_matches(got, reference(*inputs, visible), f"{kernel}, seed {seed}")
    assert_matches(got, each_document_alone(inputs, ids, window), f"{kernel} alone, seed {seed}")
    if plain_got is not None:
        no_d_lse = reference(*inputs[:4], np.zeros_like(inputs[4]), visible)
        for name, g, w in zip(("out", "dq", "dk", "dv"), plain_got, no_d_lse[:1] + no_d_lse[2:]):
            error = relative_error(g, w)
            assert error < TOLERANCE, f"flash_attention's {name} ({kernel}, {seed}): {error:.3g}"
    if kernel == "mosaic":
        forward = HEADS * tiles_meeting(ids, 64, 64, window)
        want = {
            "forward": forward,
            "forward keys": 64 * forward,  # with ids, whole pieces only
            "backward": HEADS * tiles_meeting(ids, BLOCK, 64, window),
            "two-kernel backward": 0,
        }
        causal_only = HEADS * tiles_meeting(np.zeros_like(ids), 64, 64, window)
        assert computed == want and want["forward"] < causal_only, (computed, want, seed)


@pytest.mark.parametrize("kernel", ["mosaic", "mosaic-two-kernel-backward"])
def test_each_batch_row_s_steps_skip_on_its_own_ids(packed, seed, kernel):
    # The kernels skip a block pair (a strip and a piece in the forward, a piece in the fused
    # backward) whose id ranges cannot meet, reading the tables of the pair's own batch row. Row
    # 0 here splits at position 128 (the packed row 3), so its one query block (the last 128
    # positions) skips key block 0; row 1's long document crosses position 128 (the packed row 0,
    # its ids moved past row 0's), so that pair computes. A kernel reading row 0's tables for row
    # 1 would skip it there too. One query block over two key blocks: a table read at a stride
    # of query blocks would read other ranges. Forward and backward against the float64
    # reference.
    rows, q_len = [3, 0], BLOCK
    inputs = tuple(x[rows] for x in packed[0])
    ids = packed[1][rows] + np.array([[0], [100]], np.int32)
    q_ids = ids[:, -q_len:]
    got = run_kernel(kernel, inputs, (jnp.asarray(q_ids), jnp.asarray(ids)), None, q_len)
    visible = visibility(q_ids, ids, q_len, SEQ, None)
    assert not visible[0, :, :BLOCK].any() and visible[1, :, :BLOCK].any(), seed
    q, k, v, do, d_lse = inputs
    cut = (q[:, -q_len:], k, v, do[:, -q_len:], d_lse[:, :, -q_len:])
    assert_matches(got, reference(*cut, visible), f"{kernel}, seed {seed}")


def long_ids(rng, seq: int) -> np.ndarray:
    """Two rows of ``seq`` positions in documents of 40 to 1000 tokens, their ids in order: row
    0's from 0, row 1's from 100, which no id of row 0 meets."""
    rows = [random_lengths(rng, seq, 40, 1000) for _ in range(2)]
    return np.stack([np.repeat(np.arange(len(n)) + 100 * r, n) for r, n in enumerate(rows)])


def each_document_alone_forward(q, k, v, ids):
    """``(out, lse)`` of `each_document_alone` (no window), the forward alone: each document's
    causal attention in float64, put back in place."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    out, lse = np.zeros_like(q), np.zeros((q.shape[0], q.shape[2], q.shape[1]))
    group = q.shape[2] // k.shape[2]
    for b, row in enumerate(ids):
        for start, stop in documents(row):
            one = slice(start, stop)
            kk, vv = (np.repeat(x[b, one], group, axis=1) for x in (k, v))
            s = np.einsum("qhd,khd->hqk", q[b, one], kk) * SCALE
            s = np.where(np.tri(stop - start, dtype=bool), s, -np.inf)
            top = s.max(axis=-1, keepdims=True)
            weights = np.exp(s - top)
            total = weights.sum(axis=-1, keepdims=True)
            out[b, one] = np.einsum("hqk,khd->qhd", weights / total, vv)
            lse[b, :, one] = (top + np.log(total))[..., 0]
    return out, lse


# Mosaic's forward with segment ids computes a query block ``block_q_compute`` rows (a strip) at
# a time against ``block_k_compute`` keys (a piece), skipping the pairs whose id ranges cannot
# meet (per batch row, per strip and per piece). Where a block holds as many strips as pieces
# (every case above: 64 of each in blocks of 128), a table read at a strip's stride reads a
# piece's right; these hold more pieces than strips: 2 strips of 64 rows and 4 pieces of 32 keys
# in blocks of 128, and v5e's defaults (causal blocks of 512 x 2048 computed 256 rows by 512
# keys) at 4096 positions, two key blocks.
V5E = platform.mosaic_tuning("v5e")
UNEQUAL = {
    "64-rows-32-keys": (SEQ, (BLOCK, BLOCK), dict(block_q_compute=64, block_k_compute=32)),
    "v5e-defaults": (
        4096,
        (platform.CAUSAL_BLOCK_Q, platform.TPU_BLOCKS["v5e"][1]),
        dict(block_q_compute=V5E.block_q_compute, block_k_compute=V5E.block_k_compute),
    ),
}


@pytest.mark.parametrize("case", UNEQUAL)
def test_the_forward_reads_each_piece_s_ids_where_strips_and_pieces_differ(packed, seed, case):
    # out and lse of the forward alone (strips and pieces are the forward's) against each
    # document run alone in float64: the packed rows; at v5e's defaults two rows of their own
    # (row 1's ids never row 0's), so that a piece's ranges read at another row's or another key
    # block's place skip the piece.
    seq, (block_q, block_k), tuning = UNEQUAL[case]
    assert block_k // tuning["block_k_compute"] != block_q // tuning["block_q_compute"]
    if seq == SEQ:
        inputs, ids = packed[0][:3], packed[1]
    else:
        rng = np.random.default_rng((seed, 1))
        ids = long_ids(rng, seq)
        inputs = [rng.standard_normal((2, seq, h, HEAD_DIM)).astype(np.float32) for h in (2, 1, 1)]
    attend = functools.partial(
        flash_attention_forward,
        causal=True,
        segment_ids=jnp.asarray(ids),
        block_q=block_q,
        block_k=block_k,
        interpret="tpu",
    )
    with platform.tuned(**tuning):
        got = run_fast_compiled(attend, *inputs)
    want = each_document_alone_forward(*inputs, ids)
    for name, g, w in zip(("out", "lse"), got, want):
        error = relative_error(np.asarray(g, np.float64), w)
        assert error < TOLERANCE, f"{name} ({case}, seed {seed}): relative error {error:.3g}"


def strips_and_pieces_seen(window: int, strip: int, piece: int, by_strip: bool = True) -> int:
    """The (strip, piece) pairs the Mosaic forward computes per head and row under a window
    alone: every strip of ``strip`` rows against every piece of ``piece`` keys in a block pair
    that each row sees whole; in any other block pair holding a visible pair, each strip against
    the pieces that one of its rows sees (``by_strip=False``: that a row of the block sees)."""
    position = np.arange(SEQ)
    ago = position[:, None] - position[None, :]
    sees = (ago >= 0) & (ago < window)
    pairs = 0
    for r in range(0, SEQ, BLOCK):
        for c in range(0, SEQ, BLOCK):
            block = sees[r : r + BLOCK, c : c + BLOCK]
            tiles = block.reshape(BLOCK // strip, strip, BLOCK // piece, piece).any(axis=(1, 3))
            if block.all() or (block.any() and not by_strip):
                tiles = np.broadcast_to(tiles.any(axis=0), tiles.shape)
            pairs += int(tiles.sum())
    return pairs


def test_a_window_alone_computes_only_the_strips_and_pieces_it_shows(packed, computed, seed):
    # A window of 66 keys (no ids), keys computed 32 at a time in strips of 64 rows: against the
    # float64 reference, forward and backward, and the forward computing exactly the (strip,
    # piece) pairs some row of the strip sees, fewer than the pieces some row of the block sees,
    # and of each masked piece only the halves of 16 keys the strip sees. Row 128 sees back to
    # key 63, the last of a piece: a skip one key too early would miss it. The first batch row
    # alone: without ids every row walks the same strips and pieces (the others would only
    # repeat its steps).
    window = 66
    inputs = tuple(x[:1] for x in packed[0])
    KERNELS["mosaic-pieces-of-32"] = ("tpu", dict(PIECES, block_k_compute=32))
    try:
        got = run_kernel("mosaic-pieces-of-32", inputs, None, window)
    finally:
        del KERNELS["mosaic-pieces-of-32"]
    visible = visibility(None, None, SEQ, SEQ, window)
    assert_matches(got, reference(*inputs, visible), f"window {window}, seed {seed}")
    pairs = strips_and_pieces_seen(window, PIECES["block_q_compute"], 32)
    assert computed["forward"] == HEADS * pairs, (computed, pairs, seed)
    assert pairs < strips_and_pieces_seen(window, PIECES["block_q_compute"], 32, by_strip=False)
    # In a whole block pair every strip takes every piece whole, which is every half too.
    keys = 16 * strips_and_pieces_seen(window, PIECES["block_q_compute"], 16)
    assert computed["forward keys"] == HEADS * keys, (computed, keys, seed)
    assert keys < 32 * pairs


@pytest.mark.parametrize("kernel", ["mosaic", "triton"])
def test_a_pair_of_ids_and_rows_that_see_no_key(packed, seed, kernel):
    # segment_ids as a pair (q_ids, kv_ids), the queries the last 136 of the 256 positions
    # (bottom-right causal alignment), a fifth of them with an id no key has: those rows give
    # zeros, lse -inf and no gradient, never NaN; the others as the reference.
    # With the Triton kernels, flash_attention_backward then runs on the keys cut in two, each
    # part with its own kv ids and the merged out and lse (what a ring attention does): the 120
    # keys before the queries (no causal mask: every query follows them) and the queries' own
    # 136 (causal). Its dq shares sum to dq, its dk, dv are the parts'.
    inputs, ids = packed
    q_len = 136
    rng = np.random.default_rng(seed)
    q_ids = ids[:, -q_len:].copy()
    q_ids[rng.random(q_ids.shape) < 0.2] = -1

    def by_key_blocks(kwargs, q, k, v, do, d_lse, out, lse):
        q_ids, kv_ids = kwargs["segment_ids"]
        grads = []
        for keys, causal in ((slice(0, SEQ - q_len), False), (slice(SEQ - q_len, SEQ), True)):
            one = dict(kwargs, causal=causal, segment_ids=(q_ids, kv_ids[:, keys]))
            grads.append(
                flash_attention_backward(q, k[:, keys], v[:, keys], out, lse, do, d_lse, **one)
            )
        (dq_a, dk_a, dv_a), (dq_b, dk_b, dv_b) = grads
        return dq_a + dq_b, jnp.concatenate([dk_a, dk_b], 1), jnp.concatenate([dv_a, dv_b], 1)

    segment_ids = (jnp.asarray(q_ids), jnp.asarray(ids))
    also = by_key_blocks if kernel == "triton" else None
    got = run_kernel(kernel, inputs, segment_ids, None, q_len, also=also)
    got, blocks = got if also else (got, ())
    q, k, v, do, d_lse = inputs
    cut = (q[:, -q_len:], k, v, do[:, -q_len:], d_lse[:, :, -q_len:])
    want = reference(*cut, visibility(q_ids, ids, q_len, SEQ, None))
    assert_matches(got, want, f"{kernel}, seed {seed}")
    for name, g, w in zip(("dq", "dk", "dv"), blocks, want[2:]):
        error = relative_error(g, w)
        assert error < TOLERANCE, f"{name} by key blocks ({kernel}, seed {seed}): {error:.3g}"
    lonely = q_ids == -1
    out, lse, dq = got[:3]
    assert lonely.any() and np.all(out[lonely] == 0) and np.all(dq[lonely] == 0), seed
    assert np.all(lse.transpose(0, 2, 1)[lonely] == -np.inf), seed


@pytest.mark.parametrize("kernel", ["mosaic-two-kernel-backward", "triton"])
def test_windows_of_one_key_and_of_more_than_the_sequence(packed, seed, kernel):
    # A window of 1: each query sees itself alone. With the two-kernel Mosaic backward, under a
    # pair of ids too, a fifth of the query ids changed: those rows see nothing. A window longer
    # than the sequence hides nothing: it is the causal call, its tiling has no window
    # (`test_a_window_past_the_keys_is_the_causal_call`), and with the Triton kernels its results
    # are the causal call's to the bit.
    inputs, ids = packed
    q, k, v, do, d_lse = (x[:1] for x in inputs)
    interpret, tuning = KERNELS[kernel]
    segment_ids, q_ids = None, None
    if kernel.startswith("mosaic"):
        q_ids = ids[:1].copy()
        q_ids[np.random.default_rng(seed).random(q_ids.shape) < 0.2] = -1
        segment_ids = (jnp.asarray(q_ids), jnp.asarray(ids[:1]))
    windows = (1,) if segment_ids is not None else (1, SEQ + 44, None)

    def each_window(q, k, v, do, d_lse, segment_ids):
        results = []
        for window in windows:
            attend = functools.partial(
                flash_attention_forward,
                window=window,
                segment_ids=segment_ids,
                block_q=BLOCK,
                block_k=BLOCK,
                interpret=interpret,
            )
            (out, lse), vjp = jax.vjp(attend, q, k, v)
            results.append((out, lse, *vjp((do, d_lse))))
        return results

    with platform.tuned(**tuning):
        one, *others = run_fast_compiled(each_window, q, k, v, do, d_lse, segment_ids)
    one = [np.asarray(x, np.float64) for x in one]
    kv_ids = None if q_ids is None else ids[:1]
    visible = visibility(q_ids, kv_ids, SEQ, SEQ, 1)
    assert_matches(one, reference(q, k, v, do, d_lse, visible), f"{kernel}, seed {seed}")
    if others:
        longer, causal = others
        for a, b in zip(longer, causal):
            assert np.array_equal(a, b), seed


def test_a_window_past_the_keys_is_the_causal_call():
    # A window of kv_len keys or more hides none: the tiling has no window (the kernels' causal
    # code). One key fewer is a window. Refusals: not an int >= 1, or without causal.
    q, k = jnp.zeros((1, 40, 2, 16)), jnp.zeros((1, 56, 1, 16))

    def tiling(**kw):
        config, _ = attention_module._config(
            q, k, k, sm_scale=None, block_q=None, block_k=None, interpret="tpu", **kw
        )
        return config.tiling

    assert tiling(causal=True, window=56).window is None
    assert tiling(causal=True, window=1000).window is None
    assert tiling(causal=True, window=55).window == 55
    for bad in (0, -3, 2.0, True, "8"):
        with pytest.raises(ValueError, match=re.escape("window must be None or an int >= 1")):
            tiling(causal=True, window=bad)
    with pytest.raises(ValueError, match="window=8 needs causal=True"):
        tiling(causal=False, window=8)


def test_xla_attention_takes_segment_ids_and_a_window(packed, seed):
    # dew.nn.attention.xla_attention, the XLA path: the same masks, out and lse (its gradients
    # are JAX's own), rows that see no key giving zeros and lse -inf.
    inputs, ids = packed
    q, k, v, do, d_lse = inputs
    q_ids = ids.copy()
    q_ids[:, ::7] = -1
    for window in (None, 40):
        out, lse = jax.jit(functools.partial(xla_attention, window=window))(
            q, k, v, segment_ids=(jnp.asarray(q_ids), jnp.asarray(ids))
        )
        want = reference(*inputs, visibility(q_ids, ids, SEQ, SEQ, window))
        got = [np.asarray(out, np.float64), np.asarray(lse, np.float64)]
        for name, g, w in zip(("out", "lse"), got, want[:2]):
            finite = np.isfinite(w)
            assert np.array_equal(np.isfinite(g), finite), (name, window, seed)
            assert relative_error(g[finite], w[finite]) < TOLERANCE, (name, window, seed)


def test_cudnn_takes_no_segment_ids_and_auto_runs_the_kernels_instead():
    # jax.nn.dot_product_attention (JAX 0.10.2) takes no segment ids: "cudnn" with them is
    # refused before anything is compiled, naming why, and "auto" on a GPU picks the Pallas
    # kernels for such a call (cuDNN where there are none).
    from dew.nn import attention

    with pytest.raises(ValueError, match="takes no segment ids"):
        attention.resolve("cudnn", "gpu", jnp.bfloat16, 64, segmented=True)
    assert attention.resolve("auto", "gpu", jnp.bfloat16, 64, segmented=True) == "pallas"
    assert attention.resolve("auto", "gpu", jnp.bfloat16, 64) == "cudnn"
    q = jnp.zeros((1, 16, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="takes no segment ids"):
        attention.cudnn_attention(q, q, q, segment_ids=jnp.zeros((1, 16), jnp.int32))


@pytest.mark.parametrize(
    "segment_ids,message",
    [
        (np.zeros((2, 40), np.int64), r"segment_ids must be int32; q_ids is \(2, 40\) int64"),
        (np.zeros((2, 41), np.int32), r"q_ids must be \[batch, q_len\] = \(2, 40\); got \(2, 41\)"),
        (np.zeros((1, 40), np.int32), r"= \(2, 40\); got \(1, 40\) int32"),
        ((np.zeros((2, 40), np.int32),), "one int32 \\[batch, seq\\] array or a pair"),
        ((np.zeros((2, 40), np.int32), [0] * 40), "kv_ids must be an int32 array; got list"),
        (
            (np.zeros((2, 40), np.int32), np.zeros((2, 40), np.float32)),
            "segment_ids must be int32; kv_ids is \\(2, 40\\) float32",
        ),
    ],
    ids=["int64", "longer", "batch", "one-of-a-pair", "list", "float-kv"],
)
def test_refuses_bad_segment_ids(monkeypatch, segment_ids, message):
    # A ValueError naming the shapes and dtypes, from every entry point, before any kernel.
    from tests.test_kernels import _no_kernel

    for entry in ("_padded_attention", "_padded_forward", "_padded_backward"):
        monkeypatch.setattr(attention_module, entry, _no_kernel)
    q, k = jnp.zeros((2, 40, 4, 16)), jnp.zeros((2, 40, 2, 16))
    lse = jnp.zeros((2, 4, 40))
    calls = (
        lambda: flash_attention(q, k, k, segment_ids=segment_ids),
        lambda: flash_attention_forward(q, k, k, segment_ids=segment_ids, interpret="tpu"),
        lambda: flash_attention_backward(q, k, k, q, lse, q, segment_ids=segment_ids),
    )
    for call in calls:
        with pytest.raises(ValueError, match=message):
            call()


def test_refuses_one_array_of_ids_for_unequal_lengths_and_mosaic_key_blocks_off_the_lanes(
    monkeypatch,
):
    from tests.test_kernels import _no_kernel

    monkeypatch.setattr(attention_module, "_padded_forward", _no_kernel)
    q, k = jnp.zeros((1, 40, 2, 16)), jnp.zeros((1, 300, 1, 16))
    with pytest.raises(ValueError, match="q_len is 40 and kv_len 300: pass a pair"):
        flash_attention_forward(q, k, k, segment_ids=jnp.zeros((1, 40), jnp.int32))
    # With ids, Mosaic's key blocks are lanes of the [8, block_k] id blocks: a multiple of 128,
    # or the whole key length. The generic interpreter takes its power-of-two blocks.
    ids = (jnp.zeros((1, 40), jnp.int32), jnp.zeros((1, 300), jnp.int32))
    message = r"block_k must be a multiple of 128 .* got block_k=64 for kv_len 300"
    with pytest.raises(ValueError, match=message):
        flash_attention_forward(q, k, k, segment_ids=ids, block_k=64, interpret="tpu")
    for block_k, interpret in ((128, "tpu"), (304, "tpu"), (64, True)):
        with pytest.raises(AssertionError, match="the kernels were reached"):
            flash_attention_forward(q, k, k, segment_ids=ids, block_k=block_k, interpret=interpret)
