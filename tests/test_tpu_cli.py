"""``dew-tpu`` against a stand-in ``gcloud`` on ``PATH``.

The stand-in records its arguments and plays one scripted slice (``slice/``): ``describe``
walks through scripted states (CREATING -> READY, PREEMPTED), ``create`` and ``delete`` change it,
and ``ssh --command=C`` runs C with bash once per worker, in ``home/worker-<i>`` as that worker's
home (a stand-in ``curl`` answers the metadata server's worker number). Installs (``pip``,
``sudo``) are only recorded; the device check answers with the scripted device count.
"""

import shlex
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from dew.cli import tpu
from dew.cli.tpu import gcloud as tpu_gcloud
from dew.cli.tpu import remote, slices

G = "gcloud compute tpus tpu-vm"
Q = "gcloud compute tpus queued-resources"
P = "--zone=us-east5-a --project=proj"
D = f"{G} describe s1 {P} --format=json"

# A bash script, not Python: it runs a few hundred times, and bash starts in milliseconds.
STAND_IN_GCLOUD = r"""#!/bin/bash
here="$(cd "$(dirname "$0")/.." && pwd)"
{ printf '%s\0' "$@"; printf '\036\0'; } >> "$here/gcloud.calls"
S="$here/slice"
get() { cat "$S/$1" 2>/dev/null; }
pop() { if [ -s "$S/$1" ]; then head -n 1 "$S/$1" > "$S/$2"; sed -i 1d "$S/$1"; fi; }
group=$3 verb=$4 zone= worker= command= has_command=0
for a in "$@"; do
  case "$a" in
    --zone=*) zone=${a#--zone=} ;;
    --worker=*) worker=${a#--worker=} ;;
    --command=*) command=${a#--command=} has_command=1 ;;
  esac
done
for key in "$verb@$zone" "$verb"; do
  f="$S/fail/$key"
  if [ -f "$f" ]; then tail -n +2 "$f" >&2; exit "$(head -n 1 "$f")"; fi
done
n=$(get workers)
case "$verb" in
  create)
    echo yes > "$S/exists"; echo "$zone" > "$S/zone"
    cp "$S/after_create" "$S/states"; cp "$S/after_queue" "$S/queue_states"
    echo "Create request issued for: [$5]" >&2 ;;
  delete) echo no > "$S/exists" ;;
  describe)
    if [ "$group" = queued-resources ]; then
      pop queue_states queue_state; get queue_state; exit 0
    fi
    if [ "$(get exists)" != yes ] || [ "$zone" != "$(get zone)" ]; then
      echo "ERROR: (gcloud.compute.tpus.tpu-vm.describe) NOT_FOUND: $5 not found" >&2; exit 1
    fi
    pop states state
    endpoints=
    for ((i = 0; i < n; i++)); do endpoints+="${endpoints:+, }{\"ipAddress\": \"10.0.0.$i\"}"; done
    printf '{"name": "%s", "state": "%s", "health": "HEALTHY", "acceleratorType": "%s", ' \
      "$5" "$(get state)" "$(get type)"
    printf '"runtimeVersion": "%s", "networkEndpoints": [%s], ' "$(get version)" "$endpoints"
    if [ -s "$S/disk" ]; then printf '"dataDisks": [{"sourceDisk": "%s"}], ' "$(get disk)"; fi
    echo '"schedulingConfig": {"spot": true}}' ;;
  scp)
    paths=()
    for a in "${@:5}"; do case "$a" in --*) ;; *) paths+=("$a") ;; esac; done
    if [ -f "${paths[0]}" ]; then
      for ((i = 0; i < n; i++)); do cp "${paths[0]}" "$here/home/worker-$i/${paths[1]#*:}"; done
    fi ;;
  ssh)
    [ "$has_command" = 1 ] || exit 0
    p=$(get preempt_on)
    if [ -n "$p" ] && [[ "$command" == *"$p"* ]]; then
      echo PREEMPTED > "$S/state"; rm -f "$S/preempt_on"
      echo "Connection to 10.0.0.0 closed by remote host." >&2; exit 255
    fi
    if [[ "$command" == *dew-devices* ]]; then
      for ((i = 0; i < n; i++)); do echo "[$i] dew-devices $(get devices)"; done; exit 0
    fi
    if [[ "$command" == *"pip install"* || "$command" == *sudo* ]]; then exit 0; fi
    if [ "$worker" = all ]; then chosen=$(seq 0 $((n - 1))); else chosen=$worker; fi
    for i in $chosen; do
      (cd "$here/home/worker-$i" && HOME="$PWD" DEW_STANDIN_WORKER=$i bash -c "$command") || exit $?
    done ;;
esac
"""

