"""``dew eval``: lm-eval tasks on a trained model, on the devices (``dew.evaluation``); and
``dew train --eval-tasks``, the same tasks during training (its flags and checks live here).

    dew eval runs/sft --tasks tasks/my_task.yaml --metrics runs/sft/metrics.jsonl
    dew eval Llama-3.2-1B --tasks hellaswag --limit 100 --mesh fsdp=4,tensor=2
    dew train --data tokens --eval-every 200 --eval-tasks tasks/my_task.yaml --eval-limit 100

SOURCE is read as ``dew generate`` reads it (``dew.cli.generate.load_source``): a run directory,
a Dew checkpoint directory or a Hugging Face folder, and the tokenizer the run kept or the
folder's. ``dew train`` reads its tasks with the tokenizer of its token folder
(``train_tokenizer``). lm-eval is an optional extra; without it either command says how to
install it.
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


# --- dew train --eval-tasks -----------------------------------------------------------------------

# Where dew train records the tasks each launch evaluates: one JSON line a launch, in RUN_DIR.
TASKS_RECORD = "eval_tasks.jsonl"


def add_train_flags(group) -> None:
    """``dew train``'s ``--eval-tasks``, ``--eval-limit`` and ``--eval-eot``, in ``group`` (its
    "logging and evaluation" topic)."""
    group.add_argument(
        "--eval-tasks",
        nargs="+",
        default=None,
        metavar="TASK",
        help="with --eval-every: run these lm-eval tasks (task YAML files or lm-eval task "
        "names, as dew eval --tasks) on the devices every N steps and at the last step, on the "
        "weights the validation loss uses, with the token folder's tokenizer; prints their "
        "metrics and adds eval/TASK/METRIC to the step's metrics (needs pip install -e "
        "'.[eval]')",
    )
    group.add_argument(
        "--eval-limit",
        type=int,
        default=None,
        metavar="N",
        help="with --eval-tasks: at most N documents a task at each evaluation (default: all)",
    )
    group.add_argument(
        "--eval-eot",
        type=int,
        default=None,
        metavar="ID",
        help="with --eval-tasks: the end-of-text id (lm-eval's prefix of an empty context and "
        "stop of a generation; default: the token folder's eos_id, else the tokenizer's; byte "
        "data has none)",
    )


def check_train_flags(args) -> None:
    """``dew train``'s evaluation flags, before anything is written or compiled: ``--eval-tasks``
    without ``--eval-every``, ``--eval-limit`` or ``--eval-eot`` without ``--eval-tasks``, a
    count below its least, a task file that does not exist (``ValueError`` naming the flags and
    the path), and lm-eval not installed (``MissingExtra`` saying how to install it)."""
    tasks = getattr(args, "eval_tasks", None)
    for flag, value in (("--eval-limit", args.eval_limit), ("--eval-eot", args.eval_eot)):
        if value is not None and tasks is None:
            raise ValueError(f"{flag} {value} without --eval-tasks: it sets how they run")
    if tasks is None:
        return
    if args.eval_every is None:
        raise ValueError(
            "--eval-tasks needs --eval-every N: the tasks run every N steps and at the last step"
        )
    if args.eval_limit is not None and args.eval_limit < 1:
        raise ValueError(f"--eval-limit must be at least 1, got {args.eval_limit}")
    if args.eval_eot is not None and args.eval_eot < 0:
        raise ValueError(f"--eval-eot must be a token id (0 or above), got {args.eval_eot}")
    from pathlib import Path

    for task in tasks:
        if Path(task).suffix in (".yaml", ".yml") and not Path(task).is_file():
            raise ValueError(f"--eval-tasks {task}: no such task file")
    from dew.evaluation import lm_eval_module

    lm_eval_module("dew train --eval-tasks")


def train_tokenizer(data_dir, run_dir):
    """``(tokenizer, where)``: the tokenizer ``dew train --eval-tasks`` reads its tasks with, the
    run's own: the copy the run kept (``RUN_DIR/checkpoints/tokenizer/tokenizer.json``, as
    ``dew generate`` finds it), else the one the token folder's ``meta.json`` names (its
    ``tokenizer``: ``byte``, or a tokenizer.json); ``ValueError`` naming both when neither is
    there."""
    from pathlib import Path

    from dew.cli.convert import TOKENIZER_DIR
    from dew.data import read_meta
    from dew.generation import tokenizer_of

    kept = Path(run_dir) / "checkpoints" / TOKENIZER_DIR / "tokenizer.json"
    named = read_meta(data_dir).tokenizer
    if kept.is_file():
        where = kept
    elif named in ("byte", "bytes"):
        where = "bytes"
    elif Path(named).is_file():
        where = Path(named)
    else:
        raise ValueError(
            f"--eval-tasks needs the run's tokenizer: the token folder {data_dir} names "
            f"{named!r} (meta.json's tokenizer), which is not a file, and the run kept none "
            f"({kept})"
        )
    return tokenizer_of(str(where)), where


def train_tasks(args, data_dir, run_dir, trainer):
    """The ``dew.evaluation.Tasks`` of ``dew train --eval-tasks`` (``None`` without the flag),
    checked against ``trainer`` (its model, mesh and layout) before anything compiles; the
    end-of-text id is ``--eval-eot``, else the token folder's ``eos_id``, else the tokenizer's
    (``ValueError`` naming ``--eval-eot`` when none has one)."""
    if args.eval_tasks is None:
        return None
    from dew.data import read_meta
    from dew.evaluation import Tasks

    tokenizer, where = train_tokenizer(data_dir, run_dir)
    eot = args.eval_eot
    if eot is None:
        eot = read_meta(data_dir).eos_id
    if eot is None:
        eot = tokenizer.eos_id
    if eot is None:
        raise ValueError(
            f"--eval-tasks needs an end-of-text id (lm-eval's prefix of an empty context, the "
            f"stop of a generation): neither the token folder {data_dir} (meta.json's eos_id) "
            f"nor the tokenizer ({where}) has one; give --eval-eot ID"
        )
    tasks = Tasks(args.eval_tasks, tokenizer, limit=args.eval_limit, eot_id=eot)
    try:
        tasks.check(trainer.objective.model, trainer.mesh, trainer.layout)
    except ValueError as error:  # said as the flag's, with the mesh it names
        raise ValueError(f"--eval-tasks (--mesh {_mesh_text(trainer.mesh)}): {error}") from None
    return tasks


def _mesh_text(mesh) -> str:
    """``fsdp=4,sequence=2``: a mesh's axes above 1, as ``--mesh`` takes them."""
    return ",".join(f"{a}={n}" for a, n in dict(mesh.shape).items() if n > 1) or "data=1"


def record_tasks(run_dir, tasks, from_step: int) -> None:
    """Appends what ``tasks`` are to ``RUN_DIR/eval_tasks.jsonl`` (``TASKS_RECORD``): one JSON
    line a launch, ``{"from_step", "tasks", "names", "limit", "num_fewshot", "eot_id"}``, the
    tasks as given (a resumed run may evaluate others); process 0 writes it."""
    import jax

    if jax.process_index() != 0:
        return
    from pathlib import Path

    path = Path(run_dir) / TASKS_RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps({"from_step": from_step, **tasks.describe()}) + "\n")
