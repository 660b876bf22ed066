"""``dew plan`` (``dew.planning``): the real step compiled for TPU slices with libtpu and no TPU.

One compile per behaviour, tiny models (the TPU compiler takes seconds on them, minutes on real
sizes: those are measured in docs/planning.md). All in one worker, which loads libtpu once.
"""

import dataclasses
import json
import os
import re
import subprocess
import sys
import types

import jax
import optax
import pytest

import dew
from dew import planning
from dew.cli import plan as plan_command
from dew.cli.main import build_parser
from dew.collectives import collectives, hlo_collectives
from dew.objectives.lm import LMObjective
from dew.targets import GIB, target
from tests.helpers import tpu_width_step

pytestmark = pytest.mark.xdist_group("tpu")

SEQ = 32
LAYOUT = dew.Layout(min_shard=4096)


def tiny_objective(**overrides):
    config = dict(vocab_size=256, emb_features=64, num_layers=2, num_heads=4, max_seq_len=SEQ)
    config.update(overrides)
    model = dew.models.build("causal_transformer", dtype="bfloat16", **config)
    return LMObjective(model, SEQ)


def test_a_plan_row_holds_the_memory_of_an_independent_compile_to_the_byte():
    v5e = target("v5e-8")
    # optax's AdamW, given to both (with dew train's default, clipping and all, this libtpu's
    # memory_analysis reads 0 B of temporaries for this step, under the heap it assigns).
    row = planning.plan_layout(
        v5e, tiny_objective(), "fsdp=8", 16, layout=LAYOUT, optimizer=optax.adamw(1e-3)
    )
    assert row.error is None and row.refused is None, row
    trainer = dew.Trainer(
        tiny_objective(),
        optax.adamw(1e-3),
        jax.random.key(1),
        mesh=dew.MeshSpec(fsdp=8),
        layout=LAYOUT,
        devices=v5e.devices(),
    )
    memory = trainer.compiled_step(16).memory_analysis()
    assert row.argument_bytes == memory.argument_size_in_bytes
    # The state by hand: fsdp=8 splits every weight matrix (each of 4096 elements or more) 8
    # ways, norm scales (64) stay whole; AdamW keeps two float32 moments of each weight, plus
    # its step count and the trainer's (int32 each), and the run's key (two uint32).
    model = trainer.objective.model
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    elements = sum(
        leaf.size // 8 if leaf.size >= 4096 else leaf.size
        for leaf in jax.tree_util.tree_leaves(shapes)
    )
    assert row.state_bytes == 3 * 4 * elements + 4 + 4 + 8, (row.state_bytes, elements)
    # The step's arguments are the state and this device's 2 of the 16 rows of 33 tokens, in the
    # TPU's tiled layouts (a 64-element norm scale takes a whole tile), so at least that much.
    assert row.argument_bytes >= row.state_bytes + 2 * (SEQ + 1) * 4
    # Temporaries: the compiler's heap (read from its buffer assignment; held to libtpu's own log
    # below), under memory_analysis's count, which adds the heap's fragmentation again.
    assert row.analysis_temp_bytes == memory.temp_size_in_bytes
    assert 0 < row.temp_bytes <= row.analysis_temp_bytes
    assert row.total_bytes == (
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
        + row.temp_bytes
        + memory.generated_code_size_in_bytes
    )
    assert row.fits and row.verdict == "fits" and row.hbm_bytes == 16 * GIB
    assert row.usable_bytes == v5e.usable_bytes and row.spare_bytes > 15 * GIB
    assert row.axis_sizes["fsdp"] == 8 and row.axis_sizes["data"] == 1
    # The default scheme ("auto") on a TPU slice: the fsdp rings, named in the row, as the
    # Trainer built them (tests/test_schemes_auto.py).
    assert row.options == "fsdp_scheme=ring" and trainer.shards.fsdp_ring
    assert not row.approximate and row.wire_bytes > 0 and row.collectives["ppermute"] > 0
    assert "all_gather" not in row.collectives
    # Every wire byte is either beside compute or alone (tests/test_overlap.py reads the split).
    assert row.overlapped_wire_bytes + row.exposed_wire_bytes == row.wire_bytes


