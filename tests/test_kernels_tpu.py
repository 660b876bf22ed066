"""dew.kernels' Mosaic TPU flash attention, without a TPU: run in TPU interpret mode on CPU against
the float64 reference of tests/test_kernels.py, and compiled for TPU slices inside Dew's step.

TPU interpret mode (``interpret="tpu"``: ``pallas_call(..., interpret=pltpu.InterpretParams())``)
runs the kernels with TPU semantics (blocks, VMEM scratch, the sequential grid dimension) at about
30 ms a grid step, so the shapes here are small and each case runs forward and backward in one
compile. Random inputs come from the ``seed`` fixture (fresh each run; ``DEW_SEED`` replays it).
"""

import functools
import importlib.util
import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, Mesh
from jax.sharding import PartitionSpec as P

import dew
import dew.kernels.attention as attention_module
from dew.kernels import (
    flash_attention,
    flash_attention_backward,
    flash_attention_forward,
    mosaic_backward,
    mosaic_forward,
)
from dew.kernels.platform import TPU_BLOCKS, choose_target, default_blocks, tpu_generation
from dew.kernels.tiling import Tiling
from dew.objectives.lm import LMObjective
from dew.parallel import Shards, sequence
from dew.targets import GENERATIONS, target
from tests.test_kernels import (
    _no_kernel,
    as_float64,
    assert_close,
    assert_lse_close,
    random_d_lse,
    random_inputs,
    reference_with_lse_vjp,
    run_fast_compiled,
)

KERNELS = ("dew_flash_attention_forward", "dew_flash_attention_dq", "dew_flash_attention_dkdv")


def visible_block_pairs(tiling: Tiling) -> int:
    """Block pairs (query block, key block) holding at least one visible (row, key) pair."""
    rows = np.arange(tiling.q_padded)[:, None]
    cols = np.arange(tiling.kv_padded)[None, :]
    visible = (cols < tiling.kv_len) & (rows < tiling.q_len)
    if tiling.causal:
        visible &= cols <= rows + tiling.offset
    blocks = visible.reshape(tiling.q_blocks, tiling.block_q, tiling.kv_blocks, tiling.block_k)
    return int(blocks.any(axis=(1, 3)).sum())


