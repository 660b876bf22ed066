"""Checkpoint directories on object storage: any fsspec URL (`gs://bucket/run`, `s3://...`,
`memory://...`), in the same format as on a local disk.

    gs://bucket/run/
      step_00000010/index.json            uploaded last: the step is complete once it exists
      step_00000010/process_00000.npz     one object per process, uploaded straight into place
      step_00000020/process_00000.npz     no index: a save that never finished (skipped, and
                                          removed by the next save)

Object stores have no rename, so nothing is written aside and moved into place: every process
uploads its file into `step_N/`, and process 0 uploads `index.json` once all of them are in (and
none failed). An object appears only when its upload completes, so a writer killed or failing at
any point leaves either the complete step or a folder without an index. Readers list only folders
that hold an index; the next save removes index-less ones. Deleting a step (retention, or a step
saved again) removes its index first, so a step is never seen half deleted.

The loader reads byte ranges (`cat_file(path, start, end)`), never whole files: each process reads
only the parts of the pieces its devices need, widened to whole checksum chunks.

fsspec and the filesystem package (gcsfs for `gs://`: `pip install -e '.[gcs]'`) are imported
only when a URL is opened, so local checkpoints need neither.
"""

import contextlib
import json
import re
from typing import Any

from dew.checkpoints import npz, reader, writer
from dew.checkpoints.errors import CheckpointError, CorruptCheckpointError
from dew.checkpoints.index import (
    INDEX_NAME,
    STEP_FOLDER,
    Index,
    parse,
    process_file_name,
    step_folder_name,
)

