"""The ragged expert exchange: each device of the ``expert`` axis receives exactly the token copies
routed to its experts, by ``lax.ragged_all_to_all``, into a receive buffer of a stated bound.

``dew.parallel.expert`` sorts a device's copies by expert, exchanges the ``[E]`` int32 counts once
(an ``all_gather``: every device then holds the group's ``[n, E]`` count matrix) and calls
``route`` for the offsets and sizes. Both directions then move through ``exchange``:

    dispatch   copies [c, embed], sorted by expert -> receive buffer [R, embed]
    combine    the experts' outputs [R, embed] -> [c, embed], back where each copy came from
    backward   each one's transpose is the other direction (``Route.reverse``): a custom_vjp,
               so the backward needs no offsets beyond the forward's

The receive buffer holds this device's ``L = E / n`` experts' copies expert by expert, each
expert's from source device 0 up, so it arrives sorted by local expert, ready for the grouped
matmul: one slice per (destination, expert) pair, ``L`` slices per destination, which
``ragged_all_to_all`` allows (``len(offsets)`` a multiple of the axis size). It has ``R`` rows
(``buffer_rows``); a copy whose place lies past ``R`` is not sent, its output is zero and it is
counted in ``Route.dropped`` (the metrics' ``dropped_fraction``). Which copies those are is fixed:
the last of the buffer's order, so a device's later local experts, and within an expert the
higher source devices, lose theirs first.

XLA:CPU has no ``ragged_all_to_all``. On CPU ``exchange`` runs ``emulated_ragged_all_to_all``,
which takes the same arguments and gives the same result: the padded ``all_to_all`` of each
destination's slices, then a scatter of what arrived to the offsets its senders gave. It reads the
senders' ``output_offsets`` (exchanged with them, as the primitive does), not offsets of its own,
so the offsets the accelerator path sends are the ones the CPU tests check.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

EXCHANGES = ("auto", "ragged", "padded")
# Platforms whose XLA implements ragged-all-to-all; "auto" picks the ragged exchange on them.
RAGGED_PLATFORMS = frozenset({"tpu", "gpu", "cuda", "rocm"})
# The receive buffer's default bound, over a device's balanced share (see ``buffer_rows``).
DEFAULT_BUFFER_FACTOR = 2.0


def check_exchange(exchange, buffer_factor) -> None:
    """Raises ``ValueError`` for an ``expert_exchange`` not in ``EXCHANGES`` or an
    ``expert_buffer_factor`` that is neither ``None`` nor above 0."""
    if exchange not in EXCHANGES:
        raise ValueError(
            f"unknown expert_exchange {exchange!r}; expected one of {', '.join(EXCHANGES)} "
            "(auto: ragged on TPU and GPU, padded on CPU, from the devices the step is "
            "compiled for)"
        )
    if buffer_factor is not None and (
        isinstance(buffer_factor, bool)
        or not isinstance(buffer_factor, (int, float))
        or not buffer_factor > 0
    ):
        raise ValueError(
            "expert_buffer_factor must be None (a worst-case receive buffer, which never drops) "
            f"or above 0 (the buffer over a device's balanced share of copies), got "
            f"{buffer_factor!r}"
        )


def compiled_platform() -> str:
    """The platform of the devices the step being traced is compiled for: the mesh's, which
    ``shard_map`` gives its body as the abstract mesh's device (a step compiled for a TPU slice on
    a CPU host says ``"tpu"``); ``jax.default_backend()`` where no mesh says."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    return device.platform if device is not None else jax.default_backend()


