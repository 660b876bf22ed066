"""Expert parallelism: each device of the ``expert`` axis holds ``E / n`` experts of every MoE
layer, and token copies travel to their expert and back, padded (``all_to_all``) or ragged
(``ragged_all_to_all``).

``expert`` is also a batch axis: the devices of an expert group hold different rows. In each MoE
layer a device routes its own tokens (``dew.nn.moe.route``), sorts their ``c = tokens * k``
copies by expert, and, padded:

    dispatch   all_to_all over expert of [n, B, embed]: block d goes to device d, which owns
               experts [d E/n, (d+1) E/n); (n - 1) B embed values sent per device (and an int32
               [n, B] of which local expert each copy is for)
    compute    the local experts on what arrived, one grouped matmul (dew.nn.moe.grouped_swiglu)
    combine    all_to_all back of [n, B, embed], the same bytes
    backward   the transposes: two more all_to_alls of the same size (and, as each layer is
               recomputed in the backward, the forward's two again)

``B``, the slots per destination, is static: dropless, a device may send all its copies to one
device, so ``B = c`` and the buffers are ``n`` times the copies; with a ``capacity_factor`` an
expert takes at most ``capacity`` copies from each row, so ``B = min(c, rows * capacity * E /
n)``. ``exchange_slots`` gives ``B``.

Ragged (``dew.parallel.ragged``; the default on TPU and GPU, emulated exactly on CPU):

    counts     all_gather over expert of the [E] int32 copies per expert: (n - 1) E 4 bytes in
    dispatch   ragged_all_to_all of the sorted copies [c, embed] into a receive buffer
               [R, embed] sorted by local expert; each device gets exactly its experts' copies
    compute    the local experts on the buffer, one grouped matmul
    combine    ragged_all_to_all back of [R, embed] into [c, embed]
    backward   each direction's transpose is the other (a custom_vjp), and the recompute

with ``R = min(n B, ceil(f c))`` rows (``f``: the model's ``expert_buffer_factor``, 2 by
default; ``None``: ``n B``, which never drops). Copies past ``R`` are dropped and counted in
``RouterStats.dropped``. The static buffers are ``(c + R) / (2 n B)`` of the padded ones.

Expert weights' gradients are not summed over ``expert`` (each device owns its experts, and the
all_to_all's transpose brought every copy routed to them); the router's are, as every weight
replicated over a token axis (``dew.parallel.gradients``).

Under ``tensor``, an MoE layer is a Megatron region like the MLP: each expert's width is split
over ``tensor``, the router runs outside the region (on this device's positions under
sequence-parallel activations), and the routing weights enter it through the same pair as the
activations, so their gradient comes back summed over the tensor group.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from dew.layout import weight_dimensions
from dew.mesh import TOKEN_AXES
from dew.nn import moe
from dew.parallel import ragged, tensor, tensor_ring

AXIS = "expert"


def check_experts(expert_size: int, num_experts: int) -> None:
    """Raises ``ValueError`` when ``num_experts`` does not split over ``expert_size`` devices."""
    if num_experts % expert_size:
        raise ValueError(
            f"num_experts {num_experts} does not split over expert {expert_size} "
            f"(each device of the expert axis holds num_experts / expert experts)"
        )


def exchange_slots(
    rows: int, seq: int, k: int, num_experts: int, expert_size: int, capacity: int | None
) -> int:
    """``B``: the copies one device can send to one device of the expert axis in an MoE layer,
    for ``rows x seq`` tokens routed to ``k`` experts each (``capacity``: per expert and row, or
    ``None`` for dropless)."""
    copies = rows * seq * k
    if capacity is None:
        return copies
    return min(copies, rows * capacity * (num_experts // expert_size))


def run_experts(
    experts: dict,
    copies: jax.Array,
    expert_of_copy: jax.Array,
    num_experts: int,
    slots: int,
    shards,
    *,
    exchange: str = "padded",
    buffer_factor: float | None = ragged.DEFAULT_BUFFER_FACTOR,
) -> tuple[jax.Array, jax.Array]:
    """Every copy through its expert, wherever that expert lives.

    Args:
      experts: this device's experts (``gate``, ``up``, ``down``, leading dim ``E / n``).
      copies: ``[c, embed]`` token copies.
      expert_of_copy: ``[c]`` int32 expert of each copy, ``num_experts`` for a dropped copy.
      slots: ``B`` of ``exchange_slots`` (read only over an expert axis).
      shards: the step's ``Shards``.
      exchange: ``"auto"``, ``"ragged"`` or ``"padded"`` (``dew.parallel.ragged.resolve``, on
        the platform of the devices the step is compiled for).
      buffer_factor: the ragged exchange's receive buffer over a device's balanced share
        (``dew.parallel.ragged.buffer_rows``).

    Returns ``(out, dropped)``: ``out`` ``[c, embed]`` each copy's expert output (a dropped
    copy's is zero), partial over ``tensor`` when each expert's width is split there;
    ``dropped`` the int32 count of copies the ragged exchange's receive buffers had no room for
    (0 otherwise).
    """
    n = shards.size(AXIS)
    order, sizes = moe.sort_into_groups(expert_of_copy, num_experts)
    none = jnp.zeros((), jnp.int32)
    # The experts' matmuls in the step's precision (int8 under StepOptions(quantize="int8")).
    proj = tensor_ring.region(shards)
    if n == 1:
        return moe.unsort(moe.grouped_swiglu(experts, copies[order], sizes, proj), order), none
    platform = ragged.compiled_platform()
    if ragged.resolve(exchange, platform) == "ragged":
        return _ragged(experts, copies, order, sizes, slots, n, buffer_factor, platform, proj)
    padded = _padded(experts, copies, order, sizes, expert_of_copy, num_experts, slots, n, proj)
    return padded, none


def _padded(experts, copies, order, sizes, expert_of_copy, num_experts, slots, n, proj):
    """The padded exchange: ``B`` slots for every destination, most of them zeros."""
    local = num_experts // n
    sorted_expert = expert_of_copy[order]
    # Sorted by expert is sorted by owner; a copy's slot is its place among its owner's copies.
    owner = sorted_expert // local  # n for a dropped copy: dropped by the scatters below
    first = jnp.cumsum(sizes.reshape(n, local).sum(axis=1)) - sizes.reshape(n, local).sum(axis=1)
    slot = jnp.arange(copies.shape[0]) - first[jnp.minimum(owner, n - 1)]
    outgoing = jnp.zeros((n, slots, copies.shape[1]), copies.dtype)
    outgoing = outgoing.at[owner, slot].set(copies[order], mode="drop")
    # Which of the receiver's experts each slot is for; ``local`` marks an empty slot.
    outgoing_expert = jnp.full((n, slots), local, jnp.int32)
    outgoing_expert = outgoing_expert.at[owner, slot].set(sorted_expert % local, mode="drop")

    # Dispatch: (n - 1) * B * embed activations out and in per device, plus (n - 1) * B int32.
    incoming = lax.all_to_all(outgoing, AXIS, 0, 0, tiled=True)
    incoming_expert = lax.all_to_all(outgoing_expert, AXIS, 0, 0, tiled=True)

    arrived = incoming.reshape(n * slots, -1)
    here, here_sizes = moe.sort_into_groups(incoming_expert.reshape(-1), local)
    done = moe.unsort(moe.grouped_swiglu(experts, arrived[here], here_sizes, proj), here)

    # Combine: the same bytes back to where each copy came from.
    returned = lax.all_to_all(done.reshape(n, slots, -1), AXIS, 0, 0, tiled=True)
    kept = owner < n
    out_sorted = jnp.where(
        kept[:, None], returned[jnp.minimum(owner, n - 1), jnp.clip(slot, 0, slots - 1)], 0
    )
    return moe.unsort(out_sorted, order)


def _ragged(experts, copies, order, sizes, slots, n, buffer_factor, platform, proj):
    """The ragged exchange (``dew.parallel.ragged``): only the copies routed to a device go
    there, into a receive buffer of ``R`` rows sorted by its experts; back the same way."""
    c = copies.shape[0]
    rows = ragged.buffer_rows(c, slots, n, buffer_factor)
    # The one exchange of counts: all_gather over expert of the [E] int32 copies per expert,
    # (n - 1) * E * 4 bytes in per device. Each sender needs where its runs land in each
    # receiver's buffer, which depends on what every device sends there: the whole [n, E].
    counts = lax.all_gather(sizes, AXIS)
    plan, group_sizes, dropped = ragged.route(counts, lax.axis_index(AXIS), rows)
    forward = ragged.Exchange(
        AXIS, rows_in=c, rows_out=rows, chunk=min(slots, rows), emulate=platform == "cpu"
    )
    # Dispatch: the operand is [c, embed], every copy this device routes (at most c * embed
    # values out, (n - 1) / n of them under an even spread); the receive buffer [R, embed].
    # Padded, the same step moves n * B * embed each way: dropless, B = c, so the ragged
    # exchange's static buffers are (c + R) / (2 n c) = (1 + f) / (2 n) of the padded ones
    # (f = R / c, the buffer factor: 3/16 at f = 2 and expert = 8).
    arrived = ragged.exchange(forward, copies[order], plan)
    done = moe.grouped_swiglu(experts, arrived, group_sizes, proj)
    # Combine: [R, embed] back (at most R * embed values out), into [c, embed] by expert;
    # the copies that found no room come back as zeros.
    returned = ragged.exchange(forward.reverse(), done, plan.reverse())
    return moe.unsort(returned, order), dropped


def routing_axes(shards) -> tuple[str, ...]:
    """The axes whose devices route different tokens of a microbatch: the token axes, and
    ``tensor`` under sequence-parallel activations (the router runs on each device's
    positions)."""
    axes = set(shards.token_axes())
    if tensor.sequence_parallel(shards) and shards.size(tensor.AXIS) > 1:
        axes.add(tensor.AXIS)
    return tuple(a for a in (*TOKEN_AXES, tensor.AXIS) if a in axes)


def moe_mlp(
    p: dict,
    h: jax.Array,
    shards,
    *,
    num_experts: int,
    k: int,
    capacity_factor: float | None,
    exchange: str = "auto",
    buffer_factor: float | None = ragged.DEFAULT_BUFFER_FACTOR,
) -> tuple[jax.Array, moe.RouterStats]:
    """An MoE layer in place of the MLP: ``h`` ``[rows, seq, embed]`` (normalised; ``[rows, seq /
    t, embed]`` under sequence-parallel activations) -> ``(out, stats)``, ``out`` shaped like
    ``h``, to add to the residual.

    ``p``: ``router`` and ``experts`` of ``dew.nn.moe.moe_params`` as this device holds them
    (experts split over ``expert``, their width over ``tensor``, nothing over fsdp any more).
    ``exchange`` and ``buffer_factor``: how copies cross an expert axis (``run_experts``).
    ``stats.dropped`` counts the copies a capacity dropped and those a ragged exchange's receive
    buffer had no room for.
    """
    rows, positions, width = h.shape
    ids, weights, probs, lse = moe.route(p["router"]["kernel"], h.reshape(-1, width), k)

    # Load balance and z-loss: this device's share (see dew.nn.moe); the expert counts are the
    # microbatch's, a psum of [E] float32 over the routing axes, forward only.
    counts = moe.expert_counts(ids, num_experts)
    axes = routing_axes(shards)
    if axes:
        counts = lax.psum(counts, axes)
    fraction = lax.stop_gradient(counts / jnp.sum(counts))
    load_balance = num_experts * jnp.sum(fraction * jnp.sum(probs, axis=0))
    z_loss = jnp.sum(lse**2)
    if tensor.sequence_parallel(shards):
        # Each device of the tensor group routed its own positions: sum the shares over it (the
        # loss is the same on every device of the group), their gradients staying each device's.
        load_balance, z_loss = tensor.reduce_from_region(jnp.stack([load_balance, z_loss]), shards)

    # Into the Megatron region: the tokens, their routing weights (whose gradient comes back
    # summed over the group) and their experts, whole on every device of the tensor group.
    x = tensor.enter(h, shards)
    weights = tensor.enter(weights.reshape(rows, positions, k), shards)
    ids = ids.reshape(rows, positions, k)
    if tensor.sequence_parallel(shards) and shards.size(tensor.AXIS) > 1:
        # (n - 1) * rows * seq/n * k int32 in and out: the experts of the others' positions.
        ids = lax.all_gather(ids, tensor.AXIS, axis=1, tiled=True)
    seq = x.shape[1]

    limit = None
    keep = jnp.ones(ids.shape, bool)
    if capacity_factor is not None:
        limit = moe.capacity(seq, k, num_experts, capacity_factor)
        keep = moe.within_capacity(ids, num_experts, limit)
    expert_of_copy = jnp.where(keep, ids, num_experts).reshape(-1)
    copies = jnp.repeat(x.reshape(-1, width), k, axis=0)  # [rows * seq * k, embed], token-major
    slots = exchange_slots(rows, seq, k, num_experts, shards.size(AXIS), limit)
    out, overflow = run_experts(
        p["experts"],
        copies,
        expert_of_copy,
        num_experts,
        slots,
        shards,
        exchange=exchange,
        buffer_factor=buffer_factor,
    )
    out = out.reshape(rows, seq, k, width)
    y = jnp.einsum("rskd,rsk->rsd", out, weights.astype(out.dtype))
    stats = moe.RouterStats(
        load_balance=load_balance,
        z_loss=z_loss,
        dropped=(jnp.sum(~keep) + overflow).astype(jnp.float32),
        routed=jnp.asarray(keep.size, jnp.float32),
    )
    return tensor.leave(y, shards), stats


def check_layout(param_specs: Any, logical_axes: Any, expert_size: int) -> None:
    """Raises ``ValueError`` unless every ``experts`` dimension is split over ``expert`` (and
    nothing else is): the exchange sends each device the copies for the experts it holds."""
    if expert_size == 1:
        return
    for where, names, spec, name, mesh_axes, _ in weight_dimensions(param_specs, logical_axes):
        if (AXIS in mesh_axes) != (name == "experts"):
            raise ValueError(
                f"expert {expert_size}: weight {where} (logical axes {names}) has spec {spec}; "
                f"the model needs each 'experts' dimension, and only it, split over {AXIS!r}: "
                "give the Layout the rule ('experts', 'expert') first, as "
                "dew.layout.DEFAULT_RULES does"
            )
