"""The errors a checkpoint can raise.

`CheckpointError` is the base. Its three kinds call for different responses:

- `CorruptCheckpointError`: a step folder is damaged or unreadable (missing or truncated file,
  checksum mismatch, an index that does not parse or declares impossible sizes, a file outside its
  folder). `Checkpoints.restore(step=None)` falls back to the previous complete step on this one;
  `restore(step=None, fall_back=False)` (an export or a load, which must not read an older step
  than the user meant) raises its kind `DamagedLatestStepError` instead.
- `CheckpointMismatchError`: the checkpoint is sound but does not fit what the caller asked for (a
  parameter path, shape or dtype differs). Falling back would not help; it is also a `ValueError`.
- `NotACheckpointError`: the directory is not a Dew checkpoint directory at all.
"""


class CheckpointError(Exception):
    """A checkpoint could not be written or read: the base of the errors below, and what
    `Checkpoints.wait` (and the next save or restore) raises when a save in the background
    failed.

    Examples:
        >>> try:
        ...     checkpoints.wait()
        ... except CheckpointError as error:  # a failed save, or any of the kinds below
        ...     print(f"not saved: {error}")
    """


class CorruptCheckpointError(CheckpointError):
    """A step folder is damaged: a file is missing, truncated, fails its checksum or is
    malformed. The message names the step and the file; `Checkpoints.restore(step=None)` falls
    back to the step before on it."""


class DamagedLatestStepError(CorruptCheckpointError):
    """The latest step was asked for (no step named) without falling back, and it is damaged:
    ``step``, that step; ``intact``, the other steps whose index reads and whose every file has
    the size it records (their checksums are checked when one is read), ascending; ``how``, how
    the caller names a step (``"--step N"``), said after the intact steps.

    Examples:
        >>> try:
        ...     model, params = load_checkpoint("runs/a")
        ... except DamagedLatestStepError as error:  # read an intact step, knowingly
        ...     model, params = load_checkpoint("runs/a", step=error.intact[-1])
    """

    def __init__(self, message: str, step: int, intact: list[int], how: str | None = None):
        super().__init__(f"{message} ({how})" if how and intact else message)
        self.message, self.step, self.intact = message, step, intact

    def naming(self, how: str) -> "DamagedLatestStepError":
        """This error saying ``how`` its caller names a step (in place of an inner caller's)."""
        return DamagedLatestStepError(self.message, self.step, self.intact, how)


class CheckpointMismatchError(CheckpointError, ValueError):
    """A sound checkpoint whose tree, shapes or dtypes differ from the restore target (a
    different model, or a LoRA base other than the one recorded); the message names the path
    and both values."""


class NotACheckpointError(CheckpointError):
    """A directory that holds no Dew checkpoint (`Checkpoints.restore` and `metadata` with
    nothing to read); the message says what the directory holds."""
