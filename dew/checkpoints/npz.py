"""Write an uncompressed .npz whose members' data sit at known, 64-byte-aligned offsets.

An .npz is a ZIP archive of .npy files. This writer stores members uncompressed (ZIP_STORED) and
lays the whole file out before writing a byte, so the offset of every member's raw array data is
known: the index records it, and a reader takes the bytes it needs with one positioned read, without
parsing the ZIP or the .npy header. The result is an ordinary ZIP64-capable archive that `np.load`
and `unzip` read.

Layout of one member: ZIP local header (30 bytes), file name, extra field (a ZIP64 size record when
the member is 0xFFFFFFFF bytes or larger, then padding in an extra record with id 0xD935 so that
what follows starts on a 64-byte boundary), the .npy header (its length is a multiple of 64), the
raw data.
After the last member: the central directory and the end records (ZIP64 ones when needed).

The CRC-32 of each `chunk_bytes` chunk of a member's data is computed in a helper thread while the
data is being written (both release the GIL); the ZIP's whole-member CRC is derived from those.
`write_stream` writes the same bytes front to back to a file object (an upload to object storage,
which cannot seek back): there each member's CRCs are computed before its header is written.
The disk works meanwhile: every `WRITEBACK_BYTES` written, another helper thread starts an
`fdatasync` of what is in the page cache so far, and once the data is in, a last one runs while the
CRCs finish; the final `fsync`, after the headers, then has little left to wait for.
"""

import dataclasses
import io
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

from dew.checkpoints import crc

ALIGNMENT = 64
# Sync the data written so far every this many bytes, so the final fsync has little left to wait
# for (measured: docs/results/cpu-layouts.md, 'Checkpoints').
WRITEBACK_BYTES = 64 << 20
_ZIP64_LIMIT = 0xFFFFFFFF
_PADDING_EXTRA_ID = 0xD935  # the id zipalign uses for alignment padding
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_END = struct.Struct("<IHHHHIIH")
_ZIP64_END = struct.Struct("<IQHHIIQQQQ")
_ZIP64_LOCATOR = struct.Struct("<IIQI")
_DOS_DATE = (0 << 9) | (1 << 5) | 1  # 1980-01-01, so files are reproducible
_UNIX_FILE_MODE = 0o100644 << 16


@dataclasses.dataclass(frozen=True)
class WrittenMember:
    """Where a member's raw data landed: byte offset in the file, length, chunk CRC-32s."""

    name: str
    offset: int
    nbytes: int
    chunk_crcs: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class _Planned:
    name: bytes
    header_offset: int
    extra: bytes
    npy_header: bytes
    data_offset: int
    nbytes: int  # raw data only
    zip64: bool  # sizes in a ZIP64 extra record

    @property
    def member_bytes(self) -> int:
        return len(self.npy_header) + self.nbytes


def _c_order(array: np.ndarray) -> np.ndarray:
    """`array` itself if C-contiguous, else a C-ordered copy (unlike np.ascontiguousarray, keeps
    0-d arrays 0-d)."""
    return array if array.flags.c_contiguous else np.array(array, order="C")


def npy_header(array: np.ndarray) -> bytes:
    """The .npy header (magic, version, dict) for a C-ordered `array`; its length is a multiple of
    64."""
    out = io.BytesIO()
    header = np.lib.format.header_data_from_array_1_0(array)
    try:
        np.lib.format.write_array_header_1_0(out, header)
    except ValueError:  # a header over 64 KiB needs format 2.0
        out = io.BytesIO()
        np.lib.format.write_array_header_2_0(out, header)
    return out.getvalue()


def _plan(members: list[tuple[str, np.ndarray]], zip64_limit: int) -> list[_Planned]:
    planned, offset = [], 0
    for name, array in members:
        encoded = name.encode("utf-8")
        header = npy_header(array)
        member_bytes = len(header) + array.nbytes
        zip64 = (
            struct.pack("<HHQQ", 1, 16, member_bytes, member_bytes)
            if member_bytes >= zip64_limit
            else b""
        )
        unpadded = offset + _LOCAL.size + len(encoded) + len(zip64)
        pad = -unpadded % ALIGNMENT
        if 0 < pad < 4:  # an extra record needs 4 bytes of its own
            pad += ALIGNMENT
        padding = struct.pack("<HH", _PADDING_EXTRA_ID, pad - 4) + bytes(pad - 4) if pad else b""
        data_offset = unpadded + pad + len(header)
        planned.append(
            _Planned(
                encoded, offset, zip64 + padding, header, data_offset, array.nbytes, bool(zip64)
            )
        )
        offset = data_offset + array.nbytes
    return planned


