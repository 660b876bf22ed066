"""Segment ids (documents packed in one row): the public argument's checks, the layouts the
kernels read the ids in, and the per-tile id ranges that let a kernel skip tiles.

A query attends only to keys with its own id (on top of the causal mask and the window). The ids
are data, not shapes, so which blocks hold a pair of equal ids is decided from them before each
call, in XLA, and read by the kernels while they run:

- Per tile of positions (a query block or strip, a key block or piece), the smallest and the
  largest id (`tile_ranges`). A (query tile, key tile) pair can hold a pair of equal ids only if
  their ranges meet: ``q_max >= kv_min and kv_max >= q_min`` (`overlaps`). A pair whose ranges
  are disjoint is skipped; any other is computed with the ids' mask applied element by element.
  For ids that increase along the row (documents one after another, numbered in order) a pair
  is computed only if its tiles share a document. For ids in any other order the ranges are
  wider and fewer tiles are skipped, but the mask makes the results the same.
- The tables travel as scalar prefetch (SMEM), flattened to one dimension ``[batch * tiles]``.
- A step whose block pair is skipped also fetches nothing new: its index maps read the blocks of
  the next step that computes (`fetch_steps`), which the pipeline then copies once, early.

Padding: ids are padded at the end with their last value (`pad`), which leaves every tile's
range as the real positions make it; padded keys are masked by position in any case.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

LANES = 128
SUBLANES = 8
# The ids' tables' dtype. Their constants are typed too (``ID_DTYPE.type(n)``): a bare Python int
# in ``jnp.where`` enters the program as an int64 under ``jax_enable_x64`` (tests/test_x64.py).
ID_DTYPE = np.dtype(np.int32)
# The most entries a kernel's per-row segment tables (fetch steps and id ranges, all batch rows)
# may take: 128 KiB of SMEM, beside the step tables' 256 KiB at most (`kernels.schedule`), of the
# 1 MiB a TensorCore has.
MAX_TABLE_ENTRIES = 32768


def _describe(x) -> str:
    shape = tuple(getattr(x, "shape", ()))
    dtype = getattr(x, "dtype", None)
    return f"{shape} {np.dtype(dtype).name}" if dtype is not None else type(x).__name__


def check(segment_ids, batch: int, q_len: int, kv_len: int):
    """``segment_ids`` as ``(q_ids, kv_ids)`` (int32 ``[batch, q_len]``, ``[batch, kv_len]``),
    or None; a ValueError naming the shapes and dtypes for anything else.

    Takes None, one array ``[batch, seq]`` (self-attention: ``q_len == kv_len``, the same ids
    for queries and keys) or a pair ``(q_ids, kv_ids)``."""
    if segment_ids is None:
        return None
    if isinstance(segment_ids, (tuple, list)):
        if len(segment_ids) != 2:
            raise ValueError(
                "flash_attention: segment_ids must be one int32 [batch, seq] array or a pair "
                f"(q_ids, kv_ids); got a {type(segment_ids).__name__} of {len(segment_ids)}"
            )
        q_ids, kv_ids = segment_ids
    else:
        if q_len != kv_len:
            raise ValueError(
                f"flash_attention: one segment_ids array is for self-attention (q_len == "
                f"kv_len); q_len is {q_len} and kv_len {kv_len}: pass a pair (q_ids, kv_ids)"
            )
        q_ids = kv_ids = segment_ids
    for name, ids, length in (("q_ids", q_ids, q_len), ("kv_ids", kv_ids, kv_len)):
        if not (hasattr(ids, "shape") and hasattr(ids, "dtype")):
            raise ValueError(
                f"flash_attention: segment_ids' {name} must be an int32 array; got "
                f"{type(ids).__name__}"
            )
        if tuple(ids.shape) != (batch, length):
            raise ValueError(
                f"flash_attention: segment_ids' {name} must be [batch, {name[:-4]}_len] = "
                f"{(batch, length)}; got {_describe(ids)}"
            )
        if np.dtype(ids.dtype) != ID_DTYPE:
            raise ValueError(
                f"flash_attention: segment_ids must be int32; {name} is {_describe(ids)}"
            )
    return q_ids, kv_ids


def pad(ids, length: int):
    """``[batch, n]`` ids -> ``[batch, length]``, repeating the last id (no tile's range
    widens)."""
    if ids.shape[1] == length:
        return ids
    return jnp.pad(ids, ((0, 0), (0, length - ids.shape[1])), mode="edge")


def tile_ranges(ids, tile: int):
    """``(lo, hi)``, int32 ``[batch, n // tile]``: the smallest and largest id of each tile of
    ``ids`` ``[batch, n]`` (``n`` a multiple of ``tile``)."""
    tiles = ids.reshape(ids.shape[0], -1, tile)
    return jnp.min(tiles, axis=2), jnp.max(tiles, axis=2)


def overlaps(q_lo, q_hi, kv_lo, kv_hi):
    """Whether a query tile with ids in ``[q_lo, q_hi]`` and a key tile with ids in
    ``[kv_lo, kv_hi]`` can hold a pair of equal ids (arrays or traced scalars)."""
    return jnp.logical_and(q_hi >= kv_lo, kv_hi >= q_lo)


def fetch_steps(computes):
    """``computes`` bool ``[batch, steps]`` (whether each step of a walk computes) -> int32
    ``[batch, steps]``: the step whose input blocks each step fetches. A step that computes
    fetches its own; one that does not, those of the next step that does, else of the last one
    that did (already in VMEM), else of step 0. So a run of skipped steps copies only what the
    next computed step reads."""
    steps = computes.shape[1]
    index = jnp.arange(steps, dtype=ID_DTYPE)
    following = lax.cummin(jnp.where(computes, index, ID_DTYPE.type(steps)), axis=1, reverse=True)
    preceding = lax.cummax(jnp.where(computes, index, ID_DTYPE.type(-1)), axis=1)
    fallback = jnp.maximum(preceding, 0)
    return jnp.where(following < steps, following, fallback).astype(ID_DTYPE)


def lanes(ids):
    """``[batch, n]`` -> ``[batch, n, 128]``: each id across a row of lanes, so that a block of
    it is a ``[rows, 128]`` column the rows of a ``[rows, keys]`` tile broadcast along."""
    return jnp.broadcast_to(ids[:, :, None], (*ids.shape, LANES))


def rows(ids):
    """``[batch, n]`` -> ``[batch, 8, n]``: the ids as a row (repeated on 8 sublanes, a whole
    tile), which a ``[rows, keys]`` tile broadcasts down its rows."""
    return jnp.broadcast_to(ids[:, None, :], (ids.shape[0], SUBLANES, ids.shape[1]))


def flat(x):
    """An SMEM table: ``[batch, n]`` -> ``[batch * n]`` (2-D SMEM arrays are padded to whole
    tiles; a flat one is not)."""
    return x.reshape(-1).astype(ID_DTYPE)


def block_bounds(q_lo, q_hi, kv_lo, kv_hi):
    """``(lo, hi)``, int32 ``[batch, q_tiles]``: for each query tile the key tiles ``[lo, hi)``
    from the first to the last whose ids can meet its own (``lo == hi`` where none can). The
    Triton kernels loop over that range: exact for increasing ids; tiles inside it that share no
    id are computed with the mask. The transposed call gives each key tile its query tiles."""
    meet = overlaps(q_lo[:, :, None], q_hi[:, :, None], kv_lo[:, None, :], kv_hi[:, None, :])
    tiles = meet.shape[2]
    index = jnp.arange(tiles, dtype=ID_DTYPE)
    lo = jnp.min(jnp.where(meet, index, ID_DTYPE.type(tiles)), axis=2)
    hi = jnp.max(jnp.where(meet, index + 1, ID_DTYPE.type(0)), axis=2)
    return jnp.minimum(lo, hi).astype(ID_DTYPE), hi.astype(ID_DTYPE)
