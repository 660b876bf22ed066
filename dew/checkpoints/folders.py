"""The checkpoint directory on disk: step folders, leftovers, durable writes, commit and retention.

    <directory>/
      step_00000010/              a complete step: index.json + process_NNNNN.npz files
      step_00000020/
      step_00000030.tmp/          a step being written (or left by a killed writer)
      step_00000020.replaced/     a step being overwritten by a new save of the same step
      step_00000010.deleting/     a step being removed by retention

Only `step_NNNNNNNN` folders (eight or more digits) that hold an `index.json` are checkpoints; the
index is the last thing written into the temporary folder, and one `os.rename` makes the folder
visible, so a writer killed at any moment leaves either the complete step or no step at all.
The other names are cleaned at the next save (a `.replaced` folder whose step folder is missing is
a complete step whose replacement never landed: it is renamed back instead).
"""

import errno
import os
import re
import shutil
from pathlib import Path

from dew.checkpoints.index import INDEX_NAME, STEP_FOLDER, step_folder_name

TEMP_SUFFIX = ".tmp"
REPLACED_SUFFIX = ".replaced"
DELETING_SUFFIX = ".deleting"
_LEFTOVER = re.compile(r"step_(\d{8,})\.(tmp|replaced|deleting)")


def step_folders(directory: Path) -> list[int]:
    """The steps that have a `step_NNNNNNNN` folder (complete or damaged), ascending."""
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return []
    steps = []
    for entry in entries:
        match = STEP_FOLDER.fullmatch(entry.name)
        if match and entry.is_dir(follow_symlinks=False):
            steps.append(int(match.group(1)))
    return sorted(steps)


def complete_steps(directory: Path) -> list[int]:
    """The steps whose folder holds an index.json, ascending; [] if `directory` does not exist."""
    return [
        step
        for step in step_folders(directory)
        if os.path.isfile(directory / step_folder_name(step) / INDEX_NAME)
    ]


def fsync_directory(path: Path) -> None:
    """Make a directory's entries (creations, renames, removals) durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):  # "not supported here"
            raise
    finally:
        os.close(fd)


def write_durably(path: Path, data: bytes) -> None:
    """Create `path` (it must not exist) holding `data`, and fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: Path) -> None:
    """Remove a folder tree, or a file or symlink, at `path`; nothing if it is gone."""
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)


def clean_leftovers(directory: Path) -> None:
    """Remove the temporary folders earlier saves left behind; restore an interrupted
    replacement."""
    for entry in list(os.scandir(directory)):
        match = _LEFTOVER.fullmatch(entry.name)
        if not match:
            continue
        final = directory / step_folder_name(int(match.group(1)))
        if (
            match.group(2) == REPLACED_SUFFIX[1:]
            and not os.path.lexists(final)
            and os.path.isfile(os.path.join(entry.path, INDEX_NAME))
        ):
            os.rename(entry.path, final)
            fsync_directory(directory)
        else:
            remove(Path(entry.path))


def commit(temp: Path, final: Path) -> None:
    """Make the fully written folder `temp` visible as `final` with one rename, durably.

    If `final` exists (the same step saved again) it is first renamed aside and removed after.
    """
    fsync_directory(temp)
    replaced = None
    if os.path.lexists(final):
        replaced = final.with_name(final.name + REPLACED_SUFFIX)
        remove(replaced)
        os.rename(final, replaced)
    os.rename(temp, final)
    fsync_directory(final.parent)
    if replaced is not None:
        remove(replaced)


def retain(directory: Path, keep: int | None, just_written: int) -> list[int]:
    """Remove all but the newest `keep` steps, never `just_written`; returns the removed steps.

    Each doomed folder is first renamed to `.deleting`, so a process killed while deleting never
    leaves a half-deleted folder under a step name.
    """
    if keep is None:
        return []
    others = [step for step in complete_steps(directory) if step != just_written]
    doomed = others[: max(0, len(others) - (keep - 1))]
    aside = []
    for step in doomed:
        path = directory / step_folder_name(step)
        aside.append(path.with_name(path.name + DELETING_SUFFIX))
        remove(aside[-1])
        os.rename(path, aside[-1])
    if doomed:
        fsync_directory(directory)
    for path in aside:
        remove(path)
    return doomed
