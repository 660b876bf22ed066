"""Draws the plots of docs/results/ from the JSON the benchmarks write.

    python bench/plot_results.py [--data docs/results/data] [--out docs/results]
        [--attention FILE] [--one-chip FILE] [--slices FILE] [--cpu-layouts FILE]

Each input is either a benchmark's own output or a recorded file of docs/results/data/ that wraps
the same records with the command, date and machine they came from:

- ``--attention``: ``bench/attention.py --json``'s lines (one cell a line), or a JSON object
  whose ``cells`` are those lines. Each contestant's best cell a row and mode (as the script's
  table takes it), in TFLOP/s: ``attention-kernels.png``.
- ``--one-chip``: a JSON object whose ``runs`` each hold a name and ``metrics``, one line of
  ``dew train --metrics``; the MFU of each: ``one-chip.png``.
- ``--slices``: a JSON object whose ``rows`` give a step's heap, wire and exposed bytes as
  ratios to GSPMD's on the same slice: ``slices.png``.
- ``--cpu-layouts``: ``dew bench --json``'s list of rows, or a JSON object whose ``rows`` are
  that list; wire bytes and step time per layout and engine: ``cpu-layouts.png``.

Without flags it reads the recorded files of ``--data`` and writes every PNG into ``--out``
(matplotlib, 100 dpi: the docs' PNGs stay under 100 KB).
"""

import argparse
import json
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DPI = 100
CONTESTANTS = ("dew", "jax-flash", "splash", "xla", "cudnn")


def load(path: Path, key: str) -> list[dict]:
    """The records of ``path``: a JSON list, JSON lines, or an object's ``key`` list."""
    text = Path(path).read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    if isinstance(data, dict):
        return data[key]
    return data if isinstance(data, list) else [data]


def row_label(row: dict) -> str:
    """``bench/attention.py``'s ``Row.label``: ``"4096, 128 gqa 32/8"``."""
    text = f"{row['seq']}, {row['head_dim']}"
    text += " gqa 32/8" if row.get("grouped") else ""
    text += "" if row.get("causal", True) else " non-causal"
    text += f" docs {row['documents']}" if row.get("documents") else ""
    text += f" window {row['window']}" if row.get("window") else ""
    return text


def best_tflops(cells: list[dict]) -> dict[str, dict[str, dict[str, float]]]:
    """mode -> row label -> contestant -> the best TFLOP/s over its candidates (cells with an
    error or no figure left out), rows in the order they first appear."""
    out: dict = defaultdict(lambda: defaultdict(dict))
    for cell in cells:
        if cell.get("error") or not cell.get("tflops"):
            continue
        by_name = out[cell["mode"]][row_label(cell["row"])]
        by_name[cell["contestant"]] = max(by_name.get(cell["contestant"], 0.0), cell["tflops"])
    return out


def _bars(ax, groups: list[str], series: dict[str, list[float]], ylabel: str, title: str):
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, [v if v is not None else 0 for v in values], width, label=name)
    ax.set_xticks(range(len(groups)), groups, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)


def plot_attention(cells: list[dict], out: Path) -> None:
    tables = best_tflops(cells)
    modes = [m for m in ("fwd", "fwd+bwd") if m in tables]
    fig, axes = plt.subplots(1, len(modes), figsize=(11, 4), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        rows = list(tables[mode])
        names = [n for n in CONTESTANTS if any(n in tables[mode][r] for r in rows)]
        series = {n: [tables[mode][r].get(n) for r in rows] for n in names}
        _bars(ax, rows, series, "TFLOP/s", f"{mode} (seq, head_dim)")
    fig.tight_layout()
    fig.savefig(out, dpi=DPI)
    plt.close(fig)


def plot_one_chip(runs: list[dict], out: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [r["name"] for r in runs]
    series = {"MFU (PaLM's count), %": [100 * r["metrics"]["mfu"] for r in runs]}
    _bars(ax, names, series, "MFU, %", "one v5e chip")
    ax.bar_label(ax.containers[0], fmt="%.1f", fontsize=8)
    ax.set_ylim(0, 100)
    fig.tight_layout()
    fig.savefig(out, dpi=DPI)
    plt.close(fig)


def plot_slices(rows: list[dict], out: Path) -> None:
    groups: list[str] = []
    by_step: dict = defaultdict(dict)
    for r in rows:
        group = f"{r['slice']} {r['layout']}"
        if group not in groups:
            groups.append(group)
        step = "default" if r["step"] == "default" else "gathers (and pairs)"
        by_step[step][group] = r
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, field, label in (
        (axes[0], "heap_vs_gspmd", "heap / GSPMD's"),
        (axes[1], "exposed_vs_gspmd", "exposed bytes / GSPMD's"),
    ):
        series = {s: [by_step[s].get(g, {}).get(field) for g in groups] for s in by_step}
        _bars(ax, groups, series, label, label)
        ax.axhline(1.0, color="black", lw=0.8)
    # Exposed bytes span 0.15x to 8x: on a log scale both ends read.
    axes[1].set_yscale("log")
    axes[1].set_ylim(0.1, 10)
    ticks = [0.1, 0.25, 0.5, 1, 2, 5, 10]
    axes[1].set_yticks(ticks, [f"{t:g}" for t in ticks])
    axes[1].minorticks_off()
    fig.tight_layout()
    fig.savefig(out, dpi=DPI)
    plt.close(fig)


def plot_cpu_layouts(rows: list[dict], out: Path) -> None:
    rows = [r for r in rows if r.get("fits", True)]
    layouts = [r["layout"] for r in rows if r["engine"] == "shard_map"]
    by = {(r["layout"], r["engine"]): r for r in rows}
    engines = [e for e in ("shard_map", "gspmd") if any((lay, e) in by for lay in layouts)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    wire = {e: [by[(lay, e)]["wire_bytes"] / 2**20 for lay in layouts] for e in engines}
    _bars(axes[0], layouts, wire, "MiB a step, one device", "wire bytes")
    step = {e: [by[(lay, e)]["step_ms"] for lay in layouts] for e in engines}
    _bars(axes[1], layouts, step, "ms", "step time")
    one = [r for r in rows if r["engine"] == "one_device"]
    if one:
        axes[1].axhline(one[0]["step_ms"], color="black", lw=0.8, ls="--", label="one device")
        axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=DPI)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=ROOT / "docs" / "results" / "data")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results")
    for name in ("attention", "one-chip", "slices", "cpu-layouts"):
        parser.add_argument(f"--{name}", type=Path, help="its JSON (default: the recorded file)")
    args = parser.parse_args(argv)
    inputs = {
        "attention": (args.attention or args.data / "attention-v5e.json", "cells"),
        "one_chip": (args.one_chip or args.data / "one-chip-v5e.json", "runs"),
        "slices": (args.slices or args.data / "slices.json", "rows"),
        "cpu_layouts": (args.cpu_layouts or args.data / "cpu-layouts.json", "rows"),
    }
    names = {"attention": "attention-kernels.png"}
    args.out.mkdir(parents=True, exist_ok=True)
    for kind, (path, key) in inputs.items():
        out = args.out / names.get(kind, kind.replace("_", "-") + ".png")
        globals()[f"plot_{kind}"](load(path, key), out)
        print(f"wrote {out} ({out.stat().st_size // 1024} KB) from {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
