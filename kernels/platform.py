"""Which kernels a call runs, and with which blocks: the target, read from the devices the
computation is compiled for, and each target's default block sizes and block rules.

Targets:

- ``"mosaic"``: the Mosaic TPU kernels (`kernels/mosaic_forward.py`, `kernels/mosaic_backward.py`),
  compiled for a TPU;
- ``"mosaic_interpret"``: the same kernels in TPU interpret mode
  (``pallas_call(..., interpret=pltpu.InterpretParams())``), on any backend: what tests run on CPU;
- ``"triton"``: the GPU kernels (`kernels/forward.py`, `kernels/backward.py`), compiled for a GPU;
- ``"interpret"``: the GPU kernels in Pallas' generic interpreter, on any backend.

The devices a call is compiled for are those of the mesh it is traced under (inside
``jax.shard_map``, or ``jax.sharding.use_mesh``): ``jax.sharding.get_abstract_mesh()`` carries
their platform and device kind. A step compiled for a TPU slice from a CPU host (``dew plan``,
``Trainer(devices=target("v5p-16").devices())``) therefore gets the Mosaic kernels, not the
default backend's. Outside any mesh, the default backend's first device decides.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import numpy as np

TARGETS = ("mosaic", "mosaic_interpret", "triton", "interpret")

# `interpret=` values: None picks from the devices, True / False / "tpu" force a target.
TPU_INTERPRET = "tpu"


@dataclasses.dataclass(frozen=True)
class Device:
    """What a call is compiled for: ``platform`` ("cpu", "gpu", "tpu") and ``device_kind``
    ("TPU v5 lite", ...; ``jax.Device.device_kind``)."""

    platform: str
    device_kind: str


def compile_device() -> Device:
    """The platform and device kind of the devices the traced computation is compiled for: the
    current mesh's (inside ``shard_map`` or ``use_mesh``), else the default backend's."""
    abstract = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    if abstract is not None:
        return Device(abstract.platform, abstract.device_kind)
    device = jax.devices()[0]
    return Device(device.platform, device.device_kind)


def choose_target(interpret) -> str:
    """The target of one call (a name in ``TARGETS``), from ``interpret`` and `compile_device`.

    ``interpret``: ``None`` (Mosaic on TPU, Triton on GPU, the generic interpreter on CPU),
    ``True`` (the generic interpreter), ``"tpu"`` (TPU interpret mode) or ``False`` (compiled:
    Mosaic on TPU, Triton on GPU; a ``ValueError`` elsewhere). Any other value is refused.
    """
    if interpret is not None and not isinstance(interpret, (bool, np.bool_)):
        if interpret == TPU_INTERPRET:
            return "mosaic_interpret"
        raise ValueError(
            f"flash_attention: interpret must be None, True, False or {TPU_INTERPRET!r}; "
            f"got {interpret!r}"
        )
    if interpret:
        return "interpret"
    platform = compile_device().platform
    if platform == "tpu":
        return "mosaic"
    if platform == "gpu":
        return "triton"
    if interpret is None:
        return "interpret"
    raise ValueError(
        f"flash_attention compiles only for TPU (Mosaic) and GPU (Triton); this call is compiled "
        f"for {platform!r}. Pass interpret=True (or interpret=None) to run it in interpret mode, "
        f"or interpret={TPU_INTERPRET!r} for the TPU kernels in TPU interpret mode."
    )


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """Default tiling and launch parameters of one target for one head size."""

    block_q: int
    block_k: int
    num_warps: int | None = None
    num_stages: int | None = None


# Mosaic TPU: the last two dimensions of a block are (sublanes, lanes): a multiple of 8 and of 128,
# or the whole dimension. The kernels' blocks are [block_q, head_dim] (q, out, dq), [block_k,
# head_dim] (k, v, dk, dv) and [1, block_q] (the lse and delta rows). So block_k is a multiple of 8,
# and block_q a multiple of 128 unless one block covers the whole (padded) query length.
SUBLANES = 8
LANES = 128

# Default Mosaic blocks (block_q, block_k) per TPU generation. Each forward step reads a K/V block
# (4 block_k head_dim bytes in bfloat16) for 4 block_q block_k head_dim FLOPs, block_q FLOPs a
# byte; each backward step reads a q and a dO block for 10 block_q block_k head_dim FLOPs, 2.5
# block_k a byte. A chip keeps its MXUs busy above (peak bf16 FLOP/s) / (HBM bytes/s), from Cloud
# TPU's pages: v4 275 T / 1.2 TB/s = 229, v5e 197 T / 0.82 TB/s = 241, v5p 459 T / 2.77 TB/s =
# 166, v6e 918 T / 1.64 TB/s = 560. Beyond that, a grid step costs about 0.35 us whatever it
# computes, so larger blocks keep the fixed cost small; v4's 16 MiB of VMEM holds 512 x 512.
# v5e's were measured on the chip (docs/results/attention-kernels.md, "Choosing blocks on v5e"):
# (1024, 2048) with keys computed 512 at a time (TPU_PIECES) beat (1024, 1024), (512, 512) and
# (2048, 2048) at 8k tokens. v5p's and v6e's follow v5e's and are not measured.
TPU_BLOCKS = {
    "v4": (512, 512),
    "v5e": (1024, 2048),
    "v5p": (1024, 2048),
    "v6e": (1024, 2048),
}
# Causal calls take query blocks of at most this: a diagonal block pair computes block_q *
# block_k logits of which about half are masked, so a shorter query block halves the waste while
# the key block stays long. On v5e, 512 x 2048 against the 1024 x 2048 (and 512 x 512 at up to
# 2048 keys) of before, keys 512 at a time, forward and forward+backward: +1.7% and +0.4% at 8192
# keys, d128; +5% and +4% at 2048, d64; +2.5% and +3% at 1024, d64
# (docs/results/attention-kernels.md). Without a mask the long query block stays: 512 rows were 5%
# slower at 4096 keys, d128.
CAUSAL_BLOCK_Q = 512
# Under a window of W keys, key blocks of at most W / 2, in multiples of WINDOW_BLOCK_K (and at
# least that): a query block's rows see block_q + W - 1 keys, and a key block as long as the window
# computes mostly pairs its rows mask, where shorter ones also let a forward step take more heads
# (`kernels.mosaic.FORWARD_LOGITS`). On a v5e chip, a window of 1024 at 8192 keys, d128: 512 x 512
# (16 heads a forward step) took 1.099 ms forward and 4.739 forward+backward, against 1.510 and
# 4.881 at the causal 512 x 2048 (4 heads); docs/results/attention-kernels.md. Measured at a
# window of 1024 only; from a window of 4096 the blocks are the causal ones.
WINDOW_BLOCK_K = 512
# Scoped VMEM the Mosaic kernels may ask for, per generation: most of a TensorCore's VMEM
# (pltpu.get_tpu_info_for_chip: v4 16 MiB, v5e 128, v5p 64, v6e 128), leaving room for what the
# compiler keeps there itself. None: the compiler's default limit (v4's is its whole VMEM).
TPU_VMEM_LIMIT = {
    "v4": None,
    "v5e": 100 << 20,
    "v5p": 48 << 20,
    "v6e": 100 << 20,
}
# Keys computed at a time inside a key block (`kernels.mosaic.Tuning`): the forward's, the
# backward's. None computes the whole block at once.
TPU_PIECES = {
    "v4": (None, None),
    "v5e": (512, 512),
    "v5p": (512, 512),
    "v6e": (512, 512),
}
# Query rows the forward computes at a time against a piece of keys
# (`kernels.mosaic.Tuning.block_q_compute`). A [512, 512] piece's float32 logits are 256 vector
# registers of v5e's 64: compiled for v5e, half the forward's bundles stored a spilled register.
# Strips of 256 rows spill a third to a half less for the same MXU work (each strip loads the
# piece's K and V again), and were 1.7-5.5% faster on a v5e chip at 4096 and 8192 keys (causal,
# grouped and unmasked, d64 and d128) and no different at 2048; strips of 128 loaded K and V so
# often that they were up to 30% slower (docs/results/attention-kernels.md). v5p's and v6e's
# follow v5e's and are not measured; v4 keeps whole blocks.
TPU_FORWARD_ROWS = {
    "v4": None,
    "v5e": 256,
    "v5p": 256,
    "v6e": 256,
}
# The most query heads a forward step computes (`kernels.mosaic.Tuning.forward_heads`, within
# `kernels.mosaic.FORWARD_LOGITS` a step, which sets how many the default blocks take: 4 causal,
# 2 without a mask, 16 under a window of 1024). v5e's was measured on the chip, where a step of 16
# heads of 512 x 512 takes about 28 MiB of VMEM at d128; v5p's and v6e's follow it and are not
# measured; v4 (16 MiB of VMEM) keeps one.
TPU_FORWARD_HEADS = {
    "v4": 1,
    "v5e": 16,
    "v5p": 16,
    "v6e": 16,
}

# Device kinds as JAX reports them (dew.targets.GENERATIONS), lower case, most specific first.
_DEVICE_KINDS = (
    ("v6 lite", "v6e"),
    ("v6e", "v6e"),
    ("v5 lite", "v5e"),
    ("v5e", "v5e"),
    ("v5p", "v5p"),
    ("v5", "v5p"),
    ("v4", "v4"),
)
# An unlisted TPU (a newer chip, or TPU interpret mode on a CPU) gets v5p's blocks and VMEM limit,
# which every generation from v5 on holds.
UNKNOWN_TPU = "v5p"


def tpu_generation(device_kind: str) -> str:
    """A key of ``TPU_BLOCKS`` for a TPU's ``device_kind`` ("TPU v5 lite" -> "v5e"); an unknown
    kind (a newer chip, or a CPU in TPU interpret mode) gets ``UNKNOWN_TPU``."""
    kind = device_kind.lower()
    for fragment, generation in _DEVICE_KINDS:
        if fragment in kind:
            return generation
    return UNKNOWN_TPU


# Triton float32: the kernels' matmuls run at HIGHEST precision (kernels.forward.dot), which Pallas'
# Triton lowering sends to tl.dot(input_precision="ieee"): no tensor core takes IEEE float32, so
# Triton writes each [m, k] x [k, n] block matmul as m n k / (32 warps) fused multiply-adds per
# thread, unrolled. At the bfloat16 tiles (128 x 64, head_dim 64, 4 warps) that is 4096 FMAs a
# thread for every one of the forward's 2 and the backward's 5 block matmuls: the compile-time
# blow-up issue 32 measured (17 s forward, 23 s forward+backward at q_len 300, head_dim 64, against
# 0.7 s in bfloat16; software pipelining of those tiles multiplies the code again). So float32
# gets tiles of at most FLOAT32_FMAS_PER_THREAD per matmul per thread (square, a power of two, at
# least 16: 32 x 32 at head_dim 64, 16 x 16 at 128 and 256), 4 warps and one stage (no
# software-pipelined copies: an FMA-bound loop does not wait on its loads). A diagnosis from the
# code and Triton's FMA path; the compile time it gives was not measured (no GPU was lent).
FLOAT32_FMAS_PER_THREAD = 512
FLOAT32_WARPS = 4


def triton_float32_blocks(head_dim: int) -> BlockConfig:
    """The Triton kernels' float32 tiling and launch: square blocks of the largest power of two
    ``b >= 16`` with ``b * b * head_dim <= FLOAT32_FMAS_PER_THREAD * 32 * FLOAT32_WARPS``."""
    budget = FLOAT32_FMAS_PER_THREAD * 32 * FLOAT32_WARPS // head_dim
    block = 16
    while (2 * block) ** 2 <= budget:
        block *= 2
    return BlockConfig(block, block, num_warps=FLOAT32_WARPS, num_stages=1)


def default_blocks(
    target: str, head_dim: int, dtype, causal: bool = False, window: int | None = None
) -> BlockConfig:
    """Default block sizes of ``target`` (a name in ``TARGETS``).

    Triton, bfloat16: a query block of at most 32 KiB (128 rows up to head_dim 128, 64 at 256)
    and key blocks half as long, two pipeline stages: the dk/dv kernel then keeps its K/V block
    plus two stages of q and dO blocks within about 160 KiB of shared memory (H100/H200 have 227
    KiB). 4 warps up to head_dim 64, 8 above. This is the FlashAttention-2 shape (128 x 64), not
    yet tuned on a GPU of ours.
    Triton, float32: ``triton_float32_blocks`` (the matmuls run on CUDA cores, not tensor cores).
    Mosaic (and TPU interpret mode): ``TPU_BLOCKS`` of the compiled-for device's generation,
    block_q at most ``CAUSAL_BLOCK_Q`` when ``causal``, block_k at most half a ``window`` in
    multiples of ``WINDOW_BLOCK_K`` (at least one), then block_q halved above head_dim 128 (a
    block longer than its length is shrunk to it by the caller).
    Interpret mode: 64 x 64, small enough to exercise several blocks on test-sized inputs, large
    enough to keep the emulated loops short.
    """
    if target == "triton" and np.dtype(dtype) == np.dtype(np.float32):
        return triton_float32_blocks(head_dim)
    if target == "triton":
        block_q = max(16, min(128, 32768 // (head_dim * np.dtype(dtype).itemsize)))
        return BlockConfig(
            block_q,
            max(16, block_q // 2),
            num_warps=4 if head_dim <= 64 else 8,
            num_stages=2,
        )
    if target in ("mosaic", "mosaic_interpret"):
        block_q, block_k = TPU_BLOCKS[tpu_generation(compile_device().device_kind)]
        if causal:
            block_q = min(block_q, CAUSAL_BLOCK_Q)
        if window is not None:
            half = window // 2 // WINDOW_BLOCK_K * WINDOW_BLOCK_K
            block_k = min(block_k, max(WINDOW_BLOCK_K, half))
        if head_dim > 128:
            block_q //= 2
        block_q, block_k = _overrides.get("block_q", block_q), _overrides.get("block_k", block_k)
        return BlockConfig(block_q, block_k)
    return BlockConfig(64, 64)


def mosaic_tuning(generation: str):
    """The `kernels.mosaic.Tuning` of a TPU generation (a key of ``TPU_BLOCKS``), with any
    `tuned` overrides."""
    from .mosaic import Tuning  # the TPU module, imported where it is used

    piece, backward_piece = TPU_PIECES[generation]
    fields = dict(
        block_k_compute=piece,
        backward_block_k_compute=backward_piece,
        block_q_compute=TPU_FORWARD_ROWS[generation],
        forward_heads=TPU_FORWARD_HEADS[generation],
        vmem_limit_bytes=TPU_VMEM_LIMIT[generation],
    )
    fields.update({k: v for k, v in _overrides.items() if k not in ("block_q", "block_k")})
    return Tuning(**fields)


_overrides: dict = {}


@contextlib.contextmanager
def tuned(**overrides):
    """Overrides of the Mosaic defaults while the context is open: ``block_q``, ``block_k``
    (the defaults `default_blocks` gives) and any field of `kernels.mosaic.Tuning`. For
    measuring choices side by side (bench/attention.py's ``--sweep``); a call's blocks given as
    arguments still win. Calls traced inside the context keep what they were traced with."""
    global _overrides
    previous = _overrides
    _overrides = {**previous, **overrides}
    try:
        yield
    finally:
        _overrides = previous