SLICE = dict(
    exists=True,
    zone="us-east5-a",
    state="READY",
    states=[],
    after_create=["CREATING", "READY"],
    queue_state="ACTIVE",
    queue_states=[],
    after_queue=["WAITING_FOR_RESOURCES", "ACTIVE"],
    type="v5p-16",
    version="v2-alpha-tpuv5",
    workers=2,
    devices=8,
    preempt_on=None,
    fail={},
)


class StandIn:
    def __init__(self, root: Path):
        self.root = root

    def script(self, **changes):
        """Changes the scripted slice: one file a value, a list one line an item."""
        folder = self.root / "slice"
        folder.mkdir(exist_ok=True)
        for key, value in changes.items():
            if key == "fail":  # {"verb" or "verb@zone": [exit code, stderr]}
                shutil.rmtree(folder / "fail", ignore_errors=True)
                (folder / "fail").mkdir(parents=True)
                for name, (code, text) in value.items():
                    (folder / "fail" / name).write_text(f"{code}\n{text}\n")
            elif value is None:
                (folder / key).unlink(missing_ok=True)
            else:
                if isinstance(value, bool):
                    value = "yes" if value else "no"
                lines = value if isinstance(value, list) else [value]
                (folder / key).write_text("".join(f"{v}\n" for v in lines))

    def calls(self) -> list[str]:
        """Every gcloud command line so far, as ``--dry-run`` prints them."""
        log = self.root / "gcloud.calls"
        records = log.read_bytes().split(b"\x1e\0")[:-1] if log.exists() else []
        return [shlex.join(["gcloud", *r.decode().split("\0")[:-1]]) for r in records]

    def home(self, worker: int) -> Path:
        return self.root / "home" / f"worker-{worker}"


@pytest.fixture
def gcloud(tmp_path, monkeypatch):
    """The stand-in gcloud (and curl) on PATH, a config file with project, zone and type, and a
    git checkout ``proj-repo`` as the current folder."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "gcloud"
    script.write_text(STAND_IN_GCLOUD)
    curl = bin_dir / "curl"
    curl.write_text('#!/bin/sh\necho "$DEW_STANDIN_WORKER"\n')
    for path in (script, curl):
        path.chmod(0o755)
    for i in range(2):
        (tmp_path / "home" / f"worker-{i}").mkdir(parents=True)
    stand_in = StandIn(tmp_path)
    stand_in.script(**SLICE)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("DEW_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    write_config(tmp_path / "config", 'project = "proj"\nzones = ["us-east5-a"]\ntype = "v5p-16"')
    repo = tmp_path / "proj-repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "a.py").write_text("A = 1\n")
    (repo / ".gitignore").write_text("*.log\n")
    (repo / "out.log").write_text("ignored\n")
    (repo / "data.bin").write_text("excluded\n")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "add", "pkg", ".gitignore"], cwd=repo, check=True)
    (repo / "b.py").write_text("B = 2\n")  # untracked, not ignored: synced
    monkeypatch.chdir(repo)
    return stand_in


def write_config(folder: Path, text: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tpu.toml").write_text(text + "\n")


def ssh(worker, command: str, name="s1") -> str:
    return f"{G} ssh {name} {P} --worker={worker} " + shlex.quote(f"--command={command}")


def sync_lines(name="s1", unpack=True) -> list[str]:
    pack = ".dew-sync-proj-repo.tar.gz"
    lines = [f"{G} scp ARCHIVE {name}:{pack} {P} --worker=all"]
    if unpack:
        lines.append(
            ssh(
                "all",
                'mkdir -p "$HOME"/proj-repo && tar -xzf "$HOME"/.dew-sync-proj-repo.tar.gz -C '
                '"$HOME"/proj-repo && rm -f "$HOME"/.dew-sync-proj-repo.tar.gz',
                name,
            )
        )
    return lines


def dry_run(argv: list[str]) -> list[str]:
    """``argv`` with ``--dry-run`` before any ``-- COMMAND``."""
    split = argv.index("--") if "--" in argv else len(argv)
    return [*argv[:split], "--dry-run", *argv[split:]]


def masked(lines, root: Path) -> list[str]:
    """Command lines with the local sync archive's path as ARCHIVE, comments left out."""
    archive = str(root / "dew-sync-proj-repo.tar.gz")
    return [ln.replace(archive, "ARCHIVE") for ln in lines if not ln.startswith("#")]


