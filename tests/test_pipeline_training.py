"""Pipeline parallelism in the training step, over the ``stage`` axis (the pipelined layouts'
equivalence with one device is in tests/test_equivalence.py's table): the forward-only pipeline
gives the one-device loss, a stage holds only its layers' state, the compiled step's temporary
memory is flat in the number of microbatches (and GPipe's is not), the collectives over ``stage``
are the formulas', and bad sizes are refused before compiling, naming the numbers.

The reference is the plain one-device loss (no mesh, no shard_map, no Trainer), on the module's
fresh seed (tests/conftest.py; replay with ``DEW_SEED``).
"""

import re
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import dew
from dew.benchmark import measured_bubble, state_bytes_per_device
from dew.collectives import collectives
from dew.layout import path_names
from dew.parallel import pipeline
from dew.training.step import build_loss
from tests.equivalence import ROWS, layout_case
from tests.helpers import SEQ, seeded_key, smooth_optimizer, tiny_objective


@pytest.fixture(scope="module")
def case(module_seed):
    return layout_case(module_seed)


def test_forward_pipeline_gives_the_one_device_loss(case, seed):
    # Evaluation's loss (build_loss): M + S - 1 ticks of forwards, fsdp gathers inside the stages.
    key, batches, _ = case
    objective = tiny_objective(num_layers=4)
    trainer = dew.Trainer(
        objective,
        smooth_optimizer(),
        key,
        mesh=dew.MeshSpec(stage=4, fsdp=2, microbatches=4),
        layout=dew.Layout(min_shard=1),
    )
    state = trainer.init_state()
    loss_fn = build_loss(objective, trainer.mesh, trainer.shards, global_rows=ROWS)
    placed = trainer.device_batch(batches[0], ROWS)
    want = jax.jit(objective.loss)(jax.device_get(state.params), batches[0])  # one device's
    np.testing.assert_allclose(
        float(loss_fn(state.params, placed)[0]), float(want), rtol=1e-5, err_msg=f"seed {seed}"
    )
    # One ppermute of [rows / M, seq, embed] per tick: 32 rows over 2 fsdp devices, 4 microbatches.
    (row,) = [r for r in collectives(loss_fn, state.params, placed).rows if r.op == "ppermute"]
    assert (row.axes, row.count) == (("stage",), 4 + 4 - 1), row
    assert row.operand_bytes == row.count * 4 * SEQ * 32 * 4, row


# ---- memory ---------------------------------------------------------------------------------


def test_a_stage_holds_a_quarter_of_the_layers_state(seed):
    """At stage 4 (data 2) with AdamW and an EMA, the default Layout (min_shard 65536, which keeps
    every weight of this model whole over fsdp) splits each stacked layer weight, its two moments
    and its EMA copy over stage: each device holds 1/4 of them (one layer of four, stage s layer
    s), and the embedding and final norm (and their state) whole."""
    objective = tiny_objective(num_layers=4, ema_decay=0.9)
    trainer = dew.Trainer(
        objective,
        optax.adamw(1e-3),
        seeded_key(seed),
        mesh=dew.MeshSpec(stage=4, microbatches=4),
    )
    state = trainer.init_state()
    layers_bytes = other_bytes = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        names = path_names(path)
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        nbytes = leaf.size * leaf.dtype.itemsize
        if "layers" in names:
            layers_bytes += nbytes
            assert leaf.sharding.spec[0] == "stage", (names, leaf.sharding.spec)
            for shard in leaf.addressable_shards:
                assert shard.data.shape == (1, *leaf.shape[1:]), (names, shard.data.shape)
                position = np.argwhere(trainer.mesh.devices == shard.device)[0]
                stage = position[list(trainer.mesh.axis_names).index("stage")]
                assert shard.index[0] == slice(stage, stage + 1), (names, shard.index, stage)
        else:
            other_bytes += nbytes
            for shard in leaf.addressable_shards:
                assert shard.data.shape == leaf.shape, (names, shard.data.shape)
    assert layers_bytes > 3 * other_bytes, (layers_bytes, other_bytes)
    held = state_bytes_per_device(state)
    assert held <= layers_bytes / 4 + other_bytes, (held, layers_bytes, other_bytes)


MEMORY_ROWS = 4  # rows per microbatch, the same at every M
MEMORY_WIDTH = 128


def temp_bytes(schedule: str, microbatches: int) -> int:
    objective = tiny_objective(emb_features=MEMORY_WIDTH)
    trainer = dew.Trainer(
        objective,
        optax.sgd(0.1),
        jax.random.key(0),
        mesh=dew.MeshSpec(stage=2, microbatches=microbatches),
        layout=dew.Layout(min_shard=1),
        options=dew.StepOptions(pipeline_schedule=schedule),
    )
    rows = MEMORY_ROWS * microbatches * trainer.batch_devices
    return trainer.compiled_step(rows).memory_analysis().temp_size_in_bytes


