"""One process of a run started by ``dew launch`` (tests/test_launch.py): joins the run from the
environment alone, trains the tiny model of tests/test_multiprocess.py and checkpoints it.

argv: token_folder checkpoint_dir steps [die_rank]

A SIGTERM (to any one rank) stops every rank after the same step with its checkpoint
(``dew.training.preemption``); each rank then prints ``exit code N``, ``Preempted``'s code, and
goes on as if ``fit`` had returned. With ``die_rank``, once every process is past the final
checkpoint, that rank dies (exit code 3, no clean-up, as a crash) and the others block for good,
standing for ranks stuck in a collective their dead peer never joins: only ``dew launch`` can end
them. Without it, a preempted rank exits with its code. Each prints its pid first.
"""

import os
import sys
import threading

from dew.training.runtime import prepare_process

prepare_process(multi_host=True)

import jax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import dew  # noqa: E402
from dew.data import TokenWindows  # noqa: E402
from dew.training.preemption import Preempted  # noqa: E402
from tests.helpers import SEQ, two_process_trainer  # noqa: E402

folder, checkpoint_dir, steps, *die = sys.argv[1:]
print(f"pid {os.getpid()}", flush=True)
assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
data = TokenWindows(folder, seq_len=SEQ, seed=7).load(batch=16)
trainer = two_process_trainer(dew.MeshSpec(fsdp=4), checkpoint_dir)
try:
    trainer.fit(data, steps=int(steps), log_every=1)
except Preempted as preempted:
    print(f"exit code {preempted.code}", flush=True)
    if not die:
        raise
if die:
    multihost_utils.sync_global_devices("the last checkpoint is written")
    if jax.process_index() == int(die[0]):
        os._exit(3)
    print("blocked", flush=True)
    threading.Event().wait()
