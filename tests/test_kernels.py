"""dew.kernels.flash_attention in interpret mode against a float64 reference.

Every case draws random inputs from the `seed` fixture (fresh each run, `DEW_SEED` replays it)
and runs the kernels forward and backward in one compile. Compile time dominates interpret mode,
so the cases are picked to cover lengths 1/17/128/300, head_dim 32/64, causal and not, 8 query
heads over 2 kv heads, float32 and bfloat16, q_len < kv_len and q_len > kv_len, without taking
the full cross product. The GPU path is checked by lowering the kernels to Triton from this CPU
machine.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import dew.kernels.attention as attention_module
from dew._jax_compat import has_triton_compiler, pallas_triton_lowering
from dew.kernels import flash_attention, flash_attention_backward, flash_attention_forward
from dew.kernels.attention import check_inputs, choose_target
from dew.kernels.tiling import Tiling

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
# What JAX raises when it must compile a Triton kernel and no GPU plugin registered a compiler.
NO_TRITON_COMPILER = "Platform CUDA does not have a Triton compilation handler"


def reference_attention(q, k, v, *, causal, sm_scale):
    """Plain softmax attention (call under float64). Bottom-right causal alignment; a row that
    sees no key outputs zeros (and so gets zero gradients)."""
    return reference_attention_with_lse(q, k, v, causal=causal, sm_scale=sm_scale)[0]


def reference_attention_with_lse(q, k, v, *, causal, sm_scale):
    """``(out, lse)`` of `reference_attention`: lse ``[batch, heads, q_len]`` is the natural log
    of each row's sum of ``exp(logits)``, ``-inf`` (with zero gradients) for a row that sees no
    key."""
    q_len, heads = q.shape[1], q.shape[2]
    kv_len, kv_heads = k.shape[1], k.shape[2]
    k = jnp.repeat(k, heads // kv_heads, axis=2)
    v = jnp.repeat(v, heads // kv_heads, axis=2)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * sm_scale
    visible = np.ones((q_len, kv_len), bool)
    if causal:
        visible = np.arange(kv_len)[None, :] <= np.arange(q_len)[:, None] + (kv_len - q_len)
    logits = jnp.where(visible, logits, -jnp.inf)
    row_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    weights = jnp.exp(logits - jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    total = jnp.sum(weights, axis=-1, keepdims=True)
    safe_total = jnp.where(total == 0, 1.0, total)
    weights = weights / safe_total
    lse = jnp.where(total == 0, -jnp.inf, row_max + jnp.log(safe_total))
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v), lse[..., 0]


def random_inputs(rng, batch, q_len, kv_len, heads, kv_heads, head_dim, dtype):
    def draw(*shape):
        return jnp.asarray(rng.standard_normal(shape), dtype)

    return (
        draw(batch, q_len, heads, head_dim),
        draw(batch, kv_len, kv_heads, head_dim),
        draw(batch, kv_len, kv_heads, head_dim),
        draw(batch, q_len, heads, head_dim),
    )


def run_fast_compiled(fn, *args):
    """jit(fn)(*args) with XLA's CPU backend optimisations off: interpret-mode kernels are
    compile-bound at test sizes, and this halves the compile time without changing the math."""
    compiled = jax.jit(fn).lower(*args).compile({"xla_backend_optimization_level": 0})
    return compiled(*args)


def kernel_and_reference(q, k, v, do, *, causal, sm_scale=None, **blocks):
    """(out, (dq, dk, dv)) of the kernels and of the float64 reference, as float64 numpy.
    `sm_scale` None leaves the kernel its default and gives the reference 1 / sqrt(head_dim)."""

    def kernel(q, k, v, do):
        out, vjp = jax.vjp(
            lambda q, k, v: flash_attention(q, k, v, causal=causal, sm_scale=sm_scale, **blocks),
            q,
            k,
            v,
        )
        return out, vjp(do)

    got = run_fast_compiled(kernel, q, k, v, do)
    if sm_scale is None:
        sm_scale = 1.0 / np.sqrt(q.shape[-1])
    with jax.enable_x64(True):
        as64 = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, do)]

        def reference(q, k, v, do):
            out, vjp = jax.vjp(
                lambda q, k, v: reference_attention(q, k, v, causal=causal, sm_scale=sm_scale),
                q,
                k,
                v,
            )
            return out, vjp(do)

        want = run_fast_compiled(reference, *as64)
        want = jax.tree.map(lambda x: np.asarray(x, np.float64), want)
    got = jax.tree.map(lambda x: np.asarray(x.astype(jnp.float32), np.float64), got)
    return got, want


def relative_error(got, want):
    """||got - want|| / ||want||; for an exactly zero `want` (a gradient that vanishes, as dq
    and dk do for a single key) the root-mean-square of `got`, inputs being of order 1."""
    scale = np.linalg.norm(want)
    if scale == 0:
        return np.sqrt(np.mean(np.square(got)))
    return np.linalg.norm(got - want) / scale


def assert_close(got, want, dtype, what):
    assert np.all(np.isfinite(got)), f"{what}: non-finite values"
    error = relative_error(got, want)
    # `error < tol` is False for NaN, so a NaN error fails here as well.
    assert error < TOLERANCE[dtype], f"{what}: relative error {error:.3g} >= {TOLERANCE[dtype]}"


CASES = [
    # batch, q_len, kv_len, heads, kv_heads, head_dim, causal, dtype, blocks
    pytest.param(1, 1, 1, 8, 2, 32, True, jnp.float32, {}, id="len1-causal-gqa"),
    pytest.param(1, 17, 17, 8, 2, 64, False, jnp.float32, {}, id="len17-full-gqa-d64"),
    pytest.param(
        1,
        128,
        128,
        8,
        2,
        32,
        True,
        jnp.float32,
        {"block_q": 32, "block_k": 16},
        id="len128-causal-gqa-multiblock",
    ),
    pytest.param(
        1,
        300,
        300,
        8,
        2,
        64,
        True,
        jnp.float32,
        {"block_q": 64, "block_k": 32},
        id="len300-causal-gqa-tail",
    ),
    pytest.param(
        1,
        300,
        300,
        2,
        2,
        32,
        False,
        jnp.float32,
        {"block_q": 32, "block_k": 64},
        id="len300-full-mha-tail",
    ),
    pytest.param(
        2,
        17,
        300,
        4,
        2,
        32,
        True,
        jnp.float32,
        {"block_q": 16, "block_k": 64},
        id="q17-kv300-causal-bottom-right",
    ),
    pytest.param(1, 300, 300, 8, 2, 64, True, jnp.bfloat16, {}, id="len300-causal-gqa-bf16"),
    pytest.param(1, 17, 17, 8, 2, 32, False, jnp.bfloat16, {}, id="len17-full-gqa-bf16"),
]


@pytest.mark.parametrize("batch,q_len,kv_len,heads,kv_heads,head_dim,causal,dtype,blocks", CASES)
def test_matches_float64_reference(
    seed, batch, q_len, kv_len, heads, kv_heads, head_dim, causal, dtype, blocks
):
    rng = np.random.default_rng(seed)
    q, k, v, do = random_inputs(rng, batch, q_len, kv_len, heads, kv_heads, head_dim, dtype)
    (out, grads), (want_out, want_grads) = kernel_and_reference(
        q, k, v, do, causal=causal, **blocks
    )
    assert out.shape == q.shape
    assert_close(out, want_out, dtype, f"output (seed {seed})")
    for name, got, want in zip("qkv", grads, want_grads):
        assert_close(got, want, dtype, f"d{name} (seed {seed})")


@pytest.mark.parametrize(
    "sm_scale,causal",
    [pytest.param(0.3, True, id="0.3-causal"), pytest.param(-2.0, False, id="-2-full")],
)
def test_non_default_sm_scale_matches_reference(seed, sm_scale, causal):
    # The forward folds sm_scale into base-2 logits, the backward multiplies dq and dk by it
    # separately: a kernel that used the default 1/sqrt(head_dim) anywhere differs here. A
    # negative scale is accepted (and reverses which keys dominate).
    rng = np.random.default_rng(seed)
    q, k, v, do = random_inputs(rng, 1, 40, 40, 4, 2, 16, jnp.float32)
    (out, grads), (want_out, want_grads) = kernel_and_reference(
        q, k, v, do, causal=causal, sm_scale=sm_scale, block_q=16, block_k=16
    )
    assert_close(out, want_out, jnp.float32, f"output (seed {seed})")
    for name, got, want in zip("qkv", grads, want_grads):
        assert_close(got, want, jnp.float32, f"d{name} (seed {seed})")


def test_under_vmap_with_shared_kv(seed):
    # jax.vmap over a leading axis of q and dO, with k and v shared (in_axes None): Pallas'
    # batching rule adds a grid dimension for the mapped inputs and broadcasts the others. Each
    # slice must equal the float64 reference for that slice, output and all three gradients.
    rng = np.random.default_rng(seed)
    slices = 2
    q, k, v, do = random_inputs(rng, 1, 33, 33, 4, 2, 16, jnp.float32)
    q = jnp.asarray(rng.standard_normal((slices, *q.shape)), jnp.float32)
    do = jnp.asarray(rng.standard_normal((slices, *do.shape)), jnp.float32)

    def forward_backward(attend):
        def one_slice(q, k, v, do):
            out, vjp = jax.vjp(attend, q, k, v)
            return out, vjp(do)

        return jax.vmap(one_slice, in_axes=(0, None, None, 0))

    kernel = forward_backward(
        lambda q, k, v: flash_attention(q, k, v, causal=True, block_q=16, block_k=16)
    )
    got = run_fast_compiled(kernel, q, k, v, do)
    with jax.enable_x64(True):
        reference = forward_backward(
            lambda q, k, v: reference_attention(
                q, k, v, causal=True, sm_scale=1 / np.sqrt(q.shape[-1])
            )
        )
        as64 = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, do)]
        want = jax.tree.map(lambda x: np.asarray(x, np.float64), reference(*as64))
    (out, grads), (want_out, want_grads) = jax.tree.map(np.asarray, got), want
    assert out.shape == q.shape and grads[1].shape == (slices, *k.shape), (out.shape, seed)
    for i in range(slices):
        assert_close(out[i], want_out[i], jnp.float32, f"slice {i} output (seed {seed})")
        for name, g, w in zip("qkv", grads, want_grads):
            assert_close(g[i], w[i], jnp.float32, f"slice {i} d{name} (seed {seed})")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rows_that_see_no_key_give_zeros_not_nan(seed, dtype):
    # Causal with q_len > kv_len, bottom-right aligned: rows 0..22 of 40 see no key (as in the
    # reference), rows 23.. see 1..17 keys. Blocks of 16 put the boundary inside a block.
    q_len, kv_len = 40, 17
    rng = np.random.default_rng(seed)
    q, k, v, do = random_inputs(rng, 1, q_len, kv_len, 4, 2, 32, dtype)
    (out, (dq, dk, dv)), (want_out, want_grads) = kernel_and_reference(
        q, k, v, do, causal=True, block_q=16, block_k=16
    )
    empty = q_len - kv_len
    finite = np.all(np.isfinite(out)) and all(np.all(np.isfinite(g)) for g in (dq, dk, dv))
    assert finite, f"seed {seed}"
    assert np.all(out[:, :empty] == 0.0) and np.all(want_out[:, :empty] == 0.0), f"seed {seed}"
    assert np.all(dq[:, :empty] == 0.0), f"seed {seed}"
    assert np.any(out[:, empty:] != 0.0), f"seed {seed}"
    assert_close(out, want_out, dtype, f"output (seed {seed})")
    for name, got, want in zip("qkv", (dq, dk, dv), want_grads):
        assert_close(got, want, dtype, f"d{name} (seed {seed})")


# ---- the cotangent of lse ------------------------------------------------------------------


def random_d_lse(rng, q):
    """A random float32 cotangent of lse, ``[batch, heads, q_len]`` for q's shape."""
    batch, q_len, heads, _ = q.shape
    return jnp.asarray(rng.standard_normal((batch, heads, q_len)), jnp.float32)


