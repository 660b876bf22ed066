"""``fit(metrics=FILE)``: one JSON line per step, a user can plot (``dew train --metrics FILE``
is run in tests/test_cli.py)."""

import json

import jax
import numpy as np
import optax
import pytest

import dew
from dew.data import TokenWindows
from tests.helpers import (
    SEQ,
    assert_line_speed,
    parse_log_line,
    random_token_folder,
    tiny_objective,
)

ROWS = 16


def make_trainer(directory=None):
    return dew.Trainer(
        tiny_objective(),
        optax.adamw(1e-2),
        jax.random.key(3),
        mesh=dew.MeshSpec(fsdp=4),
        layout=dew.Layout(min_shard=1),
        checkpoints=dew.Checkpoints(directory) if directory else None,
    )


@pytest.fixture
def data(tmp_path, seed):
    folder = random_token_folder(tmp_path / "tokens", seed, 3000, 300)
    return TokenWindows(folder, seq_len=SEQ).load(batch=ROWS)


def read_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_one_line_per_step_with_the_steps_loss(tmp_path, data, seed):
    path = tmp_path / "run" / "metrics.jsonl"  # its folder does not exist yet
    make_trainer().fit(data, steps=4, log_every=100, metrics=path)
    lines = read_lines(path)
    assert [line["step"] for line in lines] == [1, 2, 3, 4], f"seed {seed}"
    # No "mfu" on the CPU: its peak FLOP/s is unknown (tests/test_fit_tracking.py checks it where
    # a peak is given).
    # No "lr" either: the test's optimizer is a plain optax one, which does not say it.
    fields = {"step", "loss", "step_time_s", "tokens_per_s", "model_tflops_per_device", "grad_norm"}
    fields.add("model_tflops_per_device_causal")  # with causal attention halved (MaxText's)
    assert all(set(line) == fields for line in lines), lines[0]
    # The same steps, taken one by one: the file holds each step's loss, not a stale or averaged
    # one.
    trainer = make_trainer()
    state, step_fn = trainer.init_state(), trainer.train_step(ROWS)
    with data.batches(start=0) as batches:
        for line in lines:
            state, metrics = step_fn(state, trainer.device_batch(next(batches)[1], ROWS))
            np.testing.assert_allclose(
                line["loss"], float(metrics["loss"]), rtol=1e-6, err_msg=f"seed {seed}"
            )
    for line in lines:
        assert line["step_time_s"] > 0
        np.testing.assert_allclose(line["tokens_per_s"], ROWS * SEQ / line["step_time_s"])


def printed_lines(out: str) -> list[dict]:
    return [parse_log_line(line) for line in out.splitlines() if line.startswith("step ")]


def test_each_log_line_gives_the_speed_of_the_steps_since_the_line_before(tmp_path, data, capsys):
    path = tmp_path / "metrics.jsonl"
    make_trainer().fit(data, steps=5, log_every=2, metrics=path)
    times = {line["step"]: line["step_time_s"] for line in read_lines(path)}
    printed = printed_lines(capsys.readouterr().out)
    # Step 1, which compiles, is in no line's mean; the last step gets a line of its own.
    windows = {2: [2], 4: [3, 4], 5: [5]}
    assert [line["step"] for line in printed] == list(windows)
    for line in printed:
        assert not line["first"], line
        # No MFU: the CPU's peak is unknown (tests/test_fit_tracking.py gives one).
        assert_line_speed(line, [times[s] for s in windows[line["step"]]], tokens=ROWS * SEQ)


def test_a_line_of_the_first_step_alone_gives_its_time_and_says_so(tmp_path, data, capsys):
    path = tmp_path / "metrics.jsonl"
    make_trainer().fit(data, steps=2, log_every=1, metrics=path)
    times = {line["step"]: line["step_time_s"] for line in read_lines(path)}
    first, second = printed_lines(capsys.readouterr().out)
    assert first["first"] == "includes compiling" and not second["first"], (first, second)
    assert_line_speed(first, [times[1]], tokens=ROWS * SEQ)
    assert_line_speed(second, [times[2]], tokens=ROWS * SEQ)


def test_a_resumed_run_appends(tmp_path, data):
    path = tmp_path / "metrics.jsonl"
    make_trainer(tmp_path / "ckpt").fit(data, steps=2, metrics=path)
    make_trainer(tmp_path / "ckpt").fit(data, steps=5, metrics=path)
    assert [line["step"] for line in read_lines(path)] == [1, 2, 3, 4, 5]


def test_a_folder_is_refused_before_training(tmp_path, data):
    trainer = make_trainer()

    def no_step(*args):
        raise AssertionError("compiled a step before checking metrics")

    trainer.train_step = no_step
    with pytest.raises(ValueError, match="is a folder; give a file name"):
        trainer.fit(data, steps=2, metrics=tmp_path)
