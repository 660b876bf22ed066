"""What a step sends between devices: one row per (collective, mesh axes), read from a program.

Two readers fill the same report, so two ways of writing a step compare byte for byte:

- ``collectives(fn, *args)`` traces ``fn`` (anything that uses ``jax.shard_map``, jitted or not) to
  a jaxpr and lists every collective in it, inside ``jit``, ``scan``, ``while``, ``cond``,
  ``checkpoint``, custom-derivative calls and nested ``shard_map`` alike.
- ``hlo_collectives(compiled, mesh)`` reads the collectives XLA put in a compiled executable (the
  GSPMD baseline, where the partitioner invents the communication) and maps their replica groups
  back to mesh axes.

A row holds, per device and per step:

- ``count``: calls per step; a collective inside a ``scan`` of length 8 counts 8, nested loops
  multiply. Inside a ``while`` of unknown trip count it counts once per iteration and the row is
  marked ``approximate``; so are rows from a ``cond`` whose branches differ (the report then holds
  the larger of each branch's numbers, an upper bound).
- ``operand_bytes``: bytes of the collective's inputs on one device, summed over calls (over every
  operand of a multi-operand ``psum``).
- ``wire_bytes``: bytes one device sends under the usual ring algorithms, with ``n`` the product of
  the sizes of the row's axes and ``b`` the operand bytes of one call:

  ===============  ==========================  =========================================
  op               wire bytes per call          why
  ===============  ==========================  =========================================
  ``all_gather``   ``(n - 1) * b``              ``(n-1)/n`` of the gathered ``n * b``
  ``psum_scatter`` ``(n - 1) / n * b``          ``b`` is the whole array being scattered
  ``psum``         ``2 * (n - 1) / n * b``      a reduce-scatter, then an all-gather
  ``pmax/pmin``    ``2 * (n - 1) / n * b``      as ``psum``
  ``all_to_all``   ``(n - 1) / n * b``          keeps its own ``1/n``, sends the rest
  ``ppermute``     ``b``, or 0                  0 when every pair has source == destination
  ``pbroadcast``   ``(n - 1) / n * b``          a pipelined ring, averaged over devices
  ===============  ==========================  =========================================

  Wire bytes are summed exactly over a row's calls and rounded to whole bytes once.

Axes of size 1: the jaxpr reader lists a collective over them (its count stays, so a test sees
the call) with 0 wire bytes, which is what the formulas give for ``n = 1``. XLA deletes such
collectives, so the HLO reader never sees them. ``pvary``/``pcast`` and ``axis_index`` move no
bytes and are not collectives here.
"""

from __future__ import annotations

import dataclasses
import fractions
import itertools
import math
import re
from typing import Any, Callable, Iterable

import jax
import numpy as np

__all__ = [
    "OPS",
    "CollectiveReport",
    "CollectiveRow",
    "collectives",
    "format_bytes",
    "hlo_collectives",
]

# The order rows are listed in: forward gathers, backward scatters, reductions, point to point.
OPS = (
    "all_gather",
    "psum_scatter",
    "psum",
    "pmax",
    "pmin",
    "ppermute",
    "all_to_all",
    "ragged_all_to_all",
    "pbroadcast",
    "psend",
)

# jaxpr primitive name -> user-facing op. Several primitives bind one user function in JAX 0.10:
# `psum` binds `psum_invariant` when the shard_map checks varying axes (the default), `psum_scatter`
# binds `reduce_scatter`, and the async `*_start` forms move the same bytes as their sync twins
# (their `*_done` halves move nothing and are not listed).
_JAXPR_OPS = {
    "psum": "psum",
    "psum_invariant": "psum",
    "unreduced_psum": "psum",
    "psum_start": "psum",
    "psum_invariant_start": "psum",
    "unreduced_psum_start": "psum",
    "pmax": "pmax",
    "pmin": "pmin",
    "all_gather": "all_gather",
    "all_gather_invariant": "all_gather",
    "all_gather_reduced": "all_gather",
    "all_gather_start": "all_gather",
    "all_gather_reduced_start": "all_gather",
    "reduce_scatter": "psum_scatter",
    "unreduced_reduce_scatter": "psum_scatter",
    "reduce_scatter_start": "psum_scatter",
    "unreduced_reduce_scatter_start": "psum_scatter",
    "ppermute": "ppermute",
    "ppermute_start": "ppermute",
    "all_to_all": "all_to_all",
    "all_to_all_start": "all_to_all",
    "ragged_all_to_all": "ragged_all_to_all",
    "pbroadcast": "pbroadcast",
    "pbroadcast_start": "pbroadcast",
    "psend": "psend",
}


