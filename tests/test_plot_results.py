"""bench/plot_results.py draws docs/results/'s plots from the benchmarks' JSON; the recorded data
files say where their figures came from and hold the figures their pages' tables print."""

import importlib.util
import json
import re
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"


def _plot_results():
    spec = importlib.util.spec_from_file_location(
        "plot_results", ROOT / "bench" / "plot_results.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cell(seq, contestant, candidate, mode, tflops, error=None, **row):
    return {
        "row": {"seq": seq, "head_dim": 128, **row},
        "contestant": contestant,
        "candidate": candidate,
        "mode": mode,
        "tflops": tflops,
        "error": error,
    }


def test_best_cell_per_contestant_row_and_mode():
    """As bench/attention.py's table: each contestant's best candidate, errors left out."""
    cells = [
        _cell(4096, "splash", "1024 x 1024", "fwd", 83.5),
        _cell(4096, "splash", "2048 x 2048", "fwd", 79.25),
        _cell(4096, "splash", "512 x 512", "fwd", None, error="OOM"),
        _cell(4096, "dew", "defaults", "fwd", 98.75),
        _cell(4096, "dew", "defaults", "fwd+bwd", 123.5),
        _cell(8192, "splash", "2048 x 2048", "fwd", 109.25, window=1024),
        _cell(8192, "splash", "1024 x 1024", "fwd", 111.0, window=1024),
    ]
    best = _plot_results().best_tflops(cells)
    assert {mode: {r: dict(v) for r, v in rows.items()} for mode, rows in best.items()} == {
        "fwd": {
            "4096, 128": {"splash": 83.5, "dew": 98.75},
            "8192, 128 window 1024": {"splash": 111.0},
        },
        "fwd+bwd": {"4096, 128": {"dew": 123.5}},
    }


def test_load_reads_each_form(tmp_path):
    """JSON lines (bench/attention.py), a list (dew bench), and a recorded file's wrapped list."""
    pr = _plot_results()
    records = [{"a": 1}, {"a": 2.5}]
    lines = tmp_path / "cells.jsonl"
    lines.write_text("".join(json.dumps(r) + "\n" for r in records) + "\n")
    listed = tmp_path / "bench.json"
    listed.write_text(json.dumps(records, indent=2))
    wrapped = tmp_path / "recorded.json"
    wrapped.write_text(json.dumps({"command": "x", "cells": records}))
    for path in (lines, listed, wrapped):
        assert pr.load(path, "cells") == records


def test_draws_every_plot_from_the_recorded_files(tmp_path):
    assert _plot_results().main(["--out", str(tmp_path)]) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["attention-kernels.png", "cpu-layouts.png", "one-chip.png", "slices.png"]
    for png in tmp_path.iterdir():
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert png.stat().st_size < 100_000, png
    # The pages show the committed PNGs: each one is there, under 100 KB.
    for name in names:
        assert (RESULTS / name).stat().st_size < 100_000
        assert f"]({name})" in (RESULTS / name.replace(".png", ".md")).read_text()


@pytest.mark.parametrize("name", ["attention-v5e", "one-chip-v5e", "slices", "cpu-layouts"])
def test_recorded_files_say_where_their_figures_came_from(name):
    data = json.loads((RESULTS / "data" / f"{name}.json").read_text())
    for key in ("source", "machine", "versions"):
        assert data[key], key
    records = data.get("cells") or data.get("runs") or data.get("rows")
    assert records
    for record in [data] if "command" in data else records:
        assert record["command"].startswith(("dew ", "LIBTPU_INIT_ARGS=", "python ")), record
        assert re.fullmatch(r"2026-\d\d-\d\d", record["date"]), record


def _first_table(text: str) -> list[list[str]]:
    """The cells of the first markdown table in ``text``, its header and rule left out."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        table.append([c.strip().strip("*") for c in line.strip("|").split("|")])
    return table[2:]


def test_attention_data_holds_the_pages_table():
    cells = json.loads((RESULTS / "data" / "attention-v5e.json").read_text())["cells"]
    best = _plot_results().best_tflops(cells)
    labels = {
        "4096, 128, gqa 32/8": "4096, 128 gqa 32/8",
        "4096, 128, no mask": "4096, 128 non-causal",
    }
    text = (RESULTS / "attention-kernels.md").read_text()
    rows = _first_table(text.split("\n## Against JAX's kernels\n", 1)[1])
    assert len(rows) == 7
    for row in rows:
        label = labels.get(row[0], row[0])
        for mode, offset in (("fwd", 1), ("fwd+bwd", 4)):
            printed = [float(v) for v in row[offset : offset + 3]]
            recorded = [best[mode][label][n] for n in ("dew", "jax-flash", "splash")]
            assert recorded == printed, (label, mode)


def test_one_chip_data_holds_the_pages_table():
    runs = json.loads((RESULTS / "data" / "one-chip-v5e.json").read_text())["runs"]
    rows = _first_table((RESULTS / "one-chip.md").read_text())
    assert len(rows) == len(runs) == 4
    for row, run in zip(rows, runs):
        assert row[0].startswith(run["name"].split(" LoRA")[0]), (row, run["name"])
        assert float(row[2].replace(",", "")) == pytest.approx(run["metrics"]["step_time_s"] * 1e3)
        assert row[4] == f"{100 * run['metrics']['mfu']:.1f}%"
        assert row[6] == run["date"]
