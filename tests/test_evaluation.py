"""``dew eval`` and ``dew.evaluation``: lm-eval's model interface over Dew's model, against
lm-eval's Hugging Face backend on the exported model (tests/data/eval/tiny_mc_hf.json, written by
scripts/make_eval_reference.py) and against Dew's own full forward."""

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.evaluation import Scorer
from dew.generation import Generator
from dew.mesh import MeshSpec
from dew.models import hf

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
MODEL = DATA / "hf" / "llama3_untied"
TOKENIZER = DATA / "hf" / "llama3_tied" / "tokenizer.json"
TASK = DATA / "eval" / "tiny_mc.yaml"


@pytest.fixture(scope="module")
def untied():
    return hf.load(MODEL)


def test_scores_are_the_full_forwards_log_probabilities(untied, seed):
    """Pairs of (context, continuation) ids of 3 to 70 tokens (the longest cut to the model's
    last 65, as lm-eval's backends cut), on fsdp=2 x tensor=4: each sum of log-probabilities and
    greedy flag is the one-device full forward's, 1e-4."""
    model, params = untied
    rng = np.random.default_rng(seed)
    lengths = [(2, 1), (9, 4), (20, 11), (60, 10)]
    pairs = [
        (rng.integers(0, 256, c).tolist(), rng.integers(0, 256, n).tolist()) for c, n in lengths
    ]
    pairs.append(
        (pairs[0][0], [int(np.argmax(model.apply(params, jnp.asarray([pairs[0][0]]))[0, -1]))])
    )
    scorer = Scorer(Generator(model, params, mesh=MeshSpec(fsdp=2, tensor=4)))
    got = scorer(pairs)
    apply = jax.jit(model.apply)
    for (context, continuation), (logp, greedy) in zip(pairs, got):
        whole = (context + continuation)[-(model.max_seq_len + 1) :]
        # Right-padded to the model's 64 positions (one compile): causal, so nothing changes.
        row = whole[:-1] + [0] * (model.max_seq_len + 1 - len(whole))
        logits = np.asarray(apply(params, jnp.asarray([row]))[0], np.float64)
        logsm = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        n = len(continuation)
        rows = np.arange(len(whole) - 1)[-n:]
        want = logsm[rows, whole[-n:]].sum()
        assert abs(logp - want) < 1e-4, (logp, want)
        assert greedy == bool((logits[rows].argmax(-1) == whole[-n:]).all())
    assert got[-1][1]  # the argmax continuation is greedy


def test_dew_eval_gives_lm_evals_hf_accuracy_and_choice_loglikelihoods(untied, monkeypatch):
    """The local multiple-choice task (6 questions, 2 to 4 choices, data from a .jsonl, read
    offline) on fsdp=2 x tensor=4: lm-eval's accuracy and normalized accuracy, and every choice's
    log-likelihood within 1e-4 and is-greedy flag, as lm-eval's Hugging Face backend gave them
    on the same weights (scripts/make_eval_reference.py)."""
    pytest.importorskip("lm_eval")
    from dew.evaluation import evaluate

    monkeypatch.chdir(ROOT)  # the task's data path is relative to the repository's root
    ref = json.loads((DATA / "eval" / "tiny_mc_hf.json").read_text())
    model, params = untied
    results = evaluate(
        model, params, [str(TASK)], tokenizer=TOKENIZER, eot_id=ref["prefix_token_id"],
        mesh=MeshSpec(fsdp=2, tensor=4), log_samples=True,
    )  # fmt: skip
    task = results["results"]["dew_tiny_mc"]
    assert task["acc,none"] == ref["acc"] and task["acc_norm,none"] == ref["acc_norm"]
    samples = sorted(results["samples"]["dew_tiny_mc"], key=lambda s: s["doc_id"])
    got = [[[float(lp), bool(g)] for lp, g in s["filtered_resps"]] for s in samples]
    assert [len(c) for c in got] == [len(c) for c in ref["choices"]]
    for doc, (mine, theirs) in enumerate(zip(got, ref["choices"])):
        np.testing.assert_allclose(
            [lp for lp, _ in mine], [lp for lp, _ in theirs], atol=1e-4, rtol=0, err_msg=f"{doc}"
        )
        assert [g for _, g in mine] == [g for _, g in theirs]


