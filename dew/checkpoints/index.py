"""The index of one checkpoint step (`index.json`): what it holds and where every byte lives.

Format `dew-checkpoint`, version 1 (specified in docs/checkpoint-format.md):

    {"format": "dew-checkpoint", "version": 1, "step": 20, "metadata": {...},
     "treedef": "PyTreeDef({...})",                    # informational; restores match on paths
     "checksum": {"algorithm": "crc32", "chunk_bytes": 4194304},
     "files": [{"name": "process_00000.npz", "bytes": 123456}],
     "arrays": [{"path": "['params']['w']", "shape": [256, 64], "dtype": "bfloat16",
                 "stored_as": "<u2",
                 "pieces": [{"file": "process_00000.npz", "member": "a000000.p00000.npy",
                             "slice": [[0, 32], [0, 64]], "offset": 1088, "nbytes": 4096,
                             "crc32": [2914178232]}]}],
     "writer": {"jax": "0.10.2", "process_count": 1, "time": "2025-01-01T00:00:00Z"}}

`parse` trusts nothing in the text: every field is type- and range-checked, file names must be plain
`process_NNNNN.npz` names, every piece's byte length must equal its slice's size times the dtype's
item size, and the pieces of each array must tile it exactly (in bounds, disjoint, covering it).
A violation raises `CorruptCheckpointError` naming the step, the file and the field.
"""

import dataclasses
import json
import math
import re

import numpy as np

from dew.checkpoints import dtypes
from dew.checkpoints.errors import CorruptCheckpointError

FORMAT = "dew-checkpoint"
VERSION = 1
INDEX_NAME = "index.json"
CHECKSUM_ALGORITHM = "crc32"
DEFAULT_CHUNK_BYTES = 4 << 20
STEP_FOLDER = re.compile(r"step_(\d{8,})")
PROCESS_FILE = re.compile(r"process_(\d{5,})\.npz")
_MAX_BYTES = 1 << 62  # no array, piece or file is larger; bigger numbers are absurd, not large


def step_folder_name(step: int) -> str:
    return f"step_{step:08d}"


def process_file_name(process_index: int) -> str:
    return f"process_{process_index:05d}.npz"


@dataclasses.dataclass(frozen=True)
class Piece:
    """One saved block of an array: global slice [start, stop) per dimension, and its bytes."""

    file: str
    member: str
    start: tuple[int, ...]
    stop: tuple[int, ...]
    offset: int  # byte offset of the raw data in `file`
    nbytes: int
    crc32: tuple[int, ...]  # CRC-32 of each chunk_bytes chunk of the raw data

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.start, self.stop))

    def to_json(self) -> dict:
        return {
            "file": self.file,
            "member": self.member,
            "slice": [[a, b] for a, b in zip(self.start, self.stop)],
            "offset": self.offset,
            "nbytes": self.nbytes,
            "crc32": list(self.crc32),
        }


@dataclasses.dataclass(frozen=True)
class ArrayRecord:
    """One leaf of the saved tree: its key path, global shape, dtype name and pieces."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    pieces: tuple[Piece, ...]

    def to_json(self) -> dict:
        return {
            "path": self.path,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "stored_as": dtypes.storage_of(self.dtype).str,
            "pieces": [piece.to_json() for piece in self.pieces],
        }


@dataclasses.dataclass(frozen=True)
class Index:
    step: int
    metadata: dict
    treedef: str
    chunk_bytes: int
    files: dict[str, int]  # file name -> size in bytes
    arrays: tuple[ArrayRecord, ...]
    writer: dict

    def to_json(self) -> str:
        """The index as JSON text: one top-level field per line, one array per line."""
        fields = {
            "format": FORMAT,
            "version": VERSION,
            "step": self.step,
            "metadata": self.metadata,
            "treedef": self.treedef,
            "checksum": {"algorithm": CHECKSUM_ALGORITHM, "chunk_bytes": self.chunk_bytes},
            "files": [{"name": name, "bytes": size} for name, size in sorted(self.files.items())],
            "writer": self.writer,
        }
        lines = [
            f" {json.dumps(key)}: {json.dumps(value, allow_nan=False)},"
            for key, value in fields.items()
        ]
        arrays = ",\n".join(f"  {json.dumps(array.to_json())}" for array in self.arrays)
        return "{\n" + "\n".join(lines) + '\n "arrays": [\n' + arrays + "\n ]\n}\n"


class _Checker:
    """Raises CorruptCheckpointError with the step, the index file and the field at fault."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, message: str):
        raise CorruptCheckpointError(f"{self.where}: {message}")

    def get(self, mapping: dict, key: str, kind, field: str):
        if key not in mapping:
            self.fail(f"{field} has no {key!r}")
        value = mapping[key]
        if kind is int:
            if not isinstance(value, int) or isinstance(value, bool):
                self.fail(f"{field}.{key} must be an integer, not {value!r:.80}")
        elif not isinstance(value, kind):
            self.fail(f"{field}.{key} must be a {kind.__name__}, not {type(value).__name__}")
        return value

    def count(self, value, field: str, limit: int = _MAX_BYTES) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= limit:
            self.fail(f"{field} must be an integer in [0, {limit}], not {value!r:.80}")
        return value


