"""The vocabulary split over fsdp: move the group's tokens, not the embedding table.

Under fsdp a weight is gathered whole before it is used and its gradient reduce-scattered after.
The embedding table (and an untied output head) is the weight where that costs most: Llama 3's
``128256 x 2048`` table is 1 GiB in float32, and gathering it means every device also computes,
holds and reduce-scatters the whole table's float32 gradient, while the tokens an fsdp group holds
may number far fewer than the table's rows. When the layout splits the vocabulary over fsdp (the
``("vocab", "fsdp")`` rule, with no tensor axis) and a device holds no more tokens than table rows
(``moves_tokens``), the lookup, the head and the loss run on the table's split instead, as tensor
parallelism runs them over ``tensor``, but across the fsdp group's rows:

- ``embed``: ``all_gather`` the group's token ids (int32); each device looks up the ids its slice
  of the vocabulary holds, for every row of the group (zeros for the others), and a
  ``psum_scatter`` over the rows hands each device its own rows (one nonzero term per element:
  exact). Backward (autodiff's transposes): ``all_gather`` of the rows' gradient, scatter-added
  into the local slice.
- ``loss_sum``: ``all_gather`` the normalized activations over the rows; the local slice's logits
  for the group's tokens a chunk at a time (``dew.nn.cross_entropy``: ``[chunk, vocab / n]``,
  never the whole ``[tokens, vocab / n]``), the cross-entropy's max and sums over the vocabulary
  by ``pmax`` and ``psum`` over fsdp, device 0 counting the group's loss. Backward: the loss's
  cotangent summed over fsdp scales each slice's gradient, made in the forward; the
  ``all_gather`` transposes to a ``psum_scatter`` of the activations' gradient back to their rows.

Either way a table slice's gradient is the fsdp group's sum for that slice, as the gathered path's
``psum_scatter`` leaves it, so ``dew.parallel.gradients`` sums it over no further axis.

Bytes per device per step, ``n`` devices in the group, ``T`` tokens per device, width ``D``, ``e``
bytes per activation element, the table ``V x D`` (``e`` bytes once cast):

- gathered: ``(n - 1) / n x V x D x e`` per gather (forward, and again where the backward
  recomputes it) and ``(n - 1) / n x V x D x 4`` to reduce-scatter the float32 gradient; the whole
  table and its float32 gradient are live on every device.
- here: ``(n - 1) x T x D x e`` for each of the head's ``all_gather`` and the embedding's
  ``psum_scatter``, as much again backward, plus ``[n T]`` and ``[n T, 2]`` float32 sums. Nothing
  of size ``V x D`` beyond the local slice.

``T <= V / n`` makes the second the smaller, which is the rule ``moves_tokens`` applies.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from dew.nn import cross_entropy
from dew.parallel import fsdp, tensor

AXIS = fsdp.AXIS


def moves_tokens(spec: P | None, vocab_dim: int, local_rows: int, tokens: int, shards) -> bool:
    """Whether a table of ``spec`` (its vocabulary at ``vocab_dim``) runs this module's path: the
    vocabulary is split over fsdp alone (no tensor axis), and the ``tokens`` this device holds
    are at most the ``local_rows`` of the vocabulary it holds."""
    if spec is None or shards.size(AXIS) == 1 or shards.size(tensor.AXIS) > 1:
        return False
    entries = tuple(spec) + (None,) * (vocab_dim + 1 - len(tuple(spec)))
    return entries[vocab_dim] == AXIS and tokens <= local_rows


def embed(table_local: jax.Array, ids: jax.Array, dtype) -> jax.Array:
    """Token embeddings ``[rows, seq, embed]`` (in ``dtype``) of this device's ``ids`` ``[rows,
    seq]``, from ``table_local`` ``[vocab / n, embed]``, device ``i``'s rows ``[i vocab/n, (i+1)
    vocab/n)`` of the table."""
    vocab_local = table_local.shape[0]
    # All-gather of the ids, int32: (n - 1) x 4 rows seq bytes sent.
    group_ids = lax.all_gather(ids, AXIS, axis=0, tiled=True)
    local = group_ids - lax.axis_index(AXIS) * vocab_local
    mine = (local >= 0) & (local < vocab_local)
    found = jnp.take(table_local, jnp.where(mine, local, 0), axis=0)
    partial = jnp.where(mine[..., None], found, 0).astype(dtype)
    # Reduce-scatter over the rows: (n - 1) / n x n rows seq embed x e bytes sent (backward: its
    # all-gather, as much).
    return lax.psum_scatter(partial, AXIS, scatter_dimension=0, tiled=True)


def loss_sum(
    x: jax.Array,
    table_local: jax.Array,
    targets: jax.Array,
    weights: jax.Array | None = None,
    *,
    chunk: int | None = None,
    dtype=None,
) -> jax.Array:
    """The cross-entropy of this device's tokens, summed (float32 scalar), through the head
    ``table_local`` ``[vocab / n, embed]`` (the tied table, or an untied kernel's ``.T``, as
    stored: its gradient comes back in its dtype, added up in float32).

    ``x``: ``[rows, seq, embed]``, the final norm's output; ``targets``: ``[rows, seq]`` ids;
    ``weights``: ``None`` or float32 ``[rows, seq]`` multipliers of each token's loss; ``chunk``,
    ``dtype``: as ``dew.nn.cross_entropy.loss_sum``.

    Every device scores the whole group's tokens on its slice of the vocabulary, ``chunk`` tokens
    at a time (``dew.nn.cross_entropy``: ``[chunk, vocab / n]`` float32 logits at most, no
    recompute), its max and sums over the vocabulary reduced over fsdp. The group's loss is then
    the same on every device, and device 0 counts it. Each slice's gradient needs the loss's
    cotangent, which only device 0 holds: the backward sums it over fsdp (``sum_cotangent``, one
    float32), as a ``psum``'s transpose would under ``check_vma=False``.
    """
    # All-gathers over the rows, the group's tokens by device: (n - 1) x rows seq embed x e bytes
    # sent for the activations (backward: their psum_scatter, as much, which also sums the
    # slices' parts of each row's gradient and hands the rows back to their device), the targets
    # (int32) and the weights (float32).
    group_x = lax.all_gather(x, AXIS, tiled=True)
    group_targets = lax.all_gather(targets, AXIS, tiled=True)
    group_weights = None if weights is None else lax.all_gather(weights, AXIS, tiled=True)
    loss = cross_entropy.loss_sum(
        group_x,
        table_local,
        group_targets,
        group_weights,
        chunk=chunk,
        dtype=dtype,
        axis=AXIS,
        sum_cotangent=True,
    )
    return jnp.where(lax.axis_index(AXIS) == 0, loss, 0.0)
