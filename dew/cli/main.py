"""The ``dew`` command.

    dew train        train a --model preset, an --init-from model (a Hugging Face Llama folder or
                     a Dew checkpoint) or the example decoder on your --data (default: the
                     example corpus); every weight, or LoRA adapters with --lora-rank
    dew collectives  print the collectives of one training step of that model on a --mesh
    dew bench        time the step in several layouts (and dtypes, remat policies, attention
                     kernels), shard_map beside the GSPMD baseline
    dew plan         compile the step for a TPU slice you don't have: memory, bytes, fit
    dew launch       start the processes of one multi-process run, here or over ssh
    dew tokenize     turn text files, .jsonl or .parquet into a token folder
    dew plot         draw the curves of metrics files (loss, val loss, tokens/s, MFU)
    dew convert      a Hugging Face Llama folder to a Dew checkpoint, or back (--to hf); a LoRA
                     run's adapters to a PEFT folder (--to peft)
    dew generate     complete prompts with a run, a checkpoint or a Hugging Face folder, decoded
                     with a KV cache on the devices
    dew eval         run lm-eval tasks on such a model (the .[eval] extra)

``dew COMMAND --help`` lists a command's flags under a heading per topic (``dew.cli.flags.topics``:
devices and mesh, model, LoRA, data, precision and memory, ...).

JAX is configured (device count, platform) before anything asks it for a device, so this module
imports nothing of Dew at the top.

Layout: the parser (``_common``, the flags ``dew train`` and ``dew collectives`` share, by topic,
then ``build_parser``, which adds every subcommand); the helpers both commands use (``_example``,
``_trainer``, ``_print_header``); ``dew train``'s checks of its own flags (``_check_train_flags``,
``_check_validation_windows``); the two commands (``train_command``, ``collectives_command``); and
the dispatch (``user_errors``, ``one_line``, ``main``, which says the library's argument names as
the flags: ``dew.cli.flags.in_flags``). What ``dew train`` checks against a run it resumes is
``dew.cli.resume``'s, and its memory check before compiling ``dew.cli.preflight``'s. It is one
module (past 450 lines, most of them ``build_parser``'s flag definitions) because the two commands
share the ``Trainer``'s flags and these helpers, beside the dispatch of every subcommand; the
others live in modules of their own.
"""

from __future__ import annotations

import argparse
import sys

from dew.cli import bench, convert, evaluate, generate, launch, plan, plot, tokenize
from dew.cli.flags import (
    CHECKPOINTS,
    DATA,
    DEVICES,
    LOGGING,
    LORA,
    MODEL,
    OPTIMIZER,
    PRECISION,
    Parser,
    add_accumulation_flag,
    add_device_flag,
    add_fsdp_scheme_flag,
    add_gradient_sum_flag,
    add_mesh_flag,
    add_min_shard_flag,
    add_pipeline_schedule_flag,
    add_quantize_flag,
    add_seed_flag,
    add_sequence_parallel_flag,
    add_sequence_scheme_flag,
    add_tensor_scheme_flag,
    check_counts,
    default_mesh,
    engine_names,
    in_flags,
    step_options,
    topics,
)
from dew.cli.lora_flags import add_lora_flags
from dew.cli.model_flags import (
    EXAMPLE_SIZES,
    add_model_flags,
    add_moe_flags,
    model_config,
    moe_config,
    sizes_text,
)
from dew.cli.optimizer_flags import add_optimizer_flags, optimizer_from
from dew.targets import MissingExtra


def _common(groups: dict) -> None:
    """The flags ``dew train`` and ``dew collectives`` share, each under its topic in ``groups``
    (``dew.cli.flags.topics``)."""
    devices, model, precision = groups[DEVICES], groups[MODEL], groups[PRECISION]
    add_mesh_flag(devices)
    add_device_flag(devices)
    add_min_shard_flag(devices)
    add_sequence_parallel_flag(devices)
    add_sequence_scheme_flag(devices)
    add_pipeline_schedule_flag(devices)
    add_fsdp_scheme_flag(devices)
    add_tensor_scheme_flag(devices)
    add_model_flags(model, **EXAMPLE_SIZES, data=groups[DATA], precision=precision)
    add_moe_flags(model)
    add_lora_flags(groups[LORA])
    add_gradient_sum_flag(precision)
    add_quantize_flag(precision)
    add_accumulation_flag(precision)


