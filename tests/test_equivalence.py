"""Every layout computes what one device computes: one table of layouts over every axis and their
combinations, each against the plain one-device run of the same model (same initial weights, and
within float32 rounding the same losses, every gradient of every step, weights and optimizer state
after three steps).

The reference (tests/equivalence.py) is the model's plain loss on one device, ``jax.grad`` and the
optax update, with no mesh, no shard_map and no Trainer; it is run once per model configuration and
cut of the batch, and shared by every layout of that model. Keys and tokens come from the module's
seed (tests/conftest.py): fresh every session, shown when a test fails, replayed with ``DEW_SEED``.
"""

import dataclasses

import jax
import numpy as np
import optax
import pytest

import dew
from tests.equivalence import (
    ROWS,
    STEPS,
    TOL,
    Microbatched,
    assert_matches,
    cached_reference,
    layout_case,
    reference_run,
    sharded_run,
)
from tests.helpers import fresh_batch, relative_error, seeded_key, smooth_optimizer, tiny_objective

# Models: tiny_objective's 2-layer decoder (width 32, 4 heads, vocabulary 64, MLP 128), with
# these overrides.
TENSOR = {"num_heads": 8}  # 8 heads of 4: tensor=8 splits them
MOE = {"num_experts": 8, "experts_per_token": 2}
# Llama 3's rotary settings, scaled at an original context of 8 (rows of 16 cross it): with 4
# heads of 8, pair 0 is interpolated and pairs 1-3 stretched.
LLAMA3_ROPE = {
    "rope_theta": 500000.0,
    "rope_scaling": dew.nn.rotary.Llama3Scaling(4.0, 1.0, 4.0, 8),
    "rms_norm_eps": 1e-5,
}


@dataclasses.dataclass(frozen=True)
class Layout:
    """One row of the table: the model's overrides, the mesh, and the Trainer's other arguments."""

    model: dict
    mesh: dew.MeshSpec
    trainer: dict = dataclasses.field(default_factory=dict)

    @property
    def moe(self) -> bool:
        return bool(self.model.get("num_experts"))

    def batch_cut(self) -> tuple[int, int]:
        """``(splits, count)`` of ``Microbatched``: an MoE model's router statistics are those of
        each microbatch the step runs, ``accumulation x microbatches`` of them, each taking its
        rows from every device of the batch axes. ``(1, 1)`` for a dense model (its loss is a sum
        over tokens, which no cut changes) and for one microbatch."""
        count = self.trainer.get("accumulation", 1) * (self.mesh.microbatches or 1)
        if not self.moe or count == 1:
            return 1, 1
        shape = self.mesh.shape(jax.device_count())
        return shape["data"] * shape["expert"] * shape["fsdp"], count


def options(**kwargs) -> dict:
    return {"options": dew.StepOptions(**kwargs)}


