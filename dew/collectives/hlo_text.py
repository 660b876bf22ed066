"""Parsing XLA's HLO text: computations, instructions and the attributes the HLO reader needs.

Nothing here knows about meshes or reports; ``hlo.py`` maps what these functions return onto mesh
axes. Replica groups come in the three spellings XLA prints (see ``replica_groups``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import re

import numpy as np

from dew.collectives.primitives import HLO_BYTELESS_TYPES


@dataclasses.dataclass
class Instruction:
    """``%name = shape opcode(operands), attrs``; ``shape`` keeps its layout (``f32[4]{0}``)."""

    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str


@dataclasses.dataclass
class Computation:
    """One computation of a module: its instructions in order, and each instruction's shape."""

    name: str
    instructions: list[Instruction]
    shapes: dict[str, str]
    root_opcode: str | None
    root: str | None = None  # the ROOT instruction's name

    @functools.cached_property
    def by_name(self) -> dict[str, Instruction]:
        """Instructions by name (read once the computation is parsed)."""
        return {inst.name: inst for inst in self.instructions}


def parse_module(text: str) -> tuple[dict[str, Computation], str]:
    """The computations of an HLO module by name, and the name of its ENTRY computation."""
    computations: dict[str, Computation] = {}
    entry = None
    current = None
    for line in text.splitlines():
        stripped = line.strip()
        if current is None:
            if stripped.endswith("{") and not stripped.startswith("HloModule"):
                is_entry = stripped.startswith("ENTRY")
                name = stripped.split()[1 if is_entry else 0].lstrip("%")
                current = Computation(name=name, instructions=[], shapes={}, root_opcode=None)
                computations[name] = current
                if is_entry:
                    entry = name
            continue
        if stripped == "}":
            current = None
            continue
        inst = parse_instruction(stripped)
        if inst is None:
            continue
        current.instructions.append(inst)
        current.shapes[inst.name] = inst.shape
        if stripped.startswith("ROOT"):
            current.root_opcode = inst.opcode
            current.root = inst.name
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return computations, entry


def chain_id(attrs: str) -> str | None:
    """The ``chain_id`` frontend attribute the TPU compiler gives every piece of a collective it
    split into a chain of fusions, or None."""
    m = re.search(r'\bchain_id="([^"]*)"', attrs)
    return m.group(1) if m else None


def known_trip_count(attrs: str) -> int | None:
    """The trip count XLA recorded on a ``while`` (its backend config), or None."""
    m = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)', attrs)
    return int(m.group(1)) if m else None


_PASS_THROUGH = ("copy", "bitcast", "reshape", "convert")
_FLIP = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE", "EQ": "EQ", "NE": "NE"}


def _through(comp: Computation, name: str) -> Instruction | None:
    """The instruction ``name`` of ``comp``, seen through copies, bitcasts, reshapes and converts
    (which the TPU compiler puts between a loop counter and its uses)."""
    by_name = comp.by_name
    inst = by_name.get(name)
    while inst is not None and inst.opcode in _PASS_THROUGH and inst.operands:
        inst = by_name.get(inst.operands[0])
    return inst


def _constant(comp: Computation, name: str) -> int | None:
    inst = _through(comp, name)
    if inst is None or inst.opcode != "constant" or len(inst.operands) != 1:
        return None
    try:
        return int(inst.operands[0])
    except ValueError:
        return None


def _tuple_index(comp: Computation, name: str) -> int | None:
    """``k`` when ``name`` is element ``k`` of ``comp``'s tuple parameter (the loop state)."""
    inst = _through(comp, name)
    if inst is None or inst.opcode != "get-tuple-element" or not inst.operands:
        return None
    source = _through(comp, inst.operands[0])
    m = re.search(r"\bindex=(\d+)", inst.attrs)
    if source is None or source.opcode != "parameter" or not m:
        return None
    return int(m.group(1))