# ------------------------------------------------------------------------------------------------
# The report


@dataclasses.dataclass(frozen=True)
class CollectiveRow:
    """One collective op on one set of mesh axes, totalled over a step (per device).

    ``shapes`` (the distinct operand shapes, e.g. ``"f32[4,16]"``) is there for debugging and is left
    out of comparisons: two engines may split one array into differently shaped pieces.
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

    Two reports are equal when they hold the same rows. ``axis_names``/``axis_sizes`` describe the
    mesh the rows were read against (in mesh order) and are not compared, so a report read from the
    jaxpr equals one read from the HLO of the same step.
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

    # -- queries ------------------------------------------------------------------------------------

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
        """Calls per step of ``op`` (all ops if None) over rows whose axes include ``axis``."""
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
        """Whether any row holds a guess (a ``while`` of unknown trip count, or differing branches)."""
        return any(row.approximate for row in self.rows)

    def to_json(self) -> list[dict[str, Any]]:
        """The rows as plain dicts (``json.dumps`` ready)."""
        return [row.to_json() for row in self.rows]

    def diff(self, other: "CollectiveReport") -> tuple[str, ...]:
        """Lines naming what ``other`` adds (``+``), drops (``-``) or changes (``~``) against ``self``.

        Rows are matched by (op, axes): a collective moved to another axis shows as one ``-`` and one
        ``+``. Empty when the reports are equal.
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

    # -- printing -----------------------------------------------------------------------------------

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


# ------------------------------------------------------------------------------------------------
# Accumulating rows while walking a program


@dataclasses.dataclass
class _Tally:
    count: int = 0
    operand_bytes: int = 0
    wire_bytes: fractions.Fraction = fractions.Fraction(0)
    approximate: bool = False
    shapes: set = dataclasses.field(default_factory=set)


_Tallies = dict  # (op, axes) -> _Tally


def _add_call(
    tallies: _Tallies,
    op: str,
    axes: tuple[str, ...],
    n: int,
    operand_bytes: int,
    shapes: str,
    moves: bool = True,
    approximate: bool = False,
):
    """Record one call of ``op`` over ``axes`` (``n`` devices per group) with its ring wire bytes."""
    b = fractions.Fraction(operand_bytes)
    if op == "all_gather":
        wire = (n - 1) * b
    elif op in ("psum_scatter", "all_to_all", "ragged_all_to_all", "pbroadcast") or op.startswith(
        "reduce_scatter_"
    ):
        wire = b * (n - 1) / n
    elif op in ("psum", "pmax", "pmin") or op.startswith("all_reduce"):
        wire = 2 * b * (n - 1) / n
    elif op in ("ppermute", "psend"):
        wire = b if moves else fractions.Fraction(0)
    else:
        raise AssertionError(f"no wire formula for {op!r}")
    tally = tallies.setdefault((op, axes), _Tally())
    tally.count += 1
    tally.operand_bytes += operand_bytes
    tally.wire_bytes += wire
    tally.approximate |= approximate
    tally.shapes.add(shapes)


def _merge(into: _Tallies, part: _Tallies, times: int = 1, approximate: bool = False):
    for key, t in part.items():
        tally = into.setdefault(key, _Tally())
        tally.count += t.count * times
        tally.operand_bytes += t.operand_bytes * times
        tally.wire_bytes += t.wire_bytes * times
        tally.approximate |= t.approximate or approximate
        tally.shapes |= t.shapes


