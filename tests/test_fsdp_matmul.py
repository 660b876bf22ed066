"""``dew.parallel.fsdp_matmul``: under ``fsdp_scheme="ring"`` a layer's matrices reach their
einsums split, and each weight gradient is summed round the ring as its blocks are computed.

Three ways: ``RingSplit.einsum`` and its gradients against the formulas (``out = x W``, ``dx = d_out
W^T``, ``dW`` the sum over devices of ``x^T d_out``, written with numpy loops over the devices);
the step's gradients against one device's (float32, 1e-5); the ring's bytes against the formula
(each matrix gathered twice under full recompute, its gradient summed once, ``(n - 1) / n`` of it
each), and, on a v5p:2x2x2 compile, no buffer of a whole float32 weight gradient.
"""

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
from dew.collectives import collectives
from dew.parallel import fsdp
from dew.parallel.fsdp_matmul import RingSplit
from dew.parallel.options import StepOptions
from tests.equivalence import batch_away_from_ties
from tests.helpers import (
    one_device_and_mesh_gradients,
    tpu_width_step,
    width_batch,
    width_objective,
)


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(jax.devices()[:8]), ("fsdp",))


# The einsums of the model's layers, with the dimension fsdp splits the weight on: the model width
# of q, k, v and gate, up (contracted: a block of dW needs that block of x's columns), and of o and
# down (in the output: a block of d_out); and the MLP width (when fsdp takes it instead).
EINSUMS = [
    ("bse,ehd->bshd", 0),
    ("bshd,hde->bse", 2),
    ("te,ef->tf", 0),
    ("tf,fe->te", 1),
    ("te,ef->tf", 1),
    ("tf,fe->te", 0),
]
SIZES = dict(b=2, s=3, e=64, h=2, d=5, t=6, f=32)  # the split ones divide by 8


@pytest.mark.parametrize("spec, dim", EINSUMS, ids=[f"{s}/{d}" for s, d in EINSUMS])
def test_a_ring_einsum_and_its_gradients_follow_the_formulas(mesh, spec, dim, seed):
    rng = np.random.default_rng(seed)
    n = 8
    x_labels, w_labels, out_labels = spec.replace("->", ",").split(",")
    w = rng.standard_normal([SIZES[c] for c in w_labels]).astype(np.float32)
    # Each device's own activations and output gradient.
    xs = rng.standard_normal([n] + [SIZES[c] for c in x_labels]).astype(np.float32)
    d_outs = rng.standard_normal([n] + [SIZES[c] for c in out_labels]).astype(np.float32)

    def local(w_shard, x, d_out):
        def einsum(x, shard):
            return RingSplit(shard, dim, n).einsum(spec, x)

        out, pullback = jax.vjp(einsum, x[0], w_shard)
        dx, dw = pullback(d_out[0])
        return out[None], dx[None], dw

    w_spec = P(*([None] * dim), "fsdp")
    run = jax.jit(
        jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(w_spec, P("fsdp"), P("fsdp")),
            out_specs=(P("fsdp"), P("fsdp"), w_spec),
            check_vma=False,
        )
    )
    out, dx, dw = (np.asarray(a, np.float64) for a in run(w, xs, d_outs))
    # The formulas, device by device, in float64: out = x W, dx = d_out W^T, and the gradient of
    # the whole weight is every device's x^T d_out added up.
    w64, xs64, d64 = w.astype(np.float64), xs.astype(np.float64), d_outs.astype(np.float64)
    expected_dw = np.zeros_like(w64)
    for device in range(n):
        np.testing.assert_allclose(
            out[device], np.einsum(spec, xs64[device], w64), rtol=1e-5, atol=1e-5
        )
        dx_formula = np.einsum(f"{out_labels},{w_labels}->{x_labels}", d64[device], w64)
        np.testing.assert_allclose(dx[device], dx_formula, rtol=1e-5, atol=1e-5)
        expected_dw += np.einsum(f"{x_labels},{out_labels}->{w_labels}", xs64[device], d64[device])
    np.testing.assert_allclose(dw, expected_dw, rtol=1e-5, atol=1e-4, err_msg=str(seed))


def test_a_weight_split_on_a_dimension_both_or_neither_operand_names_is_refused():
    split = RingSplit(jnp.zeros((2, 3)), 0, 8)
    with pytest.raises(ValueError, match=r"split dimension 0 \('b'\) must be named by exactly one"):
        split.einsum("bse,bhd->bshd", jnp.zeros((16, 3, 3)))


def ring_trainer(objective, axes, **options):
    return dew.Trainer(
        objective,
        optax.sgd(0.0),
        jax.random.key(0),
        mesh=dew.MeshSpec(**axes),
        layout=dew.Layout(min_shard=1024),
        options=StepOptions(fsdp_scheme="ring", **options),
    )


