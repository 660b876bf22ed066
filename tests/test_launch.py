"""``dew launch`` and ``prepare_process(multi_host=True)`` from the environment.

One launched run of tests/launch_train.py (2 processes x 4 CPU devices, no arguments to
``prepare_process``) is shared by the tests of training, a signalled rank, rank prefixes and a dying
rank; the other tests start small Python processes that need no JAX.
"""

import json
import os
import queue
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import dew
from dew import _jax_compat
from dew.cli.launch import process_hosts, read_hostfile
from dew.data import TokenWindows
from dew.training import runtime
from tests.helpers import SEQ, child_env, random_token_folder, relative_error, two_process_trainer

ROOT = Path(__file__).resolve().parents[1]
# The step both ranks print before rank 1 is sent SIGTERM.
STEPS = 3
# How long a launched process may take to get where a test waits for it (a loaded machine
# compiles slowly); passing it fails the test.
START_BOUND_S = 300
# How long dew launch may take to stop the others once a rank has died; passing it fails the test.
STOP_BOUND_S = 60


def child_environment(**extra) -> dict:
    """This environment without the test session's 8-device XLA setup, with the repository
    importable."""
    env = child_env()
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


class Launched:
    """``python -m dew launch ARGS`` running, its output lines collected as they come."""

    def __init__(self, *args, cwd=ROOT, env=None):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "dew", "launch", *map(str, args)],
            cwd=cwd,
            env=env or child_environment(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.stdout, self.stderr = [], []
        self.lines = queue.Queue()
        self.threads = [
            threading.Thread(target=self._read, args=(stream, kept), daemon=True)
            for stream, kept in (
                (self.process.stdout, self.stdout),
                (self.process.stderr, self.stderr),
            )
        ]
        for thread in self.threads:
            thread.start()

    def _read(self, stream, kept):
        for line in stream:
            kept.append(line.rstrip("\n"))
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)  # this stream ended

    def wait_for_lines(self, wanted: set[str], bound: float = START_BOUND_S) -> None:
        """Blocks until a line beginning with each of ``wanted`` was printed; fails the test
        after ``bound`` s."""
        missing, ended = set(wanted), 0
        deadline = time.monotonic() + bound
        while missing:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.abort()
                pytest.fail(f"no {sorted(missing)} within {bound} s; stderr: {self.stderr[-20:]}")
            ended += line is None
            if ended == 2:
                pytest.fail(
                    f"dew launch ended before printing {sorted(missing)}: {self.stderr[-20:]}"
                )
            missing = {m for m in missing if line is None or not line.startswith(m)}

    def abort(self) -> None:
        """Ends a launch a test gave up on, and what it started: a second signal makes dew launch
        SIGKILL its processes (which a plain kill of dew launch would leave running)."""
        self.process.send_signal(signal.SIGTERM)
        self.process.send_signal(signal.SIGINT)  # another signal: two SIGTERMs could merge
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()

    def finish(self, bound: float) -> int:
        """The exit code; fails the test when dew launch is still running ``bound`` s on."""
        try:
            code = self.process.wait(timeout=bound)
        except subprocess.TimeoutExpired:
            self.abort()
            pytest.fail(f"dew launch still ran {bound} s on; stderr: {self.stderr[-20:]}")
        for thread in self.threads:
            thread.join()
        return code


def pid_is_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def printed_pids(lines) -> dict[int, int]:
    """The pids the processes printed as ``pid N``, by rank."""
    found = (re.fullmatch(r"\[(\d+)\] pid (\d+)", line) for line in lines)
    return {int(m[1]): int(m[2]) for m in found if m}


# --------------------------------------------------------------------------- the launched run


# The tests of the launched run go to one worker, which launches it once (a module fixture runs
# once per worker that runs a test of its module).
ON_THE_LAUNCHED_RUNS_WORKER = pytest.mark.xdist_group("launched-run")


