"""Loading: how batches are read (in the calling thread, or ahead of time by background threads),
and BatchStream, the closeable iterator that does the reading."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from dew.checks import nonnegative_int


@dataclasses.dataclass(frozen=True)
class Loading:
    """How a dataset's ``batches()`` reads ahead.

    Attributes:
      workers: accepted for the familiar loader signature, and read with threads, not processes:
        ``workers`` adds that many reader threads (``readers == threads + workers``). A batch here
        is a gather of whole windows from a memory map into one array, which numpy does with the GIL
        released, so threads overlap the reads as well as processes would, without pickling every
        batch across a process boundary. Default 0.
      threads: background reader threads. 0 reads each batch in the calling thread when it is
        asked for (no read-ahead). Default 1.
      read_buffer: how many batches the readers may hold ready ahead of the consumer (at least 1
        when there are readers). Default 2.

    Which rows a batch holds never depends on these settings, only when they are read.

    Raises:
      ValueError: a setting below 0, or ``read_buffer`` 0 with reader threads.

    Examples:
        >>> from dew.data import Loading, TokenWindows
        >>> data = TokenWindows("tokens", seq_len=32, loading=Loading(threads=2)).load(batch=16)
    """

    workers: int = 0
    threads: int = 1
    read_buffer: int = 2

    def __post_init__(self):
        for name in ("workers", "threads", "read_buffer"):
            nonnegative_int(f"Loading.{name}", getattr(self, name))
        if self.readers > 0 and self.read_buffer < 1:
            raise ValueError(
                "Loading.read_buffer must be >= 1 when there are reader threads "
                f"(threads={self.threads}, workers={self.workers}), got {self.read_buffer}"
            )

    @property
    def readers(self) -> int:
        """Background reader threads: ``threads + workers``."""
        return int(self.threads) + int(self.workers)


class _Shared:
    """State shared by the reader threads and the consumer. The threads hold this, never the
    BatchStream, so a stream that is dropped without close() can still be collected and close
    them."""

    def __init__(self, start: int, depth: int):
        self.cond = threading.Condition()
        self.next_claim = start  # the next index a reader takes
        self.next_yield = start  # the next index the consumer receives
        self.depth = depth
        self.ready: dict[int, np.ndarray] = {}
        self.error: tuple[int, BaseException] | None = None
        self.closed = False


def _read_ahead(shared: _Shared, read: Callable[[int], Any]) -> None:
    while True:
        with shared.cond:
            while (
                not shared.closed
                and shared.error is None
                and shared.next_claim >= shared.next_yield + shared.depth
            ):
                shared.cond.wait()
            if shared.closed or shared.error is not None:
                return
            index = shared.next_claim
            shared.next_claim += 1
        try:
            value = read(index)
        except BaseException as error:  # noqa: BLE001 - handed to the consumer, who re-raises it
            with shared.cond:
                if shared.error is None or index < shared.error[0]:
                    shared.error = (index, error)
                shared.cond.notify_all()
            return
        with shared.cond:
            shared.ready[index] = value
            shared.cond.notify_all()


class BatchStream(Iterator[tuple[int, Any]]):
    """Yields ``(index, read(index))`` for index = start, start + 1, ... in order, forever.

    With ``loading.readers > 0`` background threads read up to ``loading.read_buffer`` batches ahead
    of the consumer; otherwise ``read`` runs in ``next()``. An exception raised by ``read`` reaches
    the consumer, with its original type and traceback, at the index that raised it (the batches
    before it are delivered first), and ends the stream.

    Close it with ``close()`` or use it as a context manager: closing stops and joins the threads.
    ``WindowDataset.batches`` makes one.

    Args:
      read: the batch of an index (``lambda index: dataset.batch(index, rows)``).
      start: the first index.
      loading: how many threads read, and how far ahead.

    Examples:
        >>> with data.batches(start=10) as stream:
        ...     for index, rows in stream:  # index 10, 11, ...; rows int32 [16, 33]
        ...         if index == 12:
        ...             break
    """

    def __init__(self, read: Callable[[int], Any], start: int, loading: Loading):
        self._read = read
        self._shared = _Shared(start, loading.read_buffer)
        self._threads = [
            threading.Thread(
                target=_read_ahead,
                args=(self._shared, read),
                daemon=True,
                name=f"dew-data-reader-{i}",
            )
            for i in range(loading.readers)
        ]
        for thread in self._threads:
            thread.start()

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> tuple[int, Any]:
        shared = self._shared
        if not self._threads:
            if shared.closed:
                raise StopIteration
            index = shared.next_yield
            try:
                value = self._read(index)
            except BaseException:
                shared.closed = True
                raise
            shared.next_yield += 1
            return index, value
        with shared.cond:
            while True:
                if shared.closed:
                    raise StopIteration
                index = shared.next_yield
                if index in shared.ready:
                    value = shared.ready.pop(index)
                    shared.next_yield += 1
                    shared.cond.notify_all()
                    return index, value
                if shared.error is not None and shared.error[0] == index:
                    error = shared.error[1]
                    break
                shared.cond.wait()
        self.close()
        raise error

    def close(self) -> None:
        """Stops the reader threads and waits for them (a read in progress finishes first).
        Idempotent."""
        with self._shared.cond:
            self._shared.closed = True
            self._shared.ready.clear()
            self._shared.cond.notify_all()
        current = threading.current_thread()
        for thread in self._threads:
            if thread is not current:
                thread.join()

    @property
    def alive_threads(self) -> int:
        """How many reader threads are still running (0 after close())."""
        return sum(thread.is_alive() for thread in self._threads)

    def __enter__(self) -> BatchStream:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __del__(self):
        # No join here: a finalizer must not block. The threads see `closed` and exit on their own.
        shared = getattr(self, "_shared", None)
        if shared is not None:
            with shared.cond:
                shared.closed = True
                shared.cond.notify_all()
