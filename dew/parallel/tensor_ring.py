"""Tensor parallelism's activations moved as collective matmuls: rings of ``ppermute`` s over
``tensor``, each step's matmul beside the next step's transfer (``StepOptions(tensor_scheme=
"ring")``; the default ``"plain"`` runs ``dew.parallel.tensor``'s pairs).

A Megatron region (attention, the dense MLP) is entered by its column-parallel projections (q, k,
v; gate, up: one input, several weights) and left by its row-parallel one (o; down). With the
plain pairs the region's input is made whole first (``tensor.enter``) and its output summed after
(``tensor.leave``), each a collective whose result the next op waits for. Here the collective is
cut into ``n`` blocks of positions (or of tokens, ``BLOCK_LABELS``) and each block's matmul runs
while the next block travels. On the TPU compile of Llama-3.2-1B at v5e-8 ``fsdp=2,tensor=4``: the
same wire bytes and heap as the pairs, and 0.55 x GSPMD's exposed bytes where the pairs leave 1.10
x (0.34 x with sequence-parallel activations, 0.014 x with the fsdp rings too;
docs/results/slices.md). Device ``i`` of a tensor group of ``n``, blocks of ``b`` bytes:

**Sequence-parallel activations** (``StepOptions(sequence_parallel=True)``), between blocks each
device holds its ``1 / n`` of the positions:

- entry, ``columns`` (``_gather_columns``: all-gather -> matmul)::

      forward   block = x_i
                for s in 0 .. n - 1:            block i - s is here
                  send block to i + 1           n - 1 ppermutes of b: (n - 1) b, an all-gather's
                  out[i - s] = block @ W        for every W of the region's entry
      backward  dx: running sums round the ring n - 1 ppermutes of b: a reduce-scatter's
                  total = dout[i - 1] @ W^T       (the sum over the entry's weights)
                  total = ppermute(total) + dout[i - 1 - s] @ W^T
                dW = x_all^T dout               x_all gathered by the forward's ring

- exit, ``row`` (``_scatter_row``: matmul -> reduce-scatter): the forward is the backward's ring
  above, ``total = ppermute(total) + h[i - 1 - s] @ W`` (``fsdp_matmul``'s weight-gradient ring
  with positions for weight blocks), and its backward the forward's: the output's gradient
  gathered round the ring, each arriving block's ``dh = g @ W^T`` computed as the next travels.

**Whole activations** (the plain pair's place): the exit's all-reduce (``_reduce_row``) is the
exit ring above followed by an ``all_gather`` of the summed block, the entry's backward
(``_copy_columns``) the same for the input's gradient (a reduce-scatter ring fused with the
``dx`` matmul, then an ``all_gather``); the entry's forward and the exit's backward need nothing.
Half of each all-reduce (``(n - 1) / n A`` of its ``2 (n - 1) / n A``) travels beside matmuls,
the all-gather after it only beside what does not need its result (the weight gradients, in the
backward). Sequence parallelism does better: its all-gather is the next region's entry ring.

Each is a ``jax.custom_vjp``, its backward written beside its forward (the step runs with
``check_vma=False``: ``dew.parallel.tensor``). The forward keeps the gathered input (``x_all``,
the region's input over all positions, as the plain pair's einsum keeps it) for the weight
gradients, so the backward's rings move the activations' gradients only: the same bytes as the
plain pairs, in ``n - 1`` ``ppermute`` s a collective. Per decoder layer and microbatch, with
activations of ``A`` bytes and full recompute (the layer's forward run again in its backward,
attention's exit included, the MLP's dropped: ``dew.parallel.tensor``): sequence parallel, 11
rings of ``n - 1`` ``ppermute`` s of ``A / n`` (4 forward, 3 recomputed, 4 backward); whole
activations, 5 rings and 5 ``all_gather`` s of ``A / n``.

**With the fsdp rings** (``fsdp_scheme="ring"``) a region's matrices reach it still split over
fsdp (``fsdp_matmul.RingSplit``). A ring here is ``n`` matmuls a weight, so it gathers each such
weight once, round the fsdp ring (``RingSplit.whole``), before its own ring, and sums the weight's
gradient round the fsdp ring from ``x_all`` and the whole output gradient (``RingSplit.gradient``):
no device holds a whole weight gradient, as under the fsdp rings alone.

**In int8** (``StepOptions(quantize="int8")``: ``Region.int8``) the rings are the same, each
block's matmul int8 x int8 -> int32 by ``dew.nn.quantized``'s formulas, and what can travel as
int8 does: each block's integers and their float32 per-token scales packed in one int8
``ppermute`` (``_Packing``). With ``T`` tokens of width ``E`` on a group of ``n``:

- entry (``_int8_columns``): the input's scale per token is over the whole width, which every
  device holds, so each device quantizes its block once and the sequence-parallel ring passes
  int8 blocks with their scales, ``T / n (E + 4)`` bytes where bfloat16 passes ``2 T E / n``.
  Backward: the output gradient times the weight's channel scales, scaled per token over the
  output channels, which the group splits (a ``pmax`` of ``T`` float32 a weight, as the plain
  pairs take it), each device's partial products of ``dx`` summed round the ring (sums, in the
  activations' dtype); ``dW`` from the forward's int8 input, kept.
- exit (``_int8_row``): the input's per-token scale is over the width the group splits, and the
  weight's per-output-channel scale over its split rows: a ``pmax`` each before the ring, which
  sums the partial products. Backward, sequence parallel: this device's block of the output's
  gradient is rounded once, where it is, two ways (per token over the output channels, for
  ``dh``; per output channel over all ``T`` tokens, the group's peak by a ``pmax`` of ``E``
  float32, for ``dW``), and both pass round the ring as int8 with the per-token scales:
  ``T / n (2 E + 4)`` bytes, a bfloat16 block's and a little more (``dW``'s operand cannot be
  made from ``dh``'s without rounding the gradient twice). With whole activations the output's
  gradient is the same on every device: no ring, as in bfloat16.

Of a layer's 11 sequence-parallel rings the entries' forwards (recomputed too: 4) move about half
of bfloat16's bytes, the exits' backwards (2) as many, the 5 rings of sums the same. Rounded to
nearest the rings compute what one device computes to float rounding: every value is quantized
with the scales one device takes. Their stochastic rounding follows ``dew.nn.quantized``'s rule:
a block of tokens or a device's own output channels draw from the key folded with the device's
index; the exit's gradient under whole activations, the same on every device, from the same key.

What keeps the plain pairs: the MoE layers (``expert.moe_mlp`` enters and leaves around its
router and exchange), the embedding, the vocabulary-parallel head and loss (``tensor.enter``), a
weight that is neither an array nor a ``RingSplit`` (anything else with an ``einsum`` of its
own, a LoRA ``dew.nn.lora.Adapted`` or an int8 ``dew.nn.int8.Quantized``: the region falls back to
the pair for that call; in int8, a ``RingSplit`` too, whose matmuls would be the activations'
dtype's), and the GSPMD engine (no tensor axis inside its model:
``Shards.tensor_ring`` is off). Shared kv heads (``tensor.shared_kv_heads``) are plain arrays, cut
before the ring. A pipeline refuses the rings (``StepOptions.check``: a ``ppermute`` inside a
stage's branch).

It is one module, past 650 lines, because the bfloat16 and int8 rings are one technique: the
same blocks, ring helpers (``_gather_ring``, ``_scatter_ring``, ``_put``) and ``Region`` choose
between them per call; a module of the int8 rings alone would import all of this one's
privates back.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from dew.nn import quantized
from dew.nn.param import PLAIN, Projections, spec_labels
from dew.nn.quantized import Int8Projections
from dew.parallel import tensor
from dew.parallel.fsdp_matmul import RingSplit
from dew.parallel.ring import block as _block
from dew.parallel.ring import ring_pairs, scatter_ring

AXIS = tensor.AXIS

# The label a region's einsums give the dimension its rings cut into blocks: positions (``s``, in
# ``[rows, seq, ...]``), or tokens (``t``, rows and positions flattened, as the MLP runs). The
# MLP is the same for every token, so its blocks of tokens may travel in any order, as long as
# the exit scatters the order the entry gathered: with sequence-parallel activations its tokens
# are gathered device-major, ``[n, rows x seq / n]``, and scattered back the same way.
BLOCK_LABELS = ("s", "t")


def _block_label(spec: str) -> str:
    x_labels = spec_labels(spec)[0]
    for label in BLOCK_LABELS:
        if label in x_labels:
            return label
    raise ValueError(
        f"einsum {spec!r}: a tensor ring cuts its input into blocks along positions or tokens, "
        f"labelled {' or '.join(map(repr, BLOCK_LABELS))}, which its input does not name"
    )


def _put(whole: jax.Array | None, piece: jax.Array, dim: int, b, n: int) -> jax.Array:
    """``whole`` (zeros of ``n`` times ``piece`` along ``dim`` when ``None``) with block ``b``
    (traced) written by ``piece``."""
    if whole is None:
        shape = list(piece.shape)
        shape[dim] *= n
        whole = jnp.zeros(shape, piece.dtype)
    k = piece.shape[dim]
    return lax.dynamic_update_slice_in_dim(whole, piece, (b % n) * k, axis=dim)


def _whole(w, dtype) -> jax.Array:
    """The weight for the ring's matmuls, in the activations' dtype: gathered once round the
    fsdp ring when it is still split (``RingSplit``)."""
    return w.whole(dtype) if isinstance(w, RingSplit) else w.astype(dtype)


def _weight_gradient(spec: str, x: jax.Array, d_out: jax.Array, w):
    """The cotangent of ``w`` for ``einsum(spec, x, w)``: ``x^T d_out`` in the activations' dtype
    cast to the weight's (the transpose of ``project``'s cast), or, for a ``RingSplit``, its
    shard's gradient summed round the fsdp ring."""
    if isinstance(w, RingSplit):
        return w.gradient(spec, x, d_out)
    x_labels, w_labels, out_labels = spec_labels(spec)
    return jnp.einsum(f"{x_labels},{out_labels}->{w_labels}", x, d_out).astype(w.dtype)


