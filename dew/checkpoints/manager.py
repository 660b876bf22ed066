"""`Checkpoints`: a directory of training checkpoints, saved in the background, restored into any
layout.

    ckpt = Checkpoints("runs/lm", keep=2)  # or Checkpoints("gs://bucket/lm"): any fsspec URL
    ckpt.save(20, state, metadata={"data_position": 320})  # returns once the state is on the host
    ckpt.wait()  # the files are on disk (or it raises)
    state, metadata = ckpt.restore(target)  # target: ShapeDtypeStructs with shardings

The format is specified in docs/checkpoint-format.md.
"""

import atexit
import dataclasses
import json
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from dew.checkpoints import writer
from dew.checkpoints.errors import (
    CheckpointError,
    CorruptCheckpointError,
    DamagedLatestStepError,
    NotACheckpointError,
)
from dew.checkpoints.index import DEFAULT_CHUNK_BYTES
from dew.checkpoints.local import LocalDirectory
from dew.checkpoints.processes import Processes
from dew.checkpoints.remote import RemoteDirectory, url_protocol
from dew.checks import positive_int


class _PendingSave:
    def __init__(self, step: int, directory: Path | str):
        self.step, self.directory = step, directory
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None


# Background saves that failed and nobody has waited for yet: reported on stderr at exit, so an
# error never passes silently even if the program ends without calling wait().
_unreported: set[_PendingSave] = set()


@atexit.register
def _report_unwaited_failures() -> None:
    for pending in list(_unreported):
        print(
            f"dew: saving checkpoint step {pending.step} to {pending.directory} failed and nobody "
            f"called wait(): {type(pending.error).__name__}: {pending.error}",
            file=sys.stderr,
        )


def _check_step(step) -> int:
    if isinstance(step, (bool, np.bool_)) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"step must be a non-negative integer, not {step!r}")
    return int(step)


def _json_default(value):
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} {value!r:.80}")


