"""Prompt-masked training: a batch ``[rows, 2, seq_len + 1]`` (tokens, loss mask) gives the mean
cross-entropy of its unmasked targets, on every layout as on one device, and equal to a plain
reference that drops the masked targets by hand from the model's one-device logits.

The masks are drawn from the test's seed as a prompt/completion split per row (a row's first
``p`` positions masked, ``p`` drawn), with one row wholly masked and one wholly kept, so rows
of every device count different numbers of targets: a divisor of ``rows x seq_len``, or of each
device's own count, gives another loss and other gradients. The last batch of the shared runs is
wholly masked (a window of prompts alone): its loss is 0 and its gradients are 0, on every layout,
not 0 / 0.
"""

import jax
import numpy as np
import pytest

import dew
from dew.data import Loading, TokenWindows, write_token_folder
from tests.equivalence import (
    ROWS,
    assert_matches,
    reference_away_from_ties,
    reference_run,
    sharded_run,
)
from tests.helpers import SEQ, VOCAB, fresh_batch, seeded_key, smooth_optimizer, tiny_objective

STEPS = 2  # masked batches, then one wholly masked
TOL = 1e-5


def masked_batch(rows, seed) -> np.ndarray:
    """int32 ``[rows, 2, SEQ + 1]``: random tokens and a prompt mask (0 up to a drawn prompt
    length, 1 after), row 0 all masked, row 1 all kept."""
    tokens = fresh_batch(rows, seed)
    rng = np.random.default_rng(seed)
    prompt = rng.integers(1, SEQ, rows)
    prompt[0], prompt[1] = SEQ + 1, 0
    mask = (np.arange(SEQ + 1)[None, :] >= prompt[:, None]).astype(np.int32)
    return np.stack([tokens, mask], axis=1)


def wholly_masked_batch(rows, seed) -> np.ndarray:
    """``masked_batch`` with every target masked: nothing in it counts."""
    batch = masked_batch(rows, seed)
    batch[:, 1] = 0
    return batch


def hand_masked_loss(model, params, batch) -> float:
    """The mean cross-entropy of the unmasked targets, by hand: the model's one-device logits
    (``model.apply``), a float64 log-softmax, and a loop that keeps target ``j`` of a row where
    the mask of token ``j + 1`` is 1."""
    tokens, mask = np.asarray(batch[:, 0]), np.asarray(batch[:, 1])
    # (One compiled program, not op by op.)
    logits = np.asarray(jax.jit(model.apply)(params, tokens[:, :-1]), np.float64)
    peak = logits.max(axis=-1, keepdims=True)
    log_probs = logits - peak - np.log(np.exp(logits - peak).sum(axis=-1, keepdims=True))
    total, count = 0.0, 0
    for row in range(tokens.shape[0]):
        for j in range(tokens.shape[1] - 1):
            if mask[row, j + 1]:
                total -= log_probs[row, j, tokens[row, j + 1]]
                count += 1
    return total / count


@pytest.fixture(scope="module")
def dense(module_seed):
    """The dense case: key, masked batches, the one-device run, and the hand-masked mean of the
    first batch from its initial weights, shared by its layouts."""
    objective = tiny_objective()
    key = seeded_key(module_seed)
    batches = [masked_batch(ROWS, (module_seed, i)) for i in range(STEPS)]
    batches.append(wholly_masked_batch(ROWS, (module_seed, STEPS)))
    reference = reference_run(objective, smooth_optimizer(), key, batches)
    hand = hand_masked_loss(objective.model, reference["initial"], batches[0])
    return objective, key, batches, reference, hand


def test_the_one_device_reference_is_the_hand_masked_mean(dense, seed):
    objective, _, batches, reference, expected = dense
    np.testing.assert_allclose(reference["losses"][0], expected, rtol=TOL, err_msg=f"seed {seed}")
    # A wholly masked batch: no target counts, so the mean over none is taken as 0, and so are
    # the gradients (a divisor of 0 targets would make both NaN).
    assert reference["losses"][STEPS] == 0.0, f"seed {seed}"
    for leaf in jax.tree_util.tree_leaves(reference["grads"][STEPS]):
        assert np.all(np.asarray(leaf) == 0.0), f"seed {seed}"
    # Not vacuous: row 0 is all masked, so other tokens there leave the loss as it was, where a
    # loss that ignored the mask would move with them.
    other = np.array(batches[0])
    other[0, 0] = (other[0, 0] + 1) % VOCAB
    loss = jax.jit(objective.loss)
    again = float(loss(reference["initial"], other))
    np.testing.assert_allclose(again, expected, rtol=TOL, err_msg=f"seed {seed}")
    plain = [float(loss(reference["initial"], b[:, 0])) for b in (batches[0], other)]
    assert plain[0] != plain[1], f"row 0's tokens changed nothing unmasked, seed {seed}"