def test_the_tpu_hlo_counts_every_layer_as_the_jaxpr_does():
    # The TPU's final HLO keeps no trip counts: each per-layer gather is found by reading the
    # loop's counter. The step is the gradient-sum tests' gathers step on v5p:2x2x2 (fsdp=8, 2
    # layers of width 512: tests.helpers.tpu_width_step, compiled once in this worker), whose
    # layer loops the compiler keeps (read as one trip each, 9 of its 17 gathers are found).
    # v5p-8 is 4 chips, so 4 devices.
    assert len(target("v5p-8").devices()) == 4
    # The gathers, whose all-gathers this test counts ("auto" would run the rings).
    trainer, compiled = tpu_width_step("v5p:2x2x2", 512, (("fsdp", 8),), "gather")
    from_hlo = hlo_collectives(compiled, trainer.mesh)
    from_jaxpr = collectives(trainer.train_step(16), *trainer.step_arguments(16))
    assert not any(r.approximate for r in from_hlo.rows), from_hlo
    # Each of the 2 layers' gathers forward and again backward (the layer is recomputed), and
    # the gathers outside the layer loop (the vocabulary's tokens).
    gathers = from_hlo.count("all_gather")
    print(f"all_gather: {gathers} in the TPU HLO, {from_jaxpr.count('all_gather')} in the jaxpr")
    assert gathers == from_jaxpr.count("all_gather") and gathers >= 2 * 2


def test_a_layout_that_cannot_fit_is_over_by_what_the_compiler_states(tmp_path, capsys):
    # Llama-3.1-8B's shapes at 2 layers (1.49B weights), whole on each of 8 v5e chips: weights and
    # two AdamW moments in float32 are 12 bytes a weight, 16.6 GiB before anything runs. The TPU
    # compiler refuses it while compiling; the row says by how much.
    out = tmp_path / "plan.json"
    args = build_parser().parse_args(
        ["plan", "--target", "v5e-8", "--model", "llama-3.1-8b", "--layers", "2"]
        + ["--mesh", "data=8", "--json", str(out)]
    )
    assert plan_command.run(args) == 0
    printed = capsys.readouterr().out
    (row,) = json.loads(out.read_text())
    weights = planning.weight_count(plan_command._objective(args).model)
    assert not row["fits"] and row["refused"] and row["error"] is None
    assert 12 * weights <= row["state_bytes"] <= 12 * weights + 2**20
    assert row["total_bytes"] > row["state_bytes"]  # the gradients come on top
    assert row["hbm_bytes"] == 16 * GIB  # the chip's, as in a compiled row
    # What the compiler says a program may use: the target's table holds the same figure.
    assert row["usable_bytes"] == target("v5e-8").usable_bytes == int(15.75 * GIB)
    assert row["temp_bytes"] is None and row["wire_bytes"] is None  # nothing compiled to count
    assert row["overlapped_wire_bytes"] is None and row["exposed_wire_bytes"] is None
    over = (row["total_bytes"] - row["usable_bytes"]) / GIB
    assert f"over by {over:.2f} GiB" in printed and over > 0.6


def test_a_step_whose_temporaries_overflow_does_not_fit_though_its_state_does(tmp_path, capsys):
    # GPT-2 small's shapes at 2 layers on v5e-8, fsdp=8, 8192 rows of 512 tokens: the state is
    # 53M weights x 12 bytes / 8 = 76 MiB a chip, but what the preset's remat ("attention")
    # keeps for the backward, each layer's weight matmul outputs and attention's (3 x 768 + 768
    # + 768 + 2 x 2048 = 7936 bfloat16 values a token), is 2 layers x 524288 tokens x 15.5 KiB
    # = 15.5 GiB a chip alone (the loss, chunked or not, holds far less). The compiler refuses
    # it (in about a second); the row must not fit.
    # The command's own row, read back from its --json (one compile: the row it printed).
    out = tmp_path / "plan.json"
    args = build_parser().parse_args(
        ["plan", "--target", "v5e-8", "--model", "gpt2-small", "--layers", "2"]
        + ["--mesh", "fsdp=8", "--batch", "8192", "--seq-len", "512", "--json", str(out)]
    )
    assert plan_command.run(args) == 0
    printed = capsys.readouterr().out
    (written,) = json.loads(out.read_text())
    row = planning.PlanRow(
        **{f.name: written[f.name] for f in dataclasses.fields(planning.PlanRow)}
    )
    assert written["fits"] == row.fits  # the JSON's verdict is the row's
    assert row.state_bytes < 100 * 2**20 < 15 * GIB < row.total_bytes, row
    assert row.refused and not row.fits and row.verdict.startswith("over by"), row
    assert "fits" not in printed.split("layout")[-1]


