"""``dew launch``: starts the processes of one multi-process run, here or over ``ssh``.

    dew launch --processes 2 --devices-per-process 4 -- python train.py
    dew launch --hosts node1,node2 --port 62000 -- python train.py

Process ``i`` gets ``DEW_COORDINATOR_ADDRESS``, ``DEW_NUM_PROCESSES``, ``DEW_PROCESS_ID=i`` (and
``DEW_CPU_DEVICES`` with ``--devices-per-process``) in its environment, which
``prepare_process(multi_host=True)`` reads. Every line a process prints comes out prefixed with its
rank, ``[i] ``: its stdout on stdout, its stderr on stderr. When a process exits non-zero or is
killed, the others are stopped (SIGTERM, then SIGKILL after ``--grace`` seconds) and ``dew launch``
exits non-zero. Ctrl-C (SIGINT) and SIGTERM are passed on to every process. After SIGTERM (what a
scheduler sends before it kills), the processes still running ``--grace`` seconds later get SIGKILL,
so ``dew launch`` exits ``128 + SIGTERM`` (143) within about ``--grace`` seconds and leaves none
behind. After Ctrl-C it waits for them; a second signal kills them at once.

Nothing here imports JAX: the launcher only starts and watches processes.
"""

from __future__ import annotations

import argparse
import os
import queue
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from dew.checks import positive_int

DEFAULT_GRACE_S = 10.0


def add_parser(commands) -> argparse.ArgumentParser:
    """Adds ``launch`` to the ``dew`` command's subparsers."""
    parser = commands.add_parser(
        "launch",
        help="start the processes of one multi-process run, here or over ssh",
        description="Starts N processes of COMMAND with the coordinator address, the process "
        "count and each one's id in the environment (DEW_COORDINATOR_ADDRESS, DEW_NUM_PROCESSES, "
        "DEW_PROCESS_ID; DEW_CPU_DEVICES with --devices-per-process), which "
        "prepare_process(multi_host=True) reads. Output lines are prefixed with the rank. When a "
        "process fails, the others are stopped and dew launch exits non-zero.",
        usage="dew launch [--processes N] [--devices-per-process D] [--port P] "
        "[--hosts H1,H2 | --hostfile F] [--grace S] -- COMMAND...",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=None,
        metavar="N",
        help="processes to start (default: one per host with --hosts/--hostfile)",
    )
    parser.add_argument(
        "--devices-per-process",
        type=int,
        default=None,
        metavar="D",
        help="simulate D CPU devices in each process (DEW_CPU_DEVICES); default: the real devices",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=None,
        help="the coordinator's port (default: a free port on this machine; give one with --hosts)",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--hosts",
        default=None,
        metavar="H1,H2",
        help="run the processes over ssh on these hosts, the coordinator on the first; N "
        "processes over H hosts put N/H consecutive ranks on each",
    )
    where.add_argument(
        "--hostfile", default=None, metavar="F", help="the hosts, one a line ('#' comments)"
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=DEFAULT_GRACE_S,
        metavar="S",
        help="seconds between SIGTERM and SIGKILL when stopping the processes, after a failure "
        f"or a SIGTERM to dew launch (default {DEFAULT_GRACE_S:g})",
    )
    parser.add_argument("command_line", nargs=argparse.REMAINDER, metavar="-- COMMAND...")
    parser.set_defaults(run=launch_command)
    return parser


