"""lm-eval tasks during training: ``Trainer.fit(evaluations=[dew.evaluation.Tasks(...)])`` and
``dew train --eval-tasks``.

The tasks are tests/test_evaluation.py's local multiple-choice task (accuracies) and a local
perplexity task over its questions (tests/data/eval/tiny_rolling.yaml: log-likelihoods, continuous,
where six questions' accuracy moves in steps of 1/6). One run of five steps, evaluating every 2
(at steps 2, 4 and 5) on the EMA weights, laid out over fsdp=4 x tensor=2, is shared by the
module; its scores are checked against ``dew.evaluation.evaluate`` on one device, run apart on the
EMA weights its checkpoints hold at those steps. A LoRA run checks the frozen base with its
adapters; the command's refusals come before anything compiles.
"""

import contextlib
import io
import json
import re
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import dew
from dew.checkpoints import Checkpoints
from dew.data import TokenWindows, write_token_folder
from dew.mesh import MeshSpec
from dew.objectives.lm import LMObjective
from tests.helpers import seeded_key

pytest.importorskip("lm_eval")

from dew.evaluation import Tasks, evaluate  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
TOKENIZER = DATA / "hf" / "llama3_tied" / "tokenizer.json"  # 256 ids, no end-of-text of its own
MC = "tests/data/eval/tiny_mc.yaml"  # relative: their data paths are read from the root
ROLLING = "tests/data/eval/tiny_rolling.yaml"
EOT = 0
SEQ = 16
STEPS, EVAL_EVERY = 5, 2
EVAL_STEPS = [2, 4, 5]  # every 2, and the last

# One worker runs the module: its fixture trains once.
pytestmark = pytest.mark.xdist_group("fit_evaluation")


def model_of(**overrides):
    """The tiny model the runs train: vocabulary 256 (the tokenizer's), context 64."""
    config = dict(vocab_size=256, emb_features=32, num_layers=2, num_heads=4, max_seq_len=64)
    return dew.models.build("causal_transformer", **{**config, **overrides})


def token_folder(path, seed, eos_id=EOT, tokenizer=str(TOKENIZER)):
    rng = np.random.default_rng(seed)
    write_token_folder(
        path, rng.integers(0, 256, 3000), rng.integers(0, 256, 600), tokenizer=tokenizer,
        vocab_size=256, eos_id=eos_id,
    )  # fmt: skip
    return path


class Watched(Tasks):
    """Tasks that record, at each call, the step and whether the generator ran on the very
    buffers it was given (the trainer's state: no copy)."""

    def __call__(self, model, params, adapters, mesh, layout, step):
        scores = super().__call__(model, params, adapters, mesh, layout, step)
        given = jax.tree_util.tree_leaves(params)
        held = jax.tree_util.tree_leaves(self._generator.weights[0])
        self.calls.append((step, all(buffers(a) == buffers(b) for a, b in zip(given, held))))
        return scores


def buffers(array) -> list[int]:
    return [shard.data.unsafe_buffer_pointer() for shard in array.addressable_shards]


def one_device_scores(model, params, adapters=None, tasks=(MC, ROLLING)) -> dict:
    """``evaluate`` (not the in-training path) on one device: ``{"eval/TASK/METRIC": value}``."""
    from dew.evaluation import metrics_of

    results = evaluate(
        model, params, list(tasks), tokenizer=TOKENIZER, adapters=adapters,
        mesh=MeshSpec(data=1), eot_id=EOT,
    )  # fmt: skip
    return metrics_of(results)


def assert_scores_equal(got: dict, want: dict) -> None:
    """Accuracies exactly; perplexities (exp of a sum of log-likelihoods over the words or bytes)
    to 1e-5 relative: float32 forwards laid out differently."""
    assert set(got) == set(want), (sorted(got), sorted(want))
    for name, value in want.items():
        if "/acc" in name:
            assert got[name] == value, (name, got[name], value)
        else:
            assert abs(got[name] - value) <= 1e-5 * abs(value), (name, got[name], value)