def test_temporary_memory_is_flat_in_microbatches_where_gpipe_grows():
    """Stage 2 (data 4), microbatches of 4 rows, M = 4 against M = 16 (so the batch grows 4x).
    1F1B holds at most S microbatches' inputs (the phased one 2 S - 2) whatever M: its temporary
    memory may grow by less than one activation [4, 16, 128] float32 (32 KiB; what does grow is
    the step's token ids, 12 more microbatches of 4 x 16 int32 inputs and targets, 6 KiB). GPipe
    through the same code holds all M: 12 activations more, of which at least 10 show (the
    buffers every M holds, the loss's gradients among them, are placed differently at each M:
    measured 12.2 activations before the loss made its gradients in the forward, 10.8 since)."""
    activation = MEMORY_ROWS * SEQ * MEMORY_WIDTH * 4
    temp = {s: {m: temp_bytes(s, m) for m in (4, 16)} for s in ("1f1b", "1f1b_phased", "gpipe")}
    for schedule in ("1f1b", "1f1b_phased"):
        assert temp[schedule][16] - temp[schedule][4] < activation, temp
    assert temp["gpipe"][16] - temp["gpipe"][4] >= 10 * activation, temp


# ---- collectives over stage ------------------------------------------------------------------


@pytest.mark.parametrize(
    "schedule,dtype,accumulation",
    [("1f1b", "float32", 1), ("1f1b", "bfloat16", 1), ("1f1b_phased", "float32", 2)],
)
def test_stage_collectives_follow_the_formulas(schedule, dtype, accumulation):
    """Stage 4, data 2, 4 layers, M = 8 (times accumulation): per step, 2 ticks / period
    ppermutes over stage (each scan step sends an activation forward and a gradient back), each
    of [rows / (A M), seq, embed] in the activations' dtype; of the ticks' sends, A M per
    direction cross each stage boundary with a microbatch. The only other collective over stage
    is the psum of what every stage holds whole: the embedding's and final norm's gradients, the
    loss and the 4 router stats. Nothing is gathered over stage."""
    stages, microbatches = 4, 8
    objective = tiny_objective(num_layers=4, dtype=dtype)
    trainer = dew.Trainer(
        objective,
        optax.sgd(0.1),
        jax.random.key(0),
        mesh=dew.MeshSpec(stage=stages, microbatches=microbatches),
        layout=dew.Layout(min_shard=1),
        accumulation=accumulation,
        options=dew.StepOptions(pipeline_schedule=schedule),
    )
    report = trainer.collectives(types.SimpleNamespace(batch_size=ROWS, seq_len=SEQ))
    count = accumulation * microbatches
    plan = pipeline.SCHEDULES[schedule](stages, count)
    for arrivals in (plan.arrive_forward, plan.arrive_backward):
        assert (arrivals >= 0).sum() == (stages - 1) * count
    rows = ROWS // trainer.batch_devices // count
    activation = rows * SEQ * 32 * jnp.dtype(dtype).itemsize
    over_stage = {row.op: row for row in report.rows if "stage" in row.axes}
    assert set(over_stage) == {"ppermute", "psum"}, report
    ppermute = over_stage["ppermute"]
    assert ppermute.axes == ("stage",), report
    assert ppermute.count == 2 * plan.ticks // plan.period, report
    assert ppermute.operand_bytes == ppermute.count * activation, report
    psum = over_stage["psum"]
    params = jax.eval_shape(objective.model.init, jax.random.key(0))
    whole = [
        leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
        if "layers" not in path_names(path)
    ]
    assert psum.axes == ("data", "stage"), report
    # The whole weights' gradients and the loss (a dense model sends no router statistics).
    assert psum.count == len(whole) + 1, report
    assert psum.operand_bytes == sum(leaf.size * 4 for leaf in whole) + 4, report


def test_the_guide_draws_the_default_schedule():
    # docs/distributed.md's table of ticks is the schedule the step runs at S = 4, M = 8.
    guide = (Path(__file__).resolve().parents[1] / "docs" / "distributed.md").read_text()
    assert pipeline.schedule_1f1b(4, 8).table() in guide


def bytes_per_device(shapes, shardings) -> int:
    """The most bytes any device holds of a state of ``shapes`` (``jax.eval_shape``'s) laid out
    by ``shardings``: each leaf's shard on each device, from its index there (a typed key as its
    key data), as ``state_bytes_per_device`` counts the placed arrays."""
    held: dict = {}
    for leaf, sharding in zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings), strict=True):
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.eval_shape(jax.random.key_data, leaf)
        for device, index in sharding.devices_indices_map(leaf.shape).items():
            sizes = [len(range(*part.indices(n))) for part, n in zip(index, leaf.shape)]
            held[device] = held.get(device, 0) + int(np.prod(sizes)) * leaf.dtype.itemsize
    return max(held.values())


