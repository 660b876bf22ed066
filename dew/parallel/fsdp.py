"""Fully sharded data parallelism: each device holds 1/n of every large weight.

Forward: ``all_gather`` a layer's weight shards over ``fsdp`` just before the layer runs, inside the
layer scan, so only one layer's weights are whole at a time. A layer's small split weights of one
dtype travel together in one ``all_gather`` (a bucket: their local shards flattened and
concatenated), up to ``BUCKET_BYTES`` of whole weights; a larger weight travels alone.
Backward: the gather's written transpose (``_gather_summed``, a ``custom_vjp``) is one
``psum_scatter`` over ``fsdp``, which sums the layer's gradients over the fsdp group's slices of the
batch and leaves each device the gradient of its own shards; then, for the layer loop's weights, a
``psum`` of that shard over ``data`` (``loop_sum_axes``), so every gradient of the loop is summed
inside the loop, layer by layer, as the backward produces it, and never held whole. The step engine
runs each layer under ``jax.checkpoint``, so the backward gathers again rather than keeping gathered
weights alive.

On a TPU slice whose torus has three dimensions above 1 (v4, v5p from ``2x2x2`` on), the TPU
compiler rewrites a reduce-scatter whose one replica group is every device of the slice into an
all-reduce of the whole operand and a slice (its ``reduce-scatter-decomposer`` pass): twice the
bytes, and the whole float32 gradient as a temporary. A reduce-scatter over a smaller group, of
one, two or three torus dimensions, stays one, but for the shapes below. When fsdp is every
device of such a slice, the step's ``Shards.fsdp_scatter_stages`` (``scatter_stages``) names two
group sizes ``p x q = n`` and the sum runs as two ``psum_scatter`` s over fsdp with
``axis_index_groups``: over the ``p`` devices ``q`` apart, then over the ``q`` consecutive ones.
Device ``i = a q + b`` keeps block ``a`` of ``p``, then block ``b`` of ``q`` of that: block ``i``,
as the single reduce-scatter gives; the bytes are ``(p - 1) / p W + (q - 1) / q W / p = (n - 1) /
n W``, the single ring's. ``p`` is the larger
(``(4, 2)`` on 8 chips): the first stage's output, ``W / p``, is the one temporary the split adds.

On such a slice the TPU compiler also makes no ``all_gather`` asynchronous: each is a synchronous
collective (``3DAllGatherOnMajorDim``) with nothing beside it, over the whole torus or over
groups of it alike, where on a 2-D slice it chains the gathers into the matmuls that use them.
Its ``collective-permute`` s are asynchronous start/done pairs it schedules beside compute. So
``StepOptions(fsdp_scheme="ring")`` (``Shards.fsdp_ring``) runs the gather as a ring of ``n - 1``
``ppermute`` s (``ring_gather``) and its transpose as the ring reduce-scatter (``ring_scatter``),
in place of the all-gather and the staged reduce-scatters: the same bytes, ``(n - 1) / n W``
each, most of them beside the layers' matmuls there. A layer's matrices go further
(``gather(..., in_matmuls=...)``): they reach their einsums still split, and each gradient is
summed round the ring block by block as the weight-gradient matmul computes it
(``dew.parallel.fsdp_matmul``), so no device holds a whole weight gradient. On v5p they need
fewer temporaries than the gathers and leave a fraction of the bytes exposed
(docs/results/slices.md);
they are a choice, not the default: they have not run on a TPU, the gathers of a 2-D slice already
run beside compute, and a ring is written out, ``n - 1`` ``ppermute`` s a weight.

The compiler also compiles a reduce-scatter as an all-reduce (an ``all-reduce-scatter`` of the
operand padded by a few rows) when a device's piece is not whole (8, 128) tiles (a piece narrower
than 128 lanes along the minor dimension, or a bucket's single row), and, measured on Llama
matrices, often when a matrix is scattered by rows: ``[2048, 8192]`` over 4 chips of v5e, over 2
of v5p the rows of ``[512..2048, 14336]``. Scattered by columns, the same matrices stay
reduce-scatters. So on TPU (``Shards.fsdp_tpu_layout``) a matrix's gradient is scattered along
its minor dimension when a device's piece there is whole 128-lane columns (a matrix split by rows:
by columns of its transpose, which the compiler writes straight from the weight-gradient matmul),
along its leading dimension when its split is the minor one in pieces narrower than a tile
(``scatter_along``), and on any platform a bucket's is laid out in rows of whole tiles
(``_bucket_rows``: a reshape, no copy).

Bytes per bucket of ``W`` bytes (the whole weights it carries) on ``n`` devices, per device and per
gather: it receives and sends ``(n - 1) / n * W`` (ring all-gather); the reduce-scatter of its
gradients moves the same. Bucketing changes the number of collectives, not their bytes. The sum over
``data`` of a shard of ``W / n`` bytes over ``d`` devices moves ``2 (d - 1) / d * W / n`` (ring
all-reduce), per layer, as the single sum after the loop did for all of them.

The gradient sums run in the weights' dtype (float32 weights: float32 sums, which add no rounding
to each device's gradient), so their ``W`` is that of float32 gradients while the gathers move the
weights in the activations' dtype once compiled (the compiler moves the cast ahead of the gather).
``StepOptions(gradient_sum_dtype="bfloat16")`` casts each gradient to bfloat16 before its sums and
back after: half the sums' bytes, and of the whole gradient each device holds before the scatter.

Under ``StepOptions(quantize="int8")`` the int8 projections' weights (``gather(..., int8=...)``)
travel as int8 with their whole weights' scales and arrive dequantized to exactly the integers
and scales their matmuls then take (``dew.parallel.fsdp_int8``): one byte an entry, where the
gradient sums stay in float (``_gather_int8``'s backward is ``_gather_summed``'s).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from dew.layout import path_names
from dew.parallel import fsdp_int8
from dew.parallel.fsdp_matmul import RingSplit
from dew.parallel.ring import AXIS, ring_gather, ring_scatter

DATA = "data"

# Split weights of one dtype are packed into one all_gather until the whole weights it carries would
# pass this many bytes; a larger weight travels alone. Each collective is a barrier across the
# devices, so at small sizes fewer of them make a faster step; but a bucket's weights are copied out
# of the gathered buffer, so it costs its bytes again in temporary memory, which is what large
# weights cannot afford. Measured: docs/results/cpu-layouts.md, "How finely fsdp gathers".
BUCKET_BYTES = 4 * 2**20


def split_dim(spec: P) -> int | None:
    """The dimension a weight of this spec is split on over fsdp, or ``None`` if it is not."""
    for dim, entry in enumerate(tuple(spec)):
        if AXIS in (entry if isinstance(entry, tuple) else (entry,)):
            return dim
    return None


def is_split(spec: P) -> bool:
    """Whether a weight of this spec is split over fsdp (so its gradient arrives
    reduce-scattered)."""
    return split_dim(spec) is not None


def buckets(sizes: Sequence[int], limit: int) -> list[list[int]]:
    """Indices of weights whose gathered sizes (bytes) are ``sizes``, packed in order into buckets
    of at most ``limit`` bytes; a weight above ``limit`` is a bucket of its own."""
    packed: list[list[int]] = []
    total = limit + 1
    for i, size in enumerate(sizes):
        if total + size > limit:
            packed.append([])
            total = 0
        packed[-1].append(i)
        total += size
    return packed


def loop_sum_axes(shards, accumulation: int) -> tuple[str, ...]:
    """The axes, beyond ``fsdp``, the transposes of the layer loop's gathers sum its split
    weights' gradients over (``Shards.loop_sums``): ``("data",)`` when ``data`` and ``fsdp`` are
    above 1 and each layer runs once a step; else ``()``, and ``data`` stays in the step's tail.

    A layer that runs several times a step (``accumulation`` microbatches, or the microbatches of
    a pipeline over ``stage``) would sum over data once per run: its gradients are summed once,
    after the runs, as before."""
    if shards.size(DATA) == 1 or shards.size(AXIS) == 1:
        return ()
    if accumulation > 1 or shards.size("stage") > 1:
        return ()
    return (DATA,)


def fills_3d_torus(mesh) -> bool:
    """Whether the fsdp axis is every device of ``mesh``, at least 4, and they are TPU chips whose
    ``coords`` vary along three dimensions (v4, v5p from ``2x2x2`` on)."""
    devices = list(mesh.devices.flat)
    n = dict(mesh.shape).get(AXIS, 1)
    if n != len(devices) or n < 4:
        return False
    coords = [getattr(d, "coords", None) for d in devices]
    if any(c is None or len(c) < 3 for c in coords):
        return False
    return sum(len({c[k] for c in coords}) > 1 for k in range(3)) == 3


# The most devices an fsdp ring runs over (``StepOptions(fsdp_scheme="ring")``). A ring is n - 1
# ppermutes a gather, written out, so the step's HLO grows with n: Llama-3.1-8B compiled in 30 s at
# fsdp 8 and 47 s at 32, where the collectives took 19 and 39 s; Llama-3.1-70B at fsdp 128 had not
# compiled after 7.5 minutes and 13.6 GB of host memory (21 s with collectives).
RING_MAX = 32


def scatter_stages(mesh) -> tuple[int, ...]:
    """The group sizes the fsdp gradient sum runs in (``Shards.fsdp_scatter_stages``), outermost
    first; ``()`` for one ``psum_scatter`` over the whole axis.

    Two stages only where one reduce-scatter would not stay one (the module docstring): the fsdp
    axis is every device of ``mesh``, and they are TPU chips whose ``coords`` vary along three
    dimensions. The first stage runs over the most devices it can, ``p = n / s`` with ``s`` the
    smallest factor of ``n`` above 1, the second over the ``s`` left: ``(4, 2)`` for 8 devices.
    The bytes are those of one reduce-scatter whatever the split; the first stage's output, ``1 /
    p`` of the whole float32 gradient, is a temporary the single reduce-scatter does not have, so
    it is kept smallest (docs/planning.md has the measurements)."""
    if not fills_3d_torus(mesh):
        return ()
    n = mesh.shape[AXIS]
    smallest = min(f for f in range(2, n + 1) if n % f == 0)
    if smallest == n:  # a prime number of devices: no split
        return ()
    return (n // smallest, smallest)


def on_tpu(mesh) -> bool:
    """Whether ``mesh``'s devices are TPU chips (``Shards.fsdp_tpu_layout``)."""
    return all(d.platform == "tpu" for d in mesh.devices.flat)