def _max_of_branches(branches: list[_Tallies]) -> _Tallies:
    """Per (op, axes), the largest numbers any branch has; approximate where branches differ."""
    out: _Tallies = {}
    keys = {key for b in branches for key in b}
    for key in keys:
        present = [b.get(key, _Tally()) for b in branches]
        same = all(
            (t.count, t.operand_bytes, t.wire_bytes)
            == (present[0].count, present[0].operand_bytes, present[0].wire_bytes)
            for t in present
        )
        out[key] = _Tally(
            count=max(t.count for t in present),
            operand_bytes=max(t.operand_bytes for t in present),
            wire_bytes=max(t.wire_bytes for t in present),
            approximate=any(t.approximate for t in present) or not same,
            shapes=set().union(*(t.shapes for t in present)),
        )
    return out


def _report(tallies: _Tallies, axis_names: Iterable[str], axis_sizes: Iterable[int]):
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


# ------------------------------------------------------------------------------------------------
# The jaxpr reader


def collectives(fn: Callable, *args, **kwargs) -> CollectiveReport:
    """The collectives one call of ``fn(*args, **kwargs)`` runs, read from its jaxpr.

    ``fn`` is any function that uses ``jax.shard_map`` somewhere inside (jitted or not, a whole
    training step or one layer); ``args`` are arrays or ``jax.ShapeDtypeStruct``s of the global
    shapes. Nothing is compiled or run. Axis sizes come from the mesh of each ``shard_map``, so the
    ring factor ``n`` is right for any user's function. A function without ``shard_map`` (or
    ``pmap``) has no named axes and gives an empty report.
    """
    if not callable(fn):
        raise TypeError(f"collectives() needs a function to trace, got {type(fn).__name__}: {fn!r}")
    closed = jax.make_jaxpr(fn)(*args, **kwargs)
    walker = _JaxprWalker()
    tallies = walker.walk(closed.jaxpr, {})
    return _report(tallies, walker.axis_sizes.keys(), walker.axis_sizes.values())


def _as_jaxpr(value) -> Any:
    """The open jaxpr in ``value`` (a Jaxpr or ClosedJaxpr), else None. Duck-typed across versions."""
    if hasattr(value, "eqns") and hasattr(value, "invars"):
        return value
    inner = getattr(value, "jaxpr", None)
    if inner is not None and hasattr(inner, "eqns"):
        return inner
    return None


def _sub_jaxprs(params: dict) -> list:
    found = []
    for value in params.values():
        items = value if isinstance(value, (list, tuple)) else (value,)
        for item in items:
            jaxpr = _as_jaxpr(item)
            if jaxpr is not None:
                found.append(jaxpr)
    return found


def _aval_bytes(aval) -> int:
    shape = getattr(aval, "shape", None)
    dtype = getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return 0  # tokens and other abstract values carry no array bytes
    return math.prod(shape) * np.dtype(dtype).itemsize


def _aval_text(aval) -> str:
    shape = getattr(aval, "shape", None)
    dtype = getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return str(aval)
    return f"{_short_dtype(np.dtype(dtype))}[{','.join(str(d) for d in shape)}]"


_SHORT_DTYPES = {
    "bool": "pred",
    "bfloat16": "bf16",
    "float16": "f16",
    "float32": "f32",
    "float64": "f64",
    "complex64": "c64",
    "complex128": "c128",
}


def _short_dtype(dtype: np.dtype) -> str:
    """numpy dtype -> the HLO spelling (float32 -> f32), so both readers print shapes alike."""
    if dtype.name in _SHORT_DTYPES:
        return _SHORT_DTYPES[dtype.name]
    m = re.fullmatch(r"(u?)int(\d+)", dtype.name)
    if m:
        return ("u" if m.group(1) else "s") + m.group(2)
    return dtype.name  # float8_e4m3fn and friends keep their numpy names