def test_the_guides_state_per_device_is_what_the_layouts_hold():
    # docs/distributed.md's table: dew bench's model (4 layers of width 256, vocabulary 256) with
    # AdamW, the initial state's bytes on the device holding most, each layout's line as shown.
    # Counted from the state's shapes and the trainer's shardings (what init_state places it by),
    # not from a state made: three initialisations compiled and run took 6.2 CPU-s, the count
    # 0.3. The count of placed arrays (state_bytes_per_device, dew bench's) is
    # test_a_stage_holds_a_quarter_of_the_layers_state's.
    from dew.benchmark import ModelSize
    from dew.objectives.lm import LMObjective

    guide = (Path(__file__).resolve().parents[1] / "docs" / "distributed.md").read_text()
    shown = re.findall(r"^(\S+) +([\d.]+) MiB per device$", guide, re.MULTILINE)
    assert [layout for layout, _ in shown] == [
        "data=8",
        "stage=4,microbatches=8",
        "stage=4,fsdp=2,microbatches=8",
    ], shown
    size = ModelSize()
    model = dew.models.build(
        "causal_transformer",
        vocab_size=size.vocab,
        emb_features=size.width,
        num_layers=size.layers,
        num_heads=size.heads,
        max_seq_len=size.seq_len,
    )
    for layout, mib in shown:
        trainer = dew.Trainer(
            LMObjective(model, size.seq_len),
            optax.adamw(1e-3),
            jax.random.key(0),
            mesh=dew.MeshSpec.parse(layout),
        )
        held = bytes_per_device(jax.eval_shape(trainer.init_state), trainer.state_shardings)
        assert f"{held / 2**20:.2f}" == mib, (layout, held)


# ---- the measured bubble ---------------------------------------------------------------------


@pytest.mark.parametrize("stages,microbatches", [(2, 2), (4, 8), (4, 16), (8, 8)])
def test_measured_bubble_recovers_the_formula_from_two_step_times(stages, microbatches):
    # A step of M microbatches taking (M + S - 1) units, as the formula has it, and of 2M taking
    # (2M + S - 1): the measurement gives (S - 1) / (M + S - 1) back.
    unit = 0.0123
    one = (microbatches + stages - 1) * unit
    two = (2 * microbatches + stages - 1) * unit
    assert measured_bubble(one, two) == pytest.approx(
        pipeline.bubble_formula(stages, microbatches), abs=1e-12
    )


# ---- refusals, before compiling --------------------------------------------------------------