@pytest.fixture(scope="module")
def launched_run(tmp_path_factory, module_seed):
    """Two launched processes train (far more steps than they get to) until, once both have
    printed step STEPS, rank 1 alone gets SIGTERM: both stop after the same step with its
    checkpoint. Then rank 1 dies (exit code 3) and rank 0 blocks until dew launch stops it.

    One run for the tests of training, preemption and a dying rank: each launched process
    imports JAX and compiles the step, which is most of what a launched run costs."""
    tmp = tmp_path_factory.mktemp("launched")
    folder = random_token_folder(tmp / "tokens", module_seed, train=3000, val=300)
    checkpoints = tmp / "checkpoints"
    run = Launched(
        *("--processes", 2, "--devices-per-process", 4, "--grace", 2, "--"),
        *(sys.executable, ROOT / "tests" / "launch_train.py", folder, checkpoints, 100000, 1),
    )
    # Both ranks are training (each prints every step), then only rank 1 gets the signal.
    run.wait_for_lines({f"[0] step {STEPS}:", f"[1] step {STEPS}:"})
    os.kill(printed_pids(run.stdout)[1], signal.SIGTERM)
    run.wait_for_lines({"[0] blocked"})
    # Rank 1 is gone or going now: the clock for stopping rank 0 starts here.
    code = run.finish(STOP_BOUND_S)
    return dict(
        code=code, stdout=run.stdout, stderr=run.stderr, folder=folder, checkpoints=checkpoints
    )


def preempted_steps(lines) -> dict[int, int]:
    """The step each rank said it was preempted at, by rank."""
    said = (re.fullmatch(r"\[(\d)\] Preempted at step (\d+); checkpoint saved", x) for x in lines)
    return {int(m[1]): int(m[2]) for m in said if m}


def rank_losses(lines, rank):
    found = (re.fullmatch(rf"\[{rank}\] step (\d+): loss ([^\s,]+), .*", line) for line in lines)
    return {int(m[1]): float(m[2]) for m in found if m}


@ON_THE_LAUNCHED_RUNS_WORKER
def test_launched_processes_train_like_one_process(launched_run, capsys, seed):
    """Two launched processes (data 2 x fsdp 4 over both, joined from the environment alone)
    print the losses one process of 8 devices prints, and their last checkpoint restores to its
    state."""
    stopped = preempted_steps(launched_run["stdout"])[0]
    multi = rank_losses(launched_run["stdout"], 0)
    assert sorted(multi) == list(range(1, stopped + 1)), launched_run["stdout"]
    assert rank_losses(launched_run["stdout"], 1) == multi

    data = TokenWindows(launched_run["folder"], seq_len=SEQ, seed=7).load(batch=16)
    state = two_process_trainer(dew.MeshSpec(fsdp=4)).fit(data, steps=stopped, log_every=1)
    one = {
        int(s): float(v)
        for s, v in re.findall(r"^step (\d+): loss ([^\s,]+), ", capsys.readouterr().out, re.M)
    }
    for step in one:
        assert abs(multi[step] - one[step]) <= 2e-4, (f"seed {seed}", step, multi[step], one[step])

    # The newest checkpoint, written before rank 1 died, loads whole and equals that state.
    restored, _, position = two_process_trainer(
        dew.MeshSpec(fsdp=8), launched_run["checkpoints"]
    ).place()
    assert int(restored.step) == stopped and position["next_batch"] == stopped, f"seed {seed}"
    assert relative_error(restored.params, state.params) < 1e-5, f"seed {seed}"
    assert relative_error(restored.opt_state, state.opt_state) < 1e-5, f"seed {seed}"


@ON_THE_LAUNCHED_RUNS_WORKER
def test_one_signalled_process_stops_every_process_after_the_same_step(launched_run, seed):
    """SIGTERM to rank 1 alone (dew.training.preemption): rank 0 learns of it by the per-step
    all-reduce, and both save the same step, and stop with exit code 143 (``Preempted``'s, which
    each rank prints). (Moved here from tests/test_preemption.py to share the launched run.)"""
    out, err = launched_run["stdout"], launched_run["stderr"][-20:]
    steps = preempted_steps(out)
    assert sorted(steps) == [0, 1], (seed, out[-10:], err)
    assert steps[0] == steps[1] >= STEPS, (seed, steps)
    for rank in (0, 1):
        assert f"[{rank}] exit code 143" in out, (seed, rank, out[-10:])
    assert dew.Checkpoints(launched_run["checkpoints"]).latest == steps[0], seed