def _sync_data(fd: int) -> None:
    """Write the file's data to disk (its metadata follows with the final fsync; macOS has no
    fdatasync)."""
    getattr(os, "fdatasync", os.fsync)(fd)


def _pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _local_header(entry: _Planned, zip_crc: int) -> bytes:
    size = 0xFFFFFFFF if entry.zip64 else entry.member_bytes
    return (
        _LOCAL.pack(
            0x04034B50,
            45 if entry.zip64 else 20,
            0,
            0,
            0,
            _DOS_DATE,
            zip_crc,
            size,
            size,
            len(entry.name),
            len(entry.extra),
        )
        + entry.name
        + entry.extra
    )


def _central_record(entry: _Planned, zip_crc: int, zip64_limit: int) -> bytes:
    fields = []
    size, offset = entry.member_bytes, entry.header_offset
    if size >= zip64_limit:
        fields += [size, size]
        size = 0xFFFFFFFF
    if offset >= zip64_limit:
        fields.append(offset)
        offset = 0xFFFFFFFF
    extra = struct.pack(f"<HH{len(fields)}Q", 1, 8 * len(fields), *fields) if fields else b""
    version = 45 if fields else 20
    return (
        _CENTRAL.pack(
            0x02014B50,
            (3 << 8) | version,
            version,
            0,
            0,
            0,
            _DOS_DATE,
            zip_crc,
            size,
            size,
            len(entry.name),
            len(extra),
            0,
            0,
            0,
            _UNIX_FILE_MODE,
            offset,
        )
        + entry.name
        + extra
    )


def _end_records(
    count: int, directory_offset: int, directory_bytes: int, zip64_limit: int
) -> bytes:
    needs_zip64 = (
        count >= 0xFFFF or directory_offset >= zip64_limit or directory_bytes >= zip64_limit
    )
    out = b""
    if needs_zip64:
        zip64_end_offset = directory_offset + directory_bytes
        out += _ZIP64_END.pack(
            0x06064B50,
            _ZIP64_END.size - 12,
            (3 << 8) | 45,
            45,
            0,
            0,
            count,
            count,
            directory_bytes,
            directory_offset,
        )
        out += _ZIP64_LOCATOR.pack(0x07064B50, 0, zip64_end_offset, 1)
        count16, offset32, size32 = 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF
    else:
        count16, offset32, size32 = count, directory_offset, directory_bytes
    return out + _END.pack(0x06054B50, 0, 0, count16, count16, size32, offset32, 0)


def _zip_crc(entry: _Planned, chunk_crcs: list[int], chunk_bytes: int) -> int:
    """The ZIP CRC-32 of a whole member (.npy header and data), from its data's chunk CRCs."""
    return crc.whole_crc(chunk_crcs, chunk_bytes, entry.nbytes, zlib.crc32(entry.npy_header))


def _tail(planned: list[_Planned], zip_crcs: list[int], zip64_limit: int) -> tuple[int, bytes]:
    """(offset, bytes) of what follows the last member: the central directory and end records."""
    directory_offset = planned[-1].data_offset + planned[-1].nbytes if planned else 0
    directory_bytes = b"".join(
        _central_record(entry, zip_crc, zip64_limit) for entry, zip_crc in zip(planned, zip_crcs)
    )
    tail = directory_bytes + _end_records(
        len(planned), directory_offset, len(directory_bytes), zip64_limit
    )
    return directory_offset, tail