# What each command does, for dew --help (and the first line of its own --help).
TRAIN_HELP = (
    "train a --model preset, an --init-from model (a Hugging Face Llama folder or a Dew "
    "checkpoint) or the example decoder on your --data (default: the example corpus), every "
    "weight or LoRA adapters (--lora-rank); a rerun resumes from --run-dir"
)
COLLECTIVES_HELP = (
    "print the collectives of one training step of the model the flags build, on a --mesh"
)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="dew",
        description="Dew: train one model across many devices.",
        epilog="dew COMMAND --help lists a command's flags by topic.",
    )
    commands = parser.add_subparsers(
        title="commands", dest="command", required=True, metavar="COMMAND"
    )

    train = commands.add_parser(
        "train", help=TRAIN_HELP, description=TRAIN_HELP[0].upper() + TRAIN_HELP[1:] + "."
    )
    groups = topics(train, DEVICES, MODEL, LORA, DATA, PRECISION, OPTIMIZER, CHECKPOINTS, LOGGING)
    groups[MODEL].title = "model and --init-from"
    model, data, logging = groups[MODEL], groups[DATA], groups[LOGGING]
    # --init-from first: the model's other flags are the ones it replaces.
    model.add_argument(
        "--init-from",
        default=None,
        metavar="PATH",
        help="start from the weights (and model) of a Hugging Face Llama folder or a Dew "
        "checkpoint directory, instead of --model and --seed: a size flag that disagrees with "
        "its model is an error, and --seq-len may not pass its context (see docs/hf.md)",
    )
    model.add_argument(
        "--extend-context",
        action="store_true",
        help="with --init-from: a --seq-len above the model's context lengthens the context to "
        "it (max_seq_len, and max_position_embeddings in an export); the rotary frequencies "
        "stay as they are",
    )
    _common(groups)
    add_seed_flag(model, "the initial weights")
    data.add_argument(
        "--data",
        default=None,
        help="a token folder, e.g. from dew tokenize; the example decoder takes its vocabulary "
        "from the folder's meta.json (default: write the example corpus into RUN_DIR/corpus)",
    )
    data.add_argument(
        "--documents",
        default="auto",
        choices=("auto", "separate", "joined"),
        help="how documents packed in a row see each other: separate (attention, rotary "
        "positions and the loss stay inside each document; needs a folder with document "
        "starts, as dew tokenize writes), joined (one stream, documents joined by the "
        "end-of-text id), auto (default: separate for prompt/completion and chat data packed by "
        "dew tokenize --jsonl-fields, joined otherwise); docs/data.md",
    )
    optimizer = groups[OPTIMIZER]
    optimizer.add_argument(
        "--steps", type=int, default=20, help="train until this step (default 20)"
    )
    add_optimizer_flags(optimizer)
    checkpoints = groups[CHECKPOINTS]
    checkpoints.add_argument(
        "--run-dir",
        default="runs/dew-train",
        help="checkpoints go to RUN_DIR/checkpoints; a rerun resumes from them",
    )
    checkpoints.add_argument(
        "--checkpoint-every",
        type=int,
        default=None,
        metavar="N",
        help="save every N steps (default: only at the end)",
    )
    logging.add_argument(
        "--log-every",
        type=int,
        default=10,
        metavar="N",
        help="print the loss, step time, tokens/s, MFU (where the device's peak is known; "
        "PaLM's count and causal attention halved), the gradients' norm and the learning rate "
        "every N steps, the speed that of the steps since the line before (default 10)",
    )
    logging.add_argument(
        "--metrics",
        default=None,
        metavar="FILE",
        help="append one JSON line per step to FILE: step, loss, step_time_s, tokens_per_s, "
        "model_tflops_per_device and mfu (PaLM's count), model_tflops_per_device_causal and "
        "mfu_causal (causal attention halved, MaxText's), grad_norm, lr, an MoE model's router "
        "statistics, with --eval-every val_loss and val_weights, and with --eval-tasks "
        "eval/TASK/METRIC and eval_time_s (docs/metrics.md)",
    )
    logging.add_argument(
        "--tensorboard",
        default=None,
        metavar="DIR",
        help="write every step's metrics as TensorBoard scalars to event files in DIR "
        "(pip install -e '.[tensorboard]'; view with tensorboard --logdir DIR)",
    )
    logging.add_argument(
        "--eval-every",
        type=int,
        default=None,
        metavar="N",
        help="print the validation loss every N steps and at the last step, and run the "
        "--eval-tasks there (default: never)",
    )
    logging.add_argument(
        "--eval-batches",
        type=int,
        default=None,
        metavar="K",
        help=f"validation batches per evaluation, from the folder's val.bin (default "
        f"{EVAL_BATCHES}; with --eval-every)",
    )
    evaluate.add_train_flags(logging)
    train.set_defaults(run=train_command)

    coll = commands.add_parser(
        "collectives",
        help=COLLECTIVES_HELP,
        description=COLLECTIVES_HELP[0].upper() + COLLECTIVES_HELP[1:] + ".",
    )
    groups = topics(coll, DEVICES, MODEL, LORA, DATA, PRECISION)
    _common(groups)
    groups[DEVICES].add_argument(
        "--engines",
        nargs="+",
        default=["shard_map"],
        choices=engine_names(),
        help="step engines, each printed in turn (default shard_map, read from the jaxpr; gspmd: "
        "the pinned GSPMD baseline, read from the compiled HLO)",
    )
    coll.set_defaults(run=collectives_command)

    bench.add_parser(commands)
    plot.add_parser(commands)
    plan.add_parser(commands)
    launch.add_parser(commands)
    tokenize.add_parser(commands)
    convert.add_parser(commands)
    generate.add_parser(commands)
    evaluate.add_parser(commands)
    return parser


