"""``dew-tpu`` drives ``gcloud compute tpus tpu-vm``: checked against a stand-in ``gcloud`` on
``PATH`` that records its arguments (and runs an ``ssh --command`` here, as one worker would)."""

import json
import shlex
import subprocess
import sys
import time

import pytest

from dew.cli import tpu

TPU_VM = ["compute", "tpus", "tpu-vm"]
PLACE = ["s1", "--zone=us-east5-a"]
# How long the detached training command may take to write its log; passing it fails the test.
LOG_BOUND_S = 60

STAND_IN_GCLOUD = """\
#!{python}
# Stands in for gcloud: records its arguments; exits with the code in the file `exit-code` when
# there is one; with a file `run-ssh` there, an `ssh ... --command=C` runs C with bash in the folder
# `home`, as a worker's login shell would.
import json, os, pathlib, subprocess, sys
here = pathlib.Path(__file__).resolve().parent.parent
with open(here / "gcloud.jsonl", "a") as log:
    log.write(json.dumps(sys.argv[1:]) + "\\n")
if (here / "exit-code").exists():
    sys.exit(int((here / "exit-code").read_text()))
commands = [a[len("--command="):] for a in sys.argv if a.startswith("--command=")]
if "ssh" in sys.argv and commands and (here / "run-ssh").exists():
    sys.exit(subprocess.run(["bash", "-c", commands[0]], cwd=here / "home").returncode)
"""


