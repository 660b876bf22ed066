"""The collective reader: counts, axes and bytes of hand-written shard_map steps and of XLA HLO."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dew.collectives import CollectiveReport, CollectiveRow, collectives, hlo_collectives

F32 = 4


@pytest.fixture(scope="module")
def mesh():
    # Auto axes: the mesh the step engine builds (jax.make_mesh would default to Explicit).
    return Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "fsdp"))


def smap(fn, mesh, in_specs, out_specs):
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


def ring(n):
    return [(i, (i + 1) % n) for i in range(n)]


X = jax.ShapeDtypeStruct((32, 16), jnp.float32)  # rows over data x fsdp: (4, 16) per device
LOCAL_X = 4 * 16 * F32


def test_psum_over_data_counts_once_with_ring_bytes(mesh):
    f = smap(lambda x: lax.psum(x, "data"), mesh, P(("data", "fsdp")), P("fsdp"))
    report = collectives(f, X)
    assert report.rows == (
        CollectiveRow("psum", ("data",), 1, LOCAL_X, 2 * (2 - 1) * LOCAL_X // 2),
    )
    assert report.rows[0].shapes == ("f32[4,16]",)


def test_collective_in_scan_of_8_counts_8_and_nested_loops_multiply(mesh):
    def body(c, _):
        return lax.ppermute(c, "fsdp", ring(4)), None

    def one_loop(x):
        return lax.scan(body, x, None, length=8)[0]

    def nested(x):
        return lax.scan(lambda c, _: (one_loop(c), None), x, None, length=3)[0]

    spec = P(("data", "fsdp"))
    report = collectives(smap(one_loop, mesh, spec, spec), X)
    assert report.count("ppermute", "fsdp") == 8
    assert report.operand_bytes("ppermute") == 8 * LOCAL_X
    assert report.wire_bytes("ppermute") == 8 * LOCAL_X
    assert collectives(smap(nested, mesh, spec, spec), X).count("ppermute") == 24


def test_gradient_of_all_gather_is_psum_scatter_over_fsdp(mesh):
    def loss(w, x):
        whole = lax.all_gather(w, "fsdp", axis=0, tiled=True)  # (16, 16): 1 KiB
        return lax.psum(jnp.sum(jnp.tanh(x @ whole)), ("data", "fsdp"))

    f = smap(loss, mesh, (P("fsdp"), P(("data", "fsdp"))), P())
    w = jax.ShapeDtypeStruct((16, 16), jnp.float32)
    report = collectives(jax.grad(f), w, X)
    whole, shard = 16 * 16 * F32, 4 * 16 * F32
    assert report.count("all_gather", "fsdp") == 1
    assert report.operand_bytes("all_gather") == shard
    assert report.wire_bytes("all_gather") == 3 * shard  # (n-1)/n of the gathered whole
    assert report.count("psum_scatter", "fsdp") == 1
    assert report.operand_bytes("psum_scatter", "fsdp") == whole
    assert report.wire_bytes("psum_scatter", "fsdp") == whole * 3 // 4
    # The weight is replicated over data: its gradient is summed there by the transpose of pvary.
    # (axis="data" also matches the loss's scalar psum over data and fsdp: 2 * 7/8 * 4 B = 7 B.)
    assert report.wire_bytes("psum", "data") == whole + 7
    assert report.count("psum_scatter", "data") == 0


def test_psum_over_two_axes_lists_both_in_mesh_order_with_n_8(mesh):
    f = smap(lambda x: lax.psum(x, ("fsdp", "data")), mesh, P(("data", "fsdp")), P())
    (row,) = collectives(f, X).rows
    assert row.axes == ("data", "fsdp")
    assert row.wire_bytes == 2 * 7 * LOCAL_X // 8


def test_ppermute_sends_its_operand_unless_every_pair_stays(mesh):
    spec = P(("data", "fsdp"))
    moved = collectives(smap(lambda x: lax.ppermute(x, "fsdp", ring(4)), mesh, spec, spec), X)
    assert moved.rows == (CollectiveRow("ppermute", ("fsdp",), 1, LOCAL_X, LOCAL_X),)
    identity = [(i, i) for i in range(4)]
    stays = collectives(smap(lambda x: lax.ppermute(x, "fsdp", identity), mesh, spec, spec), X)
    assert stays.rows == (CollectiveRow("ppermute", ("fsdp",), 1, LOCAL_X, 0),)


def test_all_to_all_and_pmax(mesh):
    def f(x):
        y = lax.all_to_all(x, "fsdp", 0, 0, tiled=True)
        return lax.pmax(y, "data")

    spec = P(("data", "fsdp"))
    report = collectives(smap(f, mesh, spec, spec), X)
    assert report.rows == (
        CollectiveRow("pmax", ("data",), 1, LOCAL_X, LOCAL_X),
        CollectiveRow("all_to_all", ("fsdp",), 1, LOCAL_X, LOCAL_X * 3 // 4),
    )


def test_jit_and_checkpoint_are_walked(mesh):
    def layer(w, x):
        return jnp.tanh(x @ lax.all_gather(w, "fsdp", axis=0, tiled=True))

    def loss(w, x):
        return lax.psum(jnp.sum(jax.checkpoint(layer)(w, x)), ("data", "fsdp"))

    f = smap(loss, mesh, (P("fsdp"), P(("data", "fsdp"))), P())
    w = jax.ShapeDtypeStruct((16, 16), jnp.float32)
    plain = collectives(f, w, X)
    assert plain.count("all_gather") == 1
    assert collectives(jax.jit(f), w, X) == plain
    assert collectives(jax.jit(lambda w, x: jax.jit(f)(w, x) * 2), w, X) == plain
    # Under grad the checkpointed layer runs again in the backward: it gathers a second time.
    assert collectives(jax.grad(f), w, X).count("all_gather", "fsdp") == 2


def test_while_and_cond_rows_are_marked_approximate(mesh):
    def f(x):
        _, y = lax.while_loop(
            lambda c: c[0] < 3, lambda c: (c[0] + 1, lax.ppermute(c[1], "fsdp", ring(4))), (0, x)
        )
        z = lax.cond(x[0, 0] > 0, lambda: lax.all_to_all(x, "fsdp", 0, 0, tiled=True), lambda: x)
        return y + z

    spec = P(("data", "fsdp"))
    report = collectives(smap(f, mesh, spec, spec), X)
    assert report.rows == (
        CollectiveRow("ppermute", ("fsdp",), 1, LOCAL_X, LOCAL_X, approximate=True),
        CollectiveRow("all_to_all", ("fsdp",), 1, LOCAL_X, LOCAL_X * 3 // 4, approximate=True),
    )
    assert report.approximate
    assert "* approximate" in str(report)


def test_axes_of_size_1_are_listed_in_mesh_order_with_no_wire_bytes():
    # Dew's six axes: mesh order is not alphabetical (tensor before sequence).
    names = ("data", "expert", "fsdp", "tensor", "sequence", "stage")
    mesh = Mesh(np.array(jax.devices()).reshape(2, 1, 4, 1, 1, 1), names)
    spec = P(("data", "fsdp"))
    f = smap(lambda x: lax.psum(x, ("sequence", "tensor")), mesh, spec, spec)
    report = collectives(f, X)
    assert report.rows == (CollectiveRow("psum", ("tensor", "sequence"), 1, LOCAL_X, 0),)
    assert report.axis_names == names and report.axis_sizes == (2, 1, 4, 1, 1, 1)


def fsdp_step(mesh, *, extra=None, sum_over="data"):
    """A small step: gather over fsdp, then a psum of the loss; variants add or move collectives."""

    def loss(w, x):
        h = x @ lax.all_gather(w, "fsdp", axis=0, tiled=True)
        if extra == "ppermute":
            h = lax.ppermute(h, "fsdp", ring(4))
        total = jnp.sum(h)
        if sum_over is not None:
            total = lax.psum(total, sum_over)
        return total[None]

    # The loss varies over the axes it was not summed over.
    out = {None: P(("data", "fsdp")), "data": P("fsdp"), "fsdp": P("data")}[sum_over]
    return smap(loss, mesh, (P("fsdp"), P(("data", "fsdp"))), out)


def test_report_notices_a_collective_added_dropped_or_moved(mesh):
    w = jax.ShapeDtypeStruct((16, 16), jnp.float32)
    base = collectives(fsdp_step(mesh), w, X)
    assert base.diff(base) == ()

    added = collectives(fsdp_step(mesh, extra="ppermute"), w, X)
    assert added != base
    assert added.diff(base) == ("- ppermute over fsdp: count 1, operand 256 B, wire 256 B",)
    assert base.diff(added) == ("+ ppermute over fsdp: count 1, operand 256 B, wire 256 B",)

    dropped = collectives(fsdp_step(mesh, sum_over=None), w, X)
    assert base.diff(dropped) == ("- psum over data: count 1, operand 4 B, wire 4 B",)

    moved = collectives(fsdp_step(mesh, sum_over="fsdp"), w, X)
    assert base.count("psum", "fsdp") == 0 and moved.count("psum", "fsdp") == 1
    assert base.diff(moved) == (
        "- psum over data: count 1, operand 4 B, wire 4 B",
        "+ psum over fsdp: count 1, operand 4 B, wire 6 B",
    )


def test_query_methods_table_and_json(mesh):
    def f(w, x):
        whole = lax.all_gather(w, "fsdp", axis=0, tiled=True)
        h = lax.scan(
            lambda c, _: (lax.ppermute(c, "fsdp", ring(4)), None), x @ whole, None, length=2
        )[0]
        return lax.psum(h, "data"), lax.psum(jnp.sum(h), ("data", "fsdp"))

    f = smap(f, mesh, (P("fsdp"), P(("data", "fsdp"))), (P("fsdp"), P()))
    report = collectives(f, jax.ShapeDtypeStruct((16, 16), jnp.float32), X)
    shard = 4 * 16 * F32
    assert report.count() == 1 + 2 + 1 + 1
    assert report.count(axis="data") == 2
    assert report.count(op="psum") == 2
    assert report.operand_bytes("psum", "fsdp") == F32
    assert report.wire_bytes(op="all_gather", axis="fsdp") == 3 * shard
    assert report.wire_bytes() == 3 * shard + 2 * shard + shard + 7
    assert report.by_axis() == {"data": shard + 7, "fsdp": 3 * shard + 2 * shard + 7}
    with pytest.raises(ValueError, match="allgather"):
        report.count(op="allgather")
    with pytest.raises(ValueError, match="tensor"):
        report.wire_bytes(axis="tensor")

    rows = json.loads(json.dumps(report.to_json()))
    assert [(r["op"], r["axes"], r["count"], r["wire_bytes"]) for r in rows] == [
        ("all_gather", ["fsdp"], 1, 3 * shard),
        ("psum", ["data"], 1, shard),
        ("psum", ["data", "fsdp"], 1, 7),
        ("ppermute", ["fsdp"], 2, 2 * shard),
    ]

    table = str(report).splitlines()
    assert table[0].split() == ["op", "axes", "count", "operand", "bytes", "wire", "bytes"]
    assert table[2].split() == ["all_gather", "fsdp", "1", "256", "B", "768", "B"]
    assert table[4].split() == ["psum", "data,fsdp", "1", "4", "B", "7", "B"]
    assert table[5].split() == ["ppermute", "fsdp", "2", "512", "B", "512", "B"]
    assert table[7].split() == ["total", "5", "1.0", "KiB", "1.5", "KiB"]
    # Columns line up: every count ends in the same column.
    assert len({line.index(" B ") for line in table[2:6]}) == 1
    # Per axis: data has its psum (256 B) and the two-axis psum (7 B); fsdp 768 + 512 + 7 B.
    assert table[-3:] == [
        "wire bytes per axis (a row over several axes counts under each):",
        "  data       263 B (size 2)",
        "  fsdp     1.3 KiB (size 4)",
    ]


def test_reports_compare_equal_by_rows_only():
    a = CollectiveReport(
        rows=(
            CollectiveRow("psum", ("data",), 1, 8, 8),
            CollectiveRow("all_gather", ("fsdp",), 1, 8, 24, shapes=("f32[2]",)),
        ),
        axis_names=("data", "fsdp"),
        axis_sizes=(2, 4),
    )
    b = CollectiveReport(
        rows=(
            CollectiveRow("all_gather", ("fsdp",), 1, 8, 24),
            CollectiveRow("psum", ("data",), 1, 8, 8),
        )
    )
    assert a == b and a.rows[0].op == "all_gather"
    assert a != CollectiveReport(rows=(CollectiveRow("psum", ("data",), 2, 16, 16),))


def test_bad_input_is_refused(mesh):
    with pytest.raises(TypeError, match="function"):
        collectives("not a function")
    f = jax.jit(lambda x: x * 2)
    with pytest.raises(ValueError, match="compile"):
        hlo_collectives(f.lower(jnp.ones(4)), mesh)
    with pytest.raises(ValueError, match="Mesh"):
        hlo_collectives(f.lower(jnp.ones(4)).compile(), ("data", "fsdp"))


# ------------------------------------------------------------------------------------------------
# The HLO reader


def test_hlo_of_gspmd_function_finds_all_reduce_over_data_and_all_gather_over_fsdp(mesh):
    def f(x, w):
        return x.sum(0), w * 2

    sharded = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    g = jax.jit(
        f,
        in_shardings=(sharded(P("data", None)), sharded(P("fsdp", None))),
        out_shardings=(sharded(P()), sharded(P())),
    )
    compiled = g.lower(jnp.ones((8, 16)), jnp.ones((16, 16))).compile()
    report = hlo_collectives(compiled, mesh)
    # x.sum(0) over rows split on data: an all-reduce of a (16,) partial sum over data.
    # w * 2 replicated from a split over fsdp: an all-gather of the (4, 16) shard over fsdp.
    assert report.rows == (
        CollectiveRow("all_gather", ("fsdp",), 1, 4 * 16 * F32, 3 * 4 * 16 * F32),
        CollectiveRow("psum", ("data",), 1, 16 * F32, 16 * F32),
    )
    assert report.axis_names == ("data", "fsdp")
    # Replica groups name the executable's devices: read against a mesh that orders them otherwise
    # (rows {0,2,4,6} and {1,3,5,7}), neither the gather over {0..3},{4..7} nor the sum over
    # {0,4},{1,5},... is one of its axes.
    other = Mesh(np.array(jax.devices()).reshape(4, 2).T, ("data", "fsdp"))
    assert [row.axes for row in hlo_collectives(compiled, other).rows] == [("?",), ("?",)]


def test_hlo_multiplies_by_loop_trip_counts_and_follows_permuted_devices():
    order = [3, 1, 0, 2, 7, 5, 6, 4]
    mesh = Mesh(np.array(jax.devices())[order].reshape(2, 4), ("data", "fsdp"))

    def f(w, x):
        return jnp.sum(lax.scan(lambda c, wl: (jnp.tanh(c @ wl), None), x, w)[0])

    sharded = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    g = jax.jit(
        f,
        in_shardings=(sharded(P(None, "fsdp")), sharded(P(("data", "fsdp")))),
        out_shardings=sharded(P()),
    )
    report = hlo_collectives(g.lower(jnp.ones((8, 16, 16)), jnp.ones((32, 16))).compile(), mesh)
    # Each of the 8 layers gathers its (4, 16) slice of weights over fsdp.
    assert report.count("all_gather", "fsdp") == 8
    assert report.operand_bytes("all_gather", "fsdp") == 8 * 4 * 16 * F32
    assert all(row.axes != ("?",) for row in report.rows), report


def test_hlo_of_shard_map_step_equals_its_jaxpr_report(mesh):
    def f(w, x):
        whole = lax.all_gather(w, "fsdp", axis=0, tiled=True)
        h = lax.scan(
            lambda c, _: (lax.ppermute(c, "fsdp", ring(4)), None), x @ whole, None, length=8
        )[0]
        h = lax.all_to_all(h, "fsdp", 0, 0, tiled=True)
        g = lax.psum_scatter(whole, "fsdp", scatter_dimension=0, tiled=True)
        return lax.psum(jnp.sum(h), ("data", "fsdp")), lax.pmax(g, "data")

    step = jax.jit(smap(f, mesh, (P("fsdp"), P(("data", "fsdp"))), (P(), P("fsdp"))))
    w, x = jnp.ones((16, 16)), jnp.ones((32, 16))
    from_jaxpr = collectives(step, w, x)
    from_hlo = hlo_collectives(step.lower(w, x).compile(), mesh)
    assert from_hlo == from_jaxpr, from_jaxpr.diff(from_hlo)
    assert {row.op for row in from_hlo.rows} == {
        "all_gather",
        "psum_scatter",
        "psum",
        "pmax",
        "ppermute",
        "all_to_all",
    }


HLO_TEXT = """\
HloModule handwritten, entry_computation_layout={(f32[4,16]{1,0})->f32[4,16]{1,0}}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add.1 = f32[] add(%a, %b)
}

