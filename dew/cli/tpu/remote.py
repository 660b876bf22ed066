"""Commands on the workers: ssh, run, copy, sync, setup, reset, and the shell each one runs.

Every worker learns its number from the TPU VM's metadata server (``agent-worker-number``), so one
``ssh --worker=all`` gives each worker its own log file. A job ``J`` lives in ``~/dew-runs/J`` on
every worker: ``worker-<i>.log`` (its output), ``worker-<i>.pid`` (its process group) and
``worker-<i>.exit`` (its exit code, once it has ended).
"""

from __future__ import annotations

import fnmatch
import os
import re
import shlex
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from dew.cli.tpu.config import DEFAULT_PACKAGE, TpuError, slice_target
from dew.cli.tpu.gcloud import TPU_VM, Gcloud, Slice

VENV = "dew-venv"  # the virtual environment setup makes in each worker's home
WORKER_ID = (
    "i=$(curl -s -H Metadata-Flavor:Google "
    "http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number)"
)
ENVIRONMENT = f'export PATH="$HOME/{VENV}/bin:$PATH"'


def home(path: str) -> str:
    """``path`` under the worker's home, quoted for its shell, ``$HOME`` left to expand."""
    return '"$HOME"/' + shlex.quote(path)


def job_dir(job: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", job):
        raise TpuError(f"a job name is letters, digits, '.', '_' and '-', got {job!r}", 2)
    return home(f"dew-runs/{job}")


# ssh and run


def ssh(gcloud: Gcloud, slice_: Slice, worker: str, forwards: list[str]) -> int:
    """An interactive shell on one worker; ``-L PORT`` forwards localhost:PORT to it."""
    argv = slice_.ssh(worker)
    if forwards:
        argv.append("--")
        for forward in forwards:
            argv += ["-L", forward if ":" in forward else f"{forward}:localhost:{forward}"]
    return gcloud.run(argv, interactive=True, check=False).code


def start_script(job: str, command: list[str], cwd: str | None, env: dict[str, str]) -> str:
    """Starts ``command`` detached (its own session, so it outlives ssh and can be stopped as a
    group), with its output in ``~/dew-runs/J/worker-<i>.log``."""
    d = job_dir(job)
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in {"DEW_JOB": job, **env}.items())
    inner = f'{shlex.join(command)}; echo $? > "$0"'
    # The setup is one list that exits on failure; `cmd &` alone, so that $! is its process.
    go = home(cwd) if cwd else '"$HOME"'
    return (
        f"{WORKER_ID}; {ENVIRONMENT}; export DEW_TPU_WORKER=$i {exports}; d={d}; "
        f'mkdir -p "$d" && rm -f "$d/worker-$i.exit" && cd {go} || exit 1; '
        f'setsid nohup bash -c {shlex.quote(inner)} "$d/worker-$i.exit" '
        f'> "$d/worker-$i.log" 2>&1 < /dev/null & echo $! > "$d/worker-$i.pid"'
    )


def check_script(job: str, lines: int) -> str:
    """Prints ``dew-worker I running`` or ``dew-worker I exited C`` (``died``: no exit code, a
    signal) and, for one that is not running, its last ``lines`` log lines as ``dew-log I ...``.
    The exit code is looked at first: an ended process can linger a moment as a zombie."""
    return (
        f'{WORKER_ID}; d={job_dir(job)}; p=$(cat "$d/worker-$i.pid" 2>/dev/null); '
        'if [ -f "$d/worker-$i.exit" ]; then s="exited $(cat "$d/worker-$i.exit")"; '
        'elif [ -n "$p" ] && kill -0 "$p" 2>/dev/null; then s=running; else s=died; fi; '
        'echo "dew-worker $i $s"; if [ "$s" != running ]; then '
        f'tail -n {lines} "$d/worker-$i.log" 2>/dev/null | sed "s/^/dew-log $i /"; fi'
    )


def stop_script(job: str) -> str:
    """Ends the job's process group on every worker."""
    return (
        f"{WORKER_ID}; p=$(cat {job_dir(job)}/worker-$i.pid 2>/dev/null); "
        'if [ -n "$p" ]; then kill -TERM -- "-$p" 2>/dev/null; fi; true'
    )


