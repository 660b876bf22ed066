"""Building and running ``gcloud`` command lines.

``Gcloud.run`` prints each command (``+ gcloud ...`` on stderr) and runs it, its output streamed
through; under ``--dry-run`` it prints the command line on stdout instead and runs nothing. A
command that fails raises ``GcloudError``, whose message holds gcloud's stderr.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time

from dew.cli.tpu.config import TpuError

TPU_VM = ("gcloud", "compute", "tpus", "tpu-vm")
QUEUED = ("gcloud", "compute", "tpus", "queued-resources")
MISSING_GCLOUD = (
    "gcloud is not on PATH; install the Google Cloud CLI "
    "(https://cloud.google.com/sdk/docs/install), run `gcloud auth login`, and try again "
    "(--dry-run prints the commands without it)"
)
STDERR_LINES = 30  # of a failed command's stderr, in its error


@dataclasses.dataclass
class Result:
    code: int
    stdout: str
    stderr: str


class GcloudError(TpuError):
    """A gcloud command exited non-zero; the message quotes its stderr."""

    def __init__(self, argv, code: int, stderr: str, hint: str = ""):
        tail = stderr.strip().splitlines()[-STDERR_LINES:]
        said = ("; its stderr:\n  " + "\n  ".join(tail)) if tail else " (nothing on stderr)"
        super().__init__(f"`{shlex.join(argv)}` exited with {code}{said}{hint}", code or 1)
        self.stderr = stderr


def _zone_hint(argv, stderr: str) -> str:
    zones = [a.split("=", 1)[1] for a in argv if a.startswith("--zone=")]
    text = stderr.lower()
    if zones and zones[0].lower() in text and re.search(r"not found|invalid|unknown", text):
        return (
            f"\nIs {zones[0]} a TPU zone? `gcloud compute tpus locations list` lists them; "
            "give another with --zone, or save your zones with `dew-tpu init --zones ZONE,...`"
        )
    return ""


class Gcloud:
    """Runs (or, with ``dry_run``, prints) command lines. ``sleep`` and ``clock`` are what the
    waiting loops use, so tests can pass their own."""

    def __init__(self, dry_run: bool = False, sleep=time.sleep, clock=time.monotonic):
        self.dry_run = dry_run
        self.sleep = sleep
        self.clock = clock

    def run(
        self,
        argv,
        *,
        capture: bool = False,
        check: bool = True,
        quiet: bool = False,
        interactive: bool = False,
    ) -> Result:
        """Runs ``argv``: its stdout streamed to ours (``capture``: returned instead), its stderr
        streamed to ours and kept for the error (``quiet``: kept only, and no ``+`` line);
        ``interactive``: the terminal is the command's. Raises ``GcloudError`` on a non-zero exit
        when ``check``."""
        argv = [str(a) for a in argv]
        if self.dry_run:
            print(shlex.join(argv), flush=True)
            return Result(0, "", "")
        if shutil.which(argv[0]) is None:
            raise TpuError(
                MISSING_GCLOUD if argv[0] == "gcloud" else f"{argv[0]} is not on PATH", 2
            )
        if not quiet:
            print(f"+ {shlex.join(argv)}", file=sys.stderr, flush=True)
        if interactive:
            result = Result(subprocess.run(argv).returncode, "", "")
        else:
            result = self._stream(argv, capture, quiet)
        if check and result.code != 0:
            raise GcloudError(argv, result.code, result.stderr, _zone_hint(argv, result.stderr))
        return result

    @staticmethod
    def _stream(argv, capture: bool, quiet: bool) -> Result:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        errors: list[str] = []

        def read_stderr():
            for line in process.stderr:
                errors.append(line)
                if not quiet:
                    sys.stderr.write(line)
                    sys.stderr.flush()

        reader = threading.Thread(target=read_stderr, daemon=True)
        reader.start()
        out: list[str] = []
        try:
            for line in process.stdout:
                if capture:
                    out.append(line)
                else:
                    sys.stdout.write(line)
                    sys.stdout.flush()
            code = process.wait()
        except BaseException:
            process.kill()
            process.wait()
            raise
        reader.join()
        return Result(code, "".join(out), "".join(errors))


@dataclasses.dataclass
class Slice:
    """A TPU VM (slice) where it lives: what every ``gcloud compute tpus`` command names."""

    name: str
    zone: str
    project: str | None = None
    user: str | None = None

    def place(self) -> list[str]:
        return [f"--zone={self.zone}"] + ([f"--project={self.project}"] if self.project else [])

    @property
    def host(self) -> str:
        """The name ssh and scp take: ``user@name`` with a configured user."""
        return f"{self.user}@{self.name}" if self.user else self.name

    def ssh(self, worker, command: str | None = None) -> list[str]:
        argv = [*TPU_VM, "ssh", self.host, *self.place(), f"--worker={worker}"]
        return argv + ([f"--command={command}"] if command is not None else [])

    def describe(self) -> list[str]:
        return [*TPU_VM, "describe", self.name, *self.place(), "--format=json"]


def describe(gcloud: Gcloud, slice_: Slice, *, quiet: bool = True) -> dict | None:
    """The slice as ``describe --format=json`` gives it; ``None`` when there is none. Under
    ``--dry-run`` the command is printed and the slice taken to be ``READY``."""
    result = gcloud.run(slice_.describe(), capture=True, check=False, quiet=quiet)
    if gcloud.dry_run:
        return {"state": "READY", "dry_run": True}
    if result.code != 0:
        if re.search(r"not_?found|not found", result.stderr, re.IGNORECASE):
            return None
        raise GcloudError(slice_.describe(), result.code, result.stderr)
    try:
        return json.loads(result.stdout)
    except json.JSONDecodeError as error:
        raise TpuError(f"gcloud's describe gave no JSON ({error}): {result.stdout[:200]!r}")
