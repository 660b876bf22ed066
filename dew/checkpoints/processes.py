"""This process's place in a multi-process run, and the two meetings a checkpoint needs.

With one process both are no-ops and nothing below is imported. With several, they go through the
JAX distributed runtime's coordination service (the client `jax.distributed.initialize()` starts),
not through a device collective such as `multihost_utils.sync_global_devices`: a save's barriers run
in a background thread while the main thread launches training steps, and device collectives issued
from two threads could be ordered differently on different processes and deadlock.
"""

import jax

from dew._jax_compat import distributed_client
from dew.checkpoints.errors import CheckpointError


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

    def barrier(self, name: str) -> None:
        """Wait until every process reaches the barrier `name`."""
        if self.count > 1:
            self._client().wait_at_barrier(name, int(self.timeout_s * 1000))

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
