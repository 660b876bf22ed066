"""How finely fsdp gathers: ``dew.parallel.fsdp.BUCKET_BYTES`` against one bucket per layer, side by
side with the pinned GSPMD step and the one-device row.

    python bench/gather_granularity.py                     # GPT-2-small size, fsdp=8, 5 rounds
    python bench/gather_granularity.py --layers 4 --width 256 --heads 4 --seq-len 128 --batch 32

Each contestant's step is traced and compiled with the module's ``BUCKET_BYTES`` as set just before
(the value is read while tracing), then all take turns, one step each per round, in an order that
rotates every round. Prints each contestant's temporary memory and compiled collectives, each
round's step times, and the median over rounds of each one's ratio to GSPMD and to one device.
docs/results/cpu-layouts.md ("How finely fsdp gathers") has the numbers.
"""

from __future__ import annotations

import argparse
import statistics

from dew.training.runtime import prepare_process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--layout", default="fsdp=8")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    prepare_process(cpu_devices=8)

    from dew import benchmark
    from dew.mesh import MeshSpec
    from dew.parallel import fsdp

    size = benchmark.ModelSize(
        layers=args.layers,
        width=args.width,
        heads=args.heads,
        seq_len=args.seq_len,
        batch=args.batch,
    )
    objective = size.objective()
    contestants = {}
    default = fsdp.BUCKET_BYTES
    for name, limit, engine in [
        (f"buckets <= {default / 2**20:g} MiB", default, "shard_map"),
        ("one bucket per layer", 2**62, "shard_map"),
        ("gspmd", default, "gspmd"),
        ("one device", default, benchmark.ONE_DEVICE),
    ]:
        fsdp.BUCKET_BYTES = limit
        c = benchmark.Contestant(objective, size, MeshSpec.parse(args.layout), engine)
        c.prepare()
        c.compile()
        c.run(1, record=False)  # warm-up
        contestants[name] = c
        print(
            f"{name:<22} temp {c.temp_bytes / 2**20:7.1f} MiB/device, "
            f"{c.report.count()} collectives, {c.report.wire_bytes() / 2**20:.1f} MiB/step sent",
            flush=True,
        )
    fsdp.BUCKET_BYTES = default
    names = list(contestants)
    for round_ in range(args.rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            contestants[name].run(1)
        times = ", ".join(f"{n} {1e3 * contestants[n].times[-1]:.0f}" for n in names)
        print(f"round {round_ + 1}/{args.rounds} (ms): {times}", flush=True)
    for name in names:
        ours = contestants[name].times
        vs = {
            other: statistics.median(a / b for a, b in zip(ours, contestants[other].times))
            for other in ("gspmd", "one device")
        }
        print(f"{name:<22} / gspmd {vs['gspmd']:.3f}   / one device {vs['one device']:.3f}")


if __name__ == "__main__":
    main()