def read_hostfile(path: str | os.PathLike) -> list[str]:
    """The host names in ``path``: one a line, blank lines and ``#`` comments skipped."""
    hosts = []
    for line in Path(path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            hosts.append(line)
    if not hosts:
        raise ValueError(f"--hostfile {path} names no host (one host name a line)")
    return hosts


def process_hosts(hosts: list[str] | None, processes: int | None) -> list[str | None]:
    """The host of each process (``None``: this machine). ``N`` processes over ``H`` hosts put
    ``N/H`` consecutive ranks on each host."""
    if not hosts:
        if processes is None:
            raise ValueError("give --processes N (or --hosts / --hostfile)")
        return [None] * positive_int("--processes", processes)
    processes = len(hosts) if processes is None else positive_int("--processes", processes)
    if processes % len(hosts):
        raise ValueError(f"--processes {processes} does not divide over {len(hosts)} hosts")
    per_host = processes // len(hosts)
    return [hosts[rank // per_host] for rank in range(processes)]


def free_port(bind: str = "") -> int:
    """A TCP port that nothing on this machine listens on now."""
    with socket.socket() as s:
        s.bind((bind, 0))
        return s.getsockname()[1]


def coordinator_address(first_host: str | None, port: int) -> str:
    """``HOST:PORT`` of process 0: this machine's loopback, or the first host (without the
    ``user@`` ssh may carry)."""
    host = "127.0.0.1" if first_host is None else first_host.rsplit("@", 1)[-1]
    return f"{host}:{port}"


def process_variables(
    address: str, processes: int, rank: int, devices_per_process: int | None
) -> dict[str, str]:
    """The variables process ``rank`` gets (Python's output unbuffered, so lines arrive as they
    are printed)."""
    # Here, not at the top: dew.training imports JAX, which ``dew launch --help`` must not.
    from dew.training.runtime import (
        COORDINATOR_VARIABLE,
        CPU_DEVICES_VARIABLE,
        NUM_PROCESSES_VARIABLE,
        PROCESS_ID_VARIABLE,
    )

    variables = {
        COORDINATOR_VARIABLE: address,
        NUM_PROCESSES_VARIABLE: str(processes),
        PROCESS_ID_VARIABLE: str(rank),
        "PYTHONUNBUFFERED": "1",
    }
    if devices_per_process is not None:
        variables[CPU_DEVICES_VARIABLE] = str(devices_per_process)
    return variables


def ssh_command(host: str, cwd: str, variables: dict[str, str], command: list[str]) -> list[str]:
    """``ssh HOST 'cd CWD && env VAR=... COMMAND'``: the command in the same folder on ``host``,
    with ``variables`` set there."""
    assignments = " ".join(shlex.quote(f"{k}={v}") for k, v in variables.items())
    return ["ssh", host, f"cd {shlex.quote(cwd)} && env {assignments} {shlex.join(command)}"]


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _leave_signals_to_the_main_thread() -> None:
    """Blocks the signals dew launch forwards in this (helper) thread, so the kernel delivers them
    to the main thread, whose Python handlers then run at once."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})


class Launch:
    """The processes of one run: started together, their output prefixed, stopped together.

    A stop has a deadline: once a process has failed (the others get SIGTERM) or dew launch got
    SIGTERM (passed on), every process still running ``grace`` seconds later gets SIGKILL. After
    SIGINT there is no deadline until a process fails; a second signal kills at once."""

    def __init__(self, commands: list[list[str]], environments: list[dict], grace: float):
        self.commands = commands
        self.environments = environments
        self.grace = grace
        self.processes: list[subprocess.Popen] = []
        self.exits: queue.Queue = queue.Queue()
        self.write_lock = threading.Lock()
        self.threads: list[threading.Thread] = []
        self.interrupted: int | None = None
        # When the processes still running get SIGKILL (time.monotonic()), and what started the
        # clock, for the message; None: no stop under way.
        self.kill_at: float | None = None
        self.stopped_by = ""
        self.killed = False

    def _pump(self, rank: int, stream, out) -> None:
        _leave_signals_to_the_main_thread()
        prefix = f"[{rank}] "
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            with self.write_lock:
                out.write(prefix + line + "\n")
                out.flush()
        stream.close()

    def _watch(self, rank: int, process: subprocess.Popen) -> None:
        _leave_signals_to_the_main_thread()
        self.exits.put((rank, process.wait()))

    def _signal_running(self, signum: int) -> None:
        for process in self.processes:
            if process.returncode is None:
                try:
                    # Each process leads its own group: a shell's or ssh's children get it too.
                    os.killpg(process.pid, signum)
                except (ProcessLookupError, PermissionError):
                    pass

    def _start_clock(self, stopped_by: str) -> None:
        """Starts the ``grace`` seconds after which the processes still running get SIGKILL
        (unless a stop already started them: the earliest deadline stands)."""
        if self.kill_at is None:
            self.kill_at = time.monotonic() + self.grace
            self.stopped_by = stopped_by

    def _kill_when_due(self) -> None:
        """SIGKILL to every process still running, once the stop's deadline has passed."""
        if self.killed or self.kill_at is None or time.monotonic() < self.kill_at:
            return
        self.killed = True
        for rank, process in enumerate(self.processes):
            if process.returncode is None:  # set by its watcher thread once it has ended
                self._message(
                    f"process {rank} still runs {self.grace:g} s after {self.stopped_by}; killing"
                )
        self._signal_running(signal.SIGKILL)

    def _on_signal(self, signum, frame) -> None:
        if self.interrupted is not None:  # a second Ctrl-C: no more waiting
            self.killed = True
            self._signal_running(signal.SIGKILL)
            return
        self.interrupted = signum
        self._signal_running(signum)
        if signum == signal.SIGTERM:
            # A scheduler's SIGTERM is followed by its SIGKILL, which would reach dew launch alone
            # (each process has its own session) and orphan them: they must be gone before.
            self._start_clock(signal.Signals(signum).name)

    def start(self) -> None:
        for rank, (command, env) in enumerate(zip(self.commands, self.environments)):
            process = subprocess.Popen(
                command,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                # Its own session: a terminal's Ctrl-C reaches the launcher alone, which passes it
                # on once, and a stop reaches everything the process started.
                start_new_session=True,
            )
            self.processes.append(process)
            for stream, out in ((process.stdout, sys.stdout), (process.stderr, sys.stderr)):
                thread = threading.Thread(target=self._pump, args=(rank, stream, out), daemon=True)
                thread.start()
                self.threads.append(thread)
            threading.Thread(target=self._watch, args=(rank, process), daemon=True).start()

    def _tick(self) -> float:
        """How long the main thread may block before it must look again: at most 0.2 s (a signal
        delivered while another thread runs has its Python handler run only when the main thread
        next does), and no later than the stop's deadline."""
        if self.kill_at is None or self.killed:
            return 0.2
        return min(0.2, max(0.0, self.kill_at - time.monotonic()))

    def stop(self) -> None:
        """Sends SIGTERM to every running process, then SIGKILL to those still running ``grace``
        seconds later; returns once all have ended."""
        self._signal_running(signal.SIGTERM)
        self._start_clock("the stop")
        for process in self.processes:
            while True:
                self._kill_when_due()
                try:
                    process.wait(timeout=self._tick())
                    break
                except subprocess.TimeoutExpired:
                    pass

    def _message(self, text: str) -> None:
        with self.write_lock:
            print(f"dew launch: {text}", file=sys.stderr, flush=True)

    def wait(self) -> int:
        """Waits for every process; stops the rest at the first failure. Returns the exit code:
        0 when all succeeded, ``128 + signal`` after a forwarded signal (143 after SIGTERM, also
        when the processes had to be killed), else the first failure's code (``128 + signal``
        for a process killed by a signal)."""
        failure = None
        remaining = len(self.processes)
        while remaining:
            self._kill_when_due()
            try:
                # A timeout, so that the signal handler and the SIGKILL deadline run promptly in
                # this (the main) thread.
                rank, code = self.exits.get(timeout=self._tick())
            except queue.Empty:
                continue
            remaining -= 1
            if code != 0 and failure is None:
                failure = code
                if not remaining:
                    self._message(f"process {rank} {_describe_exit(code)}")
                elif self.interrupted is None:
                    self._message(f"process {rank} {_describe_exit(code)}; stopping the others")
                    self._signal_running(signal.SIGTERM)
                    self._start_clock("the stop")
                else:
                    # The others got the forwarded signal too: no SIGTERM on top of it, the
                    # grace period to finish handling it (if SIGTERM has not started it), then
                    # SIGKILL.
                    self._start_clock("the stop")
        for thread in self.threads:
            thread.join(timeout=5.0)  # an orphan holding a pipe must not hold the launcher
        if self.interrupted is not None:
            return 128 + self.interrupted
        if failure is None:
            return 0
        return failure if failure > 0 else 128 - failure

    def run(self) -> int:
        previous = {
            signum: signal.signal(signum, self._on_signal)
            for signum in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            self.start()
            return self.wait()
        finally:
            if any(p.returncode is None for p in self.processes):
                self.stop()  # the launcher itself failed: leave nothing behind
            for signum, handler in previous.items():
                signal.signal(signum, handler)


def plan(args) -> tuple[list[list[str]], list[dict]]:
    """Each process's command line and environment, from ``dew launch``'s arguments."""
    command = list(args.command_line)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise ValueError("give the command to run after --, e.g. -- python train.py")
    if args.devices_per_process is not None:
        positive_int("--devices-per-process", args.devices_per_process)
    if args.grace < 0:
        raise ValueError(f"--grace must be >= 0, got {args.grace}")
    hosts = None
    if args.hosts is not None:
        from dew.checks import comma_names

        hosts = list(comma_names("--hosts", args.hosts))
    elif args.hostfile is not None:
        hosts = read_hostfile(args.hostfile)
    placement = process_hosts(hosts, args.processes)
    if args.port is None:
        port = free_port("127.0.0.1" if hosts is None else "")
    elif not 1 <= args.port <= 65535:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    else:
        port = args.port
    address = coordinator_address(placement[0], port)
    cwd = os.getcwd()
    commands, environments = [], []
    for rank, host in enumerate(placement):
        variables = process_variables(address, len(placement), rank, args.devices_per_process)
        if host is None:
            commands.append(command)
            environments.append({**os.environ, **variables})
        else:
            commands.append(ssh_command(host, cwd, variables, command))
            environments.append(dict(os.environ))
    return commands, environments


def launch_command(args) -> int:
    commands, environments = plan(args)
    return Launch(commands, environments, args.grace).run()