M = dew.MeshSpec
LAYOUTS = {
    # --- data and fsdp
    "data8": Layout({}, M()),
    "fsdp8": Layout({}, M(fsdp=8)),
    "data2_fsdp4": Layout({}, M(fsdp=4)),
    "fsdp8_accumulation4": Layout({}, M(fsdp=8), {"accumulation": 4}),
    # The GSPMD engine's own accumulation path (global arrays, no shard_map).
    "gspmd_data2_fsdp4_accumulation2": Layout(
        {}, M(fsdp=4), {"accumulation": 2, "engine": "gspmd"}
    ),
    # --- tensor
    "tensor8": Layout(TENSOR, M(tensor=8)),
    "tensor2_fsdp4": Layout(TENSOR, M(tensor=2, fsdp=4)),
    "tensor4_kv2": Layout({**TENSOR, "num_kv_heads": 2}, M(tensor=4)),
    "tensor4_fsdp2_accumulation2": Layout(TENSOR, M(tensor=4, fsdp=2), {"accumulation": 2}),
    "data2_tensor4_sequence_parallel": Layout(TENSOR, M(tensor=4), options(sequence_parallel=True)),
    "tensor8_kv2_sequence_parallel": Layout(
        {**TENSOR, "num_kv_heads": 2}, M(tensor=8), options(sequence_parallel=True)
    ),
    "tensor4_kv2_pallas_sequence_parallel": Layout(
        {**TENSOR, "num_kv_heads": 2, "attention_impl": "pallas", "num_layers": 1},
        M(tensor=4),
        options(sequence_parallel=True),
    ),
    "untied_tensor2_fsdp4_sequence_parallel": Layout(
        {**TENSOR, "tie_embeddings": False},
        M(tensor=2, fsdp=4),
        options(sequence_parallel=True),
    ),
    # The regions' entry and exit as collective matmuls (tensor_scheme="ring"): tensor 8 with
    # shared kv heads, beside fsdp without sequence parallelism, tensor 2 beside data and fsdp.
    "tensor8_kv2_ring_sequence_parallel": Layout(
        {**TENSOR, "num_kv_heads": 2},
        M(tensor=8),
        options(sequence_parallel=True, tensor_scheme="ring"),
    ),
    "tensor4_fsdp2_ring": Layout(TENSOR, M(tensor=4, fsdp=2), options(tensor_scheme="ring")),
    "data2_tensor2_fsdp2_ring_sequence_parallel": Layout(
        TENSOR, M(tensor=2, fsdp=2), options(sequence_parallel=True, tensor_scheme="ring")
    ),
    # --- sequence
    "sequence8": Layout({}, M(sequence=8)),
    "data2_sequence4_kv2": Layout({"num_kv_heads": 2}, M(sequence=4)),
    # The ring with the Pallas block kernels (interpret mode): a sequence axis of 2 runs each
    # kind of block (the own causal one, the two c x c pairs), forward and backward, with 12
    # kernels in the step's program where 4 would put 24, each compiled as a loop of its own; the
    # ring's scanned steps are the same code for either block function (sequence8 runs them).
    "data4_sequence2_pallas": Layout({"attention_impl": "pallas", "num_layers": 1}, M(sequence=2)),
    "sequence2_fsdp4_accumulation2": Layout({}, M(sequence=2, fsdp=4), {"accumulation": 2}),
    "sequence4_fsdp2_all_to_all_accumulation2": Layout(
        {}, M(sequence=4, fsdp=2), {**options(sequence_scheme="all_to_all"), "accumulation": 2}
    ),
    "sequence2_tensor2_fsdp2_sequence_parallel": Layout(
        {}, M(sequence=2, tensor=2, fsdp=2), options(sequence_parallel=True)
    ),
    # Llama 3's scaled rotary: each device rotates its zigzag positions by the same frequencies.
    "llama3_rope_sequence4_kv2": Layout({**LLAMA3_ROPE, "num_kv_heads": 2}, M(sequence=4)),
    "llama3_rope_sequence2_kv2_fsdp4_all_to_all": Layout(
        {**LLAMA3_ROPE, "num_kv_heads": 2},
        M(sequence=2, fsdp=4),
        options(sequence_scheme="all_to_all"),
    ),
    # --- expert (mixture of experts)
    "moe_fsdp8": Layout(MOE, M(fsdp=8)),
    "moe_expert8": Layout(MOE, M(expert=8)),
    "moe_data2_expert2_tensor2": Layout(MOE, M(expert=2, tensor=2)),
    # Attention's region on the tensor ring, the MoE layer's on the plain pair.
    "moe_data2_expert2_tensor2_ring_sequence_parallel": Layout(
        MOE, M(expert=2, tensor=2), options(sequence_parallel=True, tensor_scheme="ring")
    ),
    "moe_capacity_expert8": Layout({**MOE, "capacity_factor": 1.0}, M(expert=8)),
    # One dense layer then one MoE layer, positions split over sequence too.
    "moe_every2_data2_expert2_sequence2": Layout({**MOE, "moe_every": 2}, M(expert=2, sequence=2)),
    "moe_capacity_expert2_tensor2_fsdp2_sequence_parallel": Layout(
        {**MOE, "capacity_factor": 1.0},
        M(expert=2, tensor=2, fsdp=2),
        options(sequence_parallel=True),
    ),
    "moe_expert2_sequence2_tensor2_sequence_parallel": Layout(
        MOE, M(expert=2, sequence=2, tensor=2), options(sequence_parallel=True)
    ),
    # The ragged exchange, run on CPU by its exact emulation (the offsets the accelerators use),
    # with the worst-case receive buffer, which never drops a copy.
    "moe_ragged_data2_expert4": Layout(
        {**MOE, "expert_exchange": "ragged", "expert_buffer_factor": None}, M(expert=4)
    ),
    # The router statistics of 2 microbatches, each of 2 rows from every device.
    "moe_expert4_fsdp2_accumulation2": Layout(MOE, M(expert=4, fsdp=2), {"accumulation": 2}),
    # --- stage (pipelines)
    # data 2: 16 rows per device, 8 microbatches of 2; one layer per stage.
    "stage4_m8": Layout({"num_layers": 4}, M(stage=4, microbatches=8)),
    # fsdp 4 gathers inside each stage's layers; the phased schedule.
    "stage2_fsdp4_phased": Layout(
        {}, M(stage=2, fsdp=4, microbatches=4), options(pipeline_schedule="1f1b_phased")
    ),
    "data2_stage2_tensor2_sequence_parallel": Layout(
        TENSOR, M(stage=2, tensor=2, microbatches=4), options(sequence_parallel=True)
    ),
    # 2 accumulation microbatches x 2 pipeline microbatches: 4 through one pipeline.
    "stage2_m2_accumulation2": Layout({}, M(stage=2, microbatches=2), {"accumulation": 2}),
    # Positions over sequence, by the all-to-all scheme (the ring is refused with stage).
    "data2_stage2_sequence2_all_to_all": Layout(
        {}, M(stage=2, sequence=2, microbatches=4), options(sequence_scheme="all_to_all")
    ),
    # The GSPMD baseline on the same state layout (layers split over stage): it does not
    # pipeline, XLA moves the layers as it sees fit, and it still computes what one device does.
    "gspmd_stage2_fsdp2": Layout({}, M(stage=2, fsdp=2, microbatches=2), {"engine": "gspmd"}),
    # 4 layers, every second one MoE: each stage runs one dense and one MoE layer.
    "moe_every2_data2_expert2_stage2": Layout(
        {**MOE, "num_experts": 4, "num_layers": 4, "moe_every": 2},
        M(stage=2, expert=2, microbatches=4),
    ),
    "moe_stage2_expert2_tensor2": Layout(
        {**MOE, "num_experts": 4, **TENSOR}, M(stage=2, expert=2, tensor=2, microbatches=2)
    ),
}


