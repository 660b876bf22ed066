"""The fsdp gathers of int8 projections' weights, moved as int8 with their scales
(``StepOptions(quantize="int8")``).

An int8 projection (``dew.nn.quantized.int8_einsum``) quantizes its whole weight per output
channel over the dimensions its einsum sums over: ``scale = max |row| * float32(1 / 127)``, ``q =
round(w / scale)``. Under fsdp each device holds a block of the weight along one dimension; the
gather (``dew.parallel.fsdp.gather`` with ``int8=``) sends each block already quantized, with the
whole weight's scales, so the wire carries one byte an entry where it carried the weight's dtype:

    peak   = max |shard| over the summed dimensions     float32, one per (local) output channel
             pmax over the mesh axes splitting them     fsdp, when the split is along a summed
                                                        dimension; tensor, for a row-parallel one
    q      = round(shard / scale(peak)) in [-127, 127]  the integers one device holding the whole
                                                        weight computes for these entries
    sent   = q (int8), and the peaks (float32 as 4 int8 each) when fsdp splits the output
             channels (else every device holds them all already, from the pmax)
    whole  = dequantize(all_gather(sent))               in the weight's dtype

The dequantized weight is what ``int8_einsum`` quantizes again, and it gives back the same
integers and scales bit for bit: an entry at 127 steps is written as its channel's peak itself
(not ``127 * scale``, which misses the peak by an ulp about one time in 25, and the rescaled
scale with it), every other entry as ``q * scale``, which rounds back to ``q`` (it is off by
far less than half a step, in float32 or bfloat16), and the row's largest magnitude is the peak
again, whose scale is the one sent. So the einsum multiplies exactly the integers one device
computes, and ``dew.nn.quantized`` is used as it is, a float weight in, its float gradient out.

The peaks travel in place of the scales (the same 4 bytes a channel): a scale does not give back
its peak, and the dequantized weight needs it. Bytes on the wire, per device and gather, for
``n`` devices and a weight of ``E`` entries and ``C`` output channels: ``(n - 1) / n * E`` in the
all-gather, ``+ (n - 1) / n * 4 C`` when fsdp splits the channels; else a ``pmax`` of ``4 C``
bytes (``2 (n - 1) / n * 4 C`` on the wire) before it.

Passing the integers and scales to the einsum instead of a dequantized weight would save the
whole float weight's temporary, but needs an int8 einsum taking them, with a weight gradient
(``frozen_int8_einsum`` has none): this keeps one int8 matmul, tested once.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from dew.nn.int8 import QMAX
from dew.nn.param import spec_labels
from dew.nn.quantized import _scale as scale_of_peak
from dew.parallel.ring import AXIS, ring_gather


def summed_dims(spec: str) -> tuple[int, ...]:
    """The weight's dimensions an einsum ``spec`` (``x`` first, the weight second) sums over:
    those ``x`` names. ``"bhsd,hde->bse"`` -> ``(0, 1)``. ``ValueError`` unless each of the
    weight's labels is named by exactly one of ``x`` and the output (an int8 projection's
    weight, ``dew.nn.quantized.int8_einsum``)."""
    x, w, out = spec_labels(spec)
    if any((label in x) == (label in out) for label in w):
        raise ValueError(
            f"einsum {spec!r}: an int8 projection's weight has each dimension named by exactly "
            "one of x and the output"
        )
    return tuple(i for i, label in enumerate(w) if label in x)


# One decoder layer's int8 projections, by their path in the layer's weights: the weight's
# dimensions their matmuls sum over, from the einsums of dew.nn.attention.self_attention and
# dew.nn.mlp.swiglu; the experts' ([experts, in, out], dew.nn.moe's ragged_dot) sum over ``in``.
# Whatever the layout, the scales are over these dimensions of the whole weight.
LAYER_PROJECTIONS: dict[tuple[str, ...], tuple[int, ...]] = {
    **{("attn", k): summed_dims("bse,ehd->bhsd") for k in ("q", "k", "v")},
    ("attn", "o"): summed_dims("bhsd,hde->bse"),
    ("mlp", "gate"): summed_dims("te,ef->tf"),
    ("mlp", "up"): summed_dims("te,ef->tf"),
    ("mlp", "down"): summed_dims("tf,fe->te"),
    **{("moe", "experts", k): (1,) for k in ("gate", "up", "down")},
}


@dataclasses.dataclass(frozen=True)
class Member:
    """One weight gathered as int8 (static: the shapes and axes its gather needs).

    Attributes:
      shape: this device's block of the weight.
      dim: the dimension fsdp splits.
      summed: the dimensions the weight's einsum sums over (``summed_dims``).
      peak_axes: the mesh axes splitting a summed dimension (size above 1, fsdp among them when
        ``dim`` is summed): each channel's peak is the largest over them (a ``pmax``).
    """

    shape: tuple[int, ...]
    dim: int
    summed: tuple[int, ...]
    peak_axes: tuple[str, ...]

    @property
    def sends_peaks(self) -> bool:
        """Whether fsdp splits the output channels, so each device's peaks travel with it."""
        return self.dim not in self.summed

    @property
    def peak_shape(self) -> tuple[int, ...]:
        """This device's peaks: ``shape`` without the summed dimensions."""
        return tuple(s for d, s in enumerate(self.shape) if d not in self.summed)

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def member(shape: Sequence[int], dim: int, summed: Sequence[int], spec, sizes) -> Member:
    """The ``Member`` of a weight block of ``shape`` split over fsdp along ``dim``, laid out by
    the ``PartitionSpec`` ``spec`` (of the whole weight, as the gather sees it) on a mesh of axis
    ``sizes`` (a name -> size mapping)."""
    summed = tuple(sorted(d % len(shape) for d in summed))
    if not summed or len(set(summed)) != len(summed) or summed[-1] >= len(shape):
        raise ValueError(f"summed dimensions {summed} of a weight of shape {tuple(shape)}")
    axes = []
    entries = tuple(spec) + (None,) * (len(shape) - len(tuple(spec)))
    for d in summed:
        for axis in entries[d] if isinstance(entries[d], tuple) else (entries[d],):
            if axis is not None and sizes.get(axis, 1) > 1 and axis not in axes:
                axes.append(axis)
    return Member(tuple(shape), dim, summed, tuple(axes))


