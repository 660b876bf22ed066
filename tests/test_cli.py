"""The `dew` command, run as a user runs it (a fresh process; it sets up 8 CPU devices itself)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from dew.collectives import OPS

ROOT = Path(__file__).resolve().parents[1]


def dew(*args, cwd):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-m", "dew", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_dew_train_runs_and_resumes(tmp_path):
    first = dew(
        "train",
        *("--mesh", "fsdp=8", "--steps", "4", "--log-every", "2", "--metrics", "m/metrics.jsonl"),
        cwd=tmp_path,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    lines = first.stdout.splitlines()
    # --metrics: one JSON line per step, the printed losses among them.
    metrics = [
        json.loads(line) for line in (tmp_path / "m" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert [f"step {m['step']}: loss {m['loss']:.4f}" for m in metrics[1::2]] == lines[1:3]
    assert lines[0] == (
        "Training from step 0 to 4 on {'data': 1, 'expert': 1, 'fsdp': 8, 'tensor': 1, "
        "'sequence': 1, 'stage': 1} (1 process(es))"
    )
    assert [line.split(":")[0] for line in lines[1:3]] == ["step 2", "step 4"]
    assert re.fullmatch(
        r"Goodput: first step after \d+\.\d\d s, \d+\.\d% of the wall time in steps", lines[3]
    )
    run_dir = tmp_path / "runs" / "dew-train"
    assert (run_dir / "corpus" / "meta.json").exists()

    second = dew(
        "train", "--mesh", "data=2,fsdp=4", "--steps", "6", "--log-every", "2", cwd=tmp_path
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert (
        second.stdout.splitlines()[0]
        == f"Resumed from step 4 in {(run_dir / 'checkpoints').resolve()}"
    )
    assert "Training from step 4 to 6 on {'data': 2, 'expert': 1, 'fsdp': 4," in second.stdout


def test_dew_train_bad_input_is_a_clear_error(tmp_path):
    bad = dew("train", "--batch", "12", "--mesh", "fsdp=8", "--steps", "1", cwd=tmp_path)
    assert bad.returncode == 2
    assert (
        "dew train: batch 12 does not split evenly over 8 devices (data 1 x fsdp 8)" in bad.stderr
    )
    assert "Traceback" not in bad.stderr
    missing = dew("train", "--data", str(tmp_path / "nothing"), "--steps", "1", cwd=tmp_path)
    assert (
        missing.returncode == 2
        and "nothing" in missing.stderr
        and "Traceback" not in missing.stderr
    )


def test_dew_collectives_prints_the_table(tmp_path):
    out = dew("collectives", "--mesh", "fsdp=8", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith(
        "Collectives of one shard_map step on {'data': 1, 'expert': 1, 'fsdp': 8,"
    )
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines() if line[:1].isalpha()}
    assert rows["all_gather"][1] == "fsdp" and rows["psum_scatter"][1] == "fsdp"


UNITS = {"B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}


def table_bytes(number: str, unit: str) -> float:
    """``("1.5", "KiB")`` -> 1536.0: a byte count as the report prints it."""
    return float(number) * UNITS[unit]


def report_rows(stdout: str) -> dict:
    """The rows of a printed collective report: ``{(op, axes): (count, operand_bytes,
    wire_bytes)}``, ``axes`` a tuple of axis names."""
    lines = stdout.splitlines()
    # The rows sit between the rule under the header and the rule above the total.
    rules = [i for i, line in enumerate(lines) if line.startswith("-----")]
    assert len(rules) == 2, stdout
    row = re.compile(
        r"(\w+)\s+([\w,]+)\s+(\d+)\s+([\d.]+) (B|KiB|MiB|GiB)\s+([\d.]+) (B|KiB|MiB|GiB)"
    )
    rows = {}
    for line in lines[rules[0] + 1 : rules[1]]:
        m = row.fullmatch(line)
        assert m, f"not a report row: {line!r}\n{stdout}"
        op, axes, count = m.group(1), tuple(m.group(2).split(",")), int(m.group(3))
        assert op in OPS and (op, axes) not in rows, stdout
        rows[(op, axes)] = (count, table_bytes(*m.group(4, 5)), table_bytes(*m.group(6, 7)))
    total = lines[rules[1] + 1].split()
    assert total[0] == "total" and int(total[1]) == sum(c for c, _, _ in rows.values()), stdout
    return rows


def test_dew_collectives_gspmd_prints_the_compiled_steps_rows(tmp_path):
    out = dew("collectives", "--mesh", "data=2,fsdp=4", "--engine", "gspmd", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith(
        "Collectives of one gspmd step on {'data': 2, 'expert': 1, 'fsdp': 4,"
    ), out.stdout
    rows = report_rows(out.stdout)
    for (op, axes), (count, operand, wire) in rows.items():
        assert set(axes) <= {"data", "fsdp"}, out.stdout
        assert count > 0 and operand > 0 and wire > 0, out.stdout
    # XLA gathers the weights split over fsdp, and sums the gradients over the data replicas.
    assert ("all_gather", ("fsdp",)) in rows, out.stdout
    assert any(op == "psum" and "data" in axes for op, axes in rows), out.stdout
    # Bytes per axis: the two axes the mesh splits move bytes, the axes of size 1 none.
    per_axis = {}
    for line in lines[
        lines.index("wire bytes per axis (a row over several axes counts under each):") + 1 :
    ]:
        m = re.fullmatch(r"\s+(\w+)\s+([\d.]+) (B|KiB|MiB|GiB) \(size (\d+)\)", line)
        if m:
            per_axis[m.group(1)] = (table_bytes(*m.group(2, 3)), int(m.group(4)))
    assert set(per_axis) == {"data", "expert", "fsdp", "tensor", "sequence", "stage"}, out.stdout
    assert per_axis["data"][1] == 2 and per_axis["fsdp"][1] == 4, out.stdout
    assert per_axis["data"][0] > 0 and per_axis["fsdp"][0] > 0, out.stdout
    assert all(b == 0 for b, size in per_axis.values() if size == 1), out.stdout


def test_dew_collectives_sequence_parallel_moves_activations_by_gather_and_scatter(tmp_path):
    # The example model (2 layers, width 64, batch 16 x 32) on data 4 x tensor 2: each device's
    # activations [4 rows, 32, 64] float32 are A = 32 KiB.
    out = dew("collectives", "--mesh", "tensor=2", "--sequence-parallel", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines()[0].endswith(
        "'tensor': 2, 'sequence': 1, 'stage': 1}, batch 16 x 32 tokens, sequence_parallel=True:"
    ), out.stdout
    rows = report_rows(out.stdout)
    activations = 4 * 32 * 64 * 4
    # Per layer, 6 all_gathers of [4, 16, 64] (2 entering forward, 2 recomputed, 2 in the leaves'
    # backward) and 5 psum_scatters of [4, 32, 64]; plus the embedding's and the head's pair.
    assert rows["all_gather", ("tensor",)] == (14, 14 * activations / 2, 14 * activations / 2)
    assert rows["psum_scatter", ("tensor",)] == (12, 12 * activations, 12 * activations / 2)
    # No activation is summed whole over tensor: the one psum left is the loss's two sums per
    # token ([4, 32, 2] float32), and the norm scales' gradients are summed over data and tensor.
    assert rows["psum", ("tensor",)] == (1, 4 * 32 * 2 * 4, 4 * 32 * 2 * 4), out.stdout
    assert rows["psum", ("data", "tensor")][0] == 3, out.stdout


def test_dew_collectives_refuses_heads_that_do_not_split_over_tensor(tmp_path):
    bad = dew("collectives", "--mesh", "tensor=8", cwd=tmp_path)
    assert bad.returncode == 2, bad.stdout
    assert "dew collectives: num_heads 4 does not split over tensor 8" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr


def test_dew_train_passes_sequence_parallel_to_the_trainer(tmp_path):
    # Refused by the Trainer before compiling: positions split over tensor need seq_len % 4 == 0,
    # which only sequence_parallel=True asks for (without it, --steps 0 returns at once).
    bad = dew("train", "--mesh", "tensor=4", "--seq-len", "30", "--sequence-parallel", cwd=tmp_path)
    assert bad.returncode == 2, bad.stdout
    assert "dew train: seq_len 30 does not split over tensor 4 (sequence_parallel=True" in (
        bad.stderr
    ), bad.stderr
    assert "Traceback" not in bad.stderr


def test_dew_bench_runs_and_records_sequence_parallel(tmp_path):
    # A one-step run of a tiny model: what is checked is what ran, not how fast.
    out = dew(
        "bench",
        *("--layouts", "data=8", "tensor=2", "--engines", "shard_map", "--no-one-device"),
        *("--depth-check", "0", "--repeats", "1", "--warmup", "0", "--sequence-parallel"),
        *("--layers", "1", "--width", "32", "--heads", "2", "--seq-len", "8", "--batch", "8"),
        *("--json", "bench.json"),
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith(
        "dew bench: 1 layers, width 32, 2 heads, batch 8 x 8 tokens, min_shard 65536, "
        "sequence_parallel True, on 8 cpu devices;"
    ), out.stdout
    rows = json.loads((tmp_path / "bench.json").read_text())
    # In effect only where there is a tensor group to split positions over.
    assert {(r["layout"], r["sequence_parallel"]) for r in rows} == {
        ("data=8", False),
        ("data=4,tensor=2", True),
    }, rows


def test_dew_bench_defaults_split_over_eight_tensor_devices():
    from dew.benchmark import ModelSize
    from dew.cli.main import build_parser

    args = build_parser().parse_args(["bench"])
    assert (args.width, args.heads, args.sequence_parallel) == (256, 8, False)
    size = ModelSize(
        layers=args.layers,
        width=args.width,
        heads=args.heads,
        seq_len=args.seq_len,
        batch=args.batch,
    )
    # What `dew bench --layouts tensor=8 data=2,tensor=4 fsdp=2,tensor=4` needs of the model.
    size.objective().model.check_split({"tensor": 8})
