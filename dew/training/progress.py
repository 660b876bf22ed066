"""What a run is doing while nothing else moves: reading or initializing the weights, compiling.

    progress = Progress()  # on sys.stdout
    with progress.phase("compiling the step", done="compiled the step"):
        compiled = lowered.compile()

On a terminal the phase is one live line, its elapsed time redrawn every half second by a daemon
thread (``compiling the step... 12.5 s``), replaced by ``compiled the step in 14.2 s`` when it
ends. Where the output is not a terminal (a log file, a pipe, a test) the same phase is two plain
lines, ``compiling the step...`` as it starts and ``compiled the step in 14.2 s`` as it ends, so a
log says what the time before the first step went to. ``Trainer.fit(progress=...)`` reports its
phases (the state placed, the step compiled) on one; ``dew train`` passes one, the library's
default is silence.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Callable, TextIO

__all__ = ["Progress", "phase"]


class Progress:
    """Reports phases on ``stream`` (default ``sys.stdout``): a live line when ``live`` (default:
    the stream is a terminal), plain lines otherwise. ``interval``: seconds between redraws of
    the live line; ``clock``: the time in seconds (tests replace it)."""

    def __init__(
        self,
        stream: TextIO | None = None,
        *,
        live: bool | None = None,
        interval: float = 0.5,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.stream = sys.stdout if stream is None else stream
        if live is None:
            isatty = getattr(self.stream, "isatty", None)
            live = bool(isatty and isatty())
        self.live = live
        self.interval = interval
        self.clock = clock

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

    @contextlib.contextmanager
    def phase(self, doing: str, done: str):
        """Reports ``doing`` while the block runs and ``done in X s`` when it ends. A block that
        raises ends the live line (the error is then printed on a line of its own) and prints
        nothing more."""
        start = self.clock()
        stop = threading.Event()
        drawn = [0]  # the longest live line drawn, to blank it out when the phase ends

        def draw():
            text = f"\r{doing}... {self.clock() - start:.1f} s"
            drawn[0] = max(drawn[0], len(text))
            self._write(text)

        thread = None
        if self.live:
            draw()

            def redraw():
                while not stop.wait(self.interval):
                    draw()

            thread = threading.Thread(target=redraw, name="dew-progress", daemon=True)
            thread.start()
        else:
            self._write(f"{doing}...\n")
        try:
            yield
        except BaseException:
            if thread is not None:
                stop.set()
                thread.join()
                self._write("\n")
            raise
        if thread is not None:
            stop.set()
            thread.join()
        line = f"{done} in {self.clock() - start:.1f} s"
        self._write(f"\r{line.ljust(drawn[0] - 1)}\n" if self.live else f"{line}\n")


def phase(progress: Progress | None, doing: str, done: str):
    """``progress.phase(doing, done)``, or a block that reports nothing when ``progress`` is
    ``None``."""
    return contextlib.nullcontext() if progress is None else progress.phase(doing, done)