def quantize(blocks: Sequence[jax.Array], members: Sequence[Member]):
    """``(qs, peaks)``: each block's int8 integers and its channels' float32 peaks (the summed
    dimensions dropped), both those of the whole weight: the peaks are the largest over each
    member's ``peak_axes`` (one ``pmax`` per distinct set of axes)."""
    peaks = [
        jnp.max(jnp.abs(b.astype(jnp.float32)), axis=m.summed) for b, m in zip(blocks, members)
    ]
    by_axes: dict[tuple[str, ...], list[int]] = {}
    for i, m in enumerate(members):
        if m.peak_axes:
            by_axes.setdefault(m.peak_axes, []).append(i)
    for axes, idx in by_axes.items():
        # A few floats a channel: one all-reduce for every member summed over the same axes.
        for i, p in zip(idx, lax.pmax([peaks[i] for i in idx], axes)):
            peaks[i] = p
    qs = []
    for b, m, p in zip(blocks, members, peaks):
        scale = scale_of_peak(jnp.expand_dims(p, m.summed))
        q = jnp.clip(jnp.round(b.astype(jnp.float32) / scale), -QMAX, QMAX)
        qs.append(q.astype(jnp.int8))
    return qs, peaks


def gather_int8(qs, peaks, members: Sequence[Member], n: int, ring: bool):
    """``(q_blocks, peak_blocks)``: every device's integers, ``[n, *shape]`` each (device ``i``'s
    at row ``i``), in one int8 gather over fsdp of all members' integers and the peaks fsdp splits
    (as 4 int8 each); peaks ``[n, *peak_shape]`` where they travelled, else the member's own,
    every device's alike (``[*peak_shape]``). ``ring``: a ring of ``ppermute`` s
    (``ring.ring_gather``) in place of the ``all_gather``."""
    parts = []
    for q, p, m in zip(qs, peaks, members):
        parts.append(q.reshape(-1))
        if m.sends_peaks:
            parts.append(lax.bitcast_convert_type(p, jnp.int8).reshape(-1))
    flat = jnp.concatenate(parts) if len(parts) > 1 else parts[0]
    if ring:
        gathered = ring_gather(flat[None], 0, n)
    else:
        gathered = lax.all_gather(flat, AXIS, axis=0, tiled=False)  # [n, payload]
    q_blocks, peak_blocks, start = [], [], 0
    for p, m in zip(peaks, members):
        q_blocks.append(gathered[:, start : start + m.size].reshape(n, *m.shape))
        start += m.size
        if m.sends_peaks:
            count = 4 * math.prod(m.peak_shape)
            raw = gathered[:, start : start + count].reshape(n, *m.peak_shape, 4)
            peak_blocks.append(lax.bitcast_convert_type(raw, jnp.float32))
            start += count
        else:
            peak_blocks.append(p)
    return q_blocks, peak_blocks


def _per_entry(peak_block: jax.Array, m: Member) -> jax.Array:
    """A member's peaks (``[n, *peak_shape]`` or ``[*peak_shape]``) broadcastable against its
    ``[n, *shape]`` integers."""
    if peak_block.ndim == len(m.peak_shape):
        peak_block = peak_block[None]
    return jnp.expand_dims(peak_block, tuple(d + 1 for d in m.summed))


def dequantize(q_block: jax.Array, peak_block: jax.Array, m: Member, dtype) -> jax.Array:
    """``[n, *shape]`` in ``dtype`` whose quantization over the summed dimensions is exactly
    ``q_block`` with the scales of ``peak_block`` (the module docstring): an entry at 127 steps
    is its channel's peak, the others ``q * scale``."""
    peak = _per_entry(peak_block, m)
    steps = q_block.astype(jnp.float32)
    value = jnp.where(jnp.abs(steps) == QMAX, jnp.sign(steps) * peak, steps * scale_of_peak(peak))
    return value.astype(dtype)


def whole(blocks: jax.Array, dim: int) -> jax.Array:
    """``[n, *shape]`` (device ``i``'s block at row ``i``) -> the whole weight, the blocks in
    order along ``dim``: what a tiled ``all_gather`` along ``dim`` gives."""
    n, shape = blocks.shape[0], blocks.shape[1:]
    moved = jnp.moveaxis(blocks, 0, dim)
    return moved.reshape(*shape[:dim], n * shape[dim], *shape[dim + 1 :])


def gathered(blocks: Sequence[jax.Array], members: Sequence[Member], n: int, ring: bool, dtype):
    """Each member's dequantized blocks ``[n, *shape]`` in ``dtype``: ``quantize``, then
    ``gather_int8``, then ``dequantize``."""
    qs, peaks = quantize(blocks, members)
    q_blocks, peak_blocks = gather_int8(qs, peaks, members, n, ring)
    return [dequantize(q, p, m, dtype) for q, p, m in zip(q_blocks, peak_blocks, members)]
