"""Each shard_map row against the rows it is compared with: its layout's GSPMD row and the
one-device row.

A time ratio is taken within each round and the median over rounds is kept (both sides ran in
the same rounds: ``dew.benchmark.rounds``), so the load that drifts between rounds falls on both
sides; bytes are compared as they are.
"""

from __future__ import annotations

import math
import statistics
from typing import Sequence

from dew.benchmark.measure import ONE_DEVICE, DidNotFit, Result, fitted


def ratio(a: float, b: float) -> float:
    """``a / b``, with ``0 / 0 = 1`` (nothing against nothing) and ``a / 0 = inf``."""
    if b == 0:
        return 1.0 if a == 0 else math.inf
    return a / b


def time_ratio(a: Result, b: Result) -> float:
    """``a``'s step time over ``b``'s: the median of the rounds' ratios when both ran the same
    rounds, else the ratio of the medians."""
    if a.round_ms and len(a.round_ms) == len(b.round_ms):
        return statistics.median(x / y for x, y in zip(a.round_ms, b.round_ms))
    return ratio(a.step_ms, b.step_ms)


def layout_ratios(results: Sequence[Result | DidNotFit]) -> dict[str, dict[str, float]]:
    """``Result.name`` (the layout, with its sequence scheme and pipeline schedule where it has
    them) -> that shard_map step's ratios, where the other side ran:

    - against its layout's GSPMD row: ``time_vs_gspmd``, ``wire``, ``temp`` (shard_map / gspmd)
      and ``gspmd_wire`` (gspmd / shard_map: how much more the baseline sends);
    - against the one-device row: ``time_vs_one_device`` (shard_map / one device), and with both,
      ``gspmd_vs_one_device``.

    Every scheme and schedule of a layout is compared with the layout's one GSPMD row, and each
    model variant with the rows of the same variant. A contestant that did not fit
    (``DidNotFit``) has no ratios, and is no side of one.
    """
    results = fitted(results)
    gspmd_rows = {(r.layout, r.variant): r for r in results if r.engine == "gspmd"}
    one_rows = {r.variant: r for r in results if r.engine == ONE_DEVICE}
    ratios: dict[str, dict[str, float]] = {}
    for r in results:
        if r.engine != "shard_map":
            continue
        found = ratios.setdefault(r.name, {})
        gspmd = gspmd_rows.get((r.layout, r.variant))
        one = one_rows.get(r.variant)
        if gspmd is not None:
            found["time_vs_gspmd"] = time_ratio(r, gspmd)
            found["wire"] = ratio(r.wire_bytes, gspmd.wire_bytes)
            found["gspmd_wire"] = ratio(gspmd.wire_bytes, r.wire_bytes)
            found["temp"] = ratio(r.temp_bytes_per_device, gspmd.temp_bytes_per_device)
        if one is not None:
            found["time_vs_one_device"] = time_ratio(r, one)
            if gspmd is not None:
                found["gspmd_vs_one_device"] = time_ratio(gspmd, one)
    return ratios
