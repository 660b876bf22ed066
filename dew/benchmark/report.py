"""A run's results as text and as JSON: the table of rows, each shard_map row's ratios, each
pipeline's bubble, the depth check, the targets, and the ``--json`` file of rows.

Only rendering: the numbers are ``dew.benchmark.measure``'s, ``.ratios``' and ``.judge``'s.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Sequence

from dew.benchmark.judge import Target
from dew.benchmark.measure import DidNotFit, Result, fitted
from dew.benchmark.ratios import layout_ratios
from dew.benchmark.rounds import DepthCheck

# The columns of the ratios table, in order: keys of ``layout_ratios``, and their headers.
_RATIO_COLUMNS = (
    ("time_vs_gspmd", "time / gspmd"),
    ("time_vs_one_device", "time / one device"),
    ("gspmd_vs_one_device", "gspmd time / one device"),
    ("wire", "wire / gspmd"),
    ("temp", "temp / gspmd"),
)


def table(results: Sequence[Result | DidNotFit]) -> str:
    """The results as a text table, then each layout's ratios against GSPMD and one device (a row
    per shard_map contestant: per sequence scheme on a sequence axis, per pipeline schedule on a
    stage axis), then each pipeline's bubble, measured and by the formula. A contestant that did
    not fit is one line in the first table, in its place: its name, engine and
    ``DidNotFit.verdict``."""
    header = (
        "layout",
        "engine",
        "step ms",
        "tokens/s",
        "MFU PaLM",
        "MFU causal-halved",
        "compile s",
        "state MiB/dev",
        "temp MiB/dev",
        "wire MiB/step",
        "collectives",
    )
    body = [
        (r.name, r.engine, r.verdict)
        if isinstance(r, DidNotFit)
        else (
            r.name,
            r.engine,
            f"{r.step_ms:.0f}",
            "-" if r.tokens_per_s is None else f"{r.tokens_per_s:,.0f}",
            "-" if r.mfu is None else f"{100 * r.mfu:.1f}%",
            "-" if r.mfu_causal is None else f"{100 * r.mfu_causal:.1f}%",
            f"{r.compile_s:.2f}",
            _mib(r.state_bytes_per_device),
            _mib(r.temp_bytes_per_device),
            _mib(r.wire_bytes),
            str(r.collectives),
        )
        for r in results
    ]
    lines = _render(header, body, right_from=2)
    # Rows with something to compare against (a shard_map row alone has no ratio).
    ratios = {name: r for name, r in layout_ratios(results).items() if r}
    if ratios:
        lines += [
            "",
            "ratios of each layout's shard_map step (below 1: shard_map is faster, moves fewer "
            "bytes, needs less memory; times: median over rounds of the ratio within a round)",
        ]
        lines += _render(
            ("layout", *(title for _, title in _RATIO_COLUMNS)),
            [
                (layout, *(_ratio_text(r.get(key)) for key, _ in _RATIO_COLUMNS))
                for layout, r in ratios.items()
            ],
            right_from=1,
        )
    piped = [r for r in fitted(results) if r.bubble_formula is not None]
    if piped:
        lines += [
            "",
            "pipeline bubble: the idle share of a step, measured as 2 - T(2M) / T(M) with T(2M) "
            "the step time at twice the microbatches and batch (same rows per microbatch), "
            "against (S - 1) / (M + S - 1)",
        ]
        lines += _render(
            ("layout", "microbatches", "step ms", "step ms at 2M", "measured", "formula"),
            [
                (
                    r.name,
                    str(r.microbatches),
                    f"{r.step_ms:.0f}",
                    "-" if r.double_step_ms is None else f"{r.double_step_ms:.0f}",
                    "-" if r.bubble_measured is None else f"{r.bubble_measured:.3f}",
                    f"{r.bubble_formula:.3f}",
                )
                for r in piped
            ],
            right_from=1,
        )
    return "\n".join(lines)


def depth_text(depth: DepthCheck) -> str:
    """The depth check in one line."""
    return (
        f"compile time, {depth.engine} on {depth.layout}: {depth.shallow_layers} layers "
        f"{depth.shallow_s:.2f} s, {depth.deep_layers} layers {depth.deep_s:.2f} s "
        f"(ratio {depth.ratio:.2f})"
    )


def targets_table(found: Sequence[Target]) -> str:
    """The targets as a text table, each with its verdict: ``met``, ``not yet`` (a stretch goal)
    or ``MISSED``."""
    body = [
        (
            ("stretch: " if t.stretch else "") + t.name,
            f"{t.measured:.3f}",
            f"<= {t.limit:g}",
            t.verdict,
        )
        for t in found
    ]
    return "\n".join(_render(("target", "measured", "limit", ""), body, right_from=1))


def write_json(path: Path, results: Sequence[Result | DidNotFit]) -> None:
    """One JSON object per row (``Result.to_json``, ``"fits": true``; ``DidNotFit.to_json``,
    ``"fits": false``) into ``path``, written beside it and renamed over it, so an old file is
    never left half-replaced."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump([r.to_json() for r in results], f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def _ratio_text(value: float | None) -> str:
    if value is None:
        return "-"
    return "inf" if math.isinf(value) else f"{value:.3f}" if value < 0.1 else f"{value:.2f}"


def _render(header, body, right_from: int) -> list[str]:
    """``header`` and ``body``'s rows in aligned columns, those from ``right_from`` on aligned
    right. A row shorter than ``header`` is a note: its cells but the last fill the first
    columns, and its last cell runs on, unaligned (a contestant that did not fit)."""

    def spans(row, i):  # row's cell i sets column i's width
        return i < len(row) - 1 or len(row) == len(header)

    widths = [
        max(len(row[i]) for row in [header, *body] if spans(row, i)) for i in range(len(header))
    ]

    def line(cells):
        if len(cells) < len(header):
            *first, note = cells
            return "  ".join([*(c.ljust(w) for c, w in zip(first, widths)), note]).rstrip()
        return "  ".join(
            c.rjust(w) if i >= right_from else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()

    return [line(header), line(tuple("-" * w for w in widths))] + [line(row) for row in body]
