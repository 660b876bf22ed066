"""The errors a checkpoint can raise.

`CheckpointError` is the base. Its three kinds call for different responses:

- `CorruptCheckpointError`: a step folder is damaged or unreadable (missing or truncated file,
  checksum mismatch, an index that does not parse or declares impossible sizes, a file outside its
  folder). `Checkpoints.restore(step=None)` falls back to the previous complete step on this one.
- `CheckpointMismatchError`: the checkpoint is sound but does not fit what the caller asked for (a
  parameter path, shape or dtype differs). Falling back would not help; it is also a `ValueError`.
- `NotACheckpointError`: the directory is not a Dew checkpoint directory at all.
"""


class CheckpointError(Exception):
    """A checkpoint could not be written or read."""


class CorruptCheckpointError(CheckpointError):
    """A step folder is damaged: a file is missing, truncated, fails its checksum or is
    malformed."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """A sound checkpoint whose tree, shapes or dtypes differ from the restore target."""


class NotACheckpointError(CheckpointError):
    """A directory that holds no Dew checkpoint."""
