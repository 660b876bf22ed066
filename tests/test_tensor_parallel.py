"""Tensor parallelism (Megatron) in the training step (its layouts' equivalence with one device is
in tests/test_equivalence.py's table): bfloat16 trains close to one device, each weight's gradient
is summed over the axes the rule names, the state is split by the tensor size, and bad sizes or
layouts are refused before compiling, naming the numbers.

The reference is the plain one-device run of tests/equivalence.py (no mesh, no shard_map, no
Trainer), on the module's fresh seed (tests/conftest.py; replay with ``DEW_SEED``).
"""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import dew
from dew.benchmark import state_bytes_per_device
from dew.layout import path_names
from dew.objectives.lm import LMObjective
from dew.parallel.gradients import sum_axes
from tests.equivalence import (
    ROWS,
    STEPS,
    cached_reference,
    layout_case,
    sharded_run,
)
from tests.helpers import fresh_batch, relative_error, seeded_key, smooth_optimizer, tiny_objective

# Eight query heads of width 4, so that tensor=8 splits them; the MLP (128) and vocabulary (64)
# split over 8 too.
HEADS = 8


def objective_for(overrides, dtype="float32"):
    return tiny_objective(num_heads=HEADS, dtype=dtype, **overrides)


@pytest.fixture(scope="module")
def case(module_seed):
    return layout_case(module_seed)


def reference_for(case, overrides, dtype="float32"):
    name = (tuple(sorted(overrides.items())), dtype)
    return cached_reference(case, objective_for(overrides, dtype), name)


def test_bfloat16_activations_train_close_to_one_device(case, seed):
    # The same bfloat16 model on one device and over data 2 x tensor 4 (sequence parallel): the
    # partial sums of the row-parallel matmuls are added in another order, in bfloat16.
    key, batches, _ = case
    reference = reference_for(case, {}, dtype="bfloat16")
    run = sharded_run(
        objective_for({}, dtype="bfloat16"),
        smooth_optimizer(),
        key,
        batches,
        dew.MeshSpec(tensor=4),
        options=dew.StepOptions(sequence_parallel=True),
    )
    assert all(np.isfinite(run["losses"])), (run["losses"], seed)
    np.testing.assert_allclose(
        run["losses"], reference["losses"], rtol=2e-2, err_msg=f"bfloat16 losses, seed {seed}"
    )
    error = relative_error(run["params"], reference["params"])
    assert error < 2e-2, f"bfloat16 params after {STEPS} steps differ by {error:.3g}, seed {seed}"
    # A bfloat16 gradient is itself about 2e-2 from the float32 one (its worst leaf, measured on
    # one device): the split step must be no farther from float32 than that, within half as much
    # again, rather than 2e-2 from another bfloat16 rounding.
    exact = reference_for(case, {})
    for step in range(STEPS):
        own = relative_error(reference["grads"][step], exact["grads"][step])
        split = relative_error(run["grads"][step], exact["grads"][step])
        assert split < 1.5 * own, (
            f"step {step}: bfloat16 gradients are {split:.3g} from float32 over tensor, "
            f"{own:.3g} on one device, seed {seed}"
        )


# --------------------------------------------------------------------------------------------
# Which axes each weight's gradient is summed over, for the decoder's real weights


def summed_axes(overrides, mesh, sequence_parallel=False):
    """``{weight path: axes}`` as the step decides them, for ``mesh`` on 8 devices."""
    trainer = dew.Trainer(
        objective_for(overrides),
        optax.sgd(0.1),
        jax.random.key(0),
        mesh=mesh,
        layout=dew.Layout(min_shard=1),
        options=dew.StepOptions(sequence_parallel=sequence_parallel),
    )
    shards = trainer.shards
    partial = trainer.objective.model.partial_over_tensor(shards)
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    specs = jax.tree_util.tree_flatten_with_path(trainer.param_specs, is_leaf=is_spec)[0]
    flags = jax.tree_util.tree_leaves(partial)
    return {
        "/".join(path_names(path)[1:]): sum_axes(spec, shards, partial_over_tensor=flag)
        for (path, spec), flag in zip(specs, flags, strict=True)
    }


NORMS = ("layers/attn_norm/scale", "layers/mlp_norm/scale", "final_norm/scale")
MATRICES = (
    "embed_tokens/embedding",
    "layers/attn/q",
    "layers/attn/k",
    "layers/attn/v",
    "layers/attn/o",
    "layers/mlp/gate",
    "layers/mlp/up",
    "layers/mlp/down",
)


