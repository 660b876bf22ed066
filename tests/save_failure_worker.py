"""One process of a two-process save in which process 1 cannot write its file (started by
tests/test_multiprocess.py).

argv: port process_id checkpoint_dir barrier_timeout_s

Both processes save step 1 together. Then process 1's disk is full (every write of its file fails
with ENOSPC) and both save step 2: each prints, as one JSON line, how long after `save` its
`wait()` raised and what it raised. Then, its disk fine again, both restore the latest step and
save step 3 together.
"""

import errno
import json
import sys
import time

from dew.training.runtime import prepare_process

port, process_id, checkpoint_dir, timeout_s = sys.argv[1:]
prepare_process(
    multi_host=True,
    cpu_devices=2,
    coordinator_address=f"127.0.0.1:{port}",
    num_processes=2,
    process_id=int(process_id),
)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from dew.checkpoints import CheckpointError, Checkpoints, npz  # noqa: E402

assert jax.process_count() == 2 and jax.device_count() == 4


def tree(value: float) -> dict:
    """A (8, 4) array split over all 4 devices, so each process writes half, and a host leaf."""
    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("a",)), PartitionSpec("a"))
    host = np.full((8, 4), value, np.float32)
    return {
        "w": jax.make_array_from_callback(host.shape, sharding, lambda index: host[index]),
        "n": np.int32(value),
    }


ckpt = Checkpoints(checkpoint_dir, barrier_timeout_s=float(timeout_s))
ckpt.save(1, tree(1.0))
ckpt.wait()

real_write = npz._pwrite_all
if jax.process_index() == 1:

    def disk_full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    npz._pwrite_all = disk_full
started = time.monotonic()
ckpt.save(2, tree(2.0))
try:
    ckpt.wait()
    error = None
except CheckpointError as raised:
    error = str(raised)
failed_after_s = time.monotonic() - started
npz._pwrite_all = real_write

target = tree(0.0)  # restored with its shardings
restored, _ = ckpt.restore(target)
restored_ones = bool(
    all((np.asarray(s.data) == 1.0).all() for s in restored["w"].addressable_shards)
    and restored["n"] == 1
)
ckpt.save(3, tree(3.0))
ckpt.wait()
print(
    json.dumps(
        dict(
            error=error,
            failed_after_s=failed_after_s,
            restored_step=ckpt.restored_step,
            restored_ones=restored_ones,
        )
    ),
    flush=True,
)
