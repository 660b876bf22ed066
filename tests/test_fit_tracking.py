"""``fit``'s evaluation cadence, its trackers (the JSON-lines file, TensorBoard event files read
back by TensorBoard's own reader, a user's) and the throughput fields, from one short run shared
by the module; and the refusals of bad settings, before anything compiles.

``dew train --eval-every --tensorboard`` runs in tests/test_cli.py; the FLOP count and the peak
table in tests/test_flops.py."""

import contextlib
import io
import json
import re

import jax
import numpy as np
import pytest

import dew
from dew.data import TokenWindows
from dew.training import flops, tracking
from dew.training.tracking import FitLog, JsonLines, LogWindow, TensorBoard
from tests.helpers import (
    SEQ,
    assert_line_speed,
    parse_log_line,
    random_token_folder,
    seeded_key,
    smooth_optimizer,
    tiny_objective,
)

ROWS = 8
STEPS = 5
EVAL_EVERY = 2
EVAL_BATCHES = 2  # of the folder's 3
FAKE_PEAK = 3e9  # FLOP/s: what the run is told the CPU's peak is, to check the MFU arithmetic

# One worker runs the module: its fixture trains once.
pytestmark = pytest.mark.xdist_group("fit_tracking")


class Recorder:
    """A user's tracker: keeps what it is given."""

    def __init__(self):
        self.logged, self.closed = [], 0

    def log(self, step, metrics):
        self.logged.append((step, dict(metrics)))

    def close(self):
        self.closed += 1


def make_trainer(seed):
    return dew.Trainer(
        tiny_objective(ema_decay=0.9),
        smooth_optimizer(),
        seeded_key(seed),
        mesh=dew.MeshSpec(fsdp=4),
        layout=dew.Layout(min_shard=1),
    )


@pytest.fixture(scope="module")
def folder(tmp_path_factory, module_seed):
    # 400 validation tokens: 24 windows of 17, 3 batches of 8.
    return random_token_folder(tmp_path_factory.mktemp("fit") / "tokens", module_seed, 2000, 400)


@pytest.fixture(scope="module")
def run(folder, tmp_path_factory, module_seed):
    """One fit of 5 steps, evaluating every 2 on 2 validation batches, to a metrics file, a
    TensorBoard folder and a Recorder, with the device peak looked up through a stand-in that
    records the device kind it is asked about."""
    out = tmp_path_factory.mktemp("fit_out")
    data = TokenWindows(folder, seq_len=SEQ, val_batches=3).load(batch=ROWS)
    trainer = make_trainer(module_seed)
    recorder, kinds, builds = Recorder(), [], []
    real_build_loss = dew.training.trainer.build_loss

    def counting_build_loss(*args, **kwargs):
        builds.append(kwargs.get("global_rows"))
        return real_build_loss(*args, **kwargs)

    def fake_peak(kind):
        kinds.append(kind)
        return FAKE_PEAK

    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        patch.setattr(dew.training.flops, "peak_flops", fake_peak)
        patch.setattr(dew.training.trainer, "build_loss", counting_build_loss)
        state = trainer.fit(
            data,
            steps=STEPS,
            log_every=100,
            eval_every=EVAL_EVERY,
            eval_batches=EVAL_BATCHES,
            metrics=out / "m" / "metrics.jsonl",
            trackers=[TensorBoard(out / "tb"), recorder],
        )
    lines = [json.loads(line) for line in (out / "m" / "metrics.jsonl").read_text().splitlines()]
    return dict(
        trainer=trainer,
        data=data,
        state=state,
        lines=lines,
        printed=printed.getvalue().splitlines(),
        recorder=recorder,
        kinds=kinds,
        builds=builds,
        tb=out / "tb",
    )


def test_evaluates_every_n_steps_and_at_the_end(run):
    evaluated = [line["step"] for line in run["lines"] if "val_loss" in line]
    assert evaluated == [2, 4, 5]  # every 2 steps, and the last step (5)
    printed = [line for line in run["printed"] if "val_loss" in line]
    assert printed == [
        f"step {s}: val_loss {run['lines'][s - 1]['val_loss']:.4f}" for s in (2, 4, 5)
    ]