@ON_THE_LAUNCHED_RUNS_WORKER
def test_every_output_line_carries_its_rank(launched_run):
    assert launched_run["stdout"] and launched_run["stderr"]
    for line in launched_run["stdout"]:
        assert re.match(r"\[[01]\] ", line), line
    # prepare_process found the run from dew launch's variables and says which process it is.
    assert "[0] process 0 of 2" in launched_run["stderr"]
    assert "[1] process 1 of 2" in launched_run["stderr"]


@ON_THE_LAUNCHED_RUNS_WORKER
def test_a_dying_rank_stops_the_others(launched_run):
    """Rank 1 exits with code 3 (after its checkpoint); dew launch stops rank 0 (blocked for
    good, and deaf to the SIGTERM JAX catches as a preemption notice, so it takes the SIGKILL
    after --grace) and exits with rank 1's code."""
    assert launched_run["code"] == 3, launched_run["stderr"][-20:]
    assert "dew launch: process 1 exited with code 3; stopping the others" in launched_run["stderr"]
    survivor = printed_pids(launched_run["stdout"])[0]
    assert pid_is_gone(survivor), f"rank 0 (pid {survivor}) still runs"


# --------------------------------------------------------------------------- small processes


def python_command(code: str, *args) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code), *map(str, args)]


def test_ctrl_c_reaches_every_process(tmp_path):
    """SIGINT to dew launch reaches each process (its handler leaves a marker), and dew launch
    exits 128 + SIGINT."""
    child = """
        import os, signal, sys
        def on_sigint(signum, frame):
            open(os.path.join(sys.argv[1], "sigint-" + os.environ["DEW_PROCESS_ID"]), "w").close()
            sys.exit(1)
        signal.signal(signal.SIGINT, on_sigint)
        print("ready", flush=True)
        while True:
            signal.pause()
    """
    run = Launched("--processes", 2, "--", *python_command(child, tmp_path))
    run.wait_for_lines({"[0] ready", "[1] ready"})
    run.process.send_signal(signal.SIGINT)
    assert run.finish(STOP_BOUND_S) == 128 + signal.SIGINT, run.stderr
    assert sorted(p.name for p in tmp_path.glob("sigint-*")) == ["sigint-0", "sigint-1"]


def test_a_killed_rank_stops_a_rank_that_ignores_sigterm(tmp_path):
    """Rank 1 dies by SIGKILL once rank 0 runs; rank 0 ignores SIGTERM, so dew launch kills it
    after --grace, and exits 128 + SIGKILL."""
    child = """
        import os, pathlib, signal, sys, time
        marker = pathlib.Path(sys.argv[1]) / "rank0-runs"
        if os.environ["DEW_PROCESS_ID"] == "0":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            print("pid", os.getpid(), flush=True)
            marker.touch()
            while True:
                signal.pause()
        while not marker.exists():
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
    """
    run = Launched("--processes", 2, "--grace", 1, "--", *python_command(child, tmp_path))
    assert run.finish(STOP_BOUND_S) == 128 + signal.SIGKILL, run.stderr
    assert "dew launch: process 1 was killed by SIGKILL; stopping the others" in run.stderr
    assert "dew launch: process 0 still runs 1 s after the stop; killing" in run.stderr
    assert pid_is_gone(printed_pids(run.stdout)[0])


