"""Checkpoint throughput against np.save / np.load of the same bytes, and the loader's peak host
memory.

    python bench/checkpoint_bench.py                  # about 256 MB, a warm-up and 5 timed rounds
    python bench/checkpoint_bench.py --mb 64 --rounds 9 --dir /scratch/bench --cold

The state: `--mb` megabytes in eight float32 arrays, split over the `fsdp` axis of 8 simulated CPU
devices. Contenders, all writing or reading the same bytes:

  save     np.save                   one .npy per array, from host copies made beforehand, not
                                     fsynced: not durable, shown for reference only
           np.save + fsync           the same, each file fsynced: the baseline of a durable save
           device_get + np.save + fsync   from the devices: copy to host, write, make durable
           Checkpoints.save + wait   Dew: save() copies to host, wait() returns once the files are
                                     fsynced and the step is committed (renamed into place)
  restore  np.load                   the .npy files into host memory
           np.load + device_put      the same, then onto the devices in the target's sharding: the
                                     baseline of a restore onto devices
           Checkpoints.restore       Dew, into that sharding, every chunk's CRC-32 checked

Fairness: every round runs every contender once, in an order that rotates from round to round, so
none always runs first or after the same neighbour. Before each timed save `os.sync()` (untimed)
writes back what earlier contenders left dirty, so no contender pays for another's writeback.
Saves run in this process, one after another, as a training run's saves do. Each restore runs in a
fresh process (after JAX has started and placed a small array on the target's devices, untimed), as
a resumed run's restore does. Restores repeated in one process (`--in-process`) measure the
allocator as much as the contenders: each gets memory that earlier ones freed, already faulted in or
not depending on their sizes, and on this VM first-touching fresh memory costs more than reading
the bytes. Measured: with the same restore code, np.load + device_put into fsdp 8 took 0.090 s or
0.034 s in process depending only on how the save before it had allocated its host copy, while
Dew's restore took 0.080 and 0.086 s.
Restores read files that were written and fsynced in the same round: from the page cache, unless
`--cold` evicts both sides' files (posix_fadvise DONTNEED, after a sync) before each timed restore.
Times are wall seconds (and CPU seconds of the whole process, every thread, user and system),
medians over the timed rounds; a ratio is baseline time / Dew time (throughput of Dew / throughput
of the baseline: 1.0 means as fast, the target is >= 0.7), taken within each round, where both
sides ran seconds apart under the same load, and reported as the median (and range) over rounds.
Round 0 warms up (allocator, caches, compilation) and is not recorded.

Peak host memory of restoring into the fsdp-sharded layout is measured with tracemalloc (numpy
buffers are traced), not counting host buffers that the CPU backend adopts as the restored arrays
themselves, and compared with the largest piece the process reads.
"""

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
import zlib
from concurrent.futures import ThreadPoolExecutor

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
SAVED_LAYOUT = "fsdp 8, rows"
LAYOUTS = {  # name: (data, fsdp), spec of every array; the first is the saved layout
    SAVED_LAYOUT: ((1, 8), P("fsdp")),
    "data 2 x fsdp 4, rows": ((2, 4), P("fsdp")),
    "fsdp 8, columns": ((1, 8), P(None, "fsdp")),
    "data 8, replicated": ((8, 1), P()),
}
SAVE_BASELINE = "np.save + fsync"
SAVE_NAMES = ("np.save", SAVE_BASELINE, "device_get + np.save + fsync", "Checkpoints.save + wait")
TARGET_RATIO = 0.7


def mesh(data: int, fsdp: int) -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(data, 1, fsdp, 1, 1, 1), AXES)


def sharding(layout: str) -> NamedSharding:
    (data, fsdp), spec = LAYOUTS[layout]
    return NamedSharding(mesh(data, fsdp), spec)


def timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the whole process: every thread, user and system) of `fn()`;
    freeing what it returns happens after the clocks stop."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()  # kept alive until the clocks have stopped
    elapsed = time.perf_counter() - wall, time.process_time() - cpu
    del result
    return elapsed


