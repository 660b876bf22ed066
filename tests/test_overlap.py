"""``hlo_overlap``: which collective bytes of a scheduled step run beside compute, on hand-written
scheduled HLO modules (each number worked out by hand below), and on the TPU compiler's own
scheduled HLO of a tiny model, where the split adds up to ``hlo_collectives``' bytes.

Every module runs on 8 devices in one group. The bytes by hand (``report.ring_wire_bytes``):

- an all-gather of f32[4] (16 bytes): (8 - 1) x 16 = 112 wire bytes;
- an all-reduce of f32[8] (32 bytes): 2 x 7/8 x 32 = 56;
- a reduce-scatter of f32[32] (128 bytes): 7/8 x 128 = 112;
- a collective-permute of f32[4] to another device: 16.
"""

import jax
import optax
import pytest

import dew
from dew import MeshSpec
from dew.collectives import hlo_collectives
from dew.collectives.overlap import hlo_overlap
from dew.mesh import build_mesh
from dew.objectives.lm import LMObjective
from dew.targets import target
from tests.helpers import tpu_width_step

GROUP = "replica_groups={{0,1,2,3,4,5,6,7}}"
GATHER = 112
ALL_REDUCE = 56
REDUCE_SCATTER = 112
PERMUTE = 16

SUM = """%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%matmul (x: f32[32,32], y: f32[32,32]) -> f32[32,32] {
  %x = f32[32,32]{1,0} parameter(0)
  %y = f32[32,32]{1,0} parameter(1)
  ROOT %d = f32[32,32]{1,0} dot(%x, %y), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""

# A matmul fusion: the compute that can run while a collective travels.
MATMUL = "%mm{k} = f32[32,32]{{1,0}} fusion(%w, %w), kind=kOutput, calls=%matmul"


def module(body: str, params: str = "") -> str:
    """An ENTRY computation holding ``body`` (in scheduled order), after the shared computations;
    ``%x`` is f32[4], ``%v`` f32[8], ``%y`` f32[32] and ``%w`` f32[32,32]."""
    return f"""HloModule scheduled, is_scheduled=true

{SUM}
{params}
ENTRY %main (x: f32[4], v: f32[8], y: f32[32], w: f32[32,32]) -> f32[] {{
  %x = f32[4]{{0}} parameter(0)
  %v = f32[8]{{0}} parameter(1)
  %y = f32[32]{{0}} parameter(2)
  %w = f32[32,32]{{1,0}} parameter(3)
{body}
  ROOT %out = f32[] constant(0)
}}
"""


def gather_pair(between: str, k: int = 0) -> str:
    """An async all-gather of ``%x`` with ``between`` scheduled between its start and done."""
    return f"""  %ags{k} = (f32[4]{{0}}, f32[32]{{0}}) all-gather-start(%x), channel_id={k + 1}, \
{GROUP}, dimensions={{0}}, use_global_device_ids=true
{between}
  %agd{k} = f32[32]{{0}} all-gather-done(%ags{k})"""


@pytest.fixture(scope="module")
def mesh():
    return build_mesh(MeshSpec(fsdp=8))


def split(text, mesh) -> tuple[int, int]:
    """(overlapped, exposed) wire bytes, checked to add up to ``hlo_collectives``' total."""
    overlap = hlo_overlap(text, mesh)
    total = sum(r.wire_bytes for r in hlo_collectives(text, mesh).rows)
    assert overlap.overlapped_wire_bytes + overlap.exposed_wire_bytes == total
    return overlap.overlapped_wire_bytes, overlap.exposed_wire_bytes


def test_an_async_gather_with_a_matmul_between_start_and_done_is_overlapped(mesh):
    assert split(module(gather_pair(MATMUL.format(k=0))), mesh) == (GATHER, 0)


def test_an_async_gather_with_nothing_between_is_exposed(mesh):
    # Only what moves or names bytes lies between: a copy to another memory, a bitcast, a
    # tuple element, a scalar (a loop counter's step): none of it is compute.
    between = """  %cs = (f32[32,32]{1,0}, f32[32,32]{1,0}, u32[]) copy-start(%w)
  %bc = f32[1024]{0} bitcast(%w)
  %one = s32[] constant(1)
  %two = s32[] add(%one, %one)
  %cd = f32[32,32]{1,0} copy-done(%cs)"""
    assert split(module(gather_pair(between)), mesh) == (0, GATHER)