def _staged_groups(n: int, stages: Sequence[int]) -> list[list[list[int]]]:
    """``axis_index_groups`` of each stage: index ``i`` written in the mixed radix ``stages``
    (outermost digit first); stage ``k``'s groups hold the indices that differ in digit ``k``
    alone."""
    out = []
    for k, size in enumerate(stages):
        stride = math.prod(stages[k + 1 :])
        starts = [i for i in range(n) if (i // stride) % size == 0]
        out.append([[s + stride * a for a in range(size)] for s in starts])
    return out


def scatter_sum(x: jax.Array, dim: int, stages: Sequence[int] = ()) -> jax.Array:
    """``psum_scatter(x, "fsdp", scatter_dimension=dim, tiled=True)``: ``x`` summed over fsdp,
    device ``i`` keeping block ``i`` of ``n`` along ``dim``; run as one reduce-scatter per entry
    of ``stages`` when it is given (``scatter_stages``), with the same result."""
    if not stages:
        return lax.psum_scatter(x, AXIS, scatter_dimension=dim, tiled=True)
    n = math.prod(stages)
    for groups in _staged_groups(n, stages):
        # Device i = a q + b keeps block a of p here, block b of q of that at the next stage.
        x = lax.psum_scatter(x, AXIS, scatter_dimension=dim, tiled=True, axis_index_groups=groups)
    return x


def _bucket_rows(m: int) -> int:
    """Rows a device's ``m`` elements of a bucket gradient are laid out in for its
    reduce-scatter: 32, when they make rows of whole 128-lane tiles, else 1."""
    return 32 if m % (32 * 128) == 0 else 1


# A TPU vector register's lanes: the minor dimension of a (8, 128) tile.
LANES = 128


def scatter_along(local_shape: Sequence[int], dim: int) -> int:
    """The dimension the gradient of a weight split along ``dim`` (``local_shape``: a device's
    shard) is reduce-scattered along, the TPU compiler keeping it a reduce-scatter (the module
    docstring): the minor one, when a device's piece there is whole 128-lane columns (a matrix
    split by rows is scattered by columns of its transpose); else the leading one, when ``dim`` is
    the minor one (pieces narrower than a tile: whole rows instead); else ``dim``. On TPU only
    (``Shards.fsdp_tpu_layout``): elsewhere a transposed layout would be a copy of the gradient
    for nothing."""
    last = len(local_shape) - 1
    whole_lanes = local_shape[dim] % LANES == 0
    if len(local_shape) == 2 and whole_lanes:
        return last
    if dim == last and not whole_lanes:
        return 0
    return dim


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5, 6, 7))
def _gather_summed(
    x, dim: int, tiled: bool, stages: tuple, also_sum: tuple, along: int, ring: int, sum_dtype
):
    """``all_gather(x, "fsdp", axis=dim, tiled=tiled)``, whose backward is the fsdp gradient sum
    written out: ``scatter_sum`` (in ``stages``, along dimension ``along``: ``scatter_along``),
    then a ``psum`` over ``also_sum``. ``ring``, when not 0, is the fsdp size, and both run as
    rings of ``ppermute`` s instead (``ring_gather``, ``ring_scatter``). ``sum_dtype``, when not
    ``None``, is the dtype both sums run in (``StepOptions.gradient_sum_dtype``): the gradient is
    cast to it before them and back to its own after."""
    if ring:  # A bucket's [m] is gathered as [1, m] pieces: [n, m].
        return ring_gather(x if tiled else x[None], dim, ring)
    return lax.all_gather(x, AXIS, axis=dim, tiled=tiled)