def table(norms, matrices, kv=None):
    expected = {**{w: norms for w in NORMS}, **{w: matrices for w in MATRICES}}
    if kv is not None:
        expected["layers/attn/k"] = expected["layers/attn/v"] = kv
    return expected


# Written by hand from the rule: the token axes (data, fsdp here), minus fsdp for a weight split
# over fsdp (with min_shard=1 every weight is, norm scales included, whenever fsdp > 1), plus
# tensor for the weights partial over tensor: the norm scales under sequence parallelism, k and v
# when there are fewer kv heads than the tensor size.
GRADIENT_SUMS = {
    "data=2,tensor=4": (
        {},
        dew.MeshSpec(tensor=4),
        False,
        table(("data",), ("data",)),
    ),
    "data=2,tensor=4, sequence parallel": (
        {},
        dew.MeshSpec(tensor=4),
        True,
        table(("data", "tensor"), ("data",)),
    ),
    "data=2,tensor=4, 2 kv heads": (
        {"num_kv_heads": 2},
        dew.MeshSpec(tensor=4),
        False,
        table(("data",), ("data",), kv=("data", "tensor")),
    ),
    "tensor=8, 4 kv heads, sequence parallel": (
        {"num_kv_heads": 4},
        dew.MeshSpec(tensor=8),
        True,
        table(("tensor",), (), kv=("tensor",)),
    ),
    "tensor=2,fsdp=4": (
        {},
        dew.MeshSpec(tensor=2, fsdp=4),
        False,
        table((), ()),
    ),
    "data=2,tensor=2,fsdp=2, sequence parallel, 1 kv head": (
        {"num_kv_heads": 1},
        dew.MeshSpec(tensor=2, fsdp=2),
        True,
        table(("data", "tensor"), ("data",), kv=("data", "tensor")),
    ),
}


@pytest.mark.parametrize("name", list(GRADIENT_SUMS))
def test_every_weight_is_summed_over_the_axes_the_rule_names(name):
    overrides, mesh, sequence_parallel, expected = GRADIENT_SUMS[name]
    assert summed_axes(overrides, mesh, sequence_parallel) == expected


# --------------------------------------------------------------------------------------------
# Layout: 2-D splits, and the state per device


def test_default_layout_splits_fsdp_and_tensor_on_different_dimensions():
    trainer = dew.Trainer(
        objective_for({}),
        optax.sgd(0.1),
        jax.random.key(0),
        mesh=dew.MeshSpec(tensor=4, fsdp=2),
        layout=dew.Layout(min_shard=1),
    )
    specs = trainer.param_specs["params"]
    assert specs["embed_tokens"]["embedding"] == P("tensor", "fsdp")
    assert specs["layers"]["attn"]["q"] == P(None, "fsdp", "tensor")
    assert specs["layers"]["attn"]["o"] == P(None, "tensor", None, "fsdp")
    assert specs["layers"]["mlp"]["up"] == P(None, "fsdp", "tensor")
    assert specs["layers"]["mlp"]["down"] == P(None, "tensor", "fsdp")
    # min_shard does not keep a small weight off tensor: the model computes on the split.
    small = dew.Layout(min_shard=10**9).specs(
        trainer.mesh,
        jax.eval_shape(trainer.objective.model.init, jax.random.key(0)),
        trainer.objective.model.logical_axes(),
    )
    assert small["params"]["layers"]["mlp"]["up"] == P(None, None, "tensor")
    assert small["params"]["layers"]["attn_norm"]["scale"] == P()


def test_tensor8_holds_an_eighth_of_the_data_parallel_state():
    # A model whose matrices dominate, as real ones do: the norm scales (replicated over tensor)
    # are 0.3% of it.
    objective = LMObjective(
        dew.models.build(
            "causal_transformer",
            vocab_size=256,
            emb_features=128,
            num_layers=2,
            num_heads=8,
            max_seq_len=16,
        ),
        16,
    )

    def state_bytes(mesh):
        trainer = dew.Trainer(objective, optax.adamw(1e-3), jax.random.key(0), mesh=mesh)
        state = trainer.init_state()
        return state_bytes_per_device(state)

    whole, split = state_bytes(dew.MeshSpec()), state_bytes(dew.MeshSpec(tensor=8))
    assert split <= (1 / 8 + 0.03) * whole, (split, whole, split / whole)
    # And not by leaving something out: 1/8 of the state is the least a device can hold.
    assert split >= whole / 8, (split, whole)


