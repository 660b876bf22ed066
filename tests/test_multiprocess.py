"""Two processes of four CPU devices each train one model on one mesh (data 2 x fsdp 4 over both),
checkpoint it together and resume; the result equals a one-process run of the same steps. And a
two-process save that one process fails to write fails on both at once."""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

import dew
from dew.checkpoints import Checkpoints
from dew.data import TokenWindows, write_token_folder
from tests.helpers import SEQ, VOCAB, child_env, relative_error, two_process_trainer

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(folder, checkpoints, steps):
    return run_two("multiprocess_worker.py", folder, checkpoints, steps)


def run_two(worker: str, *args) -> list[str]:
    """The stdout of each of two processes of tests/`worker` (argv: port, process id, `args`);
    fails unless both exit 0."""
    port = free_port()
    env = child_env()
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    procs = [
        subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / worker), str(port), str(i), *map(str, args)],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outputs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-4000:]
            outputs.append(out)
    finally:
        for p in procs:
            p.kill()
    return outputs


def printed_losses(text):
    # Not anchored at the line's start: a line some library wrote to the same stdout without its
    # newline must not hide the loss printed after it.
    return {
        int(step): float(loss)
        for step, loss in re.findall(r"step (\d+): loss ([^\s,]+), ", text, re.M)
    }


def test_two_processes_train_checkpoint_and_resume_like_one(tmp_path, capsys, seed):
    rng = np.random.default_rng(seed)
    folder = tmp_path / "tokens"
    write_token_folder(
        folder, rng.integers(0, VOCAB, 3000), rng.integers(0, VOCAB, 300), vocab_size=VOCAB
    )
    checkpoints = tmp_path / "checkpoints"

    first = launch(folder, checkpoints, steps=2)
    assert "(2 process(es))" in first[0] and "(2 process(es))" in first[1]
    second = launch(folder, checkpoints, steps=4)
    assert second[0].startswith(f"Resumed from step 2 in {checkpoints}")
    multi = {**printed_losses(first[0]), **printed_losses(second[0])}
    assert sorted(multi) == [1, 2, 3, 4], (first[0], second[0])

    # The same run in this one process of 8 devices, uninterrupted.
    data = TokenWindows(folder, seq_len=SEQ, seed=7).load(batch=16)
    single = two_process_trainer(dew.MeshSpec(fsdp=4))
    state = single.fit(data, steps=4, log_every=1)
    one = printed_losses(capsys.readouterr().out)
    for step in one:
        assert abs(multi[step] - one[step]) <= 2e-4, (f"seed {seed}", step, multi[step], one[step])

    # The checkpoint the two processes wrote, restored here into another layout, equals the
    # one-process state.
    reader = two_process_trainer(dew.MeshSpec(fsdp=8), checkpoints)
    restored, _, position = reader.place()
    assert int(restored.step) == 4 and position["next_batch"] == 4
    assert relative_error(restored.params, state.params) < 1e-5, f"seed {seed}"
    assert relative_error(restored.opt_state, state.opt_state) < 1e-5, f"seed {seed}"


# How long each process of the failing save may take to raise. The save is tiny and the failure
# is reported as it happens, so this is seconds; the barrier timeout, which a process waiting for
# a failed peer would sit out, is four times as long.
FAILURE_BOUND_S = 15
BARRIER_TIMEOUT_S = 60


def test_a_process_whose_write_fails_makes_every_process_raise_at_once(tmp_path):
    """Process 1 cannot write its file of step 2 (disk full): both processes' wait() raise, well
    before the barrier timeout, naming process 1 and its error; step 2 is not committed, step 1
    still restores on both, and the next save succeeds."""
    outputs = run_two("save_failure_worker.py", tmp_path, BARRIER_TIMEOUT_S)
    results = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    for rank, result in enumerate(results):
        assert result["error"] is not None, f"process {rank}: saving step 2 did not fail"
        assert "process 1 failed writing its file of step 2" in result["error"], result
        assert "No space left on device" in result["error"], result
        assert result["failed_after_s"] < FAILURE_BOUND_S, (rank, result)
        assert result["restored_step"] == 1 and result["restored_ones"], result
    # Step 2 was never committed (its unfinished folder was removed by the save of step 3).
    assert sorted(os.listdir(tmp_path)) == ["step_00000001", "step_00000003"]
    assert Checkpoints(tmp_path).steps == [1, 3]
