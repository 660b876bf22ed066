"""dew.kernels' Mosaic TPU flash attention, without a TPU: run in TPU interpret mode on CPU against
the float64 reference of tests/test_kernels.py, and compiled for TPU slices inside Dew's step.

TPU interpret mode (``interpret="tpu"``: ``pallas_call(..., interpret=pltpu.InterpretParams())``)
runs the kernels with TPU semantics (blocks, VMEM scratch, the sequential grid dimension) at about
30 ms a grid step, so the shapes here are small and each case runs forward and backward in one
compile. Random inputs come from the ``seed`` fixture (fresh each run; ``DEW_SEED`` replays it).
"""

import dataclasses
import functools
import importlib.util
import re
import subprocess
import sys
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, Mesh
from jax.sharding import PartitionSpec as P

import dew
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
from dew.kernels.mosaic import Tuning
from dew.kernels.platform import (
    CAUSAL_BLOCK_Q,
    TPU_BLOCKS,
    UNKNOWN_TPU,
    choose_target,
    default_blocks,
    tpu_generation,
)
from dew.kernels.schedule import MAX_STEPS
from dew.kernels.tiling import Tiling
from dew.objectives.lm import LMObjective
from dew.parallel import Shards, sequence
from dew.targets import GENERATIONS, target
from tests.test_kernel_segments import reference_with, visibility
from tests.test_kernels import (
    _no_kernel,
    as_float64,
    assert_close,
    assert_lse_close,
    random_d_lse,
    random_inputs,
    reference_attention_with_lse,
    reference_with_lse_vjp,
    relative_error,
    run_fast_compiled,
)

# The Mosaic kernels a forward and backward run: the forward and the fused backward, or (where the
# fused one does not fit VMEM, or `platform.tuned(fused_backward=False)`) the two-kernel backward.
KERNELS = ("dew_flash_attention_forward", "dew_flash_attention_backward")
TWO_KERNELS = ("dew_flash_attention_forward", "dew_flash_attention_dq", "dew_flash_attention_dkdv")


def visible_block_pairs(tiling: Tiling) -> int:
    """Block pairs (query block, key block) holding at least one visible (row, key) pair."""
    rows = np.arange(tiling.q_padded)[:, None]
    cols = np.arange(tiling.kv_padded)[None, :]
    visible = (cols < tiling.kv_len) & (rows < tiling.q_len)
    if tiling.causal:
        visible &= cols <= rows + tiling.offset
    blocks = visible.reshape(tiling.q_blocks, tiling.block_q, tiling.kv_blocks, tiling.block_k)
    return int(blocks.any(axis=(1, 3)).sum())


@pytest.fixture
def computed(monkeypatch) -> Counter:
    """Counts, while the kernels run, each (head, strip of query rows, piece of keys) the forward
    computes ("forward": `mosaic_forward._update`), each piece of a key block the fused backward
    computes ("backward": `mosaic_fused_backward._attend`), and each block pair the two-kernel
    backward computes ("two-kernel backward": `mosaic_backward._probabilities`, in its dq and its
    dk/dv kernel both). JAX's caches are cleared before and after: a trace another test of this
    process cached (the same shapes and blocks) would not call the patched functions, and one made
    here would keep calling them."""
    jax.clear_caches()
    counts = Counter()

    def counted(name, compute):
        def wrapper(*args, **kwargs):
            jax.debug.callback(lambda: counts.update([name]))
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


def tpu_interpret(q, k, v, do, d_lse, **kwargs):
    """``((out, lse, (dq, dk, dv)), kernels)``: `flash_attention_forward` in TPU interpret mode
    and its vjp for the cotangents ``(do, d_lse)``, as float64 numpy, and the names of the
    ``pallas_call`` s that ran. The function is made afresh, so each call is traced under the
    `platform.tuned` overrides open now (jit caches a trace by its function, not by those)."""

    def kernel(q, k, v, do, d_lse):
        attend = functools.partial(flash_attention_forward, interpret="tpu", **kwargs)
        (out, lse), vjp = jax.vjp(attend, q, k, v)
        return out, lse, vjp((do, d_lse))

    traced = jax.jit(kernel).trace(q, k, v, do, d_lse)
    names = {name for name, _ in pallas_calls(traced.jaxpr.jaxpr)}
    compiled = traced.lower().compile({"xla_backend_optimization_level": 0})
    return as_float64(compiled(q, k, v, do, d_lse)), names


def tpu_interpret_forward(q, k, v, **kwargs):
    """``(out, lse)`` of `flash_attention_forward` alone in TPU interpret mode, as float64 numpy,
    traced under the `platform.tuned` overrides open now: the run a forward-only choice (strips,
    heads a step) is compared with, to the bit, without a backward it does not change."""
    attend = functools.partial(flash_attention_forward, interpret="tpu", **kwargs)
    return as_float64(run_fast_compiled(attend, q, k, v))


def assert_matches_reference(got, want, dtype, what):
    (out, lse, grads), (want_out, want_lse, want_grads) = got, want
    assert_close(out, want_out, dtype, f"output ({what})")
    assert_lse_close(lse, want_lse, f"lse ({what})")
    for name, g, w in zip("qkv", grads, want_grads):
        assert_close(g, w, dtype, f"d{name} ({what})")


# Two ways of computing the same attention differ by rounding only. Keys in pieces against whole
# blocks: at most 2.9e-7 (float32) and 1.5e-3 (bfloat16 rounds each probability before p @ v,
# relative to a running maximum that the pieces change) over four seeds, held below a fifth
# (float32) or half (bfloat16) of the tolerance against the float64 reference.
AGREE = {jnp.float32: 2e-6, jnp.bfloat16: 1e-2}
# The fused backward against the two-kernel one: the same float32 arithmetic but for the order of
# delta's sum (in the kernel, or in XLA) and of dq's accumulation. Measured: at most 1.5e-7 in
# float32 over four seeds (3.0e-7 for q72-kv200 at seed 1); q136-kv56 in bfloat16, 0 in seven
# of seeds 1-8 and 3.6e-10 in one, where one entry of dq rounded the other way is about 3e-5.
# Summing delta in bfloat16 gives 2.2e-3 to 2.6e-3 there (dq, dk).
FUSED_AGREE = {jnp.float32: 2e-6, jnp.bfloat16: 1e-4}


def assert_agree(got, other, dtype, what, bounds=AGREE):
    for name, a, b in zip(
        ("out", "lse", "dq", "dk", "dv"), jax.tree.leaves(got), jax.tree.leaves(other)
    ):
        finite = np.isfinite(b)
        assert np.array_equal(np.isfinite(a), finite), f"{name} ({what}): -inf rows differ"
        error = relative_error(a[finite], b[finite])
        assert error < bounds[dtype], f"{name} ({what}): relative difference {error:.3g}"