INSTALL = remote.install_script("'dew-ml[gcs]'")
JOB_ENV = {"DEW_BUCKET": "gs://b", "DEW_RUN_DIR": "gs://b/dew-runs/j"}
START = remote.start_script("j", ["sleep", "0.3"], "proj-repo", {})
# Each command: its arguments, the lines --dry-run prints, and (when they differ) the gcloud
# calls a real run against the stand-in makes.
COMMANDS = {
    "init": (["init", "--zones", "us-east5-a,us-central1-a", "--bucket", "gs://b"], None, None),
    "create": (
        ["create", "s1", "--spot", "--poll", "0"],
        [f"{G} create s1 {P} --accelerator-type=v5p-16 --version=v2-alpha-tpuv5 --spot", D],
        [f"{G} create s1 {P} --accelerator-type=v5p-16 --version=v2-alpha-tpuv5 --spot", D, D],
    ),
    "delete": (["delete", "s1", "--yes"], [f"{G} delete s1 {P} --quiet"], None),
    "start": (["start", "s1"], [f"{G} start s1 {P}"], None),
    "stop": (["stop", "s1"], [f"{G} stop s1 {P}"], None),
    "list": (["list", "--queued"], [f"{G} list {P}", f"{Q} list {P}"], None),
    "describe": (["describe", "s1"], [f"{G} describe s1 {P}"], None),
    "status": (["status", "s1"], [D, ssh(0, slices.JOB_QUERY)], None),
    "ssh": (
        ["ssh", "s1", "-L", "8888"],
        [D, f"{G} ssh s1 {P} --worker=0 -- -L 8888:localhost:8888"],
        None,
    ),
    "run": (
        ["run", "s1", "--", "echo", "hi there"],
        [D, ssh("all", "export PATH=\"$HOME/dew-venv/bin:$PATH\"; echo 'hi there'")],
        None,
    ),
    "copy": (
        ["copy", "s1", "data", ":data"],
        [D, f"{G} scp --recurse data s1:data {P} --worker=all"],
        None,
    ),
    "sync": (["sync", "s1"], [D, *sync_lines()], None),
    "setup": (["setup", "s1"], [D, ssh("all", INSTALL), ssh("all", remote.DEVICES_SCRIPT)], None),
    "train": (
        ["train", "s1", "--job", "j", "--detach", "--start-check", "0.1", "--", "sleep", "0.3"],
        [D, *sync_lines(), ssh("all", START), ssh("all", remote.check_script("j", 20))],
        None,
    ),
    "logs": (
        ["logs", "s1", "j", "--lines", "5"],
        [D, ssh(0, 'tail -n 5 "$HOME"/dew-runs/j/worker-0.log')],
        None,
    ),
    "reset": (["reset", "s1"], [D, ssh("all", remote.RESET_SCRIPT)], None),
    "spawn": (
        [
            "spawn",
            "sw",
            "2",
            "--job",
            "j",
            "--poll",
            "0",
            "--start-check",
            "0",
            "--",
            "sleep",
            "0.3",
        ],
        None,
        None,
    ),
}


def spawn_lines(real: bool) -> list[str]:
    lines = []
    for i in range(2):
        name = f"sw-{i}"
        describe = f"{G} describe {name} {P} --format=json"
        env = {"DEW_SPAWN_INDEX": str(i), "DEW_SPAWN_COUNT": "2"}
        start = remote.start_script("j", ["sleep", "0.3"], "proj-repo", env)
        lines += [
            f"{G} create {name} {P} --accelerator-type=v5p-16 --version=v2-alpha-tpuv5",
            *([describe] * (2 if real else 1)),
            f"{G} ssh {name} {P} --worker=all " + shlex.quote(f"--command={INSTALL}"),
            ssh("all", remote.DEVICES_SCRIPT, name),
            *sync_lines(name),
            ssh("all", start, name),
            ssh("all", remote.check_script("j", 20), name),
        ]
    return lines


