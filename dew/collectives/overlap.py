"""Which of a step's collectives run beside compute: ``hlo_overlap(compiled, mesh)``.

Read from the scheduled HLO of a compiled step (``compiled.as_text()``: the final HLO, each
computation's instructions in the order the TPU compiler scheduled them). A collective that
travels while the chip computes costs no time of its own; one that runs with nothing beside it
stalls the step for as long as its bytes take. This reader splits the bytes ``hlo_collectives``
counts into those two parts, per step, per device, for either engine (it reads only the HLO).

What it assumes of the HLO, checked on the TPU compiler's (libtpu) scheduled HLO of Dew's steps:

- **Order is time.** In a scheduled module an instruction runs after the ones printed before it
  in its computation, and asynchronous work runs from its start to its done.
- **An asynchronous collective** is a start/done pair in one computation:
  ``all-gather-start``/``-done``, ``all-reduce-start``/``-done``,
  ``collective-permute-start``/``-done``, or an ``async-start``/``async-update``/``async-done``
  chain whose called computation holds the collective (a reduce-scatter, an all-to-all). Its
  done is the one that consumes its start. It is *overlapped* when a compute instruction (below)
  lies between the start and the done, else *exposed*.
- **A chained collective.** The TPU compiler runs an all-gather as a chain of fusions, each holding
  the whole collective with the same ``chain_id`` (``hlo_text.chain_id``): a ``kCustom`` fusion
  that starts it (``async-collective-start``), ``kOutput`` fusions that continue it inside the
  matmuls that use its pieces, and a ``kCustom`` fusion that finishes it
  (``async-collective-done``). It is overlapped when a compute instruction lies between its first
  and last piece in the computation that holds them (the continuing matmul fusions are compute).
- **Everything else is exposed**: a synchronous collective, at top level or in a fusion (the
  compiler's ``all-reduce-scatter`` fusions; collectives it turned back into synchronous ones
  because nothing could go beside them, marked ``async_collective_name``), and a start whose done
  is not found in its computation.

**Compute** is what occupies the chip's cores with arithmetic on arrays: a fusion (unless it is a
``kCustom`` fusion holding a collective: that one *is* the collective), ``convolution``, ``dot``,
``reduce``, ``reduce-window``, ``select-and-scatter``, ``sort``, ``scatter``, ``gather``,
``custom-call`` (a kernel; not the bookkeeping targets in ``BOOKKEEPING_CALLS``), control flow
(``while``, ``conditional``, ``call``: they run computations) and any other arithmetic
(``add``, ``convert``, ...) whose result is not a scalar (a scalar add is a loop counter's step).
Not compute: collectives and their starts and dones, ``parameter``, ``constant``,
``get-tuple-element``, ``tuple``, and data movement (``bitcast``, ``reshape``, ``copy``,
``copy-start``/``-done``, ``slice``/``slice-start``/``-done``, ``dynamic-slice``,
``dynamic-update-slice``, ``concatenate``, ``pad``, ``broadcast``, ``transpose``, ``iota``):
moving bytes in memory does not hide bytes on the wire behind work.

Bytes are ``hlo_collectives``' own: the same reader walks the module (each collective's ring wire
bytes, ``report.ring_wire_bytes``; a chain counted once; loops by their trip count; a conditional's
larger branch), so overlapped + exposed is the wire bytes ``hlo_collectives`` reports, exactly.
This says where the bytes could hide, not for how long: a collective overlapped with a small
fusion is still counted overlapped.
"""

from __future__ import annotations

import dataclasses
import fractions
import itertools
import re

from dew.collectives import hlo_text, primitives
from dew.collectives.hlo import _HloReader, read_compiled
from dew.collectives.report import CollectiveReport, CollectiveRow
from dew.collectives.tally import Tallies, merge

__all__ = ["Overlap", "hlo_overlap", "BOOKKEEPING_CALLS"]

OVERLAPPED, EXPOSED = "overlapped", "exposed"

# Collectives and their halves: never compute, for another collective.
COLLECTIVE_OPCODES = frozenset(
    set(primitives.HLO_OPCODES)
    | set(primitives.HLO_WAIT_HALVES)
    | set(primitives.HLO_ASYNC_PAIRS)
    | {"send", "send-done", "recv", "recv-done"}
)

# Instructions that hold no arithmetic: bookkeeping and data movement.
NOT_COMPUTE = frozenset(
    {
        "parameter",
        "constant",
        "get-tuple-element",
        "tuple",
        "bitcast",
        "bitcast-convert",
        "reshape",
        "copy",
        "copy-start",
        "copy-done",
        "slice",
        "slice-start",
        "slice-done",
        "dynamic-slice",
        "dynamic-update-slice",
        "concatenate",
        "pad",
        "broadcast",
        "transpose",
        "iota",
        "partition-id",
        "replica-id",
        "after-all",
        "add-dependency",
        "opt-barrier",
        "domain",
        "get-dimension-size",
        "set-dimension-size",
        "infeed",
        "outfeed",
    }
)

