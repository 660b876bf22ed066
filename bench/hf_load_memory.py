"""Peak host memory of loading a Hugging Face Llama folder in a 2-process fsdp=8 run.

    python bench/hf_load_memory.py                      # ~2 GiB float32 folder under /tmp
    python bench/hf_load_memory.py --layers 2 --keep    # smaller; keep the folder

Generates a Llama-like folder of random float32 weights (vocabulary 32000, width 1536, 18 layers,
12 heads of 128, 4 kv heads, MLP 4096, untied head: 552M weights, 2.06 GiB) written with Dew's own
safetensors writer in files of at most 500 MB with ``model.safetensors.index.json``, then runs
``dew launch --processes 2 --devices-per-process 4`` of this script's ``--worker``: each process
builds a ``dew.Trainer`` on fsdp=8 and calls ``hf.load(folder, trainer=trainer)``.

Each process reports, in bytes:
  baseline  its resident memory (VmRSS) just before ``hf.load``, the peak (VmHWM) reset to it
            there (``/proc/self/clear_refs``: 5)
  peak      its peak resident memory (VmHWM) once ``hf.load`` has returned
  share     the bytes of the shards its 4 devices hold (CPU devices' buffers are host memory)
  buffer    peak - baseline - share: what loading needed beyond the loaded params
and ``ru_maxrss`` (getrusage), the peak over the process's whole life (compiles and imports
included), for reference. The folder is removed afterwards unless ``--keep``. Linux only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The CPU backend, here and in the launched processes (none looks for an accelerator).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
MIB = 2**20


def status_bytes(field: str) -> int:
    """A ``kB`` field of /proc/self/status (VmRSS, VmHWM) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> None:
    """Sets this process's peak resident memory (VmHWM) to its current one (Linux 4.0+)."""
    Path("/proc/self/clear_refs").write_text("5")


def model_config(args) -> dict:
    return dict(
        vocab_size=args.vocab,
        emb_features=args.width,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        mlp_features=args.mlp,
        tie_embeddings=False,
        max_seq_len=128,
        rope_theta=500000.0,
    )


def generate(folder: Path, config: dict, max_file_bytes: int, seed: int = 0) -> int:
    """Writes a Hugging Face folder of ``config``'s model with random float32 weights, one tensor
    in memory at a time; returns the weights' bytes."""
    import jax
    import numpy as np

    import dew
    from dew.models import hf, safetensors

    model = dew.models.build("causal_transformer", **config)
    rng = np.random.default_rng(seed)
    abstract = jax.eval_shape(model.init, jax.random.key(0))
    entries = []
    for m in hf.mappings(model):
        leaf = hf._get(abstract["params"], m.path)
        for layer in range(leaf.shape[0]) if m.stacked else [None]:
            shape = hf._hf_shape(m.kind, leaf.shape[1:] if m.stacked else leaf.shape)
            entries.append(
                (
                    m.name.format(layer),
                    np.dtype("<f4"),
                    shape,
                    lambda shape=shape: rng.standard_normal(shape, np.float32) * 0.02,
                )
            )
    groups, size = [[]], 0
    for entry in entries:
        nbytes = math.prod(entry[2]) * 4
        if groups[-1] and size + nbytes > max_file_bytes:
            groups.append([])
            size = 0
        groups[-1].append(entry)
        size += nbytes
    folder.mkdir(parents=True)
    names = [f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))]
    for name, group in zip(names, groups):
        safetensors.write(folder / name, group, metadata={"format": "pt"})
    total = sum(math.prod(e[2]) * 4 for e in entries)
    index = {
        "metadata": {"total_size": total},
        "weight_map": {e[0]: name for name, group in zip(names, groups) for e in group},
    }
    (folder / hf.INDEX).write_text(json.dumps(index, indent=2))
    (folder / hf.CONFIG).write_text(json.dumps(hf.config_of(model, "float32"), indent=2))
    return total


