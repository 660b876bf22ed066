"""``dew plan`` (``dew.planning``): the real step compiled for TPU slices with libtpu and no TPU.

One compile per behaviour, tiny models (the TPU compiler takes seconds on them, minutes on real
sizes: those are measured in docs/planning.md). All in one worker, which loads libtpu once.
"""

import json
import re

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
    row = planning.plan_layout(v5e, tiny_objective(), "fsdp=8", 16, layout=LAYOUT)
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
    assert row.state_bytes == memory.argument_size_in_bytes
    assert row.temp_bytes == memory.temp_size_in_bytes
    assert row.total_bytes == (
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
        + memory.temp_size_in_bytes
        + memory.generated_code_size_in_bytes
    )
    assert row.fits and row.verdict == "fits" and row.hbm_bytes == 16 * GIB
    assert row.axis_sizes["fsdp"] == 8 and row.axis_sizes["data"] == 1
    assert not row.approximate and row.wire_bytes > 0 and row.collectives["all_gather"] > 0


def test_the_tpu_hlo_counts_every_layer_as_the_jaxpr_does():
    # The TPU's final HLO keeps no trip counts: each per-layer gather is found by reading the
    # loop's counter. v5p-8 is 4 chips, so 4 devices.
    v5p = target("v5p-8")
    assert len(v5p.devices()) == 4
    trainer = dew.Trainer(
        tiny_objective(num_layers=4),
        optax.adamw(1e-3),
        jax.random.key(0),
        mesh=dew.MeshSpec(fsdp=4),
        layout=LAYOUT,
        devices=v5p.devices(),
    )
    compiled = trainer.compiled_step(8)
    from_hlo = hlo_collectives(compiled, trainer.mesh)
    from_jaxpr = collectives(trainer.train_step(8), *trainer.step_arguments(8))
    assert not any(r.approximate for r in from_hlo.rows), from_hlo
    # Each of the 4 layers' gathers forward and again backward (the layer is recomputed), and
    # the gathers outside the layer loop (the vocabulary's tokens).
    gathers = from_hlo.count("all_gather")
    print(f"all_gather: {gathers} in the TPU HLO, {from_jaxpr.count('all_gather')} in the jaxpr")
    assert gathers == from_jaxpr.count("all_gather") and gathers >= 2 * 4


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
    assert 15 * GIB < row["hbm_bytes"] <= 16 * GIB  # what the compiler says it can use
    over = (row["total_bytes"] - row["hbm_bytes"]) / GIB
    assert f"over by {over:.2f} GiB" in printed and over > 0.6


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
        (["--target", "v5e-8", "--mesh", "fsdp=8", "--search"], "--mesh and --search: give one"),
        (["--target", "v5p-24", "--mesh", "fsdp=8"], "'v5p-24' is not a v5p slice"),
        (["--target", "v5e-8", "--search", "--max-layouts", "0"], "--max-layouts must be"),
    ],
)
def test_plan_refuses_what_it_cannot_plan_before_compiling(argv, says):
    args = build_parser().parse_args(["plan", *argv])
    with pytest.raises(ValueError, match=re.escape(says)):
        plan_command.run(args)
