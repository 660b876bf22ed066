"""The decoder split into embed, blocks and head, the loss through the vocabulary-split
cross-entropy, and attention functions that return (output, log-sum-exp) so partial softmaxes merge.

These are the seams the next parallelism axes cut along (a pipeline runs blocks per stage, the
vocabulary split feeds the loss a slice of the logits, ring attention merges blocks of keys); on
one device each must compute exactly what the unsplit model did.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.kernels import flash_attention_backward, flash_attention_forward
from dew.nn.attention import model_xla_attention, pallas_attention, xla_attention
from tests.helpers import fresh_batch, relative_error, seeded_key, tiny_objective

ROWS = 4


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_apply_is_head_of_blocks_of_embed(tie, seed):
    model = tiny_objective(tie_embeddings=tie).model
    params = jax.jit(model.init)(seeded_key(seed))  # one compiled program, not op by op
    tokens = jnp.asarray(fresh_batch(ROWS, seed)[:, :-1])

    def by_parts(params, tokens):
        x = model.embed(params, tokens)
        x, _ = model.blocks(params, x, jnp.arange(tokens.shape[1]))
        return model.head(params, x)

    whole = np.asarray(jax.jit(model.apply)(params, tokens))
    parts = np.asarray(jax.jit(by_parts)(params, tokens))
    assert whole.shape == (ROWS, tokens.shape[1], model.vocab_size), f"seed {seed}"
    np.testing.assert_array_equal(parts, whole, err_msg=f"seed {seed}")


def test_blocks_rotate_by_the_positions_given(seed):
    """A later sequence split passes its own positions: the blocks must use them."""
    model = tiny_objective().model
    # Each one compiled program, not op by op; the blocks' one for every positions.
    params = jax.jit(model.init)(seeded_key(seed))
    x = jax.jit(model.embed)(params, jnp.asarray(fresh_batch(ROWS, seed)[:, :-1]))
    blocks = jax.jit(model.blocks)
    positions = jnp.arange(x.shape[1])
    here, _ = blocks(params, x, positions)
    shifted, _ = blocks(params, x, positions + 5)
    # Rotary attention sees only differences of positions: a common shift changes rounding only
    # (2.3e-7 to 3.1e-7 of the activations' norm, seeds 1-3).
    error = relative_error(np.asarray(shifted), np.asarray(here))
    assert error < 1e-6, f"a common shift moved the blocks' output by {error:.3g}, seed {seed}"
    reversed_, _ = blocks(params, x, positions[::-1])
    assert not np.allclose(reversed_, here, rtol=1e-3, atol=1e-3), f"seed {seed}"


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_loss_sum_is_logsumexp_minus_the_target_logit(tie, seed):
    objective = tiny_objective(tie_embeddings=tie)
    # Each one compiled program, not op by op.
    params = jax.jit(objective.model.init)(seeded_key(seed))
    batch = jnp.asarray(fresh_batch(ROWS, seed))
    logits = jax.jit(objective.model.apply)(params, batch[:, :-1])
    picked = jnp.take_along_axis(logits, batch[:, 1:, None], axis=-1)[..., 0]
    want = float(jnp.sum(jax.nn.logsumexp(logits, axis=-1) - picked))
    got = float(jax.jit(objective.loss_sum)(params, batch)[0])
    assert abs(got - want) <= 1e-6 * abs(want), f"loss_sum {got} vs {want}, seed {seed}"


def numpy_lse(q, k, *, causal):
    """float64 log-sum-exp of the scaled, masked logits: ``[batch, heads, q_len]``."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    group = q.shape[2] // k.shape[2]
    k = np.repeat(k, group, axis=2)
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    if causal:
        visible = np.tril(np.ones((q.shape[1], k.shape[1]), bool))
        logits = np.where(visible, logits, -np.inf)
    peak = logits.max(axis=-1, keepdims=True)
    return (peak + np.log(np.exp(logits - peak).sum(axis=-1, keepdims=True)))[..., 0]


def draw(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)


@pytest.mark.parametrize("causal", [True, False])
def test_xla_lse_is_the_logsumexp_of_the_logits(causal, seed):
    rng = np.random.default_rng(seed)
    q, k, v = draw(rng, 2, 24, 4, 8), draw(rng, 2, 24, 2, 8), draw(rng, 2, 24, 2, 8)
    _, lse = xla_attention(q, k, v, causal=causal)
    assert lse.shape == (2, 4, 24) and lse.dtype == jnp.float32, f"seed {seed}"
    np.testing.assert_allclose(
        lse, numpy_lse(q, k, causal=causal), rtol=1e-6, atol=1e-6, err_msg=f"seed {seed}"
    )