def assert_computes_only_visible_pairs(
    computed, kernels, batch, q_len, kv_len, heads, causal, block_q, block_k, tuning
):
    """The ``pallas_call`` s that ran are the forward's and the fused backward's (the two-kernel
    backward's where ``tuning`` asks for it), and ``computed`` (the fixture's counts) holds
    exactly the visible pairs of query blocks and pieces each computed: within a key block
    computed a piece at a time (block_k_compute, backward_block_k_compute), the pieces holding a
    visible (row, key) pair, each in the forward once a strip of query rows (block_q_compute);
    the two-kernel backward computes each visible block pair twice, in its dq kernel and its
    dk/dv kernel."""
    block_q = min(block_q, -(-q_len // 8) * 8)  # one whole block when q_len is shorter
    # Interpret mode's defaults (an unknown TPU) compute whole blocks at these sizes.
    defaults = platform.mosaic_tuning(UNKNOWN_TPU)
    forward_piece = tuning.get("block_k_compute") or defaults.piece(block_k)
    backward_piece = tuning.get("backward_block_k_compute") or defaults.backward_piece(block_k)
    strips = block_q // dataclasses.replace(defaults, **tuning).rows(block_q)

    def pairs(block_k):
        return batch * heads * visible_block_pairs(Tiling(q_len, kv_len, block_q, block_k, causal))

    if tuning.get("fused_backward", True):
        assert kernels == set(KERNELS), kernels
        want_counts = {"forward": strips * pairs(forward_piece), "backward": pairs(backward_piece)}
    else:
        assert kernels == set(TWO_KERNELS), kernels
        want_counts = {
            "forward": strips * pairs(forward_piece),
            "two-kernel backward": 2 * pairs(block_k),
        }
    assert computed == want_counts, (tuning, computed, want_counts)


CASES = [
    # batch, q_len, kv_len, heads, kv_heads, head_dim, causal, dtype, block_q, block_k, tuning
    # (q200-kv232 at whole blocks, with the fused backward and with the two-kernel one, is the
    # first case of test_the_fused_backward_matches_the_two_kernel_backward, counted there.)
    pytest.param(
        1, 200, 72, 4, 2, 32, True, jnp.bfloat16, 128, 32, {}, id="q200-kv72-empty-rows-bf16"
    ),
    pytest.param(1, 40, 72, 2, 1, 16, False, jnp.float32, 128, 32, {}, id="q40-kv72-full"),
    pytest.param(
        1,
        200,
        232,
        2,
        1,
        16,
        True,
        jnp.float32,
        128,
        64,
        {"block_k_compute": 16, "backward_block_k_compute": 32},
        id="q200-kv232-causal-gqa-pieces",
    ),
    pytest.param(
        1,
        200,
        72,
        4,
        2,
        32,
        True,
        jnp.bfloat16,
        128,
        32,
        {"block_k_compute": 8, "backward_block_k_compute": 16},
        id="q200-kv72-empty-rows-bf16-pieces",
    ),
    # An offset of 1 and pieces of 8: in each query block, only the last row sees the first key
    # of the piece that starts just past it (keys 128-135 for rows 0-127, the first piece of key
    # block 4, of which that row's one key puts the block pair and the piece in the walk).
    # Blocks of 32 keys, 4 pieces each: 8 (at blocks of 64) took half as much CPU again.
    pytest.param(
        1,
        200,
        201,
        2,
        1,
        16,
        True,
        jnp.float32,
        128,
        32,
        {"block_k_compute": 8, "backward_block_k_compute": 8},
        id="q200-kv201-pieces-seen-by-one-row",
    ),
]


@pytest.mark.parametrize(
    "batch,q_len,kv_len,heads,kv_heads,head_dim,causal,dtype,block_q,block_k,tuning", CASES
)
def test_tpu_interpret_matches_reference_computing_only_visible_blocks(
    computed,
    seed,
    batch,
    q_len,
    kv_len,
    heads,
    kv_heads,
    head_dim,
    causal,
    dtype,
    block_q,
    block_k,
    tuning,
):
    # jax.vjp of flash_attention_forward with random cotangents of out and lse: out, lse, dq, dk,
    # dv (the lse cotangent enters the backward kernels as delta - d_lse). Every case pads both
    # lengths to whole blocks and groups query heads; q200-kv232 reads the queries as the last 200
    # of 232 positions, q200-kv72 has 128 rows that see no key (zeros, lse -inf, no gradient: a
    # whole query block that computes nothing), q40-kv72 is one query block (block_q shrunk to
    # 40, the whole length) over three key blocks, the last one padded. Each kernel must compute
    # exactly the block pairs with a visible (row, key) pair, and within a key block computed a
    # piece at a time exactly the pieces holding one (assert_computes_only_visible_pairs).
    rng = np.random.default_rng(seed)
    q, k, v, do = random_inputs(rng, batch, q_len, kv_len, heads, kv_heads, head_dim, dtype)
    d_lse = random_d_lse(rng, q)
    blocks = dict(causal=causal, block_q=block_q, block_k=block_k)
    with platform.tuned(**tuning):
        got, kernels = tpu_interpret(q, k, v, do, d_lse, **blocks)
    want = reference_with_lse_vjp(
        q, k, v, do, d_lse, causal=causal, sm_scale=1.0 / np.sqrt(head_dim)
    )
    assert_matches_reference(got, want, dtype, f"seed {seed}")
    assert_computes_only_visible_pairs(
        computed, kernels, batch, q_len, kv_len, heads, causal, block_q, block_k, tuning
    )


FUSED_CASES = [
    # batch, q_len, kv_len, heads, kv_heads, head_dim, causal, dtype, block_q, block_k
    pytest.param(2, 200, 232, 2, 1, 16, True, jnp.float32, 128, 64, id="q200-kv232-causal-gqa"),
    pytest.param(1, 136, 56, 3, 1, 32, True, jnp.bfloat16, 128, 24, id="q136-kv56-empty-rows-bf16"),
    pytest.param(1, 72, 200, 2, 2, 16, False, jnp.float32, 72, 64, id="q72-kv200-full"),
]


@pytest.mark.parametrize(
    "batch,q_len,kv_len,heads,kv_heads,head_dim,causal,dtype,block_q,block_k", FUSED_CASES
)
def test_the_fused_backward_matches_the_two_kernel_backward(
    computed, seed, batch, q_len, kv_len, heads, kv_heads, head_dim, causal, dtype, block_q, block_k
):
    # The one-kernel backward (dq accumulated in VMEM over the kv head's walk) and the dq and
    # dk/dv kernels it replaces, each against the float64 reference and against each other; and
    # each run computes only the visible block pairs (as in the test above, whose cases at whole
    # blocks these are).
    rng = np.random.default_rng(seed)
    q, k, v, do = random_inputs(rng, batch, q_len, kv_len, heads, kv_heads, head_dim, dtype)
    d_lse = random_d_lse(rng, q)
    blocks = dict(causal=causal, block_q=block_q, block_k=block_k)
    shape = (batch, q_len, kv_len, heads, causal, block_q, block_k)
    fused, fused_kernels = tpu_interpret(q, k, v, do, d_lse, **blocks)
    assert_computes_only_visible_pairs(computed, fused_kernels, *shape, {})
    computed.clear()
    with platform.tuned(fused_backward=False):
        two, two_kernels = tpu_interpret(q, k, v, do, d_lse, **blocks)
    assert_computes_only_visible_pairs(computed, two_kernels, *shape, {"fused_backward": False})
    want = reference_with_lse_vjp(
        q, k, v, do, d_lse, causal=causal, sm_scale=1.0 / np.sqrt(head_dim)
    )
    assert_matches_reference(fused, want, dtype, f"fused backward, seed {seed}")
    assert_matches_reference(two, want, dtype, f"two-kernel backward, seed {seed}")
    assert_agree(fused, two, dtype, f"fused against two kernels, seed {seed}", FUSED_AGREE)


def test_a_run_started_on_an_unmasked_pair_takes_its_first_pieces_row_maximum(seed):
    # Large logits (q scaled by 50: natural logits of standard deviation 50): a run that starts on
    # an unmasked pair writes m, l and the accumulator from its first piece (the fresh start),
    # whose row maximum must be subtracted before exp2, as every later piece's is. A maximum taken
    # as 0 there overflows exp2 wherever a base-2 logit passes 128, and the output is NaN
    # (without the bug: 4e-8 to 1.8e-6 off the float64 reference at 8 rows, seeds 1-3). Not
    # causal, 72 keys in blocks of 32: the run starts on an unmasked pair and ends on the padded,
    # masked tail. (q scaled by 30 overflows in 40 rows, not always in these 16.)
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    q, k, v, _ = random_inputs(rng, 1, 16, 72, 1, 1, 16, jnp.float32)
    q = 50 * q
    first_piece = np.einsum("qd,kd->qk", q[0, :, 0], k[0, :32, 0]) * 0.25 * np.log2(np.e)
    assert first_piece.max() > 128, "a first piece's logits that exp2 cannot hold unshifted"
    attend = functools.partial(
        flash_attention_forward, causal=False, block_q=128, block_k=32, interpret="tpu"
    )
    out, lse = as_float64(run_fast_compiled(attend, q, k, v))
    with jax.enable_x64(True):
        as64 = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v)]
        want_out, want_lse = reference_attention_with_lse(*as64, causal=False, sm_scale=0.25)
        want_out, want_lse = np.asarray(want_out), np.asarray(want_lse)
    assert_close(out, want_out, jnp.float32, f"output, seed {seed}")
    assert_lse_close(lse, want_lse, f"lse, seed {seed}")


