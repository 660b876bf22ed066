"""Saving one step: a blocking copy of this process's pieces to host memory, then the files and
the commit.

`snapshot(tree)` runs in the caller's thread: it starts the device-to-host copy of every shard this
process owns (the addressable shard with `replica_id == 0`, so each distinct piece is copied and
written once however many devices hold it), then waits for them. After it returns, the tree may be
donated or overwritten; the snapshot owns its bytes.

`write_step(...)` runs in a background thread, through `write_together`, the order of a save on any
kind of directory: process 0 prepares the step's folder; every process writes its own
`process_NNNNN.npz` into it (with several processes, each other one also writes a small manifest of
its pieces); process 0 reads the manifests, writes `index.json` last and commits the step (here: one
rename of the temporary folder into place), then applies retention. Each stage ends at a meeting of
all processes (`Processes.meet`, through the JAX distributed runtime's coordination service, not a
device collective, so safe from a background thread while the main thread runs training steps): a
stage that fails on one process makes every process raise at that meeting at once, so no index is
written. Object storage, which has no rename, supplies its own stages (`remote.RemoteDirectory`).
The pieces both share (the members of a file, its manifest, the index) are built here.
"""

import dataclasses
import datetime
import json
import os
import zlib
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from dew.checkpoints import dtypes, folders, npz
from dew.checkpoints.errors import CheckpointError
from dew.checkpoints.index import (
    INDEX_NAME,
    ArrayRecord,
    Index,
    Piece,
    parse,
    process_file_name,
    step_folder_name,
)
from dew.checkpoints.memory import copy_of
from dew.checkpoints.processes import Processes

# Test hook: called with each member's name after its data is written (lets a test kill a save
# deterministically in the middle of writing a file).
after_member_hook: Callable[[str], None] | None = None


@dataclasses.dataclass(frozen=True)
class HostPiece:
    array: int  # position of the leaf among the tree's leaves
    start: tuple[int, ...]
    stop: tuple[int, ...]
    data: np.ndarray  # the bits, in the dtype's storage dtype, C-contiguous, owned by the snapshot


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """The host copy of the pieces of a tree that this process writes."""

    paths: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    treedef: str
    pieces: tuple[HostPiece, ...]

    @property
    def nbytes(self) -> int:
        return sum(piece.data.nbytes for piece in self.pieces)


