"""Host buffers for pieces: aligned so the CPU backend can adopt them and the kernel can back them
with huge pages.

A buffer starting on a 64-byte boundary can become a CPU device buffer without a copy. A large one
starting on a 2 MiB boundary is backed entirely by transparent huge pages (numpy asks for them on
allocations of 4 MiB and more; unaligned, only the 2 MiB blocks that happen to lie inside the
buffer get them), which makes its first touch, the bulk of filling a fresh buffer, cheaper. The
price is up to 2 MiB of padding per buffer: address space that nothing touches, so no resident
memory, but it stays allocated as long as the buffer does.

- Buffers the loader fills become the restored arrays and live as long as they do, so only those of
  32 MiB and more are aligned that way (padding at most 6%): smaller restored slices gained nothing
  from it (measured: docs/results/cpu-layouts.md, 'Checkpoints').
- A save's host copy lives only until its files are written, so it is aligned from 4 MiB on, where
  the copy in `save()` gains (measured: docs/results/cpu-layouts.md, 'Checkpoints').
"""

import math

import numpy as np

_HUGE_PAGE = 2 << 20
_RESTORED_ALIGN_FROM = 32 << 20
_COPY_ALIGN_FROM = 4 << 20


def aligned_empty(
    shape: tuple[int, ...], dtype, huge_from: int = _RESTORED_ALIGN_FROM
) -> np.ndarray:
    """An uninitialised C-ordered array starting on a 64-byte boundary (2 MiB from `huge_from`
    bytes on)."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    alignment = _HUGE_PAGE if nbytes >= huge_from else 64
    raw = np.empty(nbytes + alignment, np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def copy_of(array: np.ndarray) -> np.ndarray:
    """A C-ordered copy of `array` in an aligned buffer (a save's short-lived host copy)."""
    out = aligned_empty(array.shape, array.dtype, huge_from=_COPY_ALIGN_FROM)
    np.copyto(out, array)
    return out
