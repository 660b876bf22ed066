"""A checkpoint directory on a local (or mounted) filesystem: the atomic-rename protocol of
folders.py. `remote.RemoteDirectory` offers the same methods for object storage."""

import os
from pathlib import Path
from typing import Any

from dew.checkpoints import folders, reader, writer
from dew.checkpoints.errors import NotACheckpointError
from dew.checkpoints.index import INDEX_NAME, Index, step_folder_name


class LocalDirectory:
    def __init__(self, directory):
        directory = Path(os.path.abspath(os.fspath(directory)))
        if directory.exists() and not directory.is_dir():
            raise NotADirectoryError(f"checkpoint directory {directory} is a file")
        if (directory / INDEX_NAME).is_file():
            raise NotACheckpointError(
                f"{directory} holds an {INDEX_NAME}: it is one step's folder, not a checkpoint "
                f"directory; pass its parent, {directory.parent}"
            )
        self.directory = directory

    @property
    def name(self) -> str:
        return str(self.directory)

    def step_path(self, step: int) -> Path:
        return self.directory / step_folder_name(step)

    def complete_steps(self) -> list[int]:
        return folders.complete_steps(self.directory)

    def step_folders(self) -> list[int]:
        """The steps a restore tries: every step folder, so that a damaged one (no index) is
        reported rather than skipped silently."""
        return folders.step_folders(self.directory)

    def write_step(self, step, shot, metadata, processes, keep, chunk_bytes, prefix) -> None:
        writer.write_step(
            self.directory, step, shot, metadata, processes, keep, chunk_bytes, prefix
        )

    def read_index(self, step: int) -> Index:
        return reader.read_index(self.step_path(step), step)

    def restore(self, step: int, index: Index, target: Any, workers: int) -> Any:
        return reader.restore(self.step_path(step), index, target, workers)

    def check_files(self, step: int, index: Index) -> None:
        """CorruptCheckpointError unless each of the step's files is there with its size."""
        files = reader._Files(self.step_path(step), index)
        try:
            files.check_all()
        finally:
            files.close()

    def why_empty(self) -> str:
        if not self.directory.exists():
            return f"no checkpoint in {self.directory}: the directory does not exist"
        entries = sorted(os.listdir(self.directory))
        shown = ", ".join(entries[:8]) + (
            f" and {len(entries) - 8} more" if len(entries) > 8 else ""
        )
        return (
            f"{self.directory} is not a Dew checkpoint directory: it holds no step_NNNNNNNN "
            f"folder with an {INDEX_NAME} (it holds: {shown or 'nothing'})"
        )