@pytest.fixture(scope="module")
def run(tmp_path_factory, module_seed):
    """Five steps, EMA 0.5, fsdp=4 x tensor=2, evaluating both tasks every 2 steps (and at the
    last) with no validation batches, a checkpoint at every evaluation step; the Generator
    constructions counted."""
    monkeypatch = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("fit_evaluation")
    data = TokenWindows(token_folder(root / "tokens", module_seed), seq_len=SEQ).load(batch=8)
    objective = LMObjective(model_of(), SEQ, ema_decay=0.5)
    trainer = dew.Trainer(
        objective, optax.adam(1e-2), seeded_key(module_seed),
        mesh=MeshSpec(fsdp=4, tensor=2), layout=dew.Layout(min_shard=1),
        checkpoints=Checkpoints(root / "checkpoints", keep=None),
    )  # fmt: skip
    built = []
    import dew.evaluation as evaluation

    real = evaluation.Generator

    class Counted(real):
        def __init__(self, *args, **kwargs):
            built.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(evaluation, "Generator", Counted)
    monkeypatch.chdir(ROOT)
    tasks = Watched([MC, ROLLING], TOKENIZER, eot_id=EOT)
    tasks.calls = []
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            trainer.fit(
                data, steps=STEPS, log_every=1, checkpoint_every=EVAL_EVERY,
                metrics=root / "metrics.jsonl", eval_every=EVAL_EVERY, evaluations=[tasks],
            )  # fmt: skip
    finally:
        monkeypatch.undo()
    lines = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    return dict(
        trainer=trainer, tasks=tasks, built=built, lines=lines, printed=printed.getvalue(),
        checkpoints=root / "checkpoints", model=objective.model,
    )  # fmt: skip


def test_the_metrics_file_holds_the_scores_at_exactly_the_evaluation_steps(run):
    """Every step has its line; the eval/ scores (both tasks' metrics), eval_time_s and
    val_weights "ema" are on the lines of steps 2, 4 and 5 only, and each is printed as one line
    ``step N: eval/... value, ... (S s)`` with the file's values."""
    lines = run["lines"]
    assert [m["step"] for m in lines] == list(range(1, STEPS + 1))
    names = {
        "eval/dew_tiny_mc/acc", "eval/dew_tiny_mc/acc_norm",
        "eval/dew_tiny_rolling/word_perplexity", "eval/dew_tiny_rolling/byte_perplexity",
        "eval/dew_tiny_rolling/bits_per_byte",
    }  # fmt: skip
    scored = [m["step"] for m in lines if names & set(m)]
    assert scored == EVAL_STEPS
    for m in lines:
        if m["step"] in EVAL_STEPS:
            assert names <= set(m) and m["val_weights"] == "ema" and m["eval_time_s"] > 0, m
            assert "val_loss" not in m  # the data has no validation batches
    printed = [line for line in run["printed"].splitlines() if "eval/" in line]
    want = [
        f"step {m['step']}: "
        + ", ".join(f"{k} {m[k]:.6g}" for k in m if k.startswith("eval/"))
        + f" ({m['eval_time_s']:.1f} s)"
        for m in lines
        if m["step"] in EVAL_STEPS
    ]
    assert printed == want


def test_the_scores_are_evaluates_on_one_device_of_the_ema_at_that_step(run):
    """At each evaluation step, the scores equal ``evaluate``'s on one device of the EMA weights
    the checkpoint of that step holds (not the weights, not another step's)."""
    model = run["model"]
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one),
        jax.eval_shape(model.init, jax.random.key(0)),
    )
    checkpoints = Checkpoints(run["checkpoints"])
    by_step = {m["step"]: m for m in run["lines"]}
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.chdir(ROOT)
        for step in (2, 5):
            ema, _ = checkpoints.restore(target, step, under=".ema")
            got = {k: v for k, v in by_step[step].items() if k.startswith("eval/")}
            assert_scores_equal(got, one_device_scores(model, ema))


def test_one_generator_its_programs_compiled_once_on_the_states_own_buffers(run):
    """Three evaluation steps build one Generator, compile each program once (the weights are
    its argument) and run on the trainer's arrays, not a copy."""
    tasks = run["tasks"]
    assert run["built"] == [1]
    assert tasks.calls == [(step, True) for step in EVAL_STEPS]
    generator = tasks._generator
    programs = list(tasks._lm.scorer._programs.values()) + list(generator._programs.values())
    assert programs and all(p._cache_size() == 1 for p in programs)