def reference_with_lse_vjp(q, k, v, do, d_lse, *, causal, sm_scale):
    """``(out, lse, (dq, dk, dv))`` of the float64 reference for the cotangents ``(do, d_lse)``,
    as float64 numpy."""
    with jax.enable_x64(True):
        as64 = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, do, d_lse)]

        def reference(q, k, v, do, d_lse):
            attend = functools.partial(
                reference_attention_with_lse, causal=causal, sm_scale=sm_scale
            )
            (out, lse), vjp = jax.vjp(attend, q, k, v)
            return out, lse, vjp((do, d_lse))

        want = run_fast_compiled(reference, *as64)
        return jax.tree.map(lambda x: np.asarray(x, np.float64), want)


def as_float64(tree):
    return jax.tree.map(lambda x: np.asarray(x.astype(jnp.float32), np.float64), tree)


def assert_lse_close(got, want, what):
    """-inf exactly where the reference has it (rows that see no key), close elsewhere."""
    empty = want == -np.inf
    assert np.array_equal(got == -np.inf, empty), f"{what}: -inf rows differ"
    assert_close(got[~empty], want[~empty], jnp.float32, what)


LSE_CASES = [
    # batch, q_len, kv_len, heads, kv_heads, head_dim, causal, dtype, blocks
    pytest.param(
        1, 72, 72, 8, 2, 32, True, jnp.float32, {"block_q": 32, "block_k": 16}, id="len72-causal"
    ),
    pytest.param(
        2, 40, 17, 4, 2, 16, True, jnp.float32, {"block_q": 16, "block_k": 16}, id="q40-kv17-empty"
    ),
    pytest.param(
        1, 24, 56, 4, 2, 32, False, jnp.float32, {"block_q": 16, "block_k": 32}, id="q24-kv56-full"
    ),
    pytest.param(1, 72, 72, 8, 2, 32, True, jnp.bfloat16, {}, id="len72-causal-bf16"),
]


