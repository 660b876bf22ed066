"""The training step, in three engines built from the same model, loss and optimizer.

``shard_map`` (the default): the forward and backward run inside one ``jax.shard_map`` over the
whole mesh, on each device's local shards, and every byte between devices is a collective written in
``dew.parallel``:

    fsdp.gather          all_gathers of a layer's split weights (small ones bucketed, per dtype)
                         just before the layer runs, and again in its recomputed backward
    (its transpose)      one psum_scatter of those weights' gradients over fsdp
    tensor.enter/leave   Megatron's pairs around attention and the MLP (psum over tensor, or
                         all_gather / psum_scatter with sequence-parallel activations), and the
                         vocabulary-parallel embedding, head and loss (psum and pmax of
                         [rows, seq]-sized values, never the logits)
    sequence.attention   over a sequence axis, ring attention (ppermute of K/V blocks, and of
                         their gradients in the backward) or the all-to-all scheme
    expert.moe_mlp       in each MoE layer, all_to_all of routed token copies over expert to the
                         devices holding their experts and back (and the transposes), and a
                         psum of the [E] expert counts over the token axes
    data.sum_gradients   psum of gradients over the axes dew.parallel.gradients names for each
                         weight: the token axes (data, fsdp for weights kept whole, sequence),
                         tensor for partial ones
    data.sum_over_tokens psum of the loss over the token axes
    pipeline             over a stage axis (``local_gradients`` then runs
                         ``pipeline_gradients``): per tick, a ppermute of one microbatch's
                         activations [rows / M, seq, embed] to the next stage and one of their
                         gradients back; the embedding's, final norm's and head's gradients and
                         the loss psummed over stage as well

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
whole-batch activations (docs/benchmarks.md has its bytes).
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dew.mesh import BATCH_AXES
from dew.nn.moe import RouterStats
from dew.parallel import Shards, data, pipeline, sequence
from dew.training.state import TrainState

ENGINES = ("shard_map", "gspmd", "gspmd_unpinned")
# The global batch [rows, seq_len + 1] as it arrives: rows split over the batch axes.
BATCH_SPEC = P(BATCH_AXES)
# Shifted tokens [rows, seq_len] inside the shard_map step: rows over the batch axes, positions
# over ``sequence``; and their global positions [seq_len].
TOKEN_SPEC = P(BATCH_AXES, "sequence")
POSITION_SPEC = P("sequence")


def accumulated_gradients(loss_share: Callable, params, microbatches: jax.Array):
    """Sum over ``microbatches`` (leading axis) of ``value_and_grad(loss_share, has_aux=True)``,
    under one ``scan``: ``(loss, stats, grads)``, each summed."""

    def accumulate(total, micro):
        (loss, stats), grads = jax.value_and_grad(loss_share, has_aux=True)(params, micro)
        return jax.tree_util.tree_map(jnp.add, total, (loss, stats, grads)), None

    zeros = (
        jnp.zeros((), jnp.float32),
        RouterStats.zeros(),
        jax.tree_util.tree_map(jnp.zeros_like, params),
    )
    (loss, stats, grads), _ = jax.lax.scan(accumulate, zeros, microbatches)
    return loss, stats, grads


def step_metrics(objective, loss: jax.Array, stats: RouterStats, global_tokens: int) -> dict:
    """What a step reports: ``{"loss": ...}``, and for an MoE model the router losses (each a
    mean over the MoE layers and the microbatches) and the fraction of token copies dropped."""
    metrics = {"loss": loss}
    if getattr(objective.model, "num_experts", 0):
        metrics["load_balance_loss"] = stats.load_balance / global_tokens
        metrics["router_z_loss"] = stats.z_loss / global_tokens
        metrics["dropped_fraction"] = stats.dropped / jnp.maximum(stats.routed, 1.0)
    return metrics


def step_shards(
    mesh: Mesh,
    param_specs,
    sequence_parallel: bool = False,
    sequence_scheme: str = "ring",
    microbatches: int = 1,
    pipeline_schedule: str = "1f1b",
) -> Shards:
    """The ``Shards`` the shard_map engine's code sees on ``mesh``."""
    return Shards(
        axis_sizes=dict(mesh.shape),
        param_specs=param_specs,
        sequence_parallel=sequence_parallel,
        sequence_scheme=sequence_scheme,
        microbatches=microbatches,
        pipeline_schedule=pipeline_schedule,
    )


