"""Every gradient sum the step asks as a reduce-scatter stays one in the TPU compiler's HLO.

On a 3-D torus (v5p:2x2x2) the TPU compiler compiles a reduce-scatter whose one group is every
device of the slice as an all-reduce of the whole operand and a slice, and one whose pieces are
not whole (8, 128) tiles likewise (``dew.parallel.fsdp``). The smallest model where both show: 2
layers of width 512, vocabulary 256, fsdp=8, 16 rows of 32 tokens; one compile, about 6 s here.
Matrices scattered by rows are also compiled as all-reduces on smaller groups of a 2-D slice
(``fsdp.scatter_along``): width 1024 at data=2,fsdp=4 on v5e:2x4, about 10 s.
The staged sum is also checked on CPU against the single ``psum_scatter`` it replaces.
Where fsdp fills a 3-D torus the step runs its gathers and their sums as rings of ``ppermute`` s
instead, which the TPU compiler overlaps with the matmuls (same tiny model on v5p:2x2x2, two
compiles); on CPU the rings are checked against ``all_gather`` and ``psum_scatter`` and a ring
step's gradients against one device's.
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import dew
from dew.collectives import collectives, hlo_collectives
from dew.parallel import Shards, fsdp
from dew.parallel.options import StepOptions
from tests.helpers import (
    one_device_and_mesh_gradients,
    tpu_width_step,
    width_batch,
    width_objective,
)

pytestmark = pytest.mark.xdist_group("tpu")


def assert_every_reduce_scatter_stays_one(trainer, compiled, rows, weight_bytes):
    """Every psum_scatter of ``trainer``'s step (each loop iteration counted) is a reduce-scatter
    of its TPU HLO ``compiled``, with the bytes the jaxpr's give, and no all-reduce is of a
    weight's size."""
    from_hlo = hlo_collectives(compiled, trainer.mesh)
    from_jaxpr = collectives(trainer.train_step(rows), *trainer.step_arguments(rows))
    assert not any(r.approximate for r in from_hlo.rows), from_hlo
    # An all-reduce standing in for a reduce-scatter would lower the count.
    asked = from_jaxpr.count("psum_scatter")
    print(f"psum_scatter: {asked} in the jaxpr, {from_hlo.count('psum_scatter')} in the TPU HLO")
    assert asked >= 2 * 2  # both layers, at least two weights
    assert from_hlo.count("psum_scatter") == asked
    # The only all-reduces over fsdp (or groups of it) are the jaxpr's own psums (the loss, the
    # whole weights' gradients), which XLA may combine: none of a gradient the size of a weight.
    # (The shards' sums over data are psums of the jaxpr, combined a layer at a time.)
    for row in from_hlo.rows:
        if row.op == "psum" and row.axes != ("data",):
            assert row.operand_bytes < weight_bytes, row
    assert not re.search(r"all-reduce(-start)?\([^)]*reduce_scatter", compiled.as_text())
    # Bytes: each reduce-scatter moves (p - 1) / p of its operand; two stages of one gradient of
    # W bytes move (n - 1) / n W, the single ring's. Read from the jaxpr by the formula, the
    # HLO's rows must agree.
    scatter = [r for r in from_jaxpr.rows if r.op == "psum_scatter"]
    hlo_scatter = [r for r in from_hlo.rows if r.op == "psum_scatter"]
    assert sum(r.wire_bytes for r in hlo_scatter) == pytest.approx(
        sum(r.wire_bytes for r in scatter), rel=1e-6
    )
    return from_jaxpr, from_hlo


def tpu_step(slice_, width, mesh, fsdp_scheme="gather"):
    """``(trainer, compiled)``, compiled once per worker (``tests.helpers.tpu_width_step``)."""
    pytest.importorskip("libtpu")
    return tpu_width_step(slice_, width, tuple(mesh.items()), fsdp_scheme)