@pytest.mark.parametrize(
    "batch,q_len,kv_len,heads,kv_heads,head_dim,causal,dtype,blocks", LSE_CASES
)
def test_gradient_through_lse_matches_float64_reference(
    seed, batch, q_len, kv_len, heads, kv_heads, head_dim, causal, dtype, blocks
):
    # jax.vjp of flash_attention_forward with random cotangents on both out and lse: the
    # custom_vjp's backward feeds d_lse to the kernels (delta - d_lse). Every case pads the rows
    # to whole blocks and groups query heads; q40-kv17 has rows that see no key, whose d_lse must
    # add nothing (the reference's lse is -inf there, with zero gradient).
    rng = np.random.default_rng(seed)
    q, k, v, do = random_inputs(rng, batch, q_len, kv_len, heads, kv_heads, head_dim, dtype)
    d_lse = random_d_lse(rng, q)

    def kernel(q, k, v, do, d_lse):
        attend = functools.partial(flash_attention_forward, causal=causal, **blocks)
        (out, lse), vjp = jax.vjp(attend, q, k, v)
        return out, lse, vjp((do, d_lse))

    out, lse, grads = as_float64(run_fast_compiled(kernel, q, k, v, do, d_lse))
    sm_scale = 1.0 / np.sqrt(head_dim)
    want_out, want_lse, want_grads = reference_with_lse_vjp(
        q, k, v, do, d_lse, causal=causal, sm_scale=sm_scale
    )
    assert_close(out, want_out, dtype, f"output (seed {seed})")
    assert_lse_close(lse, want_lse, f"lse (seed {seed})")
    for name, got, want in zip("qkv", grads, want_grads):
        assert_close(got, want, dtype, f"d{name} (seed {seed})")