def derived_trip_count(
    computations: dict[str, Computation], caller: Computation, loop: Instruction
) -> int | None:
    """The trip count of ``while`` instruction ``loop`` (in ``caller``) read from its program,
    for the loops XLA leaves without ``known_trip_count`` (the TPU compiler's final HLO).

    The loop must count: its condition compares one element ``k`` of the loop state with a
    constant, ``k`` starts at a constant (the while's operand tuple) and the body adds a constant
    to it. A body the compiler widened (unrolled ``u`` times, ``wide.*`` computations) adds ``u``
    at a time and holds ``u`` copies of each collective, so the count stays exact. Any other shape
    gives ``None``.
    """
    cond = computations.get(attr_computation(loop.attrs, "condition") or "")
    body = computations.get(attr_computation(loop.attrs, "body") or "")
    if cond is None or body is None or not loop.operands:
        return None
    compare = cond.by_name.get(cond.root) if cond.root else None
    if compare is None or compare.opcode != "compare" or len(compare.operands) != 2:
        return None
    m = re.search(r"\bdirection=(\w+)", compare.attrs)
    if not m:
        return None
    direction = m.group(1)
    left, right = compare.operands
    k, limit = _tuple_index(cond, left), _constant(cond, right)
    if k is None:
        k, limit, direction = _tuple_index(cond, right), _constant(cond, left), _FLIP[direction]
    if k is None or limit is None:
        return None
    state = _through(caller, loop.operands[0])
    if state is None or state.opcode != "tuple" or k >= len(state.operands):
        return None
    start = _constant(caller, state.operands[k])
    root = body.by_name.get(body.root) if body.root else None
    if start is None or root is None or root.opcode != "tuple" or k >= len(root.operands):
        return None
    update = _through(body, root.operands[k])
    if update is None or update.opcode not in ("add", "subtract") or len(update.operands) != 2:
        return None
    a, b = update.operands
    if _tuple_index(body, a) == k and _constant(body, b) is not None:
        step = _constant(body, b)
    elif update.opcode == "add" and _tuple_index(body, b) == k and _constant(body, a) is not None:
        step = _constant(body, a)
    else:
        return None
    if update.opcode == "subtract":
        step = -step
    return _iterations(start, limit, step, direction)


def _iterations(start: int, limit: int, step: int, direction: str) -> int | None:
    """How many times ``i = start; while i <direction> limit: i += step`` runs its body."""
    if step > 0 and direction in ("LT", "LE", "NE"):
        span = limit - start + (1 if direction == "LE" else 0)
        if direction == "NE" and span % step:
            return None
        return max(0, -(-span // step))
    if step < 0 and direction in ("GT", "GE", "NE"):
        span = start - limit + (1 if direction == "GE" else 0)
        if direction == "NE" and span % -step:
            return None
        return max(0, -(-span // -step))
    return None


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


def parse_instruction(line: str) -> Instruction | None:
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
    return Instruction(
        name=m.group(1), shape=shape, opcode=op.group(1), operands=operands, attrs=rest[close:]
    )


def attr_computation(attrs: str, key: str) -> str | None:
    m = re.search(rf"\b{key}=%?([\w.\-]+)", attrs)
    return m.group(1) if m else None


def called_computations(attrs: str, is_call: bool) -> list[str]:
    """The computations an instruction runs (``calls=``; a ``call``'s ``to_apply=`` too). A
    reduction's ``to_apply`` is not followed: it combines two elements and holds no collective."""
    called = re.findall(r"\bcalls=%?([\w.\-]+)", attrs)
    if is_call:
        called += re.findall(r"\bto_apply=%?([\w.\-]+)", attrs)
    return called


def branch_computations(attrs: str) -> list[str]:
    m = re.search(r"\bbranch_computations=\{([^}]*)\}", attrs)
    if m:
        return [b.strip().lstrip("%") for b in m.group(1).split(",") if b.strip()]
    return [
        c
        for c in (
            attr_computation(attrs, "true_computation"),
            attr_computation(attrs, "false_computation"),
        )
        if c
    ]


def source_target_pairs(attrs: str) -> list[tuple[int, int]]:
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


def replica_groups(attrs: str, device_count: int) -> list[list[int]]:
    """Groups of logical device ids, from any of the three ways XLA prints them.

    ``{{0,1},{2,3}}`` (explicit); ``[2,4]<=[8]`` or ``[4,2]<=[2,4]T(1,0)`` (iota: an arange
    reshaped, transposed, and read as rows); ``mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0)) {'a'}``
    (mesh axes: devices sharing their coordinates on every axis not listed form a group). No
    groups: everyone.
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


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string, tuples summed: ``(f32[4,16]{1,0}, bf16[8])`` -> 272."""
    total = 0
    for dtype, dims in re.findall(r"([a-z][a-z0-9]*)\[([^\]]*)\]", shape):
        if dtype in HLO_BYTELESS_TYPES:
            continue
        bits = 8 if dtype == "pred" else int(_DTYPE_BITS.match(dtype).group(1))
        count = math.prod(_ints(dims.replace("<=", ""))) if dims.strip() else 1
        total += -(-count * bits // 8)
    return total


def strip_layout(shape: str) -> str:
    return re.sub(r"\{[^{}]*\}", "", re.sub(r"/\*.*?\*/", "", shape)).strip()
