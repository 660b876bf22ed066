"""Accumulating a report's rows while a reader walks a program.

Both readers (``jaxpr.py``, ``hlo.py``) build a ``Tallies`` dict per computation, merge the
tallies of nested computations into their caller's (multiplied by a loop's trip count, or the
larger of a conditional's branches) and turn the entry's into a ``CollectiveReport`` at the end.
"""

from __future__ import annotations

import dataclasses
import fractions
from typing import Iterable

from dew.collectives.report import CollectiveReport, CollectiveRow, ring_wire_bytes


@dataclasses.dataclass
class Tally:
    """One (op, axes) row in the making: wire bytes kept exact until the report rounds them."""

    count: int = 0
    operand_bytes: int = 0
    wire_bytes: fractions.Fraction = fractions.Fraction(0)
    approximate: bool = False
    shapes: set = dataclasses.field(default_factory=set)


Tallies = dict  # (op, axes) -> Tally


def add_call(
    tallies: Tallies,
    op: str,
    axes: tuple[str, ...],
    n: int,
    operand_bytes: int,
    shapes: str,
    moves: bool = True,
    approximate: bool = False,
):
    """Record one call of ``op`` over ``axes`` (``n`` devices per group), with its ring wire
    bytes (``ring_wire_bytes``)."""
    tally = tallies.setdefault((op, axes), Tally())
    tally.count += 1
    tally.operand_bytes += operand_bytes
    tally.wire_bytes += ring_wire_bytes(op, n, operand_bytes, moves)
    tally.approximate |= approximate
    tally.shapes.add(shapes)


def merge(into: Tallies, part: Tallies, times: int = 1, approximate: bool = False):
    """Add ``part`` run ``times`` times to ``into``; ``approximate`` flags every merged row."""
    for key, t in part.items():
        tally = into.setdefault(key, Tally())
        tally.count += t.count * times
        tally.operand_bytes += t.operand_bytes * times
        tally.wire_bytes += t.wire_bytes * times
        tally.approximate |= t.approximate or approximate
        tally.shapes |= t.shapes


def max_of_branches(branches: list[Tallies]) -> Tallies:
    """Per (op, axes), the largest numbers any branch has; approximate where branches differ."""
    out: Tallies = {}
    keys = {key for b in branches for key in b}
    for key in keys:
        present = [b.get(key, Tally()) for b in branches]
        same = all(
            (t.count, t.operand_bytes, t.wire_bytes)
            == (present[0].count, present[0].operand_bytes, present[0].wire_bytes)
            for t in present
        )
        out[key] = Tally(
            count=max(t.count for t in present),
            operand_bytes=max(t.operand_bytes for t in present),
            wire_bytes=max(t.wire_bytes for t in present),
            approximate=any(t.approximate for t in present) or not same,
            shapes=set().union(*(t.shapes for t in present)),
        )
    return out


def to_report(
    tallies: Tallies, axis_names: Iterable[str], axis_sizes: Iterable[int]
) -> CollectiveReport:
    """The report of ``tallies`` on a mesh of ``axis_names`` (in mesh order) of ``axis_sizes``."""
    rows = []
    for (op, axes), t in tallies.items():
        rows.append(
            CollectiveRow(
                op=op,
                axes=axes,
                count=t.count,
                operand_bytes=t.operand_bytes,
                wire_bytes=int(round(t.wire_bytes)),
                approximate=t.approximate,
                shapes=tuple(sorted(t.shapes)),
            )
        )
    return CollectiveReport(
        rows=tuple(rows), axis_names=tuple(axis_names), axis_sizes=tuple(axis_sizes)
    )
