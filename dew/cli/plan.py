"""``dew plan``: compile the real step for a TPU slice you don't have, one row per layout.

    dew plan --target v5e-8 --model llama-3.2-1b --mesh fsdp=8
    dew plan --target v5p-64 --model llama-3.1-8b --mesh fsdp=32 data=2,fsdp=16 --engines \
        shard_map gspmd
    dew plan --target v5e-8 --model gpt2-small --search --max-layouts 4 --json plan.json
    dew plan --target v5e-1 --model gpt2-small --batch 20 --seq-len 1024 --remat auto

Needs ``libtpu`` (``pip install -e '.[tpu]'``); runs on a machine with no TPU. The compiling and
reading are ``dew.planning``'s; this module reads flags and prints.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from dew.cli.flags import (
    DATA,
    DEVICES,
    LORA,
    MODEL,
    PRECISION,
    add_accumulation_flag,
    add_fsdp_scheme_flag,
    add_gradient_sum_flag,
    add_mesh_flag,
    add_min_shard_flag,
    add_pipeline_schedule_flag,
    add_quantize_flag,
    add_sequence_parallel_flag,
    add_sequence_scheme_flag,
    add_tensor_scheme_flag,
    check_counts,
    engine_names,
    in_flags,
    step_option_variants,
    topics,
)
from dew.cli.lora_flags import add_lora_flags
from dew.cli.model_flags import (
    EXAMPLE_SIZES,
    add_model_flags,
    add_moe_flags,
    model_variants,
    sizes_text,
)

# dew plan --help's heading of its own, beside dew.cli.flags' topics.
SEARCH = "search and report"

# dew plan's sizes: a batch and a length at which a real model's step is a realistic question.
DEFAULT_BATCH = 16
DEFAULT_SEQ_LEN = 512


def add_parser(commands) -> argparse.ArgumentParser:
    """Adds ``plan`` to the ``dew`` command's subparsers."""
    parser = commands.add_parser(
        "plan",
        help="compile the training step for a TPU slice you don't have (needs libtpu, no TPU): "
        "memory, wire bytes and fit per layout; --search finds the layouts that fit",
        description="Compiles the training step for a TPU slice (needs libtpu: pip install "
        "-e '.[tpu]'; no TPU needed) in each layout asked and prints, per device: the state, "
        "temporary and total memory, whether it fits the chip, wire bytes and collective counts "
        "per step (from the compiled HLO), and the compile time.",
    )
    groups = topics(parser, DEVICES, MODEL, LORA, DATA, PRECISION, SEARCH)
    devices, precision, search = groups[DEVICES], groups[PRECISION], groups[SEARCH]
    devices.add_argument(
        "--target",
        required=True,
        help="a Cloud TPU type (v5e-8, v5litepod-16, v5p-64, v6e-256, v4-32) or a topology "
        "(v5p:4x4x4); in v4-N and v5p-N, N counts TensorCores (two per chip)",
    )
    add_mesh_flag(devices, several=True)
    devices.add_argument(
        "--engines",
        nargs="+",
        default=["shard_map"],
        choices=engine_names(),
        help="step engines per layout (default shard_map; add gspmd for the pinned baseline)",
    )
    add_min_shard_flag(devices)
    add_sequence_parallel_flag(devices)
    add_sequence_scheme_flag(devices)
    add_pipeline_schedule_flag(devices)
    add_fsdp_scheme_flag(devices, several=True)
    add_tensor_scheme_flag(devices, several=True)
    # Several recompute policies: one row each, so a user picks by the memory each costs.
    add_model_flags(
        groups[MODEL],
        **{**EXAMPLE_SIZES, "batch": DEFAULT_BATCH, "seq_len": DEFAULT_SEQ_LEN},
        several=("remat",),
        data=groups[DATA],
        precision=precision,
    )
    add_moe_flags(groups[MODEL])
    add_lora_flags(groups[LORA])
    add_gradient_sum_flag(precision, several=True)
    add_quantize_flag(precision)
    add_accumulation_flag(precision)
    precision.add_argument(
        "--moments-dtype",
        default=None,
        choices=("float32", "bfloat16"),
        help="the AdamW moments' dtype, as dew train's flag (default float32); with "
        "--param-dtype bfloat16 the state is 6 bytes a weight instead of 12. With --search and "
        "neither flag, the search tries float32 weights and moments, then both in bfloat16",
    )
    search.add_argument(
        "--search",
        action="store_true",
        help="enumerate every layout of the six axes the model and slice allow and compile the "
        "most promising (see --max-layouts), or with --mesh only the layouts given; rank those "
        "that fit by exposed wire bytes, then "
        "wire bytes. Per layout it also chooses the recompute policy (without --remat: the "
        "least recomputation that fits), the fsdp and tensor schemes (with --fsdp-scheme or "
        "--tensor-scheme auto: each that can run, the least exposed that fits) and the "
        "gradient sums' dtype (without "
        "--gradient-sum-dtype: float32, then bfloat16 where nothing fits)",
    )
    search.add_argument(
        "--max-layouts",
        type=int,
        default=4,
        metavar="N",
        help="with --search: compile layouts whose state fits the chip, fewest traced wire bytes "
        "first, until N of them fit (at most 4 N compiles; default 4)",
    )
    search.add_argument("--json", default=None, metavar="FILE", help="write the rows to FILE")
    parser.set_defaults(run=run, setup=setup)
    return parser


