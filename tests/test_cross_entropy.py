"""The head and its cross-entropy over chunks of tokens (``dew.nn.cross_entropy``).

Checked against references that make every logit at once: a loop over tokens written from the
formulas (float64), the model's plain head (``CausalTransformer.apply``'s logits, autodiff), and,
for every head layout (tied and untied, the vocabulary over tensor, over fsdp), the sharded step
against that plain one-device reference. Its memory: one chunk of logits above the rest.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dew
from dew.nn import cross_entropy
from tests.equivalence import ROWS, STEPS, assert_matches, reference_run, sharded_run
from tests.helpers import fresh_batch, seeded_key, smooth_optimizer, tiny_objective


def loop_reference(x, table, targets, weights):
    """``(loss, dx, dtable)`` in float64, token by token, from the formulas:
    ``l_t = log sum_v exp(x_t . E_v) - x_t . E_{y_t}``, ``dx_t = w_t (sum_v p_tv E_v - E_{y_t})``,
    ``dE_v = sum_t w_t (p_tv - [v = y_t]) x_t``."""
    x, table = np.asarray(x, np.float64), np.asarray(table, np.float64)
    loss, dx, dtable = 0.0, np.zeros_like(x), np.zeros_like(table)
    for t in range(x.shape[0]):
        logits = table @ x[t]
        top = logits.max()
        p = np.exp(logits - top) / np.sum(np.exp(logits - top))
        loss += weights[t] * (top + np.log(np.sum(np.exp(logits - top))) - logits[targets[t]])
        p[targets[t]] -= 1.0
        dx[t] = weights[t] * (p @ table)
        dtable += weights[t] * np.outer(p, x[t])
    return loss, dx, dtable


# 29 tokens: chunks of 1, 4 (a remainder of 1) and 8 (5), all at once, and a chunk above the
# token count; weights with zeros among them, as a loss mask has.
@pytest.mark.parametrize("chunk", [1, 4, 8, None, 64])
def test_loss_sum_matches_the_formulas(seed, chunk):
    rng = np.random.default_rng(seed)
    tokens, width, vocab = 29, 6, 11
    x = rng.normal(size=(tokens, width)).astype(np.float32)
    table = rng.normal(size=(vocab, width)).astype(np.float32)
    targets = rng.integers(0, vocab, tokens).astype(np.int32)
    weights = (rng.uniform(0, 2, tokens) * (rng.uniform(size=tokens) > 0.3)).astype(np.float32)

    def loss(x, table):
        return cross_entropy.loss_sum(x, table, targets, weights, chunk=chunk)

    value, (dx, dtable) = jax.jit(jax.value_and_grad(loss, (0, 1)))(x, table)
    want, dx_want, dtable_want = loop_reference(x, table, targets, weights)
    np.testing.assert_allclose(value, want, rtol=1e-5, err_msg=f"loss, seed {seed}")
    # Gradients to 1e-5 of their largest entry: an entry that sums terms of either sign (a row of
    # dx adds 11 of them) can be far smaller than its terms, and float32's rounding of the terms
    # is then more than 1e-5 of it (1 seed in about 200 had an entry off by 4e-5 of itself).
    for name, got, expected in (("dx", dx, dx_want), ("dE", dtable, dtable_want)):
        error = np.max(np.abs(got - expected)) / np.max(np.abs(expected))
        assert error < 1e-5, f"{name}: relative error {error:.2e}, seed {seed}"
    # Not differentiated, the loss is the same number.
    np.testing.assert_allclose(jax.jit(loss)(x, table), want, rtol=1e-5, err_msg=f"seed {seed}")


def test_the_table_gradient_keeps_the_tables_dtype_and_adds_up_in_float32(seed):
    """bfloat16 matmuls over 256 chunks of one token: the float32 table's gradient comes back in
    float32, within bfloat16's rounding of the inputs, where adding the chunks' parts in bfloat16
    would be off by far more."""
    rng = np.random.default_rng(seed)
    tokens, width, vocab = 256, 8, 16
    x = rng.normal(size=(tokens, width)).astype(np.float32)
    table = rng.normal(size=(vocab, width)).astype(np.float32)
    targets = np.zeros(tokens, np.int32)  # one id for every token: its row adds 256 parts
    x_bf16 = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
    table_bf16 = np.asarray(jnp.asarray(table, jnp.bfloat16).astype(jnp.float32))

    def loss(table):
        return cross_entropy.loss_sum(x, table, targets, chunk=1, dtype=jnp.bfloat16)

    dtable = jax.jit(jax.grad(loss))(table)
    assert dtable.dtype == jnp.float32
    _, _, want = loop_reference(x_bf16, table_bf16, targets, np.ones(tokens))
    error = np.max(np.abs(dtable - want)) / np.max(np.abs(want))
    print(f"seed {seed}: relative error {error:.2e}")
    assert error < 4e-3, f"seed {seed}: {error}"


def test_bad_shapes_are_refused():
    x, table = jnp.zeros((2, 3, 4)), jnp.zeros((5, 4))
    with pytest.raises(ValueError, match=r"targets \(2, 4\) must be x \(2, 3, 4\) less its last"):
        cross_entropy.loss_sum(x, table, jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(ValueError, match=r"table \(5, 3\) must be \[vocab, 4\]"):
        cross_entropy.loss_sum(x, jnp.zeros((5, 3)), jnp.zeros((2, 3), jnp.int32))
    with pytest.raises(ValueError, match=r"weights \(3,\) must be targets' \(2, 3\)"):
        cross_entropy.loss_sum(x, table, jnp.zeros((2, 3), jnp.int32), jnp.ones(3))
    with pytest.raises(ValueError, match=r"loss_chunk_tokens must be an integer >= 1, got 0"):
        tiny_objective(loss_chunk_tokens=0)


def test_auto_chunk_fits_the_budget_in_aligned_chunks_of_least_cost():
    budget, align = cross_entropy.CHUNK_BYTES, cross_entropy.CHUNK_ALIGN
    per_chunk = cross_entropy.CHUNK_COST_TOKENS

    def cost(tokens, size):  # the padded tokens and the chunks' own cost, in tokens
        chunks = -(-tokens // size)
        return chunks * (size + per_chunk)

    # GPT-2 small at 16 x 1024 tokens: 3.3 GB of float32 logits; up to 2,668 tokens fit. 8 chunks
    # of 2,048 pad nothing; 7 of 2,432 pad 640 tokens, more than the chunk they save.
    assert cross_entropy.auto_chunk(16 * 1024, 50304) == 2048
    # 12,000 tokens: 5 chunks of 2,432 pad 160, against 6 of 2,048 (288) or 47 of 256 (32).
    assert cross_entropy.auto_chunk(12000, 50304) == 2432
    for tokens, vocab in [(16 * 1024, 50304), (12000, 50304), (7 * 4096, 128256), (999, 4 * 2**20)]:
        chunk = cross_entropy.auto_chunk(tokens, vocab)
        assert chunk * vocab * 4 <= budget, (tokens, vocab, chunk)
        fitting = range(align, budget // (vocab * 4) + 1, align)
        if fitting:
            assert chunk % align == 0, (tokens, vocab, chunk)
            assert all(cost(tokens, s) >= cost(tokens, chunk) for s in fitting)
        else:
            # A vocabulary of 4 Mi: 32 rows fit; alignment is given up, not the budget.
            assert chunk == 32, chunk
    # Logits that fit are made at once.
    assert cross_entropy.auto_chunk(1000, 64) == 1000


# --- The model's loss against its plain head --------------------------------------------------


class PlainHead:
    """The objective's loss through ``model.apply``'s whole logits and a textbook cross-entropy:
    the one-device reference the chunked loss must reproduce."""

    def __init__(self, objective):
        self.objective, self.model = objective, objective.model

    def loss(self, params, batch):
        logits = self.model.apply(params, batch[:, :-1])
        targets = batch[:, 1:]
        picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_models_loss_matches_its_plain_head(seed, tied):
    """In chunks of 7 tokens (the last one short) and in the automatic chunk, against the plain
    head (which computes the whole logits whatever the chunk): the three losses and gradients
    in one compiled program."""
    objectives = {
        what: tiny_objective(tie_embeddings=tied, loss_chunk_tokens=chunk)
        for what, chunk in (("chunks of 7", 7), ("the automatic chunk", None))
    }
    plain = next(iter(objectives.values()))
    params = jax.jit(plain.model.init)(seeded_key(seed))
    batch = fresh_batch(4, seed)
    losses = {"plain": PlainHead(plain).loss, **{w: o.loss for w, o in objectives.items()}}
    results = jax.jit(
        lambda params, batch: {w: jax.value_and_grad(f)(params, batch) for w, f in losses.items()}
    )(params, batch)
    want, grads_want = results.pop("plain")
    for what, (got, grads) in results.items():
        np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=f"{what}, seed {seed}")
        for path, g in jax.tree_util.tree_leaves_with_path(grads):
            w = grads_want
            for key in path:
                w = w[key.key]
            # In NumPy: the same float32 arithmetic, where jnp would compile each op per shape.
            g, w = np.asarray(g), np.asarray(w)
            error = float(np.max(np.abs(g - w)) / np.max(np.abs(w)))
            assert error < 1e-5, f"{what}, {jax.tree_util.keystr(path)}: {error:.2e}, seed {seed}"


# Every head layout, in chunks of 7 tokens (each device's tokens leave a remainder), against the
# plain head on one device. The vocabulary of 256 makes fsdp move the tokens, not the table.
M = dew.MeshSpec
LAYOUTS = {
    "tied_tensor4": (True, M(tensor=4), {}),
    "untied_data2_tensor4_sequence_parallel": (
        False,
        M(data=2, tensor=4),
        {"options": dew.StepOptions(sequence_parallel=True)},
    ),
    "tied_fsdp8_vocabulary_moves_tokens": (True, M(fsdp=8), {"accumulation": 2}),
    "untied_fsdp4_sequence2": (False, M(fsdp=4, sequence=2), {}),
}


@pytest.fixture(scope="module")
def case(module_seed):
    batches = [fresh_batch(ROWS, (module_seed, i), vocab=256) for i in range(STEPS)]
    return seeded_key(module_seed), batches, {}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_head_layout_in_chunks_matches_the_plain_head(case, name, seed):
    tied, mesh, trainer_args = LAYOUTS[name]
    key, batches, cache = case
    objective = tiny_objective(vocab_size=256, tie_embeddings=tied, loss_chunk_tokens=7)
    if tied not in cache:
        cache[tied] = reference_run(PlainHead(objective), smooth_optimizer(), key, batches)
    run = sharded_run(
        objective,
        smooth_optimizer(),
        key,
        batches,
        mesh,
        initial=cache[tied]["initial"],
        **trainer_args,
    )
    assert_matches(run, cache[tied], seed, name)


# --- Memory ---------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [128, 512])
def test_temporaries_hold_one_chunk_of_logits(chunk):
    """The compiled loss and gradients (CPU) need at most one chunk's float32 logits above what
    they must hold anyway: the table's float32 gradient and the activations' gradient. The whole
    logits would be 16 (chunks of 128) or 4 (512) times one chunk's."""
    tokens, width, vocab = 2048, 64, 8192
    grad = jax.jit(jax.grad(lambda x, e, y: cross_entropy.loss_sum(x, e, y, chunk=chunk), (0, 1)))
    shapes = (
        jax.ShapeDtypeStruct((tokens, width), jnp.float32),
        jax.ShapeDtypeStruct((vocab, width), jnp.float32),
        jax.ShapeDtypeStruct((tokens,), jnp.int32),
    )
    temp = grad.lower(*shapes).compile().memory_analysis().temp_size_in_bytes
    rest = vocab * width * 4 + tokens * width * 4
    logits = chunk * vocab * 4
    print(f"chunk {chunk}: temp {temp / 2**20:.2f} MiB, rest {rest / 2**20:.2f} MiB")
    assert temp <= rest + logits, f"{temp} B > {rest} B + one chunk's logits {logits} B"


def test_gspmd_over_devices_scores_every_token_at_once():
    """The GSPMD baseline on 8 devices makes no loop for the loss (one chunk): its partitioner
    would all-reduce a loop's table gradient every chunk."""
    objective = tiny_objective(loss_chunk_tokens=7)
    trainer = dew.Trainer(
        objective, optax.adamw(1e-3), jax.random.key(0), mesh=M(fsdp=8), engine="gspmd"
    )
    text = trainer.train_step(ROWS).lower(*trainer.step_arguments(ROWS)).as_text()
    shard_map = dew.Trainer(objective, optax.adamw(1e-3), jax.random.key(0), mesh=M(fsdp=8))
    chunked = shard_map.train_step(ROWS).lower(*shard_map.step_arguments(ROWS)).as_text()
    loops = text.count("stablehlo.while")
    assert chunked.count("stablehlo.while") > loops, "the shard_map step should chunk its loss"
