"""``dew eval``: lm-eval tasks on a trained model, on the devices (``dew.evaluation``).

    dew eval runs/sft --tasks tasks/my_task.yaml --metrics runs/sft/metrics.jsonl
    dew eval Llama-3.2-1B --tasks hellaswag --limit 100 --mesh fsdp=4,tensor=2

SOURCE is read as ``dew generate`` reads it (``dew.cli.generate.load_source``): a run directory,
a Dew checkpoint directory or a Hugging Face folder, and the tokenizer the run kept or the
folder's. lm-eval is an optional extra; without it the command says how to install it.
"""

from __future__ import annotations

import argparse
import json
import sys

from dew.cli.flags import add_device_flag, add_mesh_flag, add_min_shard_flag


def add_parser(commands) -> argparse.ArgumentParser:
    """Adds ``eval`` to the ``dew`` command's subparsers."""
    parser = commands.add_parser(
        "eval",
        help="run lm-eval tasks (local YAML files or lm-eval's own) on a trained model, on the "
        "devices (needs pip install -e '.[eval]')",
        description="Runs EleutherAI lm-evaluation-harness tasks on the model of SOURCE (a run "
        "directory of dew train, a Dew checkpoint directory or a Hugging Face folder) through "
        "Dew's own model: log-likelihoods from its forward, generation with its KV cache. A "
        "task is a task YAML file (its data local: nothing is downloaded) or an lm-eval task "
        "name. Prints each task's metrics; --metrics appends them to a metrics file beside the "
        "loss.",
    )
    parser.add_argument(
        "source", help="a run directory, a Dew checkpoint directory or a Hugging Face folder"
    )
    groups = {t: parser.add_argument_group(t) for t in ("model and checkpoint", "tasks")}
    groups["devices and mesh"] = parser.add_argument_group("devices and mesh")
    groups["output"] = parser.add_argument_group("output")
    source = groups["model and checkpoint"]
    source.add_argument(
        "--step", type=int, default=None, help="the checkpoint step (default: the latest)"
    )
    source.add_argument(
        "--tokenizer",
        default=None,
        metavar="T",
        help="bytes, a tokenizer.json file or a folder holding one (default: as dew generate)",
    )
    source.add_argument(
        "--merge-lora",
        action="store_true",
        help="a LoRA run: fold the adapters into the base first (default: run them beside it)",
    )
    source.add_argument(
        "--eot",
        type=int,
        default=None,
        metavar="ID",
        help="the end-of-text id (lm-eval's prefix of an empty context and stop of a "
        "generation; default: the model's eos_token_id, else the tokenizer's)",
    )
    tasks = groups["tasks"]
    tasks.add_argument(
        "--tasks",
        nargs="+",
        required=True,
        metavar="TASK",
        help="task YAML files (their folders searched for the files they include) or lm-eval "
        "task names",
    )
    tasks.add_argument(
        "--limit", type=int, default=None, metavar="N", help="at most N documents a task"
    )
    tasks.add_argument(
        "--num-fewshot", type=int, default=None, metavar="K", help="few-shot examples a prompt"
    )
    tasks.add_argument(
        "--batch-size",
        type=int,
        default=8,
        metavar="B",
        help="rows a forward when scoring (default 8; padded to the devices they split over)",
    )
    devices = groups["devices and mesh"]
    add_device_flag(devices)
    add_mesh_flag(devices)
    add_min_shard_flag(devices)
    output = groups["output"]
    output.add_argument(
        "--output", default=None, metavar="FILE", help="write lm-eval's results as JSON"
    )
    output.add_argument(
        "--metrics",
        default=None,
        metavar="FILE",
        help="append one JSON line {step, eval/TASK/METRIC: value, ...} to FILE (a run's "
        "metrics file: dew plot reads it)",
    )
    parser.set_defaults(run=eval_command)
    return parser


def check_flags(args) -> None:
    for flag, value, least in (
        ("--limit", args.limit, 1),
        ("--num-fewshot", args.num_fewshot, 0),
        ("--batch-size", args.batch_size, 1),
        ("--step", args.step, 0),
    ):
        if value is not None and value < least:
            raise ValueError(f"{flag} must be at least {least}, got {value}")


def eval_command(args) -> int:
    import jax

    from dew.cli.flags import default_mesh
    from dew.cli.generate import default_stops, load_source
    from dew.evaluation import dew_lm, lm_eval_module, metrics_of, task_manager
    from dew.generation import Generator, tokenizer_of
    from dew.layout import Layout
    from dew.mesh import MeshSpec

    check_flags(args)
    lm_eval = lm_eval_module()  # before anything loads: the extra missing is said first
    names, manager = task_manager(args.tasks)
    mesh = MeshSpec.parse(default_mesh(args.mesh, jax.device_count()))
    model, params, adapters, found, carried = load_source(args.source, args.step, args.merge_lora)
    tokenizer = tokenizer_of(args.tokenizer or (str(found) if found is not None else "bytes"))
    eot = args.eot
    if eot is None:
        stops = default_stops(carried, tokenizer)
        eot = stops[0] if stops else None
    generator = Generator(model, params, adapters, mesh=mesh, layout=Layout(args.min_shard))
    results = lm_eval.simple_evaluate(
        model=dew_lm(generator, tokenizer, args.batch_size, eot),
        tasks=names,
        task_manager=manager,
        limit=args.limit,
        num_fewshot=args.num_fewshot,
        bootstrap_iters=0,
    )
    metrics = metrics_of(results)
    for name, value in metrics.items():
        print(f"{name}: {value:.6g}")
    sys.stdout.flush()
    if args.output is not None:
        with open(args.output, "w", encoding="utf-8") as out:
            json.dump(results, out, indent=1, default=str)
    if args.metrics is not None:
        step = args.step if args.step is not None else _latest_step(args.source)
        with open(args.metrics, "a", encoding="utf-8") as out:
            out.write(json.dumps({"step": step, **metrics}) + "\n")
    return 0


def _latest_step(source: str) -> int:
    """The step a Dew source's latest checkpoint is at; 0 for a Hugging Face folder."""
    from dew.checkpoints import Checkpoints
    from dew.models import hf
    from dew.models.checkpoint import checkpoint_directory

    if hf.is_hf_folder(source):
        return 0
    return Checkpoints(checkpoint_directory(source)).latest or 0
