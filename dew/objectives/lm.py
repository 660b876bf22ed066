"""Next-token prediction: mean cross-entropy of every position of every row of the batch, or, for
a batch with a loss mask, of the positions the mask keeps.

A batch is ``[rows, seq_len + 1]`` int tokens, or ``[rows, 2, seq_len + 1]``: the tokens at
``[:, 0]`` and their loss mask at ``[:, 1]`` (``dew.data``: 1 where predicting the token counts).
Target ``j`` of a row is token ``j + 1``, so its mask is ``batch[:, 1, j + 1]``.

Packed documents: ``[rows, 3, seq_len + 1]`` adds each token's document id at ``[:, 2]``
(``dew.data``'s ``documents="separate"``: ids that change where a document starts). A document
starts wherever the id changes (``document_starts``: ids that come back start another document).
Then a token attends only to earlier tokens of its own document (the model's ``segment_ids``,
``document_segments``: the starts counted along the row), its rotary position counts from its
document's first token in the row (``document_positions``), and target ``j`` counts only when
token ``j + 1`` is in token ``j``'s document: a document's last token (its end-of-text id) never
predicts the next document's first (``split_batch``, which makes all three from the starts).

Masked mean: the loss divides by the global count ``n`` of unmasked targets, not by
``rows x seq_len``. The step keeps its one divisor, ``N = rows x seq_len`` of the global batch,
and weighs each target's cross-entropy by ``mask x N / n`` (``loss_weights``): then
``sum(weights x ce) / N = sum(mask x ce) / n``, the mean over unmasked targets, whatever the layout
and the accumulation (``n`` is counted over the whole global batch before any microbatch runs),
and an MoE model's router losses stay means over every token, prompt tokens included (they are
routed too). A batch without an unmasked target has loss 0 (``n`` is taken as at least 1).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from dew.checks import positive_int
from dew.nn.moe import RouterStats
from dew.parallel import ONE_DEVICE, Shards


def split_batch(batch: jax.Array) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """``(tokens [rows, seq_len + 1], target mask [rows, seq_len] or None, the inputs' segment
    ids [rows, seq_len] or None)`` of a batch of one of the module's three shapes; ValueError for
    any other. With document ids, target ``j``'s mask is also 0 where token ``j + 1`` starts
    another document than token ``j``'s: the loss never predicts across a boundary. The segment
    ids are ``document_segments`` of the document ids: what attention, the rotary positions and
    the loss all read, on every path, so that they agree on where each document starts."""
    if batch.ndim == 2:
        return batch, None, None
    if batch.ndim == 3 and batch.shape[1] == 2:
        return batch[:, 0], batch[:, 1, 1:], None
    if batch.ndim == 3 and batch.shape[1] == 3:
        starts = document_starts(batch[:, 2])
        same = 1 - starts[:, 1:].astype(batch.dtype)
        return batch[:, 0], batch[:, 1, 1:] * same, _segments(starts)[:, :-1]
    raise ValueError(
        f"a batch is [rows, seq_len + 1] tokens, [rows, 2, seq_len + 1] tokens and loss mask, or "
        f"[rows, 3, seq_len + 1] tokens, loss mask and document ids; got shape {batch.shape}"
    )


def document_starts(documents: jax.Array) -> jax.Array:
    """bool ``[..., seq]``: where a document starts in each row of document ids ``[..., seq]``
    (in row order): the row's first token, and every token whose id differs from the one before.
    Ids that come back (``[0, 0, 1, 1, 0, 0]``) start a third document, not the first again."""
    first = jnp.ones(documents.shape[:-1] + (1,), bool)
    return jnp.concatenate([first, documents[..., 1:] != documents[..., :-1]], axis=-1)


def _segments(starts: jax.Array) -> jax.Array:
    return jnp.cumsum(starts, axis=-1, dtype=jnp.int32) - 1


def document_segments(documents: jax.Array) -> jax.Array:
    """int32 ``[..., seq]``: each token's document as attention sees it (a query attends only to
    keys of its own id): 0 for a row's first document, one more at each of ``document_starts``.
    Equal ids then mean the same document, as the positions and the loss mask take it
    (``[0, 0, 1, 1, 0, 0]`` gives ``[0, 0, 1, 1, 2, 2]``; ``dew.data``'s ids already are so)."""
    return _segments(document_starts(documents))


def document_positions(documents: jax.Array) -> jax.Array:
    """int32 ``[rows, seq]``: each token's position within its document in the row, counted from
    0 at the document's first token there (``document_starts``), from the document ids
    ``[rows, seq]`` of the tokens in row order."""
    seq = documents.shape[-1]
    index = jnp.arange(seq, dtype=jnp.int32)
    starts = document_starts(documents)
    first = lax.cummax(jnp.where(starts, index, 0), axis=documents.ndim - 1)
    return index - first


def loss_weights(target_mask: jax.Array, count: jax.Array, total: int) -> jax.Array:
    """float32 weights ``mask x total / max(count, 1)`` of targets whose ``target_mask`` (0 or 1,
    any shape) has ``count`` ones over the whole global batch of ``total`` targets: with them,
    the weighted loss sum over ``total`` is the mean over the unmasked targets (module doc)."""
    scale = jnp.float32(total) / jnp.maximum(count, 1).astype(jnp.float32)
    return target_mask.astype(jnp.float32) * scale


@dataclasses.dataclass(frozen=True)
class LMObjective:
    """The loss of a causal language model on windows of ``seq_len + 1`` tokens.

    Args:
      model: a model with ``init(key)``, ``share_embedding(params, shards)``,
        ``embed(params, tokens, shards)``, ``blocks(params, x, positions, shards)``,
        ``head(params, x, shards)``, ``logical_axes()`` and ``max_seq_len`` (``CausalTransformer``).
      seq_len: positions predicted per row; a batch is ``[rows, seq_len + 1]`` token ids, or
        ``[rows, 2, seq_len + 1]`` tokens and their loss mask (the module's doc).
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

    def loss_sum(
        self,
        params,
        batch: jax.Array,
        shards: Shards = ONE_DEVICE,
        weights: jax.Array | None = None,
        documents: jax.Array | None = None,
    ):
        """``(loss_sum, aux)`` of ``batch``'s rows and positions: ``token_loss_sum`` on the
        shifted batch.

        ``batch``: ``[rows, seq_len + 1]`` integer tokens, whole rows. Divide by the global number
        of predicted tokens for the mean; summing first lets devices add up their parts exactly.
        ``weights``: ``None``, or float32 ``[rows, seq_len]`` multipliers of each target's loss
        (``loss_weights`` of the batch's mask). ``documents``: ``None``, or the inputs' segment
        ids ``[rows, seq_len]`` (``split_batch``'s; any document ids are taken as
        ``document_segments`` of them): attention stays in each document and rotary positions
        restart at each (``document_positions``).
        """
        inputs, targets = batch[:, :-1], batch[:, 1:]
        if documents is None:
            positions = jnp.arange(inputs.shape[1])
        else:  # (split_batch's ids are unchanged by this: the same starts)
            documents = document_segments(documents)
            positions = document_positions(documents)
        return self.token_loss_sum(
            params, inputs, targets, positions, shards, weights, segment_ids=documents
        )

    def token_loss_sum(
        self,
        params,
        inputs: jax.Array,
        targets: jax.Array,
        positions: jax.Array,
        shards: Shards = ONE_DEVICE,
        weights: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
    ):
        """``(loss_sum, aux)``: the loss of predicting ``targets`` from ``inputs``, summed over
        tokens (float32 scalar), and the statistics the step sums over devices without reading
        them: the MoE layers' ``RouterStats``, ``{}`` for a dense model (``metrics`` reads them).
        ``weights``: ``None`` (every token's cross-entropy counts once) or float32 ``[rows,
        positions]``, each token's cross-entropy times its weight (the router losses are not
        weighted).

        The loss is the cross-entropy's sum plus, for an MoE model, ``tokens x (router_aux_weight
        x load balance + router_z_weight x z-loss)`` with ``tokens`` the microbatch's token count
        (this device's share of it: see ``dew.nn.moe``), so that dividing by the token count gives
        the mean cross-entropy plus the weighted router losses.

        ``inputs`` and ``targets``: ``[rows, positions]`` integer tokens, already shifted (target
        ``j`` follows input ``j``); ``positions``: their rotary positions, ``[n]`` for every row
        alike (all of them in order for whole rows; this device's chunks under a ``sequence``
        split) or ``[rows, n]`` per row (packed documents: ``document_positions``);
        ``segment_ids``: ``None``, or int32 ``[rows, n]`` segment ids of the inputs
        (``document_segments``, as ``split_batch`` makes them, then ordered and split as the
        inputs): a token attends only to tokens of its own id.

        The model runs as its parts (embed, blocks, then the head and the cross-entropy in
        ``head_loss_sum``), each on this device's slice of the vocabulary where a layout splits
        it (over tensor, or over fsdp: ``dew.parallel.vocabulary``).
        """
        model = self.model
        params, shards = model.share_embedding(params, shards, inputs.size)
        x = model.embed(params, inputs, shards)
        x, stats = self._blocks(params, x, positions, shards, segment_ids)
        loss = self._head_loss_sum(params, x, targets, shards, weights)
        return loss + self.router_loss(stats), self._aux(stats)

    def _blocks(self, params, x, positions, shards, segment_ids):
        if segment_ids is None:  # the model's call exactly as without documents
            return self.model.blocks(params, x, positions, shards)
        return self.model.blocks(params, x, positions, shards, segment_ids=segment_ids)

    def _head_loss_sum(self, params, x, targets, shards, weights):
        if weights is None:  # unmasked: the model's call exactly as without masks
            return self.model.head_loss_sum(params, x, targets, shards)
        return self.model.head_loss_sum(params, x, targets, shards, weights=weights)

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
        weights: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
    ):
        """One pipeline stage's part of ``token_loss_sum``: ``(y, loss_sum, aux)``; ``weights``
        as ``token_loss_sum`` takes them (read by the last stage, with the targets), and
        ``positions`` and ``segment_ids`` too.

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
        y, stats = self._blocks(params, x, positions, shards, segment_ids)

        def cross_entropy():
            return self._head_loss_sum(params, y, targets, shards, weights)

        loss = lax.cond(stage == last, cross_entropy, lambda: jnp.zeros((), jnp.float32))
        return y, loss + self.router_loss(stats), self._aux(stats)

    def loss(self, params, batch: jax.Array) -> jax.Array:
        """The mean loss of ``batch`` on one device (cross-entropy, plus the weighted router
        losses of an MoE model): the reference every layout must reproduce. With a loss mask the
        cross-entropy is the mean over the unmasked targets (the module's doc)."""
        tokens, mask, documents = split_batch(batch)
        total = tokens.shape[0] * self.seq_len
        weights = None if mask is None else loss_weights(mask, jnp.sum(mask), total)
        return self.loss_sum(params, tokens, weights=weights, documents=documents)[0] / total
