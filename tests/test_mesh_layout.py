"""Meshes and where each weight lands."""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import dew
from dew.layout import weight_dimensions
from dew.training.distributed import build_mesh
from tests.helpers import tiny_objective


@pytest.mark.parametrize(
    "spec, shape",
    [
        (
            dew.MeshSpec(),
            {"data": 8, "expert": 1, "fsdp": 1, "tensor": 1, "sequence": 1, "stage": 1},
        ),
        (
            dew.MeshSpec(fsdp=8),
            {"data": 1, "expert": 1, "fsdp": 8, "tensor": 1, "sequence": 1, "stage": 1},
        ),
        (
            dew.MeshSpec(fsdp=2, tensor=2),
            {"data": 2, "expert": 1, "fsdp": 2, "tensor": 2, "sequence": 1, "stage": 1},
        ),
    ],
)
def test_mesh_axes_in_order_data_takes_the_rest(spec, shape):
    mesh = build_mesh(spec)
    assert dict(mesh.shape) == shape
    assert list(mesh.shape) == list(dew.AXES)


def test_mesh_on_given_devices():
    mesh = build_mesh(dew.MeshSpec(fsdp=2), devices=jax.devices()[:4])
    assert dict(mesh.shape)["data"] == 2 and mesh.devices.size == 4


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(fsdp=3), "fsdp 3 = 3 devices does not divide the 8 devices"),
        (dict(fsdp=4, tensor=4), "fsdp 4 x tensor 4 = 16 devices does not divide the 8 devices"),
    ],
)
def test_mesh_that_does_not_divide_the_devices(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_mesh(dew.MeshSpec(**kwargs))


@pytest.mark.parametrize("kwargs", [dict(fsdp=0), dict(tensor=-2), dict(stage=1.5), dict(data=0)])
def test_mesh_sizes_below_one(kwargs):
    name, value = next(iter(kwargs.items()))
    with pytest.raises(ValueError, match=f"MeshSpec.{name} must be"):
        dew.MeshSpec(**kwargs)


def test_mesh_parse():
    assert dew.MeshSpec.parse("fsdp=4") == dew.MeshSpec(fsdp=4)
    assert dict(build_mesh(dew.MeshSpec.parse("data=2,fsdp=4")).shape)["fsdp"] == 4
    with pytest.raises(
        ValueError, match="mesh asks for data=4, but 8 devices over 4 per model copy leave data=2"
    ):
        build_mesh(dew.MeshSpec.parse("data=4,fsdp=4"))
    with pytest.raises(ValueError, match="'fsdp:4' is not AXIS=SIZE"):
        dew.MeshSpec.parse("fsdp:4")
    with pytest.raises(ValueError, match="size 'x' is not an integer"):
        dew.MeshSpec.parse("fsdp=x")
    # No entry at all is the default layout; an empty one among others is a typo, not skipped.
    assert dew.MeshSpec.parse(" ") == dew.MeshSpec()
    for text in ("fsdp=4,,data=2", "fsdp=4,"):
        with pytest.raises(ValueError, match=f"mesh '{text}' has an empty entry"):
            dew.MeshSpec.parse(text)


def specs_of(mesh_spec, min_shard=1, **model):
    objective = tiny_objective(**model)
    trainer = dew.Trainer(
        objective,
        optax.adam(1e-3),
        jax.random.key(0),
        mesh=mesh_spec,
        layout=dew.Layout(min_shard=min_shard),
    )
    return {
        jax.tree_util.keystr(p): s
        for p, s in jax.tree_util.tree_flatten_with_path(
            trainer.param_specs, is_leaf=lambda x: isinstance(x, P)
        )[0]
    }


# Where each weight of the tiny model (vocab 64, width 32, 4 heads of 8, MLP 128, 2 layers) lands
# with fsdp 4 or 8 and min_shard=1: the first dimension the rules split that fsdp divides.
FSDP_PLACEMENT = {
    "['params']['embed_tokens']['embedding']": P("fsdp"),  # [vocab 64, embed 32]
    "['params']['final_norm']['scale']": P("fsdp"),  # [embed 32]
    "['params']['layers']['attn']['q']": P(None, "fsdp"),  # [layers, embed, heads, d]
    "['params']['layers']['attn']['k']": P(None, "fsdp"),
    "['params']['layers']['attn']['v']": P(None, "fsdp"),
    "['params']['layers']['attn']['o']": P(None, None, None, "fsdp"),  # [layers, heads, d, embed]
    "['params']['layers']['attn_norm']['scale']": P(None, "fsdp"),
    "['params']['layers']['mlp_norm']['scale']": P(None, "fsdp"),
    "['params']['layers']['mlp']['gate']": P(None, "fsdp"),  # [layers, embed, mlp]
    "['params']['layers']['mlp']['up']": P(None, "fsdp"),
    "['params']['layers']['mlp']['down']": P(None, None, "fsdp"),  # [layers, mlp, embed]
}


def test_placement_of_each_weight_under_fsdp():
    assert specs_of(dew.MeshSpec(fsdp=8)) == FSDP_PLACEMENT


def test_placement_data_parallel_and_min_shard():
    assert set(specs_of(dew.MeshSpec()).values()) == {P()}
    # With the default min_shard of 65536 every weight of the tiny model stays whole.
    assert set(specs_of(dew.MeshSpec(fsdp=8), min_shard=65536).values()) == {P()}
    # 2048 elements: the embedding (64 x 32) and each stacked attention weight (2 x 32 x 4 x 8)
    # split, the norms (32, 2 x 32) stay whole.
    specs = specs_of(dew.MeshSpec(fsdp=8), min_shard=2048)
    assert specs["['params']['embed_tokens']['embedding']"] == P("fsdp")
    assert specs["['params']['layers']['attn']['q']"] == P(None, "fsdp")
    assert specs["['params']['final_norm']['scale']"] == P()
    assert specs["['params']['layers']['attn_norm']['scale']"] == P()


def test_placement_under_stage_splits_the_layers_whatever_their_size():
    # Stage 2 x fsdp 4: each stacked layer weight's layers dimension over stage (its first
    # rule), then fsdp where it fell without a stage axis; the embedding and final norm whole over
    # stage.
    def with_stage(spec):
        return P("stage", *tuple(spec)[1:])

    expected = {
        path: with_stage(spec) if "['layers']" in path else spec
        for path, spec in FSDP_PLACEMENT.items()
    }
    assert specs_of(dew.MeshSpec(stage=2, fsdp=4, microbatches=2)) == expected
    # The default min_shard keeps every weight of the tiny model whole over fsdp, but not over
    # stage: the pipeline computes on that split.
    specs = specs_of(dew.MeshSpec(stage=2, fsdp=4, microbatches=2), min_shard=65536)
    assert {s for path, s in specs.items() if "['layers']" in path} == {P("stage")}
    assert {s for path, s in specs.items() if "['layers']" not in path} == {P()}


def test_dimension_fsdp_does_not_divide_falls_to_the_next_rule():
    # vocab 60 is not divisible by 8: the table is split on embed (32) instead.
    specs = specs_of(dew.MeshSpec(fsdp=8), vocab_size=60)
    assert specs["['params']['embed_tokens']['embedding']"] == P(None, "fsdp")
    layout = dew.Layout(min_shard=1)
    mesh = build_mesh(dew.MeshSpec(fsdp=8))
    assert (
        layout.spec((60, 36), ("vocab", "embed"), dict(mesh.shape)) == P()
    )  # nothing divides: whole


def test_weight_dimensions_walks_every_dimension_once():
    shaped = jax.ShapeDtypeStruct
    axes = {"params": {"table": ("vocab", "embed"), "layers": {"w": ("layers", "embed", "mlp")}}}
    w_spec = P("stage", None, ("tensor", "fsdp"))
    specs = {"params": {"table": P("tensor"), "layers": {"w": w_spec}}}
    shapes = {
        "params": {
            "table": shaped((64, 32), np.float32),
            "layers": {"w": shaped((2, 32, 128), np.float32)},
        }
    }
    got = list(weight_dimensions(specs, axes, shapes))
    assert [(where, name, mesh_axes, size) for where, _, _, name, mesh_axes, size in got] == [
        ("params/layers/w", "layers", ("stage",), 2),
        ("params/layers/w", "embed", (None,), 32),
        ("params/layers/w", "mlp", ("tensor", "fsdp"), 128),
        ("params/table", "vocab", ("tensor",), 64),
        ("params/table", "embed", (None,), 32),  # past the spec's end: whole
    ]
    assert got[0][1:3] == (("layers", "embed", "mlp"), w_spec)
    # Without shapes: the same walk, every size None.
    assert [d[:5] for d in weight_dimensions(specs, axes)] == [d[:5] for d in got]
    assert {d[5] for d in weight_dimensions(specs, axes)} == {None}


def placed_specs(tree) -> dict:
    """Path -> the ``PartitionSpec`` each array of ``tree`` is actually laid out with."""
    return {
        jax.tree_util.keystr(path): leaf.sharding.spec
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def test_optimizer_state_and_ema_follow_their_parameter():
    objective = tiny_objective(ema_decay=0.9)
    trainer = dew.Trainer(
        objective,
        optax.adamw(1e-3),
        jax.random.key(0),
        mesh=dew.MeshSpec(fsdp=4),
        layout=dew.Layout(min_shard=1),
    )
    state = trainer.init_state()
    adam = state.opt_state[0]
    # The arrays as created, each against the hand-written table: the weights, Adam's two
    # moments and the EMA alike; Adam's step count and the train step stay whole.
    for name, tree in (
        ("params", state.params),
        ("mu", adam.mu),
        ("nu", adam.nu),
        ("ema", state.ema),
    ):
        assert placed_specs(tree) == FSDP_PLACEMENT, name
    assert adam.count.sharding.spec == P()
    assert state.step.sharding.spec == P()
    table = state.params["params"]["embed_tokens"]["embedding"]
    assert table.sharding.mesh.shape["fsdp"] == 4
    assert table.addressable_shards[0].data.shape == (16, 32)  # 64 rows over fsdp 4


def test_layout_of_an_undeclared_tree():
    mesh = build_mesh(dew.MeshSpec(fsdp=8))
    tree = {"params": {"embed_tokens": {"embedding": np.ones((256, 64))}}, "small": np.ones(3)}
    shardings = dew.Layout(min_shard=1).shardings(mesh, tree)
    assert shardings["params"]["embed_tokens"]["embedding"].spec == P("fsdp")
    assert shardings["small"].spec == P()
    # The default min_shard, 4096 elements: (64, 64) is split, (63, 64) stays whole.
    assert dew.Layout().min_shard == 4096
    assert dew.Layout().shardings(mesh, {"w": np.ones((64, 64))})["w"].spec == P("fsdp")
    assert dew.Layout().shardings(mesh, {"w": np.ones((63, 64))})["w"].spec == P()


@pytest.mark.parametrize(
    "rules, message",
    [
        ((("embed", "data"),), "never placed on the data axis"),
        ((("embed", "fdsp"),), "mesh axis 'fdsp' is not one of"),
        ((("embed",),), "pair of strings"),
    ],
)
def test_bad_layout_rules(rules, message):
    with pytest.raises(ValueError, match=message):
        dew.Layout(rules=rules)


def test_bad_min_shard():
    with pytest.raises(ValueError, match="min_shard must be an integer >= 0, got -1"):
        dew.Layout(min_shard=-1)