def test_rolling_and_generate_until_requests(untied):
    """loglikelihood_rolling of a text shorter than the context: the sum of its tokens'
    log-probabilities after the prefix token; generate_until: the greedy completion cut before
    the first 'until' string."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from dew.evaluation import dew_lm
    from dew.generation import tokenizer_of

    model, params = untied
    tokenizer = tokenizer_of(TOKENIZER)
    lm = dew_lm(Generator(model, params, mesh=MeshSpec(data=1)), tokenizer, eot_id=0)
    text = "a short text to score"
    (rolled,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    ids = [0, *tokenizer.encode(text)]
    logits = np.asarray(model.apply(params, jnp.asarray([ids[:-1]]))[0], np.float64)
    logsm = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    assert abs(rolled - logsm[np.arange(len(ids) - 1), ids[1:]].sum()) < 1e-4
    context = "Question: why?\nAnswer:"
    whole = Generator(model, params, mesh=MeshSpec(data=1))(
        [tokenizer.encode(context)], max_new_tokens=12
    )[0]
    text = tokenizer.decode(whole)
    until = text[5:7]
    request = Instance("generate_until", {}, (context, {"until": [until], "max_gen_toks": 12}), 0)
    assert lm.generate_until([request]) == [text[: text.index(until)]]


def test_without_lm_eval_dew_eval_says_how_to_install_it(tmp_path, dew_here, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval raises ImportError
    run = dew_here("eval", str(MODEL), "--tasks", str(TASK), cwd=tmp_path)
    assert run.returncode == 2
    assert run.stderr.strip() == (
        "dew eval: dew eval needs EleutherAI's lm-eval: pip install -e '.[eval]' (lm-eval)"
    )


def test_dew_eval_appends_the_tasks_metrics_to_the_metrics_file(tmp_path, dew_here, monkeypatch):
    pytest.importorskip("lm_eval")
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 0, "loss": 5.5}\n')
    run = dew_here(
        "eval", str(MODEL), "--tasks", str(TASK), "--tokenizer", str(TOKENIZER), "--eot", "0",
        "--limit", "2", "--metrics", str(metrics), "--mesh", "fsdp=8", cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert lines[0] == {"step": 0, "loss": 5.5}
    assert set(lines[1]) == {"step", "eval/dew_tiny_mc/acc", "eval/dew_tiny_mc/acc_norm"}
    assert "eval/dew_tiny_mc/acc:" in run.stdout


def test_dew_plot_draws_the_eval_lines_beside_the_loss(tmp_path):
    """A metrics file of training lines and two dew eval lines: dew plot reads it (a line with
    only eval/ metrics is no error) and draws each metric on the loss panel's twin axis."""
    pytest.importorskip("matplotlib")
    from dew.cli.plot import build_figure, read_metrics

    path = tmp_path / "metrics.jsonl"
    lines = [{"step": s, "loss": 5.0 - s / 10} for s in range(1, 7)]
    lines += [{"step": 3, "eval/t/acc": 0.25}, {"step": 6, "eval/t/acc": 0.5, "eval/t/f1": 0.4}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    figure = build_figure([("run", read_metrics(path))])
    assert len(figure.axes) == 4  # loss, tokens/s, MFU and the loss panel's twin
    drawn = {line.get_label(): line.get_data() for line in figure.axes[3].get_lines()}
    assert {k: (list(s), list(v)) for k, (s, v) in drawn.items()} == {
        "run t/acc": ([3, 6], [0.25, 0.5]),
        "run t/f1": ([6], [0.4]),
    }


def test_dew_plot_draws_in_training_scores_at_their_steps(tmp_path):
    """A training metrics file whose eval/ scores sit on the loss lines of the evaluation steps
    (fit(evaluations=...), dew train --eval-tasks), resumed once (step 4 trained again, the later
    line the run's): the eval series are drawn at steps 2, 4 and 5 with the later step 4, the
    loss at every step, on the loss panel and its twin."""
    pytest.importorskip("matplotlib")
    from dew.cli.plot import build_figure, read_metrics

    lines = [{"step": s, "loss": 5.0 - s / 10, "tokens_per_s": 100.0 + s} for s in range(1, 5)]
    lines[1].update({"eval/t/acc": 0.25, "eval_time_s": 1.5, "val_weights": "ema"})
    lines[3].update({"eval/t/acc": 0.375, "eval_time_s": 0.1, "val_weights": "ema"})
    lines += [  # resumed from step 3's checkpoint
        {"step": 4, "loss": 4.55, "tokens_per_s": 90.0, "eval/t/acc": 0.5, "eval_time_s": 1.4},
        {"step": 5, "loss": 4.5, "tokens_per_s": 95.0, "eval/t/acc": 0.625, "eval_time_s": 0.1},
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    figure = build_figure([("run", read_metrics(path))])
    (acc,) = figure.axes[3].get_lines()
    assert acc.get_label() == "run t/acc"
    assert [list(x) for x in acc.get_data()] == [[2, 4, 5], [0.25, 0.5, 0.625]]
    loss = figure.axes[0].get_lines()[0].get_data()
    assert [list(x) for x in loss] == [[1, 2, 3, 4, 5], [4.9, 4.8, 4.7, 4.55, 4.5]]
