"""What the HLO reader needs from the TPU compiler's final HLO, on hand-written modules: loops with
no ``known_trip_count`` (their count read from the loop's counter, widened bodies included), and a
collective split into a chain of fusions (counted once)."""

import pytest

from dew import MeshSpec
from dew.collectives import hlo_collectives
from dew.mesh import build_mesh

GROUP = "replica_groups={{0,1,2,3,4,5,6,7}}"


def loop_module(
    start: int, limit: int, step: int, direction: str, copies: int, counter_first: bool = True
) -> str:
    """A module whose ``while`` runs ``i = start; while i <direction> limit: i += step`` with
    ``copies`` all-gathers of 16 bytes per body (a widened loop holds several), no trip count
    recorded, and copies/bitcasts around the counter as the TPU compiler leaves them.
    ``counter_first=False`` writes the comparison the other way round, ``limit <flipped> i``."""
    update = "add" if step > 0 else "subtract"
    flipped = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE", "NE": "NE"}[direction]
    compare = (
        f"compare(%i.copy, %n), direction={direction}"
        if counter_first
        else f"compare(%n, %i.copy), direction={flipped}"
    )
    gathers = "\n".join(
        f"  %g{k} = f32[32]{{0}} all-gather(%x), channel_id={k + 1}, {GROUP}, dimensions={{0}}"
        for k in range(copies)
    )
    return f"""HloModule loops

%cond (p: (s32[], f32[4])) -> pred[] {{
  %p = (s32[], f32[4]{{0}}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %i.copy = s32[] copy(%i)
  %n = s32[] constant({limit})
  ROOT %cmp = pred[] {compare}
}}

%wide.body (p: (s32[], f32[4])) -> (s32[], f32[4]) {{
  %p = (s32[], f32[4]{{0}}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[4]{{0}} get-tuple-element(%p), index=1
{gathers}
  %s = s32[] constant({abs(step)})
  %next = s32[] {update}(%i, %s)
  ROOT %t = (s32[], f32[4]{{0}}) tuple(%next, %x)
}}

ENTRY %main (a: f32[4]) -> (s32[], f32[4]) {{
  %a = f32[4]{{0}} parameter(0)
  %zero = s32[] constant({start})
  %c = s32[] copy(%zero)
  %init = (s32[], f32[4]{{0}}) tuple(%c, %a)
  ROOT %w = (s32[], f32[4]{{0}}) while(%init), condition=%cond, body=%wide.body
}}
"""


@pytest.fixture(scope="module")
def mesh():
    return build_mesh(MeshSpec(fsdp=8))


def trips_by_running(start: int, limit: int, step: int, direction: str) -> int:
    """The loop run: how many times its body runs, counted one iteration at a time."""
    holds = {
        "LT": lambda i: i < limit,
        "LE": lambda i: i <= limit,
        "GT": lambda i: i > limit,
        "GE": lambda i: i >= limit,
        "NE": lambda i: i != limit,
    }[direction]
    i, trips = start, 0
    while holds(i):
        i, trips = i + step, trips + 1
        assert trips < 1000, "a loop that does not end"
    return trips


# (start, limit, step, direction, copies, trips): the trips counted by hand, and checked against
# the loop run. Each direction, up and down, where the limit is reached exactly (the case an
# inclusive bound's + 1 decides) and where it is stepped over.
LOOPS = [
    (0, 16, 1, "LT", 1, 16),  # a layer scan
    (0, 16, 2, "LT", 2, 8),  # the same scan widened: two layers per body
    (0, 7, 2, "LE", 2, 4),  # 0, 2, 4, 6: 7 is stepped over
    (0, 6, 2, "LE", 1, 4),  # 0, 2, 4, 6: the limit itself runs
    (1, 4, 1, "LE", 1, 4),  # 1, 2, 3, 4
    (5, 5, 1, "LE", 1, 1),  # only the limit
    (5, 0, -1, "GT", 1, 5),  # counting down: 5, 4, 3, 2, 1
    (6, 0, -2, "GE", 1, 4),  # 6, 4, 2, 0: the limit itself runs
    (7, 0, -2, "GE", 1, 4),  # 7, 5, 3, 1: 0 is stepped over
    (3, 3, -1, "GE", 2, 1),  # only the limit
    (-2, 3, 1, "NE", 1, 5),  # -2 .. 2
    (8, 0, -4, "NE", 1, 2),  # 8, 4
    (3, 3, 1, "LT", 1, 0),  # never entered
    (3, 4, -1, "GE", 1, 0),  # never entered, counting down
]


