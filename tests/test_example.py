"""Runs the project's example, docs/examples/scale_across_devices.py, and checks what it prints.

The example sets up its own eight simulated devices, so it runs as a fresh process, without the
device flags this test session was given. Its printed lines are what a reader compares against, so
they are checked both for their form and for the facts they state: the two layouts train to the
same losses, a checkpoint comes back bit for bit in the other layout, and training continues from
the saved step rather than starting over.
"""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import child_env

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "docs" / "examples" / "scale_across_devices.py"
DATA_PARALLEL = "{'data': 8, 'expert': 1, 'fsdp': 1, 'tensor': 1, 'sequence': 1, 'stage': 1}"
FULLY_SHARDED = "{'data': 1, 'expert': 1, 'fsdp': 8, 'tensor': 1, 'sequence': 1, 'stage': 1}"
UNIFORM_GUESS = math.log(256)  # the loss of an untrained byte model


# One worker runs every test of this module: its module fixture runs a costly subprocess once.
pytestmark = pytest.mark.xdist_group("example")


@pytest.fixture(scope="module")
def printed(tmp_path_factory):
    """``(stdout, workdir)`` of one run of the example in a fresh folder."""
    workdir = tmp_path_factory.mktemp("example")
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    # Without the run's compilation cache: the example compiles the fully sharded step twice in
    # one process (a second Trainer resumes the first's layout), and an executable XLA:CPU reads
    # back from the cache, compiled with the suite's --xla_cpu_use_fusion_emitters=false, corrupts
    # the heap when it runs (JAX 0.10.2; "double free or corruption", exit -6). Without that flag,
    # or without the cache, the example runs as a user runs it.
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    run = subprocess.run(
        [sys.executable, str(EXAMPLE), "--workdir", str(workdir)],
        check=False,
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    return run.stdout, workdir


def training_runs(out: str) -> list[str]:
    """The text of each ``fit``, from its ``Training from step`` line to the next one."""
    return ["Training from step " + part for part in out.split("Training from step ")[1:]]


def losses(text: str) -> list[tuple[int, float]]:
    return [
        (int(s), float(x))
        for s, x in re.findall(r"^step (\d+): loss (\d+\.\d{4}), ", text, re.MULTILINE)
    ]


def test_devices_meshes_and_placement(printed):
    out, _ = printed
    devices = ", ".join(f"CpuDevice(id={i})" for i in range(8))
    assert out.startswith(f"[{devices}]\n"), out[:400]
    assert f"data parallel: {DATA_PARALLEL}\n" in out
    assert f"fully sharded: {FULLY_SHARDED}\n" in out
    assert "data parallel P()\n" in out
    assert "fully sharded P('fsdp',)\n" in out
    # 95,598 training tokens of the example corpus in windows of 33: 2,987 whole ones.
    assert "training windows: 2987\n" in out


def test_both_layouts_train_to_the_same_losses(printed):
    out, _ = printed
    runs = training_runs(out)
    assert len(runs) == 3, out
    assert runs[0].startswith(f"Training from step 0 to 20 on {DATA_PARALLEL} (1 process(es))\n")
    assert runs[1].startswith(f"Training from step 0 to 20 on {FULLY_SHARDED} (1 process(es))\n")
    replicated, sharded = losses(runs[0]), losses(runs[1])
    assert [step for step, _ in replicated] == [10, 20], runs[0]
    assert replicated == sharded, (replicated, sharded)
    assert replicated[1][1] < replicated[0][1] < UNIFORM_GUESS, replicated  # it learns
    goodput = re.findall(
        r"^Goodput: first step after \d+\.\d\d s, \d+\.\d% of the wall time in steps$", out, re.M
    )
    assert len(goodput) == 3, out


def test_where_the_embedding_table_lives(printed):
    out, _ = printed
    whole = "".join(
        f" cpu:{i}: rows slice(None, None, None), local shape (256, 64)\n" for i in range(3)
    )
    assert out.count("spec: P()\n" + whole) == 1, out  # the data-parallel run
    split = "".join(
        f" cpu:{i}: rows slice({32 * i}, {32 * (i + 1)}, None), local shape (32, 64)\n"
        for i in range(3)
    )
    assert out.count("spec: P('fsdp',)\n" + split) == 2, (
        out
    )  # the sharded run, and the restored state


def test_checkpoint_moves_between_layouts_and_training_continues(printed):
    out, workdir = printed
    saved_by = (workdir / "runs" / "replicated").resolve()
    assert out.count(f"Resumed from step 20 in {saved_by}\n") == 2, out  # place(), then fit()
    assert "restored weights equal the data-parallel run's: True\n" in out
    runs = training_runs(out)
    assert runs[2].startswith(f"Training from step 20 to 30 on {FULLY_SHARDED} (1 process(es))\n")
    continued = losses(runs[2])
    assert [step for step, _ in continued] == [30], runs[2]
    # Ten more steps from the restored weights go below step 20's loss; weights that restarted from
    # scratch would be back above it after ten steps (step 10's loss).
    assert continued[0][1] < losses(runs[0])[1][1], (continued, losses(runs[0]))
    assert out.rstrip().endswith("continued to step 30"), out[-300:]
    # The continued run saved into the folder it resumed from; the sharded run's stayed at step 20.
    assert sorted(p.name for p in saved_by.glob("step_*")) == ["step_00000020", "step_00000030"]
    assert [p.name for p in (workdir / "runs" / "sharded").glob("step_*")] == ["step_00000020"]