def split_tokens(mesh: Mesh, seq_len: int) -> Callable:
    """``batch -> (inputs, targets, positions)`` on the global arrays, for the shard_map engine.

    ``batch`` ``[rows, seq_len + 1]`` is shifted into inputs and targets ``[rows, seq_len]`` and,
    over a ``sequence`` axis of ``n``, its positions are put in zigzag order
    (``dew.parallel.sequence.zigzag_positions``), so that splitting them into ``n`` contiguous
    blocks (``TOKEN_SPEC``) gives device ``i`` chunks ``i`` and ``2n - 1 - i``; ``positions`` are
    the global positions, split alike. Every device of a sequence group holds the whole rows of
    its batch slice, so the reorder is a local slice, not a collective.
    """
    n = mesh.shape["sequence"]
    order = np.arange(seq_len) if n == 1 else sequence.zigzag_positions(seq_len, n)

    def split(batch):
        inputs, targets = batch[:, :-1], batch[:, 1:]
        if n > 1:
            inputs, targets = inputs[:, order], targets[:, order]
        return inputs, targets, jnp.asarray(order, jnp.int32)

    return split


def local_gradients(objective, shards: Shards, accumulation: int, global_tokens: int) -> Callable:
    """``(params, inputs, targets, positions) -> (grads, loss, stats)`` on one device's shards;
    summed over the axes ``dew.parallel.gradients`` names (the stats over the token axes).

    ``inputs``, ``targets``: this device's ``[rows, positions]`` tokens (``TOKEN_SPEC``), taken as
    ``accumulation`` microbatches of consecutive rows; ``positions``: their global positions. Each
    microbatch's loss is its share of the global mean, so the gradients add up to the whole
    batch's. Over a ``stage`` axis of size > 1: ``pipelined_gradients``.
    """
    if shards.size(pipeline.AXIS) > 1:
        return pipelined_gradients(objective, shards, accumulation, global_tokens)

    def share(params, micro):
        inputs, targets, positions = micro
        loss, stats = objective.token_loss_sum(params, inputs, targets, positions, shards)
        return loss / global_tokens, stats

    def fn(params, inputs, targets, positions):
        def cut(x):
            return x.reshape(accumulation, x.shape[0] // accumulation, *x.shape[1:])

        every = jnp.broadcast_to(positions, (accumulation, *positions.shape))
        micro = (cut(inputs), cut(targets), every)
        loss, stats, grads = accumulated_gradients(share, params, micro)
        partial = objective.model.partial_over_tensor(shards)
        grads = data.sum_gradients(grads, shards.param_specs, shards, partial)
        if getattr(objective.model, "num_experts", 0):
            loss, stats = data.sum_over_tokens((loss, stats), shards)
        else:  # a dense model's stats are zeros: only the loss travels
            loss = data.sum_over_tokens(loss, shards)
        return grads, loss, stats

    return fn


def pipeline_microbatches(shards: Shards, accumulation: int) -> int:
    """How many microbatches one step runs through the pipeline: ``accumulation x
    shards.microbatches``."""
    return accumulation * shards.microbatches


def _cut(x: jax.Array, count: int) -> jax.Array:
    """``[rows, ...]`` -> ``[count, rows / count, ...]``: microbatch ``k`` is the ``k``-th run of
    consecutive rows."""
    return x.reshape(count, x.shape[0] // count, *x.shape[1:])


def _stage_fn(objective, shards: Shards, positions: jax.Array) -> Callable:
    """``(params, x_in, (inputs, targets)) -> (y, loss_sum, stats)``: this device's stage of the
    objective on one microbatch (``LMObjective.stage_loss_sum``), for ``dew.parallel.pipeline``."""

    def stage_fn(params, x_in, micro):
        inputs, targets = micro
        return objective.stage_loss_sum(params, x_in, inputs, targets, positions, shards)

    return stage_fn


def _activation(objective, shards: Shards, params, inputs_m: jax.Array) -> jax.ShapeDtypeStruct:
    """What one stage sends the next for one microbatch: the embedding's output, ``[rows / M,
    positions, embed]`` (positions split over the tensor group under sequence-parallel
    activations) in the activations' dtype."""
    return jax.eval_shape(lambda p, t: objective.model.embed(p, t, shards), params, inputs_m)


def pipelined_gradients(
    objective, shards: Shards, accumulation: int, global_tokens: int
) -> Callable:
    """``local_gradients`` over a ``stage`` axis of ``S > 1``: the same ``(params, inputs,
    targets, positions) -> (grads, loss, stats)``, run by ``dew.parallel.pipeline``.

    The cut: this device's rows are ``accumulation`` runs of consecutive rows, each cut into
    ``shards.microbatches`` runs of consecutive rows, so microbatch ``k = a M + m`` is the ``k``-th
    run of ``rows / (A M)`` rows; all ``A M`` go through one pipeline (``shards.pipeline_schedule``
    for ``S`` stages and ``A M`` microbatches), so accumulation shrinks the bubble too. Every
    device of a stage group holds the same rows: stage 0 reads their inputs, the last stage
    their targets.

    Each stage differentiates ``loss_sum / global_tokens`` of ``LMObjective.stage_loss_sum``;
    the gradients of its layers are whole for its stage, and those of the weights every stage
    holds (embedding, final norm, head) are summed over ``stage`` as ``dew.parallel.gradients``
    says. The loss and the router stats are summed over the token axes and ``stage``.
    """
    count = pipeline_microbatches(shards, accumulation)
    stages = shards.size(pipeline.AXIS)
    schedule = pipeline.SCHEDULES[shards.pipeline_schedule](stages, count)

    def fn(params, inputs, targets, positions):
        micro = (_cut(inputs, count), _cut(targets, count))
        grads, loss, stats = pipeline.pipeline_gradients(
            _stage_fn(objective, shards, positions),
            params,
            micro,
            schedule,
            activation=_activation(objective, shards, params, micro[0][0]),
            loss_scale=1.0 / global_tokens,
            has_aux=True,
        )
        partial = objective.model.partial_over_tensor(shards)
        grads = data.sum_gradients(grads, shards.param_specs, shards, partial)
        if getattr(objective.model, "num_experts", 0):
            loss, stats = _sum_over_tokens_and_stages((loss, stats), shards)
        else:  # a dense model's stats are zeros: only the loss travels
            loss = _sum_over_tokens_and_stages(loss, shards)
        return grads, loss / global_tokens, stats

    return fn


def _sum_over_tokens_and_stages(x, shards: Shards):
    """``psum`` of small values (a loss, router stats) over the token axes and ``stage``: each
    stage holds the part its layers (and, last, its head) added."""
    return jax.lax.psum(x, (*shards.token_axes(), pipeline.AXIS))


def global_gradients(
    objective, shards: Shards, batch_splits: int, accumulation: int, global_tokens: int
) -> Callable:
    """The GSPMD baseline's ``(params, batch) -> (grads, loss, stats)`` on the global arrays.

    ``shards``: the global view (nothing split), with ``pinned_activations`` set or not.
    Microbatch i takes the i-th block of rows of each of the ``batch_splits`` batch shards, the rows
    the shard_map engine's microbatch i holds, so both engines add the same numbers.
    """

    def share(params, micro):
        loss, stats = objective.loss_sum(params, micro, shards)
        return loss / global_tokens, stats

    def fn(params, batch):
        rows, width = batch.shape
        micro = batch.reshape(
            batch_splits, accumulation, rows // (batch_splits * accumulation), width
        )
        micro = micro.swapaxes(0, 1).reshape(accumulation, rows // accumulation, width)
        loss, stats, grads = accumulated_gradients(share, params, micro)
        return grads, loss, stats

    return fn


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
    local: Callable, mesh: Mesh, shards: Shards, seq_len: int, out_specs
) -> Callable:
    """``(params, batch) -> local(params, inputs, targets, positions)`` over ``mesh``, the batch
    split into tokens by ``split_tokens`` first.

    ``check_vma=False``: gradients are summed where dew.parallel says, not by the transposes of
    implicit casts, so the collectives of a step are exactly those written in dew.parallel.
    """
    split = split_tokens(mesh, seq_len)
    mapped = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(shards.param_specs, TOKEN_SPEC, TOKEN_SPEC, POSITION_SPEC),
        out_specs=out_specs,
        check_vma=False,
    )
    return lambda params, batch: mapped(params, *split(batch))


def build_loss(objective, mesh: Mesh, shards: Shards, *, global_rows: int) -> Callable:
    """The jitted ``(params, batch) -> loss``: the mean loss of a global batch, forward only, with
    the step's collectives (weights gathered per layer, the loss summed over the token axes).

    Over a ``stage`` axis of size > 1 the forward runs as a pipeline of ``shards.microbatches``
    microbatches (``dew.parallel.pipeline.pipeline_forward``: ``M + S - 1`` ticks, one
    ``ppermute`` of an activation each), the loss summed over ``stage`` too.
    """
    global_tokens = global_rows * objective.seq_len

    def local_loss(params, inputs, targets, positions):
        loss, _ = objective.token_loss_sum(params, inputs, targets, positions, shards)
        return data.sum_over_tokens(loss, shards) / global_tokens

    def pipelined_loss(params, inputs, targets, positions):
        count = shards.microbatches
        micro = (_cut(inputs, count), _cut(targets, count))
        loss, _ = pipeline.pipeline_forward(
            _stage_fn(objective, shards, positions),
            params,
            micro,
            activation=_activation(objective, shards, params, micro[0][0]),
            has_aux=True,
        )
        return _sum_over_tokens_and_stages(loss, shards) / global_tokens

    local = pipelined_loss if shards.size(pipeline.AXIS) > 1 else local_loss
    loss = _shard_map_step(local, mesh, shards, objective.seq_len, P())
    return jax.jit(loss, out_shardings=NamedSharding(mesh, P()))


def build_gradients(
    objective,
    mesh: Mesh,
    shards: Shards,
    *,
    accumulation: int,
    global_rows: int,
    engine: str = "shard_map",
) -> Callable:
    """``(params, batch) -> (grads, loss, stats)`` on global arrays laid out on ``mesh``: the
    gradient of the mean loss of the whole batch, laid out like the parameters, the loss, and the
    summed ``RouterStats`` of the MoE layers (zeros for a dense model).

    Args:
      shards: what the shard_map engine's code sees (``step_shards``): the mesh's sizes, the
        parameters' ``PartitionSpec`` s, the activation options. The GSPMD engines read only the
        specs' absence: they run the model on the global arrays.
      global_rows: rows of the global batch (the loss is a mean over ``global_rows * seq_len``
        tokens).
    """
    global_tokens = global_rows * objective.seq_len
    if engine == "shard_map":
        local = local_gradients(objective, shards, accumulation, global_tokens)
        out_specs = (shards.param_specs, P(), RouterStats(P(), P(), P(), P()))
        return _shard_map_step(local, mesh, shards, objective.seq_len, out_specs)
    if engine in ("gspmd", "gspmd_unpinned"):
        # Activations [rows, seq, embed] pinned to the rows' split (and the positions' one over a
        # sequence axis), as the shard_map step holds them.
        pinned = NamedSharding(mesh, TOKEN_SPEC) if engine == "gspmd" else None
        splits = math.prod(mesh.shape[a] for a in BATCH_AXES)
        return global_gradients(
            objective, Shards(pinned_activations=pinned), splits, accumulation, global_tokens
        )
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
) -> Callable:
    """The jitted step ``(state, batch) -> (state, metrics)``; ``state`` is donated.

    ``metrics``: ``step_metrics``'s dict of scalars, ``"loss"`` and, for an MoE model,
    ``"load_balance_loss"``, ``"router_z_loss"`` and ``"dropped_fraction"``.

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
    )

    global_tokens = global_rows * objective.seq_len

    def step(state: TrainState, batch: jax.Array):
        grads, loss, stats = gradients(state.params, batch)
        metrics = step_metrics(objective, loss, stats, global_tokens)
        return apply_updates(state, grads, optimizer, objective.ema_decay), metrics

    return jax.jit(
        step,
        in_shardings=(state_shardings, NamedSharding(mesh, BATCH_SPEC)),
        out_shardings=(state_shardings, NamedSharding(mesh, P())),
        donate_argnums=0,
    )