def test_no_gradient_reduce_scatter_becomes_an_all_reduce_on_a_3d_torus():
    # Width 512: a device's shard of a matrix is 64 rows, and of the MLP's down matrix 64
    # columns, scattered by rows (narrower than a 128-lane tile).
    trainer, compiled = tpu_step("v5p:2x2x2", 512, dict(fsdp=8))
    # fsdp fills the cube: its sum runs over the 4 devices 2 apart, then 2 consecutive ones
    # (rings, a choice, replace both: test_fsdp_rings_on_a_3d_torus_...).
    assert trainer.shards.fsdp_scatter_stages == (4, 2) and not trainer.shards.fsdp_ring
    from_jaxpr, _ = assert_every_reduce_scatter_stays_one(trainer, compiled, 16, 512 * 512 * 4)
    assert from_jaxpr.count("psum_scatter") >= 2 * 2 * 2  # two stages


def test_matrices_scattered_by_columns_stay_reduce_scatters_beside_data():
    # v5e:2x4, data=2,fsdp=4, width 1024: a device's shard of a [1024, 4096] matrix is 256 rows,
    # which the TPU compiler all-reduces when scattered by rows and keeps when by columns
    # (scatter_along). The layer loop also sums each shard over data.
    trainer, compiled = tpu_step("v5e:2x4", 1024, dict(data=2, fsdp=4))
    assert trainer.shards.fsdp_scatter_stages == () and trainer.shards.fsdp_tpu_layout
    _, from_hlo = assert_every_reduce_scatter_stays_one(trainer, compiled, 16, 1024 * 1024 * 4)
    # The shards' sums over data run in the layer loop: an all-reduce a layer (XLA combines a
    # layer's), and the embedding's after it; summed after the loop, XLA combines them into one.
    (over_data,) = [r for r in from_hlo.rows if r.op == "psum" and r.axes == ("data",)]
    assert over_data.count >= 2 + 1, over_data


@pytest.fixture(scope="module")
def cpu_mesh():
    return Mesh(np.array(jax.devices()[:8]), ("fsdp",))


