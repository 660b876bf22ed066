"""The report: one row per (collective, mesh axes), totalled over a step, per device.

A row holds, per device and per step:

- ``count``: calls per step; a collective inside a ``scan`` of length 8 counts 8, nested loops
  multiply. Inside a ``while`` of unknown trip count it counts once per iteration and the row is
  marked ``approximate``; so are rows from a ``cond`` whose branches differ (the report then holds
  the larger of each branch's numbers, an upper bound).
- ``operand_bytes``: bytes of the collective's inputs on one device, summed over calls (over every
  operand of a multi-operand ``psum``).
- ``wire_bytes``: bytes one device sends under the usual ring algorithms (``ring_wire_bytes``),
  with ``n`` the product of the sizes of the row's axes and ``b`` the operand bytes of one call:

  ===============  ==========================  =========================================
  op               wire bytes per call          why
  ===============  ==========================  =========================================
  ``all_gather``   ``(n - 1) * b``              ``(n-1)/n`` of the gathered ``n * b``
  ``psum_scatter`` ``(n - 1) / n * b``          ``b`` is the whole array being scattered
  ``psum``         ``2 * (n - 1) / n * b``      a reduce-scatter, then an all-gather
  ``pmax/pmin``    ``2 * (n - 1) / n * b``      as ``psum``
  ``all_to_all``   ``(n - 1) / n * b``          keeps its own ``1/n``, sends the rest
  ``ragged_a2a``   ``(n - 1) / n * b``          ``b`` its static send buffer, as all_to_all
  ``ppermute``     ``b``, or 0                  0 when every pair has source == destination
  ``pbroadcast``   ``(n - 1) / n * b``          a pipelined ring, averaged over devices
  ===============  ==========================  =========================================

  Wire bytes are summed exactly over a row's calls and rounded to whole bytes once. A
  ``ragged_all_to_all`` sends a part of its operand known only at run time (the rows its offsets
  name); its row counts the operand whole, the static buffer: what it sends when the buffer is
  full and spread evenly, an upper bound of the balanced case.
"""

from __future__ import annotations

import dataclasses
import fractions
from typing import Any

from dew.collectives.primitives import OPS, POINT_TO_POINT_OPS

__all__ = ["CollectiveReport", "CollectiveRow", "format_bytes", "ring_wire_bytes"]


def ring_wire_bytes(op: str, n: int, operand_bytes: int, moves: bool = True) -> fractions.Fraction:
    """Bytes one device sends for one call of ``op`` over a group of ``n`` devices, exactly.

    ``operand_bytes`` is the call's input on one device; ``moves`` is False for a point-to-point op
    whose every pair stays on its device. ``n = 1`` gives 0 for every group op. ``op`` may also be
    an ``all_reduce_<reduction>`` or ``reduce_scatter_<reduction>`` the HLO reader names.
    """
    b = fractions.Fraction(operand_bytes)
    if op == "all_gather":
        return (n - 1) * b
    if op in ("psum_scatter", "all_to_all", "ragged_all_to_all", "pbroadcast") or op.startswith(
        "reduce_scatter_"
    ):
        return b * (n - 1) / n
    if op in ("psum", "pmax", "pmin") or op.startswith("all_reduce"):
        return 2 * b * (n - 1) / n
    if op in POINT_TO_POINT_OPS:
        return b if moves else fractions.Fraction(0)
    raise AssertionError(f"no wire formula for {op!r}")


@dataclasses.dataclass(frozen=True)
class CollectiveRow:
    """One collective op on one set of mesh axes, totalled over a step (per device).

    ``shapes`` (the distinct operand shapes, e.g. ``"f32[4,16]"``) is there for debugging and is
    left out of comparisons: two engines may split one array into differently shaped pieces.
    """

    op: str
    axes: tuple[str, ...]
    count: int
    operand_bytes: int
    wire_bytes: int
    approximate: bool = False
    shapes: tuple[str, ...] = dataclasses.field(default=(), compare=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "axes": list(self.axes),
            "count": self.count,
            "operand_bytes": self.operand_bytes,
            "wire_bytes": self.wire_bytes,
            "approximate": self.approximate,
            "shapes": list(self.shapes),
        }