def test_fits_takes_the_whole_program_and_the_compiler_s_word():
    # Rows as plan_layout fills them, by hand: a small state never makes a row fit by itself.
    base = dict(target="v5e-8", mesh="fsdp=8", axis_sizes={}, engine="shard_map", options="")
    chip = 16 * GIB
    compiled = planning.PlanRow(**base, hbm_bytes=chip, state_bytes=GIB, total_bytes=15 * GIB)
    assert compiled.fits and compiled.verdict == "fits"
    too_big = dataclasses.replace(compiled, total_bytes=17 * GIB)  # temporaries past the chip
    assert not too_big.fits and too_big.verdict == "over by 1.00 GiB"
    refused = dataclasses.replace(
        compiled, total_bytes=15 * GIB, usable_bytes=14 * GIB, refused="RESOURCE_EXHAUSTED"
    )
    assert not refused.fits and refused.verdict == "over by 1.00 GiB"
    error = planning.PlanRow(**base, hbm_bytes=chip, error="batch 12 does not split")
    assert not error.fits and error.verdict == "error"


def test_search_compiles_only_layouts_the_trainer_accepts():
    v5e = target("v5e-4")
    objective = tiny_objective(num_heads=2)  # 2 heads, 2 layers, vocab 256, 32 positions; dense
    specs = planning.candidate_meshes(v5e, objective, 16, layout=LAYOUT)
    shapes = [spec.shape(4) for spec in specs]
    assert all(s["expert"] == 1 for s in shapes)  # a dense model has no experts to split
    assert all(s["tensor"] in (1, 2) and s["stage"] in (1, 2) for s in shapes), shapes
    split = [{a: n for a, n in s.items() if n > 1} for s in shapes]
    assert {"fsdp": 4} in split and {"sequence": 4} in split and {"tensor": 4} not in split
    seen = []
    rows = planning.search(
        v5e,
        objective,
        16,
        max_layouts=1,
        layout=LAYOUT,
        on_candidates=seen.append,
    )
    (candidates,) = seen
    assert [c.mesh for c in candidates] and {c.mesh for c in candidates} <= set(specs)
    traced = [c.traced_wire_bytes for c in candidates]
    assert traced == sorted(traced)  # fewest traced bytes first
    (row,) = rows
    assert row.fits and row.axis_sizes == candidates[0].mesh.shape(4)


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--target", "v5e-8"], "which layouts? give --mesh"),
        (["--target", "v5p-24", "--mesh", "fsdp=8"], "'v5p-24' is not a v5p slice"),
        (["--target", "v5e-8", "--search", "--max-layouts", "0"], "--max-layouts must be"),
    ],
)
def test_plan_refuses_what_it_cannot_plan_before_compiling(argv, says):
    args = build_parser().parse_args(["plan", *argv])
    with pytest.raises(ValueError, match=re.escape(says)):
        plan_command.run(args)