def parse(text: bytes, where: str, expected_step: int | None = None) -> Index:
    """Parse and validate an index.json; `where` (e.g. "step 20: /ckpt/step_00000020/index.json")
    prefixes every error message."""
    check = _Checker(where)
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError) as error:
        check.fail(f"not valid JSON ({error})")
    if not isinstance(raw, dict):
        check.fail("not a Dew checkpoint index (the top level is not a JSON object)")
    if raw.get("format") != FORMAT:
        check.fail(
            f"not a Dew checkpoint index (format {raw.get('format')!r:.80}, expected {FORMAT!r})"
        )
    version = check.get(raw, "version", int, "index")
    if version != VERSION:
        newer = " (written by a newer Dew)" if version > VERSION else ""
        check.fail(f"format version {version}{newer}; this reader reads version {VERSION}")
    step = check.count(check.get(raw, "step", int, "index"), "step")
    if expected_step is not None and step != expected_step:
        check.fail(f"index says step {step}, but its folder is step {expected_step}")
    metadata = check.get(raw, "metadata", dict, "index")
    treedef = raw.get("treedef", "")
    writer = raw.get("writer", {})
    checksum = check.get(raw, "checksum", dict, "index")
    if checksum.get("algorithm") != CHECKSUM_ALGORITHM:
        check.fail(
            f"checksum algorithm {checksum.get('algorithm')!r:.80} (this reader knows crc32)"
        )
    chunk_bytes = check.count(
        check.get(checksum, "chunk_bytes", int, "checksum"), "checksum.chunk_bytes"
    )
    if chunk_bytes == 0 or chunk_bytes % 16:
        check.fail(f"checksum.chunk_bytes must be a positive multiple of 16, not {chunk_bytes}")

    files = {}
    for number, entry in enumerate(check.get(raw, "files", list, "index")):
        field = f"files[{number}]"
        if not isinstance(entry, dict):
            check.fail(f"{field} is not an object")
        name = check.get(entry, "name", str, field)
        if not PROCESS_FILE.fullmatch(name):
            check.fail(
                f"{field} names {name!r:.200}, "
                "which is not a process_NNNNN.npz file in the step folder"
            )
        if name in files:
            check.fail(f"{field} names {name} twice")
        files[name] = check.count(check.get(entry, "bytes", int, field), f"{field}.bytes")

    arrays, paths = [], set()
    for number, entry in enumerate(check.get(raw, "arrays", list, "index")):
        if not isinstance(entry, dict):
            check.fail(f"arrays[{number}] is not an object")
        arrays.append(_parse_array(check, entry, f"arrays[{number}]", files, chunk_bytes))
        if arrays[-1].path in paths:
            check.fail(f"arrays[{number}] repeats the path {arrays[-1].path}")
        paths.add(arrays[-1].path)
    return Index(step, metadata, str(treedef), chunk_bytes, files, tuple(arrays), writer)


