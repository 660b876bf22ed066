"""The safetensors format, read and written directly (no dependency): what ``dew.models.hf`` needs.

A file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON and the data. The JSON
maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (byte offsets into
the data, which start right after the header), plus an optional ``"__metadata__"`` of strings.
Data is C order, little-endian, the tensors packed one after another without gaps.

``Header.read(path)`` checks a file's header against its size before anything is read, so a
truncated or damaged file is refused with a ``ValueError`` naming it; ``read_block`` reads the
rows (and columns) of one tensor that a caller asks for by positioned reads, never the whole
file; ``write`` writes tensors one at a time, holding only the one being written.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

import ml_dtypes
import numpy as np

# safetensors dtype names Dew reads and writes, with their numpy dtypes.
DTYPES = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F64": np.dtype("<f8"),
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
# A header larger than this is damage, not a model (safetensors' own limit is 100 MB).
MAX_HEADER_BYTES = 100_000_000
# Reads of a tensor's rows go through a scratch buffer of at most this many bytes.
SCRATCH_BYTES = 16 * 2**20


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One tensor of a file: its dtype, shape and where its bytes lie in the file."""

    path: Path
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # of its first byte in the file
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Header:
    path: Path
    tensors: dict[str, Tensor]
    metadata: dict

    @classmethod
    def read(cls, path: str | os.PathLike) -> Header:
        """The header of the safetensors file ``path``, checked against the file's size;
        ``ValueError`` naming the file and what is wrong."""
        path = Path(path)
        try:
            size = path.stat().st_size
            with open(path, "rb") as file:
                head = file.read(8)
                if len(head) < 8:
                    raise ValueError(f"{path} is not a safetensors file: {size} bytes, truncated")
                (length,) = struct.unpack("<Q", head)
                if length > MAX_HEADER_BYTES or 8 + length > size:
                    raise ValueError(
                        f"{path} is truncated or not a safetensors file: its header says "
                        f"{length} bytes of JSON, the file has {size} bytes"
                    )
                text = file.read(length)
        except OSError as error:
            raise ValueError(f"{path} cannot be read ({error})") from None
        try:
            raw = json.loads(text)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"{path}: the safetensors header is not JSON ({error})") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: the safetensors header is not a JSON object")
        start = 8 + length
        tensors, end = {}, 0
        for name, entry in raw.items():
            if name == "__metadata__":
                continue
            tensor = _tensor(path, name, entry, start)
            tensors[name] = tensor
            end = max(end, tensor.offset + tensor.nbytes)
        if end > size:
            raise ValueError(
                f"{path} is truncated: its tensors end at byte {end}, the file has {size} bytes"
            )
        metadata = raw.get("__metadata__") or {}
        return cls(path, tensors, metadata if isinstance(metadata, dict) else {})


def _tensor(path: Path, name: str, entry, start: int) -> Tensor:
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        raise ValueError(f"{where} lacks dtype, shape or data_offsets")
    if entry["dtype"] not in DTYPES:
        raise ValueError(
            f"{where} has dtype {entry['dtype']!r}, which Dew does not load; supported: "
            f"{', '.join(DTYPES)}"
        )
    dtype = DTYPES[entry["dtype"]]
    shape, offsets = entry["shape"], entry["data_offsets"]
    if not isinstance(shape, list) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
    ):
        raise ValueError(f"{where} has shape {shape!r}, not a list of sizes")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(n, int) and not isinstance(n, bool) for n in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise ValueError(f"{where} has data_offsets {offsets!r}, not [begin, end]")
    nbytes = math.prod(shape) * dtype.itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise ValueError(
            f"{where}: data_offsets {offsets} span {offsets[1] - offsets[0]} bytes, its shape "
            f"{shape} of {entry['dtype']} needs {nbytes}"
        )
    return Tensor(path, name, dtype, tuple(shape), start + offsets[0], nbytes)


def _pread_into(fd: int, buffer: np.ndarray, offset: int, where: str) -> None:
    view = memoryview(buffer.reshape(-1).view(np.uint8))
    while len(view):
        count = os.preadv(fd, [view], offset)
        if count == 0:
            raise ValueError(f"{where}: the file ends at byte {offset}, before the tensor does")
        view, offset = view[count:], offset + count


def read_block(tensor: Tensor, rows: tuple[int, int], cols: tuple[int, int] | None = None):
    """Rows ``rows[0]:rows[1]`` (of the first dimension) of ``tensor``, and of a 2-D tensor
    columns ``cols``, as a new array in the file's dtype. Only those rows' bytes are read; when
    ``cols`` is a part of each row, the rows go through a scratch buffer of at most
    ``SCRATCH_BYTES`` (a few rows at a time), so a column slice of a large matrix never holds it
    whole."""
    shape = tensor.shape
    width = math.prod(shape[1:])
    row_bytes = width * tensor.dtype.itemsize
    r0, r1 = rows
    whole_rows = cols is None or (cols[0] == 0 and cols[1] == shape[1])
    out_shape = (r1 - r0, *shape[1:]) if whole_rows else (r1 - r0, cols[1] - cols[0])
    out = np.empty(out_shape, tensor.dtype)
    where = f"{tensor.path}: tensor {tensor.name!r}"
    fd = os.open(tensor.path, os.O_RDONLY)
    try:
        if whole_rows:
            _pread_into(fd, out, tensor.offset + r0 * row_bytes, where)
            return out
        step = max(1, SCRATCH_BYTES // max(row_bytes, 1))
        for first in range(r0, r1, step):
            last = min(r1, first + step)
            scratch = np.empty((last - first, shape[1]), tensor.dtype)
            _pread_into(fd, scratch, tensor.offset + first * row_bytes, where)
            out[first - r0 : last - r0] = scratch[:, cols[0] : cols[1]]
        return out
    finally:
        os.close(fd)


def write(
    path: str | os.PathLike,
    entries: Iterable[tuple[str, np.dtype, tuple[int, ...], Callable[[], np.ndarray]]],
    metadata: dict | None = None,
) -> None:
    """Writes a safetensors file of ``entries``: ``(name, dtype, shape, make)``, where
    ``make()`` returns the tensor (called one at a time, in order, so only one is held). The
    header is written first, from the declared dtypes and shapes; a tensor that does not match
    its declaration raises ``ValueError``."""
    entries = list(entries)
    header, offset = {}, 0
    if metadata:
        header["__metadata__"] = metadata
    for name, dtype, shape, _ in entries:
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        header[name] = {
            "dtype": NAMES[np.dtype(dtype)],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(text)))
        file.write(text)
        for name, dtype, shape, make in entries:
            array = np.ascontiguousarray(make())
            if array.dtype != np.dtype(dtype) or array.shape != tuple(shape):
                raise ValueError(
                    f"tensor {name}: made {array.dtype}{list(array.shape)}, declared "
                    f"{np.dtype(dtype)}{list(shape)}"
                )
            file.write(array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes())
        file.flush()
        os.fsync(file.fileno())