def test_plan_gives_a_row_per_recompute_policy(tmp_path, capsys):
    # The example decoder (2 layers) at 16 x 128 tokens on v5e-8, fsdp=8: keeping the matmul
    # outputs for the backward ("dots") needs more memory than recomputing them ("full"): heaps
    # of 1.82 and 1.72 MB (at dew plan's 512 tokens 2.00 and 1.80 MB, in compiles about three
    # times as long). With the gathers: the default rings' pieces in flight bring the two heaps
    # close (within 4% at 4 layers and 512 tokens), and their compiles take a third longer.
    out = tmp_path / "plan.json"
    args = build_parser().parse_args(
        ["plan", "--target", "v5e-8", "--mesh", "fsdp=8", "--seq-len", "128"]
        + ["--remat", "full", "dots", "--fsdp-scheme", "gather", "--json", str(out)]
    )
    assert plan_command.run(args) == 0
    rows = {row["remat"]: row for row in json.loads(out.read_text())}
    assert set(rows) == {"full", "dots"} and all(r["fits"] for r in rows.values())
    assert rows["dots"]["state_bytes"] == rows["full"]["state_bytes"]  # the same weights
    # The heap (the temporaries), not the total: at this size the total is mostly the program's
    # code, which recomputing makes longer (at 2 layers and 512 tokens "full"'s code outweighs
    # "dots"' larger heap: totals 7.89 and 7.84 MB, heaps 1.80 and 2.00 MB).
    assert rows["dots"]["temp_bytes"] > rows["full"]["temp_bytes"], rows
    table = capsys.readouterr().out.split("layout  engine")[-1]
    assert "  full  " in table and "  dots  " in table


# A traced step's report with no collective in it (what ``search`` reads: its rows).
NO_COLLECTIVES = types.SimpleNamespace(rows=())


