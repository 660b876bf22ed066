"""Host buffers for pieces: aligned so the CPU backend can adopt them and the kernel can back them
with huge pages.

A buffer starting on a 64-byte boundary can become a CPU device buffer without a copy. A large one
starting on a 2 MiB boundary is backed entirely by transparent huge pages (numpy asks for them on
allocations of 4 MiB and more; unaligned, only the 2 MiB blocks that happen to lie inside the
buffer get them), which makes its first touch, the bulk of filling a fresh buffer, cheaper. The
price is up to 2 MiB of padding per buffer: address space that nothing touches, so no resident
memory, but it stays allocated as long as the buffer does.

- Buffers the loader fills become the restored arrays and live as long as they do, so only those of
  32 MiB and more are aligned that way (padding at most 6%). Measured: restoring 256 MB into 4 MiB
  slices was no faster with 2 MiB alignment (in one run of 10 rounds, slower: reads 180 against
  98 ms of CPU time).
- A save's host copy lives only until its files are written, so it is aligned from 4 MiB on.
  Measured on this project's 2-core VM, 256 MB in 4 MiB pieces: the copy in `save()` took 91 ms
  at 64-byte alignment and 40 ms at 2 MiB (10 saves in a row); in bench/checkpoint_bench.py, where
  other contenders allocate between the saves, 29 and 35 ms.
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
