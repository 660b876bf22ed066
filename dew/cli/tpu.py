"""``dew-tpu``: a Cloud TPU slice for a Dew run, through ``gcloud compute tpus tpu-vm``.

    dew-tpu create my-slice --zone us-east5-a --type v5p-16 --spot
    dew-tpu setup my-slice --zone us-east5-a
    dew-tpu train my-slice --zone us-east5-a -- python train.py
    dew-tpu logs my-slice --zone us-east5-a --worker 0
    dew-tpu delete my-slice --zone us-east5-a

Each subcommand runs one or two ``gcloud`` commands and prints them first; ``--dry-run`` prints them
without running anything. ``setup`` and ``train`` always act on every worker of the slice
(``--worker=all``: a run needs all of them); ``logs`` reads every worker's log, or one worker's with
``--worker K``. On the workers, ``prepare_process(multi_host=True)`` finds the slice by itself
(JAX's TPU cluster detection), so ``train`` runs the command as it is given, on every worker at
once, detached (``nohup``), its output in a log file in each worker's home folder.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys

from dew.checks import positive_int

TPU_VM = ("gcloud", "compute", "tpus", "tpu-vm")
# The TPU software version (``--version``) for JAX on each generation, by accelerator type prefix
# (cloud.google.com/tpu/docs/runtimes); the first prefix that matches wins.
DEFAULT_VERSIONS = (
    ("v6e", "v2-alpha-tpuv6e"),
    ("v5litepod", "v2-alpha-tpuv5-lite"),
    ("v5p", "v2-alpha-tpuv5"),
    ("v4", "tpu-ubuntu2204-base"),
)
DEFAULT_PACKAGE = "dew-ml[gcs]"
DEFAULT_LOG = "dew-train.log"
# Where --source lands in each worker's home folder.
SOURCE_FOLDER = "dew-source"


def default_version(accelerator_type: str) -> str:
    """The TPU software version for ``accelerator_type`` (``"v5p-16"`` -> ``"v2-alpha-tpuv5"``)."""
    for prefix, version in DEFAULT_VERSIONS:
        if accelerator_type.startswith(prefix):
            return version
    known = ", ".join(prefix for prefix, _ in DEFAULT_VERSIONS)
    raise ValueError(
        f"no default --version for --type {accelerator_type!r} (known: {known}-...); give --version"
    )


def _place(args) -> list[str]:
    """``--zone`` and ``--project``, as every gcloud command here takes them."""
    place = [f"--zone={args.zone}"]
    if args.project:
        place.append(f"--project={args.project}")
    return place


def _ssh(args, worker: str, command: str) -> list[str]:
    return [*TPU_VM, "ssh", args.name, *_place(args), f"--worker={worker}", f"--command={command}"]


def create_commands(args) -> list[list[str]]:
    version = args.version or default_version(args.type)
    command = [
        *TPU_VM,
        "create",
        args.name,
        *_place(args),
        f"--accelerator-type={args.type}",
        f"--version={version}",
    ]
    if args.spot:
        command.append("--spot")
    return [command]


def setup_commands(args) -> list[list[str]]:
    """Installs JAX for TPUs and Dew on every worker: ``--package`` from the package index
    (default ``dew-ml[gcs]``), or a local checkout copied there with ``--source``."""
    commands = []
    if args.source:
        commands.append(
            [
                *TPU_VM,
                "scp",
                "--recurse",
                args.source,
                f"{args.name}:{SOURCE_FOLDER}",
                *_place(args),
                "--worker=all",
            ]
        )
        package = f"./{SOURCE_FOLDER}[gcs]"
    else:
        package = args.package
    install = shlex.join(["python3", "-m", "pip", "install", "-U", "jax[tpu]", package])
    commands.append(_ssh(args, "all", install))
    return commands


def train_commands(args) -> list[list[str]]:
    """Starts ``COMMAND`` on every worker, detached from the ssh session, output in ``--log``."""
    command = args.command_line
    if not command:
        raise ValueError("give the command to run after --, e.g. -- python3 train.py")
    log = shlex.quote(args.log)
    detached = f"nohup {shlex.join(command)} > {log} 2>&1 < /dev/null &"
    return [_ssh(args, "all", detached)]


def logs_commands(args) -> list[list[str]]:
    positive_int("--lines", args.lines)
    tail = ["tail", "-n", str(args.lines)] + (["-f"] if args.follow else []) + [args.log]
    return [_ssh(args, args.worker, shlex.join(tail))]


def delete_commands(args) -> list[list[str]]:
    return [[*TPU_VM, "delete", args.name, *_place(args)] + (["--quiet"] if args.yes else [])]


def _worker(text: str) -> str:
    if text != "all" and not text.isdigit():
        raise argparse.ArgumentTypeError(f"--worker must be a worker number or 'all', got {text!r}")
    return text


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("name", help="the TPU VM (slice) name")
    common.add_argument("--zone", required=True, help="the slice's zone, e.g. us-east5-a")
    common.add_argument(
        "--project", default=None, help="the Google Cloud project (default: gcloud's)"
    )
    common.add_argument(
        "--dry-run", action="store_true", help="print the gcloud commands without running them"
    )
    parser = argparse.ArgumentParser(
        prog="dew-tpu",
        description="Create a Cloud TPU slice, install Dew on it, run a training command on every "
        "worker, read the logs, delete the slice (all through gcloud compute tpus tpu-vm).",
    )
    commands = parser.add_subparsers(dest="subcommand", required=True)

    create = commands.add_parser("create", parents=[common], help="create a TPU slice")
    create.add_argument("--type", required=True, help="accelerator type, e.g. v5p-16, v6e-8")
    create.add_argument(
        "--version",
        default=None,
        help="TPU software version (default by --type: "
        + ", ".join(f"{p}: {v}" for p, v in DEFAULT_VERSIONS)
        + ")",
    )
    create.add_argument("--spot", action="store_true", help="a Spot slice (cheaper, preemptible)")
    create.set_defaults(commands=create_commands)

    setup = commands.add_parser(
        "setup", parents=[common], help="install JAX for TPUs and Dew on every worker"
    )
    source = setup.add_mutually_exclusive_group()
    source.add_argument(
        "--package",
        default=DEFAULT_PACKAGE,
        help=f"what pip installs (default {DEFAULT_PACKAGE!r}; e.g. a git+https:// URL)",
    )
    source.add_argument(
        "--source",
        default=None,
        metavar="DIR",
        help=f"copy this local Dew checkout to ~/{SOURCE_FOLDER} on every worker and install it "
        "with the gcs extra",
    )
    setup.set_defaults(commands=setup_commands)

    train = commands.add_parser(
        "train",
        parents=[common],
        help="start COMMAND on every worker, detached, logging to a file",
        usage="dew-tpu train NAME --zone ZONE [--project P] [--log LOG] [--dry-run] -- COMMAND...",
    )
    train.add_argument(
        "--log",
        default=DEFAULT_LOG,
        help=f"the log file in each worker's home (default {DEFAULT_LOG})",
    )
    train.set_defaults(commands=train_commands)

    logs = commands.add_parser("logs", parents=[common], help="print the run's log")
    logs.add_argument(
        "--worker", type=_worker, default="all", help="a worker number, or all (default)"
    )
    logs.add_argument("--log", default=DEFAULT_LOG, help=f"the log file (default {DEFAULT_LOG})")
    logs.add_argument("--lines", type=int, default=100, help="last lines to print (default 100)")
    logs.add_argument("--follow", action="store_true", help="keep printing new lines (tail -f)")
    logs.set_defaults(commands=logs_commands)

    delete = commands.add_parser("delete", parents=[common], help="delete the slice")
    delete.add_argument("--yes", action="store_true", help="do not ask gcloud to confirm (--quiet)")
    delete.set_defaults(commands=delete_commands)
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after the first "--" is train's COMMAND, split off before argparse sees it: a
    # REMAINDER argument after NAME would swallow the options that follow NAME.
    split = argv.index("--") if "--" in argv else len(argv)
    argv, command_line = argv[:split], argv[split + 1 :]
    args = build_parser().parse_args(argv)
    if command_line and args.subcommand != "train":
        print(f"dew-tpu {args.subcommand}: takes no command after --", file=sys.stderr)
        return 2
    args.command_line = command_line
    try:
        commands = args.commands(args)
    except ValueError as error:
        print(f"dew-tpu {args.subcommand}: {error}", file=sys.stderr)
        return 2
    if args.dry_run:
        for command in commands:
            print(shlex.join(command))
        return 0
    if shutil.which("gcloud") is None:
        print(
            "dew-tpu: gcloud is not on PATH; install the Google Cloud CLI "
            "(https://cloud.google.com/sdk/docs/install), run `gcloud auth login`, and try again "
            "(--dry-run prints the commands without it)",
            file=sys.stderr,
        )
        return 2
    for command in commands:
        print(f"+ {shlex.join(command)}", file=sys.stderr, flush=True)
        code = subprocess.run(command).returncode
        if code != 0:
            print(f"dew-tpu {args.subcommand}: gcloud exited with code {code}", file=sys.stderr)
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