def _setup_devices(cpu_devices: int | None) -> None:
    """``--cpu-devices`` (``None``: not given) set up before JAX starts: N simulated CPU devices,
    JAX's own devices for 0, and without the flag the accelerator JAX finds, or 8 simulated CPU
    devices where there is none (``dew.training.runtime.default_cpu_devices``)."""
    if cpu_devices is not None and cpu_devices < 0:
        raise ValueError(f"--cpu-devices must be >= 0, got {cpu_devices}")
    from dew.training.runtime import default_cpu_devices, prepare_process

    prepare_process(cpu_devices=default_cpu_devices(cpu_devices))


# Validation batches `dew train --eval-every` reads when --eval-batches is not given: the example
# corpus holds 3 batches of 16 rows of 33 tokens.
EVAL_BATCHES = 2


def _val_batches(args) -> int:
    """The validation batches to load: ``--eval-batches`` (or ``EVAL_BATCHES``) with
    ``--eval-every``; none without (``_check_train_flags`` has refused the values that make no
    sense: one below 1, ``--eval-batches`` without ``--eval-every``)."""
    if getattr(args, "eval_every", None) is None:
        return 0
    return EVAL_BATCHES if args.eval_batches is None else args.eval_batches


def _example(args, data_dir, model=None):
    """The example model (or ``model``, when given), objective and data of ``args``."""
    from dew import models
    from dew.data import Loading, TokenWindows
    from dew.objectives.lm import LMObjective

    if model is None:
        config = model_config(args)
        # The vocabulary from the folder's meta.json (a preset's own must hold it).
        config["vocab_size"] = tokenize.training_vocabulary(config, args.model, data_dir)
        model = models.build("causal_transformer", **config)
    data = TokenWindows(
        path=data_dir,
        seq_len=args.seq_len,
        val_batches=_val_batches(args),
        loading=Loading(workers=0, threads=1, read_buffer=2),
        documents=getattr(args, "documents", "auto"),
    ).load(batch=args.batch)
    return LMObjective(model, args.seq_len), data


def _trainer(
    args, objective, checkpoints=None, engine="shard_map", optimizer=None, seed=0, base=None
):
    import jax

    from dew import Layout, MeshSpec, Trainer
    from dew.training.optimizer import default_optimizer

    return Trainer(
        objective,
        default_optimizer() if optimizer is None else optimizer,
        key=jax.random.key(seed),
        mesh=MeshSpec.parse(default_mesh(args.mesh, jax.device_count())),
        layout=Layout(min_shard=args.min_shard),
        checkpoints=checkpoints,
        accumulation=args.accumulation,
        engine=engine,
        options=step_options(args),
        base=base,
    )


def _print_header(args, model, name=None) -> None:
    """The command's first line: the model it runs (``name``: where its weights come from, when
    not a preset), its choices and the batch."""
    import dataclasses

    config = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)}
    print(f"dew {args.command}: {sizes_text(config, args, name=name)}", flush=True)


def _example_corpus(path):
    from dew.data import write_example_corpus

    write_example_corpus(path)
    return path


