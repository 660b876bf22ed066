"""Tensor parallelism's building blocks (dew.parallel.tensor) against one device.

Every value and gradient computed inside ``jax.shard_map(..., check_vma=False)`` on a mesh with a
``tensor`` axis is compared with the same computation on whole arrays, without any mesh (float32,
relative 1e-5). A value the same on every device of the group is returned by every device and
checked on each. Collectives are counted from the jaxpr with ``dew.collectives``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import dew
from dew.mesh import MeshSpec, build_mesh
from dew.parallel import ONE_DEVICE, Shards, tensor
from dew.parallel.options import StepOptions
from tests.helpers import relative_error

TOL = 1e-5
ROWS, SEQ, EMBED, HIDDEN, VOCAB = 2, 8, 8, 16, 32
T = tensor.AXIS
SIZES = (4, 8)


def shards_of(mesh, sequence_parallel=False) -> Shards:
    return Shards(
        axis_sizes=dict(mesh.shape), options=StepOptions(sequence_parallel=sequence_parallel)
    )


def on_mesh(mesh, fn, in_specs, out_specs):
    return jax.jit(
        jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    )


def every_device(mesh) -> P:
    """Out spec of a value each device returns with a leading axis of 1: all copies, stacked."""
    return P(tuple(mesh.axis_names))


def assert_close(actual, expected, what, seed):
    # relative_error takes max(worst, nan) == worst: a NaN must be caught here.
    for leaf in jax.tree_util.tree_leaves(actual):
        assert np.all(np.isfinite(np.asarray(leaf))), f"{what}: not finite, seed {seed}"
    error = relative_error(actual, expected)
    assert error <= TOL, f"{what}: relative error {error:.2e} above {TOL}, seed {seed}"


def assert_on_every_device(stacked, expected, what, seed):
    stacked = np.asarray(stacked)
    assert_close(list(stacked), [np.asarray(expected)] * len(stacked), what, seed)


def randn(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def boundary_ids(rng, n, shape=(ROWS, SEQ)):
    """Random ids in ``[0, VOCAB)``, among them the first and last id of every device's slice."""
    ids = rng.integers(0, VOCAB, shape).reshape(-1)
    edges = [v for i in range(n) for v in (i * VOCAB // n, (i + 1) * VOCAB // n - 1)]
    ids[: len(edges)] = edges
    rng.shuffle(ids)
    return ids.reshape(shape).astype(np.int32)


def reference_grads(fn, args, cotangent):
    """``fn(*args)`` and the gradients of ``sum(fn(*args) * cotangent)``, on one device."""
    value, vjp = jax.vjp(fn, *args)
    return value, vjp(jnp.asarray(cotangent))


# --- Each pair on its own -------------------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
def test_copy_to_region_sums_the_input_gradient(seed, n):
    """Column-parallel matmul: ``copy(x) @ A[:, local]``; each device's loss is its columns'."""
    rng = np.random.default_rng(seed)
    x, a, ct = (
        randn(rng, ROWS, SEQ, EMBED),
        randn(rng, EMBED, HIDDEN),
        randn(rng, ROWS, SEQ, HIDDEN),
    )
    mesh = build_mesh(MeshSpec(tensor=n))
    shards = shards_of(mesh)

    def body(x, a, ct):
        def loss(x, a):
            return jnp.sum(tensor.copy_to_region(x, shards) @ a * ct)

        y = tensor.copy_to_region(x, shards) @ a
        dx, da = jax.grad(loss, (0, 1))(x, a)
        return y, dx[None], da

    y, dx, da = on_mesh(
        mesh,
        body,
        (P(), P(None, T), P(None, None, T)),
        (P(None, None, T), every_device(mesh), P(None, T)),
    )(x, a, ct)
    y_ref, (dx_ref, da_ref) = reference_grads(lambda x, a: x @ a, (x, a), ct)
    assert_close(y, y_ref, "y", seed)
    assert_on_every_device(dx, dx_ref, "dx", seed)
    assert_close(da, da_ref, "dA", seed)


@pytest.mark.parametrize("n", SIZES)
def test_reduce_from_region_passes_the_output_gradient(seed, n):
    """Row-parallel matmul: ``reduce(x[..., local] @ B[local, :])``, the same on every device."""
    rng = np.random.default_rng(seed)
    x, b, ct = (
        randn(rng, ROWS, SEQ, HIDDEN),
        randn(rng, HIDDEN, EMBED),
        randn(rng, ROWS, SEQ, EMBED),
    )
    mesh = build_mesh(MeshSpec(tensor=n))
    shards = shards_of(mesh)

    def body(x, b, ct):
        def loss(x, b):
            return jnp.sum(tensor.reduce_from_region(x @ b, shards) * ct)

        y = tensor.reduce_from_region(x @ b, shards)
        dx, db = jax.grad(loss, (0, 1))(x, b)
        return y[None], dx, db

    y, dx, db = on_mesh(
        mesh,
        body,
        (P(None, None, T), P(T, None), P()),
        (every_device(mesh), P(None, None, T), P(T, None)),
    )(x, b, ct)
    y_ref, (dx_ref, db_ref) = reference_grads(lambda x, b: x @ b, (x, b), ct)
    assert_on_every_device(y, y_ref, "y", seed)
    assert_close(dx, dx_ref, "dx", seed)
    assert_close(db, db_ref, "dB", seed)


@pytest.mark.parametrize("n", SIZES)
def test_gather_from_sequence_reduce_scatters_the_gradient(seed, n):
    """``gather(x over positions) @ A[:, local]``: every device sees every position."""
    rng = np.random.default_rng(seed)
    x, a, ct = (
        randn(rng, ROWS, SEQ, EMBED),
        randn(rng, EMBED, HIDDEN),
        randn(rng, ROWS, SEQ, HIDDEN),
    )
    mesh = build_mesh(MeshSpec(tensor=n))
    shards = shards_of(mesh)

    def body(x, a, ct):
        def loss(x, a):
            return jnp.sum(tensor.gather_from_sequence(x, shards, 1) @ a * ct)

        whole = tensor.gather_from_sequence(x, shards, 1)
        dx, da = jax.grad(loss, (0, 1))(x, a)
        return whole[None], dx, da

    whole, dx, da = on_mesh(
        mesh,
        body,
        (P(None, T), P(None, T), P(None, None, T)),
        (every_device(mesh), P(None, T), P(None, T)),
    )(x, a, ct)
    _, (dx_ref, da_ref) = reference_grads(lambda x, a: x @ a, (x, a), ct)
    assert_on_every_device(whole, x, "gathered x", seed)
    assert_close(dx, dx_ref, "dx", seed)
    assert_close(da, da_ref, "dA", seed)


@pytest.mark.parametrize("n", SIZES)
def test_scatter_to_sequence_all_gathers_the_gradient(seed, n):
    """``scatter(x[..., local] @ B[local, :])``: each device keeps its positions of the sum."""
    rng = np.random.default_rng(seed)
    x, b, ct = (
        randn(rng, ROWS, SEQ, HIDDEN),
        randn(rng, HIDDEN, EMBED),
        randn(rng, ROWS, SEQ, EMBED),
    )
    mesh = build_mesh(MeshSpec(tensor=n))
    shards = shards_of(mesh)

    def body(x, b, ct):
        def loss(x, b):
            return jnp.sum(tensor.scatter_to_sequence(x @ b, shards, 1) * ct)

        y = tensor.scatter_to_sequence(x @ b, shards, 1)
        dx, db = jax.grad(loss, (0, 1))(x, b)
        return y, dx, db

    y, dx, db = on_mesh(
        mesh,
        body,
        (P(None, None, T), P(T, None), P(None, T)),
        (P(None, T), P(None, None, T), P(T, None)),
    )(x, b, ct)
    y_ref, (dx_ref, db_ref) = reference_grads(lambda x, b: x @ b, (x, b), ct)
    assert_close(y, y_ref, "y", seed)
    assert_close(dx, dx_ref, "dx", seed)
    assert_close(db, db_ref, "dB", seed)


# --- The pairs together: a Megatron MLP -----------------------------------------------------------


def reference_mlp(x, w1, w2):
    return jax.nn.silu(x @ w1) @ w2


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sequence_parallel"])
@pytest.mark.parametrize("n", SIZES)
def test_megatron_mlp_matches_one_device(seed, n, sequence_parallel):
    """``leave(silu(enter(x) @ W1[:, local]) @ W2[local, :])``; sequence parallel, x and y are split
    over positions."""
    rng = np.random.default_rng(seed)
    x, ct = randn(rng, ROWS, SEQ, EMBED), randn(rng, ROWS, SEQ, EMBED)
    w1, w2 = randn(rng, EMBED, HIDDEN), randn(rng, HIDDEN, EMBED) / 4
    mesh = build_mesh(MeshSpec(tensor=n))
    shards = shards_of(mesh, sequence_parallel)

    def mlp(x, w1, w2):
        return tensor.leave(jax.nn.silu(tensor.enter(x, shards) @ w1) @ w2, shards)

    def body(x, w1, w2, ct):
        dx, dw1, dw2 = jax.grad(lambda *a: jnp.sum(mlp(*a) * ct), (0, 1, 2))(x, w1, w2)
        y = mlp(x, w1, w2)
        if sequence_parallel:
            return y, dx, dw1, dw2
        return y[None], dx[None], dw1, dw2

    acts = P(None, T) if sequence_parallel else P()
    out = P(None, T) if sequence_parallel else every_device(mesh)
    y, dx, dw1, dw2 = on_mesh(
        mesh, body, (acts, P(None, T), P(T, None), acts), (out, out, P(None, T), P(T, None))
    )(x, w1, w2, ct)
    y_ref, (dx_ref, dw1_ref, dw2_ref) = reference_grads(reference_mlp, (x, w1, w2), ct)
    check = assert_close if sequence_parallel else assert_on_every_device
    check(y, y_ref, "y", seed)
    check(dx, dx_ref, "dx", seed)
    assert_close(dw1, dw1_ref, "dW1", seed)
    assert_close(dw2, dw2_ref, "dW2", seed)


# --- Vocabulary-parallel embedding, head and loss -------------------------------------------------


def reference_cross_entropy(logits, targets):
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - picked


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sequence_parallel"])
@pytest.mark.parametrize("n", SIZES)
def test_embed_lookup_matches_one_device(seed, n, sequence_parallel):
    rng = np.random.default_rng(seed)
    table, ids = randn(rng, VOCAB, EMBED), boundary_ids(rng, n)
    ct = randn(rng, ROWS, SEQ, EMBED)
    mesh = build_mesh(MeshSpec(tensor=n))
    shards = shards_of(mesh, sequence_parallel)

    def body(table, ids, ct):
        x = tensor.embed_lookup(table, ids, shards)
        dtable = jax.grad(lambda t: jnp.sum(tensor.embed_lookup(t, ids, shards) * ct))(table)
        return (x if sequence_parallel else x[None]), dtable

    acts = P(None, T) if sequence_parallel else P()
    out = P(None, T) if sequence_parallel else every_device(mesh)
    x, dtable = on_mesh(mesh, body, (P(T, None), P(), acts), (out, P(T, None)))(table, ids, ct)
    x_ref, (dtable_ref,) = reference_grads(lambda t: jnp.take(t, ids, axis=0), (table,), ct)
    (assert_close if sequence_parallel else assert_on_every_device)(x, x_ref, "embeddings", seed)
    assert_close(dtable, dtable_ref, "d table", seed)


def test_embed_lookup_output_dtype(seed):
    rng = np.random.default_rng(seed)
    table, ids = randn(rng, VOCAB, EMBED), boundary_ids(rng, 4)
    mesh = build_mesh(MeshSpec(tensor=4))
    shards = shards_of(mesh)
    run = on_mesh(
        mesh,
        lambda t, i: tensor.embed_lookup(t, i, shards, jnp.bfloat16)[None],
        (P(T, None), P()),
        every_device(mesh),
    )
    x = run(table, ids)
    assert x.dtype == jnp.bfloat16, f"dtype {x.dtype}, seed {seed}"
    expected = np.take(table, ids, axis=0).astype(jnp.bfloat16)
    assert np.array_equal(np.asarray(x), np.broadcast_to(expected, x.shape)), f"seed {seed}"


def reference_loss_sum(x, table, targets, weights):
    """``sum_t w_t (logsumexp(x_t table^T) - x_t . table[y_t])``, the whole logits at once."""
    return jnp.sum(weights * reference_cross_entropy(x @ table.T, targets))


# 16 tokens: chunks of 5 leave a remainder of 1, padded with a token of weight 0.
@pytest.mark.parametrize("chunk", [None, 5], ids=["whole", "chunks_of_5"])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sequence_parallel"])
@pytest.mark.parametrize("n", SIZES)
def test_head_loss_sum_matches_a_reference(seed, n, sequence_parallel, chunk):
    """The loss, the activations' gradient (summed over the slices) and each device's slice of the
    table's gradient, against the plain head and cross-entropy on every token at once."""
    rng = np.random.default_rng(seed)
    x, table, targets = randn(rng, ROWS, SEQ, EMBED), randn(rng, VOCAB, EMBED), boundary_ids(rng, n)
    weights = rng.uniform(0.0, 2.0, (ROWS, SEQ)).astype(np.float32)
    mesh = build_mesh(MeshSpec(tensor=n))
    shards = shards_of(mesh, sequence_parallel)

    def body(x, table):
        def loss(x, table):
            return tensor.head_loss_sum(x, table, targets, shards, weights, chunk=chunk)

        value, (dx, dtable) = jax.value_and_grad(loss, (0, 1))(x, table)
        return value[None], (dx if sequence_parallel else dx[None]), dtable

    acts = P(None, T) if sequence_parallel else P()
    out_x = P(None, T) if sequence_parallel else every_device(mesh)
    value, dx, dtable = on_mesh(
        mesh, body, (acts, P(T, None)), (every_device(mesh), out_x, P(T, None))
    )(x, table)
    reference = functools.partial(reference_loss_sum, targets=targets, weights=weights)
    value_ref, (dx_ref, dtable_ref) = jax.value_and_grad(reference, (0, 1))(x, table)
    assert value.dtype == jnp.float32, f"loss dtype {value.dtype}, seed {seed}"
    assert_on_every_device(value, value_ref, "loss", seed)
    (assert_close if sequence_parallel else assert_on_every_device)(dx, dx_ref, "dx", seed)
    assert_close(dtable, dtable_ref, "d table", seed)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sequence_parallel"])
@pytest.mark.parametrize("n", SIZES)
def test_tied_embedding_loss_matches_one_device(seed, n, sequence_parallel):
    """embed -> tanh -> logits through the same table -> cross-entropy: the table's gradient sums
    the lookup's and the head's, as on one device."""
    rng = np.random.default_rng(seed)
    table, ids, targets = randn(rng, VOCAB, EMBED), boundary_ids(rng, n), boundary_ids(rng, n)
    # Positive weights: the compared loss is their weighted sum, which signed weights could cancel
    # to near zero, where float32 rounding is no longer small relative to it.
    ct = rng.uniform(0.5, 1.5, (ROWS, SEQ)).astype(np.float32)
    mesh = build_mesh(MeshSpec(tensor=n))
    shards = shards_of(mesh, sequence_parallel)

    def loss_sum(table, ct):
        x = jnp.tanh(2 * tensor.embed_lookup(table, ids, shards))
        return tensor.head_loss_sum(x, table, targets, shards, ct)

    def body(table, ct):
        value, dtable = jax.value_and_grad(loss_sum)(table, ct)
        return value[None], dtable

    loss, dtable = on_mesh(mesh, body, (P(T, None), P()), (every_device(mesh), P(T, None)))(
        table, ct
    )

    def reference(table):
        x = jnp.tanh(2 * jnp.take(table, ids, axis=0))
        return jnp.sum(reference_cross_entropy(x @ table.T, targets) * ct)

    loss_ref, dtable_ref = jax.value_and_grad(reference)(table)
    assert_on_every_device(loss, loss_ref, "loss", seed)
    assert_close(dtable, dtable_ref, "d table", seed)


def test_one_device_needs_no_mesh(seed):
    """With ``ONE_DEVICE`` (no tensor axis, no shard_map) each function is the unsplit one."""
    rng = np.random.default_rng(seed)
    x = randn(rng, ROWS, SEQ, EMBED)
    for fn in (tensor.copy_to_region, tensor.reduce_from_region, tensor.enter, tensor.leave):
        assert fn(x, ONE_DEVICE) is x, f"{fn.__name__} is not the identity, seed {seed}"
    for fn in (tensor.gather_from_sequence, tensor.scatter_to_sequence):
        assert fn(x, ONE_DEVICE, 1) is x, f"{fn.__name__} is not the identity, seed {seed}"
    table, ids, targets = randn(rng, VOCAB, EMBED), boundary_ids(rng, 1), boundary_ids(rng, 1)

    def loss(table):
        h = tensor.embed_lookup(table, ids, ONE_DEVICE)
        return tensor.head_loss_sum(h, table, targets, ONE_DEVICE)

    def reference(table):
        h = jnp.take(table, ids, axis=0)
        return jnp.sum(reference_cross_entropy(h @ table.T, targets))

    assert_close(
        jax.value_and_grad(loss)(table), jax.value_and_grad(reference)(table), "loss", seed
    )


# --- Collectives ----------------------------------------------------------------------------------

IDS = np.arange(ROWS * SEQ, dtype=np.int32).reshape(ROWS, SEQ) % VOCAB

# name -> (op on a local input, local input shape, sequence parallel, forward, forward + backward)
# counts are {op: calls} over the tensor axis.
CASES = {
    "copy_to_region": (
        lambda x, s: tensor.copy_to_region(x, s),
        (ROWS, SEQ, EMBED),
        False,
        {},
        {"psum": 1},
    ),
    "reduce_from_region": (
        lambda x, s: tensor.reduce_from_region(x, s),
        (ROWS, SEQ, EMBED),
        False,
        {"psum": 1},
        {"psum": 1},
    ),
    "gather_from_sequence": (
        lambda x, s: tensor.gather_from_sequence(x, s, 1),
        (ROWS, SEQ, EMBED),
        False,
        {"all_gather": 1},
        {"all_gather": 1, "psum_scatter": 1},
    ),
    "scatter_to_sequence": (
        lambda x, s: tensor.scatter_to_sequence(x, s, 1),
        (ROWS, SEQ, EMBED),
        False,
        {"psum_scatter": 1},
        {"psum_scatter": 1, "all_gather": 1},
    ),
    "enter": (tensor.enter, (ROWS, SEQ, EMBED), False, {}, {"psum": 1}),
    "leave": (tensor.leave, (ROWS, SEQ, EMBED), False, {"psum": 1}, {"psum": 1}),
    "enter, sequence parallel": (
        tensor.enter,
        (ROWS, SEQ, EMBED),
        True,
        {"all_gather": 1},
        {"all_gather": 1, "psum_scatter": 1},
    ),
    "leave, sequence parallel": (
        tensor.leave,
        (ROWS, SEQ, EMBED),
        True,
        {"psum_scatter": 1},
        {"psum_scatter": 1, "all_gather": 1},
    ),
    "embed_lookup": (
        lambda t, s: tensor.embed_lookup(t, IDS, s),
        (VOCAB, EMBED),
        False,
        {"psum": 1},
        {"psum": 1},
    ),
    "embed_lookup, sequence parallel": (
        lambda t, s: tensor.embed_lookup(t, IDS, s),
        (VOCAB, EMBED),
        True,
        {"psum_scatter": 1},
        {"psum_scatter": 1, "all_gather": 1},
    ),
    "vocab_logits": (
        lambda t, s: tensor.vocab_logits(jnp.tanh(t[None, :SEQ]), t, s),
        (VOCAB, EMBED),
        False,
        {},
        {"psum": 1},
    ),
    # The loss's pmax and psum in the forward, which also makes the gradients; backward: only the
    # sum of the activations' gradient over the slices (entering the region).
    "head_loss_sum": (
        lambda t, s: tensor.head_loss_sum(jnp.tanh(t[None, :SEQ]), t, IDS[:1], s),
        (VOCAB, EMBED),
        False,
        {"pmax": 1, "psum": 1},
        {"pmax": 1, "psum": 2},
    ),
}


def tensor_collectives(mesh, op, shape, sequence_parallel, grad):
    """``{op: calls}`` of ``op`` (or of its forward and backward) in a shard_map over ``mesh``,
    after checking that every collective runs over the tensor axis alone."""
    shards = shards_of(mesh, sequence_parallel)

    def forward(x):
        return op(x, shards)

    def body(x):
        return jax.grad(lambda x: jnp.sum(jnp.sin(forward(x))))(x) if grad else forward(x)

    fn = jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
    report = dew.collectives(fn, jax.ShapeDtypeStruct(shape, jnp.float32))
    axes = {row.axes for row in report.rows}
    assert axes <= {(T,)}, f"collectives over {axes}, not tensor alone: {report.rows}"
    counts = {row.op: row.count for row in report.rows}
    assert sum(counts.values()) == report.count(axis=T), report.rows
    return counts


@pytest.mark.parametrize("name", CASES)
def test_collectives_forward_and_backward(name):
    op, shape, sequence_parallel, forward, both = CASES[name]
    mesh = build_mesh(MeshSpec(tensor=4))
    assert tensor_collectives(mesh, op, shape, sequence_parallel, grad=False) == forward, "forward"
    assert tensor_collectives(mesh, op, shape, sequence_parallel, grad=True) == both, "backward"


@pytest.mark.parametrize("name", CASES)
def test_tensor_size_one_runs_no_collective(name, seed):
    """On a mesh whose tensor axis has size 1, nothing is communicated, forward or backward, and
    the pairs hand back their input unchanged."""
    op, shape, sequence_parallel, _, _ = CASES[name]
    mesh = build_mesh(MeshSpec(tensor=1))
    assert dict(mesh.shape)[T] == 1
    for grad in (False, True):
        counts = tensor_collectives(mesh, op, shape, sequence_parallel, grad)
        assert counts == {}, f"{name}, grad={grad}: {counts}"
    x = randn(np.random.default_rng(seed), *shape)
    shards = shards_of(mesh, sequence_parallel)
    run = on_mesh(mesh, lambda x: op(x, shards)[None], P(), every_device(mesh))
    if name in ("embed_lookup", "embed_lookup, sequence parallel"):
        expected = np.take(x, IDS, axis=0)
    elif name == "vocab_logits":
        expected = np.einsum("bse,ve->bsv", np.tanh(x[None, :SEQ]), x)
    elif name == "head_loss_sum":
        expected = np.sum(reference_cross_entropy(np.tanh(x[None, :SEQ]) @ x.T, IDS[:1]))
    else:
        out = np.asarray(run(x))
        assert np.array_equal(out, np.broadcast_to(x, out.shape)), f"{name} changed x, seed {seed}"
        return
    assert_on_every_device(run(x), expected, name, seed)


# --- Bad input ------------------------------------------------------------------------------------


def test_bad_shapes_are_refused_before_compiling():
    mesh = build_mesh(MeshSpec(tensor=4))
    shards = shards_of(mesh)

    def traced(fn, *shapes):
        body = jax.shard_map(fn, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
        return jax.make_jaxpr(body)(*(jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes))

    with pytest.raises(
        ValueError, match=r"dimension 1 of shape \(2, 6, 8\) \(6\) does not split over tensor 4"
    ):
        traced(lambda x: tensor.scatter_to_sequence(x, shards, 1), (2, 6, 8))
    with pytest.raises(
        ValueError, match=r"dim 3 is out of range for an array of shape \(2, 8, 8\)"
    ):
        traced(lambda x: tensor.gather_from_sequence(x, shards, 3), (2, 8, 8))
    with pytest.raises(ValueError, match=r"targets \(2, 8\) must be x \(2, 7, 8\) less its last"):
        traced(lambda x: tensor.head_loss_sum(x, x[0], IDS, shards), (2, 7, 8))
    with pytest.raises(ValueError, match=r"table_local must be \[vocab / n, embed\], got \(32,\)"):
        traced(lambda t: tensor.embed_lookup(t, IDS, shards), (32,))


def test_check_layout_reads_each_dimension_and_its_size():
    """``check_layout`` on a hand-written tree: the split dimensions right, one left whole, one
    split that must not be; a ``kv_heads`` dimension smaller than the tensor size stays whole."""

    def shaped(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.float32)

    axes = {"q": ("embed", "heads", "head_dim"), "k": ("embed", "kv_heads", "head_dim")}
    shapes = {"q": shaped(32, 8, 4), "k": shaped(32, 2, 4)}
    tensor.check_layout({"q": P(None, T), "k": P()}, axes, shapes, 4)
    # At 2 the two kv heads split, and must.
    tensor.check_layout({"q": P(None, T), "k": P(None, T)}, axes, shapes, 2)
    with pytest.raises(ValueError, match=r"weight k .* leaves its 'kv_heads' dimension whole"):
        tensor.check_layout({"q": P(None, T), "k": P()}, axes, shapes, 2)
    with pytest.raises(ValueError, match=r"weight k .* splits its 'kv_heads' dimension over"):
        tensor.check_layout({"q": P(None, T), "k": P(None, T)}, axes, shapes, 4)
    with pytest.raises(ValueError, match=r"weight q .* splits its 'embed' dimension over"):
        tensor.check_layout({"q": P(T), "k": P()}, axes, shapes, 4)
    # Nothing is checked on a tensor axis of size 1.
    tensor.check_layout({"q": P(), "k": P(T)}, axes, shapes, 1)
