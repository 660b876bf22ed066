"""One process of a two-process load of a Hugging Face folder (tests/test_hf_multiprocess.py).

argv: port process_id hf_folder out_dir [scratch_bytes]

Joins a run of 2 processes x 4 CPU devices, loads the folder with ``hf.load(folder, trainer=...)``
on fsdp=8 and writes the shards its devices hold to ``out_dir/process_<id>.npz``: for each shard,
``<param path>|<device id>|<start>|<stop>`` -> its data, as the device holds it.

With ``scratch_bytes``, the load reads through a scratch of that many bytes
(``safetensors.SCRATCH_BYTES``) and the process writes ``out_dir/memory_<id>.json`` instead:
its resident memory just before ``hf.load`` (``baseline``, VmRSS, the peak VmHWM reset to it
there through /proc/self/clear_refs), its peak once loaded (``peak``, VmHWM), the bytes its
devices' shards hold (``share``) and the largest shard.
"""

import json
import sys
from pathlib import Path

from dew.training.runtime import prepare_process

port, process_id, folder, out_dir, *scratch = sys.argv[1:]
prepare_process(
    multi_host=True,
    cpu_devices=4,
    coordinator_address=f"127.0.0.1:{port}",
    num_processes=2,
    process_id=int(process_id),
)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import dew  # noqa: E402
from dew.models import hf, safetensors  # noqa: E402
from dew.objectives.lm import LMObjective  # noqa: E402

assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
model = hf.model_from_config(hf.read_config(folder), max_seq_len=16)
trainer = dew.Trainer(
    LMObjective(model, 16),
    optax.sgd(0.0),
    jax.random.key(0),
    mesh=dew.MeshSpec(fsdp=8),
    layout=dew.Layout(min_shard=1),
)


def status_bytes(field: str) -> int:
    """A ``kB`` field of /proc/self/status (VmRSS, VmHWM), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


if scratch:
    safetensors.SCRATCH_BYTES = int(scratch[0])
    # The runtime's first transfer allocates for itself, not for the load.
    jax.block_until_ready(jax.device_put(np.zeros(8, np.float32), jax.local_devices()[0]))
    baseline = status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
_, params = hf.load(folder, trainer=trainer)
if scratch:
    jax.block_until_ready(params)
    peak = status_bytes("VmHWM")
    sizes = [
        s.data.nbytes for leaf in jax.tree_util.tree_leaves(params) for s in leaf.addressable_shards
    ]
    memory = dict(baseline=baseline, peak=peak, share=sum(sizes), largest=max(sizes))
    Path(out_dir, f"memory_{process_id}.json").write_text(json.dumps(memory))
    sys.exit(0)
shards = {}
for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    name = "/".join(str(k.key) for k in path)
    for shard in leaf.addressable_shards:
        start = [s.indices(n)[0] for s, n in zip(shard.index, leaf.shape)]
        stop = [s.indices(n)[1] for s, n in zip(shard.index, leaf.shape)]
        key = f"{name}|{shard.device.id}|{','.join(map(str, start))}|{','.join(map(str, stop))}"
        shards[key] = np.asarray(shard.data)
np.savez(f"{out_dir}/process_{process_id}.npz", **shards)
print(f"process {process_id}: {len(shards)} shards", flush=True)
