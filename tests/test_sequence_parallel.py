"""The sequence axis in the training step (its layouts' equivalence with one device is in
tests/test_equivalence.py's table): evaluation gives the one-device loss, what cannot be split is
refused before compiling, and a long context takes a fraction of one device's memory.

The reference is the plain one-device loss (no mesh, no shard_map, no Trainer), on the module's
fresh seed (tests/conftest.py; replay with ``DEW_SEED``). The ring and
all-to-all functions themselves are tested against plain attention in tests/test_sequence_ops.py.
"""

import jax
import numpy as np
import optax
import pytest

import dew
from dew.objectives.lm import LMObjective
from dew.training.step import build_loss
from tests.equivalence import (
    ROWS,
    layout_case,
)
from tests.helpers import SEQ, tiny_objective


@pytest.fixture(scope="module")
def case(module_seed):
    return layout_case(module_seed)


def test_validation_loss_matches_one_device(case, seed):
    key, batches, _ = case
    objective = tiny_objective()
    trainer = dew.Trainer(objective, optax.sgd(0.1), key, mesh=dew.MeshSpec(sequence=4))
    state = trainer.init_state()
    params = jax.tree_util.tree_map(np.asarray, state.params)
    loss = build_loss(objective, trainer.mesh, trainer.shards, global_rows=ROWS)
    got = float(loss(state.params, trainer.device_batch(batches[0], ROWS))[0])
    want = float(objective.loss(params, batches[0]))
    np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=f"seed {seed}")


# --------------------------------------------------------------------------------------------
# Memory: a long context in a fraction of one device's temporary memory


def temp_bytes(mesh, devices, seq_len=4096, rows=8):
    model = dew.models.build(
        "causal_transformer",
        vocab_size=256,
        emb_features=64,
        num_layers=2,
        num_heads=4,
        max_seq_len=seq_len,
    )
    trainer = dew.Trainer(
        LMObjective(model, seq_len),
        optax.sgd(0.1),
        jax.random.key(0),
        mesh=mesh,
        devices=devices,
    )
    compiled = trainer.compiled_step(rows)
    return compiled.memory_analysis().temp_size_in_bytes


def test_sequence8_needs_a_sixth_of_one_devices_temporary_memory():
    one = temp_bytes(dew.MeshSpec(), jax.devices()[:1])
    split = temp_bytes(dew.MeshSpec(sequence=8), None)
    print(
        f"temporary memory per device: one device {one / 2**20:.1f} MiB, sequence=8 "
        f"{split / 2**20:.1f} MiB ({split / one:.3f})"
    )
    assert split <= one / 6, (split, one, split / one)


# --------------------------------------------------------------------------------------------
# Clear errors, before compiling


def trainer(overrides=None, mesh=dew.MeshSpec(sequence=4), seq_len=SEQ, **kwargs):
    config = dict(vocab_size=64, emb_features=32, num_layers=1, num_heads=4, max_seq_len=64)
    config.update(overrides or {})
    return dew.Trainer(
        LMObjective(dew.models.build("causal_transformer", **config), seq_len),
        optax.sgd(0.1),
        jax.random.key(0),
        mesh=mesh,
        **kwargs,
    )


def test_seq_len_must_cut_into_two_chunks_per_device():
    with pytest.raises(ValueError, match=r"seq_len 12 does not split into 2 x sequence 4 = 8"):
        trainer(seq_len=12)


def test_all_to_all_needs_heads_that_split_over_sequence_and_tensor():
    with pytest.raises(
        ValueError,
        match=r"num_heads 4 \(2 per device over tensor 2\) does not split over sequence 4",
    ):
        trainer(
            mesh=dew.MeshSpec(sequence=4, tensor=2),
            options=dew.StepOptions(sequence_scheme="all_to_all"),
        )
    with pytest.raises(
        ValueError,
        match=r"num_kv_heads 2 \(2 per device over tensor 1\) does not split over sequence 4",
    ):
        trainer({"num_kv_heads": 2}, options=dew.StepOptions(sequence_scheme="all_to_all"))
    # The ring takes any number of heads.
    trainer({"num_kv_heads": 2}, mesh=dew.MeshSpec(sequence=4, tensor=2))


def test_unknown_sequence_scheme():
    with pytest.raises(
        ValueError, match=r"unknown sequence_scheme 'ulysses'; expected one of ring, all_to_all"
    ):
        dew.StepOptions(sequence_scheme="ulysses")


def test_a_context_longer_than_the_model_is_refused():
    with pytest.raises(ValueError, match=r"seq_len 128 is above the model's max_seq_len 64"):
        trainer(seq_len=128)