def test_the_seventeen_commands():
    assert set(COMMANDS) == set(tpu.build_parser()._subparsers._group_actions[0].choices)
    assert len(COMMANDS) == 17


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_command_under_dry_run_and_for_real(name, gcloud, capsys):
    argv, dry, real = COMMANDS[name]
    if name == "spawn":
        dry, real = spawn_lines(False), spawn_lines(True)
    if name == "init":
        path = gcloud.root / "config" / "tpu.toml"
        text = (
            "# dew-tpu's settings (dew-tpu init writes this file; flags override it).\n"
            'project = "proj"\n'
            'zones = ["us-east5-a", "us-central1-a"]\ntype = "v5p-16"\nversion = "auto"\n'
            'bucket = "gs://b"\n'
        )
        assert tpu.main(dry_run(argv)) == 0
        assert capsys.readouterr().out == f"# {path}\n{text}"
        assert tpu.main(argv) == 0
        assert path.read_text() == text
        return
    assert tpu.main(dry_run(argv)) == 0
    assert gcloud.calls() == []  # a dry run runs nothing
    assert masked(capsys.readouterr().out.splitlines(), gcloud.root) == dry
    if name == "logs":
        log = gcloud.home(0) / "dew-runs" / "j" / "worker-0.log"
        log.parent.mkdir(parents=True)
        log.write_text("".join(f"line {k}\n" for k in range(10)))
    assert tpu.main(argv) == 0
    assert masked(gcloud.calls(), gcloud.root) == (real or dry)
    out = capsys.readouterr().out
    if name == "logs":
        assert out == "".join(f"line {k}\n" for k in range(5, 10))
    if name == "run":
        assert out == "hi there\nhi there\n"  # once on each worker
    if name == "status":
        assert "state    READY" in out and "workers  2: 10.0.0.0 10.0.0.1" in out
        assert "job      none" in out
    if name == "setup":
        assert "setup: 2 worker(s), each sees 8 devices" in out
    if name in ("sync", "train", "spawn"):
        for worker in (0, 1):
            tree = gcloud.home(worker) / "proj-repo"
            files = sorted(str(p.relative_to(tree)) for p in tree.rglob("*") if p.is_file())
            assert files == [".gitignore", "b.py", "data.bin", "pkg/a.py"]  # not out.log


