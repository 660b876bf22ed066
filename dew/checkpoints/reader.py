"""The resharding loader: build each device's slice of every array from the saved pieces.

For each array, this process works out the distinct slices its devices need (devices holding the
same slice share one host buffer) and reads every saved piece that overlaps them once: only the byte
range of the piece that the slices need, widened to whole checksum chunks. When a slice's region is
contiguous both in the piece and in the slice (splits along the leading axis, the usual case), one
positioned read (`os.preadv`; a ranged read on object storage) puts the bytes straight into the
slice's buffer; otherwise they go to a scratch buffer and are copied into place. Every chunk read
is checked against its CRC-32 before any of its bytes are used: a mismatch raises instead of
placing damaged data.

Host memory: the slices are split into groups joined by the pieces they share; a group's slices are
sent to their devices as soon as their last piece is in, `workers` groups at a time (on threads:
reads and CRCs release the GIL). Restoring a sharded state thus holds about `workers` pieces' worth
of buffers at once, never a copy of the whole state.

Layout: the index and the step's files, each checked once (`read_index`, `_Files`); reading one
piece into the slices that need it, every chunk checked (`_read_exactly`, `_verify`, `_read_piece`);
the slices this process needs, grouped under the host-memory bound and sent to their devices
(`_target_slices`, `_assemble`, `_groups`, `_fill_and_place`, `_restore_array`); the target's leaves
paired with the saved arrays (`_match`); and `restore`, the entry point. It is one module because
planning the reads, grouping the slices and checking every chunk are one pass over the same index,
kept together so that no byte reaches a slice unchecked.
"""

import math
import os
import stat
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import numpy as np

from dew._jax_compat import collect_runtime_garbage
from dew.checkpoints import dtypes
from dew.checkpoints.errors import CheckpointMismatchError, CorruptCheckpointError
from dew.checkpoints.index import INDEX_NAME, ArrayRecord, Index, Piece, parse
from dew.checkpoints.memory import aligned_empty

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (start, stop) per dimension


def _open_no_follow(path: Path, where: str) -> int:
    """A read-only descriptor of `path`, refusing a symlink; CorruptCheckpointError otherwise."""
    try:
        return os.open(
            path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        )
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where} is missing") from None
    except OSError as error:  # ELOOP: a symlink
        raise CorruptCheckpointError(
            f"{where} cannot be opened as a regular file ({error})"
        ) from None