@pytest.mark.parametrize("stages", [(2, 4), (4, 2), (2, 2, 2)])
@pytest.mark.parametrize("dim", [0, 1])
def test_a_staged_sum_is_the_single_reduce_scatter(cpu_mesh, stages, dim, seed):
    x = jax.random.normal(jax.random.key(seed), (8, 16, 24))

    def both(local):
        return (
            jax.lax.psum_scatter(local, "fsdp", scatter_dimension=dim, tiled=True),
            fsdp.scatter_sum(local, dim, stages),
        )

    spec = P(*([None] * dim), "fsdp")
    flat, staged = jax.jit(
        jax.shard_map(both, mesh=cpu_mesh, in_specs=P(), out_specs=(spec, spec), check_vma=False)
    )(x)
    np.testing.assert_allclose(np.asarray(staged), np.asarray(flat), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("ring", [False, True], ids=["staged", "ring"])
@pytest.mark.parametrize("mesh", [dict(fsdp=8), dict(data=2, fsdp=4)], ids=["fsdp8", "data2_fsdp4"])
def test_a_staged_fsdp_step_has_the_one_device_gradients(mesh, ring, seed):
    # The stages, or the rings, a 3-D torus gets, forced on 8 CPU devices (with data=2, the layer
    # loop's gathers also sum over data): the same gradients as one device.
    trainer = dew.Trainer(
        width_objective(64, dtype="float32"),
        optax.sgd(0.0),
        jax.random.key(0),
        mesh=dew.MeshSpec(**mesh),
        layout=dew.Layout(min_shard=1024),
    )
    if ring:
        trainer.shards = dataclasses.replace(trainer.shards, fsdp_ring=True)
    else:
        stages = (2, mesh["fsdp"] // 2)
        trainer.shards = dataclasses.replace(trainer.shards, fsdp_scatter_stages=stages)
    batch = width_batch(seed)
    for path, a, b in one_device_and_mesh_gradients(trainer, batch):
        scale = np.abs(a).max() + 1e-30
        assert np.abs(a - b).max() / scale < 1e-5, (path, seed)


def test_each_gradient_is_scattered_along_the_dimension_the_tpu_compiler_keeps():
    # A device's pieces are whole 128-lane columns: a matrix by columns (its transpose's when it
    # is split by rows); a minor split narrower than a tile: by rows; anything else in place.
    assert fsdp.scatter_along((128, 24), 0) == 1
    assert fsdp.scatter_along((512, 14336), 0) == 1
    assert fsdp.scatter_along((14336, 512), 1) == 1
    assert fsdp.scatter_along((2048, 64), 1) == 0
    assert fsdp.scatter_along((64, 2048), 0) == 0
    assert fsdp.scatter_along((512, 32, 128), 0) == 0
    assert fsdp.scatter_along((32, 128, 16), 2) == 0


@pytest.mark.parametrize("stages", [(), (4, 2)], ids=["one", "staged"])
def test_gradients_scattered_along_another_dimension_are_each_devices_own(
    cpu_mesh, stages, monkeypatch
):
    # Each layout of scatter_along, on 8 CPU devices: every device gets the gradient of its own
    # shard, summed over the 8 (each adds its own copy of the weight's gradient). Each weight
    # travels alone, as a large one does (a bucket is scattered by its rows).
    monkeypatch.setattr(fsdp, "BUCKET_BYTES", 0)
    rng = np.random.default_rng(0)
    layout = {  # name: (whole shape, spec); the local shard in the comment, its scatter_along
        "rows": ((8 * 128, 24), P("fsdp")),  # [128, 24]: by columns of the transpose
        "columns": ((16, 8 * 128), P(None, "fsdp")),  # [16, 128]: in place
        "narrow": ((24, 8 * 16), P(None, "fsdp")),  # [24, 16]: by rows
        "cube": ((8 * 4, 3, 5), P("fsdp")),  # in place
    }
    full = {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, (s, _) in layout.items()}
    specs = {k: spec for k, (_, spec) in layout.items()}
    coeffs = {k: jnp.asarray(rng.integers(-8, 9, s), jnp.float32) for k, (s, _) in layout.items()}
    shards = Shards(
        axis_sizes={"fsdp": 8},
        param_specs=specs,
        fsdp_scatter_stages=stages,
        fsdp_tpu_layout=True,
    )

    def grads(tree):
        def loss(tree):
            gathered = fsdp.gather(tree, specs, shards)
            return sum(jnp.sum(w * coeffs[k]) for k, w in gathered.items())

        return jax.grad(loss)(tree)

    step = jax.jit(
        jax.shard_map(grads, mesh=cpu_mesh, in_specs=(specs,), out_specs=specs, check_vma=False)
    )
    for k, g in step(full).items():
        np.testing.assert_array_equal(np.asarray(g), 8 * np.asarray(coeffs[k]), err_msg=k)


@pytest.mark.parametrize(
    "slice_, stages",
    [("v5p:2x2x2", (4, 2)), ("v5p:2x4x4", (16, 2)), ("v5p:4x4x4", (32, 2)), ("v5e:2x4", ())],
)
def test_the_sum_is_staged_only_where_fsdp_fills_a_3d_torus_largest_group_first(slice_, stages):
    pytest.importorskip("libtpu")
    from dew.targets import target

    devices = target(slice_).devices()
    whole = Mesh(np.array(devices), ("fsdp",))
    assert fsdp.scatter_stages(whole) == stages
    assert fsdp.on_tpu(whole)
    # fsdp over part of the slice (data 2): a smaller group, one reduce-scatter.
    part = Mesh(np.array(devices).reshape(2, -1), ("data", "fsdp"))
    assert fsdp.scatter_stages(part) == ()


def test_fsdp_rings_on_a_3d_torus_run_beside_compute_with_the_bytes_of_the_ring_collectives():
    # v5p:2x2x2, fsdp=8, the tiny model of the first test: the TPU compiler makes no all_gather
    # asynchronous on a 3-D torus (each a synchronous 3DAllGatherOnMajorDim, nothing beside it);
    # a ring of ppermutes is asynchronous collective-permute start/done pairs it schedules
    # beside the layers' matmuls. Two compiles, about 4 s each.
    from dew.collectives import hlo_overlap

    trainer, compiled = tpu_step("v5p:2x2x2", 512, dict(fsdp=8), fsdp_scheme="ring")
    assert trainer.shards.fsdp_ring
    text = compiled.as_text()
    overlap = hlo_overlap(compiled, trainer.mesh)
    from_hlo = hlo_collectives(compiled, trainer.mesh)
    from_jaxpr = collectives(trainer.train_step(16), *trainer.step_arguments(16))
    print("rings: overlapped", overlap.overlapped_wire_bytes, "exposed", overlap.exposed_wire_bytes)
    # Every gather and gradient sum over fsdp is the jaxpr's ring: no all-gather or
    # reduce-scatter in the HLO, and the ppermutes' bytes those of the jaxpr's.
    assert not re.search(r" (all-gather|reduce-scatter)(-start)?\(", text)
    assert from_jaxpr.count("all_gather") == from_jaxpr.count("psum_scatter") == 0
    rings = [r for r in from_hlo.rows if r.op == "ppermute"]
    asked = [r for r in from_jaxpr.rows if r.op == "ppermute"]
    assert sum(r.count for r in rings) == sum(r.count for r in asked) > 0
    # Most of the rings' bytes run beside compute (the small buckets and the embedding's gather
    # stay exposed), where the all_gathers and reduce-scatters of the same step run beside none.
    overlapped = sum(r.wire_bytes for r in overlap.overlapped.rows if r.op == "ppermute")
    assert overlapped > 0.8 * sum(r.wire_bytes for r in rings)
    # The same step with all_gathers and (staged) reduce-scatters.
    trainer, compiled = tpu_step("v5p:2x2x2", 512, dict(fsdp=8))
    without = hlo_overlap(compiled, trainer.mesh)
    print("collectives: overlapped", without.overlapped_wire_bytes)
    assert without.overlapped_wire_bytes == 0
    # The same bytes as the ring all-gathers and reduce-scatters: in the HLO (where the compiler
    # gathers bfloat16 either way) and in the jaxpr (the float32 weights the code gathers).
    assert overlap.wire_bytes == pytest.approx(without.wire_bytes, rel=1e-6)
    plain = collectives(trainer.train_step(16), *trainer.step_arguments(16))
    replaced = [r for r in plain.rows if r.op in ("all_gather", "psum_scatter")]
    assert sum(r.wire_bytes for r in asked) == pytest.approx(
        sum(r.wire_bytes for r in replaced), rel=1e-6
    )


@pytest.mark.parametrize("dim", [0, 1])
def test_a_ring_is_the_all_gather_and_the_reduce_scatter(cpu_mesh, dim, seed):
    x = jax.random.normal(jax.random.key(seed), (8, 16, 24))
    spec = P(*([None] * dim), "fsdp")

    def gathers(local):
        return (
            jax.lax.all_gather(local, "fsdp", axis=dim, tiled=True),
            fsdp.ring_gather(local, dim, 8),
        )

    def sums(whole):
        # Each device's own addend: x times its index + 1.
        local = whole * (jax.lax.axis_index("fsdp") + 1)
        return (
            jax.lax.psum_scatter(local, "fsdp", scatter_dimension=dim, tiled=True),
            fsdp.ring_scatter(local, dim, 8),
        )

    run = functools.partial(jax.shard_map, mesh=cpu_mesh, check_vma=False)
    expected, ring = jax.jit(run(gathers, in_specs=spec, out_specs=(P(), P())))(x)
    np.testing.assert_array_equal(np.asarray(ring), np.asarray(expected))
    expected, ring = jax.jit(run(sums, in_specs=P(), out_specs=(spec, spec)))(x)
    np.testing.assert_allclose(np.asarray(ring), np.asarray(expected), rtol=1e-6, atol=1e-6)


def test_the_ring_is_asked_for_and_refused_where_it_cannot_run():
    # A choice of the step's options ("auto" by default: tests/test_schemes_auto.py); the
    # Trainer hands it to the step.
    assert StepOptions().fsdp_scheme == "auto"
    with pytest.raises(
        ValueError, match="unknown fsdp_scheme 'rings'; expected one of auto, gather, ring"
    ):
        StepOptions(fsdp_scheme="rings")
    ring = StepOptions(fsdp_scheme="ring")
    ring.check({"fsdp": 8}, 32)
    assert ring.in_effect({"fsdp": 8}) == {"fsdp_scheme": "ring"}
    assert StepOptions().in_effect({"fsdp": 8}) == {}
    for n in (1, fsdp.RING_MAX * 2):
        with pytest.raises(ValueError, match=f"needs an fsdp axis of 2 to 32 devices .* fsdp {n}"):
            ring.check({"fsdp": n}, 32)
