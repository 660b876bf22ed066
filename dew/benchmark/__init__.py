"""Layouts against each other, and the shard_map engine against the GSPMD baseline, side by side.

    results = benchmark.compare(ModelSize(), ["data=8", "fsdp=8", "data=2,fsdp=4"])
    print(benchmark.table(results))
    failed = benchmark.missed(benchmark.targets(results))

Each contestant is one layout and one engine (``Trainer(..., engine=...)``) training the same
model, loss and optimizer, and one more row, ``engine="one_device"``: the same model and global
batch on one device. The parts, one job each:

- ``measure``: one contestant (build, compile, time a step, bytes, memory) and its ``Result``,
  or its ``DidNotFit`` when it ran out of device memory;
- ``rounds``: which contestants run (each with the ``StepOptions`` its layout takes) and their
  turns (``compare``; only the contestant whose turn it is holds device memory), and the compile
  time at two depths (``compile_depth``);
- ``ratios``: each shard_map row against its layout's GSPMD row and the one-device row;
- ``judge``: every target and threshold in one table (``TARGETS``), and a run judged against it;
- ``report``: tables and the JSON rows.
"""

from dew.benchmark.judge import TARGETS, Target, Threshold, missed, targets
from dew.benchmark.measure import (
    ONE_DEVICE,
    Contestant,
    DidNotFit,
    ModelSize,
    Result,
    fitted,
    layout_name,
    measured_bubble,
    out_of_memory,
    row_name,
    state_bytes_per_device,
)
from dew.benchmark.ratios import layout_ratios
from dew.benchmark.report import depth_text, table, targets_table, write_json
from dew.benchmark.rounds import DepthCheck, compare, compile_depth, options_for

__all__ = [
    "ONE_DEVICE",
    "TARGETS",
    "Contestant",
    "DepthCheck",
    "DidNotFit",
    "ModelSize",
    "Result",
    "Target",
    "Threshold",
    "compare",
    "compile_depth",
    "depth_text",
    "fitted",
    "layout_name",
    "layout_ratios",
    "measured_bubble",
    "missed",
    "options_for",
    "out_of_memory",
    "row_name",
    "state_bytes_per_device",
    "table",
    "targets",
    "targets_table",
    "write_json",
]