def test_search_compiles_on_until_enough_layouts_fit(monkeypatch):
    # The compiles stood in by rows (no TPU compile): the first layout is refused by the
    # compiler, the second compiles past the memory with the fewest wire bytes of the three, the
    # third fits. Asked for one that fits, the search compiles three, in its order.
    v5e = target("v5e-4")
    objective = tiny_objective(num_heads=2)
    compiled = []

    def fake_plan(target_, objective_, meshes, batch, *, engines, on_row, **settings):
        (mesh,) = meshes
        compiled.append(mesh)
        base = dict(target="v5e-4", mesh=str(mesh), axis_sizes={}, engine=engines[0], options="")
        if len(compiled) == 1:
            return [planning.PlanRow(**base, hbm_bytes=GIB, total_bytes=2 * GIB, refused="OOM")]
        if len(compiled) == 2:
            return [planning.PlanRow(**base, hbm_bytes=GIB, total_bytes=2 * GIB, wire_bytes=1)]
        return [planning.PlanRow(**base, hbm_bytes=GIB, total_bytes=GIB // 2, wire_bytes=1000)]

    seen = []
    monkeypatch.setattr(planning, "plan", fake_plan)
    # The traces stood in too (each layout's traced bytes 0: the candidates in the order of
    # their state): their real order is test_search_compiles_only_layouts_the_trainer_accepts'
    # subject; this test's is that the search compiles in the order it announced.
    monkeypatch.setattr(dew.collectives, "collectives", lambda step, *args: NO_COLLECTIVES)
    # The schemes named: one step a layout (with "auto", each scheme a layout's rings could be
    # replaced by is a compile too: tests/test_schemes_auto.py).
    named = dew.StepOptions(fsdp_scheme="gather", tensor_scheme="plain")
    rows = planning.search(
        v5e, objective, 16, max_layouts=1, layout=LAYOUT, on_candidates=seen.append, options=named
    )
    (candidates,) = seen
    assert compiled == [c.mesh for c in candidates[:3]]
    # Those that fit first, though one that does not has fewer wire bytes; then by wire bytes,
    # unknown (refused) last.
    assert [(r.fits, r.wire_bytes) for r in rows] == [(True, 1000), (False, 1), (False, None)]
    # None ever fits: at most 4 compiles a layout asked for.
    compiled.clear()
    monkeypatch.setattr(
        planning,
        "plan",
        lambda t, o, meshes, b, **k: (
            compiled.append(meshes[0])
            or [
                planning.PlanRow(
                    "v5e-4", "x", {}, "shard_map", "", GIB, total_bytes=2 * GIB, refused="OOM"
                )
            ]
        ),
    )
    rows = planning.search(v5e, objective, 16, max_layouts=1, layout=LAYOUT, options=named)
    assert len(compiled) == min(4, len(candidates)) and not any(r.fits for r in rows)


# libtpu's log of a compile (TPU_STDERR_LOG_LEVEL=0): "Program hbm requirement 278.32M:" then
# "HLO temp 268.16M (...)" and "overlays 10.16M", in MiB to two decimals (K, M or G).
_LOG_HEAP = re.compile(
    r"Program hbm requirement ([\d.]+)([KMG]):\s*\n\s*HLO temp\s+([\d.]+)([KMG])"
)
_LOG_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}


def test_a_plan_s_temporaries_are_the_heap_libtpu_s_log_reports(tmp_path):
    # `dew plan --target v5e-1` (one chip: its one layout, no --mesh needed), in a process whose
    # libtpu logs: the row's temp is the "HLO temp" the compiler states it needs in HBM, and its
    # temp plus the program's code the "Program hbm requirement" it checks against the chip
    # (the example decoder at 16 x 64 tokens, a compile a third as long as at dew plan's 512:
    # 1.63 MiB read, 1.59 MiB logged, and 3.14 MiB by memory_analysis; at 512, 73.93, 73.91
    # and 80.58 MiB).
    out = tmp_path / "plan.json"
    env = {**os.environ, "TPU_STDERR_LOG_LEVEL": "0", "TPU_MIN_LOG_LEVEL": "0"}
    command = ["plan", "--target", "v5e-1", "--seq-len", "64", "--json", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "dew", *command],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert row["mesh"] == "data" and row["fits"], row
    logged = _LOG_HEAP.findall(done.stderr)
    assert len(logged) == 1, logged  # the step's compile, and only it, is logged so
    ((program, program_unit, heap, heap_unit),) = logged
    print(f"log: program {program}{program_unit}, HLO temp {heap}{heap_unit}; row: {row}")
    # The log rounds to two decimals, and counts part of the few dozen 512-byte thread-local
    # scalars the heap adds (96 here, 48 KiB): within 64 KiB. memory_analysis is far off.
    logged = float(heap) * _LOG_UNITS[heap_unit]
    assert abs(row["temp_bytes"] - logged) <= 64 * 2**10, (row["temp_bytes"], logged)
    assert row["analysis_temp_bytes"] - logged > 2**20, (row["analysis_temp_bytes"], logged)
    code = row["total_bytes"] - row["temp_bytes"] - row["argument_bytes"]  # outputs are donated
    needed = row["temp_bytes"] + code
    assert abs(needed - float(program) * _LOG_UNITS[program_unit]) <= 64 * 2**10, needed


def test_search_chooses_the_recompute_policy_and_says_why(tmp_path, capsys):
    # The example decoder on one v5e chip (4 x 64 tokens, a compile two thirds as long as at
    # 16 x 64: the choice, not the size, is the subject): without --remat the search chooses
    # it, least recomputation first, and "none" fits (a compile); the output names the choice
    # and why.
    out = tmp_path / "plan.json"
    args = build_parser().parse_args(
        ["plan", "--target", "v5e-1", "--seq-len", "64", "--batch", "4", "--search"]
        + ["--json", str(out)]
    )
    assert plan_command.run(args) == 0
    printed = capsys.readouterr().out
    (row,) = json.loads(out.read_text())
    assert row["choices"] == {"state": "float32", "remat": "none"} and row["remat"] == "none"
    assert row["fits"]
    assert "remat auto" in printed.splitlines()[1]  # the header: chosen, not given
    assert (
        "chose data (shard_map): state float32, remat none, the first that fits (state float32 "
        "weights and moments first; remat least " in printed
    )
    assert "search chose data (shard_map, state float32, remat none)" in printed


def test_a_refused_layout_is_said_with_the_flags(capsys):
    # The library says num_heads (it is a Python API too); dew plan's row says --heads.
    args = build_parser().parse_args(
        ["plan", "--target", "v5e-8", "--mesh", "tensor=8", "--heads", "2"]
    )
    assert plan_command.run(args) == 0
    out = capsys.readouterr().out
    assert "tensor=8 (shard_map): --heads 2 does not split over tensor 8" in out, out
    assert ": refused: --heads 2 does not split over tensor 8" in out, out
    assert "num_heads" not in out, out