def evict(folder: str) -> None:
    """Drop `folder`'s files from the page cache (they are clean: the caller synced them)."""
    for name in os.listdir(folder):
        fd = os.open(os.path.join(folder, name), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def np_save(host: dict, folder: str, fsync: bool) -> None:
    os.makedirs(folder)
    for name, value in host.items():
        with open(os.path.join(folder, name + ".npy"), "wb") as f:
            np.save(f, value)
            if fsync:
                f.flush()
                os.fsync(f.fileno())


def np_load(names, folder: str) -> dict:
    return {name: np.load(os.path.join(folder, name + ".npy")) for name in names}


class LoaderHostMemory:
    """Peak numpy memory the loader holds beyond the restored arrays.

    See tests/test_checkpoints.py.
    """

    def __init__(self):
        self.lock, self.adopted, self.peak = threading.Lock(), 0, 0
        self.real_place = reader._place

    def _place(self, host, devices):
        placed = self.real_place(host, devices)
        with self.lock:
            self._close_interval()
            if any(array.unsafe_buffer_pointer() == host.ctypes.data for array in placed):
                allocation = host
                while allocation.base is not None:  # the whole allocation, padding included
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


class Results:
    """Times per contender and round; ratios are taken within a round."""

    def __init__(self):
        self.times: dict[str, dict[int, tuple[float, float]]] = {}

    def add(self, name: str, round_number: int, wall_cpu: tuple[float, float]) -> None:
        self.times.setdefault(name, {})[round_number] = wall_cpu

    def median(self, name: str, which: int = 0) -> float:
        return statistics.median(v[which] for v in self.times[name].values())

    def ratios(self, baseline: str, name: str) -> list[float]:
        rounds = sorted(set(self.times[baseline]) & set(self.times[name]))
        return [self.times[baseline][r][0] / self.times[name][r][0] for r in rounds]


def _rotated(items: list, round_number: int) -> list:
    k = round_number % len(items)
    return items[k:] + items[:k]


def run_rounds(args, host, state, scratch) -> tuple[Results, list[float]]:
    results, blocking = Results(), []
    fsdp = sharding(SAVED_LAYOUT)
    for round_number in range(args.rounds + 1):
        base = os.path.join(scratch, f"round{round_number}")
        ckpt = Checkpoints(base + "-dew", keep=None)

        def dew_save():
            start = time.perf_counter()
            ckpt.save(1, state)
            blocking.append(time.perf_counter() - start)
            ckpt.wait()

        def device_get_save():
            # A fresh copy on the devices, so that device_get cannot return a cached host copy.
            fresh = jax.block_until_ready({k: jax.device_put(v, fsdp) for k, v in host.items()})
            os.sync()
            results.add(
                "device_get + np.save + fsync",
                round_number,
                timed(lambda: np_save(jax.device_get(fresh), base + "-get", True)),
            )

        saves = [
            lambda: results.add(
                "np.save", round_number, timed(lambda: np_save(host, base + "-nosync", False))
            ),
            lambda: results.add(
                SAVE_BASELINE, round_number, timed(lambda: np_save(host, base + "-npy", True))
            ),
            device_get_save,
            lambda: results.add("Checkpoints.save + wait", round_number, timed(dew_save)),
        ]
        for save in _rotated(saves, round_number):
            if save is not device_get_save:
                os.sync()
            save()
            gc.collect()

        if "restore" in args.parts:
            step_dir = str(ckpt.step_path(1))
            for layout in _rotated(list(LAYOUTS), round_number):
                order = _rotated(["np.load", "np.load + device_put", "restore"], round_number)
                if layout != SAVED_LAYOUT:  # np.load alone does not depend on the layout
                    order.remove("np.load")
                for kind in order:
                    if args.cold:
                        os.sync()
                        evict(base + "-npy")
                        evict(step_dir)
                    name = kind if kind == "np.load" else f"{kind} into {layout}"
                    if args.in_process:
                        results.add(
                            name, round_number, timed(restore_operation(kind, layout, base))
                        )
                        gc.collect()
                    else:
                        results.add(
                            name, round_number, restore_in_fresh_process(kind, layout, base)
                        )
        for suffix in ("-nosync", "-npy", "-get", "-dew"):
            shutil.rmtree(base + suffix)
        print(
            f"round {round_number}{' (warm-up)' if round_number == 0 else ''} done, "
            f"load {os.getloadavg()[0]:.2f}",
            file=sys.stderr,
        )
        if round_number == 0:
            results, blocking = Results(), []
    return results, blocking


def restore_in_fresh_process(kind: str, layout: str, base: str) -> tuple[float, float]:
    """(wall, CPU) seconds of one restore contender, timed in a process of its own."""
    command = [sys.executable, __file__, "--worker", kind, layout, base]
    done = subprocess.run(command, check=False, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    wall, cpu = json.loads(done.stdout.strip().splitlines()[-1])
    return wall, cpu


def restore_operation(kind: str, layout: str, base: str):
    """The restore contender `kind` ("np.load", "np.load + device_put" or "restore") of round
    `base`'s files into `layout`, ready to time: the runtime and its devices are started first."""
    target_sharding = sharding(layout)
    names = sorted(name[: -len(".npy")] for name in os.listdir(base + "-npy"))
    shapes = {
        name: np.load(os.path.join(base + "-npy", name + ".npy"), mmap_mode="r").shape
        for name in names
    }
    jax.block_until_ready(jax.device_put(np.zeros((64, 64), np.float32), target_sharding))
    if kind == "np.load":
        return lambda: np_load(names, base + "-npy")
    if kind == "np.load + device_put":
        return lambda: jax.block_until_ready(
            {
                k: jax.device_put(v, target_sharding)
                for k, v in np_load(names, base + "-npy").items()
            }
        )
    target = {
        k: jax.ShapeDtypeStruct(shape, np.float32, sharding=target_sharding)
        for k, shape in shapes.items()
    }
    ckpt = Checkpoints(base + "-dew")
    return lambda: jax.block_until_ready(ckpt.restore(target)[0])


def crc_seconds(host: dict) -> tuple[float, float]:
    """Best of 3: CRC-32 of the whole state in 4 MiB chunks, on one thread and on two."""
    chunks = [
        memoryview(v).cast("B")[i : i + (4 << 20)]
        for v in host.values()
        for i in range(0, v.nbytes, 4 << 20)
    ]
    one = min(timed(lambda: [zlib.crc32(c) for c in chunks])[0] for _ in range(3))
    with ThreadPoolExecutor(2) as pool:
        two = min(timed(lambda: list(pool.map(zlib.crc32, chunks)))[0] for _ in range(3))
    return one, two


def memory_rows(host: dict, scratch: str) -> list[tuple[str, int, int]]:
    """Peak host memory restoring into the fsdp-sharded layout, from an fsdp-sharded checkpoint
    (pieces of 1/8 of an array) and from a replicated one (each piece a whole array)."""
    rows = []
    target = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding(SAVED_LAYOUT))
        for k, v in host.items()
    }
    for label, layout in (
        ("fsdp 8 checkpoint", SAVED_LAYOUT),
        ("data 8 (replicated) checkpoint", "data 8, replicated"),
    ):
        ckpt = Checkpoints(os.path.join(scratch, "memory-" + layout.split(",")[0]), keep=None)
        ckpt.save(1, {k: jax.device_put(v, sharding(layout)) for k, v in host.items()})
        ckpt.wait()
        index = json.loads((ckpt.step_path(1) / "index.json").read_text())
        largest = max(p["nbytes"] for a in index["arrays"] for p in a["pieces"])
        with LoaderHostMemory() as memory:
            restored, _ = ckpt.restore(target)
            jax.block_until_ready(restored)
        assert all(np.array_equal(np.asarray(restored[k]), v) for k, v in host.items())
        rows.append((label, largest, memory.peak))
        del restored
    return rows


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:  # one restore contender, in a fresh process
        print(json.dumps(timed(restore_operation(*sys.argv[2:5]))))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=256, help="state size in MB (default 256)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--cold", action="store_true", help="restore from disk, not page cache")
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="time the restores in this process, one after another (not in fresh processes)",
    )
    parser.add_argument(
        "--parts", default="save,restore,memory", help="comma-separated: save,restore,memory"
    )
    args = parser.parse_args()

    load_before = os.getloadavg()
    scratch = tempfile.mkdtemp(prefix="dew-ckpt-bench-", dir=args.dir)
    rows = max(8, args.mb * 2**20 // (8 * 2048 * 4) // 8 * 8)
    rng = np.random.default_rng(0)
    host = {f"w{i}": rng.standard_normal((rows, 2048), dtype=np.float32) for i in range(8)}
    nbytes = sum(a.nbytes for a in host.values())
    state = jax.block_until_ready(
        {k: jax.device_put(v, sharding(SAVED_LAYOUT)) for k, v in host.items()}
    )
    try:
        results, blocking = run_rounds(args, host, state, scratch)
        one_thread, two_threads = crc_seconds(host)
        memory = memory_rows(host, scratch) if "memory" in args.parts else []
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    load_after = os.getloadavg()

    cache = "from disk (--cold)" if args.cold else "from the page cache"
    where = "one after another in this process" if args.in_process else "each in a fresh process"
    print(
        f"\nDew checkpoint benchmark: {nbytes / 1e6:.0f} MB in 8 float32 arrays of {rows} x 2048, "
        f"saved from {SAVED_LAYOUT} ({jax.device_count()} simulated CPU devices, "
        f"{os.cpu_count()} cores), JAX {jax.__version__}; {args.rounds} timed rounds, medians; "
        f"restores {where}, reading {cache}.\nLoad average (1, 5, 15 min): "
        f"{', '.join(f'{x:.2f}' for x in load_before)} before, "
        f"{', '.join(f'{x:.2f}' for x in load_after)} after.\n"
    )
    width = 50
    print(
        f"{'operation':<{width}} {'wall s':>7} {'GB/s':>6} {'CPU s':>6}  "
        "Dew's throughput / the baseline's: median over rounds [range]"
    )
    verdicts = []

    def ratio_text(baseline, name):
        ratios = results.ratios(baseline, name)
        return statistics.median(ratios), f"[{min(ratios):.2f}-{max(ratios):.2f}]"

    def row(name, baselines=(), target=None):
        wall = results.median(name)
        print(
            f"{name:<{width}} {wall:7.3f} {nbytes / wall / 1e9:6.2f} "
            f"{results.median(name, 1):6.3f}",
            end="",
        )
        for number, baseline in enumerate(baselines):
            ratio, spread = ratio_text(baseline, name)
            indent = "  " if number == 0 else "\n" + " " * (width + 24)
            print(f"{indent}{ratio:.2f} {spread} vs {baseline}", end="")
            if number == 0 and target:
                verdicts.append((target, ratio))
        print()

    save_baselines = (SAVE_BASELINE, "np.save", "device_get + np.save + fsync")
    for name in SAVE_NAMES[:-1]:
        row(name)
    row("Checkpoints.save + wait", save_baselines, "save, against np.save + fsync")
    print(f"{'  of which blocking in save()':<{width}} {statistics.median(blocking):7.3f}")
    if "restore" in args.parts:
        row("np.load")
        for layout in LAYOUTS:
            baseline = f"np.load + device_put into {layout}"
            row(baseline)
            baselines = (baseline, "np.load") if layout == SAVED_LAYOUT else (baseline,)
            kind = "same layout" if layout == SAVED_LAYOUT else "other layout"
            row(f"restore into {layout}", baselines, f"restore, {kind} ({layout})")
    print(
        f"{'crc32 of the state: one thread, two threads':<{width}} {one_thread:7.3f} "
        f"{nbytes / one_thread / 1e9:6.2f}   {two_threads:.3f} s, "
        f"{nbytes / two_threads / 1e9:.2f} GB/s"
    )
    if memory:
        print("\nPeak host memory restoring into fsdp 8 (rows), beyond the restored arrays:")
        print(f"{'from':<34} {'largest piece read':>19} {'peak (tracemalloc)':>19} {'/ piece':>8}")
        for label, largest, peak in memory:
            print(
                f"{label:<34} {largest / 2**20:15.1f} MiB {peak / 2**20:15.1f} MiB "
                f"{peak / largest:8.2f}"
            )
    print(f"\n{'target: Dew / baseline throughput':<{width}} {'measured':>8}  limit")
    for target, ratio in verdicts:
        met = "met" if ratio >= TARGET_RATIO else "MISSED"
        print(f"{target:<{width}} {ratio:8.2f}  >= {TARGET_RATIO}   {met}")
    if memory:
        _, largest, peak = memory[0]
        # As tests/test_checkpoints.py: two pieces in flight, plus bookkeeping.
        met = "met" if peak <= 2 * largest + (256 << 10) else "MISSED"
        label = "peak host memory / largest piece (fsdp state)"
        print(f"{label:<{width}} {peak / largest:8.2f}  <= 2 + 256 KiB   {met}")


if __name__ == "__main__":
    sys.exit(main())
