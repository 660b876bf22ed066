"""``dew bench``: compare layouts, and the shard_map engine against GSPMD, on one machine.

    dew bench                                  # data=8, fsdp=8, data=2,fsdp=4; shard_map, gspmd
                                               # and the one-device row
    dew bench --layouts fsdp=8 --json out.json
    dew bench --layouts tensor=8 data=2,tensor=4 fsdp=2,tensor=4 --sequence-parallel
    dew bench --layouts sequence=8 data=2,sequence=4 --sequence-schemes ring all_to_all
    dew bench --layouts expert=8 fsdp=8 --experts 8 --experts-per-token 2
    dew bench --layouts stage=4,microbatches=8 --pipeline-schedules 1f1b 1f1b_phased

The measurements and the targets are ``dew.benchmark``'s; this module only reads flags and prints.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from dew.cli.flags import (
    SEQUENCE_SCHEME_HELP,
    add_device_flag,
    add_min_shard_flag,
    add_model_flags,
    add_moe_flags,
    add_seed_flag,
    add_sequence_parallel_flag,
    engine_names,
    moe_config,
    sequence_scheme_names,
)

DEFAULT_LAYOUTS = ("data=8", "fsdp=8", "data=2,fsdp=4")


def add_parser(commands) -> argparse.ArgumentParser:
    """Adds ``bench`` to the ``dew`` command's subparsers."""
    parser = commands.add_parser(
        "bench",
        help="compare layouts and the GSPMD baseline side by side",
        description="Trains the same model in every layout asked, with the shard_map engine and "
        "the GSPMD baseline, taking turns, and prints step time, compile time, memory and wire "
        "bytes per device, the ratio shard_map / GSPMD of each layout (of each sequence scheme, "
        "on a sequence axis), and the targets of docs/benchmarks.md.",
    )
    parser.add_argument(
        "--layouts",
        nargs="+",
        default=list(DEFAULT_LAYOUTS),
        metavar="MESH",
        help="mesh axis sizes per layout, e.g. data=8 fsdp=8 data=2,fsdp=4 (default)",
    )
    parser.add_argument(
        "--engines",
        nargs="+",
        default=["shard_map", "gspmd"],
        choices=engine_names(),
        help="step engines per layout (default: shard_map gspmd)",
    )
    parser.add_argument(
        "--no-one-device",
        dest="one_device",
        action="store_false",
        help="skip the one-device row (the same model and global batch on one device)",
    )
    add_device_flag(parser)
    from dew.benchmark import ModelSize

    size = ModelSize()
    add_model_flags(
        parser,
        batch=size.batch,
        seq_len=size.seq_len,
        layers=size.layers,
        width=size.width,
        heads=size.heads,
    )
    add_moe_flags(parser)
    parser.add_argument(
        "--steps", type=int, default=1, help="steps each contestant runs per turn (default 1)"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed rounds; the step time is the median (default 3)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed rounds before them (default 1: a step's first run is slower)",
    )
    from dew.layout import Layout

    add_min_shard_flag(parser, default=Layout().min_shard)
    add_sequence_parallel_flag(parser)
    parser.add_argument(
        "--sequence-schemes",
        nargs="+",
        default=["ring"],
        choices=sequence_scheme_names(),
        metavar="SCHEME",
        help="on each layout with sequence > 1, one shard_map contestant per scheme, side by side "
        "(default: ring; the GSPMD baseline runs once per layout); " + SEQUENCE_SCHEME_HELP,
    )
    from dew.parallel.pipeline import SCHEDULES

    parser.add_argument(
        "--pipeline-schedules",
        nargs="+",
        default=["1f1b"],
        choices=list(SCHEDULES),
        metavar="SCHEDULE",
        help="on each layout with stage > 1 (e.g. stage=4,microbatches=8), one shard_map "
        "contestant per schedule, side by side, each timed against the same pipeline at twice "
        "the microbatches and batch for its measured bubble (default: 1f1b; choices: "
        f"{', '.join(SCHEDULES)})",
    )
    parser.add_argument(
        "--depth-check",
        type=int,
        default=16,
        metavar="LAYERS",
        help="also compare the compile time of a LAYERS-layer model with --layers "
        "(default 16; 0 skips it)",
    )
    add_seed_flag(parser, "the initial weights and the random batch")
    parser.add_argument(
        "--json",
        default=None,
        metavar="FILE",
        help="write one object per layout and engine (per sequence scheme and pipeline schedule "
        "too, for shard_map on a sequence or stage axis; and the one-device row) to FILE",
    )
    parser.set_defaults(run=run)
    return parser


def _check_json_target(path: str | None) -> Path | None:
    if path is None:
        return None
    target = Path(path)
    if not target.parent.is_dir():
        raise FileNotFoundError(f"--json {path}: the folder {str(target.parent)!r} does not exist")
    if target.is_dir():
        raise ValueError(f"--json {path} is a folder; give a file name")
    return target


def _write_json(target: Path, objects: list) -> None:
    # Written beside the target and renamed over it, so an old file is never left half-replaced.
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(objects, f, indent=2)
            f.write("\n")
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise


def run(args) -> int:
    import jax

    from dew import benchmark
    from dew.mesh import MeshSpec

    json_target = _check_json_target(args.json)
    if args.depth_check < 0:
        raise ValueError(
            f"--depth-check must be 0 (skip) or a number of layers, got {args.depth_check}"
        )
    size = benchmark.ModelSize(
        layers=args.layers,
        width=args.width,
        heads=args.heads,
        seq_len=args.seq_len,
        batch=args.batch,
        moe=moe_config(args),
    )
    specs = [MeshSpec.parse(text) for text in args.layouts]
    schemes = (
        f"sequence schemes {' '.join(args.sequence_schemes)}, "
        if any(spec.sequence > 1 for spec in specs)
        else ""
    )
    if any(spec.stage > 1 for spec in specs):
        schemes += f"pipeline schedules {' '.join(args.pipeline_schedules)}, "
    print(
        f"dew bench: {size.layers} layers, width {size.width}, {size.heads} heads, "
        + "".join(f"{name} {value}, " for name, value in size.moe)
        + f"batch {size.batch} x {size.seq_len} tokens, min_shard {args.min_shard}, "
        f"sequence_parallel {args.sequence_parallel}, {schemes}"
        f"on {jax.device_count()} {jax.devices()[0].platform} devices; "
        f"{args.repeats} timed rounds of {args.steps} step(s)"
        + (f" after {args.warmup} warm-up round(s)" if args.warmup else ""),
        flush=True,
    )
    results = benchmark.compare(
        size,
        specs,
        args.engines,
        one_device=args.one_device,
        steps=args.steps,
        repeats=args.repeats,
        warmup=args.warmup,
        min_shard=args.min_shard,
        seed=args.seed,
        sequence_parallel=args.sequence_parallel,
        sequence_schemes=args.sequence_schemes,
        pipeline_schedules=args.pipeline_schedules,
        log=lambda line: print("  " + line, flush=True),
    )
    depth = None
    if args.depth_check:
        # The fully sharded layout if one was asked (its gathers sit in the layer scan), else the
        # first.
        spec = next((s for s in specs if s.fsdp > 1 and s.model_devices == s.fsdp), specs[0])
        depth = benchmark.compile_depth(
            size,
            spec,
            args.depth_check,
            min_shard=args.min_shard,
            seed=args.seed,
            sequence_parallel=args.sequence_parallel,
            sequence_scheme=args.sequence_schemes[0],
        )
    print()
    print(benchmark.table(results))
    if depth is not None:
        print()
        print(
            f"compile time, {depth.engine} on {depth.layout}: {depth.shallow_layers} layers "
            f"{depth.shallow_s:.2f} s, {depth.deep_layers} layers {depth.deep_s:.2f} s "
            f"(ratio {depth.ratio:.2f})"
        )
    found = benchmark.targets(results, depth)
    if found:
        print()
        print(benchmark.targets_table(found))
    if json_target is not None:
        _write_json(json_target, [r.to_json() for r in results])
        print(f"\nwrote {json_target}")
    return 0