class _JaxprWalker:
    """Walks a jaxpr and every jaxpr nested in its equations' params, tallying collectives."""

    def __init__(self):
        self.axis_sizes: dict[str, int] = {}  # every named axis seen, in mesh order of first sight

    def walk(self, jaxpr, env: dict[str, int]) -> _Tallies:
        tallies: _Tallies = {}
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            params = eqn.params
            if name in _JAXPR_OPS:
                self._record(tallies, _JAXPR_OPS[name], eqn, env)
            inner_env = self._inner_env(name, params, env)
            if name == "scan":
                _merge(
                    tallies,
                    self.walk(_as_jaxpr(params["jaxpr"]), inner_env),
                    times=params["length"],
                )
            elif name == "while":
                # Unknown trip count: one iteration's collectives, flagged as a guess.
                for key in ("cond_jaxpr", "body_jaxpr"):
                    _merge(tallies, self.walk(_as_jaxpr(params[key]), inner_env), approximate=True)
            elif name == "cond":
                branches = [self.walk(_as_jaxpr(b), inner_env) for b in params["branches"]]
                _merge(tallies, _max_of_branches(branches))
            elif name == "linear_call":
                # Only the callee runs; the transpose jaxpr is there for autodiff.
                _merge(tallies, self.walk(_as_jaxpr(params["callee"]), inner_env))
            else:
                for sub in _sub_jaxprs(params):
                    _merge(tallies, self.walk(sub, inner_env))
        return tallies

    def _inner_env(self, name: str, params: dict, env: dict[str, int]) -> dict[str, int]:
        mesh = params.get("mesh")
        if mesh is not None and hasattr(mesh, "axis_names") and hasattr(mesh, "shape"):
            sizes = dict(mesh.shape)
            for axis in mesh.axis_names:
                self.axis_sizes.setdefault(axis, sizes[axis])
            return {**env, **sizes}
        if name == "xla_pmap":
            axis, size = params["axis_name"], params["global_axis_size"]
            self.axis_sizes.setdefault(axis, size)
            return {**env, axis: size}
        return env

    def _record(self, tallies: _Tallies, op: str, eqn, env: dict[str, int]):
        params = eqn.params
        raw = params.get("axes", params.get("axis_name", ()))
        raw = tuple(raw) if isinstance(raw, (tuple, list)) else (raw,)
        # psum may also reduce positional axes (ints): those are local sums, not communication.
        named = tuple(a for a in raw if not isinstance(a, int))
        if not named:
            return
        missing = [a for a in named if a not in env]
        if missing:
            raise ValueError(
                f"{eqn.primitive.name} over axes {named} outside any shard_map or pmap that binds "
                f"{missing}; known axes here: {sorted(env)}"
            )
        order = list(self.axis_sizes)
        axes = tuple(sorted(set(named), key=lambda a: order.index(a) if a in order else len(order)))
        groups = params.get("axis_index_groups")
        n = len(groups[0]) if groups else math.prod(env[a] for a in axes)

        invars = eqn.invars
        if op == "ragged_all_to_all":
            invars = invars[
                :1
            ]  # the rest are the output buffer and offsets; sizes are known at run time
        operand = sum(_aval_bytes(v.aval) for v in invars)
        shapes = ", ".join(_aval_text(v.aval) for v in invars)
        if len(invars) > 1:
            shapes = f"({shapes})"
        moves = True
        if op in ("ppermute", "psend"):
            moves = any(src != dst for src, dst in params["perm"])
        _add_call(
            tallies,
            op,
            axes,
            n,
            operand,
            shapes,
            moves=moves,
            approximate=(op == "ragged_all_to_all"),
        )


# ------------------------------------------------------------------------------------------------
# The HLO reader


_HLO_OPS = {
    "all-gather": "all_gather",
    "all-gather-start": "all_gather",
    "all-reduce": "psum",  # refined by the reduction it applies (max -> pmax, min -> pmin)
    "all-reduce-start": "psum",
    "reduce-scatter": "psum_scatter",
    "collective-permute": "ppermute",
    "collective-permute-start": "ppermute",
    "all-to-all": "all_to_all",
    "ragged-all-to-all": "ragged_all_to_all",
    "collective-broadcast": "pbroadcast",
}
_REDUCTIONS = {"add": "psum", "maximum": "pmax", "minimum": "pmin"}
# Halves of async pairs that only wait: their `calls=` repeats the start's computation.
_NOT_CALLS = {
    "async-done",
    "async-update",
    "all-gather-done",
    "all-reduce-done",
    "collective-permute-done",
}