def test_val_loss_is_the_ema_weights_loss_on_the_first_k_batches(run, folder, seed):
    # Replays the run's steps and evaluates the EMA weights of each evaluated step with
    # evaluate() on data that holds exactly the first EVAL_BATCHES validation batches: the
    # weights evaluated (EMA, not the raw weights), the step and the batches must all be right.
    trainer, data = run["trainer"], run["data"]
    first_k = TokenWindows(folder, seq_len=SEQ, val_batches=EVAL_BATCHES).load(batch=ROWS)
    state, step_fn = trainer.init_state(), trainer.train_step(ROWS)
    by_step = {line["step"]: line for line in run["lines"]}
    with data.batches(start=0) as batches:
        for step in range(1, STEPS + 1):
            state, _ = step_fn(state, trainer.device_batch(next(batches)[1], ROWS))
            if "val_loss" in by_step[step]:
                assert by_step[step]["val_weights"] == "ema"
                want = trainer.evaluate(state, first_k, params="ema")
                np.testing.assert_allclose(
                    by_step[step]["val_loss"], want, rtol=1e-6, err_msg=f"step {step}, seed {seed}"
                )
                raw = trainer.evaluate(state, first_k, params="params")
                # The test can tell: the raw weights' loss is ten times the comparison's
                # tolerance away (a fixed 1e-4 failed on seed 905138020: 8.5e-5 at step 2).
                assert abs(raw - want) > 10 * 1e-6 * abs(want), (step, raw, want, seed)


def test_the_evaluation_compiles_once(run):
    assert run["builds"] == [ROWS]  # one forward built for 3 evaluations
    assert run["trainer"]._losses[ROWS]._cache_size() == 1


def test_throughput_fields_and_mfu_against_the_peak(run):
    model = run["trainer"].objective.model
    counts = {
        "": flops.model_flops_per_token(model, SEQ),
        "_causal": flops.model_flops_per_token(model, SEQ, causal_halved=True),
    }
    devices = jax.device_count()
    assert run["kinds"] == [jax.devices()[0].device_kind]
    for line in run["lines"]:
        tokens_per_s = ROWS * SEQ / line["step_time_s"]
        np.testing.assert_allclose(line["tokens_per_s"], tokens_per_s, rtol=1e-9)
        for suffix, per_token in counts.items():
            model_flops = per_token * tokens_per_s / devices
            np.testing.assert_allclose(
                line[f"model_tflops_per_device{suffix}"], model_flops / 1e12, rtol=1e-9
            )
            np.testing.assert_allclose(line[f"mfu{suffix}"], model_flops / FAKE_PEAK, rtol=1e-9)


def test_the_log_line_gives_the_mean_speed_and_mfu_since_the_first_step(run):
    # log_every=100: one line, at the last step, whose speed is that of steps 2 to 5 (step 1
    # compiles), MFU included: the run was told the device's peak.
    model = run["trainer"].objective.model
    per_token = flops.model_flops_per_token(model, SEQ)
    causal = flops.model_flops_per_token(model, SEQ, causal_halved=True)
    devices = jax.device_count()
    (line,) = [parse_log_line(text) for text in run["printed"] if ": loss " in text]
    assert line["step"] == STEPS and line["loss"] == f"{run['lines'][-1]['loss']:.4f}"
    assert_line_speed(
        line,
        [m["step_time_s"] for m in run["lines"][1:]],
        tokens=ROWS * SEQ,
        mfu_at=lambda seconds: per_token * ROWS * SEQ / seconds / devices / FAKE_PEAK,
        causal_at=lambda seconds: causal * ROWS * SEQ / seconds / devices / FAKE_PEAK,
    )


def test_the_user_tracker_gets_every_step_and_is_closed(run):
    recorder = run["recorder"]
    assert recorder.closed == 1
    assert [step for step, _ in recorder.logged] == list(range(1, STEPS + 1))
    for (step, metrics), line in zip(recorder.logged, run["lines"], strict=True):
        assert {"step": step, **metrics} == line


def test_tensorboard_files_read_back_by_tensorboard(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run["tb"]))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    numeric = {k for line in run["lines"] for k, v in line.items() if k != "step"} - {"val_weights"}
    assert tags == numeric, tags ^ numeric
    for tag in ("loss", "val_loss", "tokens_per_s", "mfu"):
        want = [(line["step"], line[tag]) for line in run["lines"] if tag in line]
        got = [(event.step, event.value) for event in events.Scalars(tag)]
        assert [s for s, _ in got] == [s for s, _ in want], tag
        # TensorBoard keeps float32.
        np.testing.assert_allclose([v for _, v in got], [v for _, v in want], rtol=1e-6)


# ------------------------------------------------------------------------------ refusals