@pytest.mark.parametrize(
    "dtype,causal,split",
    [
        pytest.param(jnp.float32, True, None, id="causal-whole"),
        pytest.param(jnp.bfloat16, True, None, id="causal-whole-bf16"),
        pytest.param(jnp.float32, False, 24, id="full-two-key-blocks"),
    ],
)
def test_backward_takes_the_cotangent_of_lse(seed, dtype, causal, split):
    # flash_attention_backward(..., d_lse) on out and lse from flash_attention_forward equals the
    # reference's vjp for (d_out, d_lse). With `split`, the keys are cut in two (24 and 32 rows,
    # each padded to its blocks) and each call gets the merged out and lse of all keys, as a ring
    # attention's block backward does: the dq shares sum, and dk, dv concatenate, to the whole.
    # q_len 40 and kv_len 56 are not multiples of the 16-row blocks; 4 query heads over 2.
    rng = np.random.default_rng(seed)
    q, k, v, do = random_inputs(rng, 1, 40, 56, 4, 2, 32, dtype)
    d_lse = random_d_lse(rng, q)
    blocks = dict(causal=causal, block_q=16, block_k=16)

    def kernel(q, k, v, do, d_lse):
        out, lse = flash_attention_forward(q, k, v, **blocks)
        if split is None:
            return flash_attention_backward(q, k, v, out, lse, do, d_lse, **blocks)
        parts = [
            flash_attention_backward(q, k[:, keys], v[:, keys], out, lse, do, d_lse, **blocks)
            for keys in (slice(None, split), slice(split, None))
        ]
        (dq_a, dk_a, dv_a), (dq_b, dk_b, dv_b) = parts
        # Summed in float32: each share is rounded to q's dtype already.
        dq = dq_a.astype(jnp.float32) + dq_b.astype(jnp.float32)
        return dq, jnp.concatenate([dk_a, dk_b], 1), jnp.concatenate([dv_a, dv_b], 1)

    grads = run_fast_compiled(kernel, q, k, v, do, d_lse)
    for x, like in zip(grads, (q, k, v)):
        assert x.shape == like.shape, (x.shape, like.shape)
    _, _, want_grads = reference_with_lse_vjp(
        q, k, v, do, d_lse, causal=causal, sm_scale=1.0 / np.sqrt(32)
    )
    for name, got, want in zip("qkv", as_float64(grads), want_grads):
        assert_close(got, want, dtype, f"d{name} (seed {seed})")