def worker(folder: str, seq: int) -> None:
    """One process of the launched run: loads ``folder`` on fsdp=8, prints a JSON line."""
    from dew.training.runtime import prepare_process

    prepare_process(multi_host=True)
    import jax
    import optax

    import dew
    from dew.models import hf
    from dew.objectives.lm import LMObjective

    assert jax.process_count() == 2 and jax.local_device_count() == 4, jax.devices()
    model = hf.model_from_config(hf.read_config(folder), max_seq_len=seq)
    trainer = dew.Trainer(
        LMObjective(model, seq), optax.sgd(0.0), jax.random.key(0), mesh=dew.MeshSpec(fsdp=8)
    )
    # Warm the runtime's first transfer (its own allocations are not the load's).
    jax.block_until_ready(jax.device_put(jax.numpy.zeros(8), jax.local_devices()[0]))
    baseline = status_bytes("VmRSS")
    reset_peak()
    start = time.perf_counter()
    _, params = hf.load(folder, trainer=trainer)
    jax.block_until_ready(params)
    seconds = time.perf_counter() - start
    peak = status_bytes("VmHWM")
    after = status_bytes("VmRSS")
    leaves = jax.tree_util.tree_leaves(params)
    share = sum(s.data.nbytes for leaf in leaves for s in leaf.addressable_shards)
    largest = max(s.data.nbytes for leaf in leaves for s in leaf.addressable_shards)
    total = sum(leaf.nbytes for leaf in leaves)
    report = dict(
        process=jax.process_index(),
        baseline=baseline,
        peak=peak,
        after=after,
        share=share,
        largest_shard=largest,
        model=total,
        buffer=peak - baseline - share,
        ru_maxrss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        seconds=seconds,
    )
    print("REPORT " + json.dumps(report), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--width", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--mlp", type=int, default=4096)
    parser.add_argument("--file-mb", type=int, default=500, help="largest safetensors file")
    parser.add_argument("--dir", default=None, help="where to write the folder (default /tmp)")
    parser.add_argument("--keep", action="store_true", help="keep the generated folder")
    parser.add_argument("--folder", default=None, help="load this folder instead of generating")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, 128)
        return

    scratch = None
    if args.folder:
        folder = Path(args.folder)
    else:
        scratch = Path(tempfile.mkdtemp(prefix="dew-hf-load-", dir=args.dir))
        folder = scratch / "llama"
        start = time.perf_counter()
        total = generate(folder, model_config(args), args.file_mb * 10**6)
        print(
            f"wrote {total / 2**30:.2f} GiB of float32 weights in "
            f"{len(list(folder.glob('*.safetensors')))} files to {folder} "
            f"({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
    try:
        launched = subprocess.run(
            [
                *(sys.executable, "-m", "dew", "launch", "--processes", "2"),
                *("--devices-per-process", "4", "--"),
                *(sys.executable, os.path.abspath(__file__), "--worker", str(folder)),
            ],
            capture_output=True,
            text=True,
        )
    finally:
        if scratch is not None and not args.keep:
            shutil.rmtree(scratch)
    if launched.returncode != 0:
        sys.exit(f"dew launch failed ({launched.returncode}):\n{launched.stderr[-4000:]}")
    reports = [
        json.loads(line.split("REPORT ", 1)[1])
        for line in launched.stdout.splitlines()
        if "REPORT " in line
    ]
    reports.sort(key=lambda r: r["process"])
    model = reports[0]["model"]
    print(f"model {model / MIB:.0f} MiB; 2 processes x 4 CPU devices, fsdp=8")
    print(
        f"{'process':>7} {'baseline':>10} {'peak':>10} {'growth':>10} {'share':>10} "
        f"{'buffer':>10} {'largest shard':>14} {'load s':>7}"
    )
    for r in reports:
        print(
            f"{r['process']:>7} {r['baseline'] / MIB:>6.0f} MiB {r['peak'] / MIB:>6.0f} MiB "
            f"{(r['peak'] - r['baseline']) / MIB:>6.0f} MiB {r['share'] / MIB:>6.0f} MiB "
            f"{r['buffer'] / MIB:>6.1f} MiB {r['largest_shard'] / MIB:>10.1f} MiB "
            f"{r['seconds']:>7.1f}"
        )


if __name__ == "__main__":
    main()