def test_checkpoint_written_under_fsdp_restores_into_a_tensor_layout(tmp_path, seed):
    objective = objective_for({})
    key = seeded_key(seed)
    saver = dew.Trainer(
        objective,
        smooth_optimizer(),
        key,
        mesh=dew.MeshSpec(fsdp=8),
        layout=dew.Layout(min_shard=1),
        checkpoints=dew.Checkpoints(tmp_path / "run"),
    )
    state = saver.init_state()
    state, _ = saver.train_step(ROWS)(state, saver.device_batch(fresh_batch(ROWS, seed), ROWS))
    saver.save(state)
    saver.checkpoints.wait()
    loader = dew.Trainer(
        objective,
        smooth_optimizer(),
        key,
        mesh=dew.MeshSpec(tensor=4, fsdp=2),
        layout=dew.Layout(min_shard=1),
        checkpoints=dew.Checkpoints(tmp_path / "run"),
    )
    restored, _, _ = loader.place()
    assert int(restored.step) == 1
    for saved, got in zip(
        jax.tree_util.tree_leaves((state.params, state.opt_state)),
        jax.tree_util.tree_leaves((restored.params, restored.opt_state)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(saved), err_msg=f"seed {seed}")
    assert restored.params["params"]["layers"]["mlp"]["up"].sharding.spec == P(
        None, "fsdp", "tensor"
    )


# --------------------------------------------------------------------------------------------
# Clear errors, before compiling


def trainer(overrides=None, mesh=dew.MeshSpec(tensor=4), **kwargs):
    return dew.Trainer(
        tiny_objective(**(overrides or {})),
        optax.sgd(0.1),
        jax.random.key(0),
        mesh=mesh,
        **kwargs,
    )


@pytest.mark.parametrize(
    "overrides, mesh, message",
    [
        ({}, dew.MeshSpec(tensor=8), "num_heads 4 does not split over tensor 8"),
        (
            {"num_heads": 6, "emb_features": 36},
            dew.MeshSpec(tensor=4),
            "num_heads 6 does not split over tensor 4",
        ),
        (
            {"num_heads": 8, "num_kv_heads": 8, "mlp_features": 100},
            dew.MeshSpec(tensor=8),
            "mlp_features 100 does not split over tensor 8",
        ),
        (
            {"vocab_size": 50, "num_heads": 8},
            dew.MeshSpec(tensor=4),
            "vocab_size 50 does not split over tensor 4; the vocabulary is not padded: use a "
            "vocab_size such as 52",
        ),
        (
            {"num_heads": 12, "emb_features": 48, "num_kv_heads": 6},
            dew.MeshSpec(tensor=4),
            r"num_kv_heads 6 does not split over tensor 4 \(nor divide it",
        ),
    ],
)
def test_sizes_that_do_not_split_over_tensor(overrides, mesh, message):
    with pytest.raises(ValueError, match=message):
        trainer(overrides, mesh)


def test_sequence_parallel_needs_positions_that_split():
    with pytest.raises(ValueError, match="seq_len 12 does not split over tensor 8"):
        dew.Trainer(
            LMObjective(
                dew.models.build(
                    "causal_transformer",
                    vocab_size=64,
                    emb_features=64,
                    num_layers=1,
                    num_heads=8,
                    max_seq_len=24,
                ),
                12,
            ),
            optax.sgd(0.1),
            jax.random.key(0),
            mesh=dew.MeshSpec(tensor=8),
            options=dew.StepOptions(sequence_parallel=True),
        )


def test_a_layout_that_leaves_heads_whole_is_refused():
    rules = [r for r in dew.layout.DEFAULT_RULES if r != ("heads", "tensor")]
    with pytest.raises(ValueError, match=r"weight params/layers/attn/o .*'heads' dimension whole"):
        trainer(layout=dew.Layout(rules=rules))


def test_a_layout_that_splits_the_width_over_tensor_is_refused():
    rules = [*dew.layout.DEFAULT_RULES, ("embed", "tensor")]
    with pytest.raises(ValueError, match=r"splits its 'embed' dimension over 'tensor'"):
        trainer(layout=dew.Layout(rules=rules))


def test_gspmd_engine_takes_any_layout_on_a_tensor_mesh(seed):
    # The baseline lets XLA partition whatever the layout says, so it needs no Megatron split.
    rules = [r for r in dew.layout.DEFAULT_RULES if r[1] != "tensor"]
    t = trainer({"num_heads": 8}, layout=dew.Layout(rules=rules, min_shard=1), engine="gspmd")
    state = t.init_state()
    _, metrics = t.train_step(16)(state, t.device_batch(fresh_batch(16, seed), 16))
    assert np.isfinite(float(metrics["loss"])), seed
