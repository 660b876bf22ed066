"""The `dew` command. `dew train` runs as a user runs it (a fresh process that sets up its 8 CPU
devices itself, writes its checkpoints and resumes from them); `dew collectives` and the refusals
of bad input run by ``main``, which the console script calls, in this process (8 CPU devices
already): a fresh process would only add its start-up to each.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from dew.collectives import OPS
from tests.helpers import child_env

ROOT = Path(__file__).resolve().parents[1]


def dew(*args, cwd):
    env = child_env()
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-m", "dew", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_dew_train_bad_input_is_a_clear_error(tmp_path, dew_here):
    bad = dew_here("train", "--batch", "12", "--mesh", "fsdp=8", "--steps", "1", cwd=tmp_path)
    assert bad.returncode == 2
    assert (
        "dew train: --batch 12 does not split evenly over 8 devices (data 1 x fsdp 8)" in bad.stderr
    )
    missing = dew_here("train", "--data", str(tmp_path / "nothing"), "--steps", "1", cwd=tmp_path)
    assert missing.returncode == 2 and "nothing" in missing.stderr


def test_dew_collectives_prints_the_table(tmp_path, dew_here):
    out = dew_here("collectives", "--mesh", "fsdp=8", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    header, table = out.stdout.split("\n", 1)
    assert header.startswith("dew collectives: example decoder: 2 layers, width 64,")
    assert table.startswith(
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


def test_dew_collectives_gspmd_prints_the_compiled_steps_rows(tmp_path, dew_here):
    out = dew_here("collectives", "--mesh", "data=2,fsdp=4", "--engines", "gspmd", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[1].startswith(
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


def test_dew_collectives_sequence_parallel_moves_activations_by_gather_and_scatter(
    tmp_path, dew_here
):
    # The example model (2 layers, width 64, batch 16 x 32) on data 4 x tensor 2: each device's
    # activations [4 rows, 32, 64] float32 are A = 32 KiB.
    out = dew_here("collectives", "--mesh", "tensor=2", "--sequence-parallel", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines()[1].endswith(
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


def test_dew_collectives_shows_the_expert_all_to_alls(tmp_path, dew_here):
    # The example model (2 layers, width 64, batch 16 x 32) with 8 experts, k = 2, on expert 8: a
    # device routes 2 rows x 32 tokens x 2 = 128 copies, dropless, so each all_to_all carries
    # [8, 128, 64] float32 (any device may receive them all) and [8, 128] int32 expert ids.
    out = dew_here("collectives", "--mesh", "expert=8", "--experts", "8", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    activations, ids = 8 * 128 * 64 * 4, 8 * 128 * 4
    # Per layer: dispatch and combine, again in the recompute, and their two transposes; the ids
    # forward and recomputed.
    operand = 2 * (6 * activations + 2 * ids)
    count, operand_printed, wire_printed = report_rows(out.stdout)["all_to_all", ("expert",)]
    # The table prints MiB with one decimal: within half of its last digit.
    assert count == 16, out.stdout
    assert abs(operand_printed - operand) <= 0.05 * 2**20, (operand_printed, operand)
    assert abs(wire_printed - operand * 7 / 8) <= 0.05 * 2**20, (wire_printed, operand)
    assert not any(op == "all_gather" for op, _ in report_rows(out.stdout)), out.stdout


def test_dew_collectives_refuses_heads_that_do_not_split_over_tensor(tmp_path, dew_here):
    bad = dew_here("collectives", "--mesh", "tensor=8", cwd=tmp_path)
    assert bad.returncode == 2, bad.stdout
    assert "dew collectives: --heads 4 does not split over tensor 8" in bad.stderr, bad.stderr


def test_dew_train_passes_sequence_parallel_to_the_trainer(tmp_path, dew_here):
    # Refused by the Trainer before compiling: positions split over tensor need seq_len % 4 == 0,
    # which only sequence_parallel=True asks for (without it, --steps 0 returns at once).
    bad = dew_here(
        "train", "--mesh", "tensor=4", "--seq-len", "30", "--sequence-parallel", cwd=tmp_path
    )
    assert bad.returncode == 2, bad.stdout
    assert "dew train: --seq-len 30 does not split over tensor 4 (--sequence-parallel" in (
        bad.stderr
    ), bad.stderr


def test_dew_collectives_sequence_scheme_picks_the_ring_or_the_all_to_all(tmp_path, dew_here):
    # The example model (2 layers, width 64, 4 heads of 16) on data 2 x sequence 4: each device
    # holds 8 rows x 2c = 8 positions. Per layer the layer runs forward, forward again (remat) and
    # backward.
    rows, local, heads, head_dim = 8, 32 // 4, 4, 16
    ring = dew_here("collectives", "--mesh", "sequence=4", "--seq-len", "32", cwd=tmp_path)
    assert ring.returncode == 0, ring.stderr[-3000:]
    assert ring.stdout.splitlines()[1].endswith(
        "'sequence': 4, 'stage': 1}, batch 16 x 32 tokens, sequence_scheme=ring:"
    ), ring.stdout
    rows_ring = report_rows(ring.stdout)
    # Ring: the stacked K/V block [2, 8, 8, 4, 16] float32 (32 KiB) takes n - 1 = 3 hops in each
    # forward and in the backward, and the float32 dK/dV accumulator 3 more: 12 per layer.
    block = 2 * rows * local * heads * head_dim * 4
    assert rows_ring["ppermute", ("sequence",)] == (24, 24 * block, 24 * block), ring.stdout
    assert not any(op == "all_to_all" for op, _ in rows_ring), ring.stdout
    # Gradients summed over the token axes, sequence among them.
    assert rows_ring["psum", ("data", "sequence")][0] == 12, ring.stdout

    ulysses = dew_here(
        "collectives",
        *("--mesh", "sequence=4", "--seq-len", "32", "--sequence-scheme", "all_to_all"),
        cwd=tmp_path,
    )
    assert ulysses.returncode == 0, ulysses.stderr[-3000:]
    assert ulysses.stdout.splitlines()[1].endswith("sequence_scheme=all_to_all:"), ulysses.stdout
    rows_ulysses = report_rows(ulysses.stdout)
    # All-to-all: q, k, v and out [8, 8, 4, 16] float32 (16 KiB) each, 3/4 of it sent: 4 in the
    # forward, 4 recomputed, 4 transposed in the backward (lse's is dropped: nothing uses it).
    operand = rows * local * heads * head_dim * 4
    assert rows_ulysses["all_to_all", ("sequence",)] == (24, 24 * operand, 24 * operand * 3 / 4)
    assert not any(op == "ppermute" for op, _ in rows_ulysses), ulysses.stdout


def test_dew_train_passes_the_sequence_scheme_to_the_trainer(tmp_path, dew_here):
    # 4 heads do not split over sequence 8, which only the all-to-all scheme asks for; refused
    # before compiling.
    bad = dew_here(
        "train",
        *("--mesh", "sequence=8", "--sequence-scheme", "all_to_all", "--steps", "1"),
        cwd=tmp_path,
    )
    assert bad.returncode == 2, bad.stdout
    assert (
        "dew train: --sequence-scheme 'all_to_all' trades positions for heads: --heads 4 "
        "(4 per device over tensor 1) does not split over sequence 8" in bad.stderr
    ), bad.stderr


def test_a_flag_that_cannot_take_effect_is_a_clear_error(tmp_path, dew_here):
    # Each would have been ignored: MoE flags on a dense model, an expert axis with no experts to
    # split, sequence-parallel activations without a tensor group, a schedule without stages.
    cases = [
        (
            ("collectives", "--capacity-factor", "0.5"),
            "dew collectives: --capacity-factor 0.5 configures mixture-of-experts layers, which "
            "a dense model does not have; add --experts E",
        ),
        (
            ("train", "--experts-per-token", "1", "--steps", "1"),
            "dew train: --experts-per-token 1 configures mixture-of-experts layers",
        ),
        (
            ("train", "--mesh", "expert=8", "--steps", "1"),
            "dew train: expert 8 on a dense model (--experts 0)",
        ),
        (
            ("collectives", "--mesh", "fsdp=8", "--sequence-parallel"),
            "dew collectives: --sequence-parallel needs a tensor axis above 1",
        ),
        (
            ("train", "--pipeline-schedule", "gpipe", "--steps", "1"),
            "dew train: --pipeline-schedule gpipe needs a stage axis above 1",
        ),
    ]
    for args, message in cases:
        bad = dew_here(*args, cwd=tmp_path)
        assert bad.returncode == 2, (args, bad.stdout, bad.stderr)
        assert message in bad.stderr, (args, bad.stderr)


def test_dew_train_runs_a_pipeline_with_the_schedule_asked(tmp_path, dew_here):
    out = dew_here(
        "train",
        *("--pipeline-schedule", "1f1b_phased", "--mesh", "stage=2,microbatches=4"),
        *("--steps", "2", "--log-every", "1"),
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "'stage': 2} (1 process(es))" in out.stdout, out.stdout
    losses = [float(m) for m in re.findall(r"step \d: loss (\d+\.\d+)", out.stdout)]
    assert len(losses) == 2 and all(0 < loss < 10 for loss in losses), out.stdout
    # The checkpoint records the schedule that ran.
    index = tmp_path / "runs" / "dew-train" / "checkpoints"
    recorded = [json.loads(p.read_text()) for p in index.rglob("*.json")]
    assert any(
        r.get("metadata", {}).get("pipeline", {}).get("schedule") == "1f1b_phased" for r in recorded
    ), recorded


def test_every_command_spells_and_defaults_the_shared_flags_alike():
    from dew.cli.main import build_parser

    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    shared = (
        "--mesh",
        "--min-shard",
        "--sequence-parallel",
        "--sequence-scheme",
        "--pipeline-schedule",
        "--experts",
        "--experts-per-token",
        "--moe-every",
        "--capacity-factor",
        "--cpu-devices",
        "--model",
    )

    def flags(command):
        return {o: a for a in commands[command]._actions for o in a.option_strings}

    train, collectives, bench = (flags(c) for c in ("train", "collectives", "bench"))
    for flag in shared:
        for command, actions in (("collectives", collectives), ("bench", bench)):
            assert flag in actions, (command, flag)
        assert collectives[flag].default == train[flag].default, flag
        several = bench[flag].nargs == "+"
        # bench takes several of a few, one contestant each; the default is then the same one.
        want = [train[flag].default] if several and flag != "--mesh" else train[flag].default
        if flag != "--mesh":
            assert bench[flag].default == want, (flag, bench[flag].default, want)
    assert bench["--mesh"].nargs == "+"
    # dew plan compiles for a TPU slice: no CPU devices, and no default layout (--mesh or --search).
    plan = flags("plan")
    for flag in shared:
        if flag in ("--cpu-devices", "--mesh"):
            continue
        assert plan[flag].default == train[flag].default, flag
    assert plan["--mesh"].nargs == "+" and "--cpu-devices" not in plan


def test_dew_train_evaluates_and_writes_tensorboard(tmp_path, dew_here):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    small = ("--mesh", "fsdp=8", "--layers", "1", "--width", "32", "--seq-len", "16")
    out = dew_here(
        "train",
        *small,
        *("--steps", "3", "--log-every", "1", "--eval-every", "2", "--eval-batches", "1"),
        *("--tensorboard", "tb", "--metrics", "m.jsonl"),
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    # --metrics' help names every field the file holds (and mfu, mfu_causal: a CPU has none).
    from dew.cli.main import build_parser

    train = build_parser()._subparsers._group_actions[0].choices["train"]
    (metrics_flag,) = [a for a in train._actions if a.dest == "metrics"]
    named = set(re.findall(r"\b[a-z_]+\b", metrics_flag.help))
    assert set().union(*lines) | {"mfu", "mfu_causal"} <= named, metrics_flag.help
    val = [f"step {m['step']}: val_loss {m['val_loss']:.4f}" for m in lines if "val_loss" in m]
    assert val == [line for line in out.stdout.splitlines() if "val_loss" in line]
    assert [line.split(":")[0] for line in val] == ["step 2", "step 3"]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3]
    assert [e.step for e in events.Scalars("val_loss")] == [2, 3]

    for args, message in [
        (("--eval-every", "0"), "dew train: --eval-every must be an integer >= 1, got 0"),
        (("--eval-batches", "2"), "dew train: --eval-batches 2 without --eval-every"),
        (
            ("--eval-every", "2", "--eval-batches", "9"),
            "--eval-batches 9 of --batch 16 rows, 144 windows of --seq-len 16, and val.bin in ",
        ),
    ]:
        bad = dew_here("train", *small, "--steps", "1", *args, cwd=tmp_path)
        assert bad.returncode == 2, (args, bad.stdout)
        assert message in bad.stderr, (args, bad.stderr)