def _slice_bounds(index: tuple, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    start, stop = [], []
    for item, size in zip(index, shape):
        a, b, step = item.indices(size)
        if step != 1:
            raise CheckpointError(f"a shard with a strided index {index} cannot be saved")
        start.append(a)
        stop.append(max(a, b))
    return tuple(start), tuple(stop)


def _aliases_device_memory(device_array: jax.Array, host: np.ndarray) -> bool:
    """Whether `host` is a view of the device buffer (the CPU backend's np.asarray is zero-copy)."""
    try:
        return device_array.unsafe_buffer_pointer() == host.__array_interface__["data"][0]
    except Exception:  # a backend without raw pointers: assume a view, copy to be safe
        return True


def snapshot(tree: Any, process_index: int) -> Snapshot:
    """Copy this process's pieces of `tree` to host memory (blocks until the copies are done).

    Leaves may be jax.Arrays (any sharding, possibly spread over processes), numpy arrays or
    Python scalars; numpy and Python leaves are written by process 0 only. Raises ValueError for a
    leaf that cannot be saved (typed PRNG keys: save `jax.random.key_data(key)`; object dtypes).
    """
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    paths, shapes, names, device_pieces, host_pieces = [], [], [], [], []
    for number, (key_path, leaf) in enumerate(leaves):
        path = jax.tree_util.keystr(key_path)
        if isinstance(leaf, jax.Array):
            if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                raise ValueError(
                    f"cannot save {path}: it holds typed PRNG keys ({leaf.dtype}); "
                    "save jax.random.key_data(key) and rebuild the key with "
                    "jax.random.wrap_key_data"
                )
            if leaf.is_deleted():
                raise ValueError(
                    f"cannot save {path}: its buffers were deleted (donated to a step?)"
                )
            shape = tuple(leaf.shape)
            owned = [shard for shard in leaf.addressable_shards if shard.replica_id == 0]
            for shard in owned:
                shard.data.copy_to_host_async()  # start every transfer before waiting for any
            device_pieces.extend((number, shard) for shard in owned)
        elif isinstance(leaf, (np.ndarray, np.generic, bool, int, float, complex)):
            host = np.asarray(leaf)
            shape = host.shape
            if process_index == 0:
                host_pieces.append(
                    HostPiece(number, (0,) * host.ndim, shape, _owned_storage(host, path))
                )
        else:
            raise ValueError(
                f"cannot save {path}: a {type(leaf).__name__} is not an array "
                "(leaves must be jax.Array, numpy arrays or Python numbers)"
            )
        try:
            names.append(
                dtypes.name_of(leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype)
            )
        except ValueError as error:
            raise ValueError(f"cannot save {path}: {error}") from None
        paths.append(path)
        shapes.append(shape)

    pieces = list(host_pieces)
    for number, shard in device_pieces:
        host = np.asarray(shard.data)
        if _aliases_device_memory(shard.data, host):
            host = copy_of(host)  # the training step may donate that buffer while we write
        start, stop = _slice_bounds(shard.index, shapes[number])
        pieces.append(HostPiece(number, start, stop, dtypes.to_storage(host)))
    pieces.sort(key=lambda piece: (piece.array, piece.start))
    return Snapshot(tuple(paths), tuple(shapes), tuple(names), str(treedef), tuple(pieces))


def _owned_storage(host: np.ndarray, path: str) -> np.ndarray:
    try:
        return dtypes.to_storage(
            np.array(host, order="C", copy=True)
        )  # the caller may mutate it later
    except ValueError as error:
        raise ValueError(f"cannot save {path}: {error}") from None


def manifest_name(process_index: int) -> str:
    """The manifest a process other than 0 writes next to its file, for process 0 to index."""
    return f"manifest_{process_index:05d}.json"


def write_together(
    processes: Processes,
    barrier_prefix: str,
    step: int,
    *,
    prepare: Callable[[], None],
    write_own: Callable[[], None],
    commit: Callable[[], None],
    retain: Callable[[], None],
    discard: Callable[[], None],
) -> None:
    """One save of step `step` by every process, on any kind of directory.

    Process 0 `prepare()`s the step's folder; every process `write_own()`s its file (and, but
    process 0, its manifest); process 0 `commit()`s (the index, written last, makes the step
    complete) and then `retain()`s. Each stage ends at a meeting (`Processes.meet`): when a stage
    fails on any process, every process raises CheckpointError at that meeting at once, naming the
    process and its error, and no later stage runs anywhere, so a step some process failed to
    write is never committed. With one process, a failure before the commit `discard()`s what the
    save wrote (with several, the next save removes it: the others may still be writing).
    """
    first = processes.index == 0

    def discard_alone():
        if processes.count == 1:
            try:
                discard()
            except Exception:
                pass  # the next save removes it

    try:
        processes.meet(
            f"{barrier_prefix}/ready",
            f"preparing the folder of step {step}",
            prepare if first else None,
            first_only=True,
        )
        processes.meet(f"{barrier_prefix}/written", f"writing its file of step {step}", write_own)
    except BaseException:
        discard_alone()
        raise

    def commit_and_retain():
        try:
            commit()
        except BaseException:
            discard_alone()
            raise
        retain()  # the step is complete: a failure here must not discard it

    processes.meet(
        f"{barrier_prefix}/committed",
        f"committing step {step}",
        commit_and_retain if first else None,
        first_only=True,
    )


def write_step(
    directory: Path,
    step: int,
    shot: Snapshot,
    metadata: dict,
    processes: Processes,
    keep: int | None,
    chunk_bytes: int,
    barrier_prefix: str,
) -> None:
    """Write `shot` as step `step` of the local `directory`: the files go into `step_N.tmp/`,
    which process 0 renames to `step_N/` once its index is written (folders.py)."""
    final = directory / step_folder_name(step)
    temp = final.with_name(final.name + folders.TEMP_SUFFIX)
    own: list[dict] = []  # this process's manifest, once its file is written

    def prepare():
        directory.mkdir(parents=True, exist_ok=True)
        folders.clean_leftovers(directory)
        temp.mkdir()

    def write_own():
        file_name = process_file_name(processes.index)
        written, size = npz.write(
            temp / file_name, members(shot), chunk_bytes, after_member=after_member_hook
        )
        own.append(manifest(shot, file_name, written, size))
        if processes.index != 0:
            folders.write_durably(
                temp / manifest_name(processes.index), json.dumps(own[0]).encode()
            )

    def commit():
        manifests = own + [
            json.loads((temp / manifest_name(p)).read_bytes()) for p in range(1, processes.count)
        ]
        text = index_text(
            f"{temp / INDEX_NAME}", step, shot, metadata, manifests, processes.count, chunk_bytes
        )
        folders.write_durably(temp / INDEX_NAME, text)
        for p in range(1, processes.count):
            os.unlink(temp / manifest_name(p))
        folders.commit(temp, final)

    write_together(
        processes,
        barrier_prefix,
        step,
        prepare=prepare,
        write_own=write_own,
        commit=commit,
        retain=lambda: folders.retain(directory, keep, step),
        discard=lambda: folders.remove(temp),
    )


def members(shot: Snapshot) -> list[tuple[str, np.ndarray]]:
    """(member name, data) of each piece of this process's file."""
    per_array: dict[int, int] = {}
    members = []
    for piece in shot.pieces:
        k = per_array[piece.array] = per_array.get(piece.array, -1) + 1
        members.append((f"a{piece.array:06d}.p{k:05d}.npy", piece.data))
    return members


def manifest(shot: Snapshot, file_name: str, written: list, size: int) -> dict:
    """What process 0 needs to index this process's file: its name, size and piece records."""
    return {
        "file": file_name,
        "bytes": size,
        "pieces": [
            [
                piece.array,
                Piece(
                    file_name,
                    member.name,
                    piece.start,
                    piece.stop,
                    member.offset,
                    member.nbytes,
                    member.chunk_crcs,
                ).to_json(),
            ]
            for piece, member in zip(shot.pieces, written)
        ],
    }


def index_text(where, step, shot, metadata, manifests, process_count, chunk_bytes) -> bytes:
    """The index of a step from every process's manifest, checked as a reader checks it."""
    pieces: dict[int, list[Piece]] = {number: [] for number in range(len(shot.paths))}
    for manifest in manifests:
        for number, raw in manifest["pieces"]:
            pieces[number].append(
                Piece(
                    raw["file"],
                    raw["member"],
                    tuple(a for a, _ in raw["slice"]),
                    tuple(b for _, b in raw["slice"]),
                    raw["offset"],
                    raw["nbytes"],
                    tuple(raw["crc32"]),
                )
            )
    arrays = tuple(
        ArrayRecord(
            path, shape, dtype, tuple(sorted(pieces[number], key=lambda p: (p.start, p.file)))
        )
        for number, (path, shape, dtype) in enumerate(zip(shot.paths, shot.shapes, shot.dtypes))
    )
    index = Index(
        step=step,
        metadata=metadata,
        treedef=shot.treedef,
        chunk_bytes=chunk_bytes,
        files={manifest["file"]: manifest["bytes"] for manifest in manifests},
        arrays=arrays,
        writer={
            "jax": jax.__version__,
            "process_count": process_count,
            "time": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        },
    )
    text = index.to_json().encode()
    # Read our own index back with the untrusting parser: a bug that would write an index the
    # loader refuses (a missing piece, an overlap) fails this save instead of a later restore.
    parse(text, f"step {step}: the index being written to {where}", step)
    return text


def barrier_prefix(directory: Path, save_number: int, step: int) -> str:
    """The prefix of a save's meeting names, which every process computes alike for the same save
    of the same directory."""
    return f"dew-checkpoint/{zlib.crc32(str(directory).encode()):08x}/{save_number}/step-{step}"