def write(
    path,
    members: list[tuple[str, np.ndarray]],
    chunk_bytes: int,
    *,
    after_member: Callable[[str], None] | None = None,
    zip64_limit: int = _ZIP64_LIMIT,
) -> tuple[list[WrittenMember], int]:
    """Write `members` (name, C-contiguous array) to a new file at `path`, fsync it.

    Returns the data offset, length and chunk CRCs of each member, and the file's size. The file
    must not exist. `after_member` is called after each member's data is written (a test hook).
    `zip64_limit` lowers the size from which ZIP64 records are used (for tests; default
    0xFFFFFFFF bytes, where ZIP needs them).
    """
    members = [(name, _c_order(array)) for name, array in members]
    planned = _plan(members, zip64_limit)
    arrays = [array.reshape(-1).view(np.uint8) for _, array in members]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        # One helper computes CRCs while this thread writes (both release the GIL); another syncs
        # what is written so far. Both are joined before the descriptor is closed.
        with (
            ThreadPoolExecutor(1, thread_name_prefix="dew-checkpoint-crc") as crc_thread,
            ThreadPoolExecutor(1, thread_name_prefix="dew-checkpoint-sync") as sync_thread,
        ):
            futures = [
                crc_thread.submit(crc.chunk_crcs, memoryview(array), chunk_bytes)
                for array in arrays
            ]
            syncs, unsynced = [], 0
            try:
                for entry, array in zip(planned, arrays):
                    _pwrite_all(fd, entry.npy_header, entry.data_offset - len(entry.npy_header))
                    _pwrite_all(fd, array, entry.data_offset)
                    if after_member is not None:
                        after_member(entry.name.decode())
                    unsynced += array.nbytes
                    if unsynced >= WRITEBACK_BYTES:
                        syncs.append(sync_thread.submit(_sync_data, fd))
                        unsynced = 0
                syncs.append(sync_thread.submit(_sync_data, fd))
                chunk_crcs = [future.result() for future in futures]
            finally:
                for future in futures:
                    future.cancel()
            zip_crcs = [
                _zip_crc(entry, crcs, chunk_bytes) for entry, crcs in zip(planned, chunk_crcs)
            ]
            for entry, zip_crc in zip(planned, zip_crcs):
                _pwrite_all(fd, _local_header(entry, zip_crc), entry.header_offset)
            directory_offset, tail = _tail(planned, zip_crcs, zip64_limit)
            _pwrite_all(fd, tail, directory_offset)
            # A failed writeback is reported to one fsync call only: check every one of them.
            for sync in syncs:
                sync.result()
        os.fsync(fd)
        size = directory_offset + len(tail)
    finally:
        os.close(fd)
    written = [
        WrittenMember(entry.name.decode(), entry.data_offset, entry.nbytes, tuple(crcs))
        for entry, crcs in zip(planned, chunk_crcs)
    ]
    return written, size


def write_stream(
    file,
    members: list[tuple[str, np.ndarray]],
    chunk_bytes: int,
    *,
    after_member: Callable[[str], None] | None = None,
    zip64_limit: int = _ZIP64_LIMIT,
) -> tuple[list[WrittenMember], int]:
    """Write the bytes `write` would, front to back, to the binary file object `file` (an upload
    to object storage, which cannot seek back to fill in the local headers).

    Each member's local header carries its CRC, so its chunk CRCs are computed before it is
    written; a helper thread computes the next members' while this one uploads. Returns what
    `write` returns; does not close `file`.
    """
    members = [(name, _c_order(array)) for name, array in members]
    planned = _plan(members, zip64_limit)
    arrays = [array.reshape(-1).view(np.uint8) for _, array in members]
    with ThreadPoolExecutor(1, thread_name_prefix="dew-checkpoint-crc") as crc_thread:
        futures = [
            crc_thread.submit(crc.chunk_crcs, memoryview(array), chunk_bytes) for array in arrays
        ]
        try:
            chunk_crcs, zip_crcs = [], []
            # The plan leaves no gaps: each member's local header starts where the previous
            # member's data ends, so writing in order lays every byte where `write` puts it.
            for entry, array, future in zip(planned, arrays, futures):
                chunk_crcs.append(future.result())
                zip_crcs.append(_zip_crc(entry, chunk_crcs[-1], chunk_bytes))
                file.write(_local_header(entry, zip_crcs[-1]))
                file.write(entry.npy_header)
                file.write(memoryview(array))
                if after_member is not None:
                    after_member(entry.name.decode())
        finally:
            for future in futures:
                future.cancel()
    directory_offset, tail = _tail(planned, zip_crcs, zip64_limit)
    file.write(tail)
    written = [
        WrittenMember(entry.name.decode(), entry.data_offset, entry.nbytes, tuple(crcs))
        for entry, crcs in zip(planned, chunk_crcs)
    ]
    return written, directory_offset + len(tail)
