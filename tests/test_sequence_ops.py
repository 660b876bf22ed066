"""Sequence parallelism's attention (dew.parallel.sequence) against causal attention on one device.

Each scheme runs inside ``jax.shard_map(..., check_vma=False)`` on a mesh with a ``sequence`` axis
of ``n`` devices, on the zigzag-permuted sequence split over dimension 2 (the model's layout,
``[batch, heads, seq, head_dim]``); its ``out``, ``lse`` and
the gradients of q, k and v (of a random linear function of ``out`` and, in most cases, ``lse``)
are compared with ``xla_attention`` on the natural-order sequence, permuted the same way (float32,
relative 1e-5). Collectives are counted from the jaxpr with ``dew.collectives`` and, where XLA's
program is the claim, from the compiled HLO.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import dew
from dew.collectives import hlo_collectives
from dew.nn.attention import xla_attention
from dew.parallel import ONE_DEVICE, Shards, sequence
from tests.helpers import relative_error

TOL = 1e-5
S_AXIS = sequence.AXIS
ROWS, HEAD_DIM = 2, 8
POSITIONS = P(None, None, S_AXIS)  # q, k, v, out, their gradients: [batch, heads, positions, d]
LSE_POSITIONS = P(None, None, S_AXIS)  # lse: [batch, heads, positions]


def sequence_mesh(n: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:n]), axis_names=(S_AXIS,))


def shards_of(n: int) -> Shards:
    return Shards(axis_sizes={S_AXIS: n})


def randn(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def assert_close(actual, expected, what, seed):
    actual = np.asarray(actual)
    assert np.all(np.isfinite(actual)), f"{what}: not finite, seed {seed}"
    error = relative_error(actual, expected)
    assert error <= TOL, f"{what}: relative error {error:.2e} above {TOL}, seed {seed}"


def inputs(seed, seq_len, heads, kv_heads):
    rng = np.random.default_rng(seed)
    return (
        randn(rng, ROWS, heads, seq_len, HEAD_DIM),
        randn(rng, ROWS, kv_heads, seq_len, HEAD_DIM),
        randn(rng, ROWS, kv_heads, seq_len, HEAD_DIM),
        randn(rng, ROWS, heads, seq_len, HEAD_DIM),  # the cotangent of out
        randn(rng, ROWS, heads, seq_len),  # the cotangent of lse
    )


def document_ids(rng, seq_len, sorted_ids=True):
    """int32 ``[ROWS, seq_len]`` segment ids: documents of random lengths in order (one of a
    single token, when there is room), or, ``sorted_ids=False``, ids drawn at random from 3."""
    if not sorted_ids:
        return rng.integers(0, 3, (ROWS, seq_len)).astype(np.int32)
    rows = []
    for _ in range(ROWS):
        starts = np.sort(rng.choice(np.arange(2, seq_len), 3, replace=False))
        starts[0] = 1  # a document of one token: position 0
        rows.append(np.searchsorted(starts, np.arange(seq_len), side="right"))
    return np.asarray(rows, np.int32)


def check_against_one_device(
    scheme,
    n,
    seed,
    seq_len=16,
    heads=4,
    kv_heads=4,
    impl="xla",
    with_lse=True,
    ids=None,
    window=None,
):
    """``SCHEMES[scheme]`` on ``n`` devices: out, lse and the gradients of
    ``sum(out * ct) [+ sum(lse * ct_lse)]`` equal one device's causal attention, with the
    segment ids ``ids`` (``[ROWS, seq_len]`` in natural order, or ``None``) and ``window``."""
    q, k, v, ct, ct_lse = inputs(seed, seq_len, heads, kv_heads)
    if not with_lse:
        ct_lse = np.zeros_like(ct_lse)
    masks = {"window": window}

    def objective(attend):
        def loss(q, k, v, ct, ct_lse, ids):
            out, lse = attend(q, k, v, ids)
            # Without lse the loss does not touch it: its cotangent is a symbolic zero.
            return jnp.sum(out * ct) + (jnp.sum(lse * ct_lse) if with_lse else 0.0)

        return loss

    def reference(q, k, v, ct, ct_lse, ids):
        def plain(q, k, v, ids):
            return xla_attention(q, k, v, causal=True, layout="bhsd", segment_ids=ids, **masks)

        grads = jax.grad(objective(plain), (0, 1, 2))(q, k, v, ct, ct_lse, ids)
        return (*plain(q, k, v, ids), *grads)

    # One compiled program: eager op-by-op dispatch would cost more than the test itself.
    expected = jax.jit(reference)(q, k, v, ct, ct_lse, ids)

    shards = shards_of(n)
    attend = sequence.SCHEMES[scheme]

    def body(q, k, v, ct, ct_lse, ids):
        def run(q, k, v, ids):
            return attend(q, k, v, shards, impl, segment_ids=ids, **masks)

        out, lse = run(q, k, v, ids)
        return (out, lse, *jax.grad(objective(run), (0, 1, 2))(q, k, v, ct, ct_lse, ids))

    ids_spec = None if ids is None else P(None, S_AXIS)
    specs = (POSITIONS, POSITIONS, POSITIONS, POSITIONS, LSE_POSITIONS, ids_spec)
    step = jax.jit(
        jax.shard_map(
            body,
            mesh=sequence_mesh(n),
            in_specs=specs,
            out_specs=(POSITIONS, LSE_POSITIONS, POSITIONS, POSITIONS, POSITIONS),
            check_vma=False,
        )
    )
    zz = sequence.zigzag_positions(seq_len, n)
    got = step(*(x[:, :, zz] for x in (q, k, v, ct, ct_lse)), None if ids is None else ids[:, zz])
    expected = [x[:, :, zz] for x in expected]
    where = (
        f"{scheme} {impl}, sequence {n}, heads {heads}/{kv_heads}, with_lse {with_lse}, "
        f"ids {ids is not None}, window {window}"
    )
    for name, a, e in zip(("out", "lse", "dq", "dk", "dv"), got, expected, strict=True):
        assert_close(a, e, f"{where}: {name}", seed)


# --- The zigzag order -----------------------------------------------------------------------------


@pytest.mark.parametrize("n", (1, 2, 4))
def test_zigzag_positions_give_each_device_chunks_i_and_2n_minus_1_minus_i(n):
    seq_len = 8 * n
    c = seq_len // (2 * n)
    zz = sequence.zigzag_positions(seq_len, n)
    assert zz.shape == (seq_len,) and sorted(zz.tolist()) == list(range(seq_len))
    for i in range(n):
        local = zz[2 * c * i : 2 * c * (i + 1)].tolist()
        first, second = (
            list(range(i * c, (i + 1) * c)),
            list(range((2 * n - 1 - i) * c, (2 * n - i) * c)),
        )
        assert local == first + second, (n, i, local)
    # The local permutations of the all-to-all scheme agree with it and undo each other.
    natural = jnp.arange(seq_len)[None]
    as_zigzag = sequence._natural_to_zigzag(natural, n, axis=1)
    assert np.array_equal(as_zigzag[0], zz)
    assert np.array_equal(sequence._zigzag_to_natural(as_zigzag, n, axis=1), natural)


@pytest.mark.parametrize("seq_len, n", [(12, 4), (10, 2), (6, 4)])
def test_zigzag_positions_refuse_a_length_that_does_not_split(seq_len, n):
    message = f"seq_len {seq_len} does not split into 2 x sequence {n} = {2 * n} chunks"
    with pytest.raises(ValueError, match=message):
        sequence.zigzag_positions(seq_len, n)


# --- Equal to one device --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n, seq_len, kv_heads, with_lse",
    [(2, 16, 4, True), (4, 32, 2, True), (8, 32, 4, False)],
)
def test_ring_attention_equals_one_device(seed, n, seq_len, kv_heads, with_lse):
    check_against_one_device("ring", n, seed, seq_len, kv_heads=kv_heads, with_lse=with_lse)


@pytest.mark.parametrize("with_lse", (True, False))
def test_ring_attention_with_the_pallas_blocks_equals_one_device(seed, with_lse):
    """Interpret mode: flash_attention_forward per block, flash_attention_backward with the final
    out and lse, taking the cotangent of lse when the loss uses it."""
    check_against_one_device("ring", 2, seed, kv_heads=2, impl="pallas", with_lse=with_lse)


@pytest.mark.parametrize("with_lse", (True, False))
def test_ring_pallas_backward_runs_one_kernel_pair_per_block(with_lse):
    """The Pallas ring's backward runs one dq and one dk/dv kernel per block, the lse cotangent
    included (``flash_attention_backward`` takes ``d_lse``; no second pass for it). Counted from
    the jaxpr of the gradient on a sequence axis of 2, where no step is a scan: the forward and
    the backward each visit 3 blocks (the own causal block, then two ``c x c`` pairs)."""
    n, seq_len = 2, 32
    shards = shards_of(n)

    def body(q, k, v):
        def loss(q, k, v):
            out, lse = sequence.ring_attention(q, k, v, shards, "pallas")
            return jnp.sum(out) + (jnp.sum(lse) if with_lse else 0.0)

        return jax.grad(loss, (0, 1, 2))(q, k, v)

    fn = jax.shard_map(
        body,
        mesh=sequence_mesh(n),
        in_specs=(POSITIONS,) * 3,
        out_specs=(POSITIONS,) * 3,
        check_vma=False,
    )
    args = [jax.ShapeDtypeStruct((ROWS, h, seq_len, HEAD_DIM), jnp.float32) for h in (4, 2, 2)]

    def kernels(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                yield eqn.params["name"]
            for param in eqn.params.values():
                for sub in param if isinstance(param, (list, tuple)) else (param,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        yield from kernels(inner)

    names = list(kernels(jax.make_jaxpr(fn)(*args).jaxpr))
    counts = {name: names.count(name) for name in sorted(set(names))}
    blocks = 3
    assert counts == {
        f"dew_flash_attention_{kernel}": blocks for kernel in ("dkdv", "dq", "forward")
    }, counts


@pytest.mark.parametrize(
    "scheme, n, impl, sorted_ids, window",
    [
        ("ring", 4, "xla", True, None),
        ("ring", 4, "pallas", True, None),  # the kernels' blocks round a ring of 4 (a scan)
        ("ring", 2, "xla", False, 5),
        # A window longer than a chunk round a ring of 4: step t's keys are device i - t's, not
        # i + t's (on a ring of 2 the same device).
        ("ring", 4, "xla", True, 6),
        ("all_to_all", 2, "xla", True, 3),
    ],
)
def test_segment_ids_and_windows_over_the_sequence_axis_equal_one_device(
    seed, scheme, n, impl, sorted_ids, window
):
    """Packed documents (each K/V block's ids the owner's; the Pallas blocks take them as the
    pair ``(q_ids, kv_ids)``) and unsorted ids; a window over the ring's XLA blocks by their
    global positions, and over the all-to-all's whole sequence."""
    ids = document_ids(np.random.default_rng((seed, 1)), 16, sorted_ids)
    check_against_one_device(scheme, n, seed, kv_heads=2, impl=impl, ids=ids, window=window)