def read_index(step_dir: Path, step: int) -> Index:
    """Read and validate `step_dir`/index.json; CorruptCheckpointError naming the step and file."""
    path = step_dir / INDEX_NAME
    where = f"step {step}: {path}"
    fd = _open_no_follow(path, where)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CorruptCheckpointError(f"{where} is not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as file:
            text = file.read()
    except OSError as error:
        raise CorruptCheckpointError(f"{where} cannot be read ({error})") from None
    finally:
        os.close(fd)
    return parse(text, where, step)


class _Files:
    """Open descriptors of a step's process files, each checked once: a regular file (not a
    symlink) inside the step folder, with exactly the size the index records."""

    def __init__(self, step_dir: Path, index: Index):
        self.step_dir, self.index, self.fds = step_dir, index, {}
        self.location = step_dir.parent  # the checkpoint directory, for messages

    def check_all(self) -> None:
        """Open and check every file; done before reading, so that later calls from the reading
        threads only look descriptors up."""
        for name in self.index.files:
            self.fd(name)

    def fd(self, name: str) -> int:
        if name not in self.fds:
            path = self.step_dir / name
            where = f"step {self.index.step}: {path}"
            fd = _open_no_follow(path, where)
            info = os.fstat(fd)
            expected = self.index.files[name]
            if not stat.S_ISREG(info.st_mode) or info.st_size != expected:
                os.close(fd)
                what = (
                    "is not a regular file"
                    if not stat.S_ISREG(info.st_mode)
                    else (
                        f"is truncated: {info.st_size} bytes, the index records {expected}"
                        if info.st_size < expected
                        else f"has {info.st_size} bytes, the index records {expected}"
                    )
                )
                raise CorruptCheckpointError(f"{where} {what}")
            self.fds[name] = fd
        return self.fds[name]

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """C-order strides in elements."""
    out, step = [], 1
    for size in reversed(shape):
        out.append(step)
        step *= size
    return tuple(reversed(out))


def _span(region: Box, origin: tuple[int, ...], shape: tuple[int, ...]) -> tuple[int, int, bool]:
    """Element range [first, last + 1) that `region` occupies in a C-ordered block of `shape` whose
    corner is at global `origin`, and whether the region fills that range exactly (is
    contiguous)."""
    strides = _strides(shape)
    first = sum((a - o) * s for a, o, s in zip(region[0], origin, strides))
    last = sum((b - 1 - o) * s for b, o, s in zip(region[1], origin, strides))
    volume = math.prod(b - a for a, b in zip(*region))
    return first, last + 1, last + 1 - first == volume


def _overlap(a: Box, b: Box) -> Box | None:
    start = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    stop = tuple(min(x, y) for x, y in zip(a[1], b[1]))
    return (start, stop) if all(x < y for x, y in zip(start, stop)) else None


def _read_exactly(fd, buffers: list[memoryview], offset: int, where: str) -> None:
    """Fill `buffers` with consecutive bytes of the file from `offset`. `fd` is a descriptor, or
    an object with `read_into(buffers, offset, where)` (a file on object storage)."""
    if not isinstance(fd, int):
        fd.read_into(buffers, offset, where)
        return
    remaining = [b for b in buffers if len(b)]
    while remaining:
        try:
            count = os.preadv(fd, remaining, offset)
        except OSError as error:
            raise CorruptCheckpointError(f"{where}: read failed ({error})") from None
        if count == 0:
            raise CorruptCheckpointError(
                f"{where}: file ends at byte {offset}, before the piece does"
            )
        offset += count
        while count:
            take = min(count, len(remaining[0]))
            count -= take
            remaining[0] = remaining[0][take:]
            if not len(remaining[0]):
                remaining.pop(0)


def _verify(
    segments: list[memoryview], begin: int, piece: Piece, chunk_bytes: int, where: str
) -> None:
    """Check the CRC-32 of every chunk that `segments` (consecutive bytes of the piece starting at
    piece byte `begin`, a chunk boundary, and ending at a chunk boundary or the piece's end)
    cover."""
    chunk = begin // chunk_bytes
    position, crc = begin, 0
    chunk_end = min(position + chunk_bytes, piece.nbytes)
    for segment in segments:
        i = 0
        while i < len(segment):
            take = min(len(segment) - i, chunk_end - position)
            crc = zlib.crc32(segment[i : i + take], crc)
            i, position = i + take, position + take
            if position == chunk_end:
                if crc != piece.crc32[chunk]:
                    raise CorruptCheckpointError(
                        f"{where}: checksum mismatch in bytes {chunk * chunk_bytes}-{position} "
                        f"of piece {piece.member} (CRC-32 {crc:08x}, "
                        f"the index records {piece.crc32[chunk]:08x})"
                    )
                chunk, crc = chunk + 1, 0
                chunk_end = min(position + chunk_bytes, piece.nbytes)


def _read_piece(
    piece: Piece,
    destinations: list[tuple[Box, Box, np.ndarray]],
    storage: np.dtype,
    fd,  # a descriptor, or a remote.RemoteFile
    chunk_bytes: int,
    where: str,
) -> None:
    """Copy the parts of `piece` that `destinations` (region, destination box, buffer) need."""
    itemsize = storage.itemsize
    origin, shape = piece.start, piece.shape
    spans = [_span(region, origin, shape) for region, _, _ in destinations]
    low = min(first for first, _, _ in spans) * itemsize
    high = max(end for _, end, _ in spans) * itemsize
    begin = low - low % chunk_bytes  # whole checksum chunks
    end = min(-(-high // chunk_bytes) * chunk_bytes, piece.nbytes)
    where = f"{where} ({piece.file}, member {piece.member})"

    # Direct: each region fills a contiguous byte range of both the piece and its buffer, and the
    # ranges do not overlap; then preadv reads them into place, with scratch only for the bytes
    # between them and at the edges of the checksum chunks. Ranges whose chunks do not touch are
    # read separately, so that bytes nobody here needs (other processes' rows) are skipped.
    order = sorted(range(len(destinations)), key=lambda i: spans[i][0])
    direct = all(spans[i][2] for i in order) and all(
        spans[a][1] <= spans[b][0] for a, b in zip(order, order[1:])
    )
    views = []
    if direct:
        for i in order:
            region, box, buffer = destinations[i]
            first, stop, contiguous = _span(region, box[0], buffer.shape)
            if not contiguous:
                direct = False
                break
            view = buffer.reshape(-1)[first:stop].view(np.uint8)
            views.append((spans[i][0] * itemsize, spans[i][1] * itemsize, view))
    if direct:
        runs: list[list] = []  # [run begin, run end, [(first byte, end byte, view)]]
        for first, stop, view in views:
            run_begin = first - first % chunk_bytes
            run_end = min(-(-stop // chunk_bytes) * chunk_bytes, piece.nbytes)
            if runs and run_begin <= runs[-1][1]:
                runs[-1][1] = max(runs[-1][1], run_end)
                runs[-1][2].append((first, stop, view))
            else:
                runs.append([run_begin, run_end, [(first, stop, view)]])
        for run_begin, run_end, parts in runs:
            segments, position = [], run_begin
            for first, stop, view in parts:
                if first > position:
                    segments.append(memoryview(np.empty(first - position, np.uint8)))
                segments.append(memoryview(view))
                position = stop
            if run_end > position:
                segments.append(memoryview(np.empty(run_end - position, np.uint8)))
            _read_exactly(fd, segments, piece.offset + run_begin, where)
            _verify(segments, run_begin, piece, chunk_bytes, where)
        return

    scratch = np.empty(end - begin, np.uint8)
    _read_exactly(fd, [memoryview(scratch)], piece.offset + begin, where)
    _verify([memoryview(scratch)], begin, piece, chunk_bytes, where)
    elements = scratch[low - begin : high - begin].view(storage)
    byte_strides = tuple(s * itemsize for s in _strides(shape))
    for (region, box, buffer), (first, _, _) in zip(destinations, spans):
        source = np.lib.stride_tricks.as_strided(
            elements[first - low // itemsize :],
            shape=tuple(b - a for a, b in zip(*region)),
            strides=byte_strides,
            writeable=False,
        )
        target = tuple(slice(a - o, b - o) for a, b, o in zip(region[0], region[1], box[0]))
        buffer[target] = source


def _target_slices(shape, sharding) -> dict[Box, list]:
    """Distinct global boxes this process's devices need, each with the devices that need it."""
    boxes: dict[Box, list] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        start, stop = [], []
        for item, size in zip(index, shape):
            a, b, _ = item.indices(size)
            start.append(a)
            stop.append(max(a, b))
        boxes.setdefault((tuple(start), tuple(stop)), []).append(device)
    return boxes


def _assemble(
    record: ArrayRecord, boxes: list[Box], files: "_Files", chunk_bytes: int, where: str, pool=None
) -> dict[Box, np.ndarray]:
    """Host buffers (storage dtype) for `boxes`, filled from the pieces that overlap them, each
    piece read once; the pieces are read on `pool` if given, else in this thread."""
    storage = dtypes.storage_of(record.dtype)
    buffers = {box: aligned_empty(tuple(b - a for a, b in zip(*box)), storage) for box in boxes}
    jobs = []
    for piece in record.pieces:
        destinations = []
        for box, buffer in buffers.items():
            region = _overlap((piece.start, piece.stop), box)  # ((), ()) for 0-d arrays
            if region is not None:
                destinations.append((region, box, buffer))
        if destinations:
            fd = files.fd(piece.file)
            jobs.append((piece, destinations, storage, fd, chunk_bytes, f"{where}, {record.path}"))
    if pool is None:
        for job in jobs:
            _read_piece(*job)
    else:
        for future in [pool.submit(_read_piece, *job) for job in jobs]:
            future.result()
    return buffers


Touch = tuple[Piece, list[tuple[Box, Box]]]  # a piece, and (box, region of the piece it needs)


def _groups(record: ArrayRecord, boxes: list[Box]) -> list[tuple[list[Box], list[Touch]]]:
    """Split `boxes` into groups joined by the pieces they share, each with its pieces in order.

    Groups are independent: each can be read and sent to its devices on its own, every piece of it
    read once. Slices that each lie in their own pieces (a layout restored into itself, or into a
    finer or coarser split of the same axis) form many small groups; slices that share a piece (row
    blocks of one whole saved array, column blocks of row-split pieces) form one.
    """
    parent = list(range(len(boxes)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    touches = []
    for piece in record.pieces:
        touched = []
        for number, box in enumerate(boxes):
            region = _overlap((piece.start, piece.stop), box)
            if region is not None:
                touched.append((number, region))
                parent[root(number)] = root(touched[0][0])
        if touched:
            touches.append((piece, touched))
    groups: dict[int, tuple[list[Box], list[Touch]]] = {}
    for number, box in enumerate(boxes):
        groups.setdefault(root(number), ([], []))[0].append(box)
    for piece, touched in touches:
        groups[root(touched[0][0])][1].append(
            (piece, [(boxes[n], region) for n, region in touched])
        )
    return list(groups.values())


def _place(host: np.ndarray, devices: list) -> list[jax.Array]:
    """Copies of `host` on `devices`. (The CPU backend may adopt an aligned host buffer as the
    device buffer instead of copying it, as `jax.device_put` of a numpy array does.)"""
    placed = jax.device_put([host] * len(devices), devices)
    jax.block_until_ready(placed)
    # The runtime lets go of the host buffer from its own thread and defers the Python release to
    # its next call; collect it now, so that each slice's host buffer is freed as soon as it is
    # copied (on a jaxlib without that call, a no-op: the buffer then goes a call later).
    collect_runtime_garbage()
    return placed


def _fill_and_place(
    record: ArrayRecord,
    group: tuple[list[Box], list[Touch]],
    slices: dict,
    files: "_Files",
    chunk_bytes: int,
    where: str,
) -> list[jax.Array]:
    """Read a group's pieces in order; send each slice to its devices as soon as its last piece is
    in, so that a chain of pieces and slices holds only a few slices at a time."""
    boxes, touches = group
    storage, dtype = dtypes.storage_of(record.dtype), dtypes.from_name(record.dtype)
    last = {box: k for k, (_, touched) in enumerate(touches) for box, _ in touched}
    buffers, placed = {}, []
    for k, (piece, touched) in enumerate(touches):
        destinations = []
        for box, region in touched:
            if box not in buffers:
                buffers[box] = aligned_empty(tuple(b - a for a, b in zip(*box)), storage)
            destinations.append((region, box, buffers[box]))
        _read_piece(
            piece,
            destinations,
            storage,
            files.fd(piece.file),
            chunk_bytes,
            f"{where}, {record.path}",
        )
        for box, _ in touched:
            if last[box] == k:
                placed.extend(_place(buffers.pop(box).view(dtype), slices[box]))
    for box in boxes:
        if box not in last:  # a slice of size zero: nothing to read
            placed.extend(_place(np.empty(tuple(b - a for a, b in zip(*box)), dtype), slices[box]))
    return placed


def _restore_array(
    record: ArrayRecord, sharding, files: "_Files", chunk_bytes: int, where: str, pool
) -> jax.Array:
    """One global array laid out by `sharding`, from this process's share of the pieces."""
    slices = _target_slices(record.shape, sharding)
    boxes = list(slices)
    groups = _groups(record, boxes)
    if len(groups) == 1 and all(len(touched) == len(boxes) for _, touched in groups[0][1]):
        # Every piece feeds every slice (one replicated slice, or column blocks of row pieces):
        # all the slices are alive until the last piece anyway, so read the pieces in parallel.
        buffers = _assemble(record, boxes, files, chunk_bytes, where, pool)
        dtype = dtypes.from_name(record.dtype)
        arrays = [
            array for box in boxes for array in _place(buffers.pop(box).view(dtype), slices[box])
        ]
    else:
        fill = lambda group: _fill_and_place(record, group, slices, files, chunk_bytes, where)  # noqa: E731
        arrays = [array for placed in pool.map(fill, groups) for array in placed]
    return jax.make_array_from_single_device_arrays(record.shape, sharding, arrays)


def _describe_target(path: str, leaf) -> tuple[tuple[int, ...], np.dtype, Any]:
    """(shape, dtype, sharding or None for a host numpy result) of one target leaf."""
    if isinstance(leaf, (jax.ShapeDtypeStruct, jax.Array)):
        if getattr(leaf, "sharding", None) is None:
            raise ValueError(
                f"restore target {path} is a ShapeDtypeStruct without a sharding; give it one "
                "(e.g. NamedSharding(mesh, PartitionSpec())) so the loader knows where to put it"
            )
        dtype = leaf.dtype
        if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            raise ValueError(
                f"restore target {path} holds typed PRNG keys ({dtype}); restore their "
                "jax.random.key_data (uint32) and wrap them with jax.random.wrap_key_data"
            )
        return tuple(leaf.shape), np.dtype(dtype), leaf.sharding
    if isinstance(leaf, (np.ndarray, np.generic, bool, int, float, complex)):
        host = np.asarray(leaf)
        return host.shape, host.dtype, None
    raise ValueError(
        f"restore target {path} is a {type(leaf).__name__}; targets are jax.ShapeDtypeStruct "
        "(with a sharding), jax.Array, numpy arrays or Python numbers"
    )


def _match(index: Index, target: Any, where: str):
    """Pair each target leaf with its saved array; CheckpointMismatchError naming what differs."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(target)
    saved = {record.path: record for record in index.arrays}
    wanted = [(jax.tree_util.keystr(key_path), leaf) for key_path, leaf in leaves]
    missing = [path for path, _ in wanted if path not in saved]
    extra = sorted(set(saved) - {path for path, _ in wanted})
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"the target has {_few(missing)}, which the checkpoint lacks")
        if extra:
            parts.append(f"the checkpoint has {_few(extra)}, which the target lacks")
        raise CheckpointMismatchError(
            f"{where} does not match the target's tree: " + "; ".join(parts)
        )
    pairs = []
    for path, leaf in wanted:
        record = saved[path]
        shape, dtype, sharding = _describe_target(path, leaf)
        if shape != record.shape:
            raise CheckpointMismatchError(
                f"{where}: {path} has shape {record.shape} in the checkpoint "
                f"but {shape} in the target"
            )
        if dtype != dtypes.from_name(record.dtype):
            raise CheckpointMismatchError(
                f"{where}: {path} has dtype {record.dtype} in the checkpoint "
                f"but {dtype} in the target"
            )
        pairs.append((record, sharding, leaf))
    return pairs, treedef


def _few(paths: list[str]) -> str:
    shown = ", ".join(paths[:5])
    return shown + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")


def restore(step_dir, index: Index, target: Any, workers: int = 2, files=None) -> Any:
    """The arrays of `index` laid out as `target` asks, in `target`'s tree structure.

    Target leaves: jax.ShapeDtypeStruct with a sharding, or jax.Array (its sharding is used): the
    result is a jax.Array with that sharding. numpy arrays / Python numbers: a numpy array (a Python
    number for a Python number). Shapes and dtypes must equal the saved ones. `workers` groups of
    device slices (or pieces of one group) are read at once: host memory beyond the result is about
    `workers` groups' buffers. `files` reads the step's files (default: the local files in
    `step_dir`; `remote.RemoteFiles` for object storage).
    """
    files = _Files(step_dir, index) if files is None else files
    where = f"step {index.step} in {files.location}"
    pairs, treedef = _match(index, target, where)
    try:
        files.check_all()  # every file present and whole before any array is read
        results = []
        with ThreadPoolExecutor(
            max_workers=max(1, workers), thread_name_prefix="dew-checkpoint-read"
        ) as pool:
            for record, sharding, leaf in pairs:
                if sharding is not None:
                    results.append(
                        _restore_array(record, sharding, files, index.chunk_bytes, where, pool)
                    )
                    continue
                box = ((0,) * len(record.shape), record.shape)
                host = _assemble(record, [box], files, index.chunk_bytes, where, pool)[box]
                host = host.view(dtypes.from_name(record.dtype))
                results.append(
                    host.item() if isinstance(leaf, (bool, int, float, complex)) else host
                )
        return jax.tree_util.tree_unflatten(treedef, results)
    finally:
        files.close()