def _gather_ring(block: jax.Array, dim: int, n: int, each):
    """Gather ``block`` (this device's ``i``) round the ring along ``dim``, calling ``each(piece,
    b)`` on each block ``b`` as it is here (own first); the next block's ``ppermute`` is issued
    beside it. Returns the gathered array, device ``b``'s block at ``b``."""
    i = lax.axis_index(AXIS)
    gathered = None
    for s in range(n):
        gathered = _put(gathered, block, dim, i - s, n)
        # The piece the next step needs leaves now, and travels while ``each`` computes. It is
        # read back from ``gathered``, not forwarded as it arrived, so that each send waits for
        # the write before it and one piece at a time is in flight (``ring.ring_gather``).
        sent = _block(gathered, dim, i - s, n)
        arriving = lax.ppermute(sent, AXIS, ring_pairs(n)) if s < n - 1 else None
        each(block, i - s)
        block = arriving
    return gathered


def _scatter_ring(partial_block, n: int) -> jax.Array:
    """``psum_scatter`` over tensor of ``partial_block(b)`` over its ``n`` blocks, round the
    ring (``ring.scatter_ring``): device ``i`` ends with block ``i`` summed over the group,
    ``n - 1`` ``ppermute`` s of a block, each part computed while the sum travels."""
    return scatter_ring(partial_block, n, AXIS)


