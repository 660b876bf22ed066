"""One process of a two-process training run (started by tests/test_multiprocess.py).

argv: port process_id token_folder checkpoint_dir steps
"""

import sys

from dew.training.runtime import prepare_process

port, process_id, folder, checkpoint_dir, steps = sys.argv[1:]
prepare_process(
    multi_host=True,
    cpu_devices=4,
    coordinator_address=f"127.0.0.1:{port}",
    num_processes=2,
    process_id=int(process_id),
)

import jax  # noqa: E402

import dew  # noqa: E402
from dew.data import TokenWindows  # noqa: E402
from tests.helpers import SEQ, two_process_trainer  # noqa: E402

assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
data = TokenWindows(folder, seq_len=SEQ, seed=7).load(batch=16)
trainer = two_process_trainer(dew.MeshSpec(fsdp=4), checkpoint_dir)
trainer.fit(data, steps=int(steps), log_every=1)