def _in_flags(row):
    """``row`` with its error said with the flags (``dew.cli.flags.in_flags``) where the library's
    message names none: ``--heads 2 does not split over tensor 8``, not ``num_heads``."""
    if row.error is None or "--" in row.error:
        return row
    return dataclasses.replace(row, error=in_flags(row.error))


def setup() -> None:
    """Before JAX starts: one CPU device for the host side, and libtpu told it only compiles."""
    from dew.targets import compile_only_environment
    from dew.training.runtime import prepare_process

    prepare_process(cpu_devices=1)
    compile_only_environment()


def _objectives(args) -> list:
    """The objective of ``args``' model, one per ``--remat`` policy given (one: the model's
    own policy, when none is; ``auto`` with ``--search``, which then chooses it)."""
    from dew import models
    from dew.objectives.lm import LMObjective

    config, variants = model_variants(args)
    if args.search and not args.remat:
        config["remat"] = "auto"
    return [
        LMObjective(models.build("causal_transformer", **config, **variant), args.seq_len)
        for variant in variants
    ]


def _objective(args):
    """The objective of ``args``' model, of its first ``--remat`` policy."""
    return _objectives(args)[0]


def _count(n: int) -> str:
    """``1235814400`` -> ``"1.24B"``."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def _header(args, target, objective) -> str:
    from dew.planning import weight_count

    model = objective.model
    remats = " ".join(args.remat or [model.remat])  # "auto": chosen per layout
    config = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)}
    return (
        f"dew plan: {target.describe()}\n"
        f"  model {sizes_text({**config, 'remat': remats}, args)}; "
        f"MLP {model.hidden}, {_count(weight_count(model))} weights, AdamW"
    )


def option_variants(args) -> list[tuple]:
    """``(StepOptions, engines)`` for each combination of the ``--fsdp-scheme``,
    ``--gradient-sum-dtype`` and ``--tensor-scheme`` values given, a step of its own each, in
    order. The GSPMD baseline takes none of them: it runs once a layout, beside the first."""
    out = []
    for k, options in enumerate(step_option_variants(args)):
        engines = args.engines if k == 0 else [e for e in args.engines if e != "gspmd"]
        if engines:
            out.append((options, engines))
    return out


def run(args) -> int:
    from dew import planning
    from dew.layout import Layout
    from dew.mesh import MeshSpec
    from dew.targets import target

    tpu = target(args.target)
    if not args.search and args.mesh is None:
        if tpu.chips > 1:
            raise ValueError("which layouts? give --mesh LAYOUT... (one or more) or --search")
        args.mesh = ["data=1"]  # one chip: its one layout
    if args.max_layouts < 1:
        raise ValueError(f"--max-layouts must be at least 1, got {args.max_layouts}")
    check_counts(args, "accumulation")  # by its flag, not in a row as the step's "accumulation"
    json_path = Path(args.json) if args.json else None
    if json_path is not None and not json_path.parent.is_dir():
        raise FileNotFoundError(
            f"--json {args.json}: the folder {str(json_path.parent)!r} does not exist"
        )
    objectives = _objectives(args)
    variants = option_variants(args)
    print(_header(args, tpu, objectives[0]), flush=True)
    from dew.training.optimizer import adamw

    settings = dict(
        layout=Layout(min_shard=args.min_shard),
        accumulation=args.accumulation,
        optimizer=adamw(1e-3, moments_dtype=args.moments_dtype or "float32"),
    )
    if args.search and args.moments_dtype is None and args.param_dtype is None:
        settings["states"] = planning.STATE_ORDER  # the state's precision, chosen per layout

    def show(row):
        state = f", state {row.choices['state']}" if "state" in row.choices else ""
        what = f"{row.mesh} ({row.engine}, remat {row.remat}{state}" + (
            f", {row.options})" if row.options else ")"
        )
        if row.error is not None:
            print(f"  {what}: refused: {_in_flags(row).error}", flush=True)
            return
        if row.refused is not None:
            print(
                f"  {what}: the TPU compiler refused it after {row.compile_s:.0f} s: it needs "
                f"{planning.format_bytes(row.total_bytes)} of the "
                f"{planning.format_bytes(row.usable_bytes)} it lets a program use (the chip "
                f"has {planning.format_bytes(row.hbm_bytes)}), {row.verdict}",
                flush=True,
            )
            return
        heap = "-" if row.temp_bytes is None else planning.format_bytes(row.temp_bytes)
        exposed = "" if row.exposed_s is None else f" ({planning.seconds_text(row.exposed_s)})"
        spare = (
            f" with {planning.format_bytes(row.spare_bytes)} to spare"
            if row.spare_bytes is not None
            else ""
        )
        print(
            f"  {what}: compiled in {row.compile_s:.0f} s; total "
            f"{planning.format_bytes(row.total_bytes)} per device (temporaries: the compiler's "
            f"heap {heap}, memory_analysis {planning.format_bytes(row.analysis_temp_bytes)}), "
            f"{row.verdict}{spare} of {planning.format_bytes(row.limit_bytes)}; "
            f"{planning.format_bytes(row.wire_bytes)} on the wire per step, "
            f"{planning.format_bytes(row.exposed_wire_bytes)} of it exposed{exposed}",
            flush=True,
        )

    def chose(rows):
        print(f"  chose {planning.choice_text(rows)}", flush=True)

    def chose_scheme(choice):
        print(f"  chose {choice.reason()}", flush=True)

    # The gradient sums' dtype is a choice too unless --gradient-sum-dtype names one.
    sums = planning.SUM_DTYPE_ORDER if args.gradient_sum_dtype == [None] else None
    if args.search and args.mesh is not None:
        # The layouts given, each with its own choices searched (remat, state, schemes, sums).
        rows = []
        for objective in objectives:
            for options, engines in variants:
                for text in args.mesh:
                    rows += planning.plan_schemes(
                        tpu,
                        objective,
                        MeshSpec.parse(text),
                        args.batch,
                        options=options,
                        engines=engines,
                        sum_dtypes=sums,
                        on_scheme=chose_scheme,
                        on_row=show,
                        on_choice=chose,
                        **settings,
                    )
    elif args.search:

        def listed(candidates):
            most = planning.SEARCH_COMPILES_PER_LAYOUT * args.max_layouts
            print(
                f"  {len(candidates)} layouts whose state fits; compiling in this order until "
                f"{args.max_layouts} fit (at most {min(len(candidates), most)}): "
                + ", ".join(planning.mesh_text(c.mesh) for c in candidates[:most]),
                flush=True,
            )

        rows = []
        for objective in objectives:
            for options, engines in variants:
                rows += planning.search(
                    tpu,
                    objective,
                    args.batch,
                    max_layouts=args.max_layouts,
                    engines=engines,
                    options=options,
                    on_row=show,
                    on_candidates=listed,
                    on_choice=chose,
                    on_scheme=chose_scheme,
                    sum_dtypes=sums,
                    **settings,
                )
    else:
        specs = [MeshSpec.parse(text) for text in args.mesh]
        rows = []
        for objective in objectives:
            for options, engines in variants:
                rows += planning.plan(
                    tpu,
                    objective,
                    specs,
                    args.batch,
                    engines=engines,
                    options=options,
                    on_row=show,
                    on_choice=chose,
                    **settings,
                )
    print()
    print(planning.format_table([_in_flags(row) for row in rows]))
    if args.search:
        print(planning.search_summary(rows))
    if json_path is not None:
        json_path.write_text(json.dumps([r.to_json() for r in rows], indent=2) + "\n")
        print(f"\nwrote {json_path}")
    return 0
