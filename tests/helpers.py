"""Small builders shared by the tests."""

import jax
import numpy as np
import optax

import dew
from dew.objectives.lm import LMObjective

SEQ = 16
VOCAB = 64


def tiny_objective(ema_decay=None, **overrides):
    config = dict(vocab_size=VOCAB, emb_features=32, num_layers=2, num_heads=4, max_seq_len=SEQ)
    config.update(overrides)
    return LMObjective(dew.models.build("causal_transformer", **config), SEQ, ema_decay=ema_decay)


def fresh_batch(rows, seed=None, vocab=VOCAB, seq=SEQ):
    """Random tokens drawn fresh each run (the seed is printed by pytest on failure via the assert)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, (rows, seq + 1)).astype(np.int32)


def relative_error(actual, expected) -> float:
    """The largest, over the leaves, of ||actual - expected|| / ||expected||."""
    worst = 0.0
    for a, e in zip(
        jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected), strict=True
    ):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        assert a.shape == e.shape, (a.shape, e.shape)
        worst = max(worst, float(np.linalg.norm(a - e) / max(np.linalg.norm(e), 1e-30)))
    return worst


def smooth_optimizer():
    """Momentum SGD with weight decay: an update that is a smooth function of the gradient. (Adam's
    first steps are close to sign(g), which turns float32 rounding of a near-zero gradient element
    into a full-size difference of the update, in any two correct implementations alike.)"""
    return optax.chain(optax.add_decayed_weights(1e-2), optax.sgd(0.1, momentum=0.9))


def two_process_trainer(mesh, checkpoint_dir=None):
    """The trainer of tests/test_multiprocess.py, built alike in its two processes and in the
    one-process run it is compared with."""
    import dew

    return dew.Trainer(
        tiny_objective(),
        smooth_optimizer(),
        jax.random.key(5),
        mesh=mesh,
        layout=dew.Layout(min_shard=1),
        checkpoints=None if checkpoint_dir is None else dew.Checkpoints(checkpoint_dir),
    )