def follow_script(job: str) -> str:
    """Prints worker 0's log until its process ends (its exit code written, or the process gone),
    then exits with its exit code."""
    d = job_dir(job)
    return (
        f'd={d}; p=$(cat "$d/worker-0.pid" 2>/dev/null); '
        'tail -n +1 -s 0.2 -f "$d/worker-0.log" & t=$!; '
        'while [ ! -f "$d/worker-0.exit" ] && [ -n "$p" ] && kill -0 "$p" 2>/dev/null; '
        'do sleep 0.2; done; sleep 0.3; kill "$t"; '
        'exit "$(cat "$d/worker-0.exit" 2>/dev/null || echo 1)"'
    )


def parse_check(output: str) -> tuple[dict[int, str], dict[int, list[str]]]:
    """``check_script``'s answers: each worker's status and log tail."""
    status, logs = {}, {}
    for line in output.splitlines():
        if m := re.match(r"dew-worker (\d+) (.*)$", line):
            status[int(m.group(1))] = m.group(2)
        elif m := re.match(r"dew-log (\d+) ?(.*)$", line):
            logs.setdefault(int(m.group(1)), []).append(m.group(2))
    return status, logs


def run(gcloud: Gcloud, slice_: Slice, worker: str, command: list[str]) -> int:
    """``command`` on one worker or all, with the venv on PATH, its output here."""
    script = f"{ENVIRONMENT}; {shlex.join(command)}"
    return gcloud.run(slice_.ssh(worker, script), check=False).code


# copy and sync


def copy(gcloud: Gcloud, slice_: Slice, src: str, dst: str, worker: str | None) -> None:
    """``SRC DST``: a path written ``:path`` (or ``NAME:path``) is on the workers; with neither,
    DST is. Uploads go to every worker by default; a download comes from worker 0."""
    prefix = f"{slice_.name}:"

    def remote(path):
        return path.startswith(":") or path.startswith(prefix)

    def on_workers(path):
        return f"{slice_.host}:{path.split(':', 1)[1]}"

    if remote(src) and remote(dst):
        raise TpuError("copy goes between here and the workers: one of SRC and DST is local", 2)
    if remote(src):
        worker = "0" if worker is None else worker
        if worker == "all":
            raise TpuError("a download comes from one worker: give --worker K", 2)
        paths = [on_workers(src), dst]
    else:
        worker = "all" if worker is None else worker
        paths = [src, on_workers(dst) if remote(dst) else f"{slice_.host}:{dst}"]
    gcloud.run([*TPU_VM, "scp", "--recurse", *paths, *slice_.place(), f"--worker={worker}"])