@pytest.mark.parametrize(
    "axes, model",
    [
        (dict(fsdp=8), {}),
        (dict(data=2, fsdp=4), {}),
        (dict(fsdp=2, tensor=4), {}),
        (dict(fsdp=4, tensor=2), dict(num_kv_heads=1)),  # k, v shared: gathered whole
        (dict(fsdp=4), dict(num_experts=4, moe_every=2)),  # MoE layers: attention on the ring
    ],
    ids=[
        "fsdp8",
        "data2_fsdp4",
        "fsdp2_tensor4",
        "fsdp4_tensor2_shared_kv",
        "fsdp4_moe",
    ],
)
def test_a_ring_step_has_one_device_s_gradients(axes, model, seed, monkeypatch):
    # Every matrix travels alone (no bucket), so each reaches its einsum split.
    monkeypatch.setattr(fsdp, "BUCKET_BYTES", 0)
    trainer = ring_trainer(width_objective(64, **model), axes)
    batch = width_batch(seed)
    if trainer.objective.model.num_experts:  # the one device's weights, as the helper makes them
        params = jax.jit(trainer.objective.model.init)(jax.random.key(0))
        draw = functools.partial(width_batch, seed, 16)
        batch = batch_away_from_ties(trainer.objective, params, draw, f"seed {seed}")
    for path, a, b in one_device_and_mesh_gradients(trainer, batch):
        scale = np.abs(a).max() + 1e-30
        assert np.abs(a - b).max() / scale < 1e-5, (path, seed)
    # The matrices ring (the tokens of the vocabulary-parallel embedding may still be gathered):
    # the jaxpr of the gradients just compared, read back from their trace (on the weights'
    # shapes: no second state is made).
    rows = trainer.device_batch(np.asarray(batch), 16)
    params = trainer.step_arguments(16)[0].params
    assert "ppermute" in str(jax.make_jaxpr(trainer.gradients)(params, rows))


@pytest.mark.parametrize("sum_dtype, itemsize", [(None, 4), ("bfloat16", 2)], ids=["f32", "bf16"])
def test_each_matrix_rings_twice_and_its_gradient_once(sum_dtype, itemsize, monkeypatch):
    # fsdp=8, every matrix alone, full recompute: the forward's ring and the backward's
    # recomputed one each move (n - 1) / n of the float32 weight (the jaxpr's dtype; the compiler
    # moves the cast to bfloat16 ahead of them), the gradient's ring (n - 1) / n of it in the
    # sum's dtype. The embedding (tied: the lookup's and the head's table) is gathered once,
    # round the same ring, and its gradient summed once; the norm scales stay whole.
    monkeypatch.setattr(fsdp, "BUCKET_BYTES", 0)
    objective = width_objective(128, "bfloat16")
    trainer = ring_trainer(objective, dict(fsdp=8), gradient_sum_dtype=sum_dtype)
    report = collectives(trainer.train_step(16), *trainer.step_arguments(16))
    shapes = jax.eval_shape(objective.model.init, jax.random.key(0))["params"]
    matrices = sum(
        leaf.size
        for name in ("attn", "mlp")
        for leaf in jax.tree_util.tree_leaves(shapes["layers"][name])
    )
    embedding = shapes["embed_tokens"]["embedding"].size
    (ring,) = [r for r in report.rows if r.op == "ppermute"]
    n = 8
    expected = (n - 1) / n * (matrices * (2 * 4 + itemsize) + embedding * (4 + itemsize))
    assert ring.wire_bytes == pytest.approx(expected, rel=1e-9)
    assert not [r for r in report.rows if r.op in ("all_gather", "psum_scatter")]


@pytest.mark.xdist_group("tpu")
def test_no_device_holds_a_whole_float32_weight_gradient_on_a_3d_torus():
    # v5p:2x2x2, fsdp=8, 2 layers of width 512 (one compile each, about 4 s): the gathers'
    # transposes sum each MLP matrix's whole float32 gradient, f32[512, 2048] (or its transpose);
    # the ring einsums never form it.
    pytest.importorskip("libtpu")

    def hlo(scheme):  # compiled once per worker (the 3-D torus tests of test_tpu_gradient_sums)
        return tpu_width_step("v5p:2x2x2", 512, (("fsdp", 8),), scheme)[1].as_text()

    whole_gradient = re.compile(r"f32\[(512,2048|2048,512)\]")
    assert whole_gradient.search(hlo("gather"))
    assert not whole_gradient.search(hlo("ring"))


def test_the_rings_are_refused_inside_a_pipeline():
    # Each stage runs its own branch of the schedule; a collective-permute there is joined by
    # every device on XLA:CPU, and the gradients came out wrong (checked: the MLP's, by 30 to 120
    # times their size at data=2,fsdp=2,stage=2) before the Trainer refused it.
    with pytest.raises(ValueError, match="fsdp_scheme='ring' with stage 2.*fsdp_scheme='gather'"):
        ring_trainer(
            width_objective(64, num_layers=4), dict(data=2, fsdp=2, stage=2, microbatches=2)
        )


def test_a_search_asks_for_the_rings_only_where_they_can_run():
    from dew import planning

    # (No tensor axis: the tensor scheme, "auto" as asked, is the plain pairs' in every step.)
    asked = StepOptions(fsdp_scheme="ring", gradient_sum_dtype="bfloat16")
    shape = dict(data=1, expert=1, fsdp=8, tensor=1, sequence=1, stage=1)
    plain = dict(gradient_sum_dtype="bfloat16", tensor_scheme="plain")
    assert planning._options_for(asked, shape) == StepOptions(fsdp_scheme="ring", **plain)
    for other in (dict(fsdp=64), dict(fsdp=4, stage=2), dict(fsdp=1)):
        given = planning._options_for(asked, {**shape, **other})
        assert given == StepOptions(fsdp_scheme="gather", **plain), other