def test_backward_without_d_lse_is_a_zero_d_lse(seed):
    # None skips the subtraction; zeros subtract exactly 0.0: the same bits.
    rng = np.random.default_rng(seed)
    q, k, v, do = random_inputs(rng, 1, 40, 40, 4, 2, 16, jnp.float32)
    blocks = dict(causal=True, block_q=16, block_k=16)

    def both(q, k, v, do):
        out, lse = flash_attention_forward(q, k, v, **blocks)
        zeros = jnp.zeros(lse.shape, lse.dtype)
        return (
            flash_attention_backward(q, k, v, out, lse, do, **blocks),
            flash_attention_backward(q, k, v, out, lse, do, zeros, **blocks),
        )

    without, with_zeros = run_fast_compiled(both, q, k, v, do)
    for name, a, b in zip("qkv", without, with_zeros):
        assert np.array_equal(a, b), f"d{name} (seed {seed})"


def test_equal_lengths_match_jax_dot_product_attention(seed):
    # Same scale and causal convention as JAX's own attention when q_len == kv_len.
    rng = np.random.default_rng(seed)
    q, k, v, _ = random_inputs(rng, 2, 40, 40, 4, 2, 32, jnp.float32)

    def both(q, k, v):
        return [
            (
                flash_attention(q, k, v, causal=causal, block_q=16, block_k=16),
                jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla"),
            )
            for causal in (True, False)
        ]

    for got, want in run_fast_compiled(both, q, k, v):
        error = relative_error(np.asarray(got), np.asarray(want))
        assert error < 1e-5, f"relative error {error:.3g} (seed {seed})"


def _walk_avals(jaxpr):
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            yield var.aval
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                inner = getattr(sub, "jaxpr", None)
                if inner is not None:
                    yield from _walk_avals(getattr(inner, "jaxpr", inner))


def test_grouped_queries_never_repeat_kv():
    # 8 query heads over 2 kv heads: no array of the forward or backward program may hold K or
    # V expanded to 8 heads (the kernels index the kv head in their BlockSpec).
    q = jnp.zeros((1, 16, 8, 32))
    k = v = jnp.zeros((1, 48, 2, 32))

    def loss(q, k, v):
        return jnp.sum(flash_attention(q, k, v, block_q=16, block_k=16))

    closed = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    shapes = {tuple(a.shape) for a in _walk_avals(closed.jaxpr) if hasattr(a, "shape")}
    assert (1, 48, 2, 32) in shapes  # the kernels' K/V and dK/dV, at kv_heads
    assert not [s for s in shapes if len(s) == 4 and s[1] == 48 and s[2] == 8], shapes


def test_inside_shard_map_with_replicated_kv(seed):
    # The model calls the kernel on each device's local shard. Here q is split over batch and
    # heads, k/v over heads only (replicated over `data`): the gradients of k/v must be summed
    # over `data`, exactly as the unsharded computation with k/v broadcast over batch.
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "tensor"))
    rng = np.random.default_rng(seed)
    q, _, _, _ = random_inputs(rng, 4, 33, 33, 4, 2, 16, jnp.float32)
    _, k, v, _ = random_inputs(rng, 1, 33, 33, 4, 2, 16, jnp.float32)
    weights = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

    def local_loss(q, k, v, weights):
        out = flash_attention(q, k, v, causal=True, block_q=16, block_k=16)
        return jax.lax.psum(jnp.sum(out * weights), ("data", "tensor"))

    sharded = jax.shard_map(
        local_loss,
        mesh=mesh,
        in_specs=(
            P("data", None, "tensor"),
            P(None, None, "tensor"),
            P(None, None, "tensor"),
            P("data", None, "tensor"),
        ),
        out_specs=P(),
    )

    def unsharded(q, k, v, weights):
        k, v = (jnp.broadcast_to(x, (4,) + x.shape[1:]) for x in (k, v))
        return jnp.sum(flash_attention(q, k, v, causal=True, block_q=16, block_k=16) * weights)

    got = run_fast_compiled(jax.value_and_grad(sharded, argnums=(0, 1, 2)), q, k, v, weights)
    want = run_fast_compiled(jax.value_and_grad(unsharded, argnums=(0, 1, 2)), q, k, v, weights)
    (got_loss, got_grads), (want_loss, want_grads) = got, want
    # The loss is a sum of ~8k terms of both signs, summed in another order: compare it to the
    # size of those terms, not to the (possibly small) total.
    difference = abs(float(got_loss) - float(want_loss))
    assert difference < 1e-5 * float(jnp.sum(jnp.abs(weights))), f"loss (seed {seed})"
    for name, got_x, want_x in zip("qkv", got_grads, want_grads):
        error = relative_error(np.asarray(got_x), np.asarray(want_x))
        assert error < 1e-5, f"d{name}: relative error {error:.3g} (seed {seed})"


