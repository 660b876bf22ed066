"""Next-token prediction: mean cross-entropy of every position of every row of the batch."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from dew.checks import positive_int
from dew.nn.moe import RouterStats
from dew.parallel import ONE_DEVICE, Shards


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

    @property
    def _moe(self) -> bool:
        return bool(getattr(self.model, "num_experts", 0))

    def _aux(self, stats: RouterStats):
        """The statistics the step sums for this objective: the MoE layers' ``RouterStats``, or
        nothing (``{}``) for a dense model, so that only the loss travels."""
        return stats if self._moe else {}

    def loss_sum(self, params, batch: jax.Array, shards: Shards = ONE_DEVICE):
        """``(loss_sum, aux)`` of ``batch``'s rows and positions: ``token_loss_sum`` on the
        shifted batch.

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
    ):
        """``(loss_sum, aux)``: the loss of predicting ``targets`` from ``inputs``, summed over
        tokens (float32 scalar), and the statistics the step sums over devices without reading
        them: the MoE layers' ``RouterStats``, ``{}`` for a dense model (``metrics`` reads them).

        The loss is the cross-entropy's sum plus, for an MoE model, ``tokens x (router_aux_weight
        x load balance + router_z_weight x z-loss)`` with ``tokens`` the microbatch's token count
        (this device's share of it: see ``dew.nn.moe``), so that dividing by the token count gives
        the mean cross-entropy plus the weighted router losses.

        ``inputs`` and ``targets``: ``[rows, positions]`` integer tokens, already shifted (target
        ``j`` follows input ``j``); ``positions``: their global positions in the row, ``[n]`` (all
        of them in order for whole rows; this device's chunks under a ``sequence`` split).

        The model runs as its parts (embed, blocks, then the head and the cross-entropy in
        ``head_loss_sum``), each on this device's slice of the vocabulary where a layout splits
        it (over tensor, or over fsdp: ``dew.parallel.vocabulary``).
        """
        model = self.model
        params, shards = model.share_embedding(params, shards, inputs.size)
        x = model.embed(params, inputs, shards)
        x, stats = model.blocks(params, x, positions, shards)
        loss = model.head_loss_sum(params, x, targets, shards)
        return loss + self.router_loss(stats), self._aux(stats)

    def router_loss(self, stats: RouterStats) -> jax.Array:
        """The weighted router losses ``token_loss_sum`` adds for an MoE model (0 when dense):
        ``router_aux_weight x load balance + router_z_weight x z-loss``, as sums over tokens."""
        model = self.model
        if not self._moe:
            return jnp.zeros((), jnp.float32)
        return model.router_aux_weight * stats.load_balance + model.router_z_weight * stats.z_loss

    def metrics(self, loss: jax.Array, aux, tokens: int) -> dict:
        """What a training step reports, from its mean ``loss`` and the ``aux`` of its ``tokens``
        tokens summed over every device: ``{"loss": ...}`` and, for an MoE model, the router
        losses (each a mean over the MoE layers and the tokens) and the fraction of token copies
        the capacity dropped."""
        metrics = {"loss": loss}
        if self._moe:
            metrics["load_balance_loss"] = aux.load_balance / tokens
            metrics["router_z_loss"] = aux.z_loss / tokens
            metrics["dropped_fraction"] = aux.dropped / jnp.maximum(aux.routed, 1.0)
        return metrics

    def evaluation_metrics(self, loss: jax.Array, aux, tokens: int) -> dict:
        """``metrics`` for validation: ``"loss"`` is the language model's cross-entropy alone,
        comparable with a dense model's, and an MoE model's router losses are reported beside
        it rather than folded in (the training loss minus the weighted router losses)."""
        metrics = self.metrics(loss, aux, tokens)
        if self._moe:
            metrics["loss"] = loss - self.router_loss(aux) / tokens
        return metrics

    def stage_loss_sum(
        self,
        params,
        x_in: jax.Array,
        inputs: jax.Array,
        targets: jax.Array,
        positions: jax.Array,
        shards: Shards,
        stage_axis: str = "stage",
    ):
        """One pipeline stage's part of ``token_loss_sum``: ``(y, loss_sum, aux)``.

        Stage ``s`` of ``S`` (``lax.axis_index(stage_axis)``) runs ``blocks`` on the layers it
        holds, after ``embed(inputs)`` on stage 0 (``x_in`` elsewhere, the activation from stage
        ``s - 1``, ``[rows, positions, embed]`` in the activations' dtype) and before the head and
        the cross-entropy on stage ``S - 1``. ``y``: the blocks' output, for stage ``s + 1``;
        ``loss_sum``: the cross-entropy's sum (last stage; 0 elsewhere) plus the router losses of
        this stage's MoE layers; ``aux``: their ``RouterStats`` (``{}`` when dense). Summed over
        the stages, the losses and ``aux`` are ``token_loss_sum``'s.

        The embedding table is gathered where it is read (stage 0 for the lookup, stage ``S - 1``
        for a tied head), not shared as ``token_loss_sum`` shares it: no stage reads it twice.
        """
        model = self.model
        stage = lax.axis_index(stage_axis)
        last = lax.axis_size(stage_axis) - 1
        x = lax.cond(stage == 0, lambda: model.embed(params, inputs, shards), lambda: x_in)
        y, stats = model.blocks(params, x, positions, shards)

        def cross_entropy():
            return model.head_loss_sum(params, y, targets, shards)

        loss = lax.cond(stage == last, cross_entropy, lambda: jnp.zeros((), jnp.float32))
        return y, loss + self.router_loss(stats), self._aux(stats)

    def loss(self, params, batch: jax.Array) -> jax.Array:
        """The mean loss of ``batch`` on one device (cross-entropy, plus the weighted router
        losses of an MoE model): the reference every layout must reproduce."""
        return self.loss_sum(params, batch)[0] / (batch.shape[0] * self.seq_len)