def test_the_loops_hand_counts_are_what_running_them_gives():
    for start, limit, step, direction, _, trips in LOOPS:
        assert trips_by_running(start, limit, step, direction) == trips, (start, limit, step)


@pytest.mark.parametrize("counter_first", [True, False], ids=["i_op_n", "n_op_i"])
@pytest.mark.parametrize("start, limit, step, direction, copies, trips", LOOPS)
def test_a_loop_without_known_trip_count_is_counted_from_its_counter(
    mesh, start, limit, step, direction, copies, trips, counter_first
):
    text = loop_module(start, limit, step, direction, copies, counter_first)
    report = hlo_collectives(text, mesh)
    (row,) = report.rows if trips else (None,)
    if not trips:
        assert report.rows == () or report.rows[0].count == 0
        return
    assert not row.approximate
    assert (row.op, row.axes) == ("all_gather", ("fsdp",))
    assert row.count == trips * copies
    assert row.operand_bytes == trips * copies * 16


def test_a_loop_whose_count_cannot_be_read_stays_approximate(mesh):
    # The limit is a parameter, not a constant: nothing to read, so the row says so.
    text = loop_module(0, 16, 1, "LT", 1).replace(
        "%n = s32[] constant(16)", "%n = s32[] get-tuple-element(%p), index=0"
    )
    (row,) = hlo_collectives(text, mesh).rows
    assert row.approximate and row.count == 1


CHAIN = """HloModule chain

%piece.start (x: f32[4]) -> f32[32] {
  %x = f32[4]{0} parameter(0)
  ROOT %g = f32[32]{0} all-gather(%x), channel_id=1, GATHER3
}

%piece.continue (x: f32[4]) -> f32[32] {
  %x = f32[4]{0} parameter(0)
  ROOT %g = f32[32]{0} all-gather(%x), channel_id=1, GATHER3
}

%piece.done (x: f32[4]) -> f32[32] {
  %x = f32[4]{0} parameter(0)
  ROOT %g = f32[32]{0} all-gather(%x), channel_id=1, GATHER3
}

%other (x: f32[4]) -> f32[32] {
  %x = f32[4]{0} parameter(0)
  ROOT %g = f32[32]{0} all-gather(%x), channel_id=2, GATHER4
}

ENTRY %main (a: f32[4]) -> f32[32] {
  %a = f32[4]{0} parameter(0)
  %s = f32[32]{0} fusion(%a), kind=kCustom, calls=%piece.start
  %c = f32[32]{0} fusion(%a), kind=kCustom, calls=%piece.continue
  %d = f32[32]{0} fusion(%a), kind=kCustom, calls=%piece.done
  ROOT %o = f32[32]{0} fusion(%a), kind=kCustom, calls=%other
}
""".replace("GATHER3", GROUP + ', dimensions={0}, frontend_attributes={chain_id="3"}').replace(
    "GATHER4", GROUP + ', dimensions={0}, frontend_attributes={chain_id="4"}'
)


def test_a_collective_chained_over_fusions_counts_once(mesh):
    # One gather run as start, continuation and done fusions (chain 3), and another (chain 4).
    (row,) = hlo_collectives(CHAIN, mesh).rows
    assert (row.op, row.count, row.operand_bytes) == ("all_gather", 2, 32)