def git_root(cwd: str | None = None) -> Path:
    done = subprocess.run(
        ["git", "rev-parse", "--show-toplevel"], cwd=cwd, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise TpuError(
            f"sync copies the git tree of the current folder, and {os.getcwd()} is in no git "
            "repository: cd into your checkout (or `git init` there); train takes --no-sync",
            2,
        )
    return Path(done.stdout.strip())


def tree_files(root: Path, excludes: list[str]) -> list[str]:
    """The tree's files as git sees them (tracked, and untracked ones .gitignore does not
    ignore), less those matching an ``--exclude`` pattern (a path or any folder above it)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\0")
    files = []
    for path in sorted({p for p in listed if p}):
        parts = path.split("/")
        prefixes = ["/".join(parts[: k + 1]) for k in range(len(parts))]
        if any(fnmatch.fnmatch(p, pat) for pat in excludes for p in prefixes + parts):
            continue
        if (root / path).is_file():
            files.append(path)
    return files


def sync(gcloud: Gcloud, slice_: Slice, excludes: list[str], delete: bool) -> str:
    """Copies the git tree to ``~/<repo>`` on every worker (``delete``: removing what the tree
    does not hold); returns ``<repo>``."""
    root = git_root()
    repo = root.name
    archive = Path(tempfile.gettempdir()) / f"dew-sync-{repo}.tar.gz"
    files = tree_files(root, excludes)
    packed = f".dew-sync-{repo}.tar.gz"
    print(
        f"# {len(files)} files of {root} (git ls-files, .gitignore honoured) -> {archive}",
        file=sys.stdout if gcloud.dry_run else sys.stderr,
    )
    if not gcloud.dry_run:
        with tarfile.open(archive, "w:gz") as tar:
            for path in files:
                tar.add(root / path, arcname=path, recursive=False)
    try:
        gcloud.run(
            [
                *TPU_VM,
                "scp",
                str(archive),
                f"{slice_.host}:{packed}",
                *slice_.place(),
                "--worker=all",
            ]
        )
    finally:
        if not gcloud.dry_run:
            archive.unlink(missing_ok=True)
    target, a = home(repo), home(packed)
    if delete:
        fresh = home(f".dew-sync-{repo}.new")
        unpack = (
            f"rm -rf {fresh} && mkdir -p {fresh} && tar -xzf {a} -C {fresh} && "
            f"rm -rf {target} && mv {fresh} {target} && rm -f {a}"
        )
    else:
        unpack = f"mkdir -p {target} && tar -xzf {a} -C {target} && rm -f {a}"
    gcloud.run(slice_.ssh("all", unpack))
    return repo


# setup and reset


def install_script(package: str) -> str:
    venv, pip = home(VENV), home(f"{VENV}/bin/pip")
    return (
        f"(python3 -m venv {venv} || (sudo apt-get update -q && sudo apt-get install -y -q "
        f"python3-venv && python3 -m venv {venv})) && {pip} install -q -U pip && "
        f"{pip} install -U 'jax[tpu]' {package}"
    )


DEVICES_SCRIPT = (
    f"{ENVIRONMENT}; {WORKER_ID}; "
    "python -c 'import jax; print(\"dew-devices\", jax.device_count())' 2>&1 | "
    'sed "s/^/[$i] /"'
)


def setup(
    gcloud: Gcloud,
    slice_: Slice,
    info: dict,
    *,
    source: bool,
    package: str | None,
    excludes: list[str] = (),
) -> None:
    """Installs ``jax[tpu]`` and Dew (``package``, or the synced tree with ``source``) into
    ``~/dew-venv`` on every worker, then checks that each worker's JAX sees the whole slice."""
    if source:
        repo = sync(gcloud, slice_, list(excludes), delete=False)
        package = home(repo) + "'[gcs]'"
    else:
        package = shlex.quote(package or DEFAULT_PACKAGE)
    gcloud.run(slice_.ssh("all", install_script(package)))
    answer = gcloud.run(slice_.ssh("all", DEVICES_SCRIPT), capture=True)
    if gcloud.dry_run or not info.get("acceleratorType"):
        return
    target = slice_target(info["acceleratorType"])
    counts = re.findall(r"^\[(\d+)\] dew-devices (\d+)$", answer.stdout, re.MULTILINE)
    seen = {int(w): int(n) for w, n in counts}
    wrong = {w: n for w, n in seen.items() if n != target.chips}
    missing = sorted(set(range(target.hosts)) - set(seen))
    if wrong or missing:
        said = "; ".join(f"worker {w} sees {n}" for w, n in sorted(wrong.items()))
        if missing:
            said += ("; " if said else "") + f"no count from worker(s) {missing}"
        raise TpuError(
            f"setup: jax.device_count() must be {target.chips} on every worker of "
            f"{info['acceleratorType']} ({target.hosts} workers): {said}. Its output:\n"
            f"{answer.stdout.strip()}\nAnother process may hold the TPU: `dew-tpu reset "
            f"{slice_.name}`, then `dew-tpu setup {slice_.name}` again"
        )
    print(f"setup: {target.hosts} worker(s), each sees {target.chips} devices")


RESET_SCRIPT = (
    'for p in "$HOME"/dew-runs/*/worker-*.pid; do [ -f "$p" ] && '
    'kill -TERM -- "-$(cat "$p")" 2>/dev/null; done; '
    "pids=$(sudo lsof -t /dev/accel* /dev/vfio/* 2>/dev/null | sort -u); "
    'if [ -n "$pids" ]; then sudo kill -TERM $pids; sleep 3; sudo kill -KILL $pids 2>/dev/null; '
    'fi; sudo rm -f /tmp/libtpu_lockfile; echo "reset: $(hostname) done"'
)


def reset(gcloud: Gcloud, slice_: Slice) -> None:
    """Ends Dew's jobs and every process holding a TPU device, on every worker."""
    gcloud.run(slice_.ssh("all", RESET_SCRIPT))


def log_tail(job: str, worker: str, lines: int, follow: bool) -> str:
    f = " -f" if follow else ""
    if worker == "all":
        sed = "sed -u" if follow else "sed"
        return f'{WORKER_ID}; tail -n {lines}{f} {job_dir(job)}/worker-$i.log | {sed} "s/^/[$i] /"'
    return f"tail -n {lines}{f} {job_dir(job)}/worker-{worker}.log"


def logs(gcloud: Gcloud, slice_: Slice, job: str, worker: str, lines: int, follow: bool) -> int:
    return gcloud.run(slice_.ssh(worker, log_tail(job, worker, lines, follow)), check=False).code


def say(text: str) -> None:
    print(f"dew-tpu: {text}", file=sys.stderr, flush=True)
