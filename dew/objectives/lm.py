"""Next-token prediction: mean cross-entropy of every position of every row of the batch."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dew.checks import positive_int
from dew.parallel import ONE_DEVICE, Shards, tensor


@dataclasses.dataclass(frozen=True)
class LMObjective:
    """The loss of a causal language model on windows of ``seq_len + 1`` tokens.

    Args:
      model: a model with ``init(key)``, ``share_embedding(params, shards)``,
        ``embed(params, tokens, shards)``, ``blocks(params, x, positions, shards)``,
        ``head(params, x, shards)``, ``logical_axes()`` and ``max_seq_len`` (``CausalTransformer``).
      seq_len: positions predicted per row; a batch is ``[rows, seq_len + 1]`` token ids.
      ema_decay: ``None``, or a float in ``[0, 1)``: the train state then keeps
        ``ema = decay * ema + (1 - decay) * params`` after every step.
    """

    model: object
    seq_len: int
    ema_decay: float | None = None

    def __post_init__(self):
        positive_int("seq_len", self.seq_len)
        if self.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"seq_len {self.seq_len} is above the model's max_seq_len {self.model.max_seq_len}"
            )
        if self.ema_decay is not None and not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"ema_decay must be None or in [0, 1), got {self.ema_decay!r}")

    def tokens_per_row(self) -> int:
        return self.seq_len

    def loss_sum(self, params, batch: jax.Array, shards: Shards = ONE_DEVICE) -> jax.Array:
        """Sum over ``batch``'s rows and positions of the cross-entropy (float32 scalar).

        ``batch``: ``[rows, seq_len + 1]`` integer tokens, whole rows. Divide by the global number
        of predicted tokens for the mean; summing first lets devices add up their parts exactly.
        """
        inputs, targets = batch[:, :-1], batch[:, 1:]
        return self.token_loss_sum(params, inputs, targets, jnp.arange(inputs.shape[1]), shards)

    def token_loss_sum(
        self,
        params,
        inputs: jax.Array,
        targets: jax.Array,
        positions: jax.Array,
        shards: Shards = ONE_DEVICE,
    ) -> jax.Array:
        """Sum of the cross-entropy of predicting ``targets`` from ``inputs`` (float32 scalar).

        ``inputs`` and ``targets``: ``[rows, positions]`` integer tokens, already shifted (target
        ``j`` follows input ``j``); ``positions``: their global positions in the row, ``[n]`` (all
        of them in order for whole rows; this device's chunks under a ``sequence`` split).

        The model runs as its parts (embed, blocks, head) and the cross-entropy is
        ``dew.parallel.tensor.cross_entropy``, which takes this device's slice of the vocabulary's
        logits (all of it while the tensor axis has size 1).
        """
        model = self.model
        params, shards = model.share_embedding(params, shards)
        x = model.embed(params, inputs, shards)
        x = model.blocks(params, x, positions, shards)
        logits = model.head(params, x, shards)
        return jnp.sum(tensor.cross_entropy(logits, targets, shards))

    def loss(self, params, batch: jax.Array) -> jax.Array:
        """Mean cross-entropy of ``batch`` on one device: the reference every layout must
        reproduce."""
        return self.loss_sum(params, batch) / (batch.shape[0] * self.seq_len)