@pytest.mark.parametrize(
    "n, seq_len, impl, with_ids, window",
    [
        (4, 32, "xla", False, 4),  # chunks of 4: the halo is the whole chunk before
        (4, 32, "xla", True, 3),
        (2, 16, "pallas", True, 4),
        (2, 16, "pallas_tpu_interpret", False, 3),
        # chunks of 256: a halo of 128 keys, the 29 first of which no query's window reaches
        (4, 2048, "xla", True, 100),
        (2, 16, "xla", False, 1),  # each query sees itself: the local call
    ],
)
def test_a_window_within_a_chunk_runs_the_ring_as_a_halo_exchange_equal_to_one_device(
    seed, n, seq_len, impl, with_ids, window
):
    """A window of at most a zigzag chunk: each chunk takes the last keys of the chunk before it
    from the device that holds it (device n - 1's second chunk from its own first; device 0's
    first chunk from none) and attends once, with any attention, the kernels included. Unsorted
    ids, so that the halo's ids are read, not assumed equal."""
    ids = document_ids(np.random.default_rng((seed, 1)), seq_len, False) if with_ids else None
    check_against_one_device(
        "ring", n, seed, seq_len=seq_len, kv_heads=2, impl=impl, ids=ids, window=window
    )


@pytest.mark.parametrize("n, heads, kv_heads, with_lse", [(2, 4, 2, True), (4, 8, 4, False)])
def test_all_to_all_attention_equals_one_device(seed, n, heads, kv_heads, with_lse):
    check_against_one_device(
        "all_to_all", n, seed, heads=heads, kv_heads=kv_heads, with_lse=with_lse
    )