def test_a_lora_run_is_scored_on_its_frozen_base_with_its_adapters(tmp_path, seed, monkeypatch):
    """A LoRA model (rank 4, alpha 6.5) on fsdp=8, two steps, the perplexity task at step 2:
    ``evaluate`` on one device of the base and adapters its checkpoint gives (``load_lora``),
    which differs from the base's alone by far more than the tolerance."""
    from dew.models.checkpoint import load_lora
    from dew.models.lora import Lora

    print(f"seed {seed}")
    monkeypatch.chdir(ROOT)
    data = TokenWindows(token_folder(tmp_path / "tokens", seed), seq_len=SEQ).load(batch=8)
    trainer = dew.Trainer(
        LMObjective(model_of(lora=Lora(rank=4, alpha=6.5)), SEQ), optax.adam(3e-2),
        seeded_key(seed), mesh=MeshSpec(fsdp=8), layout=dew.Layout(min_shard=1),
        checkpoints=Checkpoints(tmp_path / "checkpoints"),
    )  # fmt: skip
    metrics = tmp_path / "metrics.jsonl"
    tasks = Tasks([ROLLING], TOKENIZER, eot_id=EOT)
    trainer.fit(data, steps=2, eval_every=2, metrics=metrics, evaluations=[tasks])
    last = json.loads(metrics.read_text().splitlines()[-1])
    got = {k: v for k, v in last.items() if k.startswith("eval/")}
    model, base, adapters = load_lora(tmp_path / "checkpoints", step=2)
    want = one_device_scores(model, base, adapters, tasks=[ROLLING])
    assert_scores_equal(got, want)
    key = "eval/dew_tiny_rolling/byte_perplexity"
    unadapted = one_device_scores(model, base, jax.tree_util.tree_map(np.zeros_like, adapters),
                                  tasks=[ROLLING])  # fmt: skip
    assert abs(unadapted[key] - want[key]) > 100 * 1e-5 * want[key], (unadapted[key], want[key])


def test_fit_refuses_evaluations_it_cannot_run_before_compiling(tmp_path, monkeypatch):
    """Evaluations without eval_every, and Tasks on a mesh with a sequence axis, a mixture of
    experts or a tokenizer past the model's vocabulary: a ValueError naming what is wrong, before
    a step is built."""
    from dew.mesh import build_mesh

    def built(*args, **kwargs):
        raise AssertionError("a step was built")

    monkeypatch.setattr(dew.Trainer, "train_step", built)
    tasks = Tasks([MC], TOKENIZER, eot_id=EOT)
    trainer = dew.Trainer(LMObjective(model_of(), SEQ), optax.adam(1e-2), jax.random.key(0),
                          mesh=MeshSpec(fsdp=8))  # fmt: skip
    data = TokenWindows(token_folder(tmp_path, 0), seq_len=SEQ).load(batch=8)
    with pytest.raises(ValueError, match=r"evaluations \(1\) without eval_every"):
        trainer.fit(data, steps=2, evaluations=[tasks])
    ring = dew.Trainer(LMObjective(model_of(), SEQ), optax.adam(1e-2), jax.random.key(0),
                       mesh=MeshSpec(fsdp=4, sequence=2))  # fmt: skip
    with pytest.raises(ValueError, match="lm-eval tasks run on the data, fsdp and tensor axes; "
                       "the mesh has sequence 2"):  # fmt: skip
        ring.fit(data, steps=2, eval_every=2, evaluations=[tasks])
    layout = dew.Layout()
    with pytest.raises(ValueError, match="4 experts"):
        tasks.check(model_of(num_experts=4), build_mesh(MeshSpec(fsdp=8)), layout)
    with pytest.raises(ValueError, match="the tokenizer's 256 ids .* vocabulary of 128"):
        tasks.check(model_of(vocab_size=128), build_mesh(MeshSpec(fsdp=8)), layout)
    with pytest.raises(ValueError, match="the tokenizer has none; give eot_id"):
        Tasks([MC], TOKENIZER)


