"""The slice itself: create (and wait for READY), delete, start, stop, list, describe, status."""

from __future__ import annotations

import sys

from dew.cli.tpu.config import (
    TpuError,
    check_zone,
    cloud_type,
    need,
    runtime_version,
    slice_target,
)
from dew.cli.tpu.gcloud import QUEUED, TPU_VM, Gcloud, GcloudError, Slice, describe

# States a slice passes through on its own; anything else that is not READY needs an action.
TRANSITIONAL = ("CREATING", "STARTING", "RESTARTING", "REPAIRING", "STOPPING", "DELETING")
NOT_READY_FIX = {
    "CREATING": "wait for it: `dew-tpu status {name}`",
    "STARTING": "wait for it: `dew-tpu status {name}`",
    "STOPPED": "start it: `dew-tpu start {name}`",
    "STOPPING": "wait, then start it: `dew-tpu start {name}`",
    "PREEMPTED": "delete and re-create it: `dew-tpu delete {name} --yes` then `dew-tpu create "
    "{name} ...` (or train with --spot-restart)",
    "TERMINATED": "delete and re-create it: `dew-tpu delete {name} --yes` then `dew-tpu create "
    "{name} ...`",
}


def locate(gcloud: Gcloud, name: str, zone: str | None, zones: list[str], project, user) -> Slice:
    """The slice ``name``: in ``--zone``, else the one configured zone, else the first of the
    configured zones that has it (under ``--dry-run``: the first)."""
    if zone:
        return Slice(name, check_zone(zone), project, user)
    zones = need(zones, "zone", "--zone ZONE", "--zones us-east5-a")
    for z in zones:
        check_zone(z)
    if len(zones) == 1 or gcloud.dry_run:
        return Slice(name, zones[0], project, user)
    for z in zones:
        if describe(gcloud, Slice(name, z, project, user)) is not None:
            return Slice(name, z, project, user)
    raise TpuError(
        f"no slice {name!r} in any of the zones {', '.join(zones)}: `dew-tpu list` lists the "
        f"slices, `dew-tpu create {name} --type TYPE` makes one"
    )


def require_ready(gcloud: Gcloud, slice_: Slice) -> dict:
    """The slice's description, or a ``TpuError`` saying how to make it READY."""
    info = describe(gcloud, slice_)
    if info is None:
        raise TpuError(
            f"there is no slice {slice_.name!r} in {slice_.zone}: create it with `dew-tpu create "
            f"{slice_.name} --type TYPE` (`dew-tpu list` lists the slices there are)"
        )
    state = info.get("state", "UNKNOWN")
    if state != "READY":
        fix = NOT_READY_FIX.get(state, "see `dew-tpu status {name}`").format(name=slice_.name)
        raise TpuError(f"slice {slice_.name} is {state}, not READY: {fix}")
    return info


def workers(info: dict) -> int | None:
    """How many workers (hosts) the slice has, from its type or its endpoints."""
    if info.get("acceleratorType"):
        try:
            return slice_target(info["acceleratorType"]).hosts
        except TpuError:
            pass
    endpoints = info.get("networkEndpoints")
    return len(endpoints) if endpoints else None


def create_argv(slice_: Slice, type_name, version, spot, queued, disk) -> list[str]:
    accelerator = cloud_type(type_name)
    version = runtime_version(type_name, version)
    if queued:
        argv = [*QUEUED, "create", slice_.name, f"--node-id={slice_.name}", *slice_.place()]
        argv += [f"--accelerator-type={accelerator}", f"--runtime-version={version}"]
    else:
        argv = [*TPU_VM, "create", slice_.name, *slice_.place()]
        argv += [f"--accelerator-type={accelerator}", f"--version={version}"]
    if spot:
        argv.append("--spot")
    if disk:
        argv.append(f"--data-disk=source={disk},mode=read-write")
    return argv


def _progress(text: str, last: list) -> None:
    if sys.stderr.isatty():
        sys.stderr.write(f"\r{text}\033[K")
    elif text.split(" after ")[0] != last[0]:
        sys.stderr.write(text + "\n")
    last[0] = text.split(" after ")[0]
    sys.stderr.flush()


def wait_ready(gcloud: Gcloud, slice_: Slice, *, queued: bool, timeout: float, poll: float) -> dict:
    """Polls the slice (and, for a queued resource, its request) until READY, printing a progress
    line; a ``TpuError`` at ``timeout`` seconds or when it fails."""
    queue_argv = [*QUEUED, "describe", slice_.name, *slice_.place(), "--format=value(state.state)"]
    if gcloud.dry_run:
        if queued:
            gcloud.run(queue_argv)
        return describe(gcloud, slice_)
    start, last, state = gcloud.clock(), [None], "?"
    while True:
        elapsed = gcloud.clock() - start
        if queued:
            state = gcloud.run(queue_argv, capture=True, quiet=True).stdout.strip() or "?"
            if state in ("FAILED", "SUSPENDED"):
                raise TpuError(
                    f"the queued resource {slice_.name} is {state}: `gcloud compute tpus "
                    f"queued-resources describe {slice_.name} --zone={slice_.zone}` says why; "
                    f"`dew-tpu delete {slice_.name} --queued --yes` removes it"
                )
        if not queued or state == "ACTIVE":
            info = describe(gcloud, slice_)
            state = "NOT YET CREATED" if info is None else info.get("state", "?")
            if state == "READY":
                _progress(f"{slice_.name} in {slice_.zone}: READY after {elapsed:.0f} s", last)
                if sys.stderr.isatty():
                    sys.stderr.write("\n")
                return info
            if info is not None and state not in TRANSITIONAL:
                raise TpuError(
                    f"slice {slice_.name} became {state} while waiting for READY: "
                    f"`dew-tpu status {slice_.name}`; `dew-tpu delete {slice_.name} --yes`"
                )
        _progress(f"{slice_.name} in {slice_.zone}: {state} after {elapsed:.0f} s", last)
        if elapsed >= timeout:
            raise TpuError(
                f"slice {slice_.name} is not READY after {timeout:g} s (it is {state}): check it "
                f"with `dew-tpu status {slice_.name}`, or delete it with `dew-tpu delete "
                f"{slice_.name} --yes`"
            )
        gcloud.sleep(poll)