M = dew.MeshSpec
LAYOUTS = {
    "fsdp8": (M(fsdp=8), {}),
    # The GSPMD baseline counts over the global array (XLA's all-reduce), cut as the step cuts.
    "fsdp8_gspmd_accumulation2": (M(fsdp=8), {"engine": "gspmd", "accumulation": 2}),
    "data2_tensor4_accumulation2": (M(data=2, tensor=4), {"accumulation": 2}),
    # Positions split over sequence (zigzag, the mask reordered with the targets) inside
    # pipeline stages, whose devices hold the same rows: the count must not add them twice.
    "sequence2_stage2_fsdp2": (
        M(sequence=2, stage=2, fsdp=2, microbatches=2),
        {"options": dew.StepOptions(sequence_scheme="all_to_all")},
    ),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_a_masked_batch_trains_like_one_device_and_the_hand_reference(dense, seed, name):
    objective, key, batches, reference, expected = dense
    mesh, trainer_args = LAYOUTS[name]
    run = sharded_run(
        objective, smooth_optimizer(), key, batches, mesh, reference["initial"], **trainer_args
    )
    assert_matches(run, reference, seed, name)
    np.testing.assert_allclose(run["losses"][0], expected, rtol=TOL, err_msg=f"{name}, seed {seed}")
    assert run["losses"][STEPS] == 0.0, f"the wholly masked batch, {name}, seed {seed}"
    for leaf in jax.tree_util.tree_leaves(run["grads"][STEPS]):
        assert np.all(np.asarray(leaf) == 0.0), f"the wholly masked batch, {name}, seed {seed}"


def test_an_moe_model_averages_cross_entropy_over_kept_targets_and_router_losses_over_all(seed):
    """Over expert (a batch axis): the cross-entropy is the mean over unmasked targets, the router
    losses stay means over every token (prompt tokens are routed too)."""
    objective = tiny_objective(num_experts=4, experts_per_token=2)
    key = seeded_key(seed)

    # A draw that routes a token next to a tie is drawn again (DEW_SEED=1792944756 at 78477ee: a
    # margin of 2.1e-7, losses 2.7e-4 apart on expert=4,fsdp=2).
    def draw(attempt):
        return [masked_batch(ROWS, (seed, 0, attempt) if attempt else (seed, 0))]

    reference = reference_away_from_ties(objective, key, draw, f"seed {seed}")
    batches = reference["batches"]
    run = sharded_run(
        objective, smooth_optimizer(), key, batches, M(expert=4, fsdp=2), reference["initial"]
    )
    assert_matches(run, reference, seed, "expert4_fsdp2")
    params, batch = reference["initial"], batches[0]
    router = float(jax.jit(objective.loss)(params, batch[:, 0])) - hand_masked_loss(
        objective.model, params, np.stack([batch[:, 0], np.ones_like(batch[:, 1])], axis=1)
    )
    expected = hand_masked_loss(objective.model, params, batch) + router
    assert router > 0, f"no router loss to check, seed {seed}"
    np.testing.assert_allclose(run["losses"][0], expected, rtol=TOL, err_msg=f"seed {seed}")


def test_validation_of_a_masked_folder_is_the_hand_masked_mean(tmp_path, seed):
    """From the folder to the loss: the masked windows ``TokenWindows`` reads, evaluated by the
    Trainer's forward (``build_loss``) on fsdp=8."""
    rng = np.random.default_rng(seed)
    tokens = {split: rng.integers(0, VOCAB, 8 * SEQ + 1) for split in ("train", "val")}
    masks = {split: (rng.random(8 * SEQ + 1) < 0.5).astype(np.uint8) for split in tokens}
    write_token_folder(
        tmp_path / "masked",
        tokens["train"],
        tokens["val"],
        vocab_size=VOCAB,
        train_mask=masks["train"],
        val_mask=masks["val"],
    )
    data = TokenWindows(
        tmp_path / "masked", seq_len=SEQ, val_batches=1, loading=Loading(threads=0)
    ).load(batch=8)
    batch = data.validation()[0]
    assert batch.shape == (8, 2, SEQ + 1)
    objective = tiny_objective()
    trainer = dew.Trainer(
        objective,
        smooth_optimizer(),
        seeded_key(seed),
        mesh=M(fsdp=8),
        layout=dew.Layout(min_shard=1),
    )
    state = trainer.init_state()
    loss = trainer.evaluate(state, data)
    params = jax.device_get(state.params)
    np.testing.assert_allclose(
        loss, hand_masked_loss(objective.model, params, batch), rtol=TOL, err_msg=f"seed {seed}"
    )
