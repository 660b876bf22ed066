"""``StepOptions(gradient_sum_dtype="bfloat16")``: every cross-device sum of a weight's gradient in
bfloat16, and the summed shard back in the weight's dtype.

Three ways, as every axis: the sums against a formula (each device's gradient rounded to
bfloat16, then added), the step's gradients against one device's (to bfloat16's rounding), and
the bytes: each gradient sum's operand half its float32 size in the jaxpr, and the whole gradient
the TPU compiler holds before the scatter half too (a v5e:2x4 compile, seconds).
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import dew
from dew.collectives import collectives
from dew.parallel import Shards, data, fsdp
from dew.parallel.options import StepOptions
from tests.helpers import (
    one_device_and_mesh_gradients,
    tpu_width_step,
    width_batch,
    width_objective,
)


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "fsdp"))


# Weights of the sums below: two alone (a large one, and one scattered along another dimension on
# TPU), two small ones that share a bucket, and one whole (summed in the step's tail).
SPECS = {
    "alone": P("fsdp"),
    "columns": P(None, "fsdp"),
    "bucket_a": P("fsdp"),
    "bucket_b": P(None, "fsdp"),
    "whole": P(),
}
SHAPES = {
    "alone": (4 * 256, 8),
    "columns": (16, 4 * 128),
    "bucket_a": (4 * 2, 3),
    "bucket_b": (5, 4 * 2),
    "whole": (6, 7),
}


def cotangents(seed):
    """Each of the 8 devices' gradient of each weight: a whole number from -8 to 8 (not 0) and a
    perturbation under 2^-10, which bfloat16 (8 significant bits) rounds away: a sum of the
    rounded gradients is the sum of the whole numbers, exact in bfloat16 up to 256; a float32 sum
    keeps the perturbations."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in SHAPES.items():
        whole = rng.integers(1, 9, (8, *shape)) * rng.choice([-1, 1], (8, *shape))
        out[name] = (whole + rng.uniform(-(2**-10), 2**-10, (8, *shape))).astype(np.float32)
    return out


def summed_on_the_mesh(mesh, sum_dtype, seed, monkeypatch):
    """Each weight's gradient after the step's sums: fsdp gathers (their transposes sum over fsdp,
    then over data in the layer loop), then ``data.sum_gradients`` for the rest."""
    monkeypatch.setattr(fsdp, "BUCKET_BYTES", 1024)  # the two small weights travel together
    shards = Shards(
        axis_sizes={"data": 2, "fsdp": 4},
        param_specs=SPECS,
        options=StepOptions(gradient_sum_dtype=sum_dtype),
        fsdp_tpu_layout=True,
        loop_sums=("data",),
    )
    coeffs = cotangents(seed)
    weights = {k: jnp.zeros(s, jnp.float32) for k, s in SHAPES.items()}

    def grads(tree, coeffs):
        def loss(tree):
            gathered = fsdp.gather(tree, SPECS, shards, also_sum=shards.loop_sums)
            # This device's gradient of each whole weight is its own draw.
            return sum(jnp.sum(w * coeffs[k][0]) for k, w in gathered.items())

        g = jax.grad(loss)(tree)
        in_loop = {k: True for k in SPECS}
        return data.sum_gradients(g, SPECS, shards, summed_in_loop=in_loop)

    per_device = P(("data", "fsdp"))
    step = jax.jit(
        jax.shard_map(
            grads,
            mesh=mesh,
            in_specs=(SPECS, {k: per_device for k in SPECS}),
            out_specs=SPECS,
            check_vma=False,
        )
    )
    return step(weights, coeffs), coeffs


def test_a_bfloat16_sum_adds_each_device_s_gradient_rounded_to_bfloat16(mesh, seed, monkeypatch):
    got, coeffs = summed_on_the_mesh(mesh, "bfloat16", seed, monkeypatch)
    for name, draws in coeffs.items():
        rounded = draws.astype(ml_dtypes.bfloat16).astype(np.float64)
        assert got[name].dtype == jnp.float32, name  # back in the weight's dtype
        np.testing.assert_array_equal(np.asarray(got[name]), rounded.sum(0), err_msg=(name, seed))


def test_by_default_gradients_are_summed_in_the_weights_float32(mesh, seed, monkeypatch):
    got, coeffs = summed_on_the_mesh(mesh, None, seed, monkeypatch)
    for name, draws in coeffs.items():
        exact = draws.astype(np.float64).sum(0)
        # float32's rounding of sums up to 8 x 8 (its spacing at 64: 2^-17).
        np.testing.assert_allclose(
            np.asarray(got[name]), exact, rtol=0, atol=2**-15, err_msg=(name, seed)
        )
        # The perturbations are kept: not the sum of bfloat16-rounded draws.
        rounded = draws.astype(ml_dtypes.bfloat16).astype(np.float64).sum(0)
        assert np.abs(np.asarray(got[name]) - rounded).max() > 2**-14, (name, seed)


