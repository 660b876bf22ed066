"""Sequence parallelism (context parallelism): the ``sequence`` group splits each row's positions.

Zigzag order. Causal attention gives the last positions the most work, so the ``S`` positions of a
row are cut into ``2n`` chunks of ``c = S / (2n)`` (``n`` the sequence size) and device ``i`` holds
chunk ``i`` followed by chunk ``2n-1-i``: its local arrays are ``[batch, 2c, ...]``, and every
device has the same share of the causal triangle. ``zigzag_positions(S, n)`` lists the global
positions in device-major order (``x[:, zigzag_positions(S, n)]`` split over ``sequence`` on
dimension 1 gives each device its chunks). The caller applies rotary embeddings, masks and the
loss with those global positions; the functions here take q, k, v already rotated.

Two schemes compute this device's rows of causal attention over the whole sequence, with the same
signature as ``dew.nn.attention``'s functions plus the ``Shards`` (``SCHEMES`` picks one by name;
``"ring"`` is the default the model uses):

- ``ring_attention``: K/V blocks travel round the ring with ``ppermute``; each device merges the
  blocks' ``(out, lse)`` pairs by online softmax. Memory holds the device's own block, the
  visiting one and the next one in flight; only kv heads travel, and each hop can hide behind a
  block's ``O(c^2)`` attention, which grows with the context.
  With a sliding window of at most a chunk, the ring scheme is a halo exchange instead
  (``_halo_attention``): each chunk takes the last keys of the chunk before it, two ``ppermute``
  in all, and attends once, with any attention.
- ``all_to_all_attention`` (DeepSpeed-Ulysses): ``all_to_all`` trades positions for heads, each
  device attends over the whole sequence with ``heads / n`` heads, and ``all_to_all`` trades back.
  It needs ``heads`` and ``kv_heads`` to divide by ``n`` and holds the whole sequence's q, k, v
  for its heads. Its forward sends ``(n - 1) / n`` of the local q, k, v and out per device:
  ``(heads + kv_heads) / (n kv_heads)`` times the ring's forward bytes, fewer once
  ``n > 1 + heads / kv_heads``; but its exchanges come before and after attention, with nothing to
  hide behind. So it wins on short contexts, the ring on long ones (and wherever heads don't
  split).

Ring attention, by cases. Device ``i``'s local index runs over chunk ``i`` (first half) then chunk
``2n-1-i`` (second half), both increasing in global position, and ``i < n <= 2n-1-i``. At ring
step ``t`` it holds the K/V block of device ``src = (i - t) mod n``:

- ``t = 0`` (its own block): a key is visible to a query exactly when its local index is not
  greater (chunk ``i`` precedes chunk ``2n-1-i``), so this is plain causal attention on the local
  ``2c x 2c`` concatenation.
- ``src < i`` (``1 <= t <= i``): the block's first chunk ``src`` precedes both of ours; its second
  chunk ``2n-1-src`` follows both. All ``2c`` queries see the first ``c`` keys, unmasked.
- ``src > i`` (``t > i``): chunks ``src`` and ``2n-1-src`` both lie after chunk ``i`` and before
  chunk ``2n-1-i`` (``i < src < n <= 2n-1-src < 2n-1-i``). The second ``c`` queries see all ``2c``
  keys, unmasked; the first see none.

Each case after the first is ``2c x c`` unmasked logits, so every device does the same work at every
step. Both are computed as two ``c x c`` unmasked blocks: (second query chunk, first key chunk),
which either case contains, and (query chunk ``o``, key chunk ``o``) with ``o = 0`` when
``src < i`` and ``o = 1`` otherwise. ``o`` depends on the device, so it is a dynamic slice offset,
not a branch: the program is the same on every device.

Transfers, per device, with K and V blocks of ``[batch, 2c, kv_heads, d]`` (only the kv heads
travel) stacked into one array of ``B = 2 batch 2c kv_heads d`` elements:

- forward: ``n - 1`` ``ppermute`` over ``sequence``, each of the K/V block (``B`` elements of the
  input dtype), to the next device of the ring;
- backward: ``n - 1`` ``ppermute`` of the K/V block again (the residuals are the device's own
  q, k, v and the final out, lse), and ``n - 1`` of the dK/dV accumulator travelling with it
  (``B`` float32 elements): the accumulator is born at the block's first visit, picks up each
  visit's contribution, and its last hop, in the same direction, lands it back on the block's
  owner, which adds its own step-0 contribution.

So ``(n - 1) B (2 s_in + 4)`` bytes sent per device for forward and backward together (``s_in``
the input's item size). Nothing is gathered over ``sequence``.

The steps after the first run as a ``lax.scan`` (the backward's first visiting step, where no
accumulator arrives yet, by itself), so a step holds one visiting block and the next in flight
whatever XLA's scheduler does: with an unrolled loop, XLA:CPU hoisted every hop ahead of the
compute and kept every block.

Overlap: the transfer for step ``t + 1`` (and in the backward the previous accumulator's hop) is
issued before step ``t``'s block computation and nothing in that computation depends on it, so a
scheduler may run them together. What the compiled HLO shows on XLA:CPU (``jax.jit(f).lower(...)
.compile().as_text()``): every hop is a synchronous ``collective-permute``, no
``collective-permute-start`` / ``-done`` pair, scheduled at the top of the scan's while body
before the block's fusions (and in the entry computation before step 0's attention): XLA:CPU runs
collectives synchronously, so nothing overlaps there. On GPU XLA makes collective-permutes async
start/done pairs that its latency-hiding scheduler can place around the block's compute; that has
not been looked at on a GPU.

The step runs under ``jax.shard_map(..., check_vma=False)``, so the ring's backward is written as a
``jax.custom_vjp`` (autodiff of ``ppermute`` is not relied on). Its block backward recomputes the
probabilities from the final ``lse`` (``p = exp(s - lse)``, ``D = rowsum(dout * out)``,
``ds = p (dp - D)``), which gives each block's share of dq and its dk, dv; ``impl="pallas"`` calls
``dew.kernels.flash_attention_backward`` with the final out and lse for exactly that. The cotangent
of ``lse``, when there is one, enters as ``D - d_lse``.

On a sequence axis of size 1 both schemes are the plain attention call, without a collective, so
the same model code runs on one device (``ONE_DEVICE``) without a mesh.

Layout: the zigzag order (``check_seq_len``, ``zigzag_positions``), the argument checks, the block
computations a ring step runs (``_xla_block_forward`` to ``_pallas_block_backward``), the ring
(``_ring_forward``, ``_ring_backward``, the ``custom_vjp`` ``_ring``), a window within a chunk
(``halo_length``, ``_halo_attention``), ``ring_attention``, the
all-to-all scheme (``all_to_all_attention``, ``SCHEMES``), and what the model asks of the module
(``check_heads``, ``attention``). It is one module because all of it serves one axis, and the ring's
forward and its hand-written backward must be read side by side.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.custom_derivatives import SymbolicZero

from dew.checks import positive_int
from dew.nn.attention import IMPLEMENTATIONS, LAYOUT, check_window, masked_attention

AXIS = "sequence"
# Local activations are [batch, positions, ...]: the positions are dimension 1.
SEQUENCE_DIM = 1


def _size(shards) -> int:
    return shards.size(AXIS)


# --- The zigzag order -----------------------------------------------------------------------------


def check_seq_len(seq_len: int, n: int) -> int:
    """The chunk length ``seq_len / (2 n)``; ``ValueError`` naming the numbers when it is not whole.

    Args:
      seq_len: the global sequence length ``S``.
      n: the size of the ``sequence`` axis.
    """
    seq_len = positive_int("seq_len", seq_len)
    n = positive_int("sequence", n)
    if seq_len % (2 * n):
        raise ValueError(f"seq_len {seq_len} does not split into 2 x sequence {n} = {2 * n} chunks")
    return seq_len // (2 * n)


def zigzag_positions(seq_len: int, n: int) -> np.ndarray:
    """The global positions in device-major zigzag order: int32 ``[seq_len]``.

    Device ``i`` holds chunk ``i`` and chunk ``2n-1-i`` of ``2n`` chunks of ``c = seq_len / (2n)``
    positions; entries ``[2c i, 2c (i+1))`` are its positions, in its local order. So
    ``x[:, zigzag_positions(S, n)]``, split over ``sequence`` on dimension 1, gives each device
    its chunks, and the same slice of the result is the ``positions`` its rotary embedding takes.
    ``zigzag_positions(S, 1)`` is ``arange(S)``.
    """
    c = check_seq_len(seq_len, n)
    chunks = np.arange(seq_len, dtype=np.int32).reshape(2 * n, c)
    first, second = chunks[:n], chunks[n:][::-1]
    return np.stack([first, second], axis=1).reshape(seq_len)


def _zigzag_to_natural(x: jax.Array, n: int, axis: int) -> jax.Array:
    """``x`` whose ``axis`` runs over the whole sequence in zigzag (device-major) order -> natural
    order. Static slices and a reversal, no gather."""
    shape = x.shape
    c = shape[axis] // (2 * n)
    y = x.reshape(shape[:axis] + (n, 2, c) + shape[axis + 1 :])
    first = lax.index_in_dim(y, 0, axis + 1, keepdims=False)  # chunks 0 .. n-1
    second = jnp.flip(lax.index_in_dim(y, 1, axis + 1, keepdims=False), axis)  # n .. 2n-1
    return jnp.concatenate([first, second], axis=axis).reshape(shape)


def _natural_to_zigzag(x: jax.Array, n: int, axis: int) -> jax.Array:
    """The inverse of ``_zigzag_to_natural``."""
    shape = x.shape
    c = shape[axis] // (2 * n)
    y = x.reshape(shape[:axis] + (2 * n, c) + shape[axis + 1 :])
    first = lax.slice_in_dim(y, 0, n, axis=axis)
    second = jnp.flip(lax.slice_in_dim(y, n, 2 * n, axis=axis), axis)
    return jnp.stack([first, second], axis=axis + 1).reshape(shape)


# --- Argument checks ------------------------------------------------------------------------------


def _check_impl(name: str, impl: str) -> None:
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"{name}: impl must be one of {sorted(IMPLEMENTATIONS)}, got {impl!r}")


def _check_shapes(name: str, q, k, v, n: int, segment_ids=None) -> None:
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise ValueError(
            f"{name}: q must be [batch, heads, 2c, d] and k, v [batch, kv_heads, 2c, d], got "
            f"q {q.shape}, k {k.shape}, v {v.shape}"
        )
    if q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(
            f"{name}: q {q.shape} and k, v {k.shape} must agree on batch, positions and head_dim"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{name}: heads {q.shape[1]} must be a multiple of kv_heads {k.shape[1]}")
    local = q.shape[2]
    if local % 2:
        raise ValueError(
            f"{name}: this device's {local} positions are not two zigzag chunks: seq_len "
            f"{local * n} does not split into 2 x sequence {n} = {2 * n} chunks"
        )
    if segment_ids is not None and tuple(segment_ids.shape) != (q.shape[0], local):
        raise ValueError(
            f"{name}: segment_ids must be [batch, positions] = {(q.shape[0], local)} (this "
            f"device's), got {tuple(segment_ids.shape)}"
        )


# --- Blocks ---------------------------------------------------------------------------------------
#
# q, out, d_out: [b, h, m, d]; k, v: [b, kv, s, d]; lse, d_lse: [b, h, m] (the model's layout,
# dew.nn.attention.LAYOUT). ``causal`` is the mask on the block's own indices (the own block at
# step 0, whose local order is the zigzag chunks' global order); ``ids``: None or the pair
# (q_ids [b, m], kv_ids [b, s]); ``positions``: None or the pair (q rows' global positions [m],
# keys' [s]), which the XLA blocks mask a window by (the Pallas blocks take no window on a ring).


def _xla_mask(m: int, s_len: int, causal: bool, ids, window, positions):
    """bool ``[b or 1, m, s]`` of the pairs a block computes, or ``None`` when it computes all."""
    mask = None
    if causal:
        mask = jnp.tril(jnp.ones((m, s_len), bool))[None]
    if window is not None:
        q_pos, k_pos = positions
        near = (k_pos[None, :] > q_pos[:, None] - window)[None]
        mask = near if mask is None else mask & near
    if ids is not None:
        same = ids[0][:, :, None] == ids[1][:, None, :]
        mask = same if mask is None else mask & same
    return mask


def _xla_block_forward(q, k, v, causal, ids=None, window=None, positions=None):
    """``(out, lse)`` of one block: ``dew.nn.attention.masked_attention`` with the mask of
    ``_xla_mask``; a row that sees no key gives zeros and ``lse = -inf`` (merging ignores it)."""
    mask = _xla_mask(q.shape[2], k.shape[2], causal, ids, window, positions)
    if mask is None:
        return IMPLEMENTATIONS["xla"](q, k, v, causal=False)
    return masked_attention(q, k, v, mask)


def _pallas_block_forward(q, k, v, causal, ids=None, window=None, positions=None, interpret=None):
    from dew.kernels import flash_attention_forward

    extra = {} if ids is None else {"segment_ids": ids}
    return flash_attention_forward(
        q, k, v, causal=causal, interpret=interpret, layout=LAYOUT, **extra
    )


def _xla_block_backward(
    q, k, v, out, lse, d_out, d_lse, causal, ids=None, window=None, positions=None
):
    """``(dq, dk, dv)`` float32 of one block, from the final ``out`` and ``lse`` of these rows
    (d_lse may be ``None``). ``p = exp(s - lse)`` is this block's share of the final softmax, so
    the results are its share of dq and its whole dk, dv (masked pairs: ``p = 0``)."""
    b, h, m, d = q.shape
    kv, s_len = k.shape[1], k.shape[2]
    groups = h // kv
    scale = 1.0 / math.sqrt(d)
    f32 = jnp.float32
    qg = q.reshape(b, kv, groups, m, d)
    dog = d_out.reshape(b, kv, groups, m, d)
    delta = jnp.einsum("bhqd,bhqd->bhq", d_out.astype(f32), out.astype(f32))
    if d_lse is not None:
        delta = delta - d_lse  # d lse / d logits = p: it adds p d_lse to ds
    rows = lambda x: x.reshape(b, kv, groups, m)[..., None]  # noqa: E731
    logits = jnp.einsum("bkgqd,bksd->bkgqs", qg, k, preferred_element_type=f32) * scale
    mask = _xla_mask(m, s_len, causal, ids, window, positions)
    if mask is not None:
        logits = jnp.where(mask[:, None, None], logits, np.float32(-np.inf))
    p = jnp.exp(logits - rows(lse))
    dp = jnp.einsum("bkgqd,bksd->bkgqs", dog, v, preferred_element_type=f32)
    ds = p * (dp - rows(delta))
    dq = jnp.einsum("bkgqs,bksd->bkgqd", ds, k, preferred_element_type=f32) * scale
    dk = jnp.einsum("bkgqs,bkgqd->bksd", ds, qg, preferred_element_type=f32) * scale
    dv = jnp.einsum("bkgqs,bkgqd->bksd", p, dog, preferred_element_type=f32)
    return dq.reshape(b, h, m, d), dk, dv


def _pallas_block_backward(
    q, k, v, out, lse, d_out, d_lse, causal, ids=None, window=None, positions=None, interpret=None
):
    """``_xla_block_backward`` with Dew's Pallas backward kernels: one call, one dq kernel and one
    dk/dv kernel per block.

    ``d_lse`` (float32 ``[b, h, m]`` or ``None``) goes to the kernels as it is: they read
    ``delta = rowsum(d_out * out) - d_lse``, so the lse cotangent costs no second pass. The
    results come back in q's dtype and are returned as float32, like ``_xla_block_backward``'s.
    """
    from dew.kernels import flash_attention_backward

    extra = {} if ids is None else {"segment_ids": ids}
    grads = flash_attention_backward(
        q, k, v, out, lse, d_out, d_lse, causal=causal, interpret=interpret, layout=LAYOUT, **extra
    )
    return tuple(g.astype(jnp.float32) for g in grads)


# "pallas" follows the devices the step is compiled for (Mosaic on TPU, Triton on GPU, the
# interpreter on CPU); "pallas_tpu_interpret" runs the Mosaic kernels in TPU interpret mode.
_BLOCK_FORWARD = {
    "xla": _xla_block_forward,
    "pallas": _pallas_block_forward,
    "pallas_tpu_interpret": functools.partial(_pallas_block_forward, interpret="tpu"),
}
_BLOCK_BACKWARD = {
    "xla": _xla_block_backward,
    "pallas": _pallas_block_backward,
    "pallas_tpu_interpret": functools.partial(_pallas_block_backward, interpret="tpu"),
}
# The ring's blocks that take a window (by the blocks' global positions): XLA's. The kernels'
# window is counted from each call's own last key, which a ring block's offset does not fit.
_WINDOWED_BLOCKS = ("xla",)


# --- Ring attention -------------------------------------------------------------------------------


def _pass(x, n: int):
    """Send ``x`` to the next device of the ring (device ``i`` receives device ``i - 1``'s).
    One ``ppermute`` over ``sequence``: ``x``'s bytes sent and received per device."""
    return lax.ppermute(x, AXIS, [(j, (j + 1) % n) for j in range(n)])


def _index(start):
    # int32 whatever the mode: under jax_enable_x64 a Python int would become an int64 index.
    return jnp.asarray(start, jnp.int32)


def _rows(x, start, size: int, axis: int):
    return lax.dynamic_slice_in_dim(x, _index(start), size, axis)


def _add_rows(acc, start, value, axis: int):
    """``acc`` with ``value`` added to its rows ``[start, start + len)`` along ``axis``."""
    size = value.shape[axis]
    updated = _rows(acc, start, size, axis) + value
    return lax.dynamic_update_slice_in_dim(acc, updated, _index(start), axis)


def _merge_rows(out, lse, start, block_out, block_lse):
    """Online softmax: merge one block's ``(out, lse)`` for rows ``[start, start + m)`` into the
    float32 accumulators ``out`` ``[b, h, 2c, d]`` and ``lse`` ``[b, h, 2c]``. A block row that saw
    no key (``block_lse = -inf``, out 0) leaves the row as it was: the own block came first, so
    every row's ``lse`` is already finite."""
    m = block_out.shape[2]
    old_out, old_lse = _rows(out, start, m, 2), _rows(lse, start, m, 2)
    new_lse = jnp.logaddexp(old_lse, block_lse)
    weight = lambda part: jnp.exp(part - new_lse)[..., None]  # noqa: E731
    new_out = weight(old_lse) * old_out + weight(block_lse) * block_out.astype(jnp.float32)
    out = lax.dynamic_update_slice_in_dim(out, new_out, _index(start), 2)
    return out, lax.dynamic_update_slice_in_dim(lse, new_lse, _index(start), 2)


def _pairs(c: int, t, i):
    """The two ``c x c`` unmasked (query chunk start, key chunk start) pairs of the block visiting
    device ``i`` at step ``t >= 1`` (its owner is ``i - t``, before ``i`` exactly when ``t <= i``):
    (second query chunk, first key chunk), seen in both cases, and chunk ``o`` of each, ``o = 0``
    when the owner precedes this device, else ``1``."""
    own = jnp.where(t <= i, _index(0), _index(c))
    return ((c, 0), (own, own))


def _global_positions(device, c: int, n: int):
    """int32 ``[2c]``: the global positions of ``device``'s zigzag rows (chunks ``device`` and
    ``2n - 1 - device``)."""
    index = jnp.arange(c, dtype=jnp.int32)
    device = _index(device)
    return jnp.concatenate([device * c + index, (2 * n - 1 - device) * c + index])


class _Block:
    """What one ring step's block calls need besides q, k, v: the q rows' and the visiting keys'
    segment ids and global positions (each ``None`` when unused), sliced per pair."""

    def __init__(self, q_ids, kv_ids, q_pos, k_pos):
        self.q_ids, self.kv_ids, self.q_pos, self.k_pos = q_ids, kv_ids, q_pos, k_pos

    def at(self, q_at, k_at, q_len: int, k_len: int):
        """``(ids, positions)`` for the block of queries ``[q_at, q_at + q_len)`` and keys
        ``[k_at, k_at + k_len)``."""
        ids = positions = None
        if self.q_ids is not None:
            ids = (_rows(self.q_ids, q_at, q_len, 1), _rows(self.kv_ids, k_at, k_len, 1))
        if self.q_pos is not None:
            positions = (_rows(self.q_pos, q_at, q_len, 0), _rows(self.k_pos, k_at, k_len, 0))
        return ids, positions


def _gather_ids(ids):
    """Every device's segment ids, ``[b, n 2c]`` in device order: one ``all_gather`` over
    ``sequence`` of int32 ``[b, 2c]`` (``4 b 2c (n - 1)`` bytes received per device: the bytes the
    ids would cost travelling with each K/V block, in one collective instead of ``n - 1`` forward
    and ``n - 1`` backward). ``None`` without ids."""
    return None if ids is None else lax.all_gather(ids, AXIS, axis=1, tiled=True)


def _ring_context(ids, all_ids, n: int, c: int, window):
    """``visiting(t) -> _Block`` for this device's ring steps, and its own block's ``_Block``:
    the visiting block's ids sliced from ``all_ids`` (``_gather_ids``), its positions (for a
    window) computed from its owner's index."""
    i = lax.axis_index(AXIS)
    own_pos = None if window is None else _global_positions(i, c, n)

    def visiting(t):
        src = (i - t) % n
        kv_ids = None if ids is None else _rows(all_ids, src * 2 * c, 2 * c, 1)
        k_pos = None if window is None else _global_positions(src, c, n)
        return _Block(ids, kv_ids, own_pos, k_pos)

    return visiting, _Block(ids, ids, own_pos, own_pos)


def _ring_steps(n: int, first: int, state, incoming, visit):
    """``state = visit(t, block, state)`` for ring steps ``t = first .. n - 1``, block ``t`` being
    the K/V block of device ``i - t``; ``incoming`` is block ``first``, already in flight.

    Each step but the last sends its block on (it is the next device's next block) before its own
    computation, so the transfer may overlap it. A ``scan``, not a Python loop: whatever XLA's
    scheduler does, a step holds only its block and the next one, where an unrolled loop let it
    hoist every transfer (and keep every block) ahead of the compute.
    """

    def step(carry, t):
        state, block = carry
        following = _pass(block, n)
        return (visit(t, block, state), following), None

    if n - 1 > first:
        (state, incoming), _ = lax.scan(
            step, (state, incoming), jnp.arange(first, n - 1, dtype=jnp.int32)
        )
    return visit(n - 1, incoming, state)


def _ring_forward(q, k, v, ids, all_ids, n: int, impl: str, window):
    attend = _BLOCK_FORWARD[impl]
    c = q.shape[2] // 2
    i = lax.axis_index(AXIS)
    visiting, own = _ring_context(ids, all_ids, n, c, window)

    def visit(t, block, state):
        out, lse = state
        block_k, block_v = block[0], block[1]
        context = visiting(t)
        for q_at, k_at in _pairs(c, t, i):
            block_ids, positions = context.at(q_at, k_at, c, c)
            block_out, block_lse = attend(
                _rows(q, q_at, c, 2),
                _rows(block_k, k_at, c, 2),
                _rows(block_v, k_at, c, 2),
                False,
                block_ids,
                window,
                positions,
            )
            out, lse = _merge_rows(out, lse, q_at, block_out, block_lse)
        return out, lse

    incoming = _pass(jnp.stack([k, v]), n)  # issued before step 0's compute
    own_ids, own_positions = own.at(0, 0, 2 * c, 2 * c)
    out, lse = attend(q, k, v, True, own_ids, window, own_positions)
    out, lse = _ring_steps(n, 1, (out.astype(jnp.float32), lse), incoming, visit)
    return out.astype(q.dtype), lse


def _ring_backward(n: int, impl: str, window, q, k, v, ids, all_ids, out, lse, d_out, d_lse):
    grads = _BLOCK_BACKWARD[impl]
    c = q.shape[2] // 2
    i = lax.axis_index(AXIS)
    visiting, own = _ring_context(ids, all_ids, n, c, window)

    def contributions(t, block, dq):
        """This step's share of dq (added to ``dq``) and the visiting block's [dV, dK] float32."""
        block_v, block_k = block[0], block[1]
        context = visiting(t)
        contribution = jnp.zeros(block.shape, jnp.float32)
        for q_at, k_at in _pairs(c, t, i):
            rows_of = lambda x: _rows(x, q_at, c, 2)  # noqa: E731
            block_ids, positions = context.at(q_at, k_at, c, c)
            dq_p, dk_p, dv_p = grads(
                rows_of(q),
                _rows(block_k, k_at, c, 2),
                _rows(block_v, k_at, c, 2),
                rows_of(out),
                rows_of(lse),
                rows_of(d_out),
                None if d_lse is None else rows_of(d_lse),
                False,
                block_ids,
                window,
                positions,
            )
            dq = _add_rows(dq, q_at, dq_p, 2)
            contribution = _add_rows(contribution, k_at, jnp.stack([dv_p, dk_p]), 3)
        return dq, contribution

    def visit(t, block, state):
        dq, travelling = state
        # The accumulator of this block from the previous device: in flight during the compute.
        arrived = _pass(travelling, n)
        dq, contribution = contributions(t, block, dq)
        return dq, arrived + contribution

    # V first: not the forward's K-first stack, so XLA cannot merge this hop with the forward's
    # (a common subexpression) and keep that block alive from forward to backward.
    incoming = _pass(jnp.stack([v, k]), n)
    own_ids, own_positions = own.at(0, 0, 2 * c, 2 * c)
    dq, dk, dv = grads(q, k, v, out, lse, d_out, d_lse, True, own_ids, window, own_positions)
    own_grads = jnp.stack([dv, dk])  # this device's block's gradient from its own queries
    # Step 1 by itself: the block's accumulator is born here, nothing arrives with it.
    block = incoming
    if n > 2:
        incoming = _pass(block, n)
    dq, travelling = contributions(1, block, dq)
    if n > 2:
        dq, travelling = _ring_steps(n, 2, (dq, travelling), incoming, visit)
    own_grads = own_grads + _pass(travelling, n)  # the last hop brings each accumulator home
    return dq.astype(q.dtype), own_grads[1].astype(k.dtype), own_grads[0].astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _ring(q, k, v, ids, all_ids, n, impl, window):
    return _ring_forward(q, k, v, ids, all_ids, n, impl, window)


def _ring_fwd(q, k, v, ids, all_ids, n, impl, window):
    # symbolic_zeros: the primals come wrapped, and a cotangent nobody asked for (the model's
    # lse) arrives as a SymbolicZero, and the backward passes d_lse=None (nothing to subtract).
    q, k, v = q.value, k.value, v.value
    ids, all_ids = (None if x is None else x.value for x in (ids, all_ids))
    out, lse = _ring_forward(q, k, v, ids, all_ids, n, impl, window)
    # Named so that remat="attention" saves them and the backward does not run the ring again.
    out, lse = checkpoint_name(out, "attention_out"), checkpoint_name(lse, "attention_lse")
    return (out, lse), (q, k, v, ids, all_ids, out, lse)


def _ring_bwd(n, impl, window, residuals, cotangents):
    q, k, v, ids, all_ids, out, lse = residuals
    d_out, d_lse = cotangents
    if isinstance(d_out, SymbolicZero):
        d_out = jnp.zeros(out.shape, out.dtype)
    if isinstance(d_lse, SymbolicZero):
        d_lse = None
    d_out = d_out.astype(out.dtype)
    grads = _ring_backward(n, impl, window, q, k, v, ids, all_ids, out, lse, d_out, d_lse)
    return (*grads, None, None)  # the ids are integers: no cotangent


_ring.defvjp(_ring_fwd, _ring_bwd, symbolic_zeros=True)


def _plain(impl: str, q, k, v, segment_ids, window):
    """The plain attention call (a sequence axis of 1), with segment ids and window when set."""
    extra = {"segment_ids": segment_ids, "window": window}
    return IMPLEMENTATIONS[impl](
        q, k, v, causal=True, **{name: x for name, x in extra.items() if x is not None}
    )


# --- A window within a chunk: the halo ---------------------------------------------------------
#
# A query sees at most the ``window`` most recent keys. When ``window <= c``, each chunk's queries
# see only their own chunk and the chunk before it, and of that one at most its last ``window - 1``
# keys: each device takes those keys from the one device that holds them (a halo exchange), and
# attends each of its chunks once, over the halo and the chunk, with the window as the kernels
# count it (from the call's own last key: the queries are the last ``c`` of ``halo + c`` keys).


def halo_length(window: int, c: int) -> int:
    """The keys a chunk takes from the chunk before it under ``window`` (``<= c``): the ``window -
    1`` its first query can see, rounded up to a multiple of 128 (whole lanes and sublane tiles
    for the kernels, no padded tail to copy) but at most the chunk; the keys past ``window - 1``
    are outside every query's window, and masked."""
    return min(c, -(-(window - 1) // 128) * 128)


def _halo_attention(q, k, v, ids, n: int, impl: str, window: int):
    """``ring_attention``'s result for ``window <= c``, by a halo exchange instead of a ring.

    Device ``i``'s chunk ``i`` follows chunk ``i - 1`` (device ``i - 1``'s first) and its chunk
    ``2n-1-i`` follows chunk ``2n-2-i`` (device ``i + 1``'s second; on device ``n - 1``, its own
    first). So two ``ppermute`` over ``sequence`` bring the last ``H = halo_length(window, c)``
    keys and values of each: ``2 x 2 batch kv_heads H d`` elements of the input dtype sent per
    device (and the ids' ``2 batch H`` int32 with segment ids); autodiff's transposes send the
    halos' dK/dV back the same size (exact under ``check_vma=False``: no ``psum``). Each chunk is
    then one call of ``impl`` over ``H + c`` keys, causal with the window: the Pallas kernels skip
    the blocks outside it. Chunk 0 (device 0's first) has no chunk before it: that device
    attends it over its own keys alone (a ``lax.cond`` on the device index)."""
    c = q.shape[2] // 2
    h = halo_length(window, c)
    i = lax.axis_index(AXIS)
    kv = jnp.stack([k, v])  # [2, b, kv_heads, 2c, d]: one exchange for both

    def chunks(x, axis):
        return lax.slice_in_dim(x, 0, c, axis=axis), lax.slice_in_dim(x, c, 2 * c, axis=axis)

    def tail(x, axis):
        return lax.slice_in_dim(x, c - h, c, axis=axis)

    def halos(x, axis):
        """The last ``h`` positions of the chunk before each of this device's two chunks (zeros
        before chunk 0: unused)."""
        first, second = chunks(x, axis)
        # chunk j's tail to device j + 1 (its chunk j + 1); chunk 2n-2-j's (device j + 1's
        # second) to device j (its chunk 2n-1-j); device n - 1 holds both n - 1 and n.
        before_first = lax.ppermute(tail(first, axis), AXIS, [(j, j + 1) for j in range(n - 1)])
        before_second = lax.ppermute(tail(second, axis), AXIS, [(j + 1, j) for j in range(n - 1)])
        return before_first, jnp.where(i == n - 1, tail(first, axis), before_second)

    (q1, q2), (kv1, kv2) = chunks(q, 2), chunks(kv, 3)
    halo1, halo2 = halos(kv, 3)
    pairs = [None, None]
    own_pair = None
    if ids is not None:
        (ids1, ids2), (id_halo1, id_halo2) = chunks(ids, 1), halos(ids, 1)
        pairs = [
            (ids1, jnp.concatenate([id_halo1, ids1], axis=1)),
            (ids2, jnp.concatenate([id_halo2, ids2], axis=1)),
        ]
        own_pair = ids1

    def call(q_chunk, k_keys, v_keys, pair):
        return _plain(impl, q_chunk, k_keys, v_keys, pair, window)

    if impl == "xla":
        # XLA's attention keeps each chunk's [c, H + c] probabilities for its backward, both
        # chunks' at once; recomputed from q, k and v instead (as the ring's backward recomputes
        # its blocks from the lse), the step holds less than the ring's XLA blocks (compiled for
        # v5e-4 at 8192 positions, 8 heads: 177 MiB of temporaries against the ring's 272, and
        # 345 kept). The kernels keep only out and lse.
        call = jax.checkpoint(call)

    def attend(q_chunk, halo, own, pair):
        keys = jnp.concatenate([halo, own], axis=3)
        return call(q_chunk, keys[0], keys[1], pair)

    out2, lse2 = attend(q2, halo2, kv2, pairs[1])
    out1, lse1 = lax.cond(
        i == 0,
        lambda: call(q1, kv1[0], kv1[1], own_pair),
        lambda: attend(q1, halo1, kv1, pairs[0]),
    )
    return jnp.concatenate([out1, out2], axis=2), jnp.concatenate([lse1, lse2], axis=2)


def ring_attention(q, k, v, shards, impl: str = "xla", *, segment_ids=None, window=None):
    """Causal attention over the whole sequence, for this device's zigzag rows, as a ring.

    Args:
      q: ``[batch, heads, 2c, d]`` (the model's layout), this device's chunks ``i`` and
        ``2n-1-i`` (rotary applied with their positions).
      k, v: ``[batch, kv_heads, 2c, d]``, the same positions; query head ``h`` uses kv head
        ``h // (heads // kv_heads)``.
      shards: the step's ``Shards``; ``n = shards.size("sequence")``. At ``n = 1`` this is the
        plain causal attention call, without a collective.
      impl: the block computation, ``"xla"`` (plain JAX), ``"pallas"`` (``dew.kernels``, for
        the devices the step is compiled for) or ``"pallas_tpu_interpret"`` (its Mosaic kernels
        in TPU interpret mode).
      segment_ids: ``None``, or int32 ``[batch, 2c]``, the document ids of this device's rows: a
        query attends only to keys of its id. Every device's ids are gathered once (one
        ``all_gather`` of int32 ``[batch, 2c]``) and each visiting K/V block's are sliced from
        them; the Pallas blocks take the pair ``(q_ids, kv_ids)`` and skip the block pairs whose
        ids never meet.
      window: ``None`` or ``W``: each query sees at most the ``W`` most recent keys (global
        positions). ``W <= c``: a halo exchange, any ``impl`` (``_halo_attention``). ``W > c``:
        the ring with XLA blocks only (``ValueError`` for the Pallas blocks; the all-to-all
        scheme takes it with any ``impl``).

    Returns:
      ``(out, lse)``: ``out`` ``[batch, heads, 2c, d]`` in q's dtype, ``lse`` float32
      ``[batch, heads, 2c]``, what causal attention on the natural-order sequence gives at these
      positions; both differentiable (a ``custom_vjp`` ring, see the module docstring).
    """
    _check_impl("ring_attention", impl)
    n = _size(shards)
    if impl not in _BLOCK_FORWARD and n > 1:
        raise ValueError(
            f"ring_attention: impl {impl!r} gives no log-sum-exp to merge blocks by; use one of "
            f"{', '.join(_BLOCK_FORWARD)} on a ring (or the all_to_all scheme)"
        )
    check_window(window)
    _check_shapes("ring_attention", q, k, v, n, segment_ids)
    c = q.shape[2] // 2
    if window is not None and n > 1 and window > c and impl not in _WINDOWED_BLOCKS:
        raise ValueError(window_refusal(impl, n, window, c))
    if n == 1 or window == 1:  # (a window of 1: each query sees itself, nothing to exchange)
        return _plain(impl, q, k, v, segment_ids, window)
    ids = None if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
    if window is not None and window <= c:
        return _halo_attention(q, k, v, ids, n, impl, window)
    return _ring(q, k, v, ids, _gather_ids(ids), n, impl, window)


def window_refusal(impl: str, n: int, window: int, c: int | None) -> str:
    """Why a ring of ``n`` with chunks of ``c`` positions (``None``: not known) cannot run
    ``impl``'s blocks with a window above ``c`` (a sentence)."""
    if c is None:
        beyond = f"is not known to fit a zigzag chunk (seq_len / {2 * n}; no seq_len was given)"
        fits = "a window of at most a chunk"
    else:
        beyond = f"is longer than a zigzag chunk (seq_len / {2 * n} = {c} positions)"
        fits = f"a window of at most {c}"
    return (
        f"attention window {window} on a sequence ring of {n} {beyond}, so the ring runs it "
        f"with attention 'xla' only: the {impl!r} kernels count a "
        "window from each call's own last key, which a ring block's offset does not fit; use "
        "sequence_scheme 'all_to_all' (any attention), attention 'xla' (which 'auto' takes "
        f"there), or {fits}, which the ring's halo exchange runs with any attention"
    )


# --- All-to-all (DeepSpeed-Ulysses) ---------------------------------------------------------------


def _positions_to_heads(x, n: int):
    """``[b, heads, 2c, d]`` (this device's zigzag positions, all heads) -> ``[b, heads / n, S,
    d]`` (every position in natural order, head group ``i``). All-to-all: ``(n - 1) / n`` of
    ``x``'s bytes sent per device; its transpose (autodiff's backward) is the reverse
    all-to-all."""
    x = lax.all_to_all(x, AXIS, split_axis=1, concat_axis=2, tiled=True)
    return _zigzag_to_natural(x, n, axis=2)


def _heads_to_positions(x, n: int):
    """The inverse of ``_positions_to_heads``, for ``out`` ``[b, heads / n, S, d]`` and ``lse``
    ``[b, heads / n, S]`` (heads at 1, positions at 2 in both). All-to-all: ``(n - 1) / n`` of
    ``x``'s bytes sent."""
    x = _natural_to_zigzag(x, n, axis=2)
    return lax.all_to_all(x, AXIS, split_axis=2, concat_axis=1, tiled=True)


def all_to_all_attention(q, k, v, shards, impl: str = "xla", *, segment_ids=None, window=None):
    """Causal attention over the whole sequence, for this device's zigzag rows, by trading
    positions for heads (DeepSpeed-Ulysses).

    Arguments and results as ``ring_attention``'s. ``heads`` and ``kv_heads`` must divide by
    ``n``: device ``i`` attends with query heads ``[i h/n, (i+1) h/n)`` and kv heads
    ``[i kv/n, (i+1) kv/n)``, which are the kv heads those query heads use. Each device then
    holds the whole sequence in natural order, so ``segment_ids`` (gathered: one ``all_gather``
    of int32 ``[batch, 2c]``, put in natural order) and ``window`` go to ``impl`` as they are,
    the kernels included.

    Collectives over ``sequence`` per call: five ``all_to_all`` forward (q, k, v in; out and lse
    back; XLA drops lse's when the caller discards it) and, in the backward, the transposes of
    those whose outputs have a cotangent (out's, then q's, k's and v's: four when lse is
    discarded). Each sends ``(n - 1) / n`` of its operand per device. Autodiff writes that
    backward: an ``all_to_all``'s transpose is the reverse ``all_to_all``, exact under
    ``check_vma=False`` (no ``psum`` is involved).
    """
    _check_impl("all_to_all_attention", impl)
    n = _size(shards)
    check_window(window)
    _check_shapes("all_to_all_attention", q, k, v, n, segment_ids)
    if n == 1:
        return _plain(impl, q, k, v, segment_ids, window)
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % n or kv_heads % n:
        raise ValueError(
            f"all_to_all_attention: heads {heads} and kv_heads {kv_heads} must both divide by "
            f"sequence {n} (use the ring scheme otherwise)"
        )
    if segment_ids is not None:
        gathered = lax.all_gather(jnp.asarray(segment_ids, jnp.int32), AXIS, axis=1, tiled=True)
        segment_ids = _zigzag_to_natural(gathered, n, axis=1)
    q, k, v = (_positions_to_heads(x, n) for x in (q, k, v))
    out, lse = _plain(impl, q, k, v, segment_ids, window)
    out = _heads_to_positions(out, n)
    if lse is None:  # "cudnn" gives none
        return out, None
    return out, _heads_to_positions(lse, n)


SCHEMES = {"ring": ring_attention, "all_to_all": all_to_all_attention}
"""Sequence-parallel attention by scheme name: ``SCHEMES[name](q, k, v, shards, impl)``."""


# --- What the model and the Trainer ask of this module -------------------------------------------


def check_heads(
    scheme: str, n: int, num_heads: int, num_kv_heads: int, tensor_size: int = 1
) -> None:
    """Raises ``ValueError`` for an unknown ``scheme``, or, for ``"all_to_all"`` on a sequence axis
    of ``n > 1``, when a device's heads or kv heads (after the tensor split; a shared kv head
    counts one) do not split over ``n``."""
    if scheme not in SCHEMES:
        raise ValueError(
            f"unknown sequence_scheme {scheme!r}; expected one of {', '.join(SCHEMES)}"
        )
    if scheme != "all_to_all" or n == 1:
        return
    for name, total in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        local = max(total // tensor_size, 1)
        if local % n:
            raise ValueError(
                f"sequence_scheme 'all_to_all' trades positions for heads: {name} {total} "
                f"({local} per device over tensor {tensor_size}) does not split over sequence {n}"
            )


def attention(shards, impl: str = "xla"):
    """The attention function ``(q, k, v, *, causal, segment_ids=None, window=None) -> (out,
    lse)`` the decoder calls, in the model's layout: the plain one
    (``dew.nn.attention.IMPLEMENTATIONS[impl]``) on a sequence axis of size 1, else
    ``shards.options.sequence_scheme``'s, which spans every device's positions (always causal;
    this device's ``segment_ids`` go with its rows)."""
    if shards.size(AXIS) == 1:
        return IMPLEMENTATIONS[impl]
    scheme = SCHEMES[shards.options.sequence_scheme]

    def attend(q, k, v, *, causal=True, segment_ids=None, window=None):
        if not causal:
            raise ValueError("attention over a sequence axis is causal only")
        return scheme(q, k, v, shards, impl, segment_ids=segment_ids, window=window)

    return attend
