"""``dew bench``: compare layouts, and the shard_map engine against GSPMD, on one machine.

    dew bench                                  # data=8, fsdp=8, data=2,fsdp=4; shard_map, gspmd
                                               # and the one-device row
    dew bench --mesh fsdp=8 --json out.json
    dew bench --mesh tensor=8 data=2,tensor=4 fsdp=2,tensor=4 --sequence-parallel
    dew bench --mesh sequence=8 data=2,sequence=4 --sequence-scheme ring all_to_all
    dew bench --mesh expert=8 fsdp=8 --experts 8 --experts-per-token 2
    dew bench --mesh stage=4,microbatches=8 --pipeline-schedule 1f1b 1f1b_phased
    dew bench --check                          # exit 1 when a target is MISSED
    dew bench --cpu-devices 0 --model gpt2-small --mesh data=1 --attention cudnn pallas \
        --remat full dots                      # one GPU: four models, each with its MFU

The measurements and the targets are ``dew.benchmark``'s; this module only reads flags and prints.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dew.cli import choices
from dew.cli.flags import (
    DATA,
    DEVICES,
    LORA,
    MODEL,
    PRECISION,
    add_device_flag,
    add_mesh_flag,
    add_min_shard_flag,
    add_pipeline_schedule_flag,
    add_seed_flag,
    add_sequence_parallel_flag,
    add_sequence_scheme_flag,
    check_counts,
    default_layouts,
    engine_names,
    topics,
)
from dew.cli.lora_flags import add_lora_flags
from dew.cli.model_flags import (
    add_model_flags,
    add_moe_flags,
    model_variants,
    moe_config,
    sizes_text,
)

# dew bench --help's headings of its own, beside dew.cli.flags' topics.
TIMING = "contestants and timing"
REPORT = "report"

# ``dew bench --check``'s exit status when a target is missed (2 is a refused input, as for every
# ``dew`` command).
TARGET_MISSED = 1


def add_parser(commands) -> argparse.ArgumentParser:
    """Adds ``bench`` to the ``dew`` command's subparsers."""
    parser = commands.add_parser(
        "bench",
        help="time the training step of a --model preset or the example decoder in several "
        "layouts (and dtypes, remat policies, attention kernels), shard_map beside the GSPMD "
        "baseline: step time, MFU, memory, wire bytes",
        description="Trains the same model in every layout asked, with the shard_map engine and "
        "the GSPMD baseline, taking turns (only the contestant whose turn it is holds device "
        "memory; one that does not fit alone gets a one-line row with the memory it needs and "
        "the device's), and prints step time, compile time, memory and wire "
        "bytes per device, the ratio shard_map / GSPMD of each layout (of each sequence scheme "
        "and pipeline schedule, on a sequence or stage axis), and the targets of "
        "docs/benchmarks.md. --sequence-parallel, --sequence-scheme and --pipeline-schedule "
        "apply to the shard_map step on the layouts with a tensor, sequence or stage axis.",
    )
    groups = topics(parser, DEVICES, MODEL, LORA, DATA, PRECISION, TIMING, REPORT)
    devices, timing, report = groups[DEVICES], groups[TIMING], groups[REPORT]
    add_mesh_flag(devices, several=True)
    add_device_flag(devices)
    add_min_shard_flag(devices)
    add_sequence_parallel_flag(devices)
    add_sequence_scheme_flag(devices, several=True)
    add_pipeline_schedule_flag(devices, several=True)
    add_model_flags(
        groups[MODEL],
        **choices.BENCH_SIZES,  # dew.benchmark.ModelSize()'s
        several=("dtype", "remat", "attention", "loss_chunk"),
        data=groups[DATA],
        precision=groups[PRECISION],
    )
    add_moe_flags(groups[MODEL])
    add_seed_flag(groups[MODEL], "the initial weights and the random batch")
    add_lora_flags(groups[LORA])
    timing.add_argument(
        "--engines",
        nargs="+",
        default=["shard_map", "gspmd"],
        choices=engine_names(),
        help="step engines per layout (default: shard_map gspmd)",
    )
    timing.add_argument(
        "--no-one-device",
        dest="one_device",
        action="store_false",
        help="skip the one-device row (the same model and global batch on one device)",
    )
    timing.add_argument(
        "--steps", type=int, default=1, help="steps each contestant runs per turn (default 1)"
    )
    timing.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed rounds; the step time is the median (default 3)",
    )
    timing.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed rounds before them (default 1: a step's first run is slower)",
    )
    timing.add_argument(
        "--depth-check",
        type=int,
        default=16,
        metavar="LAYERS",
        help="also compare the compile time of a LAYERS-layer model with --layers "
        "(default 16; 0 skips it)",
    )
    report.add_argument(
        "--json",
        default=None,
        metavar="FILE",
        help="write one object per layout and engine (per sequence scheme and pipeline schedule "
        "too, for shard_map on a sequence or stage axis; and the one-device row) to FILE",
    )
    report.add_argument(
        "--check",
        action="store_true",
        help=f"exit with status {TARGET_MISSED} when a target (not a stretch goal) is MISSED, "
        "naming each; 0 when every target is met or none applies",
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


def _header(args, config, specs, models) -> str:
    import jax

    from dew.benchmark.measure import variant_text

    variants = ""
    if len(models) > 1:
        variants += "models " + " | ".join(variant_text(m) for m in models) + ", "
    if any(spec.sequence > 1 for spec in specs):
        variants += f"sequence schemes {' '.join(args.sequence_scheme)}, "
    if any(spec.stage > 1 for spec in specs):
        variants += f"pipeline schedules {' '.join(args.pipeline_schedule)}, "
    # The contestants' own choices where flags gave them (model_variants leaves those fields out
    # of ``config``, which would show the model's defaults): each field's values, "|" between.
    chosen = {field: "|".join(dict.fromkeys(str(m[field]) for m in models)) for field in models[0]}
    return (
        f"dew bench: {sizes_text({**config, **chosen}, args)}, "
        + "".join(f"{name} {value}, " for name, value in sorted(moe_config(args).items()))
        + f"min_shard {args.min_shard}, "
        f"sequence_parallel {args.sequence_parallel}, {variants}"
        f"on {jax.device_count()} {jax.devices()[0].platform} devices; "
        f"{args.repeats} timed rounds of {args.steps} step(s)"
        + (f" after {args.warmup} warm-up round(s)" if args.warmup else "")
    )


def _depth_check(args, config, models, specs):
    """``(DepthCheck, its line)`` for ``--depth-check``; ``(None, why)`` when the deeper step
    does not fit the device (the compiler's refusal, in one line: the depth check compiles only,
    so what does not fit is refused by the compiler)."""
    import jax

    from dew import benchmark
    from dew.parallel.options import StepOptions

    # The fully sharded layout if one was asked (its gathers sit in the layer scan), else the
    # first; with the first scheme and schedule asked, where it has the axis for them.
    spec = next((s for s in specs if s.fsdp > 1 and s.model_devices == s.fsdp), specs[0])
    try:
        depth = benchmark.compile_depth(
            benchmark.ModelSize.of({**config, **models[0]}, args.batch, args.seq_len),
            spec,
            args.depth_check,
            min_shard=args.min_shard,
            seed=args.seed,
            options=StepOptions(
                args.sequence_parallel, args.sequence_scheme[0], args.pipeline_schedule[0]
            ),
        )
    except jax.errors.JaxRuntimeError as error:
        if not benchmark.out_of_memory(error):
            raise
        first = str(error).strip().splitlines()[0]
        depths = f"{config['num_layers']} and {args.depth_check} layers"
        return None, f"compile time at {depths}: not measured, the step does not fit: {first}"
    return depth, benchmark.depth_text(depth)


def run(args) -> int:
    from dew import benchmark
    from dew.checks import nonnegative_int
    from dew.mesh import MeshSpec

    json_target = _check_json_target(args.json)
    check_counts(args, "steps", "repeats")  # by the flags: dew.benchmark names its arguments
    nonnegative_int("--warmup", args.warmup)
    if args.depth_check < 0:
        raise ValueError(
            f"--depth-check must be 0 (skip) or a number of layers, got {args.depth_check}"
        )
    config, models = model_variants(args)
    size = benchmark.ModelSize.of(config, batch=args.batch, seq_len=args.seq_len)
    import jax

    specs = [MeshSpec.parse(text) for text in args.mesh or default_layouts(jax.device_count())]
    # On one device the one-device row is the data=1 layout's GSPMD row again.
    one_device = args.one_device and jax.device_count() > 1
    print(_header(args, config, specs, models), flush=True)
    results = benchmark.compare(
        size,
        specs,
        args.engines,
        one_device=one_device,
        steps=args.steps,
        repeats=args.repeats,
        warmup=args.warmup,
        min_shard=args.min_shard,
        seed=args.seed,
        sequence_parallel=args.sequence_parallel,
        sequence_schemes=args.sequence_scheme,
        pipeline_schedules=args.pipeline_schedule,
        variants=models,
        log=lambda line: print("  " + line, flush=True),
    )
    depth, depth_line = None, ""
    if args.depth_check:
        depth, depth_line = _depth_check(args, config, models, specs)
    print()
    print(benchmark.table(results))
    if depth_line:
        print()
        print(depth_line)
    found = benchmark.targets(results, depth)
    if found:
        print()
        print(benchmark.targets_table(found))
    if json_target is not None:
        benchmark.write_json(json_target, results)
        print(f"\nwrote {json_target}")
    missed = benchmark.missed(found)
    if args.check and missed:
        sys.stdout.flush()
        print(f"dew bench --check: {len(missed)} target(s) MISSED:", file=sys.stderr)
        for t in missed:
            print(f"  {t.name}: {t.measured:.3f} > {t.limit:g}", file=sys.stderr)
        return TARGET_MISSED
    return 0