SMALL = ("--mesh", "fsdp=8", "--layers", "1", "--width", "32", "--seq-len", "16")


def test_dew_train_eval_tasks_end_to_end(tmp_path, dew_here, seed):
    """dew train --eval-tasks (both tasks, --eval-limit 3) on a token folder written with the
    tokenizer: the scores printed and on the metrics file's lines of steps 2 and 3 beside the
    validation loss, the tasks recorded in the run, and dew plot's eval series at those steps."""
    pytest.importorskip("matplotlib")
    from dew.cli.plot import build_figure, read_metrics

    print(f"seed {seed}")
    tokens = token_folder(tmp_path / "tokens", seed)
    metrics = tmp_path / "m.jsonl"
    run = dew_here(
        "train", *SMALL, "--data", str(tokens), "--run-dir", str(tmp_path / "run"),
        "--steps", "3", "--log-every", "1", "--eval-every", "2", "--eval-batches", "1",
        "--eval-tasks", MC, ROLLING, "--eval-limit", "3", "--metrics", str(metrics), cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    scored = {m["step"]: m for m in lines if "eval/dew_tiny_mc/acc" in m}
    assert sorted(scored) == [2, 3]
    for step, m in scored.items():
        assert "val_loss" in m and "eval/dew_tiny_rolling/bits_per_byte" in m
        assert round(3 * m["eval/dew_tiny_mc/acc"], 9) % 1 == 0  # 3 documents: --eval-limit
        assert re.search(rf"^step {step}: eval/dew_tiny_mc/acc ", run.stdout, re.M)
    recorded = (tmp_path / "run" / "eval_tasks.jsonl").read_text().splitlines()
    (record,) = [json.loads(line) for line in recorded]
    assert record == {
        "from_step": 0, "tasks": [str(ROOT / MC), str(ROOT / ROLLING)],
        "names": ["dew_tiny_mc", "dew_tiny_rolling"], "limit": 3, "num_fewshot": None,
        "eot_id": EOT,
    }  # fmt: skip
    figure = build_figure([("run", read_metrics(metrics))])
    drawn = {line.get_label(): line.get_data() for line in figure.axes[3].get_lines()}
    key = "eval/dew_tiny_rolling/byte_perplexity"
    steps, values = drawn[f"run {key[len('eval/') :]}"]
    assert list(steps) == [2, 3] and list(values) == [scored[2][key], scored[3][key]]
    loss_steps, _ = figure.axes[0].get_lines()[0].get_data()
    assert list(loss_steps) == [1, 2, 3]


@pytest.fixture
def no_compile(monkeypatch):
    """A step built or compiled fails the test: the refusals come first."""

    def built(*args, **kwargs):
        raise AssertionError("the step was built")

    monkeypatch.setattr(dew.Trainer, "train_step", built)
    monkeypatch.setattr(dew.Trainer, "compile_step", built)


def test_dew_train_eval_tasks_refusals_name_the_flags_before_compiling(
    tmp_path, dew_here, no_compile, monkeypatch
):
    byte = token_folder(tmp_path / "bytes", 0, eos_id=None, tokenizer="byte")
    lost = token_folder(tmp_path / "lost", 0, tokenizer=str(tmp_path / "gone" / "tokenizer.json"))
    good = token_folder(tmp_path / "good", 0)
    run = ("--run-dir", str(tmp_path / "run"), "--steps", "2")
    cases = [
        (("--eval-tasks", MC), "dew train: --eval-tasks needs --eval-every N"),
        (("--eval-limit", "2"), "dew train: --eval-limit 2 without --eval-tasks"),
        (
            ("--data", str(good), "--eval-every", "2", "--eval-tasks", "tasks/missing.yaml"),
            "dew train: --eval-tasks tasks/missing.yaml: no such task file",
        ),
        (
            ("--data", str(lost), "--eval-every", "2", "--eval-tasks", MC),
            f"dew train: --eval-tasks needs the run's tokenizer: the token folder {lost} names "
            f"'{tmp_path / 'gone' / 'tokenizer.json'}' (meta.json's tokenizer), which is not a "
            "file",
        ),
        (
            ("--data", str(byte), "--eval-every", "2", "--eval-tasks", MC),
            "nor the tokenizer (bytes) has one; give --eval-eot ID",
        ),
        (
            ("--data", str(good), "--eval-every", "2", "--eval-tasks", MC, "--eval-limit", "0"),
            "dew train: --eval-limit must be at least 1, got 0",
        ),
        (
            ("--data", str(good), "--eval-every", "2", "--eval-tasks", MC, "--eval-eot", "300"),
            "dew train: --eval-tasks (--mesh fsdp=8): the tokenizer's 256 ids (end-of-text 300) "
            "pass the model's vocabulary of 256",
        ),
    ]
    # A task whose data file is gone: loaded when the tasks are built, before the compile.
    lost_data = tmp_path / "lost_data.yaml"
    gone = tmp_path / "gone.jsonl"
    lost_data.write_text((ROOT / MC).read_text().replace(MC.replace(".yaml", ".jsonl"), str(gone)))
    cases.append((
        ("--data", str(good), "--eval-every", "2", "--eval-tasks", str(lost_data)),
        f"dew train: Unable to find '{gone}'",
    ))  # fmt: skip
    for args, message in cases:
        out = dew_here("train", *SMALL, *run, *args, cwd=ROOT)
        assert out.returncode == 2, (args, out.stdout[-2000:])
        assert message in out.stderr, (args, out.stderr)
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval raises ImportError
    out = dew_here("train", *SMALL, *run, "--eval-every", "2", "--eval-tasks", MC, cwd=ROOT)
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "dew train: dew train --eval-tasks needs EleutherAI's lm-eval: pip install -e '.[eval]' "
        "(lm-eval)"
    )