def _dx_block(spec, d_outs, wholes, out_dim, b, n):
    """Block ``b`` of this device's part of the entry input's gradient: ``sum_w dout_w[b] W^T``."""
    x_labels, w_labels, out_labels = spec_labels(spec)
    back = f"{out_labels},{w_labels}->{x_labels}"
    return sum(jnp.einsum(back, _block(d, out_dim, b, n), w) for d, w in zip(d_outs, wholes))


def _dims(spec: str) -> tuple[int, int]:
    """The blocked dimension of the einsum's input and of its output."""
    x_labels, _, out_labels = spec_labels(spec)
    label = _block_label(spec)
    return x_labels.index(label), out_labels.index(label)


# --- Sequence-parallel activations ----------------------------------------------------------------


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _gather_columns(x, weights, spec: str, n: int):
    return _gather_columns_fwd(x, weights, spec, n)[0]


def _gather_columns_fwd(x, weights, spec, n):
    dim, out_dim = _dims(spec)
    wholes = [_whole(w, x.dtype) for w in weights]
    outs = [None] * len(wholes)

    def each(block, b):
        for j, w in enumerate(wholes):
            outs[j] = _put(outs[j], jnp.einsum(spec, block, w), out_dim, b, n)

    gathered = _gather_ring(x, dim, n, each)
    return tuple(outs), (gathered, wholes, weights)


