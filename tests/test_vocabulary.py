"""The vocabulary split over fsdp (``dew.parallel.vocabulary``): when a device holds no more tokens
than table rows, the embedding, head and loss move the fsdp group's tokens instead of gathering the
table. Tested three ways: against one device, by the collectives it asks for, and by memory.
"""

import jax
import optax
import pytest

import dew
from dew.collectives import collectives
from dew.parallel import vocabulary
from tests.equivalence import ROWS, STEPS, assert_matches, reference_run, sharded_run
from tests.helpers import fresh_batch, seeded_key, smooth_optimizer, tiny_objective

VOCAB = 256  # 32 rows of the table per device at fsdp 8, 64 at fsdp 4
WIDTH = 32


def objective(**overrides):
    return tiny_objective(vocab_size=VOCAB, **overrides)


@pytest.fixture(scope="module")
def case(module_seed):
    # Tokens over the whole vocabulary, so that every device's slice is looked up and scored.
    batches = [fresh_batch(ROWS, (module_seed, i), vocab=VOCAB) for i in range(STEPS)]
    return seeded_key(module_seed), batches, {}


def reference(case, tied: bool):
    key, batches, cache = case
    if tied not in cache:
        cache[tied] = reference_run(
            objective(tie_embeddings=tied), smooth_optimizer(), key, batches
        )
    return cache[tied]


M = dew.MeshSpec
# Rows per device per microbatch x 16 positions <= the table rows a device holds.
LAYOUTS = {
    # 32 rows over fsdp 8, 4 microbatches: 16 tokens a device against 32 table rows.
    "tied_fsdp8_accumulation4": (True, M(fsdp=8), {"accumulation": 4}),
    # data 2 x fsdp 4, untied head: 16 tokens against 64 rows of each of the two tables.
    "untied_data2_fsdp4_accumulation4": (False, M(fsdp=4), {"accumulation": 4}),
    # A pipeline: the embedding on stage 0, the head on stage 1, each inside its branch.
    "tied_stage2_fsdp4": (True, M(stage=2, fsdp=4, microbatches=4), {}),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_vocabulary_split_over_fsdp_matches_one_device(case, name, seed):
    tied, mesh, trainer_args = LAYOUTS[name]
    expected = reference(case, tied)
    key, batches, _ = case
    run = sharded_run(
        objective(tie_embeddings=tied),
        smooth_optimizer(),
        key,
        batches,
        mesh,
        initial=expected["initial"],
        **trainer_args,
    )
    assert_matches(run, expected, seed, name)


def trainer(mesh, **overrides):
    return dew.Trainer(
        objective(**overrides),
        optax.adamw(1e-3),
        jax.random.key(0),
        mesh=mesh,
        layout=dew.Layout(min_shard=1),
    )


def test_the_table_is_not_gathered_the_tokens_are():
    # fsdp 8, 8 rows: 1 row of 16 tokens a device against 32 table rows.
    t = trainer(M(fsdp=8))
    report = collectives(t.train_step(8), *t.step_arguments(8))
    gathered = {s for r in report.rows if r.op == "all_gather" for s in r.shapes}
    table_shard = f"f32[{VOCAB // 8},{WIDTH}]"
    assert table_shard not in gathered, gathered
    # The group's ids and its final activations, gathered over the rows.
    assert {"s32[1,16]", f"f32[1,16,{WIDTH}]"} <= gathered, gathered
    scattered = {s for r in report.rows if r.op == "psum_scatter" for s in r.shapes}
    # The embedding's reduce-scatter: every row of the group, [8, 16, width].
    assert f"f32[8,16,{WIDTH}]" in scattered, scattered
    # The loss's sums over the vocabulary, the group's 8 x 16 tokens in one chunk: [128, 2]
    # float32 once (the forward makes the gradients: nothing is recomputed or transposed), the
    # loss's cotangent summed in the backward, and the step's one float of loss.
    (sums,) = [r for r in report.rows if r.op == "psum"]
    assert sums.axes == ("fsdp",) and set(sums.shapes) == {"f32[128,2]", "f32[]"}
    assert sums.count == 1 + 1 + 1
    assert sums.operand_bytes == 128 * 2 * 4 + 4 + 4
    (maxes,) = [r for r in report.rows if r.op == "pmax"]
    assert maxes.axes == ("fsdp",) and maxes.shapes == ("f32[128]",) and maxes.count == 1


def test_more_tokens_than_table_rows_gather_the_table():
    # 4 rows of 16 tokens a device against 32 rows: gathering the table moves fewer bytes.
    t = trainer(M(fsdp=8))
    report = collectives(t.train_step(32), *t.step_arguments(32))
    gathered = {s for r in report.rows if r.op == "all_gather" for s in r.shapes}
    assert f"f32[{VOCAB // 8},{WIDTH}]" in gathered, gathered


def test_it_holds_no_whole_table_gradient(monkeypatch):
    # A table large beside the tokens (4096 x 32 float32: 512 KiB, its gradient as much): moving
    # the tokens frees at least that gradient on every device.
    big = dict(vocab_size=4096)
    mesh = M(fsdp=8)

    def temp_bytes():
        t = dew.Trainer(
            tiny_objective(**big),
            optax.adamw(1e-3),
            jax.random.key(0),
            mesh=mesh,
            layout=dew.Layout(min_shard=1),
        )
        return t.compiled_step(8).memory_analysis().temp_size_in_bytes

    moving = temp_bytes()
    monkeypatch.setattr(vocabulary, "moves_tokens", lambda *args: False)
    gathering = temp_bytes()
    table = 4096 * WIDTH * 4
    print(f"temp: {moving} B moving the tokens, {gathering} B gathering the table")
    assert gathering - moving >= table