@dataclasses.dataclass
class _Instruction:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str


@dataclasses.dataclass
class _Computation:
    name: str
    instructions: list[_Instruction]
    shapes: dict[str, str]
    root_opcode: str | None


def hlo_collectives(compiled, mesh) -> CollectiveReport:
    """The collectives of a compiled XLA executable, as the same report ``collectives`` gives.

    Args:
      compiled: ``jax.jit(f).lower(*args).compile()`` (or its ``.as_text()``): a GSPMD program whose
        communication XLA inserted, or a compiled shard_map step.
      mesh: the ``jax.sharding.Mesh`` the program was compiled for. Replica groups are compared with
        the groups each subset of its axes would form over ``mesh.devices``; a group set no subset
        forms gets axes ``("?",)``.

    All-gather, reduce-scatter, all-reduce (psum/pmax/pmin by its reduction), collective-permute and
    all-to-all are read, sync or async (a ``-start``/``-done`` pair counts once), multiplied by the
    trip counts XLA records on enclosing ``while`` loops (``known_trip_count``); a loop without one
    counts once and marks its rows approximate.
    """
    if not (hasattr(mesh, "devices") and hasattr(mesh, "axis_names")):
        raise ValueError(f"hlo_collectives needs a jax.sharding.Mesh, got {type(mesh).__name__}")
    if isinstance(compiled, str):
        text, logical_devices = compiled, None
    elif hasattr(compiled, "compile") and not hasattr(compiled, "runtime_executable"):
        raise ValueError(
            "hlo_collectives reads a compiled executable: XLA inserts GSPMD's "
            "collectives while compiling, so call .compile() on the lowered function"
        )
    elif hasattr(compiled, "as_text"):
        text = compiled.as_text()
        logical_devices = _logical_devices(compiled)
    else:
        raise ValueError(
            f"hlo_collectives needs a jax Compiled object or HLO text, got "
            f"{type(compiled).__name__}"
        )
    if not isinstance(text, str) or "ENTRY" not in text:
        raise ValueError(
            "no HLO module in the text given to hlo_collectives (no ENTRY computation)"
        )
    reader = _HloReader(text, _MeshGroups(mesh, logical_devices))
    tallies = reader.entry_tallies()
    sizes = dict(mesh.shape)
    return _report(tallies, mesh.axis_names, [sizes[a] for a in mesh.axis_names])


def _logical_devices(compiled) -> list[int] | None:
    """Device ids by logical id (the ids HLO replica groups use), when the executable says."""
    try:
        devices = compiled.runtime_executable().local_devices()
    except Exception:  # noqa: BLE001  (a text-only or remote executable: fall back to mesh order)
        return None
    return [d.id for d in devices]


class _MeshGroups:
    """Maps HLO replica groups (logical device ids) to the mesh axes that form them."""

    def __init__(self, mesh, logical_devices: list[int] | None):
        self.names = tuple(mesh.axis_names)
        ids = np.vectorize(lambda d: d.id, otypes=[np.int64])(mesh.devices)
        self.size = ids.size
        if logical_devices is None or len(logical_devices) != ids.size:
            # Without the executable's assignment, logical id i is the i-th device of the mesh.
            logical_devices = list(ids.flat)
        self.device_of = list(logical_devices)
        self.position = {int(d): np.unravel_index(i, ids.shape) for i, d in enumerate(ids.flat)}
        self.axis_size = dict(zip(self.names, ids.shape))
        nontrivial = [i for i, s in enumerate(ids.shape) if s > 1]
        self.by_groups: dict[frozenset, tuple[str, ...]] = {}
        for k in range(len(nontrivial) + 1):
            for subset in itertools.combinations(nontrivial, k):
                rest = [i for i in range(ids.ndim) if i not in subset]
                flat = np.transpose(ids, rest + list(subset)).reshape(
                    -1, math.prod(ids.shape[i] for i in subset)
                )
                key = frozenset(frozenset(int(d) for d in row) for row in flat)
                self.by_groups.setdefault(key, tuple(self.names[i] for i in subset))

    def _device(self, logical: int) -> int | None:
        return self.device_of[logical] if 0 <= logical < len(self.device_of) else None

    def axes_of_groups(self, groups: list[list[int]]) -> tuple[str, ...]:
        devices = [[self._device(i) for i in g] for g in groups]
        if any(d is None for g in devices for d in g):
            return ("?",)
        key = frozenset(frozenset(g) for g in devices)
        return self.by_groups.get(key, ("?",))

    def axes_of_pairs(self, pairs: list[tuple[int, int]]) -> tuple[str, ...]:
        """The mesh axes along which some pair's source and target differ."""
        differ = set()
        for src, dst in pairs:
            a, b = self._device(src), self._device(dst)
            if a is None or b is None or a not in self.position or b not in self.position:
                return ("?",)
            differ |= {
                i for i, (x, y) in enumerate(zip(self.position[a], self.position[b])) if x != y
            }
        return tuple(self.names[i] for i in sorted(differ))