def _gather_columns_bwd(spec, n, residuals, d_outs):
    gathered, wholes, weights = residuals
    _, out_dim = _dims(spec)
    dx = _scatter_ring(lambda b: _dx_block(spec, d_outs, wholes, out_dim, b, n), n)
    grads = tuple(_weight_gradient(spec, gathered, d, w) for d, w in zip(d_outs, weights))
    return dx.astype(gathered.dtype), grads


_gather_columns.defvjp(_gather_columns_fwd, _gather_columns_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _scatter_row(h, weight, spec: str, n: int):
    return _scatter_row_fwd(h, weight, spec, n)[0]


def _scatter_row_fwd(h, weight, spec, n):
    dim, _ = _dims(spec)
    whole = _whole(weight, h.dtype)
    out = _scatter_ring(lambda b: jnp.einsum(spec, _block(h, dim, b, n), whole), n)
    return out, (h, whole, weight)


def _scatter_row_bwd(spec, n, residuals, g):
    h, whole, weight = residuals
    dim, out_dim = _dims(spec)
    h_labels, w_labels, out_labels = spec_labels(spec)
    dh = [None]

    def each(block, b):
        dh[0] = _put(
            dh[0], jnp.einsum(f"{out_labels},{w_labels}->{h_labels}", block, whole), dim, b, n
        )

    g_all = _gather_ring(g, out_dim, n, each)
    return dh[0].astype(h.dtype), _weight_gradient(spec, h, g_all, weight)


_scatter_row.defvjp(_scatter_row_fwd, _scatter_row_bwd)


# --- Whole activations ----------------------------------------------------------------------------


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _copy_columns(x, weights, spec: str, n: int):
    return _copy_columns_fwd(x, weights, spec, n)[0]


def _copy_columns_fwd(x, weights, spec, n):
    wholes = [_whole(w, x.dtype) for w in weights]
    return tuple(jnp.einsum(spec, x, w) for w in wholes), (x, wholes, weights)


def _copy_columns_bwd(spec, n, residuals, d_outs):
    x, wholes, weights = residuals
    dim, out_dim = _dims(spec)
    # The all-reduce of the input's gradient: its reduce-scatter half fused with the dx matmul,
    # then an all-gather of the summed block ((n - 1) / n of dx each), beside the weight
    # gradients, which do not need it.
    summed = _scatter_ring(lambda b: _dx_block(spec, d_outs, wholes, out_dim, b, n), n)
    dx = lax.all_gather(summed, AXIS, axis=dim, tiled=True)
    grads = tuple(_weight_gradient(spec, x, d, w) for d, w in zip(d_outs, weights))
    return dx.astype(x.dtype), grads


_copy_columns.defvjp(_copy_columns_fwd, _copy_columns_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _reduce_row(h, weight, spec: str, n: int):
    return _reduce_row_fwd(h, weight, spec, n)[0]


def _reduce_row_fwd(h, weight, spec, n):
    dim, out_dim = _dims(spec)
    whole = _whole(weight, h.dtype)
    # The all-reduce of the partial outputs: the reduce-scatter half fused with the matmul, then
    # an all-gather of the summed block ((n - 1) / n of the output each).
    summed = _scatter_ring(lambda b: jnp.einsum(spec, _block(h, dim, b, n), whole), n)
    return lax.all_gather(summed, AXIS, axis=out_dim, tiled=True), (h, whole, weight)


def _reduce_row_bwd(spec, n, residuals, g):
    h, whole, weight = residuals
    h_labels, w_labels, out_labels = spec_labels(spec)
    # The output is the same on every device, and so is its gradient: no collective.
    dh = jnp.einsum(f"{out_labels},{w_labels}->{h_labels}", g, whole).astype(h.dtype)
    return dh, _weight_gradient(spec, h, g, weight)


_reduce_row.defvjp(_reduce_row_fwd, _reduce_row_bwd)


# --- int8 (StepOptions(quantize="int8")) --------------------------------------------------------


def _tokens(labels: str, spec: str) -> str:
    """The labels of a per-token scale of an operand of ``labels`` (its dimensions but the ones
    its matmul sums, or the output channels): the ring's blocked label among them."""
    _, w_labels, _ = spec_labels(spec)
    return "".join(label for label in labels if label not in w_labels)


@dataclasses.dataclass(frozen=True)
class _Packing:
    """int8 arrays and their float32 per-token scales, all sharing the token dimensions
    ``tokens`` (of labels ``labels[k]``), as one int8 array ``[*tokens, bytes]``: each int8
    array's other dimensions flattened, each scale's float32 as its 4 bytes. One ``ppermute`` a
    ring step then carries a block's integers and scales together."""

    tokens: str
    labels: tuple[str, ...]

    def pack(self, arrays) -> jax.Array:
        parts = []
        for a, labels in zip(arrays, self.labels):
            if a.dtype == jnp.float32:  # a scale of the token dimensions: its bytes
                parts.append(lax.bitcast_convert_type(a, jnp.int8))
                continue
            order = [labels.index(t) for t in self.tokens]
            order += [d for d, label in enumerate(labels) if label not in self.tokens]
            a = jnp.transpose(a, order)
            parts.append(a.reshape(*a.shape[: len(self.tokens)], -1))
        return jnp.concatenate(parts, axis=-1)

    def unpack(self, packed: jax.Array, like) -> list[jax.Array]:
        """The arrays of ``packed`` (``pack`` of arrays shaped as ``like``, or of blocks of
        them: the token dimensions are read off ``packed``)."""
        tokens, out, start = packed.shape[:-1], [], 0
        for a, labels in zip(like, self.labels):
            if a.dtype == jnp.float32:
                piece = lax.slice_in_dim(packed, start, start + 4, axis=-1)
                out.append(lax.bitcast_convert_type(piece, jnp.float32))
                start += 4
                continue
            rest = [a.shape[d] for d, label in enumerate(labels) if label not in self.tokens]
            width = int(np.prod(rest))
            piece = lax.slice_in_dim(packed, start, start + width, axis=-1)
            piece = piece.reshape(*tokens, *rest)
            order = [t for t in self.tokens] + [t for t in labels if t not in self.tokens]
            out.append(jnp.transpose(piece, [order.index(label) for label in labels]))
            start += width
        return out


def _gather_packed(arrays, labels, spec: str, n: int, each):
    """``_gather_ring`` of ``arrays`` (int8 blocks and float32 per-token scales of this
    device's block of tokens; ``labels`` their einsum labels), packed as one int8 array a step
    (``_Packing``); ``each(parts, b)`` takes block ``b``'s arrays. Returns the gathered
    arrays."""
    tokens = _tokens(labels[0], spec)
    packing = _Packing(tokens, tuple(labels))
    packed = packing.pack(arrays)
    dim = tokens.index(_block_label(spec))
    gathered = _gather_ring(packed, dim, n, lambda p, b: each(packing.unpack(p, arrays), b))
    return packing.unpack(gathered, arrays)


def _scale_dim(spec: str, labels: str) -> int:
    """The blocked dimension of a per-token scale of an operand of ``labels``."""
    return _tokens(labels, spec).index(_block_label(spec))


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _int8_columns(x, weights, keys, spec: str, n: int, sequence_parallel: bool, w_dtypes):
    return _int8_columns_fwd(x, weights, keys, spec, n, sequence_parallel, w_dtypes)[0]


def _int8_columns_fwd(x, weights, keys, spec, n, sequence_parallel, w_dtypes):
    x_labels, _, out_labels = spec_labels(spec)
    _, out_dim = _dims(spec)
    # Per token over the whole width, which every device holds: no collective for the scale.
    qx, sx = quantized.quantize_input(spec, x)
    qws = [quantized.quantize_weight(spec, w) for w in weights]  # this device's columns
    if sequence_parallel:
        outs = [None] * len(qws)

        def each(parts, b):
            for j, (qw, sw) in enumerate(qws):
                out = quantized.product(spec, *parts, qw, sw, x.dtype)
                outs[j] = _put(outs[j], out, out_dim, b, n)

        qx, sx = _gather_packed((qx, sx), (x_labels, _tokens(x_labels, spec)), spec, n, each)
    else:
        outs = [quantized.product(spec, qx, sx, qw, sw, x.dtype) for qw, sw in qws]
    outs = tuple(checkpoint_name(out, quantized.OUT_NAME) for out in outs)
    return outs, (qx, sx, qws, keys)


def _int8_columns_bwd(spec, n, sequence_parallel, w_dtypes, residuals, d_outs):
    qx, sx, qws, keys = residuals
    dim, out_dim = _dims(spec)
    _, _, out_labels = spec_labels(spec)
    scale_dim = _scale_dim(spec, out_labels)
    dtype = d_outs[0].dtype
    operands, grads = [], []
    for (qw, sw), d_out, key, w_dtype in zip(qws, d_outs, keys, w_dtypes):
        # Each device rounds its own output channels: its own draws (quantized.gradient_keys).
        dx_key, dw_key = quantized.gradient_keys(key, AXIS)
        # Per token over the output channels, split over the group: the peak is the group's.
        operands.append((*quantized.input_operand(spec, d_out, sw, dx_key, AXIS), qw))
        qh, sh = quantized.weight_operand(spec, d_out, sx, dw_key)
        grads.append(quantized.weight_product(spec, qx, qh, sh, w_dtype))

    def partial_block(b):
        return sum(
            quantized.input_product(
                spec, _block(qg, out_dim, b, n), _block(sg, scale_dim, b, n), qw, dtype
            )
            for qg, sg, qw in operands
        )

    summed = _scatter_ring(partial_block, n)
    dx = summed if sequence_parallel else lax.all_gather(summed, AXIS, axis=dim, tiled=True)
    return dx, tuple(grads), None


_int8_columns.defvjp(_int8_columns_fwd, _int8_columns_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _int8_row(h, weight, key, spec: str, n: int, sequence_parallel: bool, w_dtype):
    return _int8_row_fwd(h, weight, key, spec, n, sequence_parallel, w_dtype)[0]


def _int8_row_fwd(h, weight, key, spec, n, sequence_parallel, w_dtype):
    dim, out_dim = _dims(spec)
    h_labels, _, _ = spec_labels(spec)
    scale_dim = _scale_dim(spec, h_labels)
    # The summed width is split over the group: each scale's peak is the group's (a pmax of one
    # float32 a token, and one an output channel), as one device holding all of it takes it.
    qh, sh = quantized.quantize_input(spec, h, AXIS)
    qw, sw = quantized.quantize_weight(spec, weight, AXIS)

    def partial_block(b):
        qh_b, sh_b = _block(qh, dim, b, n), _block(sh, scale_dim, b, n)
        return quantized.product(spec, qh_b, sh_b, qw, sw, h.dtype)

    summed = _scatter_ring(partial_block, n)
    out = summed if sequence_parallel else lax.all_gather(summed, AXIS, axis=out_dim, tiled=True)
    return checkpoint_name(out, quantized.OUT_NAME), (qh, sh, qw, sw, key)


def _int8_row_bwd(spec, n, sequence_parallel, w_dtype, residuals, g):
    qh, sh, qw, sw, key = residuals
    dim, out_dim = _dims(spec)
    h_labels, _, out_labels = spec_labels(spec)
    if not sequence_parallel:
        # The output's gradient is the same on every device, and so are these draws: each value
        # is rounded alike on every device, as one device rounds it once.
        dx_key, dw_key = quantized.gradient_keys(key)
        qg, sg = quantized.input_operand(spec, g, sw, dx_key)
        dh = quantized.input_product(spec, qg, sg, qw, g.dtype)
        qd, sd = quantized.weight_operand(spec, g, sh, dw_key)
        return dh, quantized.weight_product(spec, qh, qd, sd, w_dtype), None
    # This device's block of positions of the output's gradient, rounded here once, its own
    # draws, and gathered round the ring as int8: per token over the output channels (whole
    # here) for dh; per output channel over all the tokens (the group's peak) for dw.
    dx_key, dw_key = quantized.gradient_keys(key, AXIS)
    qg, sg = quantized.input_operand(spec, g, sw, dx_key)
    own = lax.axis_index(AXIS)
    sh_own = _block(sh, _scale_dim(spec, h_labels), own, n)
    qd, sd = quantized.weight_operand(spec, g, sh_own, dw_key, AXIS)
    dh = [None]

    def each(parts, b):
        qg_b, sg_b, _ = parts
        dh[0] = _put(dh[0], quantized.input_product(spec, qg_b, sg_b, qw, g.dtype), dim, b, n)

    labels = (out_labels, _tokens(out_labels, spec), out_labels)
    _, _, qd_all = _gather_packed((qg, sg, qd), labels, spec, n, each)
    return dh[0], quantized.weight_product(spec, qh, qd_all, sd, w_dtype), None


_int8_row.defvjp(_int8_row_fwd, _int8_row_bwd)


def _key_data(key):
    if key is not None and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(key)
    return key


# --- The functions --------------------------------------------------------------------------------


def _check_blocks(spec: str, x: jax.Array, n: int, whole: bool) -> None:
    dim, _ = _dims(spec)
    if whole and x.shape[dim] % n:
        raise ValueError(
            f"einsum {spec!r}: dimension {dim} of the input {x.shape} ({x.shape[dim]}) does not "
            f"split into tensor {n} blocks for the ring"
        )


def _ring_weights(weights: Sequence[Any], int8: bool = False) -> bool:
    """Whether the ring can run these weights: arrays, or ``RingSplit`` s (anything else with an
    ``einsum`` of its own keeps the plain pair); in int8, arrays only."""
    if int8:
        return not any(hasattr(w, "einsum") or isinstance(w, RingSplit) for w in weights)
    return all(isinstance(w, RingSplit) or not hasattr(w, "einsum") for w in weights)


def columns(
    spec: str,
    x: jax.Array,
    weights: Sequence[Any],
    shards,
    int8: Int8Projections | None = None,
) -> tuple[jax.Array, ...]:
    """Enter a tensor-parallel region through its column-parallel projections, as one ring:
    ``tuple(einsum(spec, entered(x), w) for w in weights)``, ``entered`` being ``tensor.enter``
    along the ring's blocks (``BLOCK_LABELS``).

    Args:
      spec: ``"bse,ehd->bshd"``-like, the input first; its input names ``s`` or ``t``.
      x: sequence parallel, this device's block of positions (or tokens), e.g. ``[rows, seq / n,
        embed]``; else the whole input, the same on every device of the group, its blocked
        dimension divisible by ``n``.
      weights: this device's slices (arrays, or ``fsdp_matmul.RingSplit`` s); each in ``x``'s dtype
        for the matmul.
      shards: the step's ``Shards``.
      int8: the region's int8 projections (``StepOptions(quantize="int8")``; their key and
        split), or ``None``: the matmuls in ``x``'s dtype.

    Returns:
      one output per weight, over all positions.
    """
    n = shards.size(AXIS)
    sequence_parallel = tensor.sequence_parallel(shards)
    if not _ring_weights(weights, int8 is not None):
        dim, _ = _dims(spec)
        if sequence_parallel:
            x = tensor.gather_from_sequence(x, shards, dim)
        else:
            x = tensor.copy_to_region(x, shards)
        return (PLAIN if int8 is None else int8).columns(spec, x, weights)
    _check_blocks(spec, x, n, whole=not sequence_parallel)
    if int8 is not None:
        # The plain pairs' keys (Int8Projections.columns): the same draws, one per weight.
        keys = quantized.rounding_keys(int8.key, f"columns {spec}", len(weights))
        dtypes = tuple(jnp.dtype(w.dtype).name for w in weights)
        keys = tuple(_key_data(k) for k in keys)
        return _int8_columns(x, tuple(weights), keys, spec, n, sequence_parallel, dtypes)
    ring = _gather_columns if sequence_parallel else _copy_columns
    return ring(x, tuple(weights), spec, n)


def row(spec: str, h: jax.Array, weight: Any, shards, int8: Int8Projections | None = None):
    """Leave a tensor-parallel region through its row-parallel projection, as one ring:
    ``tensor.leave(einsum(spec, h, weight))`` along the ring's blocks (``BLOCK_LABELS``).

    Args:
      spec: ``"bshd,hde->bse"``-like; ``h`` names ``s`` or ``t``, divisible by ``n``.
      h: this device's slice of the region's width, over all positions.
      weight: this device's slice (an array or a ``fsdp_matmul.RingSplit``).
      shards: the step's ``Shards``.
      int8: as ``columns``'.

    Returns:
      the sum over the group: sequence parallel, this device's block of positions (``1 / n`` of
      them along the blocked dimension); else all of them, the same on every device.
    """
    n = shards.size(AXIS)
    sequence_parallel = tensor.sequence_parallel(shards)
    if not _ring_weights([weight], int8 is not None):
        out = (PLAIN if int8 is None else int8).row(spec, h, weight)
        _, out_dim = _dims(spec)
        if sequence_parallel:
            return tensor.scatter_to_sequence(out, shards, out_dim)
        return tensor.reduce_from_region(out, shards)
    _check_blocks(spec, h, n, whole=True)
    if int8 is not None:
        key = _key_data(quantized.rounding_keys(int8.key, f"row {spec}", 1)[0])
        dtype = jnp.dtype(weight.dtype).name
        return _int8_row(h, weight, key, spec, n, sequence_parallel, dtype)
    ring = _scatter_row if sequence_parallel else _reduce_row
    return ring(h, weight, spec, n)


@dataclasses.dataclass(frozen=True)
class Region(Projections):
    """A Megatron region (attention, the dense MLP) as the model enters and leaves it and its
    layers project inside it (``dew.nn.param.Projections``: ``self_attention`` and ``swiglu`` take
    one).

    With the plain pairs (``Shards.tensor_ring`` off, or a tensor axis of 1), ``enter`` and
    ``leave`` are ``tensor.enter`` and ``tensor.leave`` and the projections plain ``project`` s:
    today's program. With the rings, ``enter`` and ``leave`` pass the activations through, and the
    projections are ``columns`` and ``row``: the entry and exit as collective matmuls.
    """

    shards: Any

    @property
    def int8(self) -> Int8Projections | None:
        """Under ``StepOptions(quantize="int8")``, the projections in int8 with the step's
        rounding key (``Shards.rounding_key``): in the plain pairs, or the rings'."""
        if self.shards.options.quantize != "int8":
            return None
        split = AXIS if self.shards.size(AXIS) > 1 else None
        return Int8Projections(self.shards.rounding_key, split)

    @property
    def ring(self) -> bool:
        """Whether the projections run as rings: ``Shards.tensor_ring`` on a tensor axis above
        1, in the activations' dtype or in int8."""
        return bool(self.shards.tensor_ring) and self.shards.size(AXIS) > 1

    def enter(self, x: jax.Array) -> jax.Array:
        """``x`` ``[rows, seq, embed]`` (``[rows, seq / n, embed]`` sequence parallel), into the
        region: ``tensor.enter``, or ``x`` itself when the region's projections enter."""
        return x if self.ring else tensor.enter(x, self.shards)

    def leave(self, h: jax.Array) -> jax.Array:
        """The region's output: ``tensor.leave`` of the partial sums, or ``h`` itself when the
        row projection has left."""
        return h if self.ring else tensor.leave(h, self.shards)

    def columns(self, spec, x, weights):
        """``Projections.columns``, in int8, or the entry as a ring (``columns``)."""
        if self.ring:
            return columns(spec, x, weights, self.shards, self.int8)
        if self.int8 is not None:
            return self.int8.columns(spec, x, weights)
        return super().columns(spec, x, weights)

    def row(self, spec, h, weight):
        """``Projections.row``, in int8, or the exit as a ring (``row``)."""
        if self.ring:
            return row(spec, h, weight, self.shards, self.int8)
        if self.int8 is not None:
            return self.int8.row(spec, h, weight)
        return super().row(spec, h, weight)

    def experts(self, x, weight, group_sizes, name=""):
        """``Projections.experts``, or in int8."""
        if self.int8 is not None:
            return self.int8.experts(x, weight, group_sizes, name)
        return super().experts(x, weight, group_sizes, name)


def region(shards) -> Region:
    """The ``Region`` of the step's ``shards``."""
    return Region(shards)