%max (a.1: f32[], b.1: f32[]) -> f32[] {
  %a.1 = f32[] parameter(0)
  %b.1 = f32[] parameter(1)
  ROOT %maximum = f32[] maximum(%a.1, %b.1)
}

%body (p: (s32[], f32[4,16])) -> (s32[], f32[4,16]) {
  %p = (s32[], /*index=1*/f32[4,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[4,16]{1,0} get-tuple-element(%p), index=1
  %all-gather-start = (f32[4,16]{1,0}, f32[16,16]{1,0}) all-gather-start(%x), channel_id=1, \
replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true
  %all-gather-done = f32[16,16]{1,0} all-gather-done(%all-gather-start)
  %cp = f32[4,16]{1,0} collective_permute(%x), channel_id=2, \
source_target_pairs={{0,1},{1,2},{2,3},{3,0},{4,5},{5,6},{6,7},{7,4}}
  ROOT %t = (s32[], f32[4,16]{1,0}) tuple(%i, %cp)
}

%cond (q: (s32[], f32[4,16])) -> pred[] {
  %q = (s32[], f32[4,16]{1,0}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %n = s32[] constant(8)
  ROOT %lt = pred[] compare(%j, %n), direction=LT
}

ENTRY %main (x.1: f32[4,16]) -> f32[4,16] {
  %x.1 = f32[4,16]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[4,16]{1,0}) tuple(%zero, %x.1)
  %while = (s32[], f32[4,16]{1,0}) while(%init), condition=%cond, body=%body, \
backend_config={"known_trip_count":{"n":"8"}}
  %y = f32[4,16]{1,0} get-tuple-element(%while), index=1
  %v = bf16[8]{0} constant({0, 0, 0, 0, 0, 0, 0, 0})
  %ar = (f32[4,16]{1,0}, bf16[8]{0}) all-reduce(%y, %v), channel_id=3, \
replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true, to_apply=%add
  %ar0 = f32[4,16]{1,0} get-tuple-element(%ar), index=0
  %all_reduce_max = f32[4,16]{1,0} all-reduce-start(%ar0), channel_id=4, \
replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%max
  %done = f32[4,16]{1,0} all-reduce-done(%all_reduce_max)
  %rs = f32[1,16]{1,0} reduce-scatter(%done), channel_id=5, \
replica_groups=mesh['x'=8] {'x':(2)4}, use_global_device_ids=true, dimensions={0}, to_apply=%add
  %ag = f32[2,16]{1,0} all-gather(%rs), channel_id=6, \
replica_groups=mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0)) {'b'}, dimensions={0}
  %odd = f32[4,16]{1,0} all-to-all(%done), channel_id=7, replica_groups={{0,1},{2,3},{4,5},{6,7}}, \
dimensions={0}
  ROOT %out = f32[4,16]{1,0} add(%odd, %odd)
}
"""


def test_hlo_text_forms_async_pairs_iota_and_mesh_groups(mesh):
    report = hlo_collectives(HLO_TEXT, mesh)
    x, half = 4 * 16 * F32, 1 * 16 * F32
    assert report.rows == (
        # mesh['a'=4,'b'=2] over devices arange(8).reshape(2,4).T: 'b' pairs i with i + 4: data.
        CollectiveRow("all_gather", ("data",), 1, half, half),
        # async start/done counted once, inside a while of 8; [2,4]<=[8] rows are the fsdp groups.
        CollectiveRow("all_gather", ("fsdp",), 8, 8 * x, 8 * 3 * x),
        # mesh['x'=8] {'x':(2)4}: the minor 4 of 8 devices, i.e. fsdp.
        CollectiveRow("psum_scatter", ("fsdp",), 1, x, x * 3 // 4),
        # [4,2]<=[2,4]T(1,0) pairs device i with i + 4: data. Tuple operands summed (bf16 = 2 B).
        CollectiveRow("psum", ("data",), 1, x + 8 * 2, x + 8 * 2),
        # all-reduce-start with a max reduction over every device.
        CollectiveRow("pmax", ("data", "fsdp"), 1, x, 2 * x * 7 // 8),
        CollectiveRow("ppermute", ("fsdp",), 8, 8 * x, 8 * x),
        # Pairs {0,1},{2,3}... are no set of mesh axes.
        CollectiveRow("all_to_all", ("?",), 1, x, x // 2),
    )


def test_hlo_text_groups_are_positions_in_the_mesh(mesh):
    # Text alone carries no device assignment: logical id i is the i-th device of mesh.devices.
    transposed = Mesh(np.array(jax.devices()).reshape(4, 2).T, ("data", "fsdp"))
    assert hlo_collectives(HLO_TEXT, transposed) == hlo_collectives(HLO_TEXT, mesh)


# ------------------------------------------------------------------------------------------------
# The package: `dew.collectives` is both the function users call and the package they import from


def test_dew_collectives_calls_the_reader_and_every_import_path_finds_the_package(mesh):
    import importlib
    import sys

    import dew
    import dew.collectives as package
    import dew.collectives.hlo as hlo_module
    from dew.collectives import jaxpr as jaxpr_module

    f = smap(lambda x: lax.psum(x, "data"), mesh, P(("data", "fsdp")), P("fsdp"))
    assert dew.collectives(f, X) == collectives(f, X)
    assert dew.collectives(f, X).count("psum", axis="data") == 1
    assert package is sys.modules["dew.collectives"] is dew.collectives
    assert dew.collectives.hlo_collectives is hlo_module.hlo_collectives is hlo_collectives
    assert jaxpr_module.collectives is collectives
    assert dew.CollectiveReport is CollectiveReport
    with pytest.raises(TypeError, match="needs a function to trace"):
        dew.collectives("not a function")
    # The report moved into the package whole: no alias module is left behind.
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("dew.collective_report")


def test_primitive_spellings_live_only_in_the_primitives_table():
    from pathlib import Path

    from dew.collectives import OPS, primitives

    spellings = set(primitives.JAXPR_PRIMITIVES) | set(primitives.HLO_OPCODES)
    assert set(primitives.JAXPR_PRIMITIVES.values()) <= set(OPS)
    assert set(primitives.HLO_OPCODES.values()) <= set(OPS)
    # A spelling that is not also an op name must not be written in a reader: a JAX release that
    # renames it would then need edits in two places.
    only_spellings = spellings - set(OPS)
    package = Path(primitives.__file__).parent
    for module in sorted(package.glob("*.py")):
        if module.name == "primitives.py":
            continue
        text = module.read_text()
        written = sorted(name for name in only_spellings if f'"{name}"' in text)
        assert not written, f"{module.name} spells {written}; look them up in primitives.py"