@pytest.mark.parametrize("scheme", sorted(sequence.SCHEMES))
def test_sequence_size_one_is_the_plain_call(seed, scheme):
    """No mesh, no collective: the same bits as xla_attention."""
    q, k, v, _, _ = inputs(seed, 16, 4, 2)
    out, lse = sequence.SCHEMES[scheme](q, k, v, ONE_DEVICE)
    out_ref, lse_ref = xla_attention(q, k, v, causal=True, layout="bhsd")
    assert np.array_equal(out, out_ref) and np.array_equal(lse, lse_ref), f"seed {seed}"
    report = dew.collectives(lambda q, k, v: sequence.SCHEMES[scheme](q, k, v, ONE_DEVICE), q, k, v)
    assert not report.rows, report.rows


# --- Collectives, from formulas -------------------------------------------------------------------


def traced_collectives(
    scheme, n, seq_len, heads, kv_heads, dtype, grad, with_lse=False, window=None
):
    """The jaxpr's and the compiled program's collectives of one attention call (or of it and its
    gradient) in a shard_map over a sequence axis of ``n``."""
    shards = shards_of(n)

    def attend(q, k, v):
        return sequence.SCHEMES[scheme](q, k, v, shards, window=window)

    def body(q, k, v):
        def loss(q, k, v):
            out, lse = attend(q, k, v)
            return jnp.sum(jnp.sin(out.astype(jnp.float32))) + (jnp.sum(lse) if with_lse else 0)

        if grad:
            return jax.grad(loss, (0, 1, 2))(q, k, v)
        return attend(q, k, v)[0], k, v

    mesh = sequence_mesh(n)
    fn = jax.shard_map(
        body, mesh=mesh, in_specs=(POSITIONS,) * 3, out_specs=(POSITIONS,) * 3, check_vma=False
    )
    args = [jax.ShapeDtypeStruct((ROWS, h, seq_len, HEAD_DIM), dtype) for h in (heads, kv_heads)]
    args.append(args[-1])
    compiled = jax.jit(fn).lower(*args).compile()
    return dew.collectives(fn, *args), hlo_collectives(compiled, mesh)