def _check_train_flags(args) -> None:
    """``dew train``'s counts and their pairings, and a ``--data`` with no meta.json, refused by
    the flags' names before anything is written or compiled (the library would name its own
    arguments: ``eval_every``)."""
    from pathlib import Path

    check_counts(
        args,
        "steps",
        "batch",
        "seq_len",
        "log_every",
        "checkpoint_every",
        "eval_every",
        "eval_batches",
        "accumulation",
    )
    data = None if args.data is None else Path(args.data)
    if data is not None and not (data / "meta.json").is_file():
        what = "holds no meta.json" if data.is_dir() else "is a file" if data.exists() else ""
        raise ValueError(
            f"--data {args.data} {what or 'does not exist'}: give a token folder (train.bin, "
            "val.bin, meta.json), as dew tokenize writes"
        )
    if args.eval_batches is not None and args.eval_every is None:
        raise ValueError(
            f"--eval-batches {args.eval_batches} without --eval-every: give --eval-every N to "
            "evaluate every N steps"
        )
    evaluate.check_train_flags(args)  # --eval-tasks: its pairings, files and lm-eval


def _check_validation_windows(args, data_dir) -> None:
    """``ValueError`` naming the flags when ``--eval-every``'s batches need more validation
    windows than the token folder's ``val.bin`` holds, with the most it can give."""
    from dew.data import read_meta
    from dew.data.windows import window_count

    batches = _val_batches(args)
    windows = window_count(read_meta(data_dir).val_tokens, args.seq_len)
    if batches * args.batch <= windows:
        return
    given = f"--eval-batches {batches}" if args.eval_batches else f"the default {batches} batches"
    most = windows // args.batch
    fix = (
        f"give --eval-batches {most} or fewer"
        if most
        else f"a smaller --batch or --seq-len, or more validation text in {data_dir}"
    )
    raise ValueError(
        f"--eval-every evaluates on {given} of --batch {args.batch} rows, {batches * args.batch} "
        f"windows of --seq-len {args.seq_len}, and val.bin in {data_dir} holds {windows}: {fix}"
    )


def train_command(args) -> int:
    from pathlib import Path

    from dew.checkpoints import Checkpoints
    from dew.cli import preflight, resume

    _check_train_flags(args)
    run_dir = Path(args.run_dir)
    model = None
    if args.init_from:  # its model is the model: read (and checked) before any data is written
        _, model = convert.init_source(args.init_from)
        convert.check_size_flags(args, model, args.init_from)
        moe_config(args)  # the MoE flags' own check (one without --experts)
    elif args.extend_context:
        raise ValueError("--extend-context lengthens the context of an --init-from model")
    data_dir = args.data or _example_corpus(run_dir / "corpus")
    _check_validation_windows(args, data_dir)
    if model is not None:
        from dew.data import read_meta

        vocab = read_meta(data_dir).vocab_size
        model = convert.init_model(args, model, args.init_from, vocab)
    objective, data = _example(args, data_dir, model)
    _print_header(args, objective.model, name=args.init_from)
    optimizer = optimizer_from(args)
    # With --lora-rank, --init-from names the frozen base: read where the state is placed, named
    # (not copied) in every checkpoint (dew.training.lora_base).
    lora_base = args.init_from if objective.model.lora is not None else None
    trainer = _trainer(
        args,
        objective,
        Checkpoints(run_dir / "checkpoints"),
        optimizer=optimizer,
        seed=args.seed,
        base=lora_base,
    )
    resume.check(trainer, data, run_dir)
    # lm-eval's tasks: the tokenizer, end-of-text id and layout checked before compiling.
    tasks = evaluate.train_tasks(args, data_dir, run_dir, trainer)
    progress = None
    if (trainer.checkpoints.latest or 0) < args.steps:  # a finished run has nothing to compile
        progress = preflight.check_and_compile(trainer, data, args)
        if tasks is not None:
            evaluate.record_tasks(run_dir, tasks, trainer.checkpoints.latest or 0)
    if lora_base:
        convert.keep_carried(
            trainer.checkpoints.directory, convert.source_carried(lora_base), replace=False
        )
    elif args.init_from:
        convert.init_from(trainer, args.init_from)
    # The tokenizer the token folder was written with, for dew convert --to hf to copy.
    convert.keep_tokenizer(trainer.checkpoints.directory, data_dir)
    from dew.checkpoints.errors import CheckpointMismatchError
    from dew.data.windows import DataPositionMismatch
    from dew.training.tracking import TensorBoard

    try:
        state = trainer.fit(
            data,
            steps=args.steps,
            log_every=args.log_every,
            checkpoint_every=args.checkpoint_every,
            metrics=args.metrics,
            eval_every=args.eval_every,
            eval_batches=args.eval_batches,
            trackers=[TensorBoard(args.tensorboard)] if args.tensorboard else [],
            progress=progress,
            evaluations=[tasks] if tasks is not None else [],
        )
    except CheckpointMismatchError as error:  # said with the flags whose values differ
        saved = resume.saved_model(trainer.checkpoints)
        line = resume.mismatch(error, saved, objective.model, run_dir, args.init_from)
        raise CheckpointMismatchError(line) from None
    except DataPositionMismatch as error:
        raise ValueError(resume.position_mismatch(error.differ, run_dir)) from None
    from dew.training.preemption import INTERRUPTED_EXIT_CODE

    # SIGTERM exits from fit with 143 (dew.training.preemption); a first Ctrl-C returns early.
    return 0 if int(state.step) >= args.steps else INTERRUPTED_EXIT_CODE