@dataclasses.dataclass(frozen=True, eq=False)
class CollectiveReport:
    """The collectives of one step: rows sorted by op, then axes in mesh order.

    ``collectives``, ``hlo_collectives`` and ``Trainer.collectives`` make one; ``print`` shows it
    as a table with the wire bytes per axis. Two reports are equal when they hold the same rows.
    ``axis_names``/``axis_sizes`` describe the mesh the rows were read against (in mesh order)
    and are not compared, so a report read from the jaxpr equals one read from the HLO of the
    same step (``diff`` says where two differ).

    Attributes:
      rows: ``CollectiveRow`` s, one per (op, axes): ``count``, ``operand_bytes`` and
        ``wire_bytes`` per device per step (the module's table gives the wire formulas).
      axis_names: the mesh's axes, in mesh order.
      axis_sizes: their sizes.

    Examples:
        >>> report = dew.collectives(f, x)  # f psums a float32 [1, 1024] a device over data 8
        >>> report.wire_bytes(), report.by_axis()
        (7168, {'data': 7168})
        >>> report.diff(hlo_collectives(compiled, mesh))  # what XLA's program does differently
        ()
    """

    rows: tuple[CollectiveRow, ...]
    axis_names: tuple[str, ...] = ()
    axis_sizes: tuple[int, ...] = ()

    def __post_init__(self):
        order = {name: i for i, name in enumerate(self.axis_names)}

        def key(row):
            op_rank = OPS.index(row.op) if row.op in OPS else len(OPS)
            return (op_rank, row.op, [order.get(a, len(order)) for a in row.axes], row.axes)

        object.__setattr__(self, "rows", tuple(sorted(self.rows, key=key)))

    def _canonical(self):
        return sorted(self.rows, key=lambda row: (row.op, row.axes))

    def __eq__(self, other):
        if not isinstance(other, CollectiveReport):
            return NotImplemented
        return self._canonical() == other._canonical()

    def __hash__(self):
        return hash(tuple(self._canonical()))

    # -- queries -----------------------------------------------------------------------------------

    def _select(self, op: str | None, axis: str | None) -> list[CollectiveRow]:
        if op is not None and op not in OPS and not any(row.op == op for row in self.rows):
            raise ValueError(f"unknown collective op {op!r}; known ops: {', '.join(OPS)}")
        if axis is not None and axis not in self.axis_names:
            raise ValueError(
                f"axis {axis!r} is not a mesh axis of this report (mesh axes: {self.axis_names}); "
                "a report read from a function without shard_map knows no axes"
            )
        return [
            row
            for row in self.rows
            if (op is None or row.op == op) and (axis is None or axis in row.axes)
        ]

    def count(self, op: str | None = None, axis: str | None = None) -> int:
        """Calls per step of ``op`` (all ops if None) over rows whose axes include ``axis`` (any
        axis if None).

        Raises:
          ValueError: ``op`` is no collective op, or ``axis`` is not one of ``axis_names``.
        """
        return sum(row.count for row in self._select(op, axis))

    def operand_bytes(self, op: str | None = None, axis: str | None = None) -> int:
        """Operand bytes per device per step, over the rows ``count`` would select."""
        return sum(row.operand_bytes for row in self._select(op, axis))

    def wire_bytes(self, op: str | None = None, axis: str | None = None) -> int:
        """Bytes one device sends per step, over the rows ``count`` would select."""
        return sum(row.wire_bytes for row in self._select(op, axis))

    def by_axis(self) -> dict[str, int]:
        """Wire bytes per mesh axis, in mesh order; a row over several axes counts under each."""
        totals = {name: 0 for name in self.axis_names}
        for row in self.rows:
            for axis in row.axes:
                totals[axis] = totals.get(axis, 0) + row.wire_bytes
        return totals

    @property
    def approximate(self) -> bool:
        """Whether any row holds a guess (a ``while`` of unknown trip count, or differing
        branches)."""
        return any(row.approximate for row in self.rows)

    def to_json(self) -> list[dict[str, Any]]:
        """The rows as plain dicts (``json.dumps`` ready)."""
        return [row.to_json() for row in self.rows]

    def diff(self, other: "CollectiveReport") -> tuple[str, ...]:
        """Lines naming what ``other`` adds (``+``), drops (``-``) or changes (``~``) against
        ``self``, one per row that differs, in ``self``'s row order and then ``other``'s.

        Rows are matched by (op, axes): a collective moved to another axis shows as one ``-`` and
        one ``+``. Each line reads ``"<sign> <op> over <axes>: count C, operand O B, wire W B"``
        (``~`` lines show ``self``'s numbers, then ``->`` and ``other``'s). Empty when the reports
        are equal.
        """
        mine = {(row.op, row.axes): row for row in self.rows}
        theirs = {(row.op, row.axes): row for row in other.rows}
        lines = []
        for key in list(mine) + [k for k in theirs if k not in mine]:
            a, b = mine.get(key), theirs.get(key)
            where = f"{key[0]} over {_axes_text(key[1])}"
            if b is None:
                lines.append(f"- {where}: {_row_summary(a)}")
            elif a is None:
                lines.append(f"+ {where}: {_row_summary(b)}")
            elif a != b:
                lines.append(f"~ {where}: {_row_summary(a)} -> {_row_summary(b)}")
        return tuple(lines)

    # -- printing ----------------------------------------------------------------------------------

    def __str__(self) -> str:
        header = ("op", "axes", "count", "operand bytes", "wire bytes")
        body = []
        for row in self.rows:
            body.append(
                (
                    row.op + ("*" if row.approximate else ""),
                    _axes_text(row.axes),
                    str(row.count),
                    format_bytes(row.operand_bytes),
                    format_bytes(row.wire_bytes),
                )
            )
        body.append(
            (
                "total",
                "",
                str(self.count()),
                format_bytes(self.operand_bytes()),
                format_bytes(self.wire_bytes()),
            )
        )
        widths = [max(len(line[i]) for line in [header] + body) for i in range(len(header))]
        right = (False, False, True, True, True)

        def render(cells):
            return "  ".join(
                c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right)
            ).rstrip()

        lines = [render(header), render(tuple("-" * w for w in widths))]
        lines += [render(cells) for cells in body[:-1]]
        lines += [render(tuple("-" * w for w in widths)), render(body[-1])]
        if not self.rows:
            lines.insert(2, "(no collectives)")
        totals = self.by_axis()
        if totals:
            sizes = dict(zip(self.axis_names, self.axis_sizes))
            lines.append("")
            lines.append("wire bytes per axis (a row over several axes counts under each):")
            width = max(len(name) for name in totals)
            for name, total in totals.items():
                size = f" (size {sizes[name]})" if name in sizes else ""
                lines.append(f"  {name.ljust(width)}  {format_bytes(total).rjust(10)}{size}")
        if self.approximate:
            lines.append(
                "* approximate: inside a while loop of unknown trip count (counted once per "
                "iteration) or a cond whose branches differ (the larger branch counted)"
            )
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"CollectiveReport(rows={self.rows!r})"


def format_bytes(n: int) -> str:
    """``1536`` -> ``'1.5 KiB'``; whole bytes below 1 KiB."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def _axes_text(axes: tuple[str, ...]) -> str:
    return ",".join(axes) if axes else "-"


def _row_summary(row: CollectiveRow) -> str:
    return f"count {row.count}, operand {row.operand_bytes} B, wire {row.wire_bytes} B" + (
        " (approximate)" if row.approximate else ""
    )