def test_another_collective_between_is_not_compute(mesh):
    # A second gather's whole pair, a synchronous all-reduce and a kCustom fusion that is a
    # collective between the first gather's start and done: collectives beside a collective hide
    # nothing, so all four are exposed.
    between = "\n".join(
        [
            gather_pair("", k=1),
            f"  %ar = f32[8]{{0}} all-reduce(%v), channel_id=9, {GROUP}, to_apply=%sum",
            "  %arf = f32[8]{0} fusion(%v), kind=kCustom, calls=%all-reduce.fused",
        ]
    )
    fused = f"""%all-reduce.fused (v: f32[8]) -> f32[8] {{
  %v = f32[8]{{0}} parameter(0)
  ROOT %r = f32[8]{{0}} all-reduce(%v), channel_id=8, {GROUP}, to_apply=%sum
}}
"""
    text = module(gather_pair(between, k=0), params=fused)
    assert split(text, mesh) == (0, 2 * GATHER + 2 * ALL_REDUCE)


def test_a_synchronous_all_reduce_is_exposed(mesh):
    body = f"""  %ar = f32[8]{{0}} all-reduce(%v), channel_id=1, {GROUP}, to_apply=%sum
  {MATMUL.format(k=0)}"""
    assert split(module(body), mesh) == (0, ALL_REDUCE)


def test_a_collective_permute_pair_with_a_matmul_between_is_overlapped(mesh):
    ring = ",".join(f"{{{i},{(i + 1) % 8}}}" for i in range(8))
    body = f"""  %cps = (f32[4]{{0}}, f32[4]{{0}}, u32[], u32[]) collective-permute-start(%x), \
channel_id=1, source_target_pairs={{{ring}}}
  {MATMUL.format(k=0)}
  %cpd = f32[4]{{0}} collective-permute-done(%cps)"""
    assert split(module(body), mesh) == (PERMUTE, 0)


ASYNC_REDUCE_SCATTER = f"""%rs.wrapped (p: f32[32]) -> f32[4] {{
  %p = f32[32]{{0}} parameter(0)
  ROOT %rs = f32[4]{{0}} reduce-scatter(%p), channel_id=1, {GROUP}, dimensions={{0}}, \
to_apply=%sum
}}
"""


@pytest.mark.parametrize("with_matmul", [True, False], ids=["matmul_between", "nothing_between"])
def test_a_reduce_scatter_wrapped_in_async_start_and_done(mesh, with_matmul):
    between = MATMUL.format(k=0) if with_matmul else "  %nothing = f32[] constant(1)"
    body = f"""  %rss = ((f32[32]{{0}}), f32[4]{{0}}, u32[]) async-start(%y), calls=%rs.wrapped
  %rsu = ((f32[32]{{0}}), f32[4]{{0}}, u32[]) async-update(%rss), calls=%rs.wrapped
  {between}
  %rsd = f32[4]{{0}} async-done(%rsu), calls=%rs.wrapped"""
    expected = (REDUCE_SCATTER, 0) if with_matmul else (0, REDUCE_SCATTER)
    assert split(module(body, params=ASYNC_REDUCE_SCATTER), mesh) == expected


def loop_module(trips: int) -> str:
    """A loop of ``trips`` iterations (no ``known_trip_count``: counted from its counter, as the
    TPU compiler's HLO needs) whose body holds an async gather with a matmul beside it and a
    synchronous all-reduce."""
    return f"""HloModule loop, is_scheduled=true

{SUM}
%cond (p: (s32[], f32[4], f32[8], f32[32,32])) -> pred[] {{
  %p = (s32[], f32[4]{{0}}, f32[8]{{0}}, f32[32,32]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant({trips})
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}}

%body (p: (s32[], f32[4], f32[8], f32[32,32])) -> (s32[], f32[4], f32[8], f32[32,32]) {{
  %p = (s32[], f32[4]{{0}}, f32[8]{{0}}, f32[32,32]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[4]{{0}} get-tuple-element(%p), index=1
  %v = f32[8]{{0}} get-tuple-element(%p), index=2
  %w = f32[32,32]{{1,0}} get-tuple-element(%p), index=3
{gather_pair(MATMUL.format(k=0))}
  %ar = f32[8]{{0}} all-reduce(%v), channel_id=2, {GROUP}, to_apply=%sum
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[4]{{0}}, f32[8]{{0}}, f32[32,32]{{1,0}}) tuple(%next, %x, %ar, %mm0)
}}

ENTRY %main (x: f32[4], v: f32[8], w: f32[32,32]) -> (s32[], f32[4], f32[8], f32[32,32]) {{
  %x = f32[4]{{0}} parameter(0)
  %v = f32[8]{{0}} parameter(1)
  %w = f32[32,32]{{1,0}} parameter(2)
  %zero = s32[] constant(0)
  %init = (s32[], f32[4]{{0}}, f32[8]{{0}}, f32[32,32]{{1,0}}) tuple(%zero, %x, %v, %w)
  ROOT %loop = (s32[], f32[4]{{0}}, f32[8]{{0}}, f32[32,32]{{1,0}}) while(%init), \
condition=%cond, body=%body
}}
"""