# A protocol followed by "://" (or "::", fsspec's chaining, as in "simplecache::gs://...").
_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*)(://|::)")
# Protocols whose filesystem package one of Dew's extras installs.
_EXTRAS = {"gs": "gcs", "gcs": "gcs"}


def url_protocol(directory: Any) -> str | None:
    """The protocol of `directory` if it is a URL string (`"gs"` for `"gs://bucket/run"`), else
    None (a local path: a str without a protocol, or an os.PathLike)."""
    if not isinstance(directory, str):
        return None
    match = _URL.match(directory)
    return match.group(1).lower() if match else None


def _install_hint(protocol: str, missing: str) -> str:
    extra = _EXTRAS.get(protocol)
    if extra is not None:
        return f"pip install -e '.[{extra}]'"
    return f"pip install fsspec and the fsspec filesystem for {protocol}:// ({missing})"


def open_filesystem(url: str, storage_options: dict) -> tuple[Any, str]:
    """(fsspec filesystem, path within it) for `url`.

    Raises ImportError naming what to install when fsspec or the protocol's filesystem package is
    missing, and ValueError for a protocol fsspec does not know: a URL never falls back to a local
    folder.
    """
    protocol = url_protocol(url)
    try:
        import fsspec
        import fsspec.core
    except ImportError:
        raise ImportError(
            f"Checkpoints({url!r}) needs fsspec, which is not installed: "
            + _install_hint(protocol, "fsspec")
        ) from None
    try:
        fsspec.get_filesystem_class(protocol)
    except ValueError:
        raise ValueError(
            f"Checkpoints({url!r}): fsspec knows no filesystem for {protocol}:// "
            "(a local directory is a path without a protocol)"
        ) from None
    except ImportError as error:
        raise ImportError(
            f"Checkpoints({url!r}) needs the filesystem for {protocol}://, which is not "
            f"installed ({error}): " + _install_hint(protocol, str(error))
        ) from None
    try:
        fs, path = fsspec.core.url_to_fs(url, **storage_options)
    except ImportError as error:  # a chained URL whose inner filesystem is missing
        raise ImportError(
            f"Checkpoints({url!r}) needs a filesystem that is not installed ({error})"
        ) from None
    path = path.rstrip("/")
    if not path.strip("/"):
        raise ValueError(f"Checkpoints({url!r}) names no bucket or folder")
    return fs, path


@contextlib.contextmanager
def _upload(fs, path: str):
    """A binary file object whose content becomes the object `path` when the block ends, and
    never if the block raises."""
    file = fs.open(path, "wb")
    try:
        yield file
    except BaseException:
        # An fsspec buffered file uploads what it holds when closed, even from its finalizer:
        # cancel the upload and mark it closed instead.
        with contextlib.suppress(Exception):
            discard = getattr(file, "discard", None)
            if discard is not None:
                discard()
            file.closed = True
        raise
    file.close()


class RemoteFile:
    """One process file of a step, read by byte ranges (the reader's stand-in for a descriptor)."""

    def __init__(self, fs, path: str):
        self.fs, self.path = fs, path

    def read_into(self, buffers: list[memoryview], offset: int, where: str) -> None:
        """Fill `buffers` (unsigned bytes) with consecutive bytes of the file from `offset`, in
        one ranged read."""
        total = sum(len(buffer) for buffer in buffers)
        if not total:
            return
        try:
            data = self.fs.cat_file(self.path, start=offset, end=offset + total)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{where}: the file is gone") from None
        except Exception as error:  # a network failure is not damage: no fallback to older steps
            raise CheckpointError(f"{where}: read failed ({error})") from error
        if len(data) < total:
            raise CorruptCheckpointError(
                f"{where}: file ends at byte {offset + len(data)}, before the piece does"
            )
        data, position = memoryview(data), 0
        for buffer in buffers:
            buffer[:] = data[position : position + len(buffer)]
            position += len(buffer)


class RemoteFiles:
    """A step's process files on object storage, each checked once (present, with exactly the size
    the index records) before anything is read; see `reader._Files`."""

    def __init__(self, directory: "RemoteDirectory", index: Index):
        self.directory, self.index, self.handles = directory, index, {}
        self.location = directory.url

    def check_all(self) -> None:
        step = self.index.step
        sizes = self.directory.sizes(step)  # one listing for all the files
        for name, expected in self.index.files.items():
            where = f"step {step}: {self.directory.url_of(step, name)}"
            size = sizes.get(name)
            if size is None:
                raise CorruptCheckpointError(f"{where} is missing")
            if size != expected:
                what = (
                    f"is truncated: {size} bytes, the index records {expected}"
                    if size < expected
                    else f"has {size} bytes, the index records {expected}"
                )
                raise CorruptCheckpointError(f"{where} {what}")
            self.handles[name] = RemoteFile(self.directory.fs, self.directory.path_of(step, name))

    def fd(self, name: str) -> RemoteFile:
        if not self.handles:
            self.check_all()
        return self.handles[name]

    def close(self) -> None:
        self.handles.clear()


class RemoteDirectory:
    """A checkpoint directory at an fsspec URL: listing, the commit protocol without renames,
    retention, and the reads of the loader."""

    def __init__(self, url: str, storage_options: dict | None = None):
        self.fs, self.root = open_filesystem(url, dict(storage_options or {}))
        self.url = url.rstrip("/")

    @property
    def name(self) -> str:
        return self.url

    @property
    def directory(self) -> str:
        return self.url

    def path_of(self, step: int, name: str | None = None) -> str:
        """The filesystem path of step `step`'s folder, or of the object `name` in it."""
        folder = f"{self.root}/{step_folder_name(step)}"
        return folder if name is None else f"{folder}/{name}"

    def url_of(self, step: int, name: str | None = None) -> str:
        folder = f"{self.url}/{step_folder_name(step)}"
        return folder if name is None else f"{folder}/{name}"

    def step_path(self, step: int) -> str:
        return self.url_of(step)

    # --- listing ----------------------------------------------------------------------------

    def _objects(self, base: str) -> dict[str, int]:
        """Every object under `base`: its path relative to `base` and its size. One listing,
        never served from the filesystem's listing cache (another process may have written)."""
        self.fs.invalidate_cache(base)
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return {}
        prefix = base + "/"
        return {
            path[len(prefix) :]: int(info.get("size") or 0)
            for path, info in found.items()
            if info.get("type") == "file" and path.startswith(prefix)
        }

    def _layout(self) -> dict[int, set[str]]:
        """Each step that has objects under `step_N/`, with their names."""
        steps: dict[int, set[str]] = {}
        for relative in self._objects(self.root):
            folder, _, name = relative.partition("/")
            match = STEP_FOLDER.fullmatch(folder)
            if match and name:
                steps.setdefault(int(match.group(1)), set()).add(name)
        return steps

    def complete_steps(self) -> list[int]:
        return sorted(step for step, names in self._layout().items() if INDEX_NAME in names)

    def step_folders(self) -> list[int]:
        """The steps a restore tries: here only complete ones. Without renames, a folder without
        an index is the normal trace of a save that never finished, not damage."""
        return self.complete_steps()

    def sizes(self, step: int) -> dict[str, int]:
        """Name and size of each object directly in step `step`'s folder."""
        return {
            name: size
            for name, size in self._objects(self.path_of(step)).items()
            if "/" not in name
        }

    # --- writing ----------------------------------------------------------------------------

    def clear_for_save(self, step: int) -> None:
        """Before process 0 starts saving `step`: remove what unfinished saves left (folders
        without an index) and the folder of `step` itself if it exists (saved again)."""
        for other, names in sorted(self._layout().items()):
            if other == step or INDEX_NAME not in names:
                self.remove_step(other, complete=INDEX_NAME in names)

    def remove_step(self, step: int, complete: bool = True) -> None:
        """Delete step `step`'s objects, its index first so that it stops being complete before
        any of its files goes."""
        if complete:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(self.path_of(step, INDEX_NAME))
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.path_of(step), recursive=True)
        self.fs.invalidate_cache(self.root)

    def retain(self, keep: int | None, just_written: int) -> list[int]:
        """Delete all but the newest `keep` complete steps, never `just_written`; returns the
        deleted steps. Their indexes go first, then their files."""
        if keep is None:
            return []
        others = [step for step in self.complete_steps() if step != just_written]
        doomed = others[: max(0, len(others) - (keep - 1))]
        if doomed:
            self.fs.rm([self.path_of(step, INDEX_NAME) for step in doomed])
            self.fs.rm([self.path_of(step) for step in doomed], recursive=True)
            self.fs.invalidate_cache(self.root)
        return doomed

    def upload(self, step: int, name: str):
        """A context manager: a file object that becomes `step_N/name` when the block ends."""
        return _upload(self.fs, self.path_of(step, name))

    def put(self, step: int, name: str, data: bytes) -> None:
        self.fs.pipe_file(self.path_of(step, name), data)

    def get(self, step: int, name: str) -> bytes:
        return self.fs.cat_file(self.path_of(step, name))

    def delete(self, step: int, names: list[str]) -> None:
        if names:
            self.fs.rm([self.path_of(step, name) for name in names])

    def write_step(self, step, shot, metadata, processes, keep, chunk_bytes, prefix) -> None:
        """Write `shot` (writer.Snapshot) as step `step`, without renames: every process uploads
        its file straight into `step_N/`, and process 0 uploads `index.json` last, once all the
        files are in and no process has failed (writer.write_together). The index's existence is
        what makes the step complete, so a writer killed or failing at any point leaves an
        index-less folder that readers skip and the next save removes."""
        own: list[dict] = []  # this process's manifest, once its file is uploaded
        others = [writer.manifest_name(p) for p in range(1, processes.count)]

        def write_own():
            file_name = process_file_name(processes.index)
            with self.upload(step, file_name) as file:
                written, size = npz.write_stream(
                    file, writer.members(shot), chunk_bytes, after_member=writer.after_member_hook
                )
            own.append(writer.manifest(shot, file_name, written, size))
            if processes.index != 0:
                self.put(step, writer.manifest_name(processes.index), json.dumps(own[0]).encode())

        def commit():
            manifests = own + [json.loads(self.get(step, name)) for name in others]
            text = writer.index_text(
                self.url_of(step, INDEX_NAME),
                step,
                shot,
                metadata,
                manifests,
                processes.count,
                chunk_bytes,
            )
            self.delete(step, others)  # before the commit: a complete step holds no manifest
            self.put(step, INDEX_NAME, text)  # the commit

        writer.write_together(
            processes,
            prefix,
            step,
            prepare=lambda: self.clear_for_save(step),
            write_own=write_own,
            commit=commit,
            retain=lambda: self.retain(keep, step),
            discard=lambda: self.remove_step(step),
        )

    # --- reading ----------------------------------------------------------------------------

    def read_index(self, step: int) -> Index:
        """Read and validate step `step`'s index; CorruptCheckpointError naming the step and
        object."""
        where = f"step {step}: {self.url_of(step, INDEX_NAME)}"
        try:
            text = self.fs.cat_file(self.path_of(step, INDEX_NAME))
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{where} is missing") from None
        except Exception as error:
            raise CheckpointError(f"{where} cannot be read ({error})") from error
        return parse(text, where, step)

    def restore(self, step: int, index: Index, target: Any, workers: int) -> Any:
        return reader.restore(
            self.step_path(step), index, target, workers, files=RemoteFiles(self, index)
        )

    def check_files(self, step: int, index: Index) -> None:
        """CorruptCheckpointError unless each of the step's files is there with its size."""
        RemoteFiles(self, index).check_all()

    def why_empty(self) -> str:
        names = sorted({relative.partition("/")[0] for relative in self._objects(self.root)})
        if not names:
            return f"no checkpoint in {self.url}: nothing is stored under it"
        if INDEX_NAME in names:
            return (
                f"{self.url} holds an {INDEX_NAME}: it is one step's folder, not a checkpoint "
                "directory; pass its parent"
            )
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        return (
            f"{self.url} is not a Dew checkpoint directory: it holds no step_NNNNNNNN folder "
            f"with an {INDEX_NAME} (it holds: {shown})"
        )