@pytest.mark.parametrize(
    "axes, scheme",
    [
        (dict(fsdp=8), "gather"),
        (dict(data=2, fsdp=4), "gather"),
        (dict(fsdp=4), "ring"),
        (dict(data=2, fsdp=2, tensor=2), "gather"),
    ],
    ids=["fsdp8", "data2_fsdp4", "fsdp4_ring", "data2_fsdp2_tensor2"],
)
def test_a_bfloat16_sum_step_has_one_device_s_gradients_to_bfloat16_rounding(
    axes, scheme, seed, monkeypatch
):
    if scheme == "ring":  # every matrix alone: each reaches its einsum split (fsdp_matmul)
        monkeypatch.setattr(fsdp, "BUCKET_BYTES", 0)
    trainer = dew.Trainer(
        width_objective(64, "float32"),
        optax.sgd(0.0),
        jax.random.key(0),
        mesh=dew.MeshSpec(**axes),
        layout=dew.Layout(min_shard=1024),
        options=StepOptions(fsdp_scheme=scheme, gradient_sum_dtype="bfloat16"),
    )
    batch = width_batch(seed)
    worst = 0.0
    for path, a, b in one_device_and_mesh_gradients(trainer, batch):
        assert b.dtype == np.float32, path
        # Each device's part rounded to bfloat16 (2^-9 of itself), then up to 8 of them added
        # in bfloat16: a few times 2^-9 of the largest entry.
        error = np.abs(a - b).max() / (np.abs(a).max() + 1e-30)
        worst = max(worst, error)
        assert error < 2**-6, (path, error, seed)
    # float32 sums agree to 1e-5 (test_equivalence); bfloat16's rounding shows.
    assert worst > 1e-5, (worst, seed)


def sums_of(axes, sum_dtype, objective):
    trainer = dew.Trainer(
        objective,
        optax.adamw(1e-3),
        jax.random.key(0),
        mesh=dew.MeshSpec(**axes),
        layout=dew.Layout(min_shard=1024),
        options=StepOptions(gradient_sum_dtype=sum_dtype),
    )
    report = collectives(trainer.train_step(16), *trainer.step_arguments(16))
    return [r for r in report.rows if r.op in ("psum_scatter", "psum")], report


@pytest.mark.parametrize("axes", [dict(fsdp=8), dict(data=8)], ids=["fsdp8", "data8"])
@pytest.mark.parametrize("sum_dtype, itemsize", [(None, 4), ("bfloat16", 2)], ids=["f32", "bf16"])
def test_the_gradient_sums_move_every_weight_once_in_the_sum_dtype(axes, sum_dtype, itemsize):
    # On fsdp=8 (every weight's gradient in one psum_scatter over fsdp, or one psum where it stays
    # whole) and on data=8 (one psum over data each), the sums' operands are every weight once,
    # in the sum's dtype, and the loss (a float32 scalar). The wire bytes follow from these by
    # the ring formulas (test_collective_costs).
    objective = width_objective(128, "bfloat16")
    shapes = jax.eval_shape(objective.model.init, jax.random.key(0))
    weights = sum(leaf.size for leaf in jax.tree_util.tree_leaves(shapes))
    rows, _ = sums_of(axes, sum_dtype, objective)
    assert sum(r.operand_bytes for r in rows) == itemsize * weights + 4, rows


def test_the_sums_of_the_shards_over_data_move_half_their_float32_bytes():
    # data=2,fsdp=4: each layer's shards summed over data in the loop, the embedding's in the
    # tail; nothing else is summed over data alone.
    objective = width_objective(128, "bfloat16")
    (float32_rows, float32_report), (bfloat16_rows, bfloat16_report) = [
        sums_of(dict(data=2, fsdp=4), d, objective) for d in (None, "bfloat16")
    ]
    (wide,) = [r for r in float32_rows if r.op == "psum" and r.axes == ("data",)]
    (narrow,) = [r for r in bfloat16_rows if r.op == "psum" and r.axes == ("data",)]
    assert wide.count == narrow.count >= 3
    assert 2 * narrow.operand_bytes == wide.operand_bytes
    # The gathers are the weights', not the sums': unchanged.
    gathers = [r for r in bfloat16_report.rows if r.op == "all_gather"]
    assert gathers and gathers == [r for r in float32_report.rows if r.op == "all_gather"]


@pytest.mark.xdist_group("tpu")
def test_a_bfloat16_sum_holds_the_whole_gradient_in_half_the_bytes_on_tpu():
    # v5e:2x4, data=2,fsdp=4, width 1024 (its MLP matrices [1024, 4096], one compile each, about
    # 8 s): each device computes a matrix's whole gradient before the reduce-scatter; in bfloat16
    # it is half the float32 one, and the step's temporaries fall by at least that half.
    pytest.importorskip("libtpu")

    def temp_bytes(sum_dtype):
        # The gathers, whose reduce-scatter takes the whole gradient ("auto" would run the rings
        # on TPU, which sum it block by block: tests/test_fsdp_matmul.py). The float32 step is
        # test_tpu_gradient_sums' own, compiled once per worker.
        mesh = (("data", 2), ("fsdp", 4))
        _, compiled = tpu_width_step("v5e:2x4", 1024, mesh, "gather", sum_dtype)
        return compiled.memory_analysis().temp_size_in_bytes

    shapes = jax.eval_shape(width_objective(1024, "bfloat16").model.init, jax.random.key(0))
    largest = max(
        leaf.size // leaf.shape[0] for leaf in jax.tree_util.tree_leaves(shapes["params"]["layers"])
    )
    as_float32, as_bfloat16 = temp_bytes(None), temp_bytes("bfloat16")
    print(f"temporaries: {as_float32} B summing in float32, {as_bfloat16} B in bfloat16")
    assert as_float32 - as_bfloat16 >= 2 * largest, (as_float32, as_bfloat16, largest)


def test_an_unknown_gradient_sum_dtype_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="unknown gradient_sum_dtype 'float16'.*float32, bfloat16"):
        StepOptions(gradient_sum_dtype="float16")
    assert StepOptions(gradient_sum_dtype="bfloat16").in_effect({"fsdp": 8}) == {
        "gradient_sum_dtype": "bfloat16"
    }
    assert StepOptions().in_effect({"fsdp": 8}) == {}