def collectives_command(args) -> int:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        objective, data = _example(args, _example_corpus(f"{tmp}/corpus"))
        _print_header(args, objective.model)
        for engine in args.engines:
            trainer = _trainer(args, objective, engine=engine)
            print(
                f"Collectives of one {engine} step on {dict(trainer.mesh.shape)}, "
                f"batch {args.batch} x {args.seq_len} tokens"
                + "".join(
                    f", {name}={value}"
                    for name, value in trainer.options.in_effect(dict(trainer.mesh.shape)).items()
                )
                + ":"
            )
            print(trainer.collectives(data))
    return 0


def user_errors() -> tuple[type[BaseException], ...]:
    """The errors that are a user's mistake, not Dew's: a bad value (``ValueError``, which
    ``CheckpointMismatchError`` is too), a checkpoint that cannot be read as asked
    (``CheckpointError`` and its kinds), a path that is missing, a file where a folder is wanted,
    unreadable or taken (``OSError``), an extra not installed (``MissingExtra``)."""
    from dew.checkpoints.errors import CheckpointError

    return (ValueError, CheckpointError, OSError, MissingExtra)


def one_line(error: BaseException) -> str:
    """``error``'s message on one line (a message of several lines joined by ``"; "``)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return "; ".join(lines) or type(error).__name__


# The commands whose flags build a model and a step: a message of the library's that names no flag
# names its arguments (num_heads, Layout.min_shard), which these commands say as their flags.
MODEL_COMMANDS = ("train", "collectives", "bench", "plan")


# The commands whose compiled programs a rerun reads back from JAX's persistent cache, on an
# accelerator (dew.training.runtime.use_compilation_cache). Not plan or bench: they measure the
# compile itself (its heap, its time).
CACHED_COMMANDS = ("train", "generate", "eval")


def main(argv=None) -> int:
    """Runs one ``dew`` command. A user's mistake in any command (``user_errors``), and a step
    that does not fit the device's memory (``dew.cli.out_of_memory``), is one line on stderr,
    ``dew COMMAND: message``, and exit code 2, never a traceback; argparse's own errors (an
    unknown flag, a missing value) also exit 2, after the usage line. In the commands that build
    a model (``MODEL_COMMANDS``), a message that names no flag is said with the flags
    (``dew.cli.flags.in_flags``)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    try:
        if hasattr(args, "setup"):
            args.setup()
        elif args.command != "launch":  # launch only starts processes; each sets up its own
            _setup_devices(args.cpu_devices)
        if args.command in CACHED_COMMANDS:
            import jax

            from dew.training.runtime import use_compilation_cache

            use_compilation_cache(jax.default_backend())
        return args.run(args)
    except user_errors() as error:
        line = one_line(error)
        if args.command in MODEL_COMMANDS and "--" not in line:  # the library's own words
            line = in_flags(line)
    except Exception as error:  # XLA's out of memory is a user's batch too big, said in one line
        from dew.cli.out_of_memory import out_of_memory_line

        line = out_of_memory_line(error, argv, args)
        if line is None:
            raise
    print(f"dew {args.command}: {line}", file=sys.stderr, flush=True)
    return 2


if __name__ == "__main__":
    sys.exit(main())
