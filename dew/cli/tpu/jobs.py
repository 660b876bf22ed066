"""Runs on a slice: train (with its spot restarts) and spawn."""

from __future__ import annotations

import dataclasses

from dew.cli.tpu import remote, slices
from dew.cli.tpu.config import TpuError
from dew.cli.tpu.gcloud import Gcloud, Slice, describe
from dew.cli.tpu.remote import say


@dataclasses.dataclass
class TrainSpec:
    job: str
    command: list[str]
    sync: bool = True
    excludes: list[str] = dataclasses.field(default_factory=list)
    detach: bool = False
    start_check: float = 5.0  # seconds after the start at which every worker must still run
    lines: int = 20  # of a dead worker's log, shown
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    spot_restart: bool = False
    max_restarts: int = 10
    source: bool = False  # how setup installs Dew again after a re-create
    package: str | None = None
    timeout: float = 1800.0  # for READY after a re-create
    poll: float = 10.0


def start(gcloud: Gcloud, slice_: Slice, info: dict, spec: TrainSpec, cwd: str | None) -> None:
    """Starts the command on every worker, then fails, stopping the others, when any worker's
    process is not alive ``spec.start_check`` seconds later (exited 0 counts as alive)."""
    script = remote.start_script(spec.job, spec.command, cwd, spec.env)
    gcloud.run(slice_.ssh("all", script))
    if not gcloud.dry_run:
        gcloud.sleep(spec.start_check)
    answer = gcloud.run(slice_.ssh("all", remote.check_script(spec.job, spec.lines)), capture=True)
    if gcloud.dry_run:
        return
    status, tails = remote.parse_check(answer.stdout)
    count = slices.workers(info) or (max(status) + 1 if status else 1)
    bad = {w: status.get(w, "gave no answer") for w in range(count)}
    bad = {w: s for w, s in bad.items() if s not in ("running", "exited 0")}
    if not bad:
        say(f"job {spec.job} runs on {count} worker(s); logs in ~/dew-runs/{spec.job}/")
        return
    gcloud.run(slice_.ssh("all", remote.stop_script(spec.job)), check=False, capture=True)
    parts = []
    for w, s in sorted(bad.items()):
        lines = tails.get(w) or ["(empty log)"]
        parts.append(
            f"worker {w} {s} within {spec.start_check:g} s of its start; the last lines of "
            f"~/dew-runs/{spec.job}/worker-{w}.log:\n    " + "\n    ".join(lines)
        )
    raise TpuError(
        "train: " + "\n".join(parts) + f"\n(the other workers' processes were stopped; `dew-tpu "
        f"logs {slice_.name} {spec.job} --worker all` shows every log)"
    )


def train_once(gcloud: Gcloud, slice_: Slice, info: dict, spec: TrainSpec) -> int:
    cwd = remote.sync(gcloud, slice_, spec.excludes, delete=False) if spec.sync else None
    start(gcloud, slice_, info, spec, cwd)
    if spec.detach:
        say(f"detached; follow it with `dew-tpu logs {slice_.name} {spec.job} --follow`")
        return 0
    try:
        return gcloud.run(slice_.ssh(0, remote.follow_script(spec.job)), check=False).code
    except KeyboardInterrupt:
        say(
            f"stopped following; the job goes on: `dew-tpu logs {slice_.name} {spec.job} "
            f"--follow`, `dew-tpu reset {slice_.name}` ends it"
        )
        return 130