def test_collectives_in_a_loop_count_once_per_iteration(mesh):
    (gather,) = hlo_overlap(loop_module(6), mesh).overlapped.rows
    assert (gather.op, gather.count) == ("all_gather", 6)
    assert split(loop_module(6), mesh) == (6 * GATHER, 6 * ALL_REDUCE)


# The TPU compiler's chained gather, as its scheduled HLO holds it: a kCustom fusion starts it, a
# matmul fusion continues it, a kCustom fusion finishes it; each holds the whole gather with one
# chain_id. A chain whose start and done sit side by side has nothing beside it.
CHAIN_PIECE = """%piece.NAME (x: f32[4]) -> f32[32] {
  %x = f32[4]{0} parameter(0)
  ROOT %g = f32[32]{0} all-gather(%x), channel_id=CHAIN, GROUP, dimensions={0}, \
frontend_attributes={chain_id="CHAIN"}
}
""".replace("GROUP", GROUP)


CONTINUED = """%continued (x: f32[4], w: f32[32,32]) -> f32[32,32] {
  %x = f32[4]{0} parameter(0)
  %w = f32[32,32]{1,0} parameter(1)
  %g = f32[32]{0} all-gather(%x), channel_id=1, CHAIN1
  ROOT %d = f32[32,32]{1,0} dot(%w, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
""".replace("CHAIN1", GROUP + ', dimensions={0}, frontend_attributes={chain_id="1"}')


def test_a_chained_gather_is_overlapped_by_the_matmuls_that_continue_it(mesh):
    pieces = "".join(
        CHAIN_PIECE.replace("NAME", name).replace("CHAIN", str(chain))
        for name, chain in (("start1", 1), ("done1", 1), ("start2", 2), ("done2", 2))
    )
    body = """  %s1 = f32[32]{0} fusion(%x), kind=kCustom, calls=%piece.start1
  %c1 = f32[32,32]{1,0} fusion(%x, %w), kind=kOutput, calls=%continued
  %d1 = f32[32]{0} fusion(%x), kind=kCustom, calls=%piece.done1
  %s2 = f32[32]{0} fusion(%x), kind=kCustom, calls=%piece.start2
  %d2 = f32[32]{0} fusion(%x), kind=kCustom, calls=%piece.done2"""
    # Chain 1 (start, a matmul continuing it, done) overlapped; chain 2 (start, done) exposed:
    # one gather each, however many pieces.
    assert split(module(body, params=pieces + CONTINUED), mesh) == (GATHER, GATHER)


def tpu_step(engine):
    """``(trainer, compiled)``: a tiny model's step that the TPU compiler overlaps in part (2
    layers, 16 rows of 32 tokens; seconds to compile). The shard_map step is the gathers' step of
    the gradient-sum tests (v5e:2x4, data=2,fsdp=4, width 1024: tests.helpers.tpu_width_step, so
    compiled once in the ``tpu`` worker); the compiler chains its gathers into matmuls from width
    512 (at 256 it schedules every gather alone), and its sums over data add rows of another
    axis. GSPMD's already at 128 (v5e-8, fsdp=8: a compile half as long as at 512)."""
    if engine == "shard_map":
        # The gathers (not "auto"'s rings on TPU): this test reads chained all-gathers.
        return tpu_width_step("v5e:2x4", 1024, (("data", 2), ("fsdp", 4)), "gather")
    seq = 32
    model = dew.models.build(
        "causal_transformer",
        dtype="bfloat16",
        vocab_size=256,
        emb_features=128,
        num_layers=2,
        num_heads=4,
        max_seq_len=seq,
    )
    trainer = dew.Trainer(
        LMObjective(model, seq),
        optax.adamw(1e-3),
        jax.random.key(0),
        mesh=MeshSpec(fsdp=8),
        layout=dew.Layout(min_shard=4096),
        devices=target("v5e-8").devices(),
        engine=engine,
    )
    return trainer, trainer.compiled_step(16)