def create(gcloud: Gcloud, slice_: Slice, zones: list[str], spec: dict) -> tuple[Slice, dict]:
    """Creates the slice in the first of ``zones`` that accepts it and waits for READY. ``spec``:
    type, version, spot, queued, disk, timeout, poll."""
    type_name = need(spec["type"], "TPU type", "--type TYPE", "--type v5e-8")
    for z in zones:
        check_zone(z)
    for k, zone in enumerate(zones):
        here = Slice(slice_.name, zone, slice_.project, slice_.user)
        argv = create_argv(
            here, type_name, spec["version"], spec["spot"], spec["queued"], spec["disk"]
        )
        try:
            gcloud.run(argv)
        except GcloudError as error:
            if k + 1 == len(zones):
                raise
            print(f"dew-tpu: {error}\ndew-tpu: trying {zones[k + 1]}", file=sys.stderr)
            continue
        info = wait_ready(
            gcloud, here, queued=spec["queued"], timeout=spec["timeout"], poll=spec["poll"]
        )
        return here, info
    raise AssertionError("unreachable")  # pragma: no cover


def delete_argv(slice_: Slice, queued: bool, yes: bool) -> list[str]:
    if queued:  # --force deletes the request's TPU VM with it
        return [*QUEUED, "delete", slice_.name, *slice_.place(), "--force", "--quiet"]
    return [*TPU_VM, "delete", slice_.name, *slice_.place()] + (["--quiet"] if yes else [])


def delete(gcloud: Gcloud, slice_: Slice, queued: bool, yes: bool) -> None:
    gcloud.run(delete_argv(slice_, queued, yes), interactive=not (yes or queued))


def start_stop(gcloud: Gcloud, slice_: Slice, verb: str) -> None:
    gcloud.run([*TPU_VM, verb, slice_.name, *slice_.place()])


def list_slices(gcloud: Gcloud, zones: list[str], project, queued: bool) -> None:
    for zone in zones:
        place = [f"--zone={check_zone(zone)}"] + ([f"--project={project}"] if project else [])
        gcloud.run([*TPU_VM, "list", *place])
        if queued:
            gcloud.run([*QUEUED, "list", *place])


def describe_slice(gcloud: Gcloud, slice_: Slice, queued: bool) -> None:
    group = QUEUED if queued else TPU_VM
    gcloud.run([*group, "describe", slice_.name, *slice_.place()])


# Printed by a worker for `status`: the newest job under ~/dew-runs and whether it runs.
JOB_QUERY = (
    'j=$(ls -t "$HOME/dew-runs" 2>/dev/null | head -n 1); '
    'if [ -z "$j" ]; then echo "dew-job none"; exit 0; fi; '
    'd="$HOME/dew-runs/$j"; p=$(cat "$d/worker-0.pid" 2>/dev/null); '
    'if [ -f "$d/worker-0.exit" ]; then echo "dew-job $j exited $(cat "$d/worker-0.exit")"; '
    'elif [ -n "$p" ] && kill -0 "$p" 2>/dev/null; then echo "dew-job $j running"; '
    'else echo "dew-job $j died"; fi'
)


def status(gcloud: Gcloud, slice_: Slice) -> int:
    """Prints the slice's state, health, type, workers and its newest job; 1 when not READY."""
    info = describe(gcloud, slice_)
    if info is None:
        raise TpuError(f"there is no slice {slice_.name!r} in {slice_.zone}: `dew-tpu list`")
    if gcloud.dry_run:
        gcloud.run(slice_.ssh(0, JOB_QUERY))
        return 0
    scheduling = info.get("schedulingConfig") or {}
    endpoints = [e.get("ipAddress", "?") for e in info.get("networkEndpoints") or []]
    rows = [
        ("slice", f"{slice_.name} in {slice_.zone}"),
        ("state", info.get("state", "?")),
        ("health", info.get("health", "-")),
        ("type", info.get("acceleratorType", "?")),
        ("runtime", info.get("runtimeVersion", "?")),
        ("spot", "yes" if scheduling.get("spot") or scheduling.get("preemptible") else "no"),
        ("workers", f"{len(endpoints)}: {' '.join(endpoints)}" if endpoints else "-"),
    ]
    job = "-"
    if info.get("state") == "READY":
        answer = gcloud.run(slice_.ssh(0, JOB_QUERY), capture=True, check=False, quiet=True)
        lines = [ln for ln in answer.stdout.splitlines() if ln.startswith("dew-job ")]
        job = lines[0][len("dew-job ") :] if lines else f"unknown ({answer.stderr.strip()[:200]})"
    rows.append(("job", job))
    for key, value in rows:
        print(f"{key:8} {value}")
    return 0 if info.get("state") == "READY" else 1
