"""SIGTERM and Ctrl-C during ``fit`` (dew.training.preemption): the step in flight finishes, a
checkpoint of it is committed, and the run stops (SIGTERM: ``Preempted``, exit code 143).

In this process the signals are sent as a chosen step's batch is read, so the step they arrive in
is known; ``dew train`` in a subprocess gets SIGTERM from outside once a step has run, and its
checkpoint resumes to what a straight run computes. (Two launched processes, one of them
signalled, stopping after the same step: tests/test_launch.py, on its launched run.)
"""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import optax
import pytest

import dew
from dew.data import Loading, TokenWindows
from dew.training.preemption import Preempted
from tests.helpers import SEQ, child_env, random_token_folder, tiny_objective

ROOT = Path(__file__).resolve().parents[1]
ROWS = 8
# How long a subprocess may take to reach what a test waits for (a loaded machine compiles
# slowly); passing it fails the test.
BOUND_S = 300


class SignalsAt:
    """``data`` whose batch of step ``k`` (a run from step 0) sends this process ``signals[k]``
    as it is read, in the main thread, before step ``k`` is dispatched: Python runs the handler at
    once, so the signal arrives during step ``k``."""

    def __init__(self, data, signals: dict[int, list[int]]):
        self._data, self._signals = data, signals

    def __getattr__(self, name):
        return getattr(self._data, name)

    @contextlib.contextmanager
    def batches(self, start=0, rows=slice(None)):
        with self._data.batches(start=start, rows=rows) as stream:

            def signalling():
                while True:
                    index, batch = next(stream)
                    for signum in self._signals.get(index + 1, ()):
                        os.kill(os.getpid(), signum)
                    yield index, batch

            yield signalling()


@pytest.fixture
def data(tmp_path, seed):
    folder = random_token_folder(tmp_path / "tokens", seed, 2000, 200)
    return TokenWindows(folder, seq_len=SEQ, loading=Loading(threads=1)).load(batch=ROWS)


def test_signals_stop_fit_after_the_step_in_flight_with_its_checkpoint(
    data, tmp_path, capsys, seed
):
    trainer = dew.Trainer(
        tiny_objective(num_layers=1),
        optax.adamw(1e-2),
        jax.random.key(seed),
        mesh=dew.MeshSpec(fsdp=2),
        layout=dew.Layout(min_shard=1),
    )
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    cases = [
        # (signals by step, checkpoints, the exit code or None for a return, the step it stops at)
        ({3: [signal.SIGTERM]}, True, 143, 3),
        ({2: [signal.SIGINT]}, True, None, 2),
        ({4: [signal.SIGINT, signal.SIGINT]}, True, 130, 4),
        ({2: [signal.SIGTERM]}, False, 143, 2),
    ]
    for number, (signals, checkpoints, code, stop_step) in enumerate(cases):
        directory = tmp_path / f"run{number}"
        trainer.checkpoints = dew.Checkpoints(directory) if checkpoints else None
        what = (
            "checkpoint saved"
            if checkpoints
            else "not saved: the Trainer has no checkpoints (checkpoints=None)"
        )
        if code is None:
            state = trainer.fit(SignalsAt(data, signals), steps=6, log_every=1)
            out = capsys.readouterr().out
            assert out.rstrip().endswith(f"Interrupted at step {stop_step}; {what}"), (seed, out)
        else:
            with pytest.raises(Preempted) as raised:
                trainer.fit(SignalsAt(data, signals), steps=6, log_every=1)
            out = capsys.readouterr().out
            assert out.rstrip().endswith(f"Preempted at step {stop_step}; {what}"), (seed, out)
            error = raised.value
            assert (error.code, error.step, error.saved) == (code, stop_step, checkpoints)
            state = error.state
        # The step the signal arrived in ran to its end, and no step after it.
        assert int(state.step) == stop_step, (seed, signals)
        assert re.findall(r"^step (\d+):", out, re.M)[-1] == str(stop_step), (seed, out)
        if checkpoints:
            assert trainer.checkpoints.steps == [stop_step], (seed, signals)
            assert trainer.checkpoints.metadata()["data_position"]["next_batch"] == stop_step
        # fit put the handlers back.
        assert {s: signal.getsignal(s) for s in handlers} == handlers


# --------------------------------------------------------------------------- dew train


TINY = ("--layers", "1", "--width", "32", "--heads", "2", "--batch", "8", "--seq-len", "16")


def dew_env():
    env = child_env()
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def losses(path: Path) -> dict[int, float]:
    """Step -> loss of a metrics file (a later line of a step wins)."""
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}


def test_sigterm_to_dew_train_saves_a_checkpoint_that_resumes_like_a_straight_run(
    tmp_path, seed, dew_here
):
    args = ("train", *TINY, "--seed", str(seed % 1000), "--log-every", "1000")
    metrics = tmp_path / "metrics.jsonl"
    # Far more steps than it can train before the signal: the run ends only by it.
    run = subprocess.Popen(
        [sys.executable, "-m", "dew", *args, "--steps", "100000", "--metrics", str(metrics)],
        cwd=tmp_path,
        env=dew_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + BOUND_S
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert run.poll() is None, run.communicate()
            assert time.monotonic() < deadline, f"no step in {BOUND_S} s"
            time.sleep(0.05)
        run.send_signal(signal.SIGTERM)
        out, err = run.communicate(timeout=BOUND_S)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 143, (seed, out, err[-3000:])
    stopped = int(
        re.fullmatch(r"Preempted at step (\d+); checkpoint saved", out.splitlines()[-1])[1]
    )
    # Every step it trained is in the metrics, the last one is the checkpoint's, and the run
    # printed that step's loss (though --log-every is far off) before it stopped.
    assert sorted(losses(metrics)) == list(range(1, stopped + 1)), (seed, out)
    last = [line for line in out.splitlines() if line.startswith("step ")][-1]
    assert last.startswith(f"step {stopped}: loss {losses(metrics)[stopped]:.4f}, "), (seed, out)

    # The resume and the straight run in this process (8 CPU devices, as dew train's): main, as
    # the console script calls it (dew_here). Only the run that takes the signal needs a process
    # of its own; a second one would import JAX and Dew again for the same step.
    final = stopped + 2
    resumed = dew_here(*args, "--steps", str(final), "--metrics", str(metrics), cwd=tmp_path)
    assert resumed.returncode == 0, (seed, resumed.stderr[-3000:])
    # After the header, the devices' line, the step's compile and the checkpoint read.
    resumed_lines = resumed.stdout.splitlines()
    read = next(i for i, line in enumerate(resumed_lines) if line.startswith("read the checkpoint"))
    assert resumed_lines[read + 1].startswith(f"Resumed from step {stopped} in "), resumed.stdout

    straight_metrics = tmp_path / "straight.jsonl"
    straight = dew_here(
        *args,
        *("--steps", str(final), "--run-dir", "straight", "--metrics", "straight.jsonl"),
        cwd=tmp_path,
    )
    assert straight.returncode == 0, (seed, straight.stderr[-3000:])
    # The same losses at every step, those after the resume included: the checkpoint held the
    # weights, the optimizer state and the data position of the step it names.
    assert losses(metrics) == losses(straight_metrics), f"seed {seed}"