# Model settings one device ignores: layouts differing only in them share a reference.
ONE_DEVICE_SAME = ("expert_exchange", "expert_buffer_factor")


@pytest.fixture(scope="module")
def case(module_seed):
    return layout_case(module_seed)


def reference_name(layout: Layout) -> tuple:
    """What names ``layout``'s one-device run: its model (less what one device ignores: how
    copies cross an expert axis, which one device does not have) and how its step cuts the
    batch."""
    model = {k: v for k, v in layout.model.items() if k not in ONE_DEVICE_SAME}
    return (tuple(sorted(model.items())), *layout.batch_cut())


def reference_for(case, layout: Layout):
    """The one-device run of ``layout``'s model, cut as its step cuts the batch; shared by every
    layout with the same model and cut."""
    objective = tiny_objective(**layout.model)
    _, splits, count = name = reference_name(layout)
    reference = objective if count == 1 else Microbatched(objective, splits, count)
    return cached_reference(case, reference, name)


def group_of(row: str) -> str | None:
    """The xdist group of a row whose one-device run other rows share (one worker runs them all,
    after computing that run once); ``None`` for a row with a run of its own."""
    names = [reference_name(layout) for layout in LAYOUTS.values()]
    shared = [n for n in dict.fromkeys(names) if names.count(n) > 1]
    name = reference_name(LAYOUTS[row])
    return f"equivalence-{shared.index(name)}" if name in shared else None


def rows():
    """The table's rows for ``parametrize``, each in its ``group_of``."""
    return [
        pytest.param(row, marks=pytest.mark.xdist_group(group)) if (group := group_of(row)) else row
        for row in LAYOUTS
    ]


@pytest.mark.parametrize("name", rows())
def test_layout_matches_one_device(case, seed, name):
    layout = LAYOUTS[name]
    key = case[0]
    reference = reference_for(case, layout)
    run = sharded_run(
        tiny_objective(**layout.model),
        smooth_optimizer(),
        key,
        reference["batches"],  # the case's, unless the router came near a tie on them
        layout.mesh,
        initial=reference["initial"],
        **layout.trainer,
    )
    assert_matches(run, reference, seed, name)
    assert run["step"] == STEPS


@pytest.mark.parametrize(
    "name", ["data8", "fsdp8", "tensor8", "sequence8", "moe_expert8", "stage4_m8"]
)
def test_initial_weights_do_not_depend_on_the_layout(case, seed, name):
    # The trainer creates the state directly in its layout, one layout per axis here; the table
    # above starts every layout from the one-device weights.
    layout = LAYOUTS[name]
    key, _, _ = case
    trainer = dew.Trainer(
        tiny_objective(**layout.model),
        smooth_optimizer(),
        key,
        mesh=layout.mesh,
        layout=dew.Layout(min_shard=1),
    )
    one = jax.devices()[0]
    want = jax.jit(trainer.objective.model.init)(jax.device_put(key, one))
    got = trainer.init_state().params
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_array_equal(
            np.asarray(a), np.asarray(b), err_msg=f"initial weights on {name}, seed {seed}"
        )