class _HloReader:
    """Parses HLO text into computations and tallies collectives from ENTRY down."""

    def __init__(self, text: str, groups: _MeshGroups):
        self.groups = groups
        self.computations: dict[str, _Computation] = {}
        self.entry: str | None = None
        self._memo: dict[str, _Tallies] = {}
        self._parse(text)

    # -- parsing ------------------------------------------------------------------------------------

    def _parse(self, text: str):
        current = None
        for line in text.splitlines():
            stripped = line.strip()
            if current is None:
                if stripped.endswith("{") and not stripped.startswith("HloModule"):
                    is_entry = stripped.startswith("ENTRY")
                    name = stripped.split()[1 if is_entry else 0].lstrip("%")
                    current = _Computation(name=name, instructions=[], shapes={}, root_opcode=None)
                    self.computations[name] = current
                    if is_entry:
                        self.entry = name
                continue
            if stripped == "}":
                current = None
                continue
            inst = _parse_instruction(stripped)
            if inst is None:
                continue
            current.instructions.append(inst)
            current.shapes[inst.name] = inst.shape
            if stripped.startswith("ROOT"):
                current.root_opcode = inst.opcode
        if self.entry is None:
            raise ValueError("no ENTRY computation in the HLO text")

    # -- tallying -----------------------------------------------------------------------------------

    def entry_tallies(self) -> _Tallies:
        return self._tallies(self.entry, ())

    def _tallies(self, name: str, stack: tuple[str, ...]) -> _Tallies:
        if name in self._memo:
            return self._memo[name]
        comp = self.computations.get(name)
        if comp is None or name in stack:
            return {}
        stack = stack + (name,)
        tallies: _Tallies = {}
        for inst in comp.instructions:
            opcode = inst.opcode.replace("_", "-")
            if opcode in _HLO_OPS:
                self._record(tallies, comp, inst, opcode)
            if opcode == "while":
                body = _attr_computation(inst.attrs, "body")
                cond = _attr_computation(inst.attrs, "condition")
                trip = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)', inst.attrs)
                if trip:
                    n = int(trip.group(1))
                    _merge(tallies, self._tallies(body, stack), times=n)
                    _merge(tallies, self._tallies(cond, stack), times=n + 1)
                else:
                    _merge(tallies, self._tallies(body, stack), approximate=True)
                    _merge(tallies, self._tallies(cond, stack), approximate=True)
            elif opcode == "conditional":
                names = _branch_computations(inst.attrs)
                _merge(tallies, _max_of_branches([self._tallies(b, stack) for b in names]))
            elif opcode not in _NOT_CALLS:
                called = re.findall(r"\bcalls=%?([\w.\-]+)", inst.attrs)
                if opcode == "call":
                    called += re.findall(r"\bto_apply=%?([\w.\-]+)", inst.attrs)
                for sub in called:
                    _merge(tallies, self._tallies(sub, stack))
        self._memo[name] = tallies
        return tallies

    def _record(self, tallies: _Tallies, comp: _Computation, inst: _Instruction, opcode: str):
        op = _HLO_OPS[opcode]
        if op == "psum" or opcode == "reduce-scatter":
            reducer = _attr_computation(inst.attrs, "to_apply")
            kind = self.computations[reducer].root_opcode if reducer in self.computations else "add"
            if op == "psum":
                op = _REDUCTIONS.get(kind, f"all_reduce_{kind}")
            elif kind != "add":
                op = f"reduce_scatter_{kind}"
        operands = inst.operands
        if op == "ragged_all_to_all" or "slice_sizes=" in inst.attrs:
            operands = operands[:1]  # the rest are output buffers and offsets (in-place forms)
        shapes = [comp.shapes.get(o, "") for o in operands]
        operand_bytes = sum(_shape_bytes(s) for s in shapes)
        shape_text = ", ".join(_strip_layout(s) for s in shapes)
        if len(shapes) > 1:
            shape_text = f"({shape_text})"

        if op == "ppermute":
            pairs = _source_target_pairs(inst.attrs)
            moving = [(s, t) for s, t in pairs if s != t]
            axes = self.groups.axes_of_pairs(moving)
            n = math.prod(self.groups.axis_size.get(a, 1) for a in axes)
            _add_call(tallies, op, axes, n, operand_bytes, shape_text, moves=bool(moving))
            return
        groups = _replica_groups(inst.attrs, self.groups.size)
        axes = self.groups.axes_of_groups(groups)
        n = len(groups[0]) if groups else 1
        _add_call(
            tallies, op, axes, n, operand_bytes, shape_text, approximate=(op == "ragged_all_to_all")
        )