def test_sigterm_to_dew_launch_kills_jax_processes_that_ignore_it_after_grace(tmp_path):
    """SIGTERM to dew launch is passed on; JAX processes (joined to the run) that ignore it get
    SIGKILL --grace seconds later, none is left, and dew launch exits 128 + SIGTERM."""
    grace = 1.0
    child = """
        import os, signal, time
        from dew.training.runtime import prepare_process
        prepare_process(multi_host=True)
        import jax
        assert jax.process_count() == 2
        # After JAX has joined the run, which installs its own SIGTERM handler.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("pid", os.getpid(), flush=True)
        print("ready", flush=True)
        while True:
            time.sleep(3600)
    """
    run = Launched(
        *("--processes", 2, "--devices-per-process", 1, "--grace", grace, "--"),
        *python_command(child),
    )
    run.wait_for_lines({"[0] ready", "[1] ready"})
    pids = printed_pids(run.stdout)
    sent = time.monotonic()
    run.process.send_signal(signal.SIGTERM)
    # The SIGKILL is due `grace` s on; the rest (the launcher's 0.2 s tick, the kills, its exit)
    # took 1.3 s on 2 cores at a load of 11. Without the escalation it never ends.
    code = run.finish(grace + 6)
    took = time.monotonic() - sent
    assert code == 128 + signal.SIGTERM, run.stderr[-20:]
    assert took >= grace, f"killed after {took:.2f} s, before the {grace} s of grace"
    for rank in (0, 1):
        message = f"dew launch: process {rank} still runs {grace:g} s after SIGTERM; killing"
        assert message in run.stderr, run.stderr[-20:]
    assert sorted(pids) == [0, 1]
    left = [pid for pid in pids.values() if not pid_is_gone(pid)]
    assert not left, f"processes {left} still run"


STAND_IN_SSH = """\
#!{python}
# Stands in for ssh: records the host and the remote command, then runs the command here with
# none of dew launch's variables inherited, so they must come from the command itself.
import json, os, sys
host, command = sys.argv[1:]
with open({log!r}, "a") as log:
    log.write(json.dumps([host, command]) + "\\n")
env = {{k: v for k, v in os.environ.items() if not k.startswith("DEW_")}}
env["STAND_IN_HOST"] = host
os.execvpe("bash", ["bash", "-c", command], env)
"""