# Compute whatever its result's shape.
ALWAYS_COMPUTE = frozenset(
    {
        "fusion",
        "convolution",
        "dot",
        "reduce",
        "reduce-window",
        "select-and-scatter",
        "sort",
        "scatter",
        "gather",
        "map",
        "fft",
        "cholesky",
        "triangular-solve",
        "rng",
        "rng-bit-generator",
        "custom-call",
        "while",
        "conditional",
        "call",
    }
)

# Custom-call targets of the TPU compiler's final HLO that only allocate, re-label or signal:
# seen in Dew's steps (libtpu with JAX 0.10.2). Any other target is taken for a kernel.
BOOKKEEPING_CALLS = frozenset(
    {
        "AllocateBuffer",
        "ConcatBitcast",
        "AsyncCollectiveStart",
        "AsyncCollectiveDone",
        "AssumeGatherIndicesInBound",
        "GatherScatterIndicesBitpacked",
    }
)

_FUSION_KIND = re.compile(r"\bkind=(\w+)")
_CALL_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_ARRAY = re.compile(r"[a-z][a-z0-9]*\[([^\]]*)\]")


@dataclasses.dataclass(frozen=True)
class Overlap:
    """A step's collectives split by what runs beside them, per device, per step.

    - ``overlapped``: the calls whose collective has compute scheduled between its start and its
      done (or between its chain's first and last piece);
    - ``exposed``: the others, which run with nothing beside them.

    Each is a ``CollectiveReport`` with the rows of ``hlo_collectives`` split in two: a row's
    exposed wire bytes are its exposed calls' exact bytes, rounded; its overlapped wire bytes are
    the rest of the row's (rounded) total, so ``overlapped_wire_bytes + exposed_wire_bytes`` is
    ``hlo_collectives``' total to the byte.
    """

    overlapped: CollectiveReport
    exposed: CollectiveReport

    @property
    def overlapped_wire_bytes(self) -> int:
        return sum(r.wire_bytes for r in self.overlapped.rows)

    @property
    def exposed_wire_bytes(self) -> int:
        return sum(r.wire_bytes for r in self.exposed.rows)

    @property
    def wire_bytes(self) -> int:
        return self.overlapped_wire_bytes + self.exposed_wire_bytes


def hlo_overlap(compiled, mesh) -> Overlap:
    """The collectives of a compiled step split into overlapped and exposed (module docstring).

    Args:
      compiled: a jax ``Compiled`` object (the step after ``.compile()``) or its ``.as_text()``:
        the scheduled HLO.
      mesh: the ``jax.sharding.Mesh`` it was compiled for, as ``hlo_collectives`` takes it.
    """
    text, groups = read_compiled(compiled, mesh, "hlo_overlap")
    reader = _OverlapReader(text, groups)
    tallies = reader.entry_tallies()
    names = tuple(mesh.axis_names)
    sizes = tuple(dict(mesh.shape)[a] for a in names)
    overlapped, exposed = [], []
    for op, axes in sorted({key[1:] for key in tallies}):
        o, e = tallies.get((OVERLAPPED, op, axes)), tallies.get((EXPOSED, op, axes))
        total = int(round(sum((t.wire_bytes for t in (o, e) if t), fractions.Fraction(0))))
        exposed_bytes = int(round(e.wire_bytes)) if e else 0
        parts = ((o, total - exposed_bytes, overlapped), (e, exposed_bytes, exposed))
        for tally, wire, into in parts:
            if tally is not None:
                into.append(
                    CollectiveRow(
                        op=op,
                        axes=axes,
                        count=tally.count,
                        operand_bytes=tally.operand_bytes,
                        wire_bytes=wire,
                        approximate=tally.approximate,
                        shapes=tuple(sorted(tally.shapes)),
                    )
                )
    return Overlap(
        overlapped=CollectiveReport(tuple(overlapped), names, sizes),
        exposed=CollectiveReport(tuple(exposed), names, sizes),
    )