def _encode_metadata(metadata) -> dict:
    """A JSON round trip of `metadata`: a private copy, and an early ValueError if it cannot be
    saved."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise ValueError(f"metadata must be a dict, not {type(metadata).__name__}")
    try:
        return json.loads(json.dumps(metadata, default=_json_default, allow_nan=False))
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"metadata must be JSON-serialisable (no NaN or infinity): {error}"
        ) from None


def _open(directory, storage_options: dict | None) -> LocalDirectory | RemoteDirectory:
    protocol = url_protocol(directory)
    if protocol is None or (protocol == "file" and directory.startswith("file://")):
        if storage_options:
            raise ValueError(
                f"storage_options are for object storage URLs, not the local directory "
                f"{directory!r}"
            )
        path = directory[len("file://") :] if protocol else directory
        return LocalDirectory(path)
    return RemoteDirectory(directory, storage_options)


class Checkpoints:
    """A directory of checkpoints of one run: `step_NNNNNNNN/` folders, the newest `keep` kept.

    Args:
      directory: where the step folders live: a local path (created at the first save, stored
        absolute; `file://` URLs too), or any other fsspec URL (`gs://bucket/run`, `s3://...`,
        `memory://...`), written through fsspec with the same format. A URL whose filesystem is
        not installed raises ImportError naming what to install (`pip install -e '.[gcs]'` for
        `gs://`); an unknown protocol raises ValueError.
      keep: how many complete steps to keep (the newest, and always the one just written;
        default 2); None keeps every step.
      chunk_bytes: size of the chunks each piece's CRC-32s cover (a reader reads whole chunks;
        default 4 MiB, a multiple of 16).
      read_workers: threads that read and verify pieces at once (default 2); host memory while
        restoring is about this many device slices (or pieces) beyond the restored arrays.
      barrier_timeout_s: how long a multi-process save waits for the other processes (default
        600). A process whose part of a save fails makes the others raise at once, without this
        wait.
      storage_options: keyword arguments of the fsspec filesystem of a URL (credentials,
        project, ...); fsspec's own configuration applies too.

    Raises:
      ValueError: `keep` below 1, `chunk_bytes` not a positive multiple of 16, or an unknown URL
        protocol.
      ImportError: the filesystem of a URL is not installed (the message says what to install).

    Examples:
        >>> from dew import Checkpoints
        >>> trainer = dew.Trainer(objective, optax.adamw(1e-3), key=jax.random.key(0),
        ...                       checkpoints=Checkpoints("runs/a/checkpoints", keep=3))
        >>> state = trainer.fit(data, steps=100, checkpoint_every=25)  # a rerun resumes
        >>> trainer.checkpoints.steps
        [50, 75, 100]
    """

    def __init__(
        self,
        directory,
        keep: int | None = 2,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        read_workers: int = 2,
        barrier_timeout_s: float = 600.0,
        storage_options: dict | None = None,
    ):
        if keep is not None:
            positive_int("keep (or None)", keep)
        if (
            isinstance(chunk_bytes, bool)
            or not isinstance(chunk_bytes, int)
            or chunk_bytes < 16
            or chunk_bytes % 16
        ):
            raise ValueError(f"chunk_bytes must be a positive multiple of 16, not {chunk_bytes!r}")
        self._location = _open(directory, storage_options)
        self._directory = self._location.directory
        self._keep = keep
        self._chunk_bytes = chunk_bytes
        self._read_workers = read_workers
        self._barrier_timeout_s = barrier_timeout_s
        self._pending: _PendingSave | None = None
        self._saves = 0  # numbers meeting names, alike on every process
        self._restores = 0
        self.restored_step: int | None = None  # the step the last restore() read

    def __repr__(self) -> str:
        return f"Checkpoints({str(self._directory)!r}, keep={self._keep})"

    @property
    def directory(self) -> Path | str:
        """The checkpoint directory: its absolute path, or the URL it was given (without a
        trailing slash)."""
        return self._directory

    @property
    def keep(self) -> int | None:
        """How many complete steps are kept (None: every one)."""
        return self._keep

    @property
    def steps(self) -> list[int]:
        """Every complete (committed) step, ascending. A save still in the background is not listed
        until it commits; call wait() first to include it."""
        return self._location.complete_steps()

    @property
    def latest(self) -> int | None:
        """The newest complete step, or None."""
        steps = self.steps
        return steps[-1] if steps else None

    def step_path(self, step: int) -> Path | str:
        """The folder of step `step` (whether or not it exists): a path, or a URL."""
        return self._location.step_path(_check_step(step))

    def save(self, step: int, tree: Any, *, metadata: dict | None = None) -> None:
        """Save `tree` as step `step`: copy it to host memory now, write the files in the
        background.

        Waits for the previous save first (and raises its error, if it failed). `tree` is any
        pytree whose leaves are jax.Arrays (any sharding, possibly over several processes), numpy
        arrays or Python numbers; once this returns it may be donated or changed. `metadata` is a
        JSON-serialisable dict stored in the step's index. Every process of a multi-process run
        calls save with the same step and tree structure. Saving a step that exists replaces it.

        Raises:
          CheckpointError: the previous save in the background failed.
          ValueError: `step` is not an integer from 0, or `metadata` is not JSON-serialisable.
        """
        self.wait()
        step = _check_step(step)
        metadata = _encode_metadata(metadata)
        processes = Processes.current(self._barrier_timeout_s)
        shot = writer.snapshot(tree, processes.index)
        self._saves += 1
        prefix = writer.barrier_prefix(self._location.name, self._saves, step)
        pending = _PendingSave(step, self._directory)

        def run():
            try:
                self._location.write_step(
                    step,
                    shot,
                    metadata,
                    processes,
                    self._keep,
                    self._chunk_bytes,
                    prefix,
                )
            except BaseException as error:  # raised by the next save, wait, restore or metadata
                pending.error = error
                _unreported.add(pending)

        pending.thread = threading.Thread(target=run, name=f"dew-checkpoint-save-{step}")
        self._pending = pending
        pending.thread.start()

    def wait(self) -> None:
        """Wait for the save in the background, if any; raise CheckpointError if it failed."""
        pending = self._pending
        if pending is None:
            return
        pending.thread.join()
        self._pending = None
        if pending.error is not None:
            _unreported.discard(pending)
            error = pending.error
            raise CheckpointError(
                f"saving step {pending.step} to {self._directory} failed: "
                f"{type(error).__name__}: {error}"
            ) from error

    def metadata(self, step: int | None = None) -> dict:
        """The metadata saved with `step` (default: the latest complete step), without reading
        arrays.

        Waits for the save in the background first, and raises its error if it failed.
        """
        self.wait()
        if step is None:
            step = self.latest
            if step is None:
                raise NotACheckpointError(self._why_empty())
        step = self._complete(step)
        return self._location.read_index(step).metadata

    def restore(
        self, target: Any, step: int | None = None, *, under: str = "", fall_back: bool = True
    ) -> tuple[Any, dict]:
        """Read step `step` laid out as `target` asks; returns (tree, metadata).

        `under`: read only the saved arrays whose path starts with this prefix (as
        `jax.tree_util.keystr` spells it: `".params"` for the weights of a saved `TrainState`),
        into a `target` whose paths are the rest of theirs.

        `target` has the saved tree's structure; its leaves are jax.ShapeDtypeStruct with a
        `sharding` (any mesh, layout and process count) or jax.Arrays (their sharding is used), or
        numpy arrays / Python numbers for leaves wanted on the host. The arrays equal the saved ones
        bit for bit. With `step=None`, the latest complete step is read; if it is damaged, a warning
        names what is wrong and the previous complete step is tried, and so on: right for resuming
        a run, which repeats the steps lost. With `fall_back=False` (an export or a load, where an
        older step would be the wrong model) a damaged latest step raises
        DamagedLatestStepError instead, naming it, what is wrong, and the intact steps.

        `restored_step` records the step read.

        Raises:
          CorruptCheckpointError: damage, naming the step and file (with `step=None`: every
            step is damaged; `DamagedLatestStepError` without `fall_back`).
          CheckpointMismatchError: the tree, a shape or a dtype differs from `target`, naming
            the path and both values.
          NotACheckpointError: nothing to restore.
          CheckpointError: the save in the background, which restore waits for first, failed.

        Examples:
            >>> like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
            ...                     sharding=NamedSharding(mesh, P())), params)
            >>> restored, metadata = Checkpoints("runs/a/checkpoints").restore(
            ...     like, under=".params")  # the weights of a saved TrainState, whole everywhere
        """
        self.wait()
        if step is not None:
            step = self._complete(step)
            tree, metadata = self._restore_agreed(step, target, under)
            self.restored_step = step
            return tree, metadata
        # Locally, every step folder, complete or not: a committed folder never lacks its index,
        # so one that does is damaged, and skipping it deserves a warning too. (On object
        # storage, an index-less folder is an unfinished save: only complete steps are listed.)
        steps = self._location.step_folders()
        if not steps:
            raise NotACheckpointError(self._why_empty())
        if not fall_back:
            return self._restore_latest(steps[-1], target, under)
        problems = []
        for position in range(len(steps) - 1, -1, -1):
            candidate = steps[position]
            try:
                tree, metadata = self._restore_agreed(candidate, target, under)
            except CorruptCheckpointError as error:
                problems.append(str(error))
                then = (
                    f"trying step {steps[position - 1]}" if position else "no earlier step is left"
                )
                warnings.warn(
                    f"checkpoint step {candidate} in {self._directory} is damaged, {then}: {error}",
                    stacklevel=2,
                )
                continue
            self.restored_step = candidate
            return tree, metadata
        raise CorruptCheckpointError(
            f"every checkpoint in {self._directory} is damaged: " + "; ".join(problems)
        )

    def _restore_latest(self, step: int, target: Any, under: str) -> tuple[Any, dict]:
        """Step ``step``, the latest, or ``DamagedLatestStepError`` naming it and the intact
        steps."""
        try:
            tree, metadata = self._restore_agreed(step, target, under)
        except CorruptCheckpointError as error:
            intact = self._intact_steps(step)
            listed = ", ".join(str(s) for s in intact)
            others = (
                f"the intact steps (every file whole) are {listed}: name one to read it"
                if intact
                else "no other step is intact"
            )
            raise DamagedLatestStepError(
                f"checkpoint step {step} in {self._directory}, the latest, is damaged, and an "
                f"older step is not read in its place: {error}; {others}",
                step,
                intact,
            ) from None
        self.restored_step = step
        return tree, metadata

    def _intact_steps(self, damaged: int) -> list[int]:
        """The steps other than ``damaged`` whose index reads and whose every file has the size
        the index records (no data is read: a checksum is checked when its chunk is)."""
        intact = []
        for step in self._location.step_folders():
            if step == damaged:
                continue
            try:
                self._location.check_files(step, self._location.read_index(step))
            except CorruptCheckpointError:
                continue
            intact.append(step)
        return intact

    def _restore_agreed(self, step: int, target: Any, under: str = "") -> tuple[Any, dict]:
        """Restore one step; with several processes, all agree on whether it was damaged (each
        reads different pieces), so that they all fall back together or none does."""
        processes = Processes.current(self._barrier_timeout_s)
        self._restores += 1
        problem, result = None, None
        try:
            index = self._location.read_index(step)
            if under:
                arrays = tuple(
                    dataclasses.replace(record, path=record.path[len(under) :])
                    for record in index.arrays
                    if record.path.startswith(under)
                )
                index = dataclasses.replace(index, arrays=arrays)
            result = self._location.restore(step, index, target, self._read_workers), index.metadata
        except CorruptCheckpointError as error:
            if processes.count == 1:
                raise
            problem = str(error)
        failures = processes.failures(
            f"dew-checkpoint-restore/{self._restores}/step-{step}", problem
        )
        if failures:
            raise CorruptCheckpointError("; ".join(f"process {p}: {what}" for p, what in failures))
        return result

    def _complete(self, step) -> int:
        """`step`, if it has a step folder (a damaged one fails when read, naming what is wrong)."""
        step = _check_step(step)
        if step not in self._location.step_folders():
            if not self.steps:
                raise NotACheckpointError(self._why_empty())
            raise CheckpointError(
                f"{self._directory} has no complete step {step} (its steps: {self.steps})"
            )
        return step

    def _why_empty(self) -> str:
        return self._location.why_empty()
