"""Two processes of four CPU devices each train one model on one mesh (data 2 x fsdp 4 over both),
checkpoint it together and resume; the result equals a one-process run of the same steps."""

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

import dew
from dew.data import TokenWindows, write_token_folder
from tests.helpers import SEQ, VOCAB, relative_error, two_process_trainer

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(folder, checkpoints, steps):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "tests" / "multiprocess_worker.py"),
                str(port),
                str(i),
                str(folder),
                str(checkpoints),
                str(steps),
            ],
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
        int(step): float(loss) for step, loss in re.findall(r"step (\d+): loss (\S+)$", text, re.M)
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