def test_the_table_covers_every_axis_and_the_combinations():
    # Each axis alone and with others; the combinations issue 19 asked for by name.
    def axes(layout):
        shape = layout.mesh.shape(8)
        return frozenset(a for a in dew.AXES if shape[a] > 1)

    used = {axes(layout) for layout in LAYOUTS.values()}
    for axis in dew.AXES:
        assert frozenset([axis]) in used or any(axis in u and len(u) > 1 for u in used), axis
    assert frozenset(["expert", "sequence", "tensor"]) in used
    assert frozenset(["stage", "expert", "tensor"]) in used
    moe_accumulation = [
        n for n, lay in LAYOUTS.items() if lay.moe and lay.trainer.get("accumulation", 1) > 1
    ]
    assert moe_accumulation, "no MoE layout with accumulation"


# With the plain model's rows, whose one-device run it shares.
@pytest.mark.xdist_group(group_of("data8"))
def test_the_trainers_gradients_match_one_device(case, seed):
    # Trainer.gradients (the inspection entry point) computes what the step computes.
    key, batches, _ = case
    objective = tiny_objective()
    reference = cached_reference(case, objective, reference_name(LAYOUTS["data8"]))
    trainer = dew.Trainer(
        objective,
        smooth_optimizer(),
        key,
        mesh=dew.MeshSpec(fsdp=4),
        layout=dew.Layout(min_shard=1),
    )
    state = trainer.init_state()
    grads, loss = trainer.gradients(state.params, trainer.device_batch(batches[0], ROWS))
    np.testing.assert_allclose(float(loss), reference["losses"][0], rtol=TOL, err_msg=f"{seed}")
    error = relative_error(grads, reference["grads"][0])
    assert error < TOL, f"gradients differ by {error:.3g}, seed {seed}"


def test_clip_by_global_norm_matches_one_device(case, seed):
    key, batches, _ = case
    objective = tiny_objective(**TENSOR)
    # A threshold far below the gradient norm, so the clip is active and depends on the global
    # norm of every gradient, fsdp- and tensor-split ones included, and a learning rate that makes
    # each update 1.0 in norm, large enough to compare in float32.
    optimizer = optax.chain(optax.clip_by_global_norm(1e-3), optax.sgd(1e3))
    reference = reference_run(objective, optimizer, key, batches[:2])
    for mesh in (dew.MeshSpec(fsdp=8), dew.MeshSpec(tensor=4, fsdp=2)):
        run = sharded_run(
            objective, optimizer, key, batches[:2], mesh, initial=reference["initial"]
        )
        # A norm summed over one device's shards only would scale the moves by about sqrt(8).
        moved = jax.tree_util.tree_map(
            lambda a, b: np.asarray(a, np.float64) - b, run["params"], run["initial"]
        )
        ref_moved = jax.tree_util.tree_map(
            lambda a, b: np.asarray(a, np.float64) - np.asarray(b),
            reference["params"],
            reference["initial"],
        )
        # Float32 rounding of the norm's sum and of the weights: 2.6e-6 to 5.0e-6 (measured on
        # both meshes, seeds 1 and 2, 2026-12-06).
        error = relative_error(moved, ref_moved)
        assert error < 2e-5, f"clipped moves differ by {error:.3g} on {mesh}, seed {seed}"


def host(tree):
    return jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), tree)


def test_ema_follows_params(seed):
    # decay 0.9, not 0.5: an EMA that swapped decay and 1 - decay would pass at 0.5.
    decay = 0.9
    trainer = dew.Trainer(
        tiny_objective(ema_decay=decay),
        optax.sgd(1.0),
        seeded_key(seed),
        mesh=dew.MeshSpec(fsdp=8),
        layout=dew.Layout(min_shard=1),
    )
    state = trainer.init_state()
    initial = host(state.params)
    expected = initial
    step = trainer.train_step(16)
    for i in range(3):
        state, _ = step(state, trainer.device_batch(fresh_batch(16, (seed, i)), 16))
        # The EMA of the params after each step: e_t = decay * e_(t-1) + (1 - decay) * p_t.
        expected = jax.tree_util.tree_map(
            lambda e, p: decay * e + (1 - decay) * p, expected, host(state.params)
        )
        # Compared as moves from the initial weights, which a wrong EMA gets wrong by their own
        # size (swapped decays: 8x, the params before the step: 1x). Float32 rounding of the
        # weights themselves is 2.3e-5 to 3.8e-5 of the moves (seeds 1 and 2, each step).
        moved = jax.tree_util.tree_map(np.subtract, host(state.ema), initial)
        expected_moved = jax.tree_util.tree_map(np.subtract, expected, initial)
        error = relative_error(moved, expected_moved)
        assert error < 1.5e-4, f"EMA after step {i + 1} is off by {error:.3g}, seed {seed}"
    assert (
        state.ema["params"]["embed_tokens"]["embedding"].sharding.spec
        == state.params["params"]["embed_tokens"]["embedding"].sharding.spec
    )


