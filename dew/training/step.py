"""The training step, in three engines built from the same model, loss and optimizer.

``shard_map`` (the default): the forward and backward run inside one ``jax.shard_map`` over the
whole mesh, on each device's local shards, and every byte between devices is a collective written in
``dew.parallel``:

    fsdp.gather          all_gathers of a layer's split weights (small ones bucketed, per dtype)
                         just before the layer runs, and again in its recomputed backward (on a
                         3-D TPU torus that fsdp fills, rings of ppermutes: Shards.fsdp_ring)
    (its transpose)      one psum_scatter of those weights' gradients over fsdp (the ring
                         reduce-scatter where the gather is a ring; two psum_scatters over
                         groups of the axis with Shards.fsdp_scatter_stages), then, in the layer
                         loop where each layer runs once a step, a psum of each shard over data
                         (Shards.loop_sums)
    tensor.enter/leave   Megatron's pairs around attention and the MLP (psum over tensor, or
                         all_gather / psum_scatter with sequence-parallel activations), and the
                         vocabulary-parallel embedding, head and loss (psum and pmax of
                         [rows, seq]-sized values, never the logits)
    sequence.attention   over a sequence axis, ring attention (ppermute of K/V blocks, and of
                         their gradients in the backward) or the all-to-all scheme
    expert.moe_mlp       in each MoE layer, routed token copies over expert to the devices
                         holding their experts and back (and the transposes): ragged_all_to_all
                         on TPU and GPU after an all_gather of the [E] counts, a padded
                         all_to_all on CPU; and a psum of the [E] expert counts over the token
                         axes
    pipeline             over a stage axis (each device then runs its stage by
                         ``pipeline_gradients``): per tick, a ppermute of one microbatch's
                         activations [rows / M, seq, embed] to the next stage and one of their
                         gradients back
    data.sum_gradients   psum of gradients over the axes dew.parallel.gradients names for each
                         weight: the token axes (data, unless the layer loop summed it; fsdp
                         for weights kept whole; sequence),
                         tensor for partial ones, stage for the weights every stage holds
    data.sum_loss        psum of the loss and the objective's statistics (an MoE model's router
                         counts; nothing more for a dense one) over the token axes and stage

The plain and the pipelined step differ only in how a device computes its part (the whole model
on its tokens, or its stage over microbatches); both end in the same tail (``_summed``), and the
step hands the objective's statistics to ``objective.metrics`` without reading them.

The optax update then runs on the gradients as laid out (the same layout as the weights), outside
the ``shard_map`` but in the same ``jit``. That makes any optax transformation give its one-device
result: an elementwise update needs no communication, and a reduction over the whole tree such as
``clip_by_global_norm``'s norm is computed over the global arrays (XLA adds one all-reduce of a
scalar per reduction).

``gspmd`` (the baseline): the same loss on the global arrays under ``jit`` with the same input and
output shardings and no ``shard_map``; XLA's partitioner inserts the communication. Every block's
input is pinned to the token split (``TOKEN_SPEC``: rows over ``("data", "expert", "fsdp")``,
positions over ``sequence``), as MaxText-style GSPMD models pin theirs: the baseline a user would
write instead of Dew.

With a ``stage`` axis the GSPMD engines do not pipeline: the layers stay split over ``stage`` as
the state is laid out, and XLA's partitioner moves them as it sees fit (``microbatches`` and the
pipeline schedule do not apply).

``gspmd_unpinned``: the same, with activations left to the partitioner. It is kept to show what
pinning buys: at fsdp it splits the matmuls along the weights' split dimension and all-reduces
whole-batch activations (docs/results/cpu-layouts.md has its bytes).

Layout: the sum over microbatches (``accumulated_gradients``) and the token split
(``split_tokens``); ``OnBase``, a LoRA model's objective; what one device computes
(``_plain_gradients``, ``_pipelined_gradients`` and their forwards), summed by ``local_gradients``
through one tail, ``_summed``; the GSPMD baseline's ``global_gradients``; the optax update
(``optimizer_metrics``, ``apply_updates``); and the builders (``build_loss``, ``build_gradients``,
``build_train_step``). It is one module because the three engines share the microbatch sum,
``OnBase``, the optax update and the builders; apart, each would import the others' halves.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dew.mesh import BATCH_AXES
from dew.models import lora
from dew.nn import quantized
from dew.objectives.lm import document_positions, loss_weights, split_batch
from dew.parallel import ONE_DEVICE, Shards, data, fsdp, pipeline, sequence
from dew.training.optimizer import global_norm, learning_rate
from dew.training.state import TrainState

ENGINES = ("shard_map", "gspmd", "gspmd_unpinned")
# The global batch [rows, seq_len + 1] as it arrives: rows split over the batch axes.
BATCH_SPEC = P(BATCH_AXES)
# Shifted tokens [rows, seq_len] inside the shard_map step: rows over the batch axes, positions
# over ``sequence``; and their global positions [seq_len].
TOKEN_SPEC = P(BATCH_AXES, "sequence")
POSITION_SPEC = P("sequence")


def _cut(x: jax.Array, count: int) -> jax.Array:
    """``[rows, ...]`` -> ``[count, rows / count, ...]``: microbatch ``k`` is the ``k``-th run of
    consecutive rows."""
    return x.reshape(count, x.shape[0] // count, *x.shape[1:])


def accumulated_gradients(loss_share: Callable, params, microbatches):
    """Sum over ``microbatches`` (leading axis of every leaf) of ``value_and_grad(loss_share,
    has_aux=True)``, under one ``scan`` (none for a single microbatch): ``(loss, aux, grads)``,
    each summed.

    ``loss_share(params, micro) -> (loss, aux)``: a scalar and a pytree of arrays (the
    objective's statistics, whatever they are)."""
    first = jax.tree_util.tree_map(lambda x: x[0], microbatches)
    if jax.tree_util.tree_leaves(microbatches)[0].shape[0] == 1:
        # No loop to carry sums through: the model is traced once, not twice (eval_shape).
        (loss, aux), grads = jax.value_and_grad(loss_share, has_aux=True)(params, first)
        return loss, aux, grads
    _, aux_shapes = jax.eval_shape(loss_share, params, first)

    def accumulate(total, micro):
        (loss, aux), grads = jax.value_and_grad(loss_share, has_aux=True)(params, micro)
        return jax.tree_util.tree_map(jnp.add, total, (loss, aux, grads)), None

    zeros = jax.tree_util.tree_map(
        lambda a: jnp.zeros(a.shape, a.dtype),
        (jax.ShapeDtypeStruct((), jnp.float32), aux_shapes, params),
    )
    (loss, aux, grads), _ = jax.lax.scan(accumulate, zeros, microbatches)
    return loss, aux, grads


def split_tokens(mesh: Mesh, seq_len: int) -> Callable:
    """``batch -> (inputs, targets, positions)`` on the global arrays, for the shard_map engine.

    ``batch`` ``[rows, seq_len + 1]`` is shifted into inputs and targets ``[rows, seq_len]`` and,
    over a ``sequence`` axis of ``n``, its positions are put in zigzag order
    (``dew.parallel.sequence.zigzag_positions``), so that splitting them into ``n`` contiguous
    blocks (``TOKEN_SPEC``) gives device ``i`` chunks ``i`` and ``2n - 1 - i``; ``positions`` are
    the global positions, split alike. Every device of a sequence group holds the whole rows of
    its batch slice, so the reorder is a local slice, not a collective.

    A batch with a loss mask (``[rows, 2, seq_len + 1]``, ``dew.objectives.lm``) gives a fourth
    array, the targets' mask ``[rows, seq_len]`` (int32, 0 or 1), ordered and split as the
    targets. One with document ids (``[rows, 3, seq_len + 1]``) gives a fifth, the inputs'
    segment ids ``[rows, seq_len]`` (``split_batch``'s: a document wherever the id changes), and
    its ``positions`` are per row, ``[rows, seq_len]``,
    each token's position in its document (``document_positions``, computed on the natural-order
    row before the reorder), ordered and split as the tokens.
    """
    n = mesh.shape["sequence"]
    order = np.arange(seq_len) if n == 1 else sequence.zigzag_positions(seq_len, n)

    def split(batch):
        batch, mask, documents = split_batch(batch)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        positions = jnp.asarray(order, jnp.int32)
        if documents is not None:
            positions = document_positions(documents)
        if n > 1:
            reorder = lambda x: None if x is None else x[:, order]  # noqa: E731
            inputs, targets, mask, documents = map(reorder, (inputs, targets, mask, documents))
            if documents is not None:
                positions = positions[:, order]
        extra = () if mask is None else (mask,) if documents is None else (mask, documents)
        return (inputs, targets, positions) + extra

    return split


@dataclasses.dataclass(frozen=True)
class OnBase:
    """``objective`` for a LoRA model (``dew.models.lora``): the parameters it is given are the
    adapters, and the model runs on them joined to the frozen base ``frozen``
    (``lora.combine``), inside the function the step differentiates, so that the base is a
    constant of it: no gradient of the base is ever formed, nor summed. Every other attribute is
    ``objective``'s."""

    objective: object
    frozen: object
    key: object = None

    def model_params(self, adapters, tokens=None, shards=None):
        """The model's tree; in a training step of a model with LoRA dropout (``key`` given),
        with the dropout keys of ``tokens``, a microbatch's inputs (``lora.dropout_keys``)."""
        model = self.objective.model
        if self.key is None or model.lora.dropout == 0:
            return lora.combine(model, self.frozen, adapters)
        keys = lora.dropout_keys(model, self.key, adapters, shards, tokens)
        rate = jnp.asarray(model.lora.dropout, jnp.float32)
        return lora.combine(model, self.frozen, adapters, keys, rate)

    def loss_sum(self, adapters, batch, shards=ONE_DEVICE, *args, **kwargs):
        params = self.model_params(adapters, batch, None)
        return self.objective.loss_sum(params, batch, shards, *args, **kwargs)

    def token_loss_sum(
        self, adapters, inputs, targets, positions, shards=ONE_DEVICE, *args, **kwargs
    ):
        params = self.model_params(adapters, inputs, shards)
        return self.objective.token_loss_sum(
            params, inputs, targets, positions, shards, *args, **kwargs
        )

    def stage_loss_sum(self, adapters, x_in, inputs, targets, positions, shards, **kwargs):
        params = self.model_params(adapters, inputs, shards)
        return self.objective.stage_loss_sum(
            params, x_in, inputs, targets, positions, shards, **kwargs
        )

    def __getattr__(self, name):
        return getattr(self.objective, name)


def on_base(objective, frozen, key=None):
    """``objective`` itself, or with a frozen base (``TrainState.frozen``) an ``OnBase``
    (``key``: the step's dropout key, ``None`` outside a training step)."""
    return objective if frozen is None else OnBase(objective, frozen, key)


# --- What one device computes: its part of the loss, its statistics and its gradients ------------
#
# Two ways to run the model on a device's shards, with one signature: ``(params, inputs, targets,
# positions) -> (grads, loss, aux)`` (``..._gradients``) or ``-> (loss, aux)`` (``..._forward``),
# each the device's part, not yet summed. ``plain``: the whole model on the device's tokens.
# ``pipelined``: over a ``stage`` axis, the device's stage of the model, its microbatches run by
# ``dew.parallel.pipeline``. The step then sums the parts the same way whichever ran
# (``_summed``): one tail, in ``dew.parallel.data``.


def _plain_gradients(objective, shards: Shards, accumulation: int, global_tokens: int):
    """The device's tokens taken as ``accumulation`` microbatches of consecutive rows; each
    microbatch's loss is its share of the global mean, so the gradients add up to the whole
    batch's."""

    def share(params, micro):
        loss, aux = _token_loss_sum(objective, _numbered(shards, micro), params, micro)
        return loss / global_tokens, aux

    def fn(params, inputs, targets, positions, weights=None, documents=None):
        micro = _microbatches(accumulation, inputs, targets, positions, weights, documents)
        micro = _with_numbers(shards, micro, accumulation)
        loss, aux, grads = accumulated_gradients(share, params, micro)
        return grads, loss, aux

    return fn


def _microbatches(count: int, inputs, targets, positions, weights, documents) -> dict:
    """The device's tokens as ``count`` microbatches of consecutive rows: a dict of ``[count,
    ...]`` arrays (``positions`` ``[seq]``, the same for every row, repeated for each); the
    weights and the document ids only where the batch has them."""
    if positions.ndim == 1:
        positions = jnp.broadcast_to(positions, (count, *positions.shape))
    else:
        positions = _cut(positions, count)
    micro = {"inputs": _cut(inputs, count), "targets": _cut(targets, count)}
    micro["positions"] = positions
    if weights is not None:
        micro["weights"] = _cut(weights, count)
    if documents is not None:
        micro["segment_ids"] = _cut(documents, count)
    return micro


def _with_numbers(shards: Shards, micro: dict, count: int) -> dict:
    """``micro`` with each microbatch's number (``"number"``, ``[count]`` int32) where the step
    has an int8 rounding key (``Shards.rounding_key``), for ``_numbered``; else ``micro``."""
    if shards.rounding_key is None:
        return micro
    return {**micro, "number": jnp.arange(count, dtype=jnp.int32)}


def _numbered(shards: Shards, micro: dict) -> Shards:
    """``shards`` with the int8 rounding key folded with the microbatch's number, so that the
    microbatches of a step draw independent rounding noise (``dew.nn.quantized.fold_key``; the
    model folds each layer's number in after it); ``shards`` itself without a number."""
    if "number" not in micro:
        return shards
    key = quantized.fold_key(shards.rounding_key, micro["number"])
    return dataclasses.replace(shards, rounding_key=key)


def _token_loss_sum(objective, shards: Shards, params, micro: dict):
    """``objective.token_loss_sum`` of one microbatch (a dict of ``_microbatches``)."""
    extra = {} if "segment_ids" not in micro else {"segment_ids": micro["segment_ids"]}
    return objective.token_loss_sum(
        params,
        micro["inputs"],
        micro["targets"],
        micro["positions"],
        shards,
        micro.get("weights"),
        **extra,
    )


def _plain_forward(objective, shards: Shards):
    def fn(params, inputs, targets, positions, weights=None, documents=None):
        micro = {"inputs": inputs, "targets": targets, "positions": positions}
        if weights is not None:
            micro["weights"] = weights
        if documents is not None:
            micro["segment_ids"] = documents
        return _token_loss_sum(objective, shards, params, micro)

    return fn


def pipeline_microbatches(shards: Shards, accumulation: int) -> int:
    """How many microbatches one step runs through the pipeline: ``accumulation x
    shards.microbatches``."""
    return accumulation * shards.microbatches


def _stage_fn(objective, shards: Shards) -> Callable:
    """``(params, x_in, micro) -> (y, loss_sum, aux)``: this device's stage of the objective on
    one microbatch (a dict of ``_microbatches``; ``LMObjective.stage_loss_sum``), for
    ``dew.parallel.pipeline``."""

    def stage_fn(params, x_in, micro):
        extra = {name: micro[name] for name in ("weights", "segment_ids") if name in micro}
        numbered = _numbered(shards, micro)
        return objective.stage_loss_sum(
            params, x_in, micro["inputs"], micro["targets"], micro["positions"], numbered, **extra
        )

    return stage_fn


def _activation(objective, shards: Shards, params, inputs_m: jax.Array) -> jax.ShapeDtypeStruct:
    """What one stage sends the next for one microbatch: the embedding's output, ``[rows / M,
    positions, embed]`` (positions split over the tensor group under sequence-parallel
    activations) in the activations' dtype."""
    if isinstance(objective, OnBase):
        params = objective.model_params(params)
    return jax.eval_shape(lambda p, t: objective.model.embed(p, t, shards), params, inputs_m)


def _pipelined_gradients(objective, shards: Shards, accumulation: int, global_tokens: int):
    """The device's stage over ``A M`` microbatches (``A = accumulation``, ``M =
    shards.microbatches``): its rows are ``A`` runs of consecutive rows, each cut into ``M``, so
    microbatch ``k = a M + m`` is the ``k``-th run of ``rows / (A M)`` rows; all go through one
    pipeline (``shards.options.pipeline_schedule``), so accumulation shrinks the bubble too.
    Every device of a stage group holds the same rows: stage 0 reads their inputs, the last stage
    their targets.

    Each stage differentiates ``loss_sum / global_tokens`` of ``stage_loss_sum``; the gradients
    of its layers are whole for its stage, and those of the weights every stage holds (embedding,
    final norm, head) are parts, summed over ``stage`` as ``dew.parallel.gradients`` says.
    """
    count = pipeline_microbatches(shards, accumulation)
    stages = shards.size(pipeline.AXIS)
    schedule = pipeline.SCHEDULES[shards.options.pipeline_schedule](stages, count)

    def fn(params, inputs, targets, positions, weights=None, documents=None):
        micro = _microbatches(count, inputs, targets, positions, weights, documents)
        micro = _with_numbers(shards, micro, count)
        grads, loss, aux = pipeline.pipeline_gradients(
            _stage_fn(objective, shards),
            params,
            micro,
            schedule,
            activation=_activation(objective, shards, params, micro["inputs"][0]),
            loss_scale=1.0 / global_tokens,
            has_aux=True,
        )
        return grads, loss / global_tokens, aux

    return fn


def _pipelined_forward(objective, shards: Shards):
    """The device's stage over ``shards.microbatches`` microbatches
    (``dew.parallel.pipeline.pipeline_forward``: ``M + S - 1`` ticks, one ``ppermute`` of an
    activation each)."""

    def fn(params, inputs, targets, positions, weights=None, documents=None):
        count = shards.microbatches
        micro = _microbatches(count, inputs, targets, positions, weights, documents)
        return pipeline.pipeline_forward(
            _stage_fn(objective, shards),
            params,
            micro,
            activation=_activation(objective, shards, params, micro["inputs"][0]),
            has_aux=True,
        )

    return fn


def _pipelined(shards: Shards) -> bool:
    return shards.size(pipeline.AXIS) > 1


def local_gradients(
    objective, shards: Shards, accumulation: int, global_tokens: int, param_specs=None
) -> Callable:
    """``(params, inputs, targets, positions) -> (grads, loss, aux)`` on one device's shards,
    summed over the devices (``_summed``): the gradients of the global mean loss, laid out like
    the parameters, the global mean loss, and the objective's statistics summed over every
    token.

    ``inputs``, ``targets``: this device's ``[rows, positions]`` tokens (``TOKEN_SPEC``);
    ``positions``: their global positions. Over a ``stage`` axis above 1 the device runs its
    stage as a pipeline (``_pipelined_gradients``), else the whole model (``_plain_gradients``).

    ``frozen`` (a keyword of the function): a LoRA model's base, this device's shards of it; the
    gradients are then the adapters' (``params``, laid out by ``param_specs``), the base a
    constant of the differentiated function (``OnBase``).
    """
    parts = _pipelined_gradients if _pipelined(shards) else _plain_gradients
    # Where each layer runs once a step, its gathers' transposes also sum over data, in the loop.
    shards = dataclasses.replace(shards, loop_sums=fsdp.loop_sum_axes(shards, accumulation))

    def fn(params, inputs, targets, positions, mask=None, documents=None, frozen=None, key=None):
        step_shards = shards
        if key is not None and shards.options.quantize == "int8":
            step_shards = dataclasses.replace(shards, rounding_key=_device_key(key, shards))
        if key is not None:  # key data, the same on every device: a typed key again
            key = jax.random.wrap_key_data(key)
        on = on_base(objective, frozen, key)
        part = parts(on, step_shards, accumulation, global_tokens)
        weights = None if mask is None else _mask_weights(mask, shards, global_tokens)
        grads, loss, aux = part(params, inputs, targets, positions, weights, documents)
        return _summed(on, shards, grads, loss, aux, param_specs)

    return fn


def _device_key(key: jax.Array, shards: Shards) -> jax.Array:
    """The int8 rounding key (key data) of this device: the step's folded with the device's
    index over the axes that split the tokens (0 on one device), so that devices rounding
    different tokens draw independent noise (``dew.nn.quantized``'s rule; the devices of a
    tensor group hold the same tokens and fold their index where they round values of their
    own)."""
    index = 0
    for axis in shards.token_axes():
        index = index * shards.size(axis) + jax.lax.axis_index(axis)
    return quantized.fold_key(key, index)


def _mask_weights(mask: jax.Array, shards: Shards, global_tokens: int) -> jax.Array:
    """This device's targets' weights ``[rows, positions]`` from their mask: ``loss_weights``
    with the count of unmasked targets over the whole global batch, before any microbatch runs.
    One ``psum`` of an int32 scalar (4 bytes) over the token axes, which hold different tokens
    (not over tensor or stage, whose devices hold the same ones)."""
    count = jnp.sum(mask, dtype=jnp.int32)
    axes = shards.token_axes()
    if axes:
        count = jax.lax.psum(count, axes)
    return loss_weights(mask, count, global_tokens)


def _summed(objective, shards: Shards, grads, loss, aux, param_specs=None):
    """The one tail of every shard_map step: each gradient summed over the axes
    ``dew.parallel.gradients`` names for it, the loss and the statistics over every axis that
    holds a part of them (``data.sum_loss``). A LoRA model's gradients are its adapters', laid out
    by ``param_specs`` (``dew.models.lora`` says which are partial over ``tensor``); none is
    split over fsdp (``dew.layout.WHOLE_OVER_FSDP``), so none was summed inside the layer loop
    (``Shards.loop_sums`` acts on fsdp-split weights only)."""
    if isinstance(objective, OnBase):
        model = objective.model
        partial = lora.partial_over_tensor(model, grads, shards)
        in_loop = None
        specs = param_specs
    else:
        partial = objective.model.partial_over_tensor(shards)
        in_loop = objective.model.in_layer_loop() if shards.loop_sums else None
        specs = shards.param_specs
    grads = data.sum_gradients(grads, specs, shards, partial, in_loop)
    loss, aux = data.sum_loss((loss, aux), shards)
    return grads, loss, aux


def global_gradients(
    objective, shards: Shards, batch_splits: int, accumulation: int, global_tokens: int
) -> Callable:
    """The GSPMD baseline's ``(params, batch) -> (grads, loss, aux)`` on the global arrays.

    ``shards``: the global view (nothing split), with ``pinned_activations`` set or not.
    Microbatch i takes the i-th block of rows of each of the ``batch_splits`` batch shards, the rows
    the shard_map engine's microbatch i holds, so both engines add the same numbers.
    """

    def cut(x):
        rows, *rest = x.shape
        x = x.reshape(batch_splits, accumulation, rows // (batch_splits * accumulation), *rest)
        return x.swapaxes(0, 1).reshape(accumulation, rows // accumulation, *rest)

    def fn(params, batch, frozen=None, key=None):
        on = on_base(objective, frozen, None if key is None else jax.random.wrap_key_data(key))

        def share(params, micro):
            loss, aux = on.loss_sum(
                params, micro["tokens"], shards, micro.get("weights"), micro.get("documents")
            )
            return loss / global_tokens, aux

        tokens, mask, documents = split_batch(batch)
        micro = {"tokens": cut(tokens)}
        if mask is not None:  # counted over the global array: XLA all-reduces the count
            count = jnp.sum(mask, dtype=jnp.int32)
            micro["weights"] = cut(loss_weights(mask, count, global_tokens))
        if documents is not None:
            micro["documents"] = cut(documents)
        loss, aux, grads = accumulated_gradients(share, params, micro)
        return grads, loss, aux

    return fn


def optimizer_metrics(grads, optimizer, opt_state) -> dict:
    """``grad_norm``: the global norm of the gradients (float32, before any clipping), over the
    global arrays as laid out (XLA adds one all-reduce of a scalar per split weight); and ``lr``,
    the learning rate this step's update uses, for an optimizer that says it
    (``dew.training.optimizer.learning_rate``)."""
    metrics = {"grad_norm": global_norm(grads)}
    lr = learning_rate(optimizer, opt_state)
    if lr is not None:
        metrics["lr"] = lr
    return metrics


def apply_updates(
    state: TrainState, grads, optimizer: optax.GradientTransformation, ema_decay: float | None
) -> TrainState:
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    ema = state.ema
    if ema_decay is not None:
        ema = jax.tree_util.tree_map(
            lambda e, p: ema_decay * e + (1.0 - ema_decay) * p, ema, params
        )
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state, ema=ema)


def _shard_map_step(
    local: Callable,
    mesh: Mesh,
    shards: Shards,
    seq_len: int,
    out_specs,
    param_specs=None,
    frozen_specs=None,
) -> Callable:
    """``(params, batch, frozen=None) -> local(params, inputs, targets, positions)`` over
    ``mesh``, the batch split into tokens by ``split_tokens`` first. ``params`` are laid out by
    ``param_specs`` (default ``shards.param_specs``); a LoRA model's base ``frozen`` by
    ``frozen_specs``, passed to ``local`` as its keyword ``frozen``.

    ``check_vma=False``: gradients are summed where dew.parallel says, not by the transposes of
    implicit casts, so the collectives of a step are exactly those written in dew.parallel.

    A batch with a loss mask passes ``local`` a fifth argument, the targets' mask, split as the
    targets are; one with document ids a sixth, the inputs' document ids (and its positions are
    per row, split as the tokens).
    """
    split = split_tokens(mesh, seq_len)

    def run(params, batch, frozen=None, key=None):
        arrays = split(batch)
        positions = POSITION_SPEC if arrays[2].ndim == 1 else TOKEN_SPEC
        specs = (TOKEN_SPEC, TOKEN_SPEC, positions) + (TOKEN_SPEC,) * (len(arrays) - 3)
        if frozen is None and key is None:
            mapped = jax.shard_map(
                local,
                mesh=mesh,
                in_specs=(shards.param_specs, *specs),
                out_specs=out_specs,
                check_vma=False,
            )
            return mapped(params, *arrays)
        if frozen is None:  # the int8 rounding key's data [2], whole on every device
            mapped = jax.shard_map(
                lambda p, k, *a: local(p, *a, key=k),
                mesh=mesh,
                in_specs=(shards.param_specs, P(), *specs),
                out_specs=out_specs,
                check_vma=False,
            )
            return mapped(params, key, *arrays)
        if key is None:
            mapped = jax.shard_map(
                lambda p, f, *a: local(p, *a, frozen=f),
                mesh=mesh,
                in_specs=(param_specs, frozen_specs, *specs),
                out_specs=out_specs,
                check_vma=False,
            )
            return mapped(params, frozen, *arrays)
        mapped = jax.shard_map(  # the dropout key's data [2], whole on every device
            lambda p, f, k, *a: local(p, *a, frozen=f, key=k),
            mesh=mesh,
            in_specs=(param_specs, frozen_specs, P(), *specs),
            out_specs=out_specs,
            check_vma=False,
        )
        return mapped(params, frozen, key, *arrays)

    return run


def build_loss(
    objective,
    mesh: Mesh,
    shards: Shards,
    *,
    global_rows: int,
    param_specs=None,
    frozen_specs=None,
) -> Callable:
    """The jitted ``(params, batch, frozen=None) -> (loss, aux)``: the mean loss of a global batch
    and the
    objective's statistics summed over its tokens, forward only, with the step's collectives
    (weights gathered per layer, the parts summed by the step's tail, ``data.sum_loss``).

    Over a ``stage`` axis of size > 1 the forward runs as a pipeline of ``shards.microbatches``
    microbatches (``_pipelined_forward``).
    """
    global_tokens = global_rows * objective.seq_len
    forward_of = _pipelined_forward if _pipelined(shards) else _plain_forward

    def local_loss(params, inputs, targets, positions, mask=None, documents=None, frozen=None):
        forward = forward_of(on_base(objective, frozen), shards)
        weights = None if mask is None else _mask_weights(mask, shards, global_tokens)
        parts = forward(params, inputs, targets, positions, weights, documents)
        loss, aux = data.sum_loss(parts, shards)
        return loss / global_tokens, aux

    loss = _shard_map_step(
        local_loss, mesh, shards, objective.seq_len, (P(), P()), param_specs, frozen_specs
    )
    return jax.jit(loss, out_shardings=NamedSharding(mesh, P()))


def on_abstract_mesh(fn: Callable, mesh: Mesh) -> Callable:
    """``fn`` traced with ``mesh``'s abstract mesh as the context, as a shard_map body is.

    The model's ``"auto"`` choices (the attention kernel, the MoE exchange) read the platform of
    the devices the step is compiled for from it (``dew.parallel.ragged.compiled_platform``).
    Without it a GSPMD step read the host's backend: compiled for a TPU slice on a CPU host, it
    planned XLA's attention where the chip runs the Mosaic kernels."""

    def traced(*args):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args)

    return traced


def build_gradients(
    objective,
    mesh: Mesh,
    shards: Shards,
    *,
    accumulation: int,
    global_rows: int,
    engine: str = "shard_map",
    param_specs=None,
    frozen_specs=None,
) -> Callable:
    """``(params, batch, frozen=None) -> (grads, loss, aux)`` on global arrays laid out on
    ``mesh``: the gradient of the mean loss of the whole batch, laid out like the parameters, the
    loss, and the objective's statistics summed over the batch (``{}`` for a dense language
    model). For a LoRA model ``params`` are its adapters (laid out by ``param_specs``) and
    ``frozen`` its base (by ``frozen_specs``); the gradients are the adapters'.

    Args:
      shards: what the shard_map engine's code sees: the mesh's sizes, the parameters'
        ``PartitionSpec`` s, the ``StepOptions``. The GSPMD engines read only the
        specs' absence: they run the model on the global arrays.
      global_rows: rows of the global batch (the loss is a mean over ``global_rows * seq_len``
        tokens, or, for a batch with a loss mask ``[rows, 2, seq_len + 1]``, over its unmasked
        targets: ``dew.objectives.lm``).
    """
    global_tokens = global_rows * objective.seq_len
    if engine == "shard_map":
        local = local_gradients(objective, shards, accumulation, global_tokens, param_specs)
        grad_specs = shards.param_specs if frozen_specs is None else param_specs
        out_specs = (grad_specs, P(), P())
        return _shard_map_step(
            local, mesh, shards, objective.seq_len, out_specs, param_specs, frozen_specs
        )
    if engine in ("gspmd", "gspmd_unpinned"):
        # Activations [rows, seq, embed] pinned to the rows' split (and the positions' one over a
        # sequence axis), as the shard_map step holds them.
        pinned = NamedSharding(mesh, TOKEN_SPEC) if engine == "gspmd" else None
        splits = math.prod(mesh.shape[a] for a in BATCH_AXES)
        fn = global_gradients(
            objective, Shards(pinned_activations=pinned), splits, accumulation, global_tokens
        )
        return on_abstract_mesh(fn, mesh)
    raise ValueError(f"unknown engine {engine!r}; expected one of {', '.join(ENGINES)}")


def build_train_step(
    objective,
    optimizer,
    mesh: Mesh,
    shards: Shards,
    state_shardings,
    *,
    accumulation: int,
    global_rows: int,
    engine: str = "shard_map",
    param_specs=None,
    frozen_specs=None,
) -> Callable:
    """The jitted step ``(state, batch) -> (state, metrics)``; ``state`` is donated (a LoRA
    model's frozen base included: the step returns it unchanged, in the same buffers).

    ``metrics``: the objective's ``metrics(loss, aux, global_tokens)``, a dict of scalars with
    ``"loss"`` (for an MoE language model also ``"load_balance_loss"``, ``"router_z_loss"`` and
    ``"dropped_fraction"``), ``optimizer_metrics``: ``"grad_norm"`` and, where the optimizer
    says it, ``"lr"``, and for a batch with a loss mask ``"useful_tokens"``: the global batch's
    targets whose loss counts (int32).

    ``state_shardings`` is the ``NamedSharding`` tree of the whole ``TrainState``; the other
    arguments are ``build_gradients``'.
    """
    gradients = build_gradients(
        objective,
        mesh,
        shards,
        accumulation=accumulation,
        global_rows=global_rows,
        engine=engine,
        param_specs=param_specs,
        frozen_specs=frozen_specs,
    )

    global_tokens = global_rows * objective.seq_len

    model = objective.model
    dropout = getattr(model, "lora", None) is not None and model.lora.dropout > 0
    # int8 gradients round stochastically (dew.nn.quantized), from the same key.
    keyed = dropout or shards.options.quantize == "int8"

    def step(state: TrainState, batch: jax.Array):
        # LoRA dropout: a key of this step's own (the run's key folded with the step), as data.
        key = jax.random.key_data(jax.random.fold_in(state.key, state.step)) if keyed else None
        grads, loss, aux = gradients(state.params, batch, state.frozen, key)
        metrics = objective.metrics(loss, aux, global_tokens)
        metrics.update(optimizer_metrics(grads, optimizer, state.opt_state))
        mask = split_batch(batch)[1]
        if mask is not None:  # the targets whose loss counts (XLA sums the rows' split: 4 bytes)
            metrics["useful_tokens"] = jnp.sum(mask, dtype=jnp.int32)
        return apply_updates(state, grads, optimizer, objective.ema_decay), metrics

    return jax.jit(
        step,
        in_shardings=(state_shardings, NamedSharding(mesh, BATCH_SPEC)),
        out_shardings=(state_shardings, NamedSharding(mesh, P())),
        donate_argnums=0,
    )
