"""``dew plot``: the figure's lines, read back from the Figure ``build_figure`` returns (not from
the pixels), the PNG ``dew plot`` writes, and the errors for files it cannot read."""

import json

import numpy as np
import pytest

from dew.cli.main import main
from dew.cli.plot import NO_MFU, build_figure, read_metrics, run_names


def write_metrics(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def records(seed, steps, val_every=None, mfu=False):
    rng = np.random.default_rng(seed)
    out = []
    for step in range(1, steps + 1):
        r = dict(step=step, loss=float(rng.uniform(1, 5)), step_time_s=0.1)
        r["tokens_per_s"] = float(rng.uniform(100, 200))
        if mfu:
            r["mfu"] = float(rng.uniform(0.1, 0.5))
            r["mfu_causal"] = float(rng.uniform(0.1, 0.5))
        out.append(r)
        if val_every and step % val_every == 0:
            out.append(dict(step=step, val_loss=float(rng.uniform(1, 5))))
    return out


def test_the_figure_has_a_line_per_run_and_series(tmp_path, seed):
    # Run "a": val_loss every 3 steps (its own lines, as fit writes them) and MFU; a resumed
    # segment from step 4 appended. Run "b": neither.
    a = records((seed, 0), 6, val_every=3, mfu=True)
    resumed = [dict(r, loss=r["loss"] + 1) for r in records((seed, 1), 6, mfu=True)[3:]]
    path_a = write_metrics(tmp_path / "a.jsonl", a + resumed)
    path_b = write_metrics(tmp_path / "b.jsonl", records((seed, 2), 5))
    runs = [("a", read_metrics(path_a)), ("b", read_metrics(path_b))]
    loss_ax, speed_ax, mfu_ax = build_figure(runs).axes

    def lines(ax):
        return {line.get_label(): line.get_data() for line in ax.get_lines()}

    train_a = {r["step"]: r["loss"] for r in a + resumed if "loss" in r}  # the later line wins
    val_a = {r["step"]: r["val_loss"] for r in a if "val_loss" in r}
    assert set(lines(loss_ax)) == {"a", "a val", "b"}, f"seed {seed}"
    steps, values = lines(loss_ax)["a"]
    assert list(steps) == list(train_a) and list(values) == list(train_a.values()), seed
    steps, values = lines(loss_ax)["a val"]
    assert list(steps) == [3, 6] and list(values) == list(val_a.values()), seed
    assert list(lines(loss_ax)["b"][0]) == [1, 2, 3, 4, 5]
    # tokens/s without each segment's first (compiling) step: a's 1 and 4, b's 1.
    assert list(lines(speed_ax)["a"][0]) == [2, 3, 5, 6]
    assert list(lines(speed_ax)["b"][0]) == [2, 3, 4, 5]
    for key, label in (("mfu", "a PaLM"), ("mfu_causal", "a causal-halved")):
        steps, values = lines(mfu_ax)[label]
        mfu_a = {r["step"]: r[key] for r in a + resumed if key in r}
        assert list(steps) == list(mfu_a), label
        assert np.allclose(values, [100 * v for v in mfu_a.values()]), label
    assert set(lines(mfu_ax)) == {"a PaLM", "a causal-halved"}
    assert not [t for t in mfu_ax.texts if t.get_text() == NO_MFU]

    # No run with mfu (a CPU run): the panel stays, empty, saying why.
    mfu_ax = build_figure([("b", read_metrics(path_b))]).axes[2]
    assert not mfu_ax.get_lines() and [t.get_text() for t in mfu_ax.texts] == [NO_MFU]


def test_dew_plot_writes_the_png(tmp_path, capsys, seed):
    one = write_metrics(tmp_path / "one.jsonl", records(seed, 4))
    (tmp_path / "x").mkdir()
    (tmp_path / "y").mkdir()
    first = write_metrics(tmp_path / "x" / "metrics.jsonl", records((seed, 1), 4))
    second = write_metrics(tmp_path / "y" / "metrics.jsonl", records((seed, 2), 4))
    assert run_names([first, second]) == ["x/metrics", "y/metrics"]
    assert run_names([one]) == ["one"]
    out = tmp_path / "plots" / "curves.png"
    assert main(["plot", str(first), str(second), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"Wrote {out}: 2 run(s), 8 steps" in capsys.readouterr().out


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "no such metrics file"),
        ("", "is empty: no metrics to plot"),
        ('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 2.\n', "line 2: not JSON"),
        ('{"step": 1, "loss": 2.0}\n[1, 2]\n', "line 2: not a JSON object"),
        ('{"step": 1, "los": 2.0}\n', "line 1: neither 'loss' nor 'val_loss'"),
        ('{"loss": 2.0}\n', "line 1: no numeric 'step'"),
    ],
)
def test_a_file_it_cannot_read_is_a_clear_error(tmp_path, capsys, content, message):
    path = tmp_path / "m.jsonl"
    if content is not None:
        path.write_text(content)
    assert main(["plot", str(path), "-o", str(tmp_path / "c.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dew plot: {path}") and message in err, err
    assert not (tmp_path / "c.png").exists()


def test_names_must_match_the_files(tmp_path, capsys, seed):
    path = write_metrics(tmp_path / "m.jsonl", records(seed, 2))
    assert main(["plot", str(path), "--name", "a", "--name", "b"]) == 2
    assert "2 --name for 1 files" in capsys.readouterr().err


def test_dew_plot_without_o_says_where_it_wrote(tmp_path, capsys, monkeypatch, seed):
    path = write_metrics(tmp_path / "one.jsonl", records(seed, 3))
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    assert main(["plot", str(path)]) == 0
    written = tmp_path / "here" / "curves.png"
    assert written.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"Wrote {written}: 1 run(s), 3 steps" in capsys.readouterr().out