def _parse_array(
    check: _Checker, entry: dict, field: str, files: dict, chunk_bytes: int
) -> ArrayRecord:
    path = check.get(entry, "path", str, field)
    field = f"{field} ({path})"
    shape = tuple(check.count(d, f"{field}.shape") for d in check.get(entry, "shape", list, field))
    dtype = check.get(entry, "dtype", str, field)
    try:
        storage = dtypes.storage_of(dtype)
    except KeyError:
        check.fail(f"{field} has dtype {dtype!r:.80}, which Dew does not store")
    stored_as = entry.get("stored_as", storage.str)
    if stored_as != storage.str:
        check.fail(
            f"{field} is stored as {stored_as!r:.80}, but {dtype} is stored as {storage.str!r}"
        )
    itemsize = storage.itemsize
    if math.prod(shape) * itemsize > _MAX_BYTES:
        check.fail(f"{field} declares an absurd shape {shape}")
    pieces = []
    for number, raw in enumerate(check.get(entry, "pieces", list, field)):
        where = f"{field}.pieces[{number}]"
        if not isinstance(raw, dict):
            check.fail(f"{where} is not an object")
        file = check.get(raw, "file", str, where)
        if file not in files:
            check.fail(f"{where} names file {file!r:.200}, which the index's file list lacks")
        member = check.get(raw, "member", str, where)
        bounds = check.get(raw, "slice", list, where)
        if len(bounds) != len(shape):
            check.fail(
                f"{where} has a {len(bounds)}-dimensional slice "
                f"for a {len(shape)}-dimensional array"
            )
        start, stop = [], []
        for dim, (bound, size) in enumerate(zip(bounds, shape)):
            if not (isinstance(bound, list) and len(bound) == 2):
                check.fail(f"{where}.slice[{dim}] must be [start, stop]")
            a, b = (check.count(x, f"{where}.slice[{dim}]", size) for x in bound)
            if a > b:
                check.fail(f"{where}.slice[{dim}] = [{a}, {b}] runs backwards")
            start.append(a)
            stop.append(b)
        offset = check.count(check.get(raw, "offset", int, where), f"{where}.offset")
        nbytes = check.count(check.get(raw, "nbytes", int, where), f"{where}.nbytes")
        expected = math.prod(b - a for a, b in zip(start, stop)) * itemsize
        if nbytes != expected:
            check.fail(
                f"{where} declares {nbytes} bytes, but its slice of {dtype} holds {expected}"
            )
        if offset + nbytes > files[file]:
            check.fail(
                f"{where} ends at byte {offset + nbytes}, "
                f"past the end of {file} ({files[file]} bytes)"
            )
        crcs = check.get(raw, "crc32", list, where)
        chunks = -(-nbytes // chunk_bytes)
        if len(crcs) != chunks:
            check.fail(f"{where} has {len(crcs)} chunk checksums; {nbytes} bytes need {chunks}")
        for value in crcs:
            check.count(value, f"{where}.crc32", 0xFFFFFFFF)
        pieces.append(Piece(file, member, tuple(start), tuple(stop), offset, nbytes, tuple(crcs)))
    _check_tiling(check, field, shape, pieces)
    return ArrayRecord(path, shape, dtype, tuple(pieces))


def _check_tiling(check: _Checker, field: str, shape: tuple[int, ...], pieces: list[Piece]) -> None:
    """The pieces must cover the array exactly once: disjoint, and their sizes add up to its
    size."""
    total = sum(math.prod(piece.shape) for piece in pieces)
    if total != math.prod(shape):
        check.fail(f"{field}: its pieces hold {total} elements, the array {math.prod(shape)}")
    nonempty = [piece for piece in pieces if math.prod(piece.shape) > 0]
    if len(nonempty) < 2 or not shape:
        return
    starts = np.array([piece.start for piece in nonempty], dtype=np.int64)
    stops = np.array([piece.stop for piece in nonempty], dtype=np.int64)
    block = 1024  # bounds the pairwise comparison's memory for arrays with very many pieces
    for first in range(0, len(nonempty), block):
        a_start, a_stop = starts[first : first + block, None], stops[first : first + block, None]
        overlap = np.all((a_start < stops[None]) & (starts[None] < a_stop), axis=-1)
        rows = np.arange(overlap.shape[0])
        overlap[rows, first + rows] = False
        if overlap.any():
            i, j = np.argwhere(overlap)[0]
            a, b = nonempty[first + i], nonempty[j]
            check.fail(
                f"{field}: pieces {list(zip(a.start, a.stop))} "
                f"and {list(zip(b.start, b.stop))} overlap"
            )