def _gather_summed_fwd(x, dim, tiled, stages, also_sum, along, ring, sum_dtype):
    return _gather_summed(x, dim, tiled, stages, also_sum, along, ring, sum_dtype), None


def _scatter(x, dim, stages, ring):
    return ring_scatter(x, dim, ring) if ring else scatter_sum(x, dim, stages)


def _gather_summed_bwd(dim, tiled, stages, also_sum, along, ring, sum_dtype, _, cotangent):
    own_dtype = cotangent.dtype
    if sum_dtype is not None:
        # Cast before the sums: their bytes, and the whole gradient they start from, are this
        # dtype's (a bfloat16 weight-gradient matmul's output cast to float32 and back is no
        # copy once compiled).
        cotangent = cotangent.astype(jnp.dtype(sum_dtype))
    if tiled:
        # The gradient laid out with the split dimension at ``along``: the compiler writes the
        # weight-gradient matmul's output in that layout, a transpose without a copy where the
        # gradient comes straight from a matmul (docs/planning.md).
        moved = jnp.moveaxis(cotangent, dim, along)
        grad = jnp.moveaxis(_scatter(moved, along, stages, ring), along, dim)
    else:  # A bucket, [n, m] (dim 0): device i keeps row i.
        n, m = cotangent.shape
        rows = _bucket_rows(m)
        # The same sum over [n rows, m / rows] blocks: the TPU compiler keeps a reduce-scatter
        # whose pieces are whole (8, 128) tiles, 32 rows of them here, and compiles one of
        # single-row pieces as an all-reduce and a slice (docs/planning.md).
        pieces = cotangent.reshape(n * rows, m // rows)
        grad = _scatter(pieces, 0, stages, ring).reshape(m)
    if also_sum:
        # The fsdp shard, 1/n of the gradient, summed over the other devices that hold it.
        grad = lax.psum(grad, also_sum)
    return (grad.astype(own_dtype),)


_gather_summed.defvjp(_gather_summed_fwd, _gather_summed_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5, 6, 7, 8, 9))
def _gather_int8(
    x, members: tuple, n: int, dim: int, tiled, stages, also_sum, along: int, ring, sum_dtype
):
    """``_gather_summed``'s result and backward, the forward moving int8 (``fsdp_int8``): ``x``
    is one weight's block (``tiled``: the whole weight back, its blocks along ``dim``) or a
    bucket's blocks flattened and concatenated (``[n, elements]`` back, device-major), each
    block of ``members`` quantized with its whole weight's scales, gathered as int8 and
    dequantized to ``x``'s dtype (which ``dew.nn.quantized`` quantizes back to the same integers
    and scales). The backward is the float gradient sum, unchanged: the straight-through
    estimator, as ``int8_einsum``'s own gradient is. ``n``: the fsdp size."""
    blocks, start = [], 0
    for m in members:
        blocks.append(x[start : start + m.size].reshape(m.shape) if not tiled else x)
        start += m.size
    out = fsdp_int8.gathered(blocks, members, n, bool(ring), x.dtype)
    if tiled:
        return fsdp_int8.whole(out[0], dim)
    return jnp.concatenate([o.reshape(n, -1) for o in out], axis=1)


