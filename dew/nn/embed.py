"""Token embedding table, also used (transposed) as the output head when tied.

The lookup and the head's matmul are ``dew.parallel.tensor.embed_lookup`` and ``vocab_logits``,
which split the table's rows over ``tensor`` and are the plain ``take`` and matmul on one device.
"""

from dew.nn.param import Param, normal


def embed_params(vocab: int, features: int) -> dict:
    # Standard deviation 1/sqrt(features): as the (tied) output head it gives logits of unit scale
    # on normalized inputs (measured against GPT-2's 0.02: docs/results/cpu-layouts.md,
    # "Choices in the model").
    return {"embedding": Param((vocab, features), ("vocab", "embed"), normal(features**-0.5))}
