"""The `dew` command, run as a user runs it (a fresh process; it sets up 8 CPU devices itself)."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def dew(*args, cwd):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-m", "dew", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_dew_train_runs_and_resumes(tmp_path):
    first = dew("train", "--mesh", "fsdp=8", "--steps", "4", "--log-every", "2", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    lines = first.stdout.splitlines()
    assert lines[0] == (
        "Training from step 0 to 4 on {'data': 1, 'expert': 1, 'fsdp': 8, 'tensor': 1, "
        "'sequence': 1, 'stage': 1} (1 process(es))"
    )
    assert [l.split(":")[0] for l in lines[1:3]] == ["step 2", "step 4"]
    assert re.fullmatch(
        r"Goodput: first step after \d+\.\d\d s, \d+\.\d% of the wall time in steps", lines[3]
    )
    run_dir = tmp_path / "runs" / "dew-train"
    assert (run_dir / "corpus" / "meta.json").exists()

    second = dew(
        "train", "--mesh", "data=2,fsdp=4", "--steps", "6", "--log-every", "2", cwd=tmp_path
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert (
        second.stdout.splitlines()[0]
        == f"Resumed from step 4 in {(run_dir / 'checkpoints').resolve()}"
    )
    assert "Training from step 4 to 6 on {'data': 2, 'expert': 1, 'fsdp': 4," in second.stdout


def test_dew_train_bad_input_is_a_clear_error(tmp_path):
    bad = dew("train", "--batch", "12", "--mesh", "fsdp=8", "--steps", "1", cwd=tmp_path)
    assert bad.returncode == 2
    assert (
        "dew train: batch 12 does not split evenly over 8 devices (data 1 x fsdp 8)" in bad.stderr
    )
    assert "Traceback" not in bad.stderr
    missing = dew("train", "--data", str(tmp_path / "nothing"), "--steps", "1", cwd=tmp_path)
    assert (
        missing.returncode == 2
        and "nothing" in missing.stderr
        and "Traceback" not in missing.stderr
    )


def test_dew_collectives_prints_the_table(tmp_path):
    out = dew("collectives", "--mesh", "fsdp=8", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith(
        "Collectives of one shard_map step on {'data': 1, 'expert': 1, 'fsdp': 8,"
    )
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines() if line[:1].isalpha()}
    assert rows["all_gather"][1] == "fsdp" and rows["psum_scatter"][1] == "fsdp"