def partitioned_devices() -> int:
    """The devices XLA's partitioner splits the computation being traced over: the abstract
    mesh's axes that are not manual. 1 inside a shard_map body over every axis (Dew's engine) and
    where no mesh is set; the mesh's size under the GSPMD engine (traced on its abstract mesh:
    ``dew.training.step.on_abstract_mesh``)."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = set(mesh.manual_axes)
    return math.prod(n for a, n in zip(mesh.axis_names, mesh.axis_sizes) if a not in manual)


def resolve(exchange: str, platform: str) -> str:
    """``"ragged"`` or ``"padded"`` for the setting ``exchange`` on ``platform``."""
    if exchange == "auto":
        return "ragged" if platform in RAGGED_PLATFORMS else "padded"
    return exchange


def buffer_rows(copies: int, slots: int, expert_size: int, factor: float | None) -> int:
    """``R``, the rows of a device's receive buffer.

    ``copies``: the copies each device routes (``rows * seq * k``), which is also a device's
    balanced share of what arrives; ``slots``: the most one device can send one device (``B`` of
    ``expert.exchange_slots``), so ``expert_size * slots`` is the worst case. ``R = min(worst,
    ceil(factor * copies))``; ``factor=None`` is the worst case (nothing ever drops, at the padded
    exchange's receive memory).
    """
    worst = expert_size * slots
    if factor is None:
        return worst
    return max(1, min(worst, math.ceil(factor * copies)))


class Route(NamedTuple):
    """One device's side of a ragged exchange: ``[K]`` int32 each, ``K = E`` slices, ``E / n``
    per device of the axis. The first four are ``lax.ragged_all_to_all``'s arguments.

    input_offsets, send_sizes: where slice ``i`` starts in this device's operand, and its rows;
      it goes to device ``i // (K / n)``.
    output_offsets: where slice ``i`` lands in its receiver's output.
    recv_sizes: rows of the ``j``-th slice received (from device ``j // (K / n)``).
    recv_offsets: where that slice lands in this device's output (the senders' output_offsets).
    source_offsets: where it started in its sender's operand (the senders' input_offsets).
    """

    input_offsets: jax.Array
    send_sizes: jax.Array
    output_offsets: jax.Array
    recv_sizes: jax.Array
    recv_offsets: jax.Array
    source_offsets: jax.Array

    def reverse(self) -> "Route":
        """The route back: every received slice returns from where it landed to where it came
        from (the combine, and the transpose of either direction)."""
        return Route(
            input_offsets=self.recv_offsets,
            send_sizes=self.recv_sizes,
            output_offsets=self.source_offsets,
            recv_sizes=self.send_sizes,
            recv_offsets=self.input_offsets,
            source_offsets=self.output_offsets,
        )


def route(counts: jax.Array, me, rows: int) -> tuple[Route, jax.Array, jax.Array]:
    """The dispatch's ``Route`` for device ``me`` of the expert axis.

    Args:
      counts: ``[n, E]`` int32, ``counts[s, e]`` the copies device ``s`` routes to expert ``e``
        (every device holds the same matrix: one ``all_gather`` of each device's ``[E]``).
      me: this device's index on the axis (``lax.axis_index``).
      rows: ``R``, the receive buffer's rows.

    Returns ``(route, group_sizes, dropped)``: ``group_sizes`` ``[E / n]`` int32 the copies of each
    local expert in this device's buffer (in that order, from row 0); ``dropped`` the int32 count
    of this device's copies that found no room in their receiver's buffer.
    """
    n, num_experts = counts.shape
    local = num_experts // n
    counts = counts.astype(jnp.int32)

    def exclusive_cumsum(a, axis):
        return jnp.cumsum(a, axis=axis) - a

    # A receiver's buffer: its experts in order, each expert's copies from source 0 up.
    expert_start = exclusive_cumsum(jnp.sum(counts, axis=0).reshape(n, local), 1).reshape(-1)
    start = expert_start[None, :] + exclusive_cumsum(counts, 0)  # [n, E]: run (s, e) there
    kept = jnp.clip(rows - start, 0, counts)  # what fits under R
    at = exclusive_cumsum(counts, 1)  # [n, E]: run (s, e) in s's operand (sorted by expert)

    def received(a):  # [n, E] -> [n * local]: the runs for my experts, slice j = s * local + l
        return lax.dynamic_slice_in_dim(a, me * local, local, axis=1).reshape(-1)

    send_sizes, recv_sizes = kept[me], received(kept)

    def where_sent(offsets, sizes):  # an empty slice's offset may point past the buffer: 0
        return jnp.where(sizes > 0, offsets, 0)

    plan = Route(
        input_offsets=where_sent(at[me], send_sizes),
        send_sizes=send_sizes,
        output_offsets=where_sent(start[me], send_sizes),
        recv_sizes=recv_sizes,
        recv_offsets=where_sent(received(start), recv_sizes),
        source_offsets=where_sent(received(at), recv_sizes),
    )
    group_sizes = jnp.sum(recv_sizes.reshape(n, local), axis=0)
    dropped = jnp.sum(counts[me]) - jnp.sum(send_sizes)
    return plan, group_sizes, dropped


def emulated_ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name, chunk
):
    """``lax.ragged_all_to_all`` on a backend without it (XLA:CPU), the same arguments and result.

    ``chunk``: a static bound on the rows one device sends one device (the sum of its slices to
    it); rows past it would be lost, so the caller guarantees it. Moves ``[n, chunk, ...]`` by
    ``all_to_all``: ``(n - 1) * chunk`` rows out and in per device, and the ``[K]`` int32
    ``output_offsets``.
    """
    n = lax.axis_size(axis_name)
    per = input_offsets.shape[0] // n
    row = jnp.arange(chunk)

    def packed(offsets, sizes):
        """For block ``b`` (a peer) and packed row ``j`` (its slices back to back): the row
        ``offsets`` places it at, and whether ``j`` is in a slice at all."""
        offsets, sizes = offsets.reshape(n, per), sizes.reshape(n, per)
        ends = jnp.cumsum(sizes, axis=1)
        piece = jax.vmap(lambda e: jnp.searchsorted(e, row, side="right"))(ends)  # [n, chunk]
        inside = piece < per
        piece = jnp.minimum(piece, per - 1)
        first = jnp.take_along_axis(ends - sizes, piece, axis=1)
        return jnp.take_along_axis(offsets, piece, axis=1) + row - first, inside

    source, inside = packed(input_offsets, send_sizes)
    picked = operand[jnp.clip(source, 0, operand.shape[0] - 1)]  # [n, chunk, ...]
    mask = inside.reshape(inside.shape + (1,) * (operand.ndim - 1))
    blocks = jnp.where(mask, picked, jnp.zeros((), operand.dtype))
    # The padded exchange: (n - 1) * chunk rows each way per device; then the senders' offsets,
    # (n - 1) * K / n int32, which say where their rows go in this device's output.
    arrived = lax.all_to_all(blocks, axis_name, 0, 0, tiled=True)
    offsets_here = lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    target, inside = packed(offsets_here, recv_sizes)
    target = jnp.where(inside, target, output.shape[0])  # past the end: dropped by the scatter
    flat = arrived.reshape((n * chunk,) + arrived.shape[2:])
    return output.at[target.reshape(-1)].set(flat, mode="drop")


class Exchange(NamedTuple):
    """The static side of one direction of an exchange (hashable: ``custom_vjp``'s static
    argument)."""

    axis: str
    rows_in: int  # the operand's rows
    rows_out: int  # the output buffer's rows
    chunk: int  # the emulation's bound on what one device sends one device
    emulate: bool  # XLA:CPU: emulated_ragged_all_to_all

    def reverse(self) -> "Exchange":
        return self._replace(rows_in=self.rows_out, rows_out=self.rows_in)


def _move(static: Exchange, x: jax.Array, plan: Route) -> jax.Array:
    output = jnp.zeros((static.rows_out,) + x.shape[1:], x.dtype)
    args = (x, output, plan.input_offsets, plan.send_sizes, plan.output_offsets, plan.recv_sizes)
    if static.emulate:
        return emulated_ragged_all_to_all(*args, axis_name=static.axis, chunk=static.chunk)
    # The ragged exchange: at most rows_in * row bytes out per device (the copies bound for other
    # devices) and at most rows_out * row bytes in; the HLO counter counts the operand, the bound.
    return lax.ragged_all_to_all(*args, axis_name=static.axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def exchange(static: Exchange, x: jax.Array, plan: Route) -> jax.Array:
    """``x`` ``[static.rows_in, ...]`` moved along ``plan`` into a zero ``[static.rows_out,
    ...]`` buffer (rows nothing lands on stay zero). Its backward is the reverse exchange of the
    cotangent (``plan.reverse()``), written here rather than left to JAX's transpose of the
    primitive, which exchanges the offsets again."""
    return _move(static, x, plan)


def _exchange_fwd(static, x, plan):
    return _move(static, x, plan), plan


def _exchange_bwd(static, plan, cotangent):
    return _move(static.reverse(), cotangent, plan.reverse()), None


exchange.defvjp(_exchange_fwd, _exchange_bwd)