def _gather_int8_fwd(x, members, n, dim, tiled, stages, also_sum, along, ring, sum_dtype):
    return _gather_int8(x, members, n, dim, tiled, stages, also_sum, along, ring, sum_dtype), None


def _gather_int8_bwd(members, n, dim, tiled, stages, also_sum, along, ring, sum_dtype, _, grad):
    return _gather_summed_bwd(dim, tiled, stages, also_sum, along, ring, sum_dtype, None, grad)


_gather_int8.defvjp(_gather_int8_fwd, _gather_int8_bwd)


def gather(
    tree: Any,
    specs: Any,
    shards,
    also_sum: tuple[str, ...] = (),
    in_matmuls: tuple[str, ...] = (),
    int8: Mapping[tuple[str, ...], tuple[int, ...]] | None = None,
) -> Any:
    """Undo the fsdp split of every leaf of ``tree`` whose spec names ``fsdp``.

    The split leaves of one dtype travel in as few ``all_gather`` s as fit ``BUCKET_BYTES`` of whole
    weights each (``buckets``); the other leaves pass through.

    Args:
      tree: local weight shards.
      specs: ``PartitionSpec`` tree matching ``tree`` (the layout of the full weights), or ``None``.
      shards: the step's ``Shards``; on an fsdp axis of size 1 nothing is gathered. Its
        ``fsdp_scatter_stages`` and ``fsdp_tpu_layout`` shape the gradient sum (``scatter_sum``,
        ``scatter_along``); with ``fsdp_ring`` the gathers and sums are rings of ``ppermute`` s
        (``ring_gather``, ``ring_scatter``).
      also_sum: axes the backward sums each split leaf's gradient over after the fsdp
        reduce-scatter (``Shards.loop_sums`` for the layer loop's weights).
      in_matmuls: keys of ``tree`` (a dict) whose leaves are used only as the weight of an
        einsum (``dew.nn.param.project``). With ``fsdp_ring``, each of their split leaves that
        travels alone stays split, a ``fsdp_matmul.RingSplit``, whose einsum sums its gradient
        as the weight-gradient matmul computes it (``dew.parallel.fsdp_matmul``).
      int8: ``None``, or the weights of int8 projections (``StepOptions(quantize="int8")``):
        their paths in ``tree`` (key names) -> the dimensions their einsums sum over
        (``fsdp_int8.LAYER_PROJECTIONS``). Each of those split over fsdp travels as int8 with its
        whole weight's scales (``fsdp_int8``; in buckets of their own) and
        arrives dequantized to its dtype, to exactly the integers and scales ``int8_einsum``
        takes of the whole weight; its gradient is summed as any other's. Never a ``RingSplit``.

    Returns:
      ``tree`` with each split leaf whole along its split dimension (``n`` times its local size
      there, device ``i``'s shard at block ``i``), as a tiled ``all_gather`` of that leaf would
      give; under ``fsdp_ring`` the leaves ``in_matmuls`` names that travel alone are
      ``RingSplit`` s instead, whose einsums see that whole weight.
    """
    if specs is None or shards.size(AXIS) == 1:
        return tree
    n = shards.size(AXIS)
    stages = tuple(shards.fsdp_scatter_stages)
    ring = n if shards.fsdp_ring else 0
    sum_dtype = shards.options.gradient_sum_dtype
    also_sum = tuple(also_sum)
    paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = [leaf for _, leaf in paths]
    spec_leaves = treedef.flatten_up_to(specs)
    dims = [split_dim(spec) for spec in spec_leaves]
    # The int8 projections' weights split over fsdp: how each travels (fsdp_int8.Member).
    int8_members: dict[int, fsdp_int8.Member] = {}
    for i, (path, leaf) in enumerate(paths):
        summed = (int8 or {}).get(path_names(path))
        if summed is not None and dims[i] is not None:
            int8_members[i] = fsdp_int8.member(
                leaf.shape, dims[i], summed, spec_leaves[i], shards.axis_sizes
            )
    # Leaves an einsum takes still split (their first key in ``in_matmuls``), under the rings.
    kept_split = [
        bool(ring) and getattr(p[0], "key", None) in in_matmuls and i not in int8_members
        for i, (p, _) in enumerate(paths)
    ]
    # Split leaves by what travels: a dtype, or int8 from a dtype (an int8 bucket dequantizes to
    # one dtype).
    by_dtype: dict[Any, list[int]] = {}
    for i, (leaf, dim) in enumerate(zip(leaves, dims)):
        if dim is not None:
            by_dtype.setdefault((jnp.dtype(leaf.dtype), i in int8_members), []).append(i)

    out = list(leaves)
    for (_, as_int8), idx in by_dtype.items():
        # An int8 bucket by its weights' float bytes too: what is copied out of it is the
        # dequantized weights (GPT-2 small's 2 first layers compiled for v5e-8 at fsdp=8: 303 MiB
        # of heap bucketed by their int8 bytes, 282 MiB each alone, 281 MiB gathered in float).
        whole_bytes = [n * leaves[i].size * leaves[i].dtype.itemsize for i in idx]
        for bucket in buckets(whole_bytes, BUCKET_BYTES):
            members = [idx[b] for b in bucket]
            if len(members) == 1 and kept_split[members[0]]:
                (i,) = members
                out[i] = RingSplit(leaves[i], dims[i], n, also_sum, sum_dtype)
                continue
            plan = tuple(int8_members[i] for i in members) if as_int8 else None

            def summed(x, dim, tiled, along, plan=plan):
                """The gather with its gradient sum; an int8 bucket's forward moves int8."""
                if plan is None:
                    return _gather_summed(x, dim, tiled, stages, also_sum, along, ring, sum_dtype)
                return _gather_int8(
                    x, plan, n, dim, tiled, stages, also_sum, along, ring, sum_dtype
                )

            if len(members) == 1:
                (i,) = members
                # (n-1)/n of the whole weight in, as much out; no copy: it lands in place.
                along = dims[i]
                if shards.fsdp_tpu_layout:
                    along = scatter_along(leaves[i].shape, dims[i])
                out[i] = summed(leaves[i], dims[i], True, along)
                continue
            flat = jnp.concatenate([leaves[i].reshape(-1) for i in members])
            # One ring all-gather for the bucket: each device sends and receives (n-1)/n of its
            # whole weights, as one gather per weight would, in one barrier instead of several.
            # Its transpose is one psum_scatter of their gradients, moving as much.
            # [n, local elements of the bucket], device-major.
            gathered = summed(flat, 0, False, 0)
            _unpack(gathered, members, leaves, dims, n, out)
    return jax.tree_util.tree_unflatten(treedef, out)


def _unpack(gathered, members, leaves, dims, n, out) -> None:
    """Each of a bucket's ``members`` (indices of ``leaves``) whole, into ``out``, from the
    bucket's gathered ``[n, local elements]`` (device-major)."""
    start = 0
    for i in members:
        local, dim = leaves[i].shape, dims[i]
        columns = gathered[:, start : start + leaves[i].size].reshape(n, *local)
        start += leaves[i].size
        # [n, ..., local[dim], ...] -> [..., n, local[dim], ...] -> [..., n * local[dim], ...]
        out[i] = fsdp_int8.whole(columns, dim)