def train(gcloud: Gcloud, slice_: Slice, spec: TrainSpec) -> int:
    """Syncs, starts, checks and follows the job; with ``spot_restart``, a slice that leaves
    READY is waited for, re-created (or re-queued), set up, and the job started again."""
    if spec.spot_restart and spec.detach:
        raise TpuError("--spot-restart watches the run, so it cannot --detach", 2)
    info = slices.require_ready(gcloud, slice_)
    recipe, restarts = info, 0
    while True:
        code, failure = 1, None
        try:
            code = train_once(gcloud, slice_, info, spec)
        except TpuError as error:
            if not spec.spot_restart:
                raise
            failure = error
        if code == 0 or not spec.spot_restart or gcloud.dry_run:
            if code not in (0, 130):
                say(
                    f"worker 0's command exited with {code}: `dew-tpu logs {slice_.name} "
                    f"{spec.job} --worker all`"
                )
            return code
        now = describe(gcloud, slice_)
        state = "gone" if now is None else now.get("state", "?")
        if state == "READY":  # the command failed on a healthy slice: no restart helps
            if failure is not None:
                raise failure
            say(
                f"worker 0's command exited with {code} on a READY slice: `dew-tpu logs "
                f"{slice_.name} {spec.job} --worker all`"
            )
            return code
        if restarts >= spec.max_restarts:
            raise TpuError(
                f"slice {slice_.name} is {state} and --max-restarts {spec.max_restarts} are "
                f"used up; `dew-tpu status {slice_.name}`"
            )
        restarts += 1
        say(
            f"slice {slice_.name} left READY (it is {state}): restart {restarts} of "
            f"{spec.max_restarts}: re-create, setup, train again (the run resumes from its "
            "latest checkpoint)"
        )
        info = recover(gcloud, slice_, now, recipe, spec)


def recover(gcloud: Gcloud, slice_: Slice, now, recipe: dict, spec: TrainSpec) -> dict:
    """Waits out a transitional state; then re-creates the slice as ``recipe`` describes it (type,
    runtime, spot, queued, its first data disk, read-write), waits for READY and runs setup
    again."""
    waited = 0.0
    while now is not None and now.get("state") in slices.TRANSITIONAL and waited < spec.timeout:
        gcloud.sleep(spec.poll)
        waited += spec.poll
        now = describe(gcloud, slice_)
    if now is not None and now.get("state") == "READY":
        return now
    scheduling = recipe.get("schedulingConfig") or {}
    queued = bool(recipe.get("queuedResource"))
    # The data disk the slice had (describe's dataDisks), attached again: a re-created slice
    # without it would start a run that cannot read its data.
    disks = recipe.get("dataDisks") or [{}]
    if now is not None or queued:
        gcloud.run(slices.delete_argv(slice_, queued, yes=True), check=not queued)
    create = dict(
        type=recipe.get("acceleratorType"),
        version=recipe.get("runtimeVersion") or "auto",
        spot=bool(scheduling.get("spot") or scheduling.get("preemptible")),
        queued=queued,
        disk=disks[0].get("sourceDisk"),
        timeout=spec.timeout,
        poll=spec.poll,
    )
    _, info = slices.create(gcloud, slice_, [slice_.zone], create)
    remote.setup(
        gcloud, slice_, info, source=spec.source, package=spec.package, excludes=spec.excludes
    )
    return info


def spawn(
    gcloud: Gcloud, base: Slice, count: int, zones: list[str], create: dict, spec: TrainSpec
) -> int:
    """``count`` slices ``BASE-0`` ... for a sweep: each created, set up, and the job started
    detached, with ``DEW_SPAWN_INDEX`` and ``DEW_SPAWN_COUNT`` in its environment."""
    names = []
    for index in range(count):
        slice_ = dataclasses.replace(base, name=f"{base.name}-{index}")
        slice_, info = slices.create(gcloud, slice_, zones, create)
        remote.setup(
            gcloud, slice_, info, source=spec.source, package=spec.package, excludes=spec.excludes
        )
        env = {**spec.env, "DEW_SPAWN_INDEX": str(index), "DEW_SPAWN_COUNT": str(count)}
        one = dataclasses.replace(spec, env=env, detach=True, spot_restart=False)
        train_once(gcloud, slice_, info, one)
        names.append(slice_.name)
    say(f"spawned {', '.join(names)}; `dew-tpu logs NAME {spec.job} --follow` follows one")
    return 0