def _balanced(text: str, start: int) -> int:
    """Index just past the bracket that closes the one at ``text[start]``."""
    pairs = {"(": ")", "[": "]", "{": "}"}
    stack = []
    for i in range(start, len(text)):
        c = text[i]
        if c in pairs:
            stack.append(pairs[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
    return len(text)


_INSTRUCTION = re.compile(r"(?:ROOT\s+)?%?([^\s=]+)\s*=\s*")
_OPCODE = re.compile(r"\s*([A-Za-z][\w\-]*)\(")


def _parse_instruction(line: str) -> _Instruction | None:
    m = _INSTRUCTION.match(line)
    if not m:
        return None
    rest = line[m.end() :]
    if rest.startswith("("):
        end = _balanced(rest, 0)
    else:
        end = len(rest.split(None, 1)[0]) if rest.strip() else 0
    shape, rest = rest[:end], rest[end:]
    op = _OPCODE.match(rest)
    if not op:
        return None
    close = _balanced(rest, op.end() - 1)
    operand_text = rest[op.end() : close - 1]
    operands = re.findall(r"%([\w.\-]+)", operand_text)
    if not operands and operand_text.strip():
        operands = [part.split()[-1] for part in operand_text.split(",") if part.strip()]
    return _Instruction(
        name=m.group(1), shape=shape, opcode=op.group(1), operands=operands, attrs=rest[close:]
    )


def _attr_computation(attrs: str, key: str) -> str | None:
    m = re.search(rf"\b{key}=%?([\w.\-]+)", attrs)
    return m.group(1) if m else None


def _branch_computations(attrs: str) -> list[str]:
    m = re.search(r"\bbranch_computations=\{([^}]*)\}", attrs)
    if m:
        return [b.strip().lstrip("%") for b in m.group(1).split(",") if b.strip()]
    return [
        c
        for c in (
            _attr_computation(attrs, "true_computation"),
            _attr_computation(attrs, "false_computation"),
        )
        if c
    ]


def _source_target_pairs(attrs: str) -> list[tuple[int, int]]:
    m = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", attrs)
    if not m:
        return []
    return [(int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1))]


def _iota(dims: list[int], reshape: list[int], perm: list[int] | None) -> np.ndarray:
    ids = np.arange(math.prod(reshape)).reshape(reshape)
    if perm:
        ids = ids.transpose(perm)
    return ids.reshape(dims)


def _ints(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text)]