def test_validation_loss_matches_one_device(tmp_path, seed):
    from dew.data import TokenWindows, write_token_folder
    from tests.helpers import SEQ, VOCAB

    rng = np.random.default_rng(seed)
    write_token_folder(
        tmp_path / "t", rng.integers(0, VOCAB, 2000), rng.integers(0, VOCAB, 800), vocab_size=VOCAB
    )
    data = TokenWindows(tmp_path / "t", seq_len=SEQ, val_batches=2).load(batch=16)
    objective = tiny_objective(ema_decay=0.5)
    trainer = dew.Trainer(
        objective,
        optax.sgd(0.1),
        seeded_key(seed),
        mesh=dew.MeshSpec(fsdp=4),
        layout=dew.Layout(min_shard=1),
    )
    state = trainer.init_state()
    state, _ = trainer.train_step(16)(state, trainer.device_batch(fresh_batch(16, seed), 16))
    # One device's loss, compiled once (run op by op, the model's every operation compiles a
    # program of its own).
    loss = jax.jit(objective.loss)
    for which in ("params", "ema"):
        weights = jax.tree_util.tree_map(np.asarray, getattr(state, which))
        expected = np.mean([float(loss(weights, b)) for b in data.validation()])
        np.testing.assert_allclose(
            trainer.evaluate(state, data, params=which),
            expected,
            rtol=TOL,
            err_msg=f"{which}, seed {seed}",
        )
    assert trainer.evaluate(state, data) != trainer.evaluate(state, data, params="ema"), seed


def test_moe_validation_reports_the_language_model_loss_and_the_router_losses_beside_it(
    tmp_path, seed
):
    # Over expert 4 x fsdp 2. "loss" must be the cross-entropy alone (comparable with a dense
    # model's), computed here from the one-device logits; the router losses are reported beside
    # it, each from the one-device statistics of each validation batch.
    from dew.data import TokenWindows
    from tests.helpers import SEQ, random_token_folder

    data = TokenWindows(
        random_token_folder(tmp_path / "t", seed, train=2000, val=800), seq_len=SEQ, val_batches=2
    ).load(batch=16)
    objective = tiny_objective(**MOE)
    trainer = dew.Trainer(
        objective,
        optax.sgd(0.1),
        seeded_key(seed),
        mesh=dew.MeshSpec(expert=4, fsdp=2),
        layout=dew.Layout(min_shard=1),
    )
    state = trainer.init_state()
    params = jax.tree_util.tree_map(np.asarray, state.params)
    # One device's logits and router statistics, each compiled once (run op by op, the model's
    # every operation compiles a program of its own).
    apply, loss_sum = jax.jit(objective.model.apply), jax.jit(objective.loss_sum)
    want = {"loss": [], "load_balance_loss": [], "router_z_loss": []}
    for batch in data.validation():
        logits = np.asarray(apply(params, batch[:, :-1]), np.float64)
        top = logits.max(-1, keepdims=True)
        log_probs = logits - (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))
        picked = np.take_along_axis(log_probs, batch[:, 1:, None], axis=-1)
        want["loss"].append(-picked.mean())
        _, stats = loss_sum(params, batch)
        tokens = batch.shape[0] * SEQ
        want["load_balance_loss"].append(float(stats.load_balance) / tokens)
        want["router_z_loss"].append(float(stats.z_loss) / tokens)
    got = trainer.validation_metrics(state, data)
    for name, values in want.items():
        np.testing.assert_allclose(got[name], np.mean(values), rtol=1e-5, err_msg=f"{name}, {seed}")
    assert got["dropped_fraction"] == 0.0, got  # dropless
    assert trainer.evaluate(state, data) == got["loss"]
    # The training loss folds the weighted router losses in; validation's does not.
    training = float(jax.jit(objective.loss)(params, data.validation()[0]))
    assert training > want["loss"][0], (training, want["loss"][0], seed)