@pytest.fixture
def gcloud(tmp_path, monkeypatch):
    """The stand-in gcloud alone on PATH (with bash); returns a function giving its calls."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "home").mkdir()
    script = bin_dir / "gcloud"
    script.write_text(STAND_IN_GCLOUD.format(python=sys.executable))
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")

    def calls():
        log = tmp_path / "gcloud.jsonl"
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    return calls


def test_create_with_spot_and_version(gcloud):
    assert tpu.main(["create", *PLACE, "--type", "v5p-16", "--version", "v2-x", "--spot"]) == 0
    assert tpu.main(["create", *PLACE, "--type", "v6e-8", "--project", "p"]) == 0
    assert gcloud() == [
        TPU_VM + ["create", *PLACE, "--accelerator-type=v5p-16", "--version=v2-x", "--spot"],
        # No --version: the one for the generation; no --spot: on-demand.
        TPU_VM
        + [
            "create",
            *PLACE,
            "--project=p",
            "--accelerator-type=v6e-8",
            "--version=v2-alpha-tpuv6e",
        ],
    ]


def test_setup_installs_on_every_worker(gcloud, tmp_path):
    assert tpu.main(["setup", *PLACE]) == 0
    assert tpu.main(["setup", *PLACE, "--package", "git+https://example.org/dew.git"]) == 0
    assert tpu.main(["setup", *PLACE, "--source", str(tmp_path / "checkout")]) == 0
    install = "python3 -m pip install -U 'jax[tpu]' "
    ssh = TPU_VM + ["ssh", *PLACE, "--worker=all"]
    assert gcloud() == [
        ssh + [f"--command={install}'dew-ml[gcs]'"],
        ssh + [f"--command={install}git+https://example.org/dew.git"],
        TPU_VM
        + [
            "scp",
            "--recurse",
            str(tmp_path / "checkout"),
            "s1:dew-source",
            PLACE[1],
            "--worker=all",
        ],
        ssh + [f"--command={install}'./dew-source[gcs]'"],
    ]


def test_train_starts_the_command_detached_on_every_worker(gcloud, tmp_path):
    message = 'step 1: it\'s "quoted" $HOME'
    command = [sys.executable, "-c", "import sys; print(sys.argv[1])", message]
    (tmp_path / "run-ssh").touch()
    assert tpu.main(["train", *PLACE, "--", *command]) == 0
    (call,) = gcloud()
    assert call[:-1] == TPU_VM + ["ssh", *PLACE, "--worker=all"]
    assert call[-1] == f"--command=nohup {shlex.join(command)} > dew-train.log 2>&1 < /dev/null &"
    # The stand-in ran it as a worker would: detached, its output in the log in the home folder.
    log = tmp_path / "home" / "dew-train.log"
    deadline = time.monotonic() + LOG_BOUND_S
    while not (log.exists() and log.read_text() == message + "\n"):
        if time.monotonic() > deadline:
            pytest.fail(f"the detached command wrote no {message!r} to {log} in {LOG_BOUND_S} s")
        time.sleep(0.05)


def test_logs_of_one_worker_or_all(gcloud):
    assert tpu.main(["logs", *PLACE, "--worker", "1"]) == 0
    assert tpu.main(["logs", *PLACE, "--follow", "--lines", "5", "--log", "run.log"]) == 0
    ssh = TPU_VM + ["ssh", *PLACE]
    assert gcloud() == [
        ssh + ["--worker=1", "--command=tail -n 100 dew-train.log"],
        ssh + ["--worker=all", "--command=tail -n 5 -f run.log"],
    ]


def test_delete(gcloud):
    assert tpu.main(["delete", *PLACE]) == 0
    assert tpu.main(["delete", *PLACE, "--yes"]) == 0
    assert gcloud() == [TPU_VM + ["delete", *PLACE], TPU_VM + ["delete", *PLACE, "--quiet"]]


def test_a_failing_gcloud_stops_and_its_code_is_returned(gcloud, tmp_path):
    (tmp_path / "exit-code").write_text("5")
    assert tpu.main(["setup", *PLACE, "--source", "."]) == 5
    assert [call[3] for call in gcloud()] == ["scp"]  # the install never ran


def test_dry_run_prints_and_runs_nothing(gcloud, capsys):
    assert tpu.main(["create", *PLACE, "--type", "v5p-16", "--spot", "--dry-run"]) == 0
    assert tpu.main(["train", *PLACE, "--dry-run", "--", "python3", "train.py", "--x", "a b"]) == 0
    assert gcloud() == []
    assert capsys.readouterr().out.splitlines() == [
        "gcloud compute tpus tpu-vm create s1 --zone=us-east5-a --accelerator-type=v5p-16 "
        "--version=v2-alpha-tpuv5 --spot",
        "gcloud compute tpus tpu-vm ssh s1 --zone=us-east5-a --worker=all "
        + shlex.quote(
            "--command=nohup python3 train.py --x 'a b' > dew-train.log 2>&1 < /dev/null &"
        ),
    ]


def test_missing_gcloud_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert tpu.main(["delete", *PLACE]) == 2
    assert "dew-tpu: gcloud is not on PATH; install the Google Cloud CLI" in capsys.readouterr().err
    # A dry run needs no gcloud.
    assert tpu.main(["delete", *PLACE, "--dry-run"]) == 0
    assert capsys.readouterr().out == "gcloud compute tpus tpu-vm delete s1 --zone=us-east5-a\n"


def test_bad_arguments_are_refused_before_gcloud(gcloud, capsys):
    assert tpu.main(["create", *PLACE, "--type", "v9z-8"]) == 2
    assert "no default --version for --type 'v9z-8'" in capsys.readouterr().err
    assert tpu.main(["train", *PLACE]) == 2
    assert "give the command to run after --" in capsys.readouterr().err
    assert tpu.main(["delete", *PLACE, "--", "echo"]) == 2
    with pytest.raises(SystemExit):
        tpu.main(["logs", *PLACE, "--worker", "first"])
    assert gcloud() == []


def test_console_script_is_declared():
    """pyproject.toml names dew-tpu's entry point, and the module runs as a program."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    scripts = tomllib.loads((root / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["dew-tpu"] == "dew.cli.tpu:main"
    done = subprocess.run(
        [sys.executable, "-m", "dew.cli.tpu", "delete", *PLACE, "--dry-run"],
        capture_output=True,
        text=True,
        cwd=root,
        timeout=120,
    )
    assert done.stdout == "gcloud compute tpus tpu-vm delete s1 --zone=us-east5-a\n", done.stderr