class _OverlapReader(_HloReader):
    """``hlo_collectives``' reader, its tallies keyed ``(OVERLAPPED or EXPOSED, op, axes)``."""

    def __init__(self, text, groups):
        super().__init__(text, groups)
        self._collectives_memo: dict[str, frozenset[tuple[str, str]]] = {}
        # Every collective instruction of each chain, as (computation, instruction) names.
        self._chain_members: dict[str, set[tuple[str, str]]] = {}
        for comp in self.computations.values():
            for inst in comp.instructions:
                chain = hlo_text.chain_id(inst.attrs)
                if chain is not None and _is_collective(inst):
                    self._chain_members.setdefault(chain, set()).add((comp.name, inst.name))
        self._overlapped: set[tuple[str, str]] = set()
        for comp in self.computations.values():
            self._classify(comp)

    def _record(self, tallies: Tallies, comp, inst, opcode: str):
        part: Tallies = {}
        super()._record(part, comp, inst, opcode)
        kind = OVERLAPPED if (comp.name, inst.name) in self._overlapped else EXPOSED
        merge(tallies, {(kind, *key): t for key, t in part.items()})

    def _classify(self, comp: hlo_text.Computation):
        """Adds the collectives ``comp``'s schedule overlaps with compute to ``_overlapped``."""
        order = comp.instructions
        # busy(i, j): some compute strictly between positions i and j.
        prefix = list(itertools.accumulate((self._computes(i) for i in order), initial=0))

        def busy(i: int, j: int) -> bool:
            return prefix[j] - prefix[i + 1] > 0

        chains: dict[str, list[int]] = {}
        for k, inst in enumerate(order):
            opcode = primitives.hlo_opcode(inst.opcode)
            if opcode in primitives.HLO_ASYNC_PAIRS:
                done = _done_position(order, k, primitives.HLO_ASYNC_PAIRS[opcode])
                if done is not None and busy(k, done):
                    if opcode == primitives.HLO_ASYNC_WRAPPER:
                        for sub in hlo_text.called_computations(inst.attrs, False):
                            self._overlapped |= self._collectives_in(sub)
                    else:
                        self._overlapped.add((comp.name, inst.name))
            for chain in self._chains_of(comp, inst):
                chains.setdefault(chain, []).append(k)
        for chain, positions in chains.items():
            if busy(min(positions), max(positions)):
                self._overlapped |= self._chain_members[chain]

    def _chains_of(self, comp, inst) -> set[str]:
        """The chains ``inst`` is a piece of: its own ``chain_id`` if it is a collective, and
        those of the collectives in the fusions it calls."""
        chains = set()
        if _is_collective(inst) and hlo_text.chain_id(inst.attrs) is not None:
            chains.add(hlo_text.chain_id(inst.attrs))
        if primitives.hlo_opcode(inst.opcode) == "fusion":
            for sub in hlo_text.called_computations(inst.attrs, False):
                for c, name in self._collectives_in(sub):
                    chain = hlo_text.chain_id(self.computations[c].by_name[name].attrs)
                    if chain is not None:
                        chains.add(chain)
        return chains

    def _collectives_in(self, name: str) -> frozenset[tuple[str, str]]:
        """The collectives of computation ``name`` and of the computations its instructions call
        (``calls=``: fusions, async wrappers), as (computation, instruction) names."""
        if name in self._collectives_memo:
            return self._collectives_memo[name]
        self._collectives_memo[name] = frozenset()  # a cycle (none in valid HLO) stops here
        comp = self.computations.get(name)
        found = set()
        for inst in comp.instructions if comp is not None else ():
            if _is_collective(inst):
                found.add((name, inst.name))
            for sub in hlo_text.called_computations(inst.attrs, False):
                found |= self._collectives_in(sub)
        self._collectives_memo[name] = frozenset(found)
        return self._collectives_memo[name]

    def _computes(self, inst: hlo_text.Instruction) -> bool:
        """Whether ``inst`` is compute (module docstring)."""
        opcode = primitives.hlo_opcode(inst.opcode)
        if opcode in COLLECTIVE_OPCODES or opcode in NOT_COMPUTE:
            return False
        if opcode == "fusion":
            kind = _FUSION_KIND.search(inst.attrs)
            holds_collective = any(
                self._collectives_in(sub) for sub in hlo_text.called_computations(inst.attrs, False)
            )
            return not (kind is not None and kind.group(1) == "kCustom" and holds_collective)
        if opcode == "custom-call":
            target = _CALL_TARGET.search(inst.attrs)
            return target is None or target.group(1) not in BOOKKEEPING_CALLS
        if opcode in ALWAYS_COMPUTE:
            return True
        return not _is_scalar(inst.shape)


def _is_collective(inst: hlo_text.Instruction) -> bool:
    return primitives.hlo_opcode(inst.opcode) in primitives.HLO_OPCODES


def _is_scalar(shape: str) -> bool:
    """Every array of ``shape`` (a tuple's too) has no dimensions: ``s32[]``, ``(f32[], u32[])``."""
    dims = _ARRAY.findall(hlo_text.strip_layout(shape))
    return all(not d.strip() for d in dims)


def _done_position(order: list, start: int, done_opcode: str) -> int | None:
    """The position of the done that ends the async op at ``order[start]``: the first
    ``done_opcode`` consuming it, or (``async-start``) consuming an ``async-update`` of it."""
    chain = {order[start].name}
    for k in range(start + 1, len(order)):
        inst = order[k]
        opcode = primitives.hlo_opcode(inst.opcode)
        if not inst.operands or inst.operands[0] not in chain:
            continue
        if opcode == done_opcode:
            return k
        if opcode == primitives.HLO_ASYNC_UPDATE:
            chain.add(inst.name)
    return None