FRESH_STARTS = [
    # q_len, kv_len, causal, window, block_q, block_k, strip rows, piece keys. One key block:
    # q200-kv200 (the causal diagonal through both query blocks), q72-kv200 (the queries are the
    # last 72 of 200 positions), q40-kv70 (no causal mask, 2 padded keys masked), q40-kv72 (no
    # mask at all: the first piece starts fresh unmasked), q200-kv150 (the first block's first 50
    # rows see no key: that run starts from zeros, the second fresh). Several key blocks:
    # q256-kv256 (each run starts on its diagonal, the second then walks back to key block 0),
    # and windows of 130 (every run fresh: the edge's masked pair is not, so the masked walk
    # takes both starts) and of 100, the queries the last 200 of 256 positions (each block's
    # last rows do not reach its diagonal's first key: every run starts from zeros; the strips
    # compute the halves of masked pieces they see, by positions offset by 56). Query blocks
    # longer than the key blocks: the first rows do not reach the diagonal's first key, so each
    # run walks forward from key block 0 and starts fresh there.
    pytest.param(200, 200, True, None, 128, 200, 32, 40, id="q200-kv200-causal"),
    pytest.param(72, 200, True, None, 72, 200, None, 40, id="q72-kv200-causal"),
    pytest.param(40, 70, False, None, 40, 72, None, None, id="q40-kv70-full"),
    pytest.param(40, 72, False, None, 40, 72, None, 24, id="q40-kv72-full-unmasked"),
    pytest.param(200, 150, True, None, 128, 152, 32, None, id="q200-kv150-rows-see-nothing"),
    pytest.param(256, 256, True, None, 128, 128, 32, 64, id="q256-kv256-causal-runs"),
    pytest.param(256, 256, True, 130, 128, 128, 32, 64, id="q256-kv256-window130"),
    pytest.param(200, 256, True, 100, 128, 128, 32, 64, id="q200-kv256-window100"),
    pytest.param(256, 256, True, None, 128, 64, 32, None, id="q256-kv256-causal-longer-rows"),
]


