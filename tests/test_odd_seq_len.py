"""``seq_len`` must split into zigzag chunks (2 x sequence) only where a sequence axis splits the
rows: an odd length trains on one device and on the other axes, its loss the cross-entropy
written from the formula; on a sequence axis it is refused, naming the numbers."""

import jax
import numpy as np
import optax
import pytest

import dew
from dew.objectives.lm import LMObjective

SEQ = 37
VOCAB = 64
ROWS = 8


def objective():
    model = dew.models.build(
        "causal_transformer",
        vocab_size=VOCAB,
        emb_features=32,
        num_layers=1,
        num_heads=2,
        max_seq_len=SEQ,
    )
    return LMObjective(model, SEQ)


def reference_loss(model, params, rows) -> float:
    """Mean cross-entropy of each next token, in float64, from the model's logits."""
    logits = np.asarray(jax.jit(model.apply)(params, rows[:, :-1]), np.float64)
    logits -= logits.max(-1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    targets = rows[:, 1:]
    return float(-np.take_along_axis(log_probs, targets[..., None], -1).mean())


@pytest.mark.parametrize(
    "mesh, devices", [(dew.MeshSpec(), 1), (dew.MeshSpec(data=2, fsdp=4), 8)], ids=["one", "d2f4"]
)
def test_an_odd_seq_len_trains_off_a_sequence_axis(mesh, devices, seed):
    print(f"seed {seed}")
    rows = np.random.default_rng(seed).integers(0, VOCAB, (ROWS, SEQ + 1)).astype(np.int32)
    trainer = dew.Trainer(
        objective(), optax.sgd(0.1), jax.random.key(seed % 1000), mesh=mesh,
        layout=dew.Layout(min_shard=1), devices=jax.devices()[:devices],
    )  # fmt: skip
    state = trainer.init_state()
    want = reference_loss(trainer.objective.model, jax.device_get(state.params), rows)
    _, metrics = trainer.train_step(ROWS)(state, trainer.device_batch(rows, ROWS))
    loss = float(metrics["loss"])
    assert abs(loss - want) <= 1e-5 * abs(want), (loss, want)


def test_an_odd_seq_len_is_refused_on_a_sequence_axis():
    with pytest.raises(ValueError, match="seq_len 37 does not split into 2 x sequence 2 = 4"):
        dew.Trainer(objective(), optax.sgd(0.1), jax.random.key(0), mesh=dew.MeshSpec(sequence=2))