def rows_of(report):
    return {(row.op, row.axes): (row.count, row.wire_bytes) for row in report.rows}


@pytest.mark.parametrize(
    "n, kv_heads, dtype",
    [(2, 2, jnp.float32), (8, 2, jnp.float32), (4, 4, jnp.bfloat16)],
)
def test_ring_sends_kv_blocks_and_their_gradients_round_the_ring(n, kv_heads, dtype):
    """Forward: n - 1 hops of the stacked K/V block (kv heads only). Backward: n - 1 hops of it
    again and n - 1 of its float32 dK/dV accumulator, the last one home. Nothing else, nothing
    gathered; the compiled program keeps every hop (none merged with another)."""
    seq_len, heads = 32, 8
    block = 2 * ROWS * (seq_len // n) * kv_heads * HEAD_DIM  # elements of one stacked K/V block
    kv_bytes, grad_bytes = block * np.dtype(dtype).itemsize, block * 4
    key = ("ppermute", (S_AXIS,))
    forward = {key: (n - 1, (n - 1) * kv_bytes)}
    both = {key: (3 * (n - 1), (n - 1) * (2 * kv_bytes + grad_bytes))}
    for grad, want in ((False, forward), (True, both)):
        jaxpr, hlo = traced_collectives("ring", n, seq_len, heads, kv_heads, dtype, grad)
        assert rows_of(jaxpr) == want, (grad, jaxpr.rows)
        if dtype == jnp.float32:
            assert rows_of(hlo) == want, (grad, hlo.rows)
        else:  # XLA:CPU sends bfloat16 collective-permutes as float32: count only.
            assert {k: c for k, (c, _) in rows_of(hlo).items()} == {key: want[key][0]}, hlo.rows


@pytest.mark.parametrize(
    "n, seq_len, window, halo",
    [(2, 16, 3, 4), (4, 2048, 129, 128), (4, 2048, 200, 256), (2, 1024, 100, 128)],
)
def test_a_window_within_a_chunk_sends_each_chunk_its_halo_and_the_halos_gradients_back(
    n, seq_len, window, halo
):
    """Forward: two ppermute of the stacked K/V tails (the last ``halo`` positions of each chunk:
    ``window - 1`` rounded up to whole 128s, at most the chunk), one each way along the ring's
    line. Backward: their transposes, the halos' dK/dV, the same bytes. Nothing else: no hop round
    the ring, nothing gathered."""
    heads, kv_heads = 8, 2
    assert sequence.halo_length(window, seq_len // (2 * n)) == halo, (window, seq_len)
    tails = 2 * ROWS * kv_heads * halo * HEAD_DIM * 4  # the stacked K/V tails, float32
    key = ("ppermute", (S_AXIS,))
    for grad, want in ((False, {key: (2, 2 * tails)}), (True, {key: (4, 4 * tails)})):
        jaxpr, hlo = traced_collectives(
            "ring", n, seq_len, heads, kv_heads, jnp.float32, grad, window=window
        )
        assert rows_of(jaxpr) == want, (grad, jaxpr.rows)
        assert rows_of(hlo) == want, (grad, hlo.rows)


@pytest.mark.xdist_group("tpu")
def test_a_window_within_a_chunk_holds_less_than_the_ring_on_a_tpu_slice():
    """Compiled for v5e-4 (libtpu, no TPU), sequence=4, 8192 positions, 8 heads of 128, bfloat16,
    forward and backward: the halo exchange with the kernels holds under a tenth of the ring's
    temporaries (the ring's XLA blocks, at a window one key past the chunk), and with XLA's
    attention less than the ring too (each chunk's logits recomputed in the backward, not kept)."""
    pytest.importorskip("libtpu")
    from dew.targets import target

    n, seq_len, heads = 4, 8192, 8
    mesh = Mesh(np.array(target("v5e-4").devices()), axis_names=(S_AXIS,))
    shards = shards_of(n)
    chunk = seq_len // (2 * n)

    def temporaries(impl, window):
        def body(q, k, v):
            def loss(q, k, v):
                out, _ = sequence.ring_attention(q, k, v, shards, impl, window=window)
                return jnp.sum(out.astype(jnp.float32))

            return jax.grad(loss, (0, 1, 2))(q, k, v)

        fn = jax.shard_map(
            body, mesh=mesh, in_specs=(POSITIONS,) * 3, out_specs=(POSITIONS,) * 3, check_vma=False
        )
        x = jax.ShapeDtypeStruct((1, heads, seq_len, 128), jnp.bfloat16)
        compiled = jax.jit(fn).lower(x, x, x).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    ring = temporaries("xla", chunk + 1)
    halo_kernels, halo_xla = temporaries("pallas", chunk), temporaries("xla", chunk)
    print(f"temporaries: ring {ring}, halo with the kernels {halo_kernels}, with XLA {halo_xla}")
    assert halo_kernels * 10 < ring, (halo_kernels, ring)
    assert halo_xla < ring, (halo_xla, ring)


@pytest.mark.parametrize("n", (2, 4))
def test_all_to_all_trades_positions_for_heads_and_back(n):
    """Forward: q, k, v in, out and lse back (five all_to_all; XLA drops lse's when it is unused).
    Backward: the transposes of those with a cotangent: out's, q's, k's, v's, and lse's when the
    loss uses it. Each sends (n - 1) / n of its operand."""
    seq_len, heads, kv_heads = 16, 8, 4
    local = seq_len // n
    q_bytes = ROWS * local * heads * HEAD_DIM * 4
    kv_bytes = ROWS * local * kv_heads * HEAD_DIM * 4
    lse_bytes = ROWS * heads * local * 4
    share = lambda b: (n - 1) * b // n  # noqa: E731
    exchanges = share(2 * q_bytes + 2 * kv_bytes)  # q, k, v in; out back: each way
    key = ("all_to_all", (S_AXIS,))
    jaxpr, hlo = traced_collectives("all_to_all", n, seq_len, heads, kv_heads, jnp.float32, False)
    assert rows_of(jaxpr) == {key: (5, exchanges + share(lse_bytes))}, jaxpr.rows
    assert rows_of(hlo) == {key: (4, exchanges)}, hlo.rows
    for with_lse in (False, True):
        jaxpr, _ = traced_collectives(
            "all_to_all", n, seq_len, heads, kv_heads, jnp.float32, True, with_lse
        )
        count, wire = 9 + with_lse, 2 * exchanges + (1 + with_lse) * share(lse_bytes)
        assert rows_of(jaxpr) == {key: (count, wire)}, (with_lse, jaxpr.rows)


# --- Bad input ------------------------------------------------------------------------------------


def trace(scheme, n, seq_len, heads, kv_heads, impl="xla"):
    shards = shards_of(n)
    fn = jax.shard_map(
        lambda q, k, v: sequence.SCHEMES[scheme](q, k, v, shards, impl)[0],
        mesh=sequence_mesh(n),
        in_specs=(POSITIONS,) * 3,
        out_specs=POSITIONS,
        check_vma=False,
    )
    shapes = [(ROWS, h, seq_len, HEAD_DIM) for h in (heads, kv_heads, kv_heads)]
    return jax.make_jaxpr(fn)(*(jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes))


@pytest.mark.parametrize(
    "scheme, n, seq_len, heads, kv_heads, impl, message",
    [
        ("ring", 2, 6, 4, 4, "xla", "seq_len 6 does not split into 2 x sequence 2 = 4 chunks"),
        ("all_to_all", 4, 20, 8, 4, "xla", "seq_len 20 does not split into 2 x sequence 4 = 8"),
        ("ring", 2, 8, 6, 4, "xla", "heads 6 must be a multiple of kv_heads 4"),
        ("all_to_all", 4, 16, 4, 2, "xla", "heads 4 and kv_heads 2 must both divide by sequence 4"),
        ("all_to_all", 4, 16, 6, 6, "xla", "heads 6 and kv_heads 6 must both divide by sequence 4"),
        (
            "ring",
            2,
            8,
            4,
            4,
            "flash",
            r"impl must be one of \['cudnn', 'pallas', 'pallas_tpu_interpret', 'xla'\], got "
            "'flash'",
        ),
    ],
)
def test_bad_sizes_are_refused_before_compiling(scheme, n, seq_len, heads, kv_heads, impl, message):
    with pytest.raises(ValueError, match=message):
        trace(scheme, n, seq_len, heads, kv_heads, impl)


def test_the_ring_gathers_the_segment_ids_once():
    """The ids of every device come in one all_gather of int32 [rows, 2c] (forward and backward
    share it); the K/V blocks and their gradients travel as without ids."""
    n, seq_len, heads, kv_heads = 4, 32, 4, 2
    shards = shards_of(n)

    def body(q, k, v, ids):
        def loss(q, k, v):
            out, lse = sequence.ring_attention(q, k, v, shards, segment_ids=ids)
            return jnp.sum(out) + jnp.sum(lse)

        return jax.grad(loss, (0, 1, 2))(q, k, v)

    fn = jax.shard_map(
        body,
        mesh=sequence_mesh(n),
        in_specs=(POSITIONS,) * 3 + (P(None, S_AXIS),),
        out_specs=(POSITIONS,) * 3,
        check_vma=False,
    )
    shapes = [(ROWS, h, seq_len, HEAD_DIM) for h in (heads, kv_heads, kv_heads)]
    args = [jax.ShapeDtypeStruct(shape, jnp.float32) for shape in shapes]
    args.append(jax.ShapeDtypeStruct((ROWS, seq_len), jnp.int32))
    rows = rows_of(dew.collectives(fn, *args))
    block = 2 * ROWS * (seq_len // n) * kv_heads * HEAD_DIM
    ids_bytes = (n - 1) * ROWS * (seq_len // n) * 4
    assert rows == {
        ("all_gather", (S_AXIS,)): (1, ids_bytes),
        ("ppermute", (S_AXIS,)): (3 * (n - 1), (n - 1) * (2 * 4 * block + 4 * block)),
    }, rows