def test_create_translates_v5e_and_queues(gcloud, capsys):
    assert tpu.main(["create", "s1", "--type", "v5e-8", "--dry-run"]) == 0
    assert tpu.main(["create", "s1", "--queued", "--dry-run", "--version", "v2-x"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"{G} create s1 {P} --accelerator-type=v5litepod-8 --version=v2-alpha-tpuv5-lite",
        D,
        f"{Q} create s1 --node-id=s1 {P} --accelerator-type=v5p-16 --runtime-version=v2-x",
        f"{Q} describe s1 {P} '--format=value(state.state)'",
        D,
    ]
    # For real: the queued resource waits, becomes ACTIVE, then the slice READY.
    assert tpu.main(["create", "s1", "--queued", "--spot", "--poll", "0"]) == 0
    queue = f"{Q} describe s1 {P} '--format=value(state.state)'"
    create = f"{Q} create s1 --node-id=s1 {P} --accelerator-type=v5p-16"
    assert gcloud.calls() == [
        f"{create} --runtime-version=v2-alpha-tpuv5 --spot",
        queue,
        queue,
        D,
        queue,
        D,
    ]
    assert "s1 in us-east5-a: WAITING_FOR_RESOURCES after 0 s" in capsys.readouterr().err


def test_create_tries_the_zones_in_order_and_times_out(gcloud, capsys):
    write_config(gcloud.root / "config", 'zones = ["us-east5-a", "us-central1-a"]\ntype = "v6e-8"')
    gcloud.script(fail={"create@us-east5-a": [1, "ERROR: RESOURCE_EXHAUSTED: no v6e capacity"]})
    assert tpu.main(["create", "s1", "--poll", "0"]) == 0
    where = "--zone=us-central1-a"
    assert gcloud.calls() == [
        f"{G} create s1 --zone=us-east5-a --accelerator-type=v6e-8 --version=v2-alpha-tpuv6e",
        f"{G} create s1 {where} --accelerator-type=v6e-8 --version=v2-alpha-tpuv6e",
        f"{G} describe s1 {where} --format=json",
        f"{G} describe s1 {where} --format=json",
    ]
    assert "RESOURCE_EXHAUSTED: no v6e capacity" in capsys.readouterr().err
    # A slice that stays CREATING: the timeout, with what to do.
    gcloud.script(after_create=["CREATING"] * 50, fail={})
    assert (
        tpu.main(["create", "s1", "--zone", "us-east5-a", "--timeout", "0.05", "--poll", "0.01"])
        == 1
    )
    err = capsys.readouterr().err
    assert "s1 in us-east5-a: CREATING after 0 s" in err
    assert "slice s1 is not READY after 0.05 s (it is CREATING)" in err
    assert "dew-tpu delete s1 --yes" in err


def test_a_slice_is_found_in_the_configured_zones(gcloud, capsys):
    write_config(gcloud.root / "config", 'zones = ["us-east5-a", "us-central1-a"]')
    gcloud.script(zone="us-central1-a")
    assert tpu.main(["describe", "s1"]) == 0
    assert gcloud.calls() == [
        f"{G} describe s1 --zone=us-east5-a --format=json",
        f"{G} describe s1 --zone=us-central1-a --format=json",
        f"{G} describe s1 --zone=us-central1-a",
    ]


def test_config_precedence(gcloud, capsys, monkeypatch, tmp_path):
    def project(*flags):
        assert tpu.main(["start", "s1", "--zone", "us-east5-a", "--dry-run", *flags]) == 0
        line = capsys.readouterr().out.strip()
        return line.split("--project=")[1] if "--project=" in line else None

    assert project() == "proj"  # $DEW_CONFIG_DIR/tpu.toml
    assert project("--project", "flag") == "flag"  # a flag wins over the file
    monkeypatch.delenv("DEW_CONFIG_DIR")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    write_config(tmp_path / "xdg" / "dew", 'project = "xdg"')
    assert project() == "xdg"  # $XDG_CONFIG_HOME/dew/tpu.toml
    monkeypatch.setenv("DEW_CONFIG_DIR", str(tmp_path / "dew-dir"))
    write_config(tmp_path / "dew-dir", 'project = "dew-dir"')
    assert project() == "dew-dir"  # $DEW_CONFIG_DIR before $XDG_CONFIG_HOME
    monkeypatch.delenv("DEW_CONFIG_DIR")
    monkeypatch.delenv("XDG_CONFIG_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home-dir"))
    assert project() is None  # no file: the default, gcloud's own project
    write_config(tmp_path / "home-dir" / ".config" / "dew", 'project = "home"')
    assert project() == "home"
    # The zone and the version too: the flag, else the file, else the default (auto).
    write_config(
        tmp_path / "home-dir" / ".config" / "dew", 'zones = ["europe-west4-a"]\nversion = "v9"'
    )
    assert tpu.main(["create", "s1", "--type", "v4-8", "--dry-run"]) == 0
    assert (
        tpu.main(
            [
                "create",
                "s1",
                "--type",
                "v4-8",
                "--zone",
                "us-central2-b",
                "--version",
                "auto",
                "--dry-run",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{G} create s1 --zone=europe-west4-a --accelerator-type=v4-8 --version=v9"
    v4 = "--accelerator-type=v4-8 --version=tpu-ubuntu2204-base"
    assert out[2] == f"{G} create s1 --zone=us-central2-b {v4}"


def test_init_asks_when_given_no_flags(gcloud, monkeypatch, capsys):
    answers = iter(["", "us-central2-b", "v4-8", "", "me", "gs://bucket"])
    monkeypatch.setattr("builtins.input", lambda prompt: next(answers))
    assert tpu.main(["init"]) == 0
    assert (gcloud.root / "config" / "tpu.toml").read_text().splitlines()[1:] == [
        'project = "proj"',
        'zones = ["us-central2-b"]',
        'type = "v4-8"',
        'version = "auto"',
        'user = "me"',
        'bucket = "gs://bucket"',
    ]
    # The user goes into ssh's and scp's host.
    assert tpu.main(["ssh", "s1", "--dry-run"]) == 0
    assert (
        capsys.readouterr().out.splitlines()[-1].startswith(f"{G} ssh me@s1 --zone=us-central2-b")
    )


def test_train_follows_worker_0_to_its_exit(gcloud, capsys):
    code = 'echo "step 1 on $DEW_TPU_WORKER in $(basename "$PWD")"; sleep 0.3'
    argv = ["train", "s1", "--job", "j", "--start-check", "0.1", "--", "sh", "-c", code]
    assert tpu.main(argv) == 0
    assert capsys.readouterr().out == "step 1 on 0 in proj-repo\n"  # in the synced tree
    log = gcloud.home(1) / "dew-runs" / "j" / "worker-1.log"
    assert log.read_text() == "step 1 on 1 in proj-repo\n"
    assert gcloud.calls()[-1] == ssh(0, remote.follow_script("j"))
    # Its exit code is train's. The command exits only once train follows worker 0's log (the
    # follow script, which alone names worker-0.exit, is in gcloud's log; the pattern is not that
    # text, which would find itself in the start call), so the start check always finds it
    # running, however slowly this machine runs.
    calls = gcloud.root / "gcloud.calls"
    calls.write_bytes(b"")  # the first run's follow call is not this one's
    argv[-1] = f"until grep -aq 'worker-0[.]exit' {calls}; do sleep 0.02; done; exit 7"
    assert tpu.main(argv) == 7
    assert "worker 0's command exited with 7" in capsys.readouterr().err


def test_train_fails_when_a_worker_dies_at_once(gcloud, capsys, monkeypatch):
    code = (
        'echo "loading on $DEW_TPU_WORKER"; echo "ValueError: no checkpoint on $DEW_TPU_WORKER"; '
        '[ "$DEW_TPU_WORKER" = 1 ] && exit 3; sleep 600'
    )
    # The start check's wait ends once worker 1 has exited (its exit file written), not after a
    # time this machine might not keep; worker 0 runs until it is stopped.
    exited = gcloud.home(1) / "dew-runs" / "j" / "worker-1.exit"

    def wait_for_worker_1(seconds):
        assert seconds == 0.5
        deadline = time.monotonic() + 60
        while not exited.exists() and time.monotonic() < deadline:
            time.sleep(0.02)

    real_init = tpu_gcloud.Gcloud.__init__
    monkeypatch.setattr(
        tpu_gcloud.Gcloud,
        "__init__",
        lambda self, dry_run=False: real_init(self, dry_run, sleep=wait_for_worker_1),
    )
    argv = ["train", "s1", "--job", "j", "--start-check", "0.5", "--", "sh", "-c", code]
    assert tpu.main(argv) == 1
    err = capsys.readouterr().err
    assert "worker 1 exited 3 within 0.5 s of its start" in err
    assert "~/dew-runs/j/worker-1.log:\n    loading on 1\n    ValueError: no checkpoint on 1" in err
    assert "worker 0 " not in err  # worker 0 was alive
    # The others were stopped: worker 0's process is gone, and nothing was followed.
    assert gcloud.calls()[-1] == ssh("all", remote.stop_script("j"))
    pid = int((gcloud.home(0) / "dew-runs" / "j" / "worker-0.pid").read_text())
    deadline = time.monotonic() + 5
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not alive(pid)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_spot_restart_recreates_sets_up_and_trains_again(gcloud, capsys):
    write_config(
        gcloud.root / "config", 'project = "proj"\nzones = ["us-east5-a"]\nbucket = "gs://b"'
    )
    # The first follow: the slice is preempted. It had a data disk, which the new one gets too.
    gcloud.script(preempt_on="tail -n +1", disk="projects/proj/zones/us-east5-a/disks/d1")
    code = 'echo "$DEW_RUN_DIR" >> "$HOME/starts.txt"; sleep 0.2'
    argv = ["train", "s1", "--job", "j", "--spot-restart", "--poll", "0", "--start-check", "0.1"]
    assert tpu.main([*argv, "--", "sh", "-c", code]) == 0
    start = remote.start_script("j", ["sh", "-c", code], "proj-repo", JOB_ENV)
    once = [*sync_lines(), ssh("all", start), ssh("all", remote.check_script("j", 20))]
    follow = ssh(0, remote.follow_script("j"))
    assert masked(gcloud.calls(), gcloud.root) == [
        D,
        *once,
        follow,  # preempted here
        D,  # PREEMPTED
        f"{G} delete s1 {P} --quiet",
        f"{G} create s1 {P} --accelerator-type=v5p-16 --version=v2-alpha-tpuv5 --spot "
        "--data-disk=source=projects/proj/zones/us-east5-a/disks/d1,mode=read-write",
        D,  # CREATING
        D,  # READY
        ssh("all", INSTALL),
        ssh("all", remote.DEVICES_SCRIPT),
        *once,
        follow,
    ]
    assert "slice s1 left READY (it is PREEMPTED): restart 1 of 10" in capsys.readouterr().err
    for worker in (0, 1):  # started twice, each time told where the checkpoints are
        assert (gcloud.home(worker) / "starts.txt").read_text() == "gs://b/dew-runs/j\n" * 2


def test_clear_errors(gcloud, capsys, monkeypatch, tmp_path):
    def error(*argv, code=None):
        result = tpu.main(list(argv))
        assert result != 0 and (code is None or result == code)
        return capsys.readouterr().err

    # An unknown type lists the valid ones (dew.targets').
    err = error("create", "s1", "--type", "v9z-8", code=2)
    assert "unknown --type 'v9z-8'" in err and "v5e-8" in err and "v5p-16" in err
    err = error("create", "s1", "--type", "v5e-12", code=2)
    assert "'v5e-12' is not a v5e slice" in err and "Valid types: v4-8" in err
    # An unknown zone: by its form, before gcloud; or by gcloud's answer, with its stderr.
    assert "unknown zone 'useast5'" in error("start", "s1", "--zone", "useast5", code=2)
    err = error("init", "--zones", "us-east5-a,,us-central1-a", code=2)
    assert "--zones 'us-east5-a,,us-central1-a' has an empty entry" in err
    gcloud.script(fail={"start": [1, "ERROR: NOT_FOUND: Location mars-north1-a not found"]})
    err = error("start", "s1", "--zone", "mars-north1-a", code=1)
    assert "ERROR: NOT_FOUND: Location mars-north1-a not found" in err
    assert "Is mars-north1-a a TPU zone? `gcloud compute tpus locations list`" in err
    # Every failed gcloud call shows its stderr.
    gcloud.script(fail={"stop": [4, "ERROR: (gcloud) PERMISSION_DENIED on proj"]})
    err = error("stop", "s1", code=4)
    assert "exited with 4; its stderr:\n  ERROR: (gcloud) PERMISSION_DENIED on proj" in err
    # A slice that is not READY, or not there.
    gcloud.script(fail={}, state="PREEMPTED")
    err = error("setup", "s1")
    assert "slice s1 is PREEMPTED, not READY: delete and re-create it" in err
    gcloud.script(exists=False)
    assert "there is no slice 's1' in us-east5-a: create it with `dew-tpu create" in error(
        "ssh", "s1"
    )
    # Missing config values.
    write_config(gcloud.root / "config", 'project = "proj"')
    assert "no zone: give --zone ZONE, or save it in" in error("status", "s1", code=2)
    assert "`dew-tpu init --type v5e-8`" in error("create", "s1", "--zone", "us-east5-a", code=2)
    err = error("train", "s1", "--zone", "us-east5-a", "--spot-restart", "--", "x", code=2)
    assert "no bucket: give --bucket gs://B" in err
    # A command where none is taken, or none where one is needed.
    assert "takes no command after --" in error("delete", "s1", "--", "echo", code=2)
    assert "give the command to run after --" in error("run", "s1", "--zone", "us-east5-a", code=2)
    # A setup whose workers do not see the whole slice.
    write_config(gcloud.root / "config", 'zones = ["us-east5-a"]')
    gcloud.script(exists=True, state="READY", devices=4)
    err = error("setup", "s1")
    assert "jax.device_count() must be 8 on every worker of v5p-16 (2 workers)" in err
    assert "worker 0 sees 4; worker 1 sees 4" in err and "dew-tpu reset s1" in err
    # No gcloud at all.
    before = len(gcloud.calls())
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert "gcloud is not on PATH; install the Google Cloud CLI" in error("list", code=2)
    assert len(gcloud.calls()) == before


def test_console_script_is_declared(monkeypatch, capsys):
    """pyproject.toml names dew-tpu's entry point, and the package runs as a program."""
    import runpy
    import tomllib

    root = Path(__file__).resolve().parents[1]
    scripts = tomllib.loads((root / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["dew-tpu"] == "dew.cli.tpu:main"
    monkeypatch.setenv("DEW_CONFIG_DIR", str(root / "no-such-folder"))
    monkeypatch.setattr(
        "sys.argv", ["dew-tpu", "delete", "s1", "--zone", "us-east5-a", "--dry-run"]
    )
    with pytest.raises(SystemExit) as exit:
        runpy.run_module("dew.cli.tpu", run_name="__main__")
    assert exit.value.code == 0
    assert capsys.readouterr().out == f"{G} delete s1 --zone=us-east5-a\n"