def test_two_processes_each_run_the_tasks_and_process_0_logs_them(tmp_path, seed):
    """fsdp=8 over two processes of four devices: both processes run the tasks (the forwards'
    collectives, the rows gathered to each) and print the same scores; process 0 alone writes
    the metrics file, whose scores are ``evaluate``'s on one device of the checkpoint's weights."""
    from tests.test_multiprocess import run_two

    print(f"seed {seed}")
    tokens = token_folder(tmp_path / "tokens", seed)
    metrics = tmp_path / "metrics.jsonl"
    outputs = run_two("fit_evaluation_worker.py", tokens, tmp_path / "checkpoints", metrics)
    printed = [[line for line in out.splitlines() if "eval/" in line] for out in outputs]
    assert len(printed[0]) == 1 and printed[0][0].startswith("step 2: eval/dew_tiny_mc/acc ")
    assert [p[0].rsplit(" (", 1)[0] for p in printed] == [printed[0][0].rsplit(" (", 1)[0]] * 2
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2]  # once: process 0's
    got = {k: v for k, v in lines[1].items() if k.startswith("eval/")}
    model, params = dew.load_checkpoint(tmp_path / "checkpoints", step=2)
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.chdir(ROOT)
        from dew.evaluation import metrics_of

        want = metrics_of(evaluate(model, params, [MC, ROLLING], tokenizer=TOKENIZER,
                                   mesh=MeshSpec(data=1), eot_id=EOT, limit=3))  # fmt: skip
    assert_scores_equal(got, want)


def test_set_weights_keeps_arrays_in_place_and_refuses_other_shapes():
    """Generator.set_weights: weights already laid out as the generator lays them out are used as
    they are (the same buffers); another model's are refused, naming why."""
    from dew.generation import Generator

    model = model_of(num_layers=1)
    generator = Generator(model, model.init(jax.random.key(0)), mesh=MeshSpec(fsdp=8))
    again = jax.tree_util.tree_map(lambda x: x + 1, generator.weights[0])  # same layout
    generator.set_weights(again)
    leaves = zip(jax.tree_util.tree_leaves(again), jax.tree_util.tree_leaves(generator.weights))
    assert all(buffers(a) == buffers(b) for a, b in leaves)
    wider = model_of(num_layers=1, emb_features=64)
    with pytest.raises(ValueError, match="tree, shapes or dtypes differ"):
        generator.set_weights(wider.init(jax.random.key(0)))