@pytest.mark.xdist_group("tpu")
@pytest.mark.parametrize("engine", ["shard_map", "gspmd"])
def test_a_tpu_step_splits_every_wire_byte_into_overlapped_or_exposed(engine):
    trainer, compiled = tpu_step(engine)
    overlap = hlo_overlap(compiled, trainer.mesh)
    report = hlo_collectives(compiled, trainer.mesh)
    print(engine, overlap.overlapped_wire_bytes, overlap.exposed_wire_bytes)
    assert overlap.overlapped_wire_bytes + overlap.exposed_wire_bytes == sum(
        r.wire_bytes for r in report.rows
    )
    # Per row too: each (op, axes) of the report is split, calls and operand bytes included.
    for row in report.rows:
        key = (row.op, row.axes)
        parts = [r for r in overlap.overlapped.rows + overlap.exposed.rows if (r.op, r.axes) == key]
        assert sum(p.count for p in parts) == row.count
        assert sum(p.operand_bytes for p in parts) == row.operand_bytes
        assert sum(p.wire_bytes for p in parts) == row.wire_bytes
    # Both engines' weight gathers are chained into the matmuls that use them, in part.
    assert overlap.overlapped.count("all_gather") > 0 and overlap.exposed_wire_bytes > 0


# Programs whose answer is known, compiled for v5e-8 by the TPU compiler and read from its
# schedule: each moves f32[512, 512] pieces (1 MiB; a ppermute's wire bytes are its operand's).
PIECE = (512, 512)
PIECE_BYTES = 512 * 512 * 4


@pytest.fixture(scope="module")
def tpu_ring():
    """``(compile, mesh)``: ``compile(f, outputs)`` compiles ``f(x, w)`` (each device's ``[1,
    512, 512]`` pieces; ``outputs`` arrays out) in a shard_map over the 8 chips of v5e-8."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    tpu_mesh = Mesh(target("v5e-8").devices(), ("fsdp",))
    specs = (P("fsdp"), P("fsdp"))
    args = [jax.ShapeDtypeStruct((8, *PIECE), "float32")] * 2

    def compile_(f, outputs=1):
        out_specs = P("fsdp") if outputs == 1 else (P("fsdp"),) * outputs
        step = jax.shard_map(f, mesh=tpu_mesh, in_specs=specs, out_specs=out_specs, check_vma=False)
        return jax.jit(step).lower(*args).compile()

    return compile_, tpu_mesh


RING = [(i, (i + 1) % 8) for i in range(8)]


@pytest.mark.xdist_group("tpu")
def test_a_tpu_collective_with_independent_compute_beside_it_is_overlapped(tpu_ring):
    compile_, tpu_mesh = tpu_ring

    def independent(x, w):
        # Nothing the matmuls compute waits for the ppermute (two outputs: nothing joins them),
        # so it travels while they run.
        moved = jax.lax.ppermute(x, "fsdp", RING)
        product = jax.numpy.tanh(w[0] @ w[0]) @ w[0]
        return moved, product[None]

    overlap = hlo_overlap(compile_(independent, outputs=2), tpu_mesh)
    assert (overlap.overlapped_wire_bytes, overlap.exposed_wire_bytes) == (PIECE_BYTES, 0)


@pytest.mark.xdist_group("tpu")
def test_a_tpu_collective_whose_result_the_next_op_needs_is_exposed(tpu_ring):
    compile_, tpu_mesh = tpu_ring

    def dependent(x, w):
        # The only compute there is needs what the ppermute brings: nothing can run beside it.
        moved = jax.lax.ppermute(x, "fsdp", RING)
        return (jax.numpy.tanh(moved[0]) @ w[0])[None]

    overlap = hlo_overlap(compile_(dependent), tpu_mesh)
    assert (overlap.overlapped_wire_bytes, overlap.exposed_wire_bytes) == (0, PIECE_BYTES)


@pytest.mark.xdist_group("tpu")
def test_a_tpu_ring_inside_a_scan_is_overlapped_once_per_step(tpu_ring):
    compile_, tpu_mesh = tpu_ring
    steps = 7

    def ring(x, w):
        # fsdp_matmul's pattern: each step's matmul on the piece held, beside the piece's trip
        # to the next device; the scan's trip count multiplies the bytes.
        def step(carry, _):
            piece, total = carry
            return (
                jax.lax.ppermute(piece, "fsdp", RING),
                total + jax.numpy.tanh(piece @ w[0]),
            ), None

        (piece, total), _ = jax.lax.scan(step, (x[0], jax.numpy.zeros(PIECE)), None, length=steps)
        return (piece + total)[None]

    overlap = hlo_overlap(compile_(ring), tpu_mesh)
    assert (overlap.overlapped_wire_bytes, overlap.exposed_wire_bytes) == (steps * PIECE_BYTES, 0)
    assert overlap.overlapped.count("ppermute") == steps


def test_what_is_not_a_compiled_step_and_its_mesh_is_refused_by_name(mesh):
    with pytest.raises(ValueError, match="no HLO module in the text given to hlo_overlap"):
        hlo_overlap("HloModule empty", mesh)
    with pytest.raises(ValueError, match="hlo_overlap needs a jax.sharding.Mesh, got str"):
        hlo_overlap(module(""), "fsdp=8")
