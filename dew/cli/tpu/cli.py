"""``dew-tpu``'s arguments, and ``main``."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from dew.checks import comma_names, positive_int
from dew.cli.tpu import config, jobs, remote, slices
from dew.cli.tpu.config import DEFAULT_PACKAGE, KEYS, RUNTIME_VERSIONS, TpuError
from dew.cli.tpu.gcloud import Gcloud

TAKES_COMMAND = ("run", "train", "spawn")


def _worker(text: str) -> str:
    if text != "all" and not text.isdigit():
        raise argparse.ArgumentTypeError(f"--worker must be a worker number or 'all', got {text!r}")
    return text


def _seconds(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"seconds must be >= 0, got {text}")
    return value


def _env(text: str) -> str:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--env takes KEY=VALUE, got {text!r}")
    return text


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--zone", help="the zone (default: the config's zones, in order)")
    common.add_argument("--project", help="the Google Cloud project (default: config, gcloud's)")
    common.add_argument("--user", help="the ssh user on the workers (default: config, gcloud's)")
    common.add_argument(
        "--dry-run", action="store_true", help="print the commands without running them"
    )
    named = argparse.ArgumentParser(add_help=False, parents=[common])
    named.add_argument("name", help="the TPU VM (slice) name")
    making = argparse.ArgumentParser(add_help=False)
    making.add_argument("--type", help="TPU type, e.g. v5e-8, v5p-16 (default: config)")
    making.add_argument(
        "--version",
        help="TPU runtime version; auto (the default) picks the published one for the type: "
        + ", ".join(f"{g}: {v}" for g, v in RUNTIME_VERSIONS.items()),
    )
    making.add_argument("--spot", action="store_true", help="a Spot slice (cheaper, preemptible)")
    making.add_argument("--queued", action="store_true", help="ask through a queued resource")
    making.add_argument("--disk", help="a persistent disk to attach (read-write), by its source")
    making.add_argument("--timeout", type=_seconds, default=1800.0, help="for READY (s, 1800)")
    making.add_argument("--poll", type=_seconds, default=10.0, help="between checks (s, 10)")
    install = argparse.ArgumentParser(add_help=False)
    source = install.add_mutually_exclusive_group()
    source.add_argument("--package", help=f"what pip installs as Dew (default {DEFAULT_PACKAGE!r})")
    source.add_argument(
        "--source", action="store_true", help="install the synced git tree (with its gcs extra)"
    )
    install.add_argument("--exclude", action="append", default=[], help="leave out of the sync")
    job = argparse.ArgumentParser(add_help=False)
    job.add_argument("--job", help="the job's name (default: run-<date>-<time>)")
    job.add_argument("--start-check", type=_seconds, default=5.0, help="seconds to stay alive (5)")
    job.add_argument("--lines", type=int, default=20, help="of a dead worker's log shown (20)")
    job.add_argument("--env", type=_env, action="append", default=[], help="KEY=VALUE for it")
    job.add_argument("--bucket", help="gs:// bucket for checkpoints (default: config)")

    parser = argparse.ArgumentParser(
        prog="dew-tpu",
        description="Cloud TPU slices for Dew runs, through gcloud compute tpus. Settings come "
        f"from flags, then {config.config_path()} (dew-tpu init), then defaults.",
    )
    commands = parser.add_subparsers(dest="subcommand", required=True)

    def add(name, help, parents):
        return commands.add_parser(name, help=help, parents=parents)

    init = add("init", "write the config file (interactively, or from flags)", [])
    init.add_argument("--project")
    init.add_argument("--zones", help="comma-separated, in the order create tries them")
    init.add_argument("--type")
    init.add_argument("--version")
    init.add_argument("--user")
    init.add_argument("--bucket")
    init.add_argument("--dry-run", action="store_true", help="print the file, write nothing")
    add("create", "create a slice and wait for READY", [named, making])
    delete = add("delete", "delete a slice", [named])
    delete.add_argument("--yes", action="store_true", help="do not ask (gcloud --quiet)")
    delete.add_argument("--queued", action="store_true", help="delete its queued resource too")
    add("start", "start a stopped slice", [named])
    add("stop", "stop a slice", [named])
    listing = add("list", "list the slices in each zone", [common])
    listing.add_argument("--queued", action="store_true", help="and the queued resources")
    describe = add("describe", "gcloud's description of a slice", [named])
    describe.add_argument("--queued", action="store_true", help="of its queued resource")
    add("status", "state, health, workers, and the running job", [named])
    ssh = add("ssh", "a shell on one worker", [named])
    ssh.add_argument("--worker", type=_worker, default="0", help="a worker number (default 0)")
    ssh.add_argument("-L", dest="forward", action="append", default=[], help="forward PORT")
    run = add("run", "run a command on the workers", [named, job])
    run.add_argument("--worker", type=_worker, default="all", help="K or all (default)")
    run.add_argument("--detach", action="store_true", help="start it detached as job --job")
    copy = add("copy", "copy to the workers (:path is on them)", [named])
    copy.add_argument("src")
    copy.add_argument("dst")
    copy.add_argument("--worker", type=_worker, help="all (uploads' default) or K (0 to download)")
    sync = add("sync", "the git tree to ~/<repo> on every worker", [named])
    sync.add_argument("--exclude", action="append", default=[], help="a pattern to leave out")
    sync.add_argument("--delete", action="store_true", help="remove what the tree does not hold")
    add(
        "setup",
        "install JAX and Dew in ~/dew-venv on every worker, check devices",
        [named, install],
    )
    train = add(
        "train", "sync, start on every worker, check, follow worker 0", [named, install, job]
    )
    train.add_argument("--detach", action="store_true", help="do not follow worker 0's log")
    train.add_argument("--no-sync", action="store_true", help="run in the home folder, no sync")
    train.add_argument("--spot-restart", action="store_true", help="re-create after preemption")
    train.add_argument("--max-restarts", type=int, default=10, help="(10)")
    train.add_argument("--timeout", type=_seconds, default=1800.0, help="for READY on restart")
    train.add_argument("--poll", type=_seconds, default=10.0, help="between checks on restart")
    logs = add("logs", "print a job's log", [named])
    logs.add_argument("job")
    logs.add_argument("--worker", type=_worker, default="0", help="K (default 0) or all")
    logs.add_argument("--lines", type=int, default=100, help="last lines (100)")
    logs.add_argument("--follow", action="store_true", help="keep printing new lines")
    add("reset", "end the processes holding the TPU on every worker", [named])
    spawn = add("spawn", "N slices BASE-0 ... for a sweep", [common, making, install, job])
    spawn.add_argument("name", metavar="BASE", help="the slices are BASE-0 ... BASE-(N-1)")
    spawn.add_argument("count", type=int, metavar="N")
    return parser


def _settings(args) -> config.Settings:
    flags = {key: getattr(args, key, None) for key in KEYS}
    flags["zones"] = [args.zone] if getattr(args, "zone", None) else None
    return config.resolve(flags)


def _init(args) -> int:
    settings = config.resolve({})
    given = {k: getattr(args, k) for k in KEYS if getattr(args, k) is not None}
    if not given:
        print(f"dew-tpu init: {config.config_path()} (Enter keeps a value, - clears it)")
        for key in KEYS:
            now = getattr(settings, key)
            shown = ",".join(now) if isinstance(now, list) else now
            try:
                answer = input(f"{key} [{shown or ''}]: ").strip()
            except EOFError:
                answer = ""
            if answer:
                given[key] = None if answer == "-" else answer
    for key, value in given.items():
        if key == "zones" and value is not None:
            value = list(comma_names("--zones", value))
            for zone in value:
                config.check_zone(zone)
        setattr(settings, key, value if value is not None else getattr(config.DEFAULTS, key))
    if settings.type:
        config.cloud_type(settings.type)
    if settings.bucket and "://" not in settings.bucket:
        raise TpuError(f"--bucket is a URL such as gs://my-bucket, got {settings.bucket!r}", 2)
    if args.dry_run:
        print(f"# {config.config_path()}\n{config.to_toml(settings)}", end="")
        return 0
    path = config.write_config(settings)
    print(f"wrote {path}:\n{config.to_toml(settings)}", end="")
    return 0


def _train_spec(args, settings, command) -> jobs.TrainSpec:
    job = args.job or time.strftime("run-%Y%m%d-%H%M%S")
    positive_int("--lines", args.lines)
    env = dict(item.split("=", 1) for item in args.env)
    if settings.bucket:
        env.setdefault("DEW_BUCKET", settings.bucket)
        env.setdefault("DEW_RUN_DIR", f"{settings.bucket.rstrip('/')}/dew-runs/{job}")
    return jobs.TrainSpec(
        job=job,
        command=command,
        sync=not getattr(args, "no_sync", False),
        excludes=getattr(args, "exclude", []),
        detach=getattr(args, "detach", False),
        start_check=args.start_check,
        lines=args.lines,
        env=env,
        spot_restart=getattr(args, "spot_restart", False),
        max_restarts=getattr(args, "max_restarts", 10),
        source=getattr(args, "source", False),
        package=getattr(args, "package", None),
        timeout=getattr(args, "timeout", 1800.0),
        poll=getattr(args, "poll", 10.0),
    )


def _create_spec(args, settings) -> dict:
    return dict(
        type=settings.type,
        version=settings.version,
        spot=args.spot,
        queued=args.queued,
        disk=args.disk,
        timeout=args.timeout,
        poll=args.poll,
    )


def dispatch(args, gcloud: Gcloud) -> int:
    sub = args.subcommand
    if sub == "init":
        return _init(args)
    settings = _settings(args)
    command = args.command_line
    if sub in TAKES_COMMAND and not command:
        raise TpuError("give the command to run after --, e.g. -- python3 train.py", 2)
    if sub == "list":
        zones = config.need(settings.zones, "zone", "--zone ZONE", "--zones us-east5-a")
        slices.list_slices(gcloud, zones, settings.project, args.queued)
        return 0
    if sub in ("create", "spawn"):
        zones = config.need(settings.zones, "zone", "--zone ZONE", "--zones us-east5-a")
        config.cloud_type(config.need(settings.type, "TPU type", "--type TYPE", "--type v5e-8"))
        base = slices.Slice(args.name, zones[0], settings.project, settings.user)
        if sub == "create":
            slices.create(gcloud, base, zones, _create_spec(args, settings))
            return 0
        positive_int("N", args.count)
        spec = _train_spec(args, settings, command)
        return jobs.spawn(gcloud, base, args.count, zones, _create_spec(args, settings), spec)
    slice_ = slices.locate(
        gcloud, args.name, args.zone, settings.zones, settings.project, settings.user
    )
    if sub == "delete":
        slices.delete(gcloud, slice_, args.queued, args.yes)
    elif sub in ("start", "stop"):
        slices.start_stop(gcloud, slice_, sub)
    elif sub == "describe":
        slices.describe_slice(gcloud, slice_, args.queued)
    elif sub == "status":
        return slices.status(gcloud, slice_)
    elif sub == "train":
        spec = _train_spec(args, settings, command)
        if spec.spot_restart:
            config.need(settings.bucket, "bucket", "--bucket gs://B", "--bucket gs://my-bucket")
        return jobs.train(gcloud, slice_, spec)
    else:  # every other command acts on a READY slice's workers
        info = slices.require_ready(gcloud, slice_)
        if sub == "ssh":
            return remote.ssh(gcloud, slice_, args.worker, args.forward)
        if sub == "run" and args.detach:
            spec = dataclasses.replace(_train_spec(args, settings, command), sync=False)
            jobs.start(gcloud, slice_, info, spec, None)
        elif sub == "run":
            return remote.run(gcloud, slice_, args.worker, command)
        elif sub == "copy":
            remote.copy(gcloud, slice_, args.src, args.dst, args.worker)
        elif sub == "sync":
            remote.sync(gcloud, slice_, args.exclude, args.delete)
        elif sub == "setup":
            remote.setup(
                gcloud,
                slice_,
                info,
                source=args.source,
                package=args.package,
                excludes=args.exclude,
            )
        elif sub == "logs":
            positive_int("--lines", args.lines)
            return remote.logs(gcloud, slice_, args.job, args.worker, args.lines, args.follow)
        elif sub == "reset":
            remote.reset(gcloud, slice_)
    return 0


def main(argv=None, *, gcloud: Gcloud | None = None) -> int:
    """``dew-tpu``; ``gcloud`` replaces the runner (tests pass one with their own clock)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after the first "--" is the command to run, split off before argparse sees it.
    split = argv.index("--") if "--" in argv else len(argv)
    argv, command_line = argv[:split], argv[split + 1 :]
    args = build_parser().parse_args(argv)
    if command_line and args.subcommand not in TAKES_COMMAND:
        print(f"dew-tpu {args.subcommand}: takes no command after --", file=sys.stderr)
        return 2
    args.command_line = command_line
    if gcloud is None:
        gcloud = Gcloud(dry_run=getattr(args, "dry_run", False))
    else:
        gcloud.dry_run = getattr(args, "dry_run", False)
    try:
        return dispatch(args, gcloud)
    except (TpuError, ValueError) as error:
        print(f"dew-tpu {args.subcommand}: {error}", file=sys.stderr)
        return getattr(error, "code", 2)
    except KeyboardInterrupt:
        print(f"dew-tpu {args.subcommand}: interrupted", file=sys.stderr)
        return 130