def refuse_compiling(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("compiled before checking the input")

    monkeypatch.setattr(jax, "jit", boom)


@pytest.mark.parametrize(
    "val_batches, settings, message",
    [
        (3, dict(eval_every=0), "eval_every must be an integer >= 1, got 0"),
        (3, dict(eval_every=-2), "eval_every must be an integer >= 1, got -2"),
        (3, dict(eval_every=2, eval_batches=0), "eval_batches must be an integer >= 1, got 0"),
        (3, dict(eval_batches=2), "eval_batches=2 without eval_every"),
        (0, dict(eval_every=2), r"eval_every=2 needs validation batches; the data has none"),
        (2, dict(eval_every=2, eval_batches=3), "eval_batches=3 is more than the data's 2"),
    ],
    ids=["zero", "negative", "zero_batches", "batches_alone", "no_validation", "too_many"],
)
def test_bad_evaluation_settings(
    folder, seed, monkeypatch, tmp_path, val_batches, settings, message
):
    data = TokenWindows(folder, seq_len=SEQ, val_batches=val_batches).load(batch=ROWS)
    trainer = make_trainer(seed)
    refuse_compiling(monkeypatch)
    with pytest.raises(ValueError, match=message):
        trainer.fit(data, steps=2, metrics=tmp_path / "m.jsonl", **settings)
    assert not (tmp_path / "m.jsonl").exists()


def test_a_tracker_without_close_is_refused(folder, seed, monkeypatch):
    class LogOnly:
        def log(self, step, metrics):
            pass

    data = TokenWindows(folder, seq_len=SEQ).load(batch=ROWS)
    trainer = make_trainer(seed)
    refuse_compiling(monkeypatch)
    with pytest.raises(TypeError, match=re.escape("needs log(step, metrics) and close()")):
        trainer.fit(data, steps=2, trackers=[LogOnly()])


# ------------------------------------------------------------------------------ units


def test_only_process_0_logs(monkeypatch):
    recorder = Recorder()
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    with FitLog([recorder], tokens=16, flops_per_token=None, devices=1, peak=None) as log:
        log.step(1, {"loss": 1.0}, 0.5)
    assert recorder.logged == [] and recorder.closed == 1
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    with FitLog([recorder], tokens=16, flops_per_token=None, devices=1, peak=None) as log:
        log.step(1, {"loss": 1.0}, 0.5)
    assert recorder.logged == [(1, {"loss": 1.0, "step_time_s": 0.5, "tokens_per_s": 32.0})]


def test_the_log_window_leaves_out_the_first_step_unless_it_is_alone():
    # Step times as a clock would give them: 3 s for the first step (compiling), then 0.2, 0.3,
    # then 0.5. 1000 tokens a step, 1e8 FLOPs a token (6e7 with causal attention halved), 2
    # devices of 1e12 FLOP/s.
    speed = dict(tokens=1000, flops_per_token=1e8, causal_flops_per_token=6e7, devices=2)
    window = LogWindow(**speed, peak=1e12)
    window.add(3.0)
    assert window.line() == (
        "3,000.0 ms/step, 333 tokens/s, MFU 1.7% PaLM, 1.0% causal-halved (first step: includes "
        "compiling)"
    )
    window.add(0.2)
    window.add(0.3)
    # Mean 0.25 s: 4,000 tokens/s, 1e8 x 4,000 / 2 = 2e11 FLOP/s per device, 20% of 1e12; 6e7:
    # 12%.
    assert window.line() == "250.0 ms/step, 4,000 tokens/s, MFU 20.0% PaLM, 12.0% causal-halved"
    window.add(0.5)
    assert window.line() == "500.0 ms/step, 2,000 tokens/s, MFU 10.0% PaLM, 6.0% causal-halved"
    with pytest.raises(ValueError, match="no step was added since the last line"):
        window.line()
    # The first step with others after it: left out. No peak (a CPU): no MFU.
    window = LogWindow(**speed, peak=None)
    for seconds in (3.0, 0.5, 1.5):
        window.add(seconds)
    assert window.line() == "1,000.0 ms/step, 1,000 tokens/s"


def test_no_flop_count_no_peak_no_invented_fields():
    assert flops.throughput(64, 2.0, None, 8, 1e12) == {"tokens_per_s": 32.0}
    assert flops.throughput(64, 2.0, 1e9, 8, None) == {
        "tokens_per_s": 32.0,
        "model_tflops_per_device": 1e9 * 32.0 / 8 / 1e12,
    }
    assert flops.throughput(64, 2.0, 1e9, 8, None, 6e8) == {
        "tokens_per_s": 32.0,
        "model_tflops_per_device": 1e9 * 32.0 / 8 / 1e12,
        "model_tflops_per_device_causal": 6e8 * 32.0 / 8 / 1e12,
    }


def test_trackers_write_nothing_before_their_first_step(tmp_path):
    # Built on every process, opened by the first log (process 0's): the others leave no file.
    for tracker in (JsonLines(tmp_path / "a" / "m.jsonl"), TensorBoard(tmp_path / "tb")):
        tracker.close()
    assert list(tmp_path.iterdir()) == []


def test_a_missing_tensorboardx_names_the_extra(monkeypatch, tmp_path):
    import builtins

    real_import = builtins.__import__

    def no_tensorboardx(name, *args, **kwargs):
        if name == "tensorboardX":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboardx)
    with pytest.raises(tracking.MissingExtra, match=re.escape("pip install -e '.[tensorboard]'")):
        TensorBoard(tmp_path)