def merge(out1, lse1, out2, lse2):
    """Ring attention's merge of attention over two disjoint sets of keys."""
    lse = jnp.logaddexp(lse1, lse2)
    # lse is [b, h, s] and the outputs [b, s, h, d]: bring the weights to the outputs' layout.
    w1 = jnp.exp(lse1 - lse).transpose(0, 2, 1)[..., None]
    w2 = jnp.exp(lse2 - lse).transpose(0, 2, 1)[..., None]
    return w1 * out1 + w2 * out2, lse


def test_attention_over_two_halves_of_the_keys_merges_into_the_whole(seed):
    rng = np.random.default_rng(seed)
    q, k, v = draw(rng, 2, 16, 4, 8), draw(rng, 2, 32, 2, 8), draw(rng, 2, 32, 2, 8)
    out, lse = xla_attention(q, k, v, causal=False)
    first = xla_attention(q, k[:, :12], v[:, :12], causal=False)
    second = xla_attention(q, k[:, 12:], v[:, 12:], causal=False)
    merged_out, merged_lse = merge(*first, *second)
    np.testing.assert_allclose(merged_lse, lse, rtol=1e-6, atol=1e-6, err_msg=f"seed {seed}")
    np.testing.assert_allclose(merged_out, out, rtol=1e-5, atol=1e-6, err_msg=f"seed {seed}")


# Interpret-mode Pallas: small shapes, grouped queries (4 heads over 2 kv heads), a length that
# is not a multiple of the 16-row blocks so the padding path runs.
PALLAS_CASES = [(True, 40), (False, 24)]


@pytest.mark.parametrize("causal,length", PALLAS_CASES)
def test_pallas_forward_and_backward_match_xla(causal, length, seed):
    rng = np.random.default_rng(seed)
    q, k, v = draw(rng, 2, length, 4, 16), draw(rng, 2, length, 2, 16), draw(rng, 2, length, 2, 16)
    d_out = draw(rng, 2, length, 4, 16)
    blocks = dict(causal=causal, block_q=16, block_k=16, interpret=True)

    out, lse = flash_attention_forward(q, k, v, **blocks)
    want_out, vjp = jax.vjp(lambda q, k, v: xla_attention(q, k, v, causal=causal)[0], q, k, v)
    want_lse = xla_attention(q, k, v, causal=causal)[1]
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5, err_msg=f"seed {seed}")
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5, err_msg=f"seed {seed}")

    grads = flash_attention_backward(q, k, v, out, lse, d_out, **blocks)
    for name, got, want in zip("qkv", grads, vjp(d_out)):
        error = relative_error(got, want)
        assert error < 1e-5, f"d{name} differs from XLA's by {error:.3g}, seed {seed}"


def test_pallas_attention_differentiates_through_its_lse(seed):
    """``pallas_attention`` returns a differentiable lse: its gradient matches XLA's (both in the
    model's layout, ``bhsd``)."""
    rng = np.random.default_rng(seed)
    q, k, v = draw(rng, 1, 4, 24, 16), draw(rng, 1, 2, 24, 16), draw(rng, 1, 2, 24, 16)
    d_out, d_lse = draw(rng, 1, 4, 24, 16), draw(rng, 1, 4, 24)

    def objective(attend):
        def f(q, k, v):
            out, lse = attend(q, k, v, causal=True)
            return jnp.sum(out * d_out) + jnp.sum(lse * d_lse)

        return jax.jit(jax.grad(f, argnums=(0, 1, 2)))(q, k, v)  # not op by op

    for name, got, want in zip("qkv", objective(pallas_attention), objective(model_xla_attention)):
        error = relative_error(got, want)
        assert error < 1e-5, f"d{name} differs from XLA's by {error:.3g}, seed {seed}"


def test_backward_refuses_residuals_of_the_wrong_shape():
    q = jnp.zeros((1, 16, 2, 16))
    k = jnp.zeros((1, 16, 1, 16))
    with pytest.raises(ValueError, match=r"lse must be \(1, 2, 16\) float32 .* got \(1, 16, 2\)"):
        flash_attention_backward(q, k, k, q, jnp.zeros((1, 16, 2)), q, interpret=True)
