"""Checkpoint throughput against np.save / np.load, and the loader's peak host memory.

    python bench/checkpoint_bench.py              # about 256 MB, 3 alternating rounds
    python bench/checkpoint_bench.py --mb 64 --rounds 5 --dir /scratch/bench

A state of `--mb` megabytes (eight float32 arrays, split over the `fsdp` axis of 8 simulated CPU
devices) is saved with `Checkpoints.save` (timed until `wait()` returns: the files are fsynced and
committed) and with `np.save` of the same bytes (one .npy per array: from host copies made beforehand,
without and with fsync, and from the devices through `jax.device_get`, with fsync, which is what
Dew's save does: copy, write, make durable); then
restored with `Checkpoints.restore` into the same layout and into other layouts, against `np.load`
of the same bytes, and against `np.load` followed by `jax.device_put` into the same target sharding
(what a restore onto devices costs with plain .npy files). Each round runs every contender once, in turn;
the table reports medians over rounds and throughput ratios (baseline time / Dew time: 1.0 means as
fast; the issue's target is at least 0.7), of wall time and of the process's CPU time (all threads,
user and system), which a machine shared with other jobs disturbs less. Files are read back from the
page cache in both cases.

Peak host memory of restoring into the fsdp-sharded layout is measured with tracemalloc (numpy
buffers are traced), not counting host buffers that the CPU backend adopts as the restored arrays
themselves, and compared with the largest piece the process reads.

Round 0 is a warm-up (first-touch page faults, allocator growth) and is not recorded.
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import tracemalloc
import zlib

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from dew.checkpoints import Checkpoints, reader  # noqa: E402

AXES = ("data", "expert", "fsdp", "tensor", "sequence", "stage")


def mesh(data: int, fsdp: int) -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(data, 1, fsdp, 1, 1, 1), AXES)


LAYOUTS = {  # name: (mesh shape, spec of every array)
    "fsdp 8, rows": ((1, 8), P("fsdp")),
    "data 2 x fsdp 4, rows": ((2, 4), P("fsdp")),
    "fsdp 8, columns": ((1, 8), P(None, "fsdp")),
    "data 8, replicated": ((8, 1), P()),
}


def timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the whole process: every thread, user and system)."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


class LoaderHostMemory:
    """Peak numpy memory the loader holds beyond the restored arrays (see tests/test_checkpoints.py)."""

    def __init__(self):
        self.lock, self.adopted, self.peak = threading.Lock(), 0, 0
        self.real_place = reader._place

    def _place(self, host, devices):
        placed = self.real_place(host, devices)
        with self.lock:
            self._close_interval()
            if any(array.unsafe_buffer_pointer() == host.ctypes.data for array in placed):
                allocation = host
                while (
                    allocation.base is not None
                ):  # the whole allocation, alignment padding included
                    allocation = allocation.base
                self.adopted += allocation.nbytes
        return placed

    def _close_interval(self):
        self.peak = max(self.peak, tracemalloc.get_traced_memory()[1] - self.adopted)
        tracemalloc.reset_peak()

    def __enter__(self):
        reader._place = self._place
        tracemalloc.start()
        return self

    def __exit__(self, *exc):
        self._close_interval()
        tracemalloc.stop()
        reader._place = self.real_place


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=256, help="state size in MB (default 256)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    args = parser.parse_args()

    scratch = tempfile.mkdtemp(prefix="dew-ckpt-bench-", dir=args.dir)
    rows = max(8, args.mb * 2**20 // (8 * 2048 * 4) // 8 * 8)
    rng = np.random.default_rng(0)
    host = {f"w{i}": rng.standard_normal((rows, 2048), dtype=np.float32) for i in range(8)}
    nbytes = sum(a.nbytes for a in host.values())
    fsdp = NamedSharding(mesh(1, 8), P("fsdp"))
    state = {k: jax.device_put(v, fsdp) for k, v in host.items()}
    jax.block_until_ready(state)

    def targets(layout: str):
        (data, fsdp_size), spec = LAYOUTS[layout]
        sharding = NamedSharding(mesh(data, fsdp_size), spec)
        return {
            k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in host.items()
        }

    times: dict[str, list[float]] = {}
    record = lambda name, seconds: times.setdefault(name, []).append(seconds)  # noqa: E731
    blocking = []

    def np_save(fsync: bool, folder: str, source=None):
        os.makedirs(folder)
        for name, value in (source or host).items():
            with open(os.path.join(folder, name + ".npy"), "wb") as f:
                np.save(f, value)
                if fsync:
                    f.flush()
                    os.fsync(f.fileno())

    def np_load(folder: str):
        return {name: np.load(os.path.join(folder, name + ".npy")) for name in host}

    for round_number in range(
        args.rounds + 1
    ):  # round 0 warms up the allocator and caches, unrecorded
        if round_number == 1:
            times.clear()
            blocking.clear()
        base = os.path.join(scratch, f"round{round_number}")
        record("np.save", timed(lambda: np_save(False, base + "-npy")))
        record("np.save + fsync", timed(lambda: np_save(True, base + "-npy-fsync")))
        fresh = jax.block_until_ready(
            {k: jax.device_put(v, fsdp) for k, v in host.items()}
        )  # no cached host copy
        record(
            "device_get + np.save + fsync",
            timed(lambda: np_save(True, base + "-get", jax.device_get(fresh))),
        )
        del fresh
        ckpt = Checkpoints(base + "-dew", keep=None)
        start, cpu = time.perf_counter(), time.process_time()
        ckpt.save(1, state)
        blocking.append(time.perf_counter() - start)
        ckpt.wait()
        record(
            "Checkpoints.save (until wait)",
            (time.perf_counter() - start, time.process_time() - cpu),
        )

        record("np.load", timed(lambda: np_load(base + "-npy")))
        for layout in LAYOUTS:
            record(
                f"np.load + device_put into {layout}",
                timed(
                    lambda: jax.block_until_ready(
                        {
                            k: jax.device_put(v, targets(layout)[k].sharding)
                            for k, v in np_load(base + "-npy").items()
                        }
                    )
                ),
            )
            record(
                f"restore into {layout}",
                timed(lambda: jax.block_until_ready(ckpt.restore(targets(layout))[0])),
            )
        shutil.rmtree(base + "-npy")
        shutil.rmtree(base + "-npy-fsync")
        shutil.rmtree(base + "-get")
    crc_seconds = min(
        timed(lambda: [zlib.crc32(memoryview(v).cast("B")) for v in host.values()])[0]
        for _ in range(3)
    )

    # Peak host memory restoring into the fsdp-sharded layout, from an fsdp-sharded checkpoint
    # (pieces of 1/8 of an array) and from a replicated one (each piece a whole array).
    memory_rows = []
    replicated = Checkpoints(os.path.join(scratch, "replicated"), keep=None)
    replicated.save(
        1, {k: jax.device_put(v, NamedSharding(mesh(8, 1), P())) for k, v in host.items()}
    )
    replicated.wait()
    for label, source in (
        ("fsdp 8 checkpoint", ckpt),
        ("data 8 (replicated) checkpoint", replicated),
    ):
        largest = max(p["nbytes"] for a in _index(source)["arrays"] for p in a["pieces"])
        with LoaderHostMemory() as memory:
            restored, _ = source.restore(targets("fsdp 8, rows"))
            jax.block_until_ready(restored)
        memory_rows.append((label, largest, memory.peak))
        del restored

    median = {name: statistics.median(wall for wall, _ in values) for name, values in times.items()}
    median_cpu = {
        name: statistics.median(cpu for _, cpu in values) for name, values in times.items()
    }
    print(
        f"\nDew checkpoint benchmark: {nbytes / 1e6:.0f} MB in 8 float32 arrays of {rows} x 2048, "
        f"saved from fsdp 8 ({jax.device_count()} simulated CPU devices, {os.cpu_count()} cores), "
        f"{args.rounds} alternating rounds, medians; files in {scratch} (page cache)\n"
    )
    print(
        f"{'operation':<52} {'wall s':>7} {'GB/s':>6} {'CPU s':>6}  "
        "ratios, baseline / Dew: wall time (CPU time)"
    )

    def row(name, baselines=()):
        ratios = "  ".join(
            f"{median[b] / median[name]:.2f} ({median_cpu[b] / median_cpu[name]:.2f}) vs {b.split(' into ')[0]}"
            for b in baselines
        )
        print(
            f"{name:<52} {median[name]:7.3f} {nbytes / median[name] / 1e9:6.2f} {median_cpu[name]:6.3f}  {ratios}"
        )

    row("np.save")
    row("np.save + fsync")
    row("device_get + np.save + fsync")
    row(
        "Checkpoints.save (until wait)",
        ("np.save", "np.save + fsync", "device_get + np.save + fsync"),
    )
    print(f"{'  of which blocking in save()':<52} {statistics.median(blocking):7.3f}")
    row("np.load")
    for layout in LAYOUTS:
        row(f"np.load + device_put into {layout}")
        row(f"restore into {layout}", ("np.load", f"np.load + device_put into {layout}"))
    print(
        f"{'crc32 of the state, one thread':<52} {crc_seconds:7.3f} {nbytes / crc_seconds / 1e9:6.2f}"
    )
    print(f"\nPeak host memory restoring into fsdp 8 (rows), beyond the restored arrays:")
    print(
        f"{'from':<34} {'largest piece read':>19} {'peak (tracemalloc)':>19} {'peak / piece':>13}"
    )
    for label, largest, peak in memory_rows:
        print(
            f"{label:<34} {largest / 2**20:15.1f} MiB {peak / 2**20:15.1f} MiB {peak / largest:13.2f}"
        )
    shutil.rmtree(scratch)


def _index(ckpt: Checkpoints) -> dict:
    import json

    return json.loads((ckpt.step_path(ckpt.latest) / "index.json").read_text())


if __name__ == "__main__":
    sys.exit(main())