@pytest.mark.parametrize("q_len,kv_len", [(17, 17), (40, 17), (33, 64), (64, 64)])
@pytest.mark.parametrize("window", [1, 9, 16, 40])
def test_window_loop_bounds_are_exact(q_len, kv_len, window):
    # With a window the kernels visit key blocks [lo, hi) of a query block (and query blocks
    # [lo, hi) of a key block), each with its mask: exactly those holding a visible pair.
    for block_q, block_k in [(16, 16), (16, 32), (32, 16)]:
        tiling = Tiling(q_len, kv_len, block_q, block_k, True, window)
        rows = np.arange(tiling.q_padded)[:, None]
        cols = np.arange(tiling.kv_padded)[None, :]
        position = rows + kv_len - q_len
        visible = (cols < kv_len) & (cols <= position) & (position - cols < window)
        blocks = visible.reshape(tiling.q_blocks, block_q, tiling.kv_blocks, block_k)
        any_visible = blocks.any(axis=(1, 3))
        for i in range(tiling.q_blocks):
            lo, hi = (int(x) for x in tiling.kv_bounds(jnp.int32(i)))
            want = np.flatnonzero(any_visible[i])
            assert (lo, hi) == ((want[0], want[-1] + 1) if len(want) else (lo, lo)), (tiling, i)
        for j in range(tiling.kv_blocks):
            lo, hi = (int(x) for x in tiling.q_bounds(jnp.int32(j)))
            want = np.flatnonzero(any_visible[:, j])
            assert (lo, hi) == ((want[0], want[-1] + 1) if len(want) else (lo, lo)), (tiling, j)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    "q_len,kv_len", [(1, 1), (5, 40), (17, 17), (40, 17), (64, 33), (33, 64), (48, 48)]
)
def test_loop_bounds_are_exact(q_len, kv_len, causal):
    # The kernels visit [0, n_visit) key blocks per query block, masking from n_full on (and
    # the transposed ranges for the dk/dv kernel). Both must be tight: every block with a
    # visible pair visited, every block skipped empty, every unmasked block wholly visible.
    for block_q, block_k in [(16, 16), (16, 32), (32, 16)]:
        tiling = Tiling(q_len, kv_len, block_q, block_k, causal)
        rows = np.arange(tiling.q_padded)[:, None]
        cols = np.arange(tiling.kv_padded)[None, :]
        visible = np.broadcast_to(cols < kv_len, (tiling.q_padded, tiling.kv_padded))
        if causal:
            visible = visible & (cols <= rows + kv_len - q_len)
        blocks = visible.reshape(tiling.q_blocks, block_q, tiling.kv_blocks, block_k)
        any_visible = blocks.any(axis=(1, 3))
        all_visible = blocks.all(axis=(1, 3))
        for i in range(tiling.q_blocks):
            n_full, n_visit = (int(x) for x in tiling.kv_range(jnp.int32(i)))
            assert any_visible[i, :n_visit].all() and not any_visible[i, n_visit:].any()
            assert all_visible[i, :n_full].all() and not all_visible[i, n_full:n_visit].any()
        for j in range(tiling.kv_blocks):
            first, first_full = (int(x) for x in tiling.q_range(jnp.int32(j)))
            assert any_visible[first:, j].all() and not any_visible[:first, j].any()
            assert all_visible[first_full:, j].all() and not all_visible[first:first_full, j].any()


