"""Reading a compiled executable's HLO: ``hlo_collectives(compiled, mesh)``, what XLA inserted.

This is how the GSPMD baseline's communication is seen (the partitioner invents it while
compiling), and it reads a compiled shard_map step alike, so both engines compare byte for byte.
Replica groups are mapped back to mesh axes. XLA deletes collectives over axes of size 1, so unlike
the jaxpr reader this one never lists them.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from dew.collectives import hlo_text, primitives
from dew.collectives.report import CollectiveReport
from dew.collectives.tally import Tallies, add_call, max_of_branches, merge, to_report

__all__ = ["hlo_collectives"]


def hlo_collectives(compiled, mesh) -> CollectiveReport:
    """The collectives of a compiled XLA executable, as the same report ``collectives`` gives.

    Args:
      compiled: ``jax.jit(f).lower(*args).compile()`` (or its ``.as_text()``): a GSPMD program whose
        communication XLA inserted, or a compiled shard_map step.
      mesh: the ``jax.sharding.Mesh`` the program was compiled for. Replica groups are compared with
        the groups each subset of its axes would form over ``mesh.devices``; a group set no subset
        forms gets axes ``("?",)``.

    All-gather, reduce-scatter, all-reduce (psum/pmax/pmin by its reduction), collective-permute,
    all-to-all and ragged-all-to-all (its send buffer, the bound of what it moves) are read, sync
    or async (a ``-start``/``-done`` pair counts once), multiplied by the trip counts of enclosing
    ``while`` loops: the ``known_trip_count`` XLA records, or else the count read from the loop's
    own counter (``hlo_text.derived_trip_count``: the TPU compiler's final HLO keeps no
    ``known_trip_count`` and may widen a loop's body). A loop whose count neither gives counts
    once and marks its rows approximate.

    Returns:
      a ``CollectiveReport`` over ``mesh``'s axes; XLA deletes collectives over axes of size 1,
      so none are listed.

    Raises:
      ValueError: ``mesh`` is not a ``Mesh``, ``compiled`` is a lowered function not yet
        compiled, or neither a ``Compiled`` nor HLO text with an ``ENTRY`` computation.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> from dew.collectives import hlo_collectives
        >>> mesh = jax.make_mesh((8,), ("data",))
        >>> g = jax.jit(lambda x: x.sum(0), in_shardings=NamedSharding(mesh, P("data")))
        >>> compiled = g.lower(jax.ShapeDtypeStruct((8, 1024), jnp.float32)).compile()
        >>> hlo_collectives(compiled, mesh).wire_bytes()  # GSPMD's all-reduce of f32[1024]
        7168
    """
    text, groups = read_compiled(compiled, mesh, "hlo_collectives")
    reader = _HloReader(text, groups)
    tallies = reader.entry_tallies()
    sizes = dict(mesh.shape)
    return to_report(tallies, mesh.axis_names, [sizes[a] for a in mesh.axis_names])


def read_compiled(compiled, mesh, reader: str) -> tuple[str, _MeshGroups]:
    """The HLO text of ``compiled`` (a jax ``Compiled`` or HLO text) and the map from its replica
    groups to ``mesh``'s axes; a ``ValueError`` naming ``reader`` for anything else."""
    if not (hasattr(mesh, "devices") and hasattr(mesh, "axis_names")):
        raise ValueError(f"{reader} needs a jax.sharding.Mesh, got {type(mesh).__name__}")
    if isinstance(compiled, str):
        text, logical_devices = compiled, None
    elif hasattr(compiled, "compile") and not hasattr(compiled, "runtime_executable"):
        raise ValueError(
            f"{reader} reads a compiled executable: XLA inserts GSPMD's "
            "collectives while compiling, so call .compile() on the lowered function"
        )
    elif hasattr(compiled, "as_text"):
        text = compiled.as_text()
        logical_devices = _logical_devices(compiled)
    else:
        raise ValueError(
            f"{reader} needs a jax Compiled object or HLO text, got {type(compiled).__name__}"
        )
    if not isinstance(text, str) or "ENTRY" not in text:
        raise ValueError(f"no HLO module in the text given to {reader} (no ENTRY computation)")
    return text, _MeshGroups(mesh, logical_devices)


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
    """Tallies the collectives of a parsed HLO module, from its ENTRY computation down."""

    def __init__(self, text: str, groups: _MeshGroups):
        self.groups = groups
        self.computations, self.entry = hlo_text.parse_module(text)
        self._memo: dict[str, Tallies] = {}
        # The TPU compiler runs one collective as a chain of fusions (start, continuations, done:
        # a gather overlapped with the matmuls around it), each holding the whole collective
        # with the same ``chain_id``; the first in the module stands for the chain.
        self._chain_heads: dict[str, tuple[str, str]] = {}
        for comp in self.computations.values():
            for inst in comp.instructions:
                chain = hlo_text.chain_id(inst.attrs)
                if chain is not None:
                    self._chain_heads.setdefault(chain, (comp.name, inst.name))

    def entry_tallies(self) -> Tallies:
        return self._tallies(self.entry, ())

    def _tallies(self, name: str, stack: tuple[str, ...]) -> Tallies:
        if name in self._memo:
            return self._memo[name]
        comp = self.computations.get(name)
        if comp is None or name in stack:
            return {}
        stack = stack + (name,)
        tallies: Tallies = {}
        for inst in comp.instructions:
            opcode = primitives.hlo_opcode(inst.opcode)
            if opcode in primitives.HLO_OPCODES:
                self._record(tallies, comp, inst, opcode)
            if opcode == primitives.HLO_WHILE:
                body = hlo_text.attr_computation(inst.attrs, "body")
                cond = hlo_text.attr_computation(inst.attrs, "condition")
                trip = hlo_text.known_trip_count(inst.attrs)
                if trip is None:
                    trip = hlo_text.derived_trip_count(self.computations, comp, inst)
                if trip is not None:
                    merge(tallies, self._tallies(body, stack), times=trip)
                    merge(tallies, self._tallies(cond, stack), times=trip + 1)
                else:
                    merge(tallies, self._tallies(body, stack), approximate=True)
                    merge(tallies, self._tallies(cond, stack), approximate=True)
            elif opcode == primitives.HLO_CONDITIONAL:
                names = hlo_text.branch_computations(inst.attrs)
                merge(tallies, max_of_branches([self._tallies(b, stack) for b in names]))
            elif opcode not in primitives.HLO_WAIT_HALVES:
                for sub in hlo_text.called_computations(inst.attrs, opcode == primitives.HLO_CALL):
                    merge(tallies, self._tallies(sub, stack))
        self._memo[name] = tallies
        return tallies

    def _record(self, tallies: Tallies, comp: hlo_text.Computation, inst, opcode: str):
        chain = hlo_text.chain_id(inst.attrs)
        if chain is not None and self._chain_heads[chain] != (comp.name, inst.name):
            return  # a continuation of a chained collective, counted at its head
        op = primitives.HLO_OPCODES[opcode]
        is_reduce_scatter = op == "psum_scatter"
        if op == "psum" or is_reduce_scatter:
            reducer = hlo_text.attr_computation(inst.attrs, "to_apply")
            kind = self.computations[reducer].root_opcode if reducer in self.computations else "add"
            if op == "psum":
                op = primitives.HLO_REDUCTIONS.get(kind, f"all_reduce_{kind}")
            elif kind != "add":
                op = f"reduce_scatter_{kind}"
        operands = inst.operands
        if op in primitives.RUNTIME_SIZED_OPS or "slice_sizes=" in inst.attrs:
            operands = operands[:1]  # the rest are output buffers and offsets (in-place forms)
        shapes = [comp.shapes.get(o, "") for o in operands]
        operand_bytes = sum(hlo_text.shape_bytes(s) for s in shapes)
        shape_text = ", ".join(hlo_text.strip_layout(s) for s in shapes)
        if len(shapes) > 1:
            shape_text = f"({shape_text})"

        if op in primitives.POINT_TO_POINT_OPS:
            pairs = hlo_text.source_target_pairs(inst.attrs)
            moving = [(s, t) for s, t in pairs if s != t]
            axes = self.groups.axes_of_pairs(moving)
            n = math.prod(self.groups.axis_size.get(a, 1) for a in axes)
            add_call(tallies, op, axes, n, operand_bytes, shape_text, moves=bool(moving))
            return
        groups = hlo_text.replica_groups(inst.attrs, self.groups.size)
        axes = self.groups.axes_of_groups(groups)
        n = len(groups[0]) if groups else 1
        add_call(tallies, op, axes, n, operand_bytes, shape_text)
