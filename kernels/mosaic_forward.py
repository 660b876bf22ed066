"""Mosaic TPU forward kernel: an online softmax over the visible block pairs only.

Grid ``(batch, heads / n, steps)``, the last dimension sequential: it walks `kernels.schedule`'s
table of the (query block, key block) pairs that hold a visible (row, key) pair, each query block's
key blocks in a run (a causal one from the diagonal back). The step ``(b, h, t)`` holds the ``[n,
block_q, head_dim]`` query blocks of the ``n`` heads from ``h * n`` (``Tuning.heads_per_step``: up
to 16 on v5e, within ``mosaic.FORWARD_LOGITS``) and the ``[block_k, head_dim]`` key and value
blocks of their kv heads (query head ``i`` reads kv head ``i // group``: grouped queries read the
shared K/V in place), and adds the key block to each query block's running maximum ``m``, running
sum ``l`` and unnormalised float32 accumulator, in VMEM scratch; the run's last step writes ``out``
and ``lse``. A run whose first step is ``FRESH`` (every row of the block sees its key block's first
key) writes the three from its first piece, under its mask, rather than adding that piece to zeros:
on a v5e chip, without the zeroing step (768 vector stores a run at two heads of 1024 rows), the
forward was 1.2% faster at 4096 keys without a mask and 0.7% at 8192 causal keys, and walking
causal runs from the diagonal lets masked and windowed runs start so too (on a v5e chip, 10.8% and
8.0% faster at GPT-2 small's and Llama-3.2-1B's shapes, where every run is one masked step, 3.7%
under a window of 1024 at 8192 keys, 1.7% causal at 8192). With segment ids no run starts fresh (a
run's first step may be skipped) and runs ascend, as the diagonal-first walk was 3% slower there.
Several heads a step make the grid shorter and its DMAs longer, and give the compiler more
independent matmuls to overlap with each head's softmax: on a v5e chip 4 heads of 512 rows were
6-7% faster than one, and 16 heads at 512 x 512 under a window 15% faster than 4.

Inside a step the key block is computed ``block_k_compute`` keys at a time, and each piece
``block_q_compute`` query rows at a time (both unrolled): a large block keeps the DMAs long and
the grid short, a smaller computed strip keeps the ``[block_q_compute, block_k_compute]`` float32
logits small. They are held in the core's 64 vector registers as far as they fit and spilled to
VMEM past that; a store of a spilled register is half the forward's bundles at whole 512-row
blocks, so strips of 256 rows were 1.7-5.5% faster on a v5e chip from 4096 keys on (no
different at 2048), though each strip loads the piece's K and V into the MXUs again. Only pairs
the table marks ``MASKED`` (the causal diagonal, a padded key tail) build a mask, and within them
a piece no row sees is skipped.

Segment ids (`kernels.segments`) skip more while the kernel runs: a step whose blocks' id ranges
cannot meet computes nothing and fetches the next computed step's blocks, a strip of query rows
whose ids cannot meet a piece's is skipped, and every strip computed masks the pairs of unequal
ids. A window is positions: the step table leaves out the pairs outside it, and a masked pair
skips the strips of a piece no row of theirs sees and computes only the half of a piece a strip
sees where it sees one half (the window's edge, the diagonal): compiled for v5e, a run under a
window of 1024 at 512 x 512 blocks went from 15,281 to 13,751 bundles, and the call from 1.401
to 1.289 ms on a v5e chip (docs/kernels.md, "Half pieces under a window").

A strip is the unit of that skipping, and all the step's heads compute it together (`_strip`):
heads inside strips, not strips inside heads. A branch ends a basic block, and the compiler
interleaves one head's matmuls with another's softmax only within a block; a strip's skip and its
mask depend on positions and ids, never on the head, so one branch and one mask serve all the
heads. Compiled for v5e with a window, a masked strip of four heads took 2,363 bundles where the
head-by-head order took about 2,717 (each head's strip its own branch, its own mask); on the chip
the window of 1024 at 8192 keys went from 1.649 to 1.455 ms and segment ids (documents of mean
300) from 1.283 to 1.120 ms, outputs equal to the bit (docs/kernels.md, "The strip as the unit").
A causal mask alone skips whole pieces: a piece's strips stay in one block.

Numerics (`kernels.mosaic`): base-2 logits ``s = (q . k) * sm_scale * log2(e)``, ``m`` and ``l``
kept lane-dense (``[block_q, 128]``, every lane equal), ``lse = m + log2(l)``, ``+inf`` for a row
that sees no key (its output is 0).

Layout: the kernel from the inside out (`_strip`, `_update`: a strip of every head against one
piece; `_walk`: a step's pieces and strips; `_forward_kernel`: a step), the starts a step table
holds (`_fresh_starts`), the segment ids' tables and in-kernel tests (`_segments`,
`segments_for_forward`), then the `pallas_call` (`forward`). One module, because each layer takes
the one inside it as its only caller and their static choices (which starts compile, which walks
mask, which strips skip) are made once in `forward` and threaded through; split apart, each piece
would carry the others' arguments across a module boundary for no second user.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import mosaic, segments
from .schedule import EMPTY, FIRST, FRESH, LAST, MASKED, forward_steps
from .tiling import Tiling, as_index, index_div
from .varying import out_struct


def _strip(
    q_ref,
    k_ref,
    v_ref,
    acc_ref,
    m_ref,
    l_ref,
    *,
    group,
    rows,
    keys,
    scale,
    visible=None,
    fresh=False,
):
    """One strip of query rows (``rows``: a static slice of the query block) of every head of the
    step against one piece of keys (``keys``: a slice of the key block). ``visible``: None, or a
    function giving the bool ``[rows, piece]`` pairs to keep (the position mask and/or the ids'),
    called once here and applied to every head. The heads sit in one basic block, so their
    matmuls and softmaxes interleave; the mask is built once for all of them."""
    mask = None if visible is None else visible()
    for j in range(q_ref.shape[0]):
        _update(
            q_ref[j, rows, :],
            k_ref.at[j // group],
            v_ref.at[j // group],
            acc_ref.at[j, rows],
            m_ref.at[j, rows],
            l_ref.at[j, rows],
            keys=keys,
            scale=scale,
            mask=mask,
            fresh=fresh,
        )


def _update(q, k_ref, v_ref, acc_ref, m_ref, l_ref, *, keys, scale, mask=None, fresh=False):
    """The online softmax of ``q``'s rows (``[rows, head_dim]``) after one piece of keys;
    ``mask``: None, or bool ``[rows, piece]``, the pairs kept. ``fresh``: True where the piece
    starts the run and every row sees one of its keys, so the statistics and the accumulator are
    written from it alone, not read (nothing zeroed them); a traced bool where only some steps
    that run this code start their run so (their statistics are read as zeros, not loaded).
    False: added to what is there."""
    k = k_ref[keys, :]
    s = mosaic.dot(q, k, (1, 1)) * scale  # [rows, piece], float32
    if mask is not None:
        s = jnp.where(mask, s, -jnp.inf)
    if fresh is True:  # every row sees a key of the piece: its maximum is finite
        m_next = jnp.broadcast_to(jnp.max(s, axis=1, keepdims=True), m_ref.shape)
        p = jnp.exp2(s - mosaic.lanes_to(m_next, s.shape[1]))
        l_ref[...] = jnp.broadcast_to(jnp.sum(p, axis=1, keepdims=True), l_ref.shape)
        v = v_ref[keys, :]
        acc_ref[...] = mosaic.dot(p.astype(v.dtype), v, (1, 0))
        m_ref[...] = m_next
        return
    m_prev, l_prev, acc_prev = m_ref[...], l_ref[...], acc_ref[...]  # m, l: [rows, LANES]
    if fresh is not False:  # the step's FRESH flag: nothing zeroed the scratch
        m_prev = jnp.where(fresh, -jnp.inf, m_prev)
        l_prev = jnp.where(fresh, 0.0, l_prev)
        acc_prev = jnp.where(fresh, 0.0, acc_prev)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    # A row that has seen only masked keys still has m = -inf, and exp2(-inf - (-inf)) is NaN;
    # subtracting 0 for it keeps its p and rescale at exactly 0.
    m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
    p = jnp.exp2(s - mosaic.lanes_to(m_safe, s.shape[1]))
    rescale = jnp.exp2(m_prev - m_safe)
    l_ref[...] = rescale * l_prev + jnp.sum(p, axis=1, keepdims=True)
    v = v_ref[keys, :]
    acc_ref[...] = mosaic.lanes_to(rescale, acc_ref.shape[1]) * acc_prev + mosaic.dot(
        p.astype(v.dtype), v, (1, 0)
    )
    m_ref[...] = m_next


def _walk(
    *,
    masked: bool,
    tiling: Tiling,
    q_block,
    kv_block,
    piece: int,
    rows: int,
    fresh,
    segments,
    strip,
):
    """One step's work over its key block, ``piece`` keys at a time, each piece ``rows`` query rows
    at a time (all unrolled). An unmasked pair computes every strip and piece without a position
    mask. A ``masked`` pair (the table marks it ``MASKED``) masks each piece by position and skips
    a piece no row sees: the whole piece at once under a causal mask alone (its strips and heads
    in one basic block, so their matmuls interleave), strip by strip with a window or segment ids,
    which leave more of a piece's strips unseen; under a window alone, a strip that sees one half
    of a piece computes that half (`by_halves`). ``fresh``: None, True, or a traced bool (the
    step's ``FRESH`` flag): the first piece writes the run's statistics (`_update`), every strip
    of it, since every row sees its first key. ``segments``: None, or ``segments(first_row, rows,
    keys) -> (seen, same_id)`` of a strip (`_segments`): a strip skips a piece whose ids cannot
    meet its own, and masks unequal ids. ``strip(**kw)`` computes one strip (`_strip`, its refs
    bound)."""

    def position_mask(first_row, first_key, same_id=None, width=piece):
        keep = mosaic.piece_mask(tiling, q_block, first_key, (rows, width), first_row=first_row)
        return keep if same_id is None else jnp.logical_and(keep, same_id())

    strip_by_strip = tiling.window is not None or segments is not None
    # Under a window (without ids) a strip computes only the half of a masked piece its rows
    # see, where they see one half: the window's edge leaves the first half of a piece unseen by
    # a block's later strips, the diagonal the second half by its earlier ones. A half is a
    # piece (keys a multiple of 8) of its own (docs/kernels.md, "Half pieces under a window").
    half = piece // 2 if tiling.window is not None and segments is None and piece % 16 == 0 else 0

    def by_halves(n, first_row, starts):
        first_key = kv_block * tiling.block_k + n * piece
        sees = [
            mosaic.piece_is_seen(tiling, q_block, first_key + h, half, first_row, rows)
            for h in (0, half)
        ]

        def compute(offset, width):
            visible = functools.partial(position_mask, first_row, first_key + offset, None, width)
            keys = pl.ds(n * piece + offset, width)
            strip(rows=pl.ds(first_row, rows), keys=keys, visible=visible, fresh=starts)

        pl.when(jnp.logical_and(sees[0], sees[1]))(functools.partial(compute, 0, piece))

        # One copy of the half's code for either half (a fresh start is always the first: all
        # its rows see the piece's first key).
        @pl.when(sees[0] != sees[1])
        def _one_half():
            offset = pl.multiple_of(jnp.where(sees[0], as_index(0), as_index(half)), half)
            compute(offset, half)

    def fresh_piece():
        first_key = kv_block * tiling.block_k
        for first_row in range(0, tiling.block_q, rows):
            visible = functools.partial(position_mask, first_row, first_key) if masked else None
            strip(rows=pl.ds(first_row, rows), keys=pl.ds(0, piece), visible=visible, fresh=True)

    def compute_piece(n, starts=False):
        keys = pl.ds(n * piece, piece)
        first_key = kv_block * tiling.block_k + n * piece
        if masked and not strip_by_strip:

            def masked_piece():
                for first_row in range(0, tiling.block_q, rows):
                    visible = functools.partial(position_mask, first_row, first_key)
                    strip(rows=pl.ds(first_row, rows), keys=keys, visible=visible, fresh=starts)

            pl.when(mosaic.piece_is_seen(tiling, q_block, first_key, piece))(masked_piece)
            return
        for first_row in range(0, tiling.block_q, rows):
            run = functools.partial(strip, rows=pl.ds(first_row, rows), keys=keys, fresh=starts)
            seen, same_id = None, None
            if segments is not None:
                seen, same_id = segments(first_row, rows, keys)
            if not masked:
                run = functools.partial(run, visible=same_id)
                if seen is None:
                    run()
                else:
                    pl.when(seen)(run)
                continue
            if half:
                by_halves(n, first_row, starts)
                continue
            by_position = mosaic.piece_is_seen(tiling, q_block, first_key, piece, first_row, rows)
            seen = by_position if seen is None else jnp.logical_and(seen, by_position)
            visible = functools.partial(position_mask, first_row, first_key, same_id)
            pl.when(seen)(functools.partial(run, visible=visible))

    for n in range(tiling.block_k // piece):
        if n == 0 and fresh is True:
            fresh_piece()
        elif n == 0 and fresh is not None and masked:
            # One copy of the masked code for both starts (fresh ones read zeros): two would
            # double the masked walk's first piece.
            compute_piece(0, starts=fresh)
        elif n == 0 and fresh is not None:
            pl.when(fresh)(fresh_piece)
            pl.when(~fresh)(functools.partial(compute_piece, 0))
        else:
            compute_piece(n)


def _forward_kernel(
    *refs,
    tiling: Tiling,
    scale: float,
    block_k_compute: int,
    rows: int,
    group: int,
    segment_tables: int,
    fresh_starts: tuple,
):
    # Scalar prefetch: the step tables (and with segment ids `segments_for_forward`'s), then
    # q, k, v (and the ids' blocks), out, lse, and the scratch.
    tables, refs = refs[: 4 + segment_tables], refs[4 + segment_tables :]
    q_table, kv_table, _, flags_table = tables[:4]
    q_ref, k_ref, v_ref = refs[:3]
    ids_refs = refs[3:5] if segment_tables else None
    o_ref, lse_ref, acc_ref, m_ref, l_ref = refs[5:] if segment_tables else refs[3:]
    t = pl.program_id(2)
    flags = flags_table[t]
    q_block, kv_block = q_table[t], kv_table[t]
    heads = q_ref.shape[0]  # the step's query heads; query head j reads kv head j // group
    first = (flags & FIRST) != 0
    # A run whose first step is FRESH writes its statistics from that step's first piece
    # (`_update`'s ``fresh``); any other starts from zeros. Which kinds the table holds is known
    # before compiling (`_fresh_starts`): a kind no step has compiles no code.
    fresh = (flags & FRESH) != 0
    unmasked_kind, masked_kind, zeros_kind = fresh_starts
    step_seen = segments = None
    if segment_tables:
        step_seen, segments = _segments(tables[4:], ids_refs, tiling, rows, block_k_compute)

    if zeros_kind is not None:

        @pl.when(first if zeros_kind is True else first & ~fresh)
        def _start():
            acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
            m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
            l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)

    strip = functools.partial(
        _strip, q_ref, k_ref, v_ref, acc_ref, m_ref, l_ref, group=group, scale=scale
    )

    def walk(masked: bool):
        # A start every step of the walk has (or none has) is static; one only some steps have
        # reads the step's flag.
        kind = masked_kind if masked else unmasked_kind
        _walk(
            masked=masked,
            tiling=tiling,
            q_block=q_block,
            kv_block=kv_block,
            piece=block_k_compute,
            rows=rows,
            fresh=fresh if kind == "some" else kind,
            segments=None if segments is None else segments(q_block, kv_block),
            strip=strip,
        )

    mosaic.by_mask(walk, flags=flags, step_seen=step_seen)

    @pl.when((flags & LAST) != 0)
    def _finish():
        # The run's end costs the same for every row whatever its keys, so it weighs most in
        # short runs (a window's: 11% of a run's bundles). Two things keep it short: `1 / l`
        # without the IEEE edge cases (`full_range=False`), whose input max(l, 1) is never 0,
        # inf or NaN (a row that sees a key has l >= 1, the key of its maximum adding exp2(0) =
        # 1; one that sees none has l = 0 and acc = 0, so its output is 0); and the lse's log on
        # one row of block_q values, m and l transposed together (lane 0 and lane 1), not on a
        # lane-dense [block_q, 128] copy. Compiled for v5e, a window run's end went from 348 to
        # 181 bundles a head (docs/kernels.md, "A shorter end of a run").
        first_lane = jax.lax.broadcasted_iota(jnp.int32, l_ref.shape[1:], 1) == 0
        for j in range(heads):
            row_sum = l_ref[j]  # [block_q, LANES], every lane equal
            inverse = pl.reciprocal(jnp.maximum(row_sum, 1.0), full_range=False)
            o_ref[j] = (acc_ref[j] * mosaic.lanes_to(inverse, o_ref.shape[-1])).astype(o_ref.dtype)
            stats = jnp.where(first_lane, m_ref[j], row_sum)[:, :2].T  # [2, block_q]: m, l
            m_row, l_row = stats[:1], stats[1:]
            # stored as a row (kernels/mosaic.py); +inf for a row that sees no key
            lse_ref[j] = jnp.where(l_row == 0.0, jnp.inf, m_row + jnp.log2(l_row))


def _fresh_starts(steps) -> tuple:
    """``(unmasked, masked, zeros)``, each None (no step of the kind), True (every one) or
    "some": the computing steps, unmasked and masked, whose first piece starts its run fresh
    (``FRESH``), and the runs that start from zeros (a first step without ``FRESH``, ``EMPTY``
    ones included; with segment ids every run, `schedule.forward_steps`)."""
    flags = steps.flags
    first = (flags & FIRST) != 0
    fresh = (flags & FRESH) != 0
    computing = (flags & EMPTY) == 0
    masked = (flags & MASKED) != 0
    kinds = []
    for chosen in (computing & ~masked, computing & masked):
        if not (fresh & chosen).any():
            kinds.append(None)
        else:
            kinds.append(True if (fresh | ~chosen).all() else "some")
    zeros = first & ~fresh
    zeros_kind = None if not zeros.any() else (True if not (first & fresh).any() else "some")
    return (*kinds, zeros_kind)


def _segments(tables, ids_refs, tiling: Tiling, rows: int, piece: int):
    """``(step_seen, segments)`` of a forward step with segment ids: whether the step computes
    (its fetch table names itself: `segments.fetch_steps`), and ``segments(q_block, kv_block)``,
    which gives `_walk` its ``segments(first_row, rows, keys) -> (seen, same_id)``: the strip's
    and the piece's id ranges meet (SMEM tables), and the strip's pairs of equal ids (read from
    the ids' blocks: the query ids across lanes, the key ids as a row)."""
    fetch, q_lo, q_hi, kv_lo, kv_hi = tables
    q_ids_ref, kv_ids_ref = ids_refs
    b, t = pl.program_id(0), pl.program_id(2)
    steps = pl.num_programs(2)
    strips, pieces = tiling.block_q // rows, tiling.block_k // piece
    strips_per_row, pieces_per_row = tiling.q_blocks * strips, tiling.kv_blocks * pieces

    def for_pair(q_block, kv_block):
        def strip(first_row, rows, keys):
            q_tile = b * strips_per_row + q_block * strips + first_row // rows
            kv_tile = b * pieces_per_row + kv_block * pieces + keys.start // piece
            seen = segments.overlaps(q_lo[q_tile], q_hi[q_tile], kv_lo[kv_tile], kv_hi[kv_tile])

            def same_id():
                q_ids = q_ids_ref[first_row : first_row + rows, :]  # [rows, LANES]
                kv_ids = kv_ids_ref[0:1, keys]  # [1, piece]
                return mosaic.lanes_to(q_ids, kv_ids.shape[1]) == kv_ids

            return seen, same_id

        return strip

    return fetch[b * steps + t] == t, for_pair


def segments_for_forward(ids, steps, tiling: Tiling, rows: int, piece: int):
    """The forward's segment tables (``fetch, q_lo, q_hi, kv_lo, kv_hi``: flat int32, per batch
    row: the step each step fetches, and the id ranges of the query strips and the key pieces)
    and the ids' blocks' arrays (query ids across lanes, key ids as rows), from padded
    ``(q_ids, kv_ids)``."""
    q_ids, kv_ids = ids
    q_lo, q_hi = segments.tile_ranges(q_ids, rows)
    kv_lo, kv_hi = segments.tile_ranges(kv_ids, piece)
    q_block_lo, q_block_hi = segments.tile_ranges(q_ids, tiling.block_q)
    kv_block_lo, kv_block_hi = segments.tile_ranges(kv_ids, tiling.block_k)
    computes = segments.overlaps(
        q_block_lo[:, steps.q_block],
        q_block_hi[:, steps.q_block],
        kv_block_lo[:, steps.kv_block],
        kv_block_hi[:, steps.kv_block],
    ) & jnp.asarray((steps.flags & EMPTY) == 0)
    tables = [segments.fetch_steps(computes), q_lo, q_hi, kv_lo, kv_hi]
    return [segments.flat(x) for x in tables], [segments.lanes(q_ids), segments.rows(kv_ids)]


def forward(
    q,
    k,
    v,
    *,
    tiling: Tiling,
    scale: float,
    interpret: bool,
    tuning: mosaic.Tuning,
    segment_ids=None,
):
    """Padded inputs -> (o, lse), as `kernels.forward.forward`.

    q: [batch, q_padded, heads, head_dim]; k, v: [batch, kv_padded, kv_heads, head_dim];
    segment_ids: None or padded ``(q_ids, kv_ids)``, int32 [batch, q_padded], [batch,
    kv_padded]. Returns o like q and lse float32 [batch, heads, q_padded] (base-2, scaled
    logits). ``interpret``: TPU interpret mode rather than Mosaic's compiler.
    """
    batch, q_padded, heads, head_dim = q.shape
    group = heads // k.shape[2]
    block_q, block_k = tiling.block_q, tiling.block_k
    block_k_compute = tuning.piece(block_k)
    rows = tuning.rows(block_q)
    steps = forward_steps(tiling, segmented=segment_ids is not None)
    # A step computes `per_step` query heads over the kv heads they read (one, or per_step //
    # group): fewer, longer steps, whose DMAs and fixed cost serve several heads.
    per_step = tuning.heads_per_step(heads, group, block_q, block_k, head_dim)
    kv_per_step = max(1, per_step // group)
    segment_tables, id_blocks = [], []
    if segment_ids is not None:
        segment_tables, id_blocks = segments_for_forward(
            segment_ids, steps, tiling, rows, block_k_compute
        )
    n_steps = len(steps)

    def fetched(b, t, tables):
        """The step whose input blocks step t reads: itself, or with segment ids the step its
        fetch table names (a skipped step copies what the next computed step reads)."""
        return tables[4][b * n_steps + t] if segment_tables else t

    def q_index(b, h, t, *tables):
        return mosaic.index(b, h, tables[0][fetched(b, t, tables)], 0)

    def kv_index(b, h, t, *tables):
        kv_head = index_div(h * per_step, group * kv_per_step)
        return mosaic.index(b, kv_head, tables[1][fetched(b, t, tables)], 0)

    def out_index(b, h, t, *tables):
        return mosaic.index(b, h, tables[0][t], 0)

    def lse_index(b, h, t, *tables):
        return mosaic.index(b, h, 0, tables[0][t])

    q_spec = pl.BlockSpec((None, per_step, block_q, head_dim), q_index)
    kv_spec = pl.BlockSpec((None, kv_per_step, block_k, head_dim), kv_index)
    out_spec = pl.BlockSpec((None, per_step, block_q, head_dim), out_index)
    lse_spec = pl.BlockSpec((None, per_step, 1, block_q), lse_index)
    id_specs = []
    if segment_tables:
        id_specs = [
            pl.BlockSpec(
                (None, block_q, segments.LANES),
                lambda b, h, t, *tables: mosaic.index(b, tables[0][fetched(b, t, tables)], 0),
            ),
            pl.BlockSpec(
                (None, segments.SUBLANES, block_k),
                lambda b, h, t, *tables: mosaic.index(b, 0, tables[1][fetched(b, t, tables)]),
            ),
        ]
    qt, kt, vt = mosaic.heads_major(q), mosaic.heads_major(k), mosaic.heads_major(v)
    pairs = batch * heads * steps.computed_pairs()  # with segment ids, at most this many
    itemsize = q.dtype.itemsize
    o, lse = pl.pallas_call(
        functools.partial(
            _forward_kernel,
            tiling=tiling,
            scale=scale,
            block_k_compute=block_k_compute,
            rows=rows,
            group=group,
            segment_tables=len(segment_tables),
            fresh_starts=_fresh_starts(steps),
        ),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4 + len(segment_tables),
            grid=(batch, heads // per_step, n_steps),
            in_specs=[q_spec, kv_spec, kv_spec, *id_specs],
            out_specs=[out_spec, lse_spec],
            scratch_shapes=[
                pltpu.VMEM((per_step, block_q, head_dim), jnp.float32),
                pltpu.VMEM((per_step, block_q, mosaic.LANES), jnp.float32),
                pltpu.VMEM((per_step, block_q, mosaic.LANES), jnp.float32),
            ],
        ),
        out_shape=[
            out_struct(qt.shape, q.dtype, like=qt),
            out_struct((batch, heads, 1, q_padded), jnp.float32, like=qt),
        ],
        interpret=mosaic.interpret_mode(interpret),
        compiler_params=tuning.compiler_params(3),
        cost_estimate=pl.CostEstimate(
            flops=4 * pairs * block_q * block_k * head_dim,
            transcendentals=pairs * block_q * block_k,
            bytes_accessed=itemsize * (2 * qt.size + pairs * 2 * block_k * head_dim),
        ),
        name="dew_flash_attention_forward",
    )(
        *(jnp.asarray(table) for table in steps.tables()),
        *segment_tables,
        qt,
        kt,
        vt,
        *id_blocks,
    )
    return mosaic.heads_major(o), lse[:, :, 0]