@pytest.mark.parametrize(
    "q_len,kv_len,heads,kv_heads,head_dim,dtype,causal,masks",
    [
        (1000, 1000, 8, 2, 64, jnp.bfloat16, True, {}),
        (300, 300, 4, 4, 128, jnp.float32, False, {}),
        (256, 1000, 4, 2, 256, jnp.bfloat16, True, {}),
        (256, 1000, 4, 2, 128, jnp.bfloat16, True, {"segment_ids": True, "window": 100}),
    ],
    ids=["causal-gqa", "full-f32", "q256-kv1000-d256", "segment-ids-window"],
)
def test_kernels_lower_to_triton_without_a_gpu(
    monkeypatch, q_len, kv_len, heads, kv_heads, head_dim, dtype, causal, masks
):
    """Lower forward + backward for an sm_90 GPU from this CPU machine: Pallas' Triton lowering
    (power-of-two tensors, supported ops, loop shapes) runs here, so a kernel that could not
    compile on a GPU fails in CI. All three kernels must lower, and every loop must become an
    scf.for (Triton pipelines those); with segment ids and a window, the masked kernels (their
    ids' blocks and bounds read as scalars).

    Skipped in exactly two cases, both "Triton lowering is not available in this JAX":
    - `dew._jax_compat.pallas_triton_lowering()` is None: the private module
      `jax._src.pallas.triton.lowering`, or the jaxlib Triton dialect it imports, is not
      installed, or it has no `lower_jaxpr_to_triton_module` to wrap;
    - lowering raises ``RuntimeError("Platform CUDA does not have a Triton compilation
      handler")`` while `dew._jax_compat.has_triton_compiler("cuda")` is False: jaxlib releases
      after 0.10.2 compile each kernel with Triton as they lower it, which needs jaxlib's CUDA
      plugin (JAX 0.10.2, installed here, lowers without it).
    Anything else that goes wrong, at import or while lowering, fails the test.
    """
    triton_lowering = pallas_triton_lowering()
    if triton_lowering is None:
        pytest.skip("this JAX has no Pallas Triton lowering (jax._src.pallas.triton.lowering)")
    modules = []
    real_lower = triton_lowering.lower_jaxpr_to_triton_module

    def keep_module(*args, **kwargs):
        result = real_lower(*args, **kwargs)
        modules.append(result.module.operation.get_asm())
        return result

    monkeypatch.setattr(triton_lowering, "lower_jaxpr_to_triton_module", keep_module)
    monkeypatch.setattr(attention_module, "choose_target", lambda interpret: "triton")
    q = jax.ShapeDtypeStruct((1, q_len, heads, head_dim), dtype)
    k = jax.ShapeDtypeStruct((1, kv_len, kv_heads, head_dim), dtype)
    ids = (
        jax.ShapeDtypeStruct((1, q_len), jnp.int32),
        jax.ShapeDtypeStruct((1, kv_len), jnp.int32),
    )

    def forward_backward(q, k, v, do, ids):
        window, segment_ids = masks.get("window"), ids if masks.get("segment_ids") else None

        def attend(q, k, v):
            return flash_attention(q, k, v, causal=causal, segment_ids=segment_ids, window=window)

        out, vjp = jax.vjp(attend, q, k, v)
        return out, vjp(do)

    try:
        jax.jit(forward_backward).trace(q, k, k, q, ids).lower(lowering_platforms=("cuda",))
    except RuntimeError as error:
        if str(error) == NO_TRITON_COMPILER and not has_triton_compiler("cuda"):
            pytest.skip(f"this JAX compiles Triton while lowering and has no compiler: {error}")
        raise
    names = sorted(
        name
        for text in modules
        for name in ("forward", "dq", "dkdv")
        if f"@dew_flash_attention_{name}" in text
    )
    assert names == ["dkdv", "dq", "forward"], names
    for text in modules:
        # Two loops (unmasked and masked blocks) a kernel; the masked kernels' forward and dq one.
        assert "scf.while" not in text and text.count("scf.for") >= (1 if masks else 2)


# ---- refusals: a ValueError naming the shapes, before any kernel is traced -----------------


def _no_kernel(*args, **kwargs):
    raise AssertionError("the kernels were reached before the inputs were checked")


