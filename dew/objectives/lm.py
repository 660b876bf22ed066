"""Next-token prediction: mean cross-entropy of every position of every row of the batch."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dew.checks import positive_int
from dew.parallel import ONE_DEVICE, Shards


@dataclasses.dataclass(frozen=True)
class LMObjective:
    """The loss of a causal language model on windows of ``seq_len + 1`` tokens.

    Args:
      model: a model with ``init(key)``, ``apply(params, tokens, shards)``, ``logical_axes()`` and
        ``max_seq_len``.
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

        ``batch``: ``[rows, seq_len + 1]`` integer tokens. Divide by the global number of predicted
        tokens for the mean; summing first lets devices add up their parts exactly.
        """
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits = self.model.apply(params, inputs, shards)
        log_z = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
        return jnp.sum(log_z - picked)

    def loss(self, params, batch: jax.Array) -> jax.Array:
        """Mean cross-entropy of ``batch`` on one device: the reference every layout must
        reproduce."""
        return self.loss_sum(params, batch) / (batch.shape[0] * self.seq_len)
