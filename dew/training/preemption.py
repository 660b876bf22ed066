"""Stopping ``Trainer.fit`` cleanly when the process is asked to stop: SIGTERM (what a scheduler or
a preemptible TPU sends before its SIGKILL) or Ctrl-C (SIGINT).

    with stop_signals() as stop:  # handlers for SIGTERM and SIGINT, the previous ones restored
        for step in ...:
            ...  # the step runs to its end whatever arrives meanwhile
            if stop.agreed():  # the same answer on every process, after the same step
                break
        ...  # save the state
    stop.finish(step, saved=True)  # prints what happened; raises Preempted for an exit

What ``fit`` does with each signal (the step in flight always finishes first):

- SIGTERM: a checkpoint of that step is written and committed, ``fit`` prints ``Preempted at step
  N; checkpoint saved`` and raises ``Preempted``, a ``SystemExit`` with code
  ``PREEMPTED_EXIT_CODE`` = 143 = 128 + SIGTERM: left uncaught (as in ``dew train``) the process
  exits with 143 and no traceback.
- the first Ctrl-C: the same stop, without the exit: ``fit`` saves, prints ``Interrupted at step N;
  checkpoint saved`` and returns the state (its ``step`` below the ``steps`` asked for).
- a second Ctrl-C (before ``fit`` has returned): turns that stop into an exit, as SIGTERM, with
  code ``INTERRUPTED_EXIT_CODE`` = 130 = 128 + SIGINT.
- a third Ctrl-C: ``KeyboardInterrupt`` at once, even in the middle of a save (the save in progress
  is lost; committed checkpoints are not touched).

Without checkpoints (``Trainer(checkpoints=None)``) the stop is the same and the message says
``not saved``; ``Preempted.state`` holds the state for a caller that catches it.

Several processes: each process's handler sets its own flag, so every process contributes it to a
tiny all-reduce (the maximum of one int32 per process, ``multihost_utils.process_allgather``), and
all stop after the same step, saving the same checkpoint, even when only one got the signal. The
all-reduce's answer waits for the step in flight, so ``fit`` does not ask it after every step (its
steps are dispatched ahead of the host, ``Trainer.fit``): it asks every
``dew.training.trainer.STOP_AGREE_EVERY`` (10) steps and at the steps where it waits anyway (saving,
evaluating, the last), after that step's loss is read, so it never overlaps the step's own
collectives. A signal therefore stops a run of several processes within 10 steps. One process
alone reads its flag after every step: no collective, no wait.

Handlers are installed only in the main thread (Python delivers signals there alone); elsewhere
``stop_signals`` installs nothing and never asks to stop. A handler installed outside Python (JAX's
own SIGTERM notifier in a multi-process run) is put back as it was when the context ends.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import threading

import numpy as np

PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM  # 143
INTERRUPTED_EXIT_CODE = 128 + signal.SIGINT  # 130

# What the processes agree on: the largest of their levels wins.
RUN, RETURN, EXIT_INTERRUPTED, EXIT_PREEMPTED = 0, 1, 2, 3
_EXIT_CODES = {EXIT_INTERRUPTED: INTERRUPTED_EXIT_CODE, EXIT_PREEMPTED: PREEMPTED_EXIT_CODE}


class Preempted(SystemExit):
    """``fit`` stopped on SIGTERM or a second Ctrl-C, after saving the step it had finished.

    A ``SystemExit``: uncaught, the process exits with ``code`` (143 after SIGTERM, 130 after a
    second Ctrl-C) and no traceback. ``step`` is the step saved (or, without checkpoints, reached);
    ``saved`` whether a checkpoint of it was committed; ``state`` the ``TrainState`` at that step.
    """

    def __init__(self, step: int, code: int, saved: bool, state=None):
        super().__init__(code)
        self.step, self.saved, self.state = step, saved, state


def _agree(level: int) -> int:
    """The largest ``level`` of all processes (one process: its own, no collective)."""
    import jax

    if jax.process_count() == 1:
        return level
    from jax.experimental import multihost_utils

    return int(np.max(multihost_utils.process_allgather(np.int32(level))))


# Handlers installed outside Python cannot be put back with ``signal.signal``; their ``struct
# sigaction`` is saved and restored as opaque bytes (larger than the struct on Linux and macOS).
_SIGACTION_BYTES = 512
# The Python handler Python's own table still names for a signal whose handler was restored raw.
_stale: dict[int, object] = {}


def _sigaction(signum: int, new=None):
    """The raw handler of ``signum`` (after setting ``new``, a buffer this returned, if given), or
    ``None`` where libc's ``sigaction`` cannot be called."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        old = ctypes.create_string_buffer(_SIGACTION_BYTES)
        if libc.sigaction(signum, new, old) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return old


class StopSignals:
    """What SIGTERM and Ctrl-C asked for since ``stop_signals`` installed the handlers."""

    def __init__(self, installed: bool):
        self.installed = installed
        self.level = RUN
        self.interrupts = 0

    def _on_signal(self, signum, frame) -> None:
        if signum == signal.SIGTERM:
            self.level = EXIT_PREEMPTED
            return
        self.interrupts += 1
        if self.interrupts >= 3:
            raise KeyboardInterrupt
        self.level = max(self.level, RETURN if self.interrupts == 1 else EXIT_INTERRUPTED)

    def agreed(self) -> int:
        """What every process asks for, the same on each: ``RUN`` (0, go on) or a level to stop at.
        A collective in a multi-process run: every process calls it after the same steps."""
        return _agree(self.level)

    def finish(self, step: int, saved: bool, state=None) -> None:
        """After the final save: prints how a stopped run ended (nothing when no stop was asked
        for) and raises ``Preempted`` when it was an exit. Agrees with the other processes first,
        so a signal that arrived during the save counts alike everywhere."""
        level = self.agreed()
        if level == RUN:
            return
        what = (
            "checkpoint saved"
            if saved
            else "not saved: the Trainer has no checkpoints (checkpoints=None)"
        )
        if level == RETURN:
            print(f"Interrupted at step {step}; {what}", flush=True)
            return
        print(f"Preempted at step {step}; {what}", flush=True)
        raise Preempted(step, _EXIT_CODES[level], saved, state)


@contextlib.contextmanager
def stop_signals():
    """Installs SIGTERM and SIGINT handlers recording a request to stop (``StopSignals``), and
    restores the previous handlers on exit. Outside the main thread it installs nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield StopSignals(installed=False)
        return
    stop = StopSignals(installed=True)
    handler = stop._on_signal  # one object: what getsignal returns is compared with it later
    previous = {}
    try:
        for signum in (signal.SIGTERM, signal.SIGINT):
            python = signal.getsignal(signum)
            raw = None
            if python is None or python is _stale.get(signum):
                python, raw = None, _sigaction(signum)
            previous[signum] = (python, raw)
            signal.signal(signum, handler)
        yield stop
    finally:
        for signum, (python, raw) in previous.items():
            if python is not None:
                signal.signal(signum, python)
            elif raw is not None and _sigaction(signum, raw) is not None:
                _stale[signum] = handler
            else:
                signal.signal(signum, signal.SIG_DFL)