@pytest.mark.parametrize("where", ["--hosts", "--hostfile"])
def test_hosts_run_over_ssh_with_the_variables(tmp_path, where):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ssh_log = tmp_path / "ssh.jsonl"
    ssh = bin_dir / "ssh"
    ssh.write_text(STAND_IN_SSH.format(python=sys.executable, log=str(ssh_log)))
    ssh.chmod(0o755)
    # A folder and an argument that only survive correct quoting.
    work = tmp_path / "a folder's name"
    work.mkdir()
    hosts = ["user@alpha", "beta"]
    if where == "--hosts":
        place = ["--hosts", ",".join(hosts)]
    else:
        (tmp_path / "hosts").write_text("# the cluster\nuser@alpha\n\nbeta  # second\n")
        place = ["--hostfile", tmp_path / "hosts"]
    child = """
        import json, os, sys
        names = ("COORDINATOR_ADDRESS", "NUM_PROCESSES", "PROCESS_ID", "CPU_DEVICES")
        print(json.dumps([os.environ["STAND_IN_HOST"], os.getcwd(), sys.argv[1]]
                         + [os.environ.get("DEW_" + n) for n in names]))
    """
    env = child_environment(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    run = Launched(
        *place,
        *("--processes", 4, "--devices-per-process", 2, "--port", 12345, "--"),
        *python_command(child, "it's $HOME; `two words`"),
        cwd=work,
        env=env,
    )
    assert run.finish(START_BOUND_S) == 0, run.stderr
    printed = {int(line[1]): json.loads(line[4:]) for line in run.stdout}
    assert printed == {
        rank: [hosts[rank // 2], str(work), "it's $HOME; `two words`"]
        + ["alpha:12345", "4", str(rank), "2"]
        for rank in range(4)
    }, run.stdout
    recorded = [json.loads(line) for line in ssh_log.read_text().splitlines()]
    assert sorted(host for host, _ in recorded) == sorted(hosts * 2)


def test_hostfile_and_host_placement(tmp_path):
    (tmp_path / "hosts").write_text("a\n# b\n\nc # d\n")
    assert read_hostfile(tmp_path / "hosts") == ["a", "c"]
    (tmp_path / "empty").write_text("# nobody\n")
    with pytest.raises(ValueError, match="names no host"):
        read_hostfile(tmp_path / "empty")
    assert process_hosts(["a", "c"], None) == ["a", "c"]
    assert process_hosts(["a", "c"], 4) == ["a", "a", "c", "c"]
    assert process_hosts(None, 2) == [None, None]
    with pytest.raises(ValueError, match="--processes 3 does not divide over 2 hosts"):
        process_hosts(["a", "c"], 3)


@pytest.mark.parametrize("hosts", ["a,,c", "a,c,", ""])
def test_an_empty_host_in_hosts_is_refused(hosts, dew_here, tmp_path):
    # Dropped, "a,,c" would start the processes of a host lost from a script's list elsewhere.
    run = dew_here("launch", "--hosts", hosts, "--", "python", "-c", "1", cwd=tmp_path)
    assert run.returncode == 2, run.stdout
    assert run.stderr.startswith(f"dew launch: --hosts {hosts!r} has an empty entry"), run.stderr


# --------------------------------------------------------------------------- prepare_process

CLUSTER_PREFIXES = ("DEW_", "SLURM_", "OMPI_", "PMI_", "TPU_", "MEGASCALE_", "KUBERNETES_", "JAX_")


def test_prepare_process_without_a_cluster_names_what_it_looked_for():
    env = {
        k: v
        for k, v in child_environment().items()
        if not k.startswith(CLUSTER_PREFIXES) and k != "JOB_COMPLETION_INDEX"
    }
    env["JAX_PLATFORMS"] = "cpu"
    done = subprocess.run(
        python_command(
            """
            from dew.training.runtime import prepare_process
            prepare_process(multi_host=True)
            """
        ),
        env=env,
        capture_output=True,
        text=True,
        timeout=START_BOUND_S,
    )
    assert done.returncode != 0
    error = done.stderr.strip().splitlines()[-1]
    assert error.startswith(
        "dew.training.runtime.NoClusterError: prepare_process(multi_host=True)"
    ), done.stderr
    for looked_for in (
        "DEW_COORDINATOR_ADDRESS",
        "TPU_WORKER_HOSTNAMES",
        "SLURM_JOB_ID",
        "OMPI_MCA_orte_hnp_uri",
        "KUBERNETES_SERVICE_HOST",
    ):
        assert looked_for in error, error


def test_launch_variables_are_read_and_checked(monkeypatch):
    for name in runtime.LAUNCH_VARIABLES + (runtime.CPU_DEVICES_VARIABLE,):
        monkeypatch.delenv(name, raising=False)
    assert runtime.launch_settings() is None
    monkeypatch.setenv("DEW_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    with pytest.raises(ValueError, match="DEW_COORDINATOR_ADDRESS set but not DEW_NUM_PROCESSES"):
        runtime.launch_settings()
    monkeypatch.setenv("DEW_NUM_PROCESSES", "2")
    monkeypatch.setenv("DEW_PROCESS_ID", "1")
    assert runtime.launch_settings() == (
        dict(coordinator_address="10.0.0.1:1234", num_processes=2, process_id=1),
        None,
    )
    monkeypatch.setenv("DEW_CPU_DEVICES", "4")
    assert runtime.launch_settings()[1] == 4
    monkeypatch.setenv("DEW_PROCESS_ID", "2")
    with pytest.raises(ValueError, match="DEW_PROCESS_ID=2 is not below DEW_NUM_PROCESSES=2"):
        runtime.launch_settings()


def test_a_slurm_job_is_left_to_jax(monkeypatch):
    """Slurm's variables are a cluster JAX detects: no NoClusterError before initialize()."""
    for name in list(os.environ):
        if name.startswith(CLUSTER_PREFIXES):
            monkeypatch.delenv(name)
    assert _jax_compat.detected_cluster() is None
    slurm = dict(
        SLURM_JOB_ID="7",
        SLURM_STEP_NODELIST="node[1-2]",
        SLURM_NTASKS="2",
        SLURM_PROCID="0",
        SLURM_LOCALID="0",
    )
    for name, value in slurm.items():
        monkeypatch.setenv(name, value)
    assert _jax_compat.detected_cluster() == "SlurmCluster"
