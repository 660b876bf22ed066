"""Dew's checkpoints: a sharded .npz format of its own, a background writer, a resharding loader.

    from dew.checkpoints import Checkpoints, CheckpointError

A directory is a local path or any fsspec URL (`Checkpoints("gs://bucket/run")`, with
`pip install -e '.[gcs]'`). The format is specified in docs/checkpoint-format.md.
"""

from dew.checkpoints.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CorruptCheckpointError,
    DamagedLatestStepError,
    NotACheckpointError,
)
from dew.checkpoints.index import FORMAT, VERSION
from dew.checkpoints.manager import Checkpoints

__all__ = [
    "Checkpoints",
    "CheckpointError",
    "CheckpointMismatchError",
    "CorruptCheckpointError",
    "DamagedLatestStepError",
    "NotACheckpointError",
    "FORMAT",
    "VERSION",
]