@pytest.fixture
def no_compiling(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("compiled before checking the input")

    monkeypatch.setattr(jax, "jit", boom)


def trainer_for(mesh, overrides=None, **kwargs):
    return dew.Trainer(
        tiny_objective(**(overrides or {})), optax.sgd(0.1), jax.random.key(0), mesh=mesh, **kwargs
    )


def test_mesh_spec_reads_and_checks_microbatches():
    assert dew.MeshSpec.parse("stage=4,microbatches=8") == dew.MeshSpec(stage=4, microbatches=8)
    with pytest.raises(ValueError, match=r"MeshSpec\(microbatches=4\) needs stage > 1"):
        dew.MeshSpec(microbatches=4)
    with pytest.raises(
        ValueError,
        match=r"MeshSpec\(stage=4, microbatches=2\): microbatches must be at least stage 4",
    ):
        dew.MeshSpec.parse("stage=4,microbatches=2")
    with pytest.raises(ValueError, match="MeshSpec.microbatches must be an integer >= 1, got 0"):
        dew.MeshSpec(stage=2, microbatches=0)


REFUSED = [
    (
        {"num_layers": 3},
        dew.MeshSpec(stage=2, microbatches=2),
        {},
        r"num_layers 3 does not split over stage 2",
    ),
    (
        {"num_layers": 4, "num_experts": 4, "moe_every": 2},
        dew.MeshSpec(stage=4, microbatches=4),
        {},
        r"num_layers 4 makes 2 groups of moe_every 2 layers .* do not split over stage 4",
    ),
    (
        {},
        dew.MeshSpec(stage=2, microbatches=2),
        {"layout": dew.Layout(rules=[r for r in dew.layout.DEFAULT_RULES if r[1] != "stage"])},
        r"stage 2: weight params/layers/attn/k \(logical axes \('layers', .*\) has spec P\(\); "
        r"the pipeline needs each 'layers' dimension split over 'stage'",
    ),
    (
        {},
        dew.MeshSpec(stage=2, microbatches=2),
        {"layout": dew.Layout(rules=[("vocab", "stage"), *dew.layout.DEFAULT_RULES])},
        r"stage 2: weight params/embed_tokens/embedding .* has spec P\('stage',\); the pipeline "
        r"needs .* nothing else split over it",
    ),
    (
        {},
        dew.MeshSpec(stage=2, sequence=2, microbatches=2),
        {},
        r"sequence 2 with stage 2: ring attention's ppermutes cannot run inside a pipeline "
        r"stage .* use sequence_scheme='all_to_all'",
    ),
]


@pytest.mark.parametrize("overrides,mesh,kwargs,match", REFUSED)
def test_bad_pipelines_are_refused_before_compiling(no_compiling, overrides, mesh, kwargs, match):
    with pytest.raises(ValueError, match=match):
        trainer_for(mesh, overrides, **kwargs)


def test_an_unknown_schedule_is_refused():
    with pytest.raises(
        ValueError,
        match=r"unknown pipeline_schedule 'zigzag'; expected one of 1f1b, 1f1b_phased, gpipe",
    ):
        dew.StepOptions(pipeline_schedule="zigzag")


def test_a_batch_that_does_not_cut_into_microbatches_is_refused(no_compiling):
    trainer = trainer_for(dew.MeshSpec(stage=2, microbatches=4), accumulation=2)
    with pytest.raises(
        ValueError,
        match=r"batch 16 over 4 devices \(data 4 x fsdp 1\) leaves 4 rows per device, 2 per "
        r"accumulation microbatch \(accumulation 2\), which do not split into 4 pipeline "
        r"microbatches \(MeshSpec\(stage=2, microbatches=4\)\)",
    ):
        trainer.train_step(16)
    # Without accumulation: 2 rows per device against 4 microbatches.
    with pytest.raises(
        ValueError, match=r"leaves 2 rows per device, which do not split into 4 pipeline"
    ):
        trainer_for(dew.MeshSpec(stage=2, microbatches=4)).train_step(8)


def test_the_gradient_rule_sums_whole_weights_over_stage():
    # The specs the default layout gives a pipeline: the stacked layers over stage, the rest whole.
    trainer = trainer_for(
        dew.MeshSpec(stage=2, fsdp=2, microbatches=2), layout=dew.Layout(min_shard=1)
    )
    from dew.parallel.gradients import sum_axes

    specs = trainer.param_specs["params"]
    assert specs["layers"]["mlp"]["up"] == P("stage", "fsdp")
    assert sum_axes(specs["layers"]["mlp"]["up"], trainer.shards) == ("data",)
    assert specs["embed_tokens"]["embedding"] == P("fsdp")
    assert sum_axes(specs["embed_tokens"]["embedding"], trainer.shards) == ("data", "stage")


def test_a_stage4_checkpoint_restores_into_fsdp8_and_stage2_tensor2(tmp_path, seed):
    # Every array of the state (weights and both Adam moments) filled with random numbers, so a
    # slice restored into the wrong place, or a moment swapped for another, cannot pass as zeros.
    def trainer(mesh):
        return dew.Trainer(
            tiny_objective(num_layers=4, num_heads=8),
            optax.adam(1e-3),
            seeded_key(seed),
            mesh=mesh,
            layout=dew.Layout(min_shard=1),
            checkpoints=dew.Checkpoints(tmp_path / "ckpt"),
        )

    saver = trainer(dew.MeshSpec(stage=4, microbatches=4))
    state = saver.init_state()
    rng = np.random.default_rng(seed)

    def randomized(x):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        return jax.device_put(rng.standard_normal(x.shape).astype(x.dtype), x.sharding)

    state = state.replace(
        params=jax.tree_util.tree_map(randomized, state.params),
        opt_state=jax.tree_util.tree_map(randomized, state.opt_state),
    )
    saver.save(state)
    saver.checkpoints.wait()
    for mesh in (dew.MeshSpec(fsdp=8), dew.MeshSpec(stage=2, tensor=2, microbatches=2)):
        target = trainer(mesh)
        restored, shardings, _ = target.place()
        for got, want, sharding in zip(
            jax.tree_util.tree_leaves((restored.params, restored.opt_state)),
            jax.tree_util.tree_leaves((state.params, state.opt_state)),
            jax.tree_util.tree_leaves((shardings.params, shardings.opt_state)),
            strict=True,
        ):
            assert got.sharding.is_equivalent_to(sharding, got.ndim), (mesh, got.sharding)
            np.testing.assert_array_equal(
                np.asarray(got), np.asarray(want), err_msg=f"{mesh}, seed {seed}"
            )
