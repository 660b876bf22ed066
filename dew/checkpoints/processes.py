"""This process's place in a multi-process run, and the meetings a checkpoint needs.

With one process they are no-ops and nothing below is imported. With several, they go through the
JAX distributed runtime's coordination service (the client `jax.distributed.initialize()` starts),
not through a device collective such as `multihost_utils.sync_global_devices`: a save's meetings
run in a background thread while the main thread launches training steps, and device collectives
issued from two threads could be ordered differently on different processes and deadlock.
"""

from typing import Callable

import jax

from dew._jax_compat import distributed_client
from dew.checkpoints.errors import CheckpointError

# The value of a meeting's outcome key when every process's part succeeded; a failure's value is
# "x" and the message.
_SUCCEEDED = "ok"


class Processes:
    def __init__(self, index: int, count: int, timeout_s: float):
        self.index, self.count, self.timeout_s = index, count, timeout_s

    @classmethod
    def current(cls, timeout_s: float) -> "Processes":
        return cls(jax.process_index(), jax.process_count(), timeout_s)

    def _client(self):
        client = distributed_client()
        if client is None:
            raise CheckpointError(
                f"a checkpoint shared by {self.count} processes needs jax.distributed.initialize()"
            )
        return client

    def meet(
        self, name: str, doing: str, work: Callable[[], None] | None, *, first_only: bool = False
    ) -> None:
        """Every process runs `work` (process 0 alone with `first_only`; the others pass None),
        then waits until every process that ran it has succeeded. `doing` says what `work` does
        ("writing its file of step 5"), for the errors.

        The meeting fails fast: as soon as one process's `work` raises, every process raises
        CheckpointError("process P failed DOING: ERROR") at once, the failing one too (chained to
        its exception), rather than waiting for that process until a timeout. Nothing after the
        meeting runs anywhere. Waiting longer than `timeout_s` for the others raises
        CheckpointError too. Every process calls `meet` with the same `name` (unique to this
        meeting of this save), `doing` and `first_only`. With one process, `work` runs and its
        exception propagates unchanged.

        How: the outcome is one key of the coordination service's key-value store, written once.
        A process whose part succeeded increments a counter; the one that brings it to the number
        of reporting processes writes success. A process whose part failed, or that gave up
        waiting, writes its error instead. Everyone blocks on that key, so a failure wakes them
        all at once, without polling, and no two processes can act on different outcomes.
        """
        if self.count == 1:
            if work is not None:
                work()
            return
        client = self._client()
        reporting = 1 if first_only else self.count
        if work is not None:
            try:
                work()
            except BaseException as error:
                message = f"process {self.index} failed {doing}: {type(error).__name__}: {error}"
                self._decide(client, name, "x" + message)  # wakes the others at once
                if not isinstance(error, Exception):
                    raise  # KeyboardInterrupt, SystemExit: not turned into a CheckpointError
                raise CheckpointError(message) from error
            if client.key_value_increment(f"{name}/succeeded", 1) == reporting:
                self._decide(client, name, _SUCCEEDED)
        try:
            verdict = client.blocking_key_value_get(f"{name}/outcome", int(self.timeout_s * 1000))
        except Exception as error:  # the deadline passed (or the coordination service failed)
            verdict = self._decide(
                client, name, "x" + self._too_slow(client, name, doing, reporting, error)
            )
        if verdict != _SUCCEEDED:
            raise CheckpointError(verdict[1:])

    def _decide(self, client, name: str, verdict: str) -> str:
        """Writes the outcome of meeting `name`, unless another process already did; returns the
        outcome that stands."""
        try:
            client.key_value_set(f"{name}/outcome", verdict)
            return verdict
        except Exception:  # already written (ALREADY_EXISTS): the first word stands
            return client.key_value_try_get(f"{name}/outcome")

    def _too_slow(self, client, name, doing, reporting, error) -> str:
        try:
            done = client.key_value_try_get(f"{name}/succeeded")
        except Exception:  # no process got there
            done = "0"
        who = "process 0" if reporting == 1 else f"{reporting - int(done)} of {reporting} processes"
        first_line = str(error).partition("\n")[0]
        return (
            f"{who} did not finish {doing} within {self.timeout_s:g} s (barrier_timeout_s; "
            f"{type(error).__name__}: {first_line})"
        )

    def failures(self, name: str, problem: str | None) -> list[tuple[int, str]]:
        """Share each process's verdict (None: fine, else what went wrong) and return every
        process's problems as (process index, problem), so that all processes decide alike."""
        if self.count == 1:
            return [] if problem is None else [(0, problem)]
        client = self._client()
        client.key_value_set(f"{name}/{self.index}", "" if problem is None else "x" + problem)
        verdicts = [
            client.blocking_key_value_get(f"{name}/{p}", int(self.timeout_s * 1000))
            for p in range(self.count)
        ]
        return [(p, verdict[1:]) for p, verdict in enumerate(verdicts) if verdict]