def _replica_groups(attrs: str, device_count: int) -> list[list[int]]:
    """Groups of logical device ids, from any of the three ways XLA prints them.

    ``{{0,1},{2,3}}`` (explicit); ``[2,4]<=[8]`` or ``[4,2]<=[2,4]T(1,0)`` (iota: an arange reshaped,
    transposed, and read as rows); ``mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0)) {'a'}`` (mesh axes:
    devices sharing their coordinates on every axis not listed form a group). No groups: everyone.
    """
    start = attrs.find("replica_groups=")
    if start < 0:
        return [list(range(device_count))]
    text = attrs[start + len("replica_groups=") :]
    if text.startswith("{"):
        inner = text[: _balanced(text, 0)]
        groups = [_ints(g) for g in re.findall(r"\{([\d,\s]*)\}", inner[1:-1])]
        return groups or [list(range(device_count))]
    m = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    if m:
        dims, reshape = _ints(m.group(1)), _ints(m.group(2))
        perm = _ints(m.group(3)) if m.group(3) else None
        return _iota(dims, reshape, perm).tolist()
    if text.startswith("mesh["):
        return _mesh_axes_groups(text)
    raise ValueError(f"cannot read replica_groups in HLO attributes: {text[:120]!r}")


def _mesh_axes_groups(text: str) -> list[list[int]]:
    close = _balanced(text, 4)
    axes_spec = text[5 : close - 1]
    names, sizes = [], []
    for name, size in re.findall(r"'?([^'=,\s]+)'?\s*=\s*(\d+)", axes_spec):
        names.append(name)
        sizes.append(int(size))
    rest = text[close:]
    devices = np.arange(math.prod(sizes))
    m = re.match(r"\s*,\s*device_ids=\(", rest)
    if m:
        end = _balanced(rest, m.end() - 1)
        spec = rest[m.end() : end - 1].strip()
        rest = rest[end:]
        iota = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", spec)
        if iota and math.prod(_ints(iota.group(1))) == devices.size:
            reshape = _ints(iota.group(1))
            perm = _ints(iota.group(2)) if iota.group(2) else None
            devices = _iota([devices.size], reshape, perm)
        else:
            listed = _ints(spec)
            if len(listed) != devices.size:
                raise ValueError(f"cannot read device_ids={spec!r} of mesh [{axes_spec}]")
            devices = np.array(listed)
    devices = devices.reshape(sizes)
    m = re.match(r"\s*\{([^}]*)\}", rest)
    if not m:
        raise ValueError(f"cannot read the axes of replica_groups=mesh[{axes_spec}]{rest[:60]!r}")
    refs = re.findall(r"'?([^':,\s]+)'?(?::\((\d+)\)(\d+))?", m.group(1))
    # A device's key is what it shares with its group: its coordinates with the grouped axes (or
    # the grouped digits of a sub-axis `a:(pre)size`) taken out.
    grouped: dict[int, list[tuple[int, int]]] = {}
    for name, pre, size in refs:
        if name not in names:
            raise ValueError(f"replica group axis {name!r} is not in mesh [{axes_spec}]")
        d = names.index(name)
        if pre:
            grouped.setdefault(d, []).append((int(pre), int(size)))
        else:
            grouped.setdefault(d, []).append((1, sizes[d]))
    groups: dict[tuple, list[int]] = {}
    for coords in itertools.product(*(range(s) for s in sizes)):
        key = []
        for d, c in enumerate(coords):
            for pre, size in grouped.get(d, ()):
                minor = sizes[d] // (pre * size)
                c -= ((c // minor) % size) * minor
            key.append(c)
        groups.setdefault(tuple(key), []).append(int(devices[coords]))
    return list(groups.values())


_DTYPE_BITS = re.compile(r"^[a-z]+?(\d+)")


def _shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string, tuples summed: ``(f32[4,16]{1,0}, bf16[8])`` -> 272."""
    total = 0
    for dtype, dims in re.findall(r"([a-z][a-z0-9]*)\[([^\]]*)\]", shape):
        if dtype == "token" or dtype == "opaque":
            continue
        bits = 8 if dtype == "pred" else int(_DTYPE_BITS.match(dtype).group(1))
        count = math.prod(_ints(dims.replace("<=", ""))) if dims.strip() else 1
        total += -(-count * bits // 8)
    return total


def _strip_layout(shape: str) -> str:
    return re.sub(r"\{[^{}]*\}", "", re.sub(r"/\*.*?\*/", "", shape)).strip()
