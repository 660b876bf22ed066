"""Host buffers for pieces: aligned so the CPU backend can adopt them and the kernel can back them
with huge pages.

A buffer starting on a 64-byte boundary can become a CPU device buffer without a copy. A large one
starting on a 2 MiB boundary is backed by transparent huge pages (numpy asks for them on
allocations of 4 MiB and more), which makes its first touch, the bulk of filling a fresh buffer,
about twice as cheap. Aligning costs up to 2 MiB of allocation per buffer (address space the
buffer never touches), so only buffers of 32 MiB and more are aligned that way (at most 6%).
"""

import math

import numpy as np

_HUGE_PAGE = 2 << 20
_HUGE_ALIGN_FROM = 32 << 20


def aligned_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialised C-ordered array starting on a 64-byte (2 MiB if large) boundary."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    alignment = _HUGE_PAGE if nbytes >= _HUGE_ALIGN_FROM else 64
    raw = np.empty(nbytes + alignment, np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def copy_of(array: np.ndarray) -> np.ndarray:
    """A C-ordered copy of `array` in an aligned buffer."""
    out = aligned_empty(array.shape, array.dtype)
    np.copyto(out, array)
    return out