def fresh_runs(q_len, kv_len, causal, window, block_q, block_k) -> Counter:
    """The fresh strips' kinds expected, by position: a query block's run starts fresh where
    every row of the block (its padded rows too: they are computed) sees the first key of the
    run's first key block: the diagonal's under a causal mask (the run walks back from it), else
    the first visible block's (the run walks forward); "fresh masked" where that block pair hides
    a key from a real row."""
    offset = kv_len - q_len

    def sees(row, key):
        position = row + offset
        inside = window is None or position - key < window
        return key < kv_len and inside and (not causal or key <= position)

    kinds = Counter()
    for i in range(-(-q_len // block_q)):
        rows = range(i * block_q, (i + 1) * block_q)
        real = [r for r in rows if r < q_len]
        kv_blocks = [
            j
            for j in range(-(-kv_len // block_k))
            if any(sees(r, k) for r in real for k in range(j * block_k, (j + 1) * block_k))
        ]
        if not kv_blocks:
            continue
        starts = [max(kv_blocks), min(kv_blocks)] if causal else [min(kv_blocks)]
        fresh = [j for j in starts if all(sees(r, j * block_k) for r in rows)]
        if fresh:
            first = fresh[0]
            keys = range(first * block_k, (first + 1) * block_k)
            hidden = any(not sees(r, k) for r in real for k in keys)
            kinds["fresh masked" if hidden else "fresh"] += 1
    return kinds


@pytest.mark.parametrize("q_len,kv_len,causal,window,block_q,block_k,strip,piece", FRESH_STARTS)
def test_a_run_starts_fresh_where_every_row_sees_its_first_key(
    monkeypatch, seed, q_len, kv_len, causal, window, block_q, block_k, strip, piece
):
    # A run whose first key block's first key every row of the query block sees writes m, l and
    # the accumulator from that step's first piece, under its mask (no zeroing first: at GPT-2
    # small's and Llama-3.2-1B's shapes on v5e every run is one such step; a window's runs
    # start on their diagonal). Large logits (q scaled by 50) need that piece's masked row
    # maximum subtracted before exp2; rows that see no key of it need the zeros.
    print(f"seed {seed}")
    jax.clear_caches()  # a cached trace would not call the patched `_update`
    counts = Counter()
    update = mosaic_forward._update

    def counted(*args, fresh=False, mask=None, **kwargs):
        if fresh is not False:  # True, or a step's traced flag (the masked walk's shared code)
            kind = "fresh" if mask is None else "fresh masked"

            def count(started, kind=kind):
                if started:
                    counts.update([kind])

            jax.debug.callback(count, jnp.asarray(fresh))
        return update(*args, fresh=fresh, mask=mask, **kwargs)

    monkeypatch.setattr(mosaic_forward, "_update", counted)
    rng = np.random.default_rng(seed)
    batch, heads = 2, 2
    q, k, v, _ = random_inputs(rng, batch, q_len, kv_len, heads, 1, 16, jnp.float32)
    q = 50 * q
    attend = functools.partial(
        flash_attention_forward,
        causal=causal,
        window=window,
        block_q=block_q,
        block_k=block_k,
        interpret="tpu",
    )
    with platform.tuned(block_q_compute=strip, block_k_compute=piece):
        out, lse = as_float64(run_fast_compiled(attend, q, k, v))
    jax.clear_caches()
    visible = np.ones((1, q_len, kv_len), bool)
    if causal:
        visible = visibility(None, None, q_len, kv_len, window)
    zeros = np.zeros(q.shape), np.zeros((batch, heads, q_len))
    want_out, want_lse = reference_with(q, k, v, *zeros, visible, 0.25)[:2]
    assert_close(out, want_out, jnp.float32, f"output, seed {seed}")
    assert_lse_close(lse, want_lse, f"lse, seed {seed}")
    # Every strip of a fresh run's first piece starts fresh, for every head of every row.
    strips = block_q // strip if strip else 1
    want = fresh_runs(q_len, kv_len, causal, window, block_q, block_k)
    want = Counter({kind: n * batch * heads * strips for kind, n in want.items()})
    assert counts == want, (counts, want)


@pytest.mark.parametrize(
    "pieces,strips,dtype",
    [
        # Strips of 32 rows over query blocks of 128 and pieces of 16 keys: the causal diagonal
        # (offset 32: the queries are the last 200 of 232 positions) crosses strips inside a
        # piece, and a strip can see none of a masked piece.
        pytest.param(
            {"block_k_compute": 16, "backward_block_k_compute": 8},
            {"block_q_compute": 32, "block_k_compute": 16},
            jnp.float32,
            id="f32",
        ),
        pytest.param(
            {"block_k_compute": 32, "backward_block_k_compute": 16},
            {"block_q_compute": 64},
            jnp.bfloat16,
            id="bf16",
        ),
    ],
)
def test_keys_in_pieces_and_query_rows_in_strips_match_whole_blocks(seed, pieces, strips, dtype):
    # Pieces: the forward's and the backward's key blocks of 64 computed 8, 16 or 32 keys at a
    # time (a masked block pair skips its pieces no row sees) give the whole blocks' results.
    # Strips: the forward computing its query block a strip of rows at a time (256 on v5e) places
    # each strip's mask, statistics and accumulator rows right: against the float64 reference,
    # and to the bit against the forward over whole query blocks with the same pieces (a row's
    # arithmetic does not depend on the rows beside it), which is the whole blocks' run or the
    # pieces' run here (one compile fewer than a forward of its own). Strips are the forward's
    # alone (the backward computes whole query blocks), so the strips' run is the forward alone:
    # its backward, at the default backward pieces, would be the whole blocks' backward taking
    # an out and lse equal to the bit to the run it is compared with. One batch row of two
    # query heads over one kv head: the pieces and strips are the subject (a second row or more
    # heads only repeat the same steps; the cases above and below read several kv heads).
    rng = np.random.default_rng(seed)
    q, k, v, do = random_inputs(rng, 1, 200, 232, 2, 1, 16, dtype)
    d_lse = random_d_lse(rng, q)
    blocks = dict(causal=True, block_q=128, block_k=64)
    whole_rows = {"block_q_compute": None}
    with platform.tuned(block_k_compute=None, backward_block_k_compute=None, **whole_rows):
        whole, _ = tpu_interpret(q, k, v, do, d_lse, **blocks)
    with platform.tuned(**pieces, **whole_rows):
        pieced, _ = tpu_interpret(q, k, v, do, d_lse, **blocks)
    with platform.tuned(**strips):
        stripped = tpu_interpret_forward(q, k, v, **blocks)
    want = reference_with_lse_vjp(q, k, v, do, d_lse, causal=True, sm_scale=0.25)
    assert_matches_reference(whole, want, dtype, f"whole blocks, seed {seed}")
    assert_matches_reference(pieced, want, dtype, f"{pieces}, seed {seed}")
    assert_agree(pieced, whole, dtype, f"{pieces} against whole blocks, seed {seed}")
    assert_close(stripped[0], want[0], dtype, f"output ({strips}, seed {seed})")
    assert_lse_close(stripped[1], want[1], f"lse ({strips}, seed {seed})")
    # The forward over whole query blocks computing the strips' pieces.
    same_pieces = {None: whole, pieces["block_k_compute"]: pieced}[strips.get("block_k_compute")]
    for name, a, b in zip(("out", "lse"), stripped[:2], same_pieces[:2]):
        assert np.array_equal(a, b), (
            f"{name}: {strips} differ from whole query blocks (seed {seed})"
        )


@pytest.mark.parametrize(
    "heads,kv_heads,per_step,backward",
    [
        pytest.param(8, 1, 4, True, id="4-of-a-kv-head's-8"),
        pytest.param(8, 4, 4, False, id="4-over-2-kv-heads"),
        pytest.param(6, 3, 2, False, id="2-of-6-over-3-kv-heads"),
    ],
)
def test_several_heads_a_forward_step_match_one(seed, heads, kv_heads, per_step, backward):
    # The forward computing several query heads a step (4 on v5e) reads their kv heads right:
    # several query heads of one kv head, or several kv heads' groups whole. Against the float64
    # reference, and to the bit against one head a step (the same arithmetic per head). Heads a
    # step are the forward's alone; the backward runs beside in the first case only, for its
    # group of 8 query heads over one kv head (the fused backward's dq for all 8 in VMEM), which
    # no other case of this file has: groups of 2, as the others', are the cases above's.
    rng = np.random.default_rng(seed)
    q, k, v, do = random_inputs(rng, 1, 200, 232, heads, kv_heads, 16, jnp.float32)
    d_lse = random_d_lse(rng, q)
    blocks = dict(causal=True, block_q=128, block_k=64)
    assert Tuning(forward_heads=4).heads_per_step(heads, heads // kv_heads, 128, 64, 16) == per_step
    with platform.tuned(forward_heads=1):
        one = tpu_interpret_forward(q, k, v, **blocks)
    with platform.tuned(forward_heads=4):
        if backward:
            several, _ = tpu_interpret(q, k, v, do, d_lse, **blocks)
        else:
            several = tpu_interpret_forward(q, k, v, **blocks)
    want = reference_with_lse_vjp(q, k, v, do, d_lse, causal=True, sm_scale=0.25)
    what = f"{per_step} heads a step, seed {seed}"
    if backward:
        assert_matches_reference(several, want, jnp.float32, what)
    else:
        assert_close(several[0], want[0], jnp.float32, f"output ({what})")
        assert_lse_close(several[1], want[1], f"lse ({what})")
    for name, a, b in zip(("out", "lse"), several[:2], one):
        assert np.array_equal(a, b), f"{name}: {per_step} heads a step differ (seed {seed})"


def test_query_strips_split_the_block_into_whole_16_row_parts():
    # A strip that does not split the query block into whole bfloat16 vector registers (16 rows)
    # computes the block whole.
    assert Tuning(block_q_compute=256).rows(512) == 256
    assert Tuning(block_q_compute=256).rows(1024) == 256
    assert Tuning(block_q_compute=256).rows(384) == 384  # 256 does not divide 384
    assert Tuning(block_q_compute=256).rows(200) == 200  # a block shrunk to a short length
    assert Tuning(block_q_compute=24).rows(48) == 48  # not a multiple of 16
    assert Tuning(block_q_compute=16).rows(48) == 16
    assert Tuning().rows(512) == 512


def test_heads_a_forward_step_divide_the_heads_and_share_kv_heads_whole():
    # Within 4 x 512 x 2048 logits a step (FORWARD_LOGITS: the size of the step's unrolled code),
    # each 128 lanes of head_dim past the first counted again.
    tuning = Tuning(forward_heads=4)
    assert tuning.heads_per_step(12, 1, 512, 2048, 128) == 4  # 12 heads, 4 a step
    assert tuning.heads_per_step(12, 1, 1024, 2048, 128) == 2  # 4 would be twice the logits
    assert tuning.heads_per_step(12, 1, 2048, 2048, 128) == 1
    assert tuning.heads_per_step(12, 1, 512, 2048, 256) == 2  # head_dim 256 counts twice
    assert tuning.heads_per_step(12, 1, 512, 2048, 64) == 4  # 64 lanes take a register's 128
    assert tuning.heads_per_step(5, 1, 512, 512, 128) == 1  # no divisor of 5 from 2 to 4
    assert tuning.heads_per_step(6, 3, 128, 128, 128) == 3  # one kv head's 3 query heads
    assert tuning.heads_per_step(12, 3, 128, 128, 128) == 3  # 4 would split kv heads' groups
    assert tuning.heads_per_step(32, 4, 512, 2048, 128) == 4  # Llama 3: one kv head's 4
    assert Tuning().heads_per_step(12, 1, 512, 512, 128) == 1  # one unless a generation asks
    # v5e's 16: all 16 heads of 512 x 512 (a window's blocks), 12 of GPT-2 small at 512 x 512,
    # 6 of them at 512 x 1024 (its causal blocks at 1024 tokens), 8 of Llama 3's 32 over 8 kv
    # heads at 512 x 1024 (two kv heads' groups), and never more than 16.
    v5e = platform.mosaic_tuning("v5e")
    assert v5e.heads_per_step(16, 1, 512, 512, 128) == 16
    assert v5e.heads_per_step(12, 1, 512, 512, 64) == 12
    assert v5e.heads_per_step(12, 1, 512, 1024, 64) == 6
    assert v5e.heads_per_step(32, 4, 512, 1024, 128) == 8
    assert v5e.heads_per_step(32, 1, 128, 128, 128) == 16


def test_a_piece_is_a_divisor_of_its_block_in_whole_sublanes():
    # A piece that does not split the key block into whole (8-row) parts computes the block whole.
    tuning = Tuning(block_k_compute=16, backward_block_k_compute=24)
    assert (tuning.piece(64), tuning.backward_piece(48)) == (16, 24)
    assert tuning.backward_piece(64) == 64  # 24 does not divide 64
    assert Tuning(block_k_compute=12).piece(48) == 48  # not a multiple of 8
    assert Tuning(block_k_compute=128).piece(64) == 64
    assert Tuning().piece(64) == Tuning().backward_piece(64) == 64


def test_layout_bhsd_is_bshd_transposed(seed):
    # layout="bhsd" takes and returns [batch, heads, seq, head_dim]: the same kernels on the same
    # numbers, so the same bits as "bshd" with the sequence and head axes swapped, through all
    # three entry points (forward, its gradient, and the backward alone). The layout is swapped
    # at the entry points, outside the kernels, so their walk is not the subject: one query block
    # of 40 rows (block_q shrunk to the length) over two key blocks, the second padded, causal
    # with an offset, two query heads over one kv head (a third of the grid steps of 136 x 152).
    rng = np.random.default_rng(seed)
    q, k, v, do = random_inputs(rng, 1, 40, 72, 2, 1, 16, jnp.float32)
    d_lse = random_d_lse(rng, q)
    blocks = dict(causal=True, block_q=128, block_k=64, interpret="tpu")

    def entry_points(layout):
        def run(q, k, v, do, d_lse):
            attend = functools.partial(flash_attention_forward, layout=layout, **blocks)
            (out, lse), vjp = jax.vjp(attend, q, k, v)
            alone = flash_attention_backward(q, k, v, out, lse, do, d_lse, layout=layout, **blocks)
            plain = flash_attention(q, k, v, layout=layout, **blocks)
            return out, lse, vjp((do, d_lse)), alone, plain

        return run

    swap = functools.partial(jnp.swapaxes, axis1=1, axis2=2)
    bshd = as_float64(run_fast_compiled(entry_points("bshd"), q, k, v, do, d_lse))
    bhsd = as_float64(
        run_fast_compiled(entry_points("bhsd"), swap(q), swap(k), swap(v), swap(do), d_lse)
    )
    out, lse, grads, alone, plain = bhsd
    # Each gradient in the layout of its input: [batch, heads, seq, head_dim].
    assert out.shape == (1, 2, 40, 16)
    assert [g.shape for g in grads] == [(1, 2, 40, 16), (1, 1, 72, 16), (1, 1, 72, 16)]
    np.testing.assert_array_equal(np.swapaxes(out, 1, 2), bshd[0], f"out (seed {seed})")
    np.testing.assert_array_equal(lse, bshd[1], f"lse (seed {seed})")
    np.testing.assert_array_equal(
        np.swapaxes(plain, 1, 2), bshd[4], f"flash_attention (seed {seed})"
    )
    for name, got, want in zip("qkv", grads, bshd[2]):
        np.testing.assert_array_equal(np.swapaxes(got, 1, 2), want, f"d{name} (seed {seed})")
    for name, got, want in zip("qkv", alone, bshd[3]):
        np.testing.assert_array_equal(
            np.swapaxes(got, 1, 2), want, f"backward's d{name} (seed {seed})"
        )
    want = reference_with_lse_vjp(q, k, v, do, d_lse, causal=True, sm_scale=0.25)
    assert_matches_reference(bshd[:3], want, jnp.float32, f"bshd, seed {seed}")


def test_the_fused_backward_runs_where_its_dq_fits_vmem():
    # The fused backward keeps dq for all of a kv head's query rows (the group's heads, padded to
    # whole blocks) in float32 VMEM plus its double-buffered output block, beside a fixed
    # working set; where that passes the tuning's VMEM limit, or its step table passes MAX_STEPS,
    # the two-kernel backward runs.
    q = jax.ShapeDtypeStruct((1, 200, 4, 64), jnp.float32)
    k = jax.ShapeDtypeStruct((1, 232, 2, 64), jnp.float32)

    def fused(q, k, block_k=64, **tuning):
        with platform.tuned(**tuning):
            config, _ = attention_module._config(
                q, k, k, causal=False, sm_scale=None, block_q=128, block_k=block_k, interpret="tpu"
            )
        return attention_module._fused_backward_fits(q, k, config)

    dq = 2 * 256 * 64 * (4 + 2 * 4)  # group 2 x 256 padded rows x head_dim, float32 + 2 x float32
    need = mosaic_fused_backward.WORKING_BYTES + dq
    assert fused(q, k)
    assert fused(q, k, vmem_limit_bytes=need) and not fused(q, k, vmem_limit_bytes=need - 1)
    assert not fused(q, k, fused_backward=False)
    assert not fused(q, k, vmem_limit_bytes=None)  # the compiler's default: not known here
    # One query block over MAX_STEPS / 4 key blocks of 8: the fused backward walks them for each
    # of a group of 4 heads, MAX_STEPS steps, what its table holds; one key block more passes it.
    q = jax.ShapeDtypeStruct((1, 128, 4, 8), jnp.float32)
    k = jax.ShapeDtypeStruct((1, 2 * MAX_STEPS, 1, 8), jnp.float32)
    longer = jax.ShapeDtypeStruct((1, 2 * MAX_STEPS + 8, 1, 8), jnp.float32)
    assert fused(q, k, block_k=8) and not fused(q, longer, block_k=8)


def assert_fetches_are_used(name, blocks, computed, own):
    """Over one head's grid steps in order, ``blocks[s]`` is the block step ``s`` fetches (a copy
    into VMEM when it differs from the previous step's), ``computed[s]`` whether it computes, and
    ``own[s]`` the block it computes on. Every computed step must get its own block, and every
    copy must be of the block that the next computed step reads (nothing skipped is fetched)."""
    steps = len(blocks)
    for s in range(steps):
        if computed[s]:
            assert blocks[s] == own[s], (name, s, blocks)
        if s == 0 or blocks[s] != blocks[s - 1]:
            later = [t for t in range(s, steps) if computed[t]]
            assert later and blocks[later[0]] == blocks[s], (name, s, blocks, computed)


@pytest.mark.parametrize("q_len,kv_len", [(64, 64), (40, 64), (64, 24)])
def test_the_two_kernel_backward_fetches_only_blocks_its_next_computed_step_reads(q_len, kv_len):
    # The forward and the fused backward walk only the visible block pairs (their step tables:
    # tests/test_kernel_schedule.py). The two-kernel backward (the fallback) still steps over
    # every block pair: a causal step whose pair is masked whole is not computed, and its index
    # map names the block the next computed step reads (key block 0 for the dq kernel, where the
    # next query block starts; for dk/dv the first query block that sees the key block), so the
    # pipeline copies nothing it will not use. (64, 24) has query blocks that see no key at all.
    tiling = Tiling(q_len, kv_len, 16, 16, causal=True)
    rows = np.arange(tiling.q_padded)[:, None]
    cols = np.arange(tiling.kv_padded)[None, :]
    visible = (cols < kv_len) & (cols <= rows + tiling.offset)
    sees = visible.reshape(tiling.q_blocks, 16, tiling.kv_blocks, 16).any(axis=(1, 3))
    pairs = [(i, j) for i in range(tiling.q_blocks) for j in range(tiling.kv_blocks)]
    dq = [
        int(mosaic_backward.visited_kv_block(tiling, jnp.int32(i), jnp.int32(j))) for i, j in pairs
    ]
    assert_fetches_are_used("dq", dq, [sees[i, j] for i, j in pairs], [j for _, j in pairs])
    pairs = [(j, i) for j in range(tiling.kv_blocks) for i in range(tiling.q_blocks)]
    dkdv = [
        int(mosaic_backward.visited_q_block(tiling, jnp.int32(j), jnp.int32(i))) for j, i in pairs
    ]
    assert_fetches_are_used("dkdv", dkdv, [sees[i, j] for j, i in pairs], [i for _, i in pairs])
    assert not sees.all()  # some steps were skipped


# ---- the target: from the devices the call is compiled for ---------------------------------


def tpu_mesh(device_kind: str, platform: str = "tpu") -> AbstractMesh:
    device = AbstractDevice(device_kind=device_kind, num_cores=1, platform=platform)
    return AbstractMesh((1,), ("x",), abstract_device=device)


def test_the_target_follows_the_mesh_devices_not_the_default_backend():
    # This process's default backend is the CPU. Under a mesh of TPU devices (what shard_map
    # sets while tracing a step for a slice) the kernels are Mosaic's, with that generation's
    # blocks; under GPU devices Triton's; without a mesh the CPU's interpreter.
    assert choose_target(None) == "interpret" and choose_target("tpu") == "mosaic_interpret"
    for generation in GENERATIONS.values():
        assert tpu_generation(generation.device_kind) == generation.name
        with jax.sharding.use_abstract_mesh(tpu_mesh(generation.device_kind)):
            assert choose_target(None) == choose_target(False) == "mosaic", generation
            assert choose_target(True) == "interpret"
            blocks = default_blocks("mosaic", 128, jnp.bfloat16)
            assert (blocks.block_q, blocks.block_k) == TPU_BLOCKS[generation.name], generation
    with jax.sharding.use_abstract_mesh(tpu_mesh("NVIDIA H200", platform="gpu")):
        assert choose_target(None) == "triton"
    # No mesh: TPU interpret mode gets an unknown TPU's blocks.
    assert tpu_generation(jax.devices()[0].device_kind) == UNKNOWN_TPU
    blocks = default_blocks("mosaic_interpret", 128, jnp.bfloat16)
    assert (blocks.block_q, blocks.block_k) == TPU_BLOCKS[UNKNOWN_TPU]


def call_blocks(q_len, kv_len, head_dim=128, causal=True, window=None, **blocks):
    """(block_q, block_k) of a Mosaic call (traced for the mesh's devices, if any)."""
    q = jax.ShapeDtypeStruct((1, q_len, 2, head_dim), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, kv_len, 1, head_dim), jnp.bfloat16)
    blocks = {"block_q": None, "block_k": None, **blocks}
    config, _ = attention_module._config(
        q, k, k, causal=causal, sm_scale=None, interpret=None, window=window, **blocks
    )
    assert config.target == "mosaic"
    return config.tiling.block_q, config.tiling.block_k


@pytest.mark.parametrize("generation", sorted(GENERATIONS))
def test_default_mosaic_blocks_follow_the_generation_mask_and_head_dim(generation):
    # A generation's TPU_BLOCKS without a mask; causal calls' query blocks at most CAUSAL_BLOCK_Q;
    # under a window key blocks at most half of it in multiples of 512 (at least 512); block_q
    # then halved above head_dim 128; a block longer than its length shrunk to it. Read through a
    # call's own block choice.
    kind = GENERATIONS[generation].device_kind
    block_q, block_k = TPU_BLOCKS[GENERATIONS[generation].name]
    causal_q = min(block_q, CAUSAL_BLOCK_Q)
    # Two blocks each way: none is shrunk to the length. (The call's step tables cost a mask of
    # q_len x kv_len: at 4 blocks, 8192 x 8192 on v5e, 2 CPU-s a generation; at 2, a quarter.)
    long = 2 * block_k
    with jax.sharding.use_abstract_mesh(tpu_mesh(kind)):
        assert call_blocks(long, long, causal=False) == (block_q, block_k)
        assert call_blocks(long, long) == (causal_q, block_k)
        assert call_blocks(long, long, head_dim=256, causal=False) == (block_q // 2, block_k)
        assert call_blocks(long, long, head_dim=256) == (causal_q // 2, block_k)
        short = block_k // 2 + 8  # fewer keys than a block: the block is their length
        assert call_blocks(long, short) == (causal_q, short)
        for window, at_most in [(100, 512), (1024, 512), (1535, 512), (3000, 1024), (4096, 2048)]:
            assert call_blocks(long, long, window=window) == (causal_q, min(block_k, at_most))
        assert call_blocks(long, long, head_dim=256, window=1024) == (causal_q // 2, 512)
        # platform.tuned overrides the defaults; a call's own blocks win over both.
        with platform.tuned(block_q=256, block_k=128):
            assert call_blocks(2048, long) == call_blocks(2048, long, causal=False) == (256, 128)
            assert call_blocks(2048, long, block_q=384, block_k=64) == (384, 64)


def pallas_calls(jaxpr):
    """(name, interpret) of every pallas_call in a jaxpr, nested ones included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn.params["name"], eqn.params["interpret"]
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from pallas_calls(inner)


def test_pallas_tpu_interpret_reaches_the_ring_and_the_model():
    # attention_impl="pallas_tpu_interpret": the model's attention and the ring's blocks (forward
    # and its hand-written backward) all run the Mosaic kernels in TPU interpret mode: the forward
    # and the fused backward, or the two-kernel backward where it is asked for. Traced only, on a
    # sequence axis of 2.
    from jax.experimental.pallas import tpu as pltpu

    shards = Shards(axis_sizes={sequence.AXIS: 2})

    def kernel_calls():
        def body(q, k, v):
            def loss(q, k, v):
                out, lse = sequence.ring_attention(q, k, v, shards, "pallas_tpu_interpret")
                alone, _ = dew.nn.attention.IMPLEMENTATIONS["pallas_tpu_interpret"](q, k, v)
                return jnp.sum(out) + jnp.sum(lse) + jnp.sum(alone)

            return jax.grad(loss, (0, 1, 2))(q, k, v)

        positions = P(None, None, sequence.AXIS)  # [batch, heads, seq, head_dim]: the model's
        fn = jax.shard_map(
            body,
            mesh=Mesh(np.array(jax.devices()[:2]), (sequence.AXIS,)),
            in_specs=(positions,) * 3,
            out_specs=(positions,) * 3,
            check_vma=False,
        )
        args = [jax.ShapeDtypeStruct((1, h, 16, 8), jnp.float32) for h in (2, 1, 1)]
        return list(pallas_calls(jax.make_jaxpr(fn)(*args).jaxpr))

    calls = kernel_calls()
    assert {name for name, _ in calls} == set(KERNELS), calls
    assert all(isinstance(mode, pltpu.InterpretParams) for _, mode in calls), calls
    with platform.tuned(fused_backward=False):
        calls = kernel_calls()
    assert {name for name, _ in calls} == set(TWO_KERNELS), calls


def test_dew_train_takes_pallas_tpu_interpret():
    from dew.cli.main import build_parser

    args = build_parser().parse_args(["train", "--attention", "pallas_tpu_interpret"])
    assert args.attention == "pallas_tpu_interpret"
    assert (
        dew.models.build(
            "causal_transformer",
            vocab_size=64,
            emb_features=32,
            num_layers=1,
            num_heads=4,
            max_seq_len=16,
            attention_impl=args.attention,
        ).attention_impl
        == "pallas_tpu_interpret"
    )


# ---- refusals: a ValueError naming the rule and the values, before any kernel is traced ------


def mosaic_calls(q_len):
    """The three entry points on a [1, q_len, 4, 16] q and [1, 32, 2, 16] k, v."""
    q, k = jnp.zeros((1, q_len, 4, 16)), jnp.zeros((1, 32, 2, 16))
    lse = jnp.zeros((1, 4, q_len))
    return (
        lambda **kw: flash_attention(q, k, k, **kw),
        lambda **kw: flash_attention_forward(q, k, k, **kw),
        lambda **kw: flash_attention_backward(q, k, k, q, lse, q, **kw),
    )


def no_kernels(monkeypatch):
    for entry in ("_padded_attention", "_padded_forward", "_padded_backward"):
        monkeypatch.setattr(attention_module, entry, _no_kernel)


@pytest.mark.parametrize("name", ["block_q", "block_k"])
@pytest.mark.parametrize("bad", [12, 4, 0, -8, 16.0, True], ids=repr)
def test_mosaic_refuses_blocks_that_are_not_whole_sublane_tiles(monkeypatch, name, bad):
    no_kernels(monkeypatch)
    message = re.escape(f"{name} must be a positive multiple of 8 (the rows of a [{name}, ") + (
        ".*" + re.escape(f"(8, 128) sublanes and lanes); got {name}={bad!r}")
    )
    for call in mosaic_calls(32):
        with pytest.raises(ValueError, match=message):
            call(interpret="tpu", **{name: bad})
    with jax.sharding.use_abstract_mesh(tpu_mesh("TPU v5")):  # compiled for a TPU: the same rule
        with pytest.raises(ValueError, match=message):
            mosaic_calls(32)[0](**{name: bad})


def test_mosaic_block_q_is_whole_lanes_or_the_whole_length(monkeypatch):
    # block_q is also the lanes of the [1, block_q] lse and delta blocks: a multiple of 128, or
    # one block over the whole query length (rounded up to 8). block_k needs only 8.
    no_kernels(monkeypatch)
    message = re.escape(
        "block_q must be a multiple of 128 (the lanes of the lse and delta blocks [1, block_q], "
        "tiled (8, 128)) or cover q_len in one block (>= 200); got block_q=64 for q_len 200"
    )
    for call in mosaic_calls(200):
        with pytest.raises(ValueError, match=message):
            call(interpret="tpu", block_q=64)

    def blocks(q_len, **kw):
        q, k = jnp.zeros((1, q_len, 4, 16)), jnp.zeros((1, 200, 2, 16))
        config, _ = attention_module._config(
            q, k, k, causal=True, sm_scale=None, interpret="tpu", **kw
        )
        return config.tiling.block_q, config.tiling.block_k

    assert blocks(40, block_q=64, block_k=24) == (40, 24)  # shrunk to the whole length
    assert blocks(200, block_q=256, block_k=8) == (200, 8)
    assert blocks(300, block_q=128, block_k=512) == (128, 200)


def test_refuses_an_interpret_that_names_no_target(monkeypatch):
    monkeypatch.setattr(attention_module, "_padded_attention", _no_kernel)
    q, k = jnp.zeros((1, 8, 4, 16)), jnp.zeros((1, 8, 2, 16))
    for bad in ("gpu", "TPU", 1, jnp.array(True)):
        message = re.escape(f"interpret must be None, True, False or 'tpu'; got {bad!r}")
        with pytest.raises(ValueError, match=message):
            flash_attention(q, k, k, interpret=bad)


def test_mosaic_refuses_more_visible_block_pairs_than_the_step_tables_hold(monkeypatch):
    # One query block over key blocks of 8: MAX_STEPS of them fill the forward's step table (held
    # in SMEM), one more is refused, by every entry point and whether compiled for a TPU or
    # interpreted, before any kernel is traced. Not causal: every block pair is visible.
    no_kernels(monkeypatch)

    def calls(kv_len, **kw):
        q, k = jnp.zeros((1, 128, 1, 8)), jnp.zeros((1, kv_len, 1, 8))
        lse = jnp.zeros((1, 1, 128))
        kw = dict(causal=False, block_q=128, block_k=8, **kw)
        return (
            lambda: flash_attention(q, k, k, **kw),
            lambda: flash_attention_forward(q, k, k, **kw),
            lambda: flash_attention_backward(q, k, k, q, lse, q, **kw),
        )

    longest, refused = 8 * MAX_STEPS, 8 * MAX_STEPS + 1
    message = re.escape(
        f"flash_attention on TPU (Mosaic): q_len 128 and kv_len {refused} at block_q 128 and "
        f"block_k 8 make {MAX_STEPS + 1} visible block pairs, more than the {MAX_STEPS} the "
        "kernels' step tables hold in SMEM; pass larger block_q and block_k"
    )
    for call in calls(longest, interpret="tpu"):
        with pytest.raises(AssertionError, match="the kernels were reached"):
            call()  # accepted: it reaches the (stubbed) kernels
    for call in calls(refused, interpret="tpu"):
        with pytest.raises(ValueError, match=message):
            call()
    with jax.sharding.use_abstract_mesh(tpu_mesh("TPU v5 lite")):
        for call in calls(refused):
            with pytest.raises(ValueError, match=message):
                call()


# ---- compiled for TPU slices: the Mosaic kernels in Dew's step ------------------------------

SEQ = 16
needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="compiling for a TPU slice needs libtpu (pip install -e '.[tpu]')",
)


def mosaic_kernels(hlo_text: str) -> set[str]:
    """The names of Dew's Mosaic kernels the compiled HLO calls (its ``tpu_custom_call`` s)."""
    calls = [line for line in hlo_text.splitlines() if "tpu_custom_call" in line]
    return {name for line in calls for name in re.findall(r"dew_flash_attention_\w+", line)}


@pytest.mark.xdist_group("tpu")
@needs_libtpu
@pytest.mark.parametrize(
    "slice_name, mesh, tuning, kernels",
    [
        pytest.param("v5e-8", dew.MeshSpec(fsdp=8), {}, KERNELS, id="v5e-8-fsdp8"),
        pytest.param(
            "v5p-16",
            dew.MeshSpec(sequence=4, tensor=2),
            {},
            KERNELS,
            id="v5p-16-ring4-tensor2",
        ),
        pytest.param(
            "v5e-8",
            dew.MeshSpec(fsdp=8),
            {"fused_backward": False},
            TWO_KERNELS,
            id="v5e-8-fsdp8-two-kernel-backward",
        ),
    ],
)
def test_the_step_compiles_the_mosaic_kernels_for_a_tpu_slice(slice_name, mesh, tuning, kernels):
    # attention_impl="pallas" on a CPU host, compiled for the slice's TPU devices: the step's HLO
    # must call the Mosaic kernels (tpu_custom_call), not carry the CPU's interpreted form: the
    # forward and the fused backward, or the forward, dq and dk/dv kernels of the two-kernel
    # backward where it is asked for. v5p-16 runs the ring (sequence 4, the Pallas blocks forward
    # and backward) on tensor parallelism's local heads (2 of 4 query heads, 1 of 2 kv heads per
    # device).
    config = dict(vocab_size=64, emb_features=32, num_layers=1, num_heads=4, num_kv_heads=2)
    model = dew.models.build(
        "causal_transformer",
        max_seq_len=SEQ,
        dtype="bfloat16",
        attention_impl="pallas",
        **config,
    )
    trainer = dew.Trainer(
        LMObjective(model, SEQ),
        optax.adamw(1e-3),
        jax.random.key(0),
        mesh=mesh,
        layout=dew.Layout(min_shard=4096),
        devices=target(slice_name).devices(),
    )
    with platform.tuned(**tuning):
        text = trainer.compiled_step(8).as_text()
    assert mosaic_kernels(text) == set(kernels), slice_name


@pytest.mark.xdist_group("tpu")
@needs_libtpu
@pytest.mark.parametrize(
    "slice_name, mesh",
    [
        pytest.param("v5e-1", dew.MeshSpec(), id="v5e-1"),
        pytest.param("v5e-8", dew.MeshSpec(fsdp=8), id="v5e-8-fsdp8"),
        pytest.param("v5e-8", dew.MeshSpec(data=2, fsdp=2, tensor=2), id="v5e-8-tensor2"),
    ],
)
def test_the_gspmd_step_runs_the_mosaic_kernels_for_a_tpu_slice(slice_name, mesh):
    # The GSPMD engine has no shard_map body to say the devices' platform: it is traced on its
    # mesh's abstract mesh (dew.training.step.on_abstract_mesh), so "auto" picks the Mosaic
    # kernels compiled on this CPU host as on the chip (before, the host's backend chose XLA's
    # attention: GPT-2 small's step at 16 x 1024 planned 7.0 GiB of temporaries for v5e-1, where
    # the chip's needs 6.4). Over several chips XLA cannot partition the kernels: they run in a
    # shard_map over the rows and heads (dew.parallel.gspmd_kernel), and the step compiles.
    config = dict(vocab_size=64, emb_features=256, num_layers=1, num_heads=2, dtype="bfloat16")
    model = dew.models.build("causal_transformer", max_seq_len=SEQ, attention_impl="auto", **config)
    trainer = dew.Trainer(
        LMObjective(model, SEQ),
        optax.adamw(1e-3),
        jax.random.key(0),
        mesh=mesh,
        engine="gspmd",
        devices=target(slice_name).devices(),
    )
    assert mosaic_kernels(trainer.compiled_step(8).as_text()) == set(KERNELS), slice_name


@pytest.mark.xdist_group("tpu")
@needs_libtpu
def test_the_two_kernel_backward_compiles_at_the_long_blocks_for_v5e():
    # v5e's long blocks (1024 x 2048, pieces of 512: its defaults without a mask, pinned here on a
    # causal call) ask the Mosaic compiler for more scoped VMEM than its 16 MiB default: the
    # two-kernel backward, the fallback where the fused one's dq does not fit, must carry the
    # generation's limit as the fused one does. Heads of 256 (Gemma's), where the dk/dv kernel
    # needs 23.9 MiB: at 128 both kernels now fit the default (dq 11.5, dk/dv 14.4 MiB), and a
    # backward that dropped the limit compiled there all the same. The backward alone is
    # compiled, from `flash_attention_backward`: the forward at these blocks is not the subject,
    # and compiling it too would nearly treble the time. 2048 positions, one key block whole and
    # two query blocks: a kernel's VMEM is its blocks', whatever the length (8192 positions took
    # this test 22 s of CPU against 16 s, and needed the limit all the same). One head: the
    # backward computes one head a step, so its kernels are the same at any number (8 heads took
    # 19.8 CPU-s against 15.2 and 17.7 for one).
    mesh = jax.sharding.Mesh(target("v5e-1").devices(), ("x",))
    replicated = jax.sharding.NamedSharding(mesh, P())
    x = jax.ShapeDtypeStruct((1, 2048, 1, 256), jnp.bfloat16, sharding=replicated)
    lse = jax.ShapeDtypeStruct((1, 1, 2048), jnp.float32, sharding=replicated)
    backward = functools.partial(flash_attention_backward, causal=True)
    with platform.tuned(fused_backward=False, block_q=1024), jax.set_mesh(mesh):
        text = jax.jit(backward).lower(x, x, x, x, lse, x).compile().as_text()
    assert mosaic_kernels(text) == {"dew_flash_attention_dq", "dew_flash_attention_dkdv"}


# Compiles Dew's attention forward and backward for one v5e chip, causal, not and under a window,
# with libtpu's overlay log and its final LLO bundles dumped (the last pass only: all of them are
# about 700 MB), in a process of its own (libtpu reads its flags once, when it loads). The masks in
# one process
# (Python, JAX, Dew and libtpu load once): libtpu writes a compile's dump while it compiles, so
# after each compile the dump is moved into a folder named for the mask, beside the program's
# HLO, and a line on stderr ends that mask's part of the log.
_OVERLAY_PROBE = """
import os, sys
os.environ["LIBTPU_INIT_ARGS"] = (
    f"--xla_jf_dump_to={sys.argv[1]} --xla_jf_dump_llo_text=true "
    "--xla_jf_dump_llo_pass_label_regex=final_bundles "
    "--logtostderr --stderrthreshold=0 --minloglevel=0 --vmodule=overlay_partitioner=3"
)
import dew.targets
dew.targets.compile_only_environment()
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec
from dew.kernels import flash_attention

mesh = jax.sharding.Mesh(dew.targets.target("v5e-1").devices(), ("x",))
replicated = NamedSharding(mesh, PartitionSpec())
x = jax.ShapeDtypeStruct((1, 16, 4096, 128), jnp.bfloat16, sharding=replicated)
WINDOWS = {"window": 1024}

for mask in sys.argv[2:]:
    def forward_and_backward(q, k, v, do):
        attend = lambda q, k, v: flash_attention(
            q, k, v, causal=mask != "full", window=WINDOWS.get(mask), layout="bhsd"
        )
        out, vjp = jax.vjp(attend, q, k, v)
        return out, vjp(do)

    with jax.set_mesh(mesh):
        compiled = jax.jit(forward_and_backward).lower(x, x, x, x).compile()
    folder = os.path.join(sys.argv[1], mask)
    os.mkdir(folder)
    for name in os.listdir(sys.argv[1]):
        if os.path.isfile(os.path.join(sys.argv[1], name)):
            os.rename(os.path.join(sys.argv[1], name), os.path.join(folder, name))
    open(os.path.join(folder, "program.hlo"), "w").write(compiled.as_text())
    print("OVERLAY PROBE: compiled", mask, file=sys.stderr, flush=True)
"""
OVERLAY_MASKS = ("causal", "full", "window")


@pytest.fixture(scope="module")
def overlay_probe(tmp_path_factory) -> dict:
    """``{mask: (log, dump)}`` from one run of `_OVERLAY_PROBE` over both masks: libtpu's log
    while that mask compiled, and the folder of its dump and its program's HLO."""
    root = tmp_path_factory.mktemp("overlay")
    result = subprocess.run(
        [sys.executable, "-c", _OVERLAY_PROBE, str(root), *OVERLAY_MASKS],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    logs = re.split(r"OVERLAY PROBE: compiled (\w+)\n", result.stderr)
    # [log, mask, log, mask, ..., the rest]: each mask follows the log of its compile.
    assert logs[1::2] == list(OVERLAY_MASKS), logs[1::2]
    return {mask: (log, root / mask) for log, mask in zip(logs[0::2], logs[1::2])}


# The cases on one worker: each worker that drew one would run the probe (every compile) again.
@pytest.mark.xdist_group("overlay_probe")
@needs_libtpu
@pytest.mark.parametrize("mask", OVERLAY_MASKS)
def test_each_kernel_fits_one_instruction_overlay_on_v5e_and_xla_makes_no_pass_between(
    overlay_probe, mask
):
    # A TPU core runs a program larger than its instruction memory in overlays, loaded from HBM
    # when control moves between them (libtpu's overlay partitioner; its largest, "jumbo", overlay
    # holds 65,232 bundles on v5e in this libtpu). A kernel whose grid step crosses overlays
    # reloads code every step: a forward that computed the causal diagonal as triangles had twice
    # the code (79,389 bundles), was split over four overlays, and ran 2.35x slower on a v5e chip
    # (docs/kernels.md). So each of Dew's kernels, at v5e's blocks, heads a step and pieces (the
    # unrolled work that sets its size), must fit the largest overlay: causal (512 x 2048, 4 heads
    # a step, the masked branches), not (1024 x 2048, 2 heads), and a window of 1024 (512 x 512, 16
    # heads, the largest: each masked piece's strips by position, whole or one half; 47,601 bundles
    # on 2026-12-07). 16 heads, so that each mask's step takes as many as
    # kernels.mosaic.FORWARD_LOGITS allows. The count is from libtpu's final bundles; the limit
    # from its log. And the same program is the two kernels and nothing between them: the fused
    # backward computes delta = rowsum(dO * O) from the O block each step reads, so no XLA fusion
    # reads O and dO in HBM (the two-kernel backward still takes delta from one), and layout "bhsd"
    # leaves no transposes around them.
    log, dump = overlay_probe[mask]
    limits = re.findall(r"overlay size (\d+)/(\d+)/(\d+)", log)
    assert limits, "libtpu printed no overlay sizes (a new log format, or no overlays needed)"
    jumbo = int(limits[0][1])
    sizes, texts = {}, {}
    for path in dump.glob("*dew_flash_attention_*-final_bundles.txt"):
        if "schedule-analysis" in path.name:
            continue
        kernel = re.search(r"dew_flash_attention_\w+", path.name).group(0)
        assert kernel not in sizes, f"{mask}: {kernel} dumped twice (the other mask's dump?)"
        texts[kernel] = path.read_text()
        lines = texts[kernel].splitlines()
        sizes[kernel] = sum(1 for line in lines if re.match(r"\s*0x[0-9a-f]+\s", line))
    assert set(sizes) == {"dew_flash_attention_forward", "dew_flash_attention_backward"}, sizes
    print(f"{mask}: bundles {sizes}, largest overlay {jumbo}")
    assert all(size <= jumbo for size in sizes.values()), (sizes, jumbo)
    # The forward's end of a run takes the lse's log2 on one row of block_q values a head
    # (docs/kernels.md, "A shorter end of a run"): block_q / 128 vector registers, 4 heads x 512
    # / 128 = 16 causal, 2 x 1024 / 128 = 16 without a mask, 16 x 512 / 128 = 64 under the
    # window, where the lane-dense log it replaced took 16 x 512 / 8 = 1,024 (libtpu's vlog2).
    logs = re.findall(r"= vlog2", texts["dew_flash_attention_forward"])
    assert len(logs) == {"causal": 16, "full": 16, "window": 64}[mask], len(logs)
    text = (dump / "program.hlo").read_text()
    entry = text[text.index("\nENTRY") :]
    fusions = [line.strip()[:160] for line in entry.splitlines() if " fusion(" in line]
    assert mosaic_kernels(text) == set(KERNELS)
    assert fusions == [], fusions
