"""Only one layer's gathered weights are alive at a time: the backward gathers again instead of
keeping what the forward gathered (docs/design.md), checked on the compiled step's
memory_analysis()."""

import jax
import optax

import dew
from dew.objectives.lm import LMObjective

WIDTH, SEQ, ROWS = 128, 32, 16


def temp_bytes(layers):
    model = dew.models.build(
        "causal_transformer",
        vocab_size=256,
        emb_features=WIDTH,
        num_layers=layers,
        num_heads=4,
        max_seq_len=SEQ,
    )
    trainer = dew.Trainer(
        LMObjective(model, SEQ),
        optax.sgd(0.1),
        jax.random.key(0),
        mesh=dew.MeshSpec(fsdp=8),
        layout=dew.Layout(min_shard=1),
    )
    compiled = trainer.compiled_step(ROWS)
    return compiled.memory_analysis().temp_size_in_bytes


def test_gathered_weights_are_not_kept_for_the_backward():
    whole_layer_bytes = 4 * (4 * WIDTH * WIDTH + 3 * WIDTH * 4 * WIDTH + 2 * WIDTH)  # float32
    per_layer = (temp_bytes(8) - temp_bytes(2)) / 6
    # Kept gathered weights would add a whole layer (1 MiB) per layer; what a layer must keep is its
    # input activations (2 rows x 32 x 128 floats = 32 KiB here) and its gradient shard (1/8 layer).
    assert per_layer < 0.4 * whole_layer_bytes, (per_layer, whole_layer_bytes)
