"""Tensor parallelism (Megatron): the tensor group splits each layer's width, not its tokens.

What is split over ``tensor``: the heads of attention and the hidden width of the MLP (a first
matmul split by columns, a second by rows), and the vocabulary of the embedding table, of the output
head and of the loss. Every device of a tensor group sees the same tokens. A split layer is a
*region*: its input arrives whole on every device, each device computes its slice of the width, and
the partial results of the second matmul are summed on the way out.

The step runs inside ``jax.shard_map(..., check_vma=False)``, where autodiff transposes a bare
``psum`` into another ``psum`` (a row-parallel weight's gradient would come out ``n`` times too
large). So every collective here is one half of a conjugate pair, the backward of each the forward
of the other (picotron's copy-to / reduce-from / gather-from / scatter-to a region):

==========================  ===============================  ===============================
function                    forward                          backward
==========================  ===============================  ===============================
``copy_to_region``          identity                         ``psum`` over tensor
``reduce_from_region``      ``psum`` over tensor             identity
``gather_from_sequence``    ``all_gather`` along ``dim``     ``psum_scatter`` along ``dim``
``scatter_to_sequence``     ``psum_scatter`` along ``dim``   ``all_gather`` along ``dim``
==========================  ===============================  ===============================

The first two are the plain pair: activations between blocks are whole on every device of the
group. The last two are the sequence-parallel pair (Megatron's "sequence parallelism", which lives
on the ``tensor`` axis and is unrelated to the ``sequence`` mesh axis): between blocks each device
keeps only its slice of the positions, so norms and residual adds run on ``1/n`` of the tokens
and the activations they save shrink by ``n``; the region's input is gathered over positions and
its output reduce-scattered back to them, which moves the same bytes as the all-reduce it replaces.
Only the plain pair is a ``jax.custom_vjp``, its backward written out. The sequence-parallel pair is
the bare collectives: autodiff already transposes a tiled ``all_gather`` into a tiled
``psum_scatter`` along the same dimension, and back, which is the backward in the table.
``enter`` / ``leave`` pick the pair from one switch, ``shards.options.sequence_parallel``. Under
``StepOptions(tensor_scheme="ring")`` attention's and the dense MLP's entry and exit run as
collective matmuls instead (``dew.parallel.tensor_ring``, whose ``Region`` calls these pairs when
the rings are off); the embedding, the head, the loss and the MoE layers keep these pairs.

Gradients follow one convention: each device differentiates its own copy of the loss. Through these
pairs a tensor-split weight's gradient comes out whole (nothing left to sum over ``tensor``); a
weight replicated over ``tensor`` that sees sequence-split activations gets only its positions'
part, which the step must still sum over ``tensor``.

On a tensor axis of size 1 nothing here issues a collective: the pairs are the identity, and the
embedding, head and loss are their unsplit selves, so the same model code runs on one device
(``ONE_DEVICE``) without a mesh.

Which weights are split, and how (``SPLIT_NAMES``, ``check_sizes``, ``check_layout``): every
dimension the model names ``vocab``, ``heads``, ``kv_heads`` or ``mlp`` is split over ``tensor``,
and no other. The sizes must divide by the tensor size; the vocabulary is not padded (pad it in
the tokenizer, as GPT-2's 50257 becomes 50304). With fewer kv heads than devices the kv weights
stay whole and each device keeps the kv head its query heads use (``shared_kv_heads``).

Bytes, per device and per call, for a local operand of ``b`` bytes on a tensor group of ``n`` (ring
algorithms, as ``dew.collectives`` counts them) are written beside each collective below. Per
decoder layer and microbatch, with activations ``[rows, seq, embed]`` of ``A`` bytes: the forward
has two all-reduces of ``A`` (attention's and the MLP's ``leave``); the backward has two more (their
``enter``) and, as the layer is rematerialized, attention's ``leave`` again (the MLP's output is
not needed to differentiate the layer, so its recomputation is dropped): five in all. With
sequence parallelism each ``enter`` is an all-gather (recomputed too) and each ``leave`` a
reduce-scatter, and their backwards the other one.

Layout: the plain pair (``copy_to_region``, ``reduce_from_region``), the sequence-parallel pair
(``gather_from_sequence``, ``scatter_to_sequence``), the switch between them (``enter``, ``leave``),
the vocabulary-parallel embedding, head and loss (``embed_lookup``, ``vocab_logits``,
``head_loss_sum``), ``shared_kv_heads``, and the layout checks (``check_sizes``, ``check_layout``).
It is one module because it is one technique: the embedding, the head and the loss reach the pairs
through ``enter`` and ``leave``, and the checks hold a layout to the splits all of them assume.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
from jax import lax

from dew.layout import weight_dimensions
from dew.nn import cross_entropy

AXIS = "tensor"
# Activations between blocks are [rows, seq, embed]: sequence parallelism splits dimension 1.
SEQUENCE_DIM = 1
# The logical dimensions Megatron's splits cut: every weight dimension of one of these names is
# split over ``tensor`` (kv heads only when there are at least as many as devices), and no other.
SPLIT_NAMES = ("vocab", "heads", "kv_heads", "mlp")


def _size(shards) -> int:
    return shards.size(AXIS)


def sequence_parallel(shards) -> bool:
    """Whether activations between blocks are split over positions across the tensor group.

    Read from ``shards.options.sequence_parallel``.
    """
    return shards.options.sequence_parallel


# --- The plain pair -------------------------------------------------------------------------------


@jax.custom_vjp
def _copy(x):
    return x


def _copy_fwd(x):
    return x, None


def _copy_bwd(_, g):
    # Each device's slice of the region sent back its part of the input's gradient: sum them.
    # All-reduce of the input's gradient: 2 (n - 1) / n * b sent.
    return (lax.psum(g, AXIS),)


_copy.defvjp(_copy_fwd, _copy_bwd)


@jax.custom_vjp
def _reduce(x):
    # All-reduce of the region's partial outputs: 2 (n - 1) / n * b sent.
    return lax.psum(x, AXIS)


def _reduce_fwd(x):
    return _reduce(x), None


def _reduce_bwd(_, g):
    # The output is the same on every device, and so is its gradient: each partial gets it whole.
    return (g,)


_reduce.defvjp(_reduce_fwd, _reduce_bwd)


def copy_to_region(x: jax.Array, shards) -> jax.Array:
    """Enter a tensor-parallel region with activations whole on every device of the group.

    Forward: ``x`` unchanged. Backward: the gradient summed over ``tensor`` (each device's slice
    of the region contributed a part of it). Put it on the input of a column-parallel matmul, and of
    the vocabulary-split output head.

    Args:
      x: any array, the same on every device of the tensor group.
      shards: the step's ``Shards``; on a tensor axis of size 1 this is the identity.
    """
    return x if _size(shards) == 1 else _copy(x)


def reduce_from_region(x: jax.Array, shards) -> jax.Array:
    """Leave a tensor-parallel region: sum the devices' partial results.

    Forward: ``psum`` of ``x`` over ``tensor`` (the result is the same on every device). Backward:
    the gradient passed to each device's partial unchanged. Put it on the output of a row-parallel
    matmul.

    Args:
      x: this device's partial result, any shape.
      shards: the step's ``Shards``; on a tensor axis of size 1 this is the identity.
    """
    return x if _size(shards) == 1 else _reduce(x)


# --- The sequence-parallel pair -------------------------------------------------------------------


def _gather(x, dim):
    # All-gather of the positions: each device receives (and sends) (n - 1) * b, b its own slice.
    # Backward: each device's gradient of the gathered input is a partial over its slice of the
    # width; the reduce-scatter sums them and keeps this device's positions: (n - 1) / n * b_g
    # sent for a gradient of b_g = n b bytes.
    return lax.all_gather(x, AXIS, axis=dim, tiled=True)


def _scatter(x, dim):
    # Reduce-scatter of the partial outputs over positions: (n - 1) / n * b sent. Backward: every
    # position's gradient reaches every device's partial, an all-gather: (n - 1) * b_g sent.
    return lax.psum_scatter(x, AXIS, scatter_dimension=dim, tiled=True)


def _check_dim(name: str, x: jax.Array, dim: int) -> None:
    if not -x.ndim <= dim < x.ndim:
        raise ValueError(f"{name}: dim {dim} is out of range for an array of shape {x.shape}")


def gather_from_sequence(x: jax.Array, shards, dim: int = SEQUENCE_DIM) -> jax.Array:
    """Enter a tensor-parallel region with activations split over positions.

    Forward: ``all_gather`` of ``x`` along ``dim`` (device ``i``'s slice at block ``i``), so every
    device holds all positions. Backward: ``psum_scatter`` of the gradient along ``dim``: summed
    over the devices' slices of the region, each device keeping its own positions.

    Args:
      x: this device's positions, e.g. ``[rows, seq / n, embed]``.
      shards: the step's ``Shards``; on a tensor axis of size 1 this is the identity.
      dim: the split dimension (1, positions, by default).

    Returns:
      ``x`` with ``n`` times its size along ``dim``.
    """
    _check_dim("gather_from_sequence", x, dim)
    return x if _size(shards) == 1 else _gather(x, dim % x.ndim)


def scatter_to_sequence(x: jax.Array, shards, dim: int = SEQUENCE_DIM) -> jax.Array:
    """Leave a tensor-parallel region, splitting the summed result over positions.

    Forward: ``psum_scatter`` of the partial results along ``dim``: device ``i`` keeps block ``i``
    of the sum. Backward: ``all_gather`` of the gradient along ``dim``, since every device's partial
    touched every position.

    Args:
      x: this device's partial result, e.g. ``[rows, seq, embed]``; ``x.shape[dim]`` must divide by
        the tensor size.
      shards: the step's ``Shards``; on a tensor axis of size 1 this is the identity.
      dim: the dimension to split (1, positions, by default).

    Returns:
      ``x`` with ``1 / n`` of its size along ``dim``.
    """
    _check_dim("scatter_to_sequence", x, dim)
    n = _size(shards)
    if n == 1:
        return x
    dim = dim % x.ndim
    if x.shape[dim] % n:
        raise ValueError(
            f"scatter_to_sequence: dimension {dim} of shape {x.shape} ({x.shape[dim]}) does not "
            f"split over tensor {n}"
        )
    return _scatter(x, dim)


# --- The switch -----------------------------------------------------------------------------------


def enter(x: jax.Array, shards) -> jax.Array:
    """Enter a tensor-parallel region (attention, MLP, the output head).

    ``gather_from_sequence(x, shards, dim=1)`` when ``shards.options.sequence_parallel``, else
    ``copy_to_region(x, shards)``. ``x``: ``[rows, seq, embed]``, or ``[rows, seq / n, embed]`` when
    sequence parallel. Returns ``[rows, seq, embed]``, the same on every device of the group.
    """
    if sequence_parallel(shards):
        return gather_from_sequence(x, shards, SEQUENCE_DIM)
    return copy_to_region(x, shards)


def leave(x: jax.Array, shards) -> jax.Array:
    """Leave a tensor-parallel region: sum the devices' partial ``[rows, seq, embed]`` results.

    ``scatter_to_sequence(x, shards, dim=1)`` when ``shards.options.sequence_parallel`` (returns
    ``[rows, seq / n, embed]``, this device's positions), else ``reduce_from_region(x, shards)``
    (returns ``[rows, seq, embed]``, the same on every device).
    """
    if sequence_parallel(shards):
        return scatter_to_sequence(x, shards, SEQUENCE_DIM)
    return reduce_from_region(x, shards)


# --- Vocabulary-parallel embedding, head and loss -------------------------------------------------


def _vocab_start(vocab_local: int, shards) -> jax.Array | int:
    """The first vocabulary id of this device's slice: device ``i`` holds ``[i V/n, (i+1) V/n)``."""
    return 0 if _size(shards) == 1 else lax.axis_index(AXIS) * vocab_local


def embed_lookup(table_local: jax.Array, ids: jax.Array, shards, dtype=None) -> jax.Array:
    """Token embeddings from a table whose rows (the vocabulary) are split over ``tensor``.

    Each device looks up the ids in its slice of the vocabulary and writes zeros for the others; the
    devices' results are summed by ``leave``, so each id's row comes from the one device that holds
    it. The gradient reaches each device's rows whole (``leave``'s backward gives every device the
    whole gradient of the output).

    Args:
      table_local: ``[vocab / n, embed]``, device ``i``'s rows ``[i vocab/n, (i+1) vocab/n)``.
      ids: ``[rows, seq]`` integer token ids in ``[0, vocab)``, the same on every device of the
        group (ids outside that range give zeros).
      shards: the step's ``Shards``.
      dtype: the output dtype; default the table's. The sum runs in it, exactly: each element has
        one nonzero term.

    Returns:
      ``[rows, seq, embed]``, the same on every device of the group; ``[rows, seq / n, embed]``,
      this device's positions, when ``shards.options.sequence_parallel``.
    """
    if table_local.ndim != 2:
        raise ValueError(
            f"embed_lookup: table_local must be [vocab / n, embed], got {table_local.shape}"
        )
    dtype = table_local.dtype if dtype is None else dtype
    if _size(shards) == 1:
        return jnp.take(table_local, ids, axis=0).astype(dtype)
    vocab_local = table_local.shape[0]
    local = ids - _vocab_start(vocab_local, shards)
    mine = (local >= 0) & (local < vocab_local)
    rows = jnp.take(table_local, jnp.where(mine, local, 0), axis=0)
    # Other devices' ids read row 0 (a valid index) and are then zeroed, value and gradient.
    return leave(jnp.where(mine[..., None], rows, 0).astype(dtype), shards)


def vocab_logits(x: jax.Array, table_local: jax.Array, shards) -> jax.Array:
    """This device's slice of the vocabulary's logits, through the (tied) embedding table.

    The head's input is the same on every device of the group while its weight is split by
    vocabulary, so it enters the region (``enter``): each device's slice of the vocabulary sends
    back a part of the input's gradient, which the backward sums over ``tensor``. Without that sum
    the blocks below would see only the gradient through this device's slice of the vocabulary.

    Args:
      x: ``[rows, seq, embed]`` (``[rows, seq / n, embed]`` when sequence parallel).
      table_local: ``[vocab / n, embed]``; for an untied ``[embed, vocab / n]`` kernel, its ``.T``.
      shards: the step's ``Shards``.

    Returns:
      float32 ``[rows, seq, vocab / n]``, for ``cross_entropy``.
    """
    x = enter(x, shards)
    return jnp.einsum(
        "bse,ve->bsv", x, table_local.astype(x.dtype), preferred_element_type=jnp.float32
    )


def head_loss_sum(
    x: jax.Array,
    table_local: jax.Array,
    targets: jax.Array,
    shards,
    weights: jax.Array | None = None,
    *,
    chunk: int | None = None,
    dtype=None,
) -> jax.Array:
    """The head's cross-entropy, summed (float32 scalar), from this device's slice of the
    vocabulary: ``dew.nn.cross_entropy.loss_sum`` over ``tensor``, chunk by chunk over tokens.

    The ``[rows, seq, vocab]`` logits are never gathered, nor held whole on one device: the max
    over the vocabulary comes from a ``pmax`` and the sum of exponentials and the target's logit
    (picked on the one device whose slice holds it) from one ``psum`` of both, ``[chunk]`` and
    ``[chunk, 2]`` float32 a chunk. The loss is the same on every device of the group, and each
    device's gradient of it is its cotangent unchanged: the gradient of ``table_local`` is this
    slice's, and the activations' gradient is this slice's part of it, which entering the region
    (``enter``: the head's input is the same on every device while its weight is split by
    vocabulary) sums over ``tensor`` in the backward.

    Args:
      x: ``[rows, seq, embed]`` (``[rows, seq / n, embed]`` when sequence parallel), the final
        norm's output.
      table_local: ``[vocab / n, embed]``, device ``i``'s ids ``[i vocab/n, (i+1) vocab/n)``; for an
        untied ``[embed, vocab / n]`` kernel, its ``.T``. As stored: its gradient comes back in its
        dtype, added up in float32.
      targets: ``[rows, seq]`` integer ids in ``[0, vocab)``, the same on every device of the group.
      shards: the step's ``Shards``.
      weights: ``None``, or float32 ``[rows, seq]`` multipliers of each token's loss.
      chunk, dtype: tokens per chunk (``None``: ``dew.nn.cross_entropy.auto_chunk``) and the
        matmuls' input dtype (default ``x``'s).
    """
    if x.shape[-1] != table_local.shape[-1] or targets.ndim != 2:
        raise ValueError(
            f"head_loss_sum: x {x.shape}, table_local {table_local.shape} and targets "
            f"{targets.shape} must be [rows, seq, embed], [vocab / n, embed] and [rows, seq]"
        )
    x = enter(x, shards)
    return cross_entropy.loss_sum(
        x,
        table_local,
        targets,
        weights,
        chunk=chunk,
        dtype=dtype,
        axis=AXIS if _size(shards) > 1 else None,
    )


# --- Grouped-query attention with fewer kv heads than devices -------------------------------------


def shared_kv_heads(kernel: jax.Array, shards, dim: int = 1) -> jax.Array:
    """The kv head this device's query heads use, out of a K or V kernel kept whole over ``tensor``.

    With ``kv`` kv heads, ``h`` query heads and a tensor group of ``n > kv`` (``n`` a multiple of
    ``kv``), device ``i`` holds query heads ``[i h/n, (i+1) h/n)``, all in kv head ``(i kv) // n``.
    The kernel's gradient then has that head's part from this device only, zeros elsewhere; summed
    over ``tensor`` (the weight is ``partial_over_tensor``, ``dew.parallel.gradients``), each kv
    head's gradient is the sum over exactly the ``n / kv`` devices that share it.

    Args:
      kernel: ``[embed, kv, head_dim]`` (kv heads at ``dim``), the same on every device of the
        group.
      shards: the step's ``Shards``.

    Returns:
      ``kernel`` with one head at ``dim``; ``kernel`` itself on a tensor axis of size 1.
    """
    n = _size(shards)
    if n == 1:
        return kernel
    kv = kernel.shape[dim]
    if n % kv:
        raise ValueError(f"shared_kv_heads: {kv} kv heads do not divide tensor {n}")
    return lax.dynamic_slice_in_dim(kernel, (lax.axis_index(AXIS) * kv) // n, 1, dim)


# --- What a layout must split ---------------------------------------------------------------------


def check_sizes(tensor_size: int, sizes: Mapping[str, int]) -> None:
    """Raises ``ValueError`` naming the numbers when a size cannot be split over ``tensor``.

    Args:
      tensor_size: the tensor axis's size.
      sizes: ``{"num_heads": h, "num_kv_heads": kv, "mlp_features": m, "vocab_size": v}``; each
        must divide by ``tensor_size``, except ``num_kv_heads``, which may instead divide it (the kv
        heads are then shared, ``shared_kv_heads``).
    """
    if tensor_size == 1:
        return
    for name, size in sizes.items():
        if name == "num_kv_heads" and size < tensor_size and tensor_size % size == 0:
            continue
        if size % tensor_size:
            hint = ""
            if name == "num_kv_heads":
                hint = " (nor divide it: kv heads are shared only when they divide tensor)"
            elif name == "vocab_size":
                pad = -(-size // tensor_size) * tensor_size
                hint = f"; the vocabulary is not padded: use a vocab_size such as {pad}"
            raise ValueError(f"{name} {size} does not split over tensor {tensor_size}{hint}")


def check_layout(param_specs: Any, logical_axes: Any, shapes: Any, tensor_size: int) -> None:
    """Raises ``ValueError`` unless each weight is split over ``tensor`` exactly on its
    ``SPLIT_NAMES`` dimensions (a ``kv_heads`` dimension smaller than the tensor size stays whole).

    The model's code assumes those splits; a layout whose rules leave one out, or split another
    dimension over ``tensor``, would compute something else, so it is refused before compiling.

    Args:
      param_specs: ``PartitionSpec`` tree of the parameters.
      logical_axes: the model's tree of logical-axis tuples (``model.logical_axes()``).
      shapes: a tree of arrays or ``ShapeDtypeStruct`` matching ``param_specs``.
      tensor_size: the tensor axis's size; nothing is checked at 1.
    """
    if tensor_size == 1:
        return
    dimensions = weight_dimensions(param_specs, logical_axes, shapes)
    for where, names, spec, name, mesh_axes, size in dimensions:
        split = AXIS in mesh_axes
        wanted = name in SPLIT_NAMES and size >= tensor_size
        if split == wanted:
            continue
        if wanted:
            raise ValueError(
                f"tensor {tensor_size}: weight {where} (logical axes {names}) has spec {spec}, "
                f"which leaves its {name!r} dimension whole; the model needs every "
                f"{', '.join(SPLIT_NAMES)} dimension split over {AXIS!r}: give the Layout "
                f"a rule ({name!r}, {AXIS!r}) before its fsdp rules, as "
                "dew.layout.DEFAULT_RULES does"
            )
        raise ValueError(
            f"tensor {tensor_size}: weight {where} (logical axes {names}) has spec {spec}, "
            f"which splits its {name!r} dimension over {AXIS!r}; only the "
            f"{', '.join(SPLIT_NAMES)} dimensions may be"
        )