def count_computed_blocks(monkeypatch) -> Counter:
    """Counts, while the kernels run, each block pair the forward computes ("forward") and each
    one the backward kernels compute ("backward": dq and dk/dv both)."""
    counts = Counter()

    def counted(name, compute):
        def wrapper(*args, **kwargs):
            jax.debug.callback(lambda: counts.update([name]))
            return compute(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(
        mosaic_forward, "_attend_block", counted("forward", mosaic_forward._attend_block)
    )
    monkeypatch.setattr(
        mosaic_backward, "_probabilities", counted("backward", mosaic_backward._probabilities)
    )
    return counts


CASES = [
    # batch, q_len, kv_len, heads, kv_heads, head_dim, causal, dtype, block_q, block_k
    pytest.param(1, 200, 232, 2, 1, 16, True, jnp.float32, 128, 64, id="q200-kv232-causal-gqa"),
    pytest.param(1, 200, 72, 4, 2, 32, True, jnp.bfloat16, 128, 32, id="q200-kv72-empty-rows-bf16"),
    pytest.param(1, 40, 72, 2, 1, 16, False, jnp.float32, 128, 32, id="q40-kv72-full"),
]


@pytest.mark.parametrize(
    "batch,q_len,kv_len,heads,kv_heads,head_dim,causal,dtype,block_q,block_k", CASES
)
def test_tpu_interpret_matches_reference_computing_only_visible_blocks(
    monkeypatch,
    seed,
    batch,
    q_len,
    kv_len,
    heads,
    kv_heads,
    head_dim,
    causal,
    dtype,
    block_q,
    block_k,
):
    # jax.vjp of flash_attention_forward with random cotangents of out and lse: out, lse, dq, dk,
    # dv (the lse cotangent enters the backward kernels as delta - d_lse). Every case pads both
    # lengths to whole blocks and groups query heads; q200-kv232 reads the queries as the last 200
    # of 232 positions, q200-kv72 has 128 rows that see no key (zeros, lse -inf, no gradient: a
    # whole query block skipped), q40-kv72 is one query block (block_q shrunk to 40, the whole
    # length) over three key blocks, the last one padded. Each kernel must compute exactly the
    # block pairs with a visible (row, key) pair.
    counts = count_computed_blocks(monkeypatch)
    rng = np.random.default_rng(seed)
    q, k, v, do = random_inputs(rng, batch, q_len, kv_len, heads, kv_heads, head_dim, dtype)
    d_lse = random_d_lse(rng, q)
    blocks = dict(causal=causal, block_q=block_q, block_k=block_k)

    def kernel(q, k, v, do, d_lse):
        attend = functools.partial(flash_attention_forward, interpret="tpu", **blocks)
        (out, lse), vjp = jax.vjp(attend, q, k, v)
        return out, lse, vjp((do, d_lse))

    out, lse, grads = as_float64(run_fast_compiled(kernel, q, k, v, do, d_lse))
    want_out, want_lse, want_grads = reference_with_lse_vjp(
        q, k, v, do, d_lse, causal=causal, sm_scale=1.0 / np.sqrt(head_dim)
    )
    assert_close(out, want_out, dtype, f"output (seed {seed})")
    assert_lse_close(lse, want_lse, f"lse (seed {seed})")
    for name, got, want in zip("qkv", grads, want_grads):
        assert_close(got, want, dtype, f"d{name} (seed {seed})")
    block_q = min(block_q, -(-q_len // 8) * 8)  # one whole block when q_len is shorter
    pairs = batch * heads * visible_block_pairs(Tiling(q_len, kv_len, block_q, block_k, causal))
    assert counts == {"forward": pairs, "backward": 2 * pairs}, (counts, pairs)


def assert_fetches_are_used(name, blocks, computed, own):
    """Over one head's grid steps in order, ``blocks[s]`` is the block step ``s`` fetches (a copy
    into VMEM when it differs from the previous step's), ``computed[s]`` whether it computes, and
    ``own[s]`` the block it computes on. Every computed step must get its own block, and every
    copy must be of the block that the next computed step reads (nothing skipped is fetched)."""
    steps = len(blocks)
    for s in range(steps):
        if computed[s]:
            assert blocks[s] == own[s], (name, s, blocks)
        if s == 0 or blocks[s] != blocks[s - 1]:
            later = [t for t in range(s, steps) if computed[t]]
            assert later and blocks[later[0]] == blocks[s], (name, s, blocks, computed)


@pytest.mark.parametrize("q_len,kv_len", [(64, 64), (40, 64), (64, 24)])
def test_skipped_steps_fetch_only_blocks_the_next_computed_step_reads(q_len, kv_len):
    # A causal step whose block pair is masked whole is not computed; its index map names the
    # block the next computed step reads (key block 0 for the forward and dq kernels, where the
    # next query block starts; for dk/dv the first query block that sees the key block), so the
    # pipeline copies nothing it will not use. (64, 24) has query blocks that see no key at all.
    tiling = Tiling(q_len, kv_len, 16, 16, causal=True)
    rows = np.arange(tiling.q_padded)[:, None]
    cols = np.arange(tiling.kv_padded)[None, :]
    visible = (cols < kv_len) & (cols <= rows + tiling.offset)
    sees = visible.reshape(tiling.q_blocks, 16, tiling.kv_blocks, 16).any(axis=(1, 3))
    pairs = [(i, j) for i in range(tiling.q_blocks) for j in range(tiling.kv_blocks)]
    forward = [
        int(mosaic_forward.visited_kv_block(tiling, jnp.int32(i), jnp.int32(j))) for i, j in pairs
    ]
    assert_fetches_are_used(
        "forward", forward, [sees[i, j] for i, j in pairs], [j for _, j in pairs]
    )
    pairs = [(j, i) for j in range(tiling.kv_blocks) for i in range(tiling.q_blocks)]
    dkdv = [
        int(mosaic_backward.visited_q_block(tiling, jnp.int32(j), jnp.int32(i))) for j, i in pairs
    ]
    assert_fetches_are_used("dkdv", dkdv, [sees[i, j] for j, i in pairs], [i for _, i in pairs])
    assert not sees.all()  # some steps were skipped


# ---- the target: from the devices the call is compiled for ---------------------------------


def tpu_mesh(device_kind: str, platform: str = "tpu") -> AbstractMesh:
    device = AbstractDevice(device_kind=device_kind, num_cores=1, platform=platform)
    return AbstractMesh((1,), ("x",), abstract_device=device)


def test_the_target_follows_the_mesh_devices_not_the_default_backend():
    # This process's default backend is the CPU. Under a mesh of TPU devices (what shard_map
    # sets while tracing a step for a slice) the kernels are Mosaic's, with that generation's
    # blocks; under GPU devices Triton's; without a mesh the CPU's interpreter.
    assert choose_target(None) == "interpret" and choose_target("tpu") == "mosaic_interpret"
    for generation in GENERATIONS.values():
        assert tpu_generation(generation.device_kind) == generation.name
        with jax.sharding.use_abstract_mesh(tpu_mesh(generation.device_kind)):
            assert choose_target(None) == choose_target(False) == "mosaic", generation
            assert choose_target(True) == "interpret"
            blocks = default_blocks("mosaic", 128, jnp.bfloat16)
            assert (blocks.block_q, blocks.block_k) == TPU_BLOCKS[generation.name], generation
    with jax.sharding.use_abstract_mesh(tpu_mesh("NVIDIA H200", platform="gpu")):
        assert choose_target(None) == "triton"
    assert default_blocks("mosaic", 256, jnp.bfloat16).block_q == 256  # head_dim > 128: halved


def pallas_calls(jaxpr):
    """(name, interpret) of every pallas_call in a jaxpr, nested ones included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn.params["name"], eqn.params["interpret"]
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from pallas_calls(inner)


def test_pallas_tpu_interpret_reaches_the_ring_and_the_model():
    # attention_impl="pallas_tpu_interpret": the model's attention and the ring's blocks (forward
    # and its hand-written backward) all run the Mosaic kernels in TPU interpret mode. Traced
    # only, on a sequence axis of 2.
    from jax.experimental.pallas import tpu as pltpu

    shards = Shards(axis_sizes={sequence.AXIS: 2})

    def body(q, k, v):
        def loss(q, k, v):
            out, lse = sequence.ring_attention(q, k, v, shards, "pallas_tpu_interpret")
            alone, _ = dew.nn.attention.IMPLEMENTATIONS["pallas_tpu_interpret"](q, k, v)
            return jnp.sum(out) + jnp.sum(lse) + jnp.sum(alone)

        return jax.grad(loss, (0, 1, 2))(q, k, v)

    positions = P(None, sequence.AXIS)
    fn = jax.shard_map(
        body,
        mesh=Mesh(np.array(jax.devices()[:2]), (sequence.AXIS,)),
        in_specs=(positions,) * 3,
        out_specs=(positions,) * 3,
        check_vma=False,
    )
    args = [jax.ShapeDtypeStruct((1, 16, h, 8), jnp.float32) for h in (2, 1, 1)]
    calls = list(pallas_calls(jax.make_jaxpr(fn)(*args).jaxpr))
    assert {name for name, _ in calls} == set(KERNELS), calls
    assert all(isinstance(mode, pltpu.InterpretParams) for _, mode in calls), calls


def test_dew_train_takes_pallas_tpu_interpret():
    from dew.cli.main import build_parser

    args = build_parser().parse_args(["train", "--attention", "pallas_tpu_interpret"])
    assert args.attention == "pallas_tpu_interpret"
    assert (
        dew.models.build(
            "causal_transformer",
            vocab_size=64,
            emb_features=32,
            num_layers=1,
            num_heads=4,
            max_seq_len=16,
            attention_impl=args.attention,
        ).attention_impl
        == "pallas_tpu_interpret"
    )


# ---- refusals: a ValueError naming the rule and the values, before any kernel is traced ------


def mosaic_calls(q_len):
    """The three entry points on a [1, q_len, 4, 16] q and [1, 32, 2, 16] k, v."""
    q, k = jnp.zeros((1, q_len, 4, 16)), jnp.zeros((1, 32, 2, 16))
    lse = jnp.zeros((1, 4, q_len))
    return (
        lambda **kw: flash_attention(q, k, k, **kw),
        lambda **kw: flash_attention_forward(q, k, k, **kw),
        lambda **kw: flash_attention_backward(q, k, k, q, lse, q, **kw),
    )


def no_kernels(monkeypatch):
    for entry in ("_padded_attention", "_padded_forward", "_padded_backward"):
        monkeypatch.setattr(attention_module, entry, _no_kernel)


@pytest.mark.parametrize("name", ["block_q", "block_k"])
@pytest.mark.parametrize("bad", [12, 4, 0, -8, 16.0, True], ids=repr)
def test_mosaic_refuses_blocks_that_are_not_whole_sublane_tiles(monkeypatch, name, bad):
    no_kernels(monkeypatch)
    message = re.escape(f"{name} must be a positive multiple of 8 (the rows of a [{name}, ") + (
        ".*" + re.escape(f"(8, 128) sublanes and lanes); got {name}={bad!r}")
    )
    for call in mosaic_calls(32):
        with pytest.raises(ValueError, match=message):
            call(interpret="tpu", **{name: bad})
    with jax.sharding.use_abstract_mesh(tpu_mesh("TPU v5")):  # compiled for a TPU: the same rule
        with pytest.raises(ValueError, match=message):
            mosaic_calls(32)[0](**{name: bad})


def test_mosaic_block_q_is_whole_lanes_or_the_whole_length(monkeypatch):
    # block_q is also the lanes of the [1, block_q] lse and delta blocks: a multiple of 128, or
    # one block over the whole query length (rounded up to 8). block_k needs only 8.
    no_kernels(monkeypatch)
    message = re.escape(
        "block_q must be a multiple of 128 (the lanes of the lse and delta blocks [1, block_q], "
        "tiled (8, 128)) or cover q_len in one block (>= 200); got block_q=64 for q_len 200"
    )
    for call in mosaic_calls(200):
        with pytest.raises(ValueError, match=message):
            call(interpret="tpu", block_q=64)

    def blocks(q_len, **kw):
        q, k = jnp.zeros((1, q_len, 4, 16)), jnp.zeros((1, 200, 2, 16))
        config = attention_module._config(
            q, k, k, causal=True, sm_scale=None, interpret="tpu", **kw
        )
        return config.tiling.block_q, config.tiling.block_k

    assert blocks(40, block_q=64, block_k=24) == (40, 24)  # shrunk to the whole length
    assert blocks(200, block_q=256, block_k=8) == (200, 8)
    assert blocks(300, block_q=128, block_k=512) == (128, 200)


def test_refuses_an_interpret_that_names_no_target(monkeypatch):
    monkeypatch.setattr(attention_module, "_padded_attention", _no_kernel)
    q, k = jnp.zeros((1, 8, 4, 16)), jnp.zeros((1, 8, 2, 16))
    for bad in ("gpu", "TPU", 1, jnp.array(True)):
        message = re.escape(f"interpret must be None, True, False or 'tpu'; got {bad!r}")
        with pytest.raises(ValueError, match=message):
            flash_attention(q, k, k, interpret=bad)


# ---- compiled for TPU slices: the Mosaic kernels in Dew's step ------------------------------

SEQ = 16


@pytest.mark.xdist_group("tpu")
@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="compiling for a TPU slice needs libtpu (pip install 'dew-ml[tpu]')",
)
@pytest.mark.parametrize(
    "slice_name, mesh",
    [
        pytest.param("v5e-8", dew.MeshSpec(fsdp=8), id="v5e-8-fsdp8"),
        pytest.param("v5p-16", dew.MeshSpec(sequence=4, tensor=2), id="v5p-16-ring4-tensor2"),
    ],
)
def test_the_step_compiles_the_mosaic_kernels_for_a_tpu_slice(slice_name, mesh):
    # attention_impl="pallas" on a CPU host, compiled for the slice's TPU devices: the step's HLO
    # must call the three Mosaic kernels (tpu_custom_call), not carry the CPU's interpreted form.
    # v5p-16 runs the ring (sequence 4, the Pallas blocks forward and backward) on tensor
    # parallelism's local heads (2 of 4 query heads, 1 of 2 kv heads per device).
    config = dict(vocab_size=64, emb_features=32, num_layers=1, num_heads=4, num_kv_heads=2)
    model = dew.models.build(
        "causal_transformer",
        max_seq_len=SEQ,
        dtype="bfloat16",
        attention_impl="pallas",
        **config,
    )
    trainer = dew.Trainer(
        LMObjective(model, SEQ),
        optax.adamw(1e-3),
        jax.random.key(0),
        mesh=mesh,
        layout=dew.Layout(min_shard=4096),
        devices=target(slice_name).devices(),
    )
    text = trainer.compiled_step(8).as_text()
    custom_calls = [line for line in text.splitlines() if "tpu_custom_call" in line]
    called = {name for line in custom_calls for name in KERNELS if name in line}
    assert called == set(KERNELS), (slice_name, len(custom_calls), called)
