"""Reading a traced function's jaxpr: ``collectives(fn, *args)``, what the code asks for.

The walker follows every jaxpr nested in an equation's params, so collectives inside ``jit``,
``scan``, ``while``, ``cond``, ``checkpoint``, custom-derivative calls and nested ``shard_map``
are all found. Axis sizes come from the mesh of each ``shard_map`` (or a ``pmap``'s axis size).

Axes of size 1: a collective over them is listed (its count stays, so a test sees the call) with
0 wire bytes, which is what the ring formulas give for ``n = 1``. ``pvary``/``pcast`` and
``axis_index`` move no bytes and are not collectives here.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable

import jax
import numpy as np

from dew.collectives import primitives
from dew.collectives.report import CollectiveReport
from dew.collectives.tally import Tallies, add_call, max_of_branches, merge, to_report

__all__ = ["collectives"]


def collectives(fn: Callable, *args, **kwargs) -> CollectiveReport:
    """The collectives one call of ``fn(*args, **kwargs)`` runs, read from its jaxpr.

    Nothing is compiled or run. Axis sizes come from the mesh of each ``shard_map``, so the ring
    factor ``n`` is right for any user's function. Also callable as ``dew.collectives(fn, *args)``.

    Args:
      fn: any function that uses ``jax.shard_map`` somewhere inside (jitted or not, a whole
        training step or one layer). A function without ``shard_map`` (or ``pmap``) has no named
        axes and gives an empty report.
      *args: arrays or ``jax.ShapeDtypeStruct`` s of the global shapes (with the shardings the
        ``shard_map`` expects), as ``fn`` takes them.
      **kwargs: passed to ``fn`` alike.

    Returns:
      a ``CollectiveReport``: per (op, mesh axes), calls, operand bytes and wire bytes per device.

    Raises:
      TypeError: ``fn`` is not callable.

    Examples:
        >>> import dew, jax, jax.numpy as jnp
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> mesh = jax.make_mesh((8,), ("data",))
        >>> f = jax.shard_map(lambda x: jax.lax.psum(x, "data"), mesh=mesh,
        ...                   in_specs=P("data"), out_specs=P())
        >>> rows = NamedSharding(mesh, P("data"))
        >>> x = jax.ShapeDtypeStruct((8, 1024), jnp.float32, sharding=rows)
        >>> report = dew.collectives(f, x)  # a psum of 4 KiB a device: 2 x 7/8 x 4096 on the wire
        >>> report.count("psum"), report.wire_bytes("psum")
        (1, 7168)
    """
    if not callable(fn):
        raise TypeError(f"collectives() needs a function to trace, got {type(fn).__name__}: {fn!r}")
    closed = jax.make_jaxpr(fn)(*args, **kwargs)
    walker = _JaxprWalker()
    tallies = walker.walk(closed.jaxpr, {})
    return to_report(tallies, walker.axis_sizes.keys(), walker.axis_sizes.values())


def _as_jaxpr(value) -> Any:
    """The open jaxpr in ``value`` (a Jaxpr or ClosedJaxpr), else None; duck-typed, so that it
    reads every JAX release's jaxpr classes."""
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

    def walk(self, jaxpr, env: dict[str, int]) -> Tallies:
        tallies: Tallies = {}
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            params = eqn.params
            if name in primitives.JAXPR_PRIMITIVES:
                self._record(tallies, primitives.JAXPR_PRIMITIVES[name], eqn, env)
            inner_env = self._inner_env(name, params, env)
            if name == primitives.JAXPR_SCAN:
                merge(
                    tallies,
                    self.walk(_as_jaxpr(params["jaxpr"]), inner_env),
                    times=params["length"],
                )
            elif name == primitives.JAXPR_WHILE:
                # Unknown trip count: one iteration's collectives, flagged as a guess.
                for key in ("cond_jaxpr", "body_jaxpr"):
                    merge(tallies, self.walk(_as_jaxpr(params[key]), inner_env), approximate=True)
            elif name == primitives.JAXPR_COND:
                branches = [self.walk(_as_jaxpr(b), inner_env) for b in params["branches"]]
                merge(tallies, max_of_branches(branches))
            elif name in primitives.JAXPR_RUNS_ONLY:
                runs = params[primitives.JAXPR_RUNS_ONLY[name]]
                merge(tallies, self.walk(_as_jaxpr(runs), inner_env))
            else:
                for sub in _sub_jaxprs(params):
                    merge(tallies, self.walk(sub, inner_env))
        return tallies

    def _inner_env(self, name: str, params: dict, env: dict[str, int]) -> dict[str, int]:
        mesh = params.get("mesh")
        if mesh is not None and hasattr(mesh, "axis_names") and hasattr(mesh, "shape"):
            sizes = dict(mesh.shape)
            for axis in mesh.axis_names:
                self.axis_sizes.setdefault(axis, sizes[axis])
            return {**env, **sizes}
        if name == primitives.JAXPR_PMAP:
            axis, size = params["axis_name"], params["global_axis_size"]
            self.axis_sizes.setdefault(axis, size)
            return {**env, axis: size}
        return env

    def _record(self, tallies: Tallies, op: str, eqn, env: dict[str, int]):
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

        # A ragged exchange's first operand is its data (see primitives.RUNTIME_SIZED_OPS).
        invars = eqn.invars[:1] if op in primitives.RUNTIME_SIZED_OPS else eqn.invars
        operand = sum(_aval_bytes(v.aval) for v in invars)
        shapes = ", ".join(_aval_text(v.aval) for v in invars)
        if len(invars) > 1:
            shapes = f"({shapes})"
        moves = True
        if op in primitives.POINT_TO_POINT_OPS:
            moves = any(src != dst for src, dst in params["perm"])
        add_call(tallies, op, axes, n, operand, shapes, moves=moves)
