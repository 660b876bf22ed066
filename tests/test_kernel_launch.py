"""The Triton kernels' launch (blocks, warps, stages) per dtype, read from the ``pallas_call`` s of
a call traced for a GPU: under an abstract mesh of GPU devices (what ``shard_map`` gives a step
compiled for GPUs), which needs no GPU.

float32 matmuls run at IEEE precision, which Triton does on CUDA cores with every block matmul
unrolled into fused multiply-adds per thread; bfloat16 tiles there made float32 compile 25 times
longer than bfloat16 (issue 32). float32 must keep each thread's share of a block matmul small."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from dew.kernels import flash_attention

Q_LEN, HEADS = 300, 2  # the shape: q_len 300
KERNELS = ("dew_flash_attention_forward", "dew_flash_attention_dq", "dew_flash_attention_dkdv")


def gpu_mesh() -> AbstractMesh:
    device = AbstractDevice(device_kind="NVIDIA H200", num_cores=1, platform="gpu")
    return AbstractMesh((1,), ("x",), abstract_device=device)


def launches(dtype, head_dim) -> dict:
    """``{kernel name: (rows of its first block, num_warps, num_stages)}`` of forward + backward."""
    x = jax.ShapeDtypeStruct((1, Q_LEN, HEADS, head_dim), dtype)
    loss = lambda q, k, v: flash_attention(q, k, v).astype(jnp.float32).sum()  # noqa: E731
    with jax.sharding.use_abstract_mesh(gpu_mesh()):
        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(x, x, x).jaxpr
    found = {}

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                params = eqn.params["compiler_params"]
                blocks = eqn.params["grid_mapping"].block_mappings
                # forward, dq: q's block [., block_q, ., d] first; dkdv: the whole q, then k's
                # [., block_k, ., d].
                block = blocks[1 if "dkdv" in eqn.params["name"] else 0].block_shape[1]
                rows = getattr(block, "block_size", block)
                found[eqn.params["name"]] = (rows, params.num_warps, params.num_stages)
            for param in eqn.params.values():
                for sub in param if isinstance(param, (list, tuple)) else (param,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jaxpr)
    assert set(found) == set(KERNELS), found
    return found


@pytest.mark.parametrize("head_dim", [64, 128])
def test_float32_launches_small_fma_tiles_in_one_stage(head_dim):
    got = launches(jnp.float32, head_dim)
    (block_q, warps, stages) = got["dew_flash_attention_forward"]
    block_k = got["dew_flash_attention_dkdv"][0]
    assert got["dew_flash_attention_dq"] == (block_q, warps, stages), got
    # A block matmul [block_q, block_k] over head_dim, shared by 32 x warps threads: at most 512
    # multiply-adds each (the bfloat16 tiles give 4096 at head_dim 64), one pipeline stage.
    assert block_q * block_k * head_dim // (32 * warps) <= 512, got
    assert stages == 1 and warps == 4, got
    expected = (32 if head_dim == 64 else 16, 4, 1)
    assert got == {name: expected for name in KERNELS}, got


def test_bfloat16_keeps_the_tensor_core_tiles():
    got = launches(jnp.bfloat16, 64)
    assert got["dew_flash_attention_forward"] == (128, 4, 2), got
    assert got["dew_flash_attention_dq"] == (128, 4, 2), got
    assert got["dew_flash_attention_dkdv"] == (64, 4, 2), got