@pytest.mark.parametrize(
    "q_shape,k_shape,v_shape,dtypes,message",
    [
        ((1, 8, 4, 16), (1, 8, 2, 16), (1, 9, 2, 16), ("float32",) * 3, "same shape"),
        ((1, 8, 4, 16), (1, 8, 2, 32), (1, 8, 2, 32), ("float32",) * 3, "head_dim"),
        ((2, 8, 4, 16), (1, 8, 2, 16), (1, 8, 2, 16), ("float32",) * 3, "batch"),
        ((1, 8, 6, 16), (1, 8, 4, 16), (1, 8, 4, 16), ("float32",) * 3, "multiple of kv_heads"),
        (
            (1, 8, 4, 16),
            (1, 8, 2, 16),
            (1, 8, 2, 16),
            ("float32", "bfloat16", "float32"),
            "one dtype",
        ),
        ((1, 8, 4, 16), (1, 8, 2, 16), (1, 8, 2, 16), ("float16",) * 3, "float32 or bfloat16"),
        ((8, 4, 16), (8, 2, 16), (8, 2, 16), ("float32",) * 3, "expects q"),
        ((1, 0, 4, 16), (1, 8, 2, 16), (1, 8, 2, 16), ("float32",) * 3, "at least 1"),
    ],
)
def test_refuses_bad_inputs(monkeypatch, q_shape, k_shape, v_shape, dtypes, message):
    monkeypatch.setattr(attention_module, "_padded_attention", _no_kernel)
    q, k, v = (jnp.zeros(s, d) for s, d in zip((q_shape, k_shape, v_shape), dtypes))
    with pytest.raises(ValueError, match=message) as info:
        flash_attention(q, k, v)
    assert str(q_shape) in str(info.value) and str(k_shape) in str(info.value)


@pytest.mark.parametrize("bad", [1, 0, "True", None, jnp.array(True)], ids=repr)
def test_refuses_causal_that_is_not_a_bool(monkeypatch, bad):
    monkeypatch.setattr(attention_module, "_padded_attention", _no_kernel)
    q, k = jnp.zeros((1, 8, 4, 16)), jnp.zeros((1, 8, 2, 16))
    with pytest.raises(ValueError, match=re.escape(f"causal must be a bool, got {bad!r}")):
        flash_attention(q, k, k, causal=bad)


@pytest.mark.parametrize(
    "bad",
    [True, "0.5", jnp.asarray(0.5), float("nan"), float("inf"), -float("inf"), np.float32("nan")],
    ids=repr,
)
def test_refuses_sm_scale_that_is_not_a_finite_number(monkeypatch, bad):
    # The scale is static (it is folded into the kernels), so an array is refused like a string.
    monkeypatch.setattr(attention_module, "_padded_attention", _no_kernel)
    q, k = jnp.zeros((1, 8, 4, 16)), jnp.zeros((1, 8, 2, 16))
    message = f"sm_scale must be a finite Python number, got {bad!r}"
    with pytest.raises(ValueError, match=re.escape(message)):
        flash_attention(q, k, k, sm_scale=bad)


@pytest.mark.parametrize(
    "shape,dtype",
    [((1, 8, 4), jnp.float32), ((1, 4, 8), jnp.bfloat16), ((1, 4), jnp.float32)],
    ids=["q_len-heads-swapped", "bfloat16", "2-d"],
)
def test_backward_refuses_a_d_lse_that_is_not_float32_rows(monkeypatch, shape, dtype):
    monkeypatch.setattr(attention_module, "_padded_backward", _no_kernel)
    q, k = jnp.zeros((1, 8, 4, 16)), jnp.zeros((1, 8, 2, 16))
    lse = jnp.zeros((1, 4, 8))
    message = rf"d_lse must be \(1, 4, 8\) float32 .* got {re.escape(str(shape))}"
    with pytest.raises(ValueError, match=message):
        flash_attention_backward(q, k, k, q, lse, q, jnp.zeros(shape, dtype), interpret=True)


def test_refuses_head_dims_triton_cannot_take():
    k = jnp.zeros((1, 8, 2, 48))
    with pytest.raises(ValueError, match=r"head_dim .*48.*\(1, 8, 4, 48\)"):
        check_inputs(jnp.zeros((1, 8, 4, 48)), k, k, "triton")
    check_inputs(jnp.zeros((1, 8, 4, 48)), k, k, "interpret")  # the interpreter takes any size
    k = jnp.zeros((1, 8, 2, 128))
    check_inputs(jnp.zeros((1, 8, 4, 128)), k, k, "triton")


def test_refuses_bad_blocks_and_compiling_on_cpu(monkeypatch):
    monkeypatch.setattr(attention_module, "_padded_attention", _no_kernel)
    q = jnp.zeros((1, 8, 4, 16))
    k = jnp.zeros((1, 8, 2, 16))
    for bad in (24, 8, 0):
        with pytest.raises(ValueError, match=f"block_q must be a power of two >= 16; got {bad}"):
            flash_attention(q, k, k, block_q=bad)
    with pytest.raises(ValueError, match="block_k"):
        flash_attention(q, k, k, block_k=48)
    assert choose_target(None) == "interpret"  # CPU: interpret mode by default
    with pytest.raises(ValueError, match="interpret=True"):
        flash_attention(q, k, k, interpret=False)
