"""The one rule that decides every gradient sum (``dew.parallel.gradients.sum_axes``), as a table
over weights and layouts, each expected tuple written out by hand from the rule in words: the axes
that split the tokens, minus fsdp for a weight split over fsdp, minus the axes a weight is split on
as its own, plus tensor for a weight partial over tensor, plus stage (above size 1) for a weight
not split over stage (every stage holds it whole, and only some stages use it)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import dew
from dew.mesh import AXES, build_mesh
from dew.parallel import ONE_DEVICE, Shards, data
from dew.parallel.gradients import sum_axes


def layout(**sizes) -> Shards:
    return Shards(axis_sizes={a: sizes.get(a, 1) for a in AXES})


LAYOUTS = {
    "data=8": layout(data=8),
    "fsdp=8": layout(fsdp=8),
    "data=2,fsdp=4": layout(data=2, fsdp=4),
    "data=2,expert=2,fsdp=2": layout(data=2, expert=2, fsdp=2),
    "fsdp=2,tensor=2,sequence=2": layout(fsdp=2, tensor=2, sequence=2),
    "data=2,tensor=2,stage=2": layout(data=2, tensor=2, stage=2),
    "expert=2,tensor=2,sequence=2": layout(expert=2, tensor=2, sequence=2),
    "one device": ONE_DEVICE,
}

SPECS = {
    "fsdp": P("fsdp"),
    "fsdp,tensor": P(None, "fsdp", "tensor"),
    "whole": P(),
    "expert,fsdp": P("expert", "fsdp"),
    "(expert,fsdp)": P(("expert", "fsdp")),
    "stage": P("stage"),
}

# layout -> spec -> (expected with partial_over_tensor=False, with True); "error": a ValueError.
EXPECTED = {
    "data=8": {
        "fsdp": (("data",), ("data",)),
        "fsdp,tensor": (("data",), "error"),
        "whole": (("data",), ("data",)),
        "expert,fsdp": (("data",), ("data",)),
        "(expert,fsdp)": (("data",), ("data",)),
        "stage": (("data",), ("data",)),
    },
    "fsdp=8": {
        "fsdp": ((), ()),
        "fsdp,tensor": ((), "error"),
        "whole": (("fsdp",), ("fsdp",)),
        "expert,fsdp": ((), ()),
        "(expert,fsdp)": ((), ()),
        "stage": (("fsdp",), ("fsdp",)),
    },
    "data=2,fsdp=4": {
        "fsdp": (("data",), ("data",)),
        "fsdp,tensor": (("data",), "error"),
        "whole": (("data", "fsdp"), ("data", "fsdp")),
        "expert,fsdp": (("data",), ("data",)),
        "(expert,fsdp)": (("data",), ("data",)),
        "stage": (("data", "fsdp"), ("data", "fsdp")),
    },
    "data=2,expert=2,fsdp=2": {
        "fsdp": (("data", "expert"), ("data", "expert")),
        "fsdp,tensor": (("data", "expert"), "error"),
        "whole": (("data", "expert", "fsdp"), ("data", "expert", "fsdp")),
        "expert,fsdp": (("data",), ("data",)),
        "(expert,fsdp)": (("data",), ("data",)),
        "stage": (("data", "expert", "fsdp"), ("data", "expert", "fsdp")),
    },
    "fsdp=2,tensor=2,sequence=2": {
        "fsdp": (("sequence",), ("tensor", "sequence")),
        "fsdp,tensor": (("sequence",), "error"),
        "whole": (("fsdp", "sequence"), ("fsdp", "tensor", "sequence")),
        "expert,fsdp": (("sequence",), ("tensor", "sequence")),
        "(expert,fsdp)": (("sequence",), ("tensor", "sequence")),
        "stage": (("fsdp", "sequence"), ("fsdp", "tensor", "sequence")),
    },
    "data=2,tensor=2,stage=2": {
        "fsdp": (("data", "stage"), ("data", "tensor", "stage")),
        "fsdp,tensor": (("data", "stage"), "error"),
        "whole": (("data", "stage"), ("data", "tensor", "stage")),
        "expert,fsdp": (("data", "stage"), ("data", "tensor", "stage")),
        "(expert,fsdp)": (("data", "stage"), ("data", "tensor", "stage")),
        "stage": (("data",), ("data", "tensor")),
    },
    "expert=2,tensor=2,sequence=2": {
        "fsdp": (("expert", "sequence"), ("expert", "tensor", "sequence")),
        "fsdp,tensor": (("expert", "sequence"), "error"),
        "whole": (("expert", "sequence"), ("expert", "tensor", "sequence")),
        "expert,fsdp": (("sequence",), ("tensor", "sequence")),
        "(expert,fsdp)": (("sequence",), ("tensor", "sequence")),
        "stage": (("expert", "sequence"), ("expert", "tensor", "sequence")),
    },
    "one device": {
        "fsdp": ((), ()),
        "fsdp,tensor": ((), "error"),
        "whole": ((), ()),
        "expert,fsdp": ((), ()),
        "(expert,fsdp)": ((), ()),
        "stage": ((), ()),
    },
}

CASES = [
    (layout_name, spec_name, partial)
    for layout_name in LAYOUTS
    for spec_name in SPECS
    for partial in (False, True)
]


def test_the_table_covers_every_case():
    assert set(EXPECTED) == set(LAYOUTS)
    for layout_name, row in EXPECTED.items():
        assert set(row) == set(SPECS), layout_name


@pytest.mark.parametrize("layout_name, spec_name, partial", CASES)
def test_sum_axes(layout_name, spec_name, partial):
    shards, spec = LAYOUTS[layout_name], SPECS[spec_name]
    expected = EXPECTED[layout_name][spec_name][partial]
    if expected == "error":
        with pytest.raises(ValueError, match=r"partial_over_tensor=True for a weight split over"):
            sum_axes(spec, shards, partial_over_tensor=partial)
    else:
        got = sum_axes(spec, shards, partial_over_tensor=partial)
        assert got == expected, f"{layout_name}, {spec}, partial_over_tensor={partial}: {got}"


def test_a_whole_weight_without_a_spec_is_summed_over_every_token_axis():
    assert sum_axes(None, LAYOUTS["data=2,expert=2,fsdp=2"]) == ("data", "expert", "fsdp")


def test_sum_gradients_sums_each_weight_over_its_axes():
    """On a data 2 x expert 2 x tensor 2 mesh, each device's gradient is ``d + 10 e + 100 t`` (its
    indices along those axes), so a sum over the wrong axes gives a different number."""
    mesh = build_mesh(dew.MeshSpec(expert=2, tensor=2))
    shards = Shards(axis_sizes=dict(mesh.shape))
    specs = {"whole": P(), "experts": P("expert", None), "norm": P()}
    partial = {"whole": False, "experts": False, "norm": True}

    def local(_):
        index = {a: jax.lax.axis_index(a).astype(jnp.float32) for a in ("data", "expert", "tensor")}
        v = index["data"] + 10 * index["expert"] + 100 * index["tensor"]
        grads = {
            "whole": jnp.full((3,), v),
            "experts": jnp.full((1, 3), v),
            "norm": jnp.full((3,), v),
        }
        summed = data.sum_gradients(grads, specs, shards, partial_over_tensor=partial)
        return {k: g.reshape(-1)[0].reshape((1,) * len(AXES)) for k, g in summed.items()}

    got = jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=P(), out_specs=P(*AXES), check_vma=False)
    )(jnp.zeros(()))
    d, e, f, t, s, st = np.indices(mesh.devices.shape)
    v = (d + 10 * e + 100 * t).astype(np.float32)

    def summed_over(*axes):
        return np.broadcast_to(
            v.sum(axis=tuple(AXES.index(a) for a in axes), keepdims=True), v.shape
        )

    expected = {
        "whole": summed_over("data", "expert"),
        "experts": summed_over("data"),
        "norm": summed_over("data", "expert", "tensor"),
    }
    for name in expected:
        np.testing.assert_array_equal(np.asarray(got[name]), expected[name], err_msg=name)
