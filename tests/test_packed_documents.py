"""Packed documents, end to end: ``dew tokenize`` records where each document starts, the windows
carry each token's document, and a packed row of three documents trains as the three documents in
rows of their own, on one device and on every layout (float32, relative 1e-5).

The reference is the model on the documents apart: each in its own row, from position 0, padded
and masked after its end (``separate_rows``), through the plain one-device loss. Nothing of the
packed path is in it: no segment ids, no per-row positions, no boundary mask. The packed rows'
documents have random lengths drawn from the seed (a document of one token, with no target, comes
up), and their rows are masked at random on top (a prompt mask), so a divisor of ``rows x seq`` or
a per-device or per-microbatch count gives another loss.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dew
from dew.data import Loading, TokenWindows, tokenize_files, write_token_folder
from dew.data.folder import DOCS, open_document_starts, open_tokens
from dew.data.tokenizer import ByteTokenizer
from dew.mesh import build_mesh
from dew.objectives.lm import LMObjective, document_positions, split_batch
from dew.training.step import split_tokens
from tests.equivalence import ROWS, assert_matches, host_state, reference_run, sharded_run
from tests.helpers import SEQ, VOCAB, seeded_key, smooth_optimizer, tiny_objective

TOL = 1e-5
DOCUMENTS = 3  # per packed row


def packed_rows(rows, seed):
    """``(packed, lengths)``: int32 ``[rows, 3, SEQ + 1]`` (tokens, a random prompt mask, document
    ids 0, 1, 2 by the drawn lengths) and the ``[rows, 3]`` lengths, summing to ``SEQ + 1``."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, (rows, SEQ + 1))
    mask = (rng.random((rows, SEQ + 1)) < 0.8).astype(np.int64)
    cuts = np.sort(
        np.stack([rng.choice(np.arange(1, SEQ + 1), 2, replace=False) for _ in range(rows)]), 1
    )
    lengths = np.diff(
        np.concatenate([np.zeros((rows, 1), int), cuts, np.full((rows, 1), SEQ + 1)], 1)
    )
    documents = np.stack([np.repeat(np.arange(DOCUMENTS), n) for n in lengths])
    return np.stack([tokens, mask, documents], axis=1).astype(np.int32), lengths


def separate_rows(packed, lengths):
    """int32 ``[rows * 3, 2, SEQ + 1]``: each document of ``packed`` alone in a row from position
    0, with its own mask, its first token never a target, the rest of the row padded and masked."""
    out = np.zeros((packed.shape[0] * DOCUMENTS, 2, SEQ + 1), np.int32)
    for r, row in enumerate(packed):
        start = 0
        for d, n in enumerate(lengths[r]):
            out[DOCUMENTS * r + d, 0, :n] = row[0, start : start + n]
            out[DOCUMENTS * r + d, 1, 1:n] = row[1, start + 1 : start + n]
            start += n
    return out


@pytest.fixture(scope="module")
def case(module_seed):
    """The packed batch, its documents apart, and the one-device run on them apart."""
    objective = tiny_objective()
    key = seeded_key(module_seed)
    packed, lengths = packed_rows(ROWS, module_seed)
    apart = separate_rows(packed, lengths)
    reference = reference_run(objective, smooth_optimizer(), key, [apart])
    return objective, key, packed, lengths, reference


# --- The objective: boundaries, positions, one device -------------------------------------------


def test_the_loss_never_predicts_across_a_boundary_and_positions_restart(case, seed):
    _, _, packed, lengths, _ = case
    tokens, mask, documents = (np.asarray(x) for x in split_batch(jnp.asarray(packed)))
    assert np.array_equal(tokens, packed[:, 0]) and np.array_equal(documents, packed[:, 2, :-1])
    positions = np.asarray(document_positions(jnp.asarray(documents)))
    for r in range(ROWS):
        starts = np.cumsum([0, *lengths[r]])
        for j in range(SEQ):
            # Target j (token j + 1) counts where its mask says so and it is not a document's first.
            first = (j + 1) in starts
            assert mask[r, j] == (packed[r, 1, j + 1] and not first), (r, j, f"seed {seed}")
            # Input j's rotary position: its index less its document's first index.
            assert positions[r, j] == j - starts[starts <= j].max(), (r, j, f"seed {seed}")


def test_split_tokens_gives_each_device_its_rows_positions_in_zigzag_order(case, seed):
    _, _, packed, _, _ = case
    mesh = build_mesh(dew.MeshSpec(sequence=4))
    inputs, targets, positions, mask, documents = split_tokens(mesh, SEQ)(jnp.asarray(packed))
    order = dew.parallel.sequence.zigzag_positions(SEQ, 4)
    # By hand: a token's index less that of the first token of its document in the row.
    ids = packed[:, 2, :-1]
    natural = np.array([[j - min(np.flatnonzero(r == r[j])) for j in range(SEQ)] for r in ids])
    assert positions.shape == (ROWS, SEQ), f"seed {seed}"
    np.testing.assert_array_equal(positions, natural[:, order], err_msg=f"seed {seed}")
    np.testing.assert_array_equal(documents, packed[:, 2, :-1][:, order], err_msg=f"seed {seed}")
    np.testing.assert_array_equal(inputs, packed[:, 0, :-1][:, order], err_msg=f"seed {seed}")


@pytest.fixture(scope="module")
def one_device_loss(case):
    """``jit(value_and_grad(objective.loss))``, compiled once for the module's batches."""
    return jax.jit(jax.value_and_grad(case[0].loss))


def assert_is_the_documents_apart(loss_and_grads, batch, reference, where):
    from tests.helpers import relative_error

    loss, grads = loss_and_grads(reference["initial"], batch)
    np.testing.assert_allclose(loss, reference["losses"][0], rtol=TOL, err_msg=where)
    error = relative_error(grads, reference["grads"][0])
    assert error < TOL, f"gradients differ by {error:.3g}, {where}"


def test_one_device_loss_and_gradients_are_the_documents_apart(case, one_device_loss, seed):
    *_, packed, _, reference = case
    assert_is_the_documents_apart(one_device_loss, packed, reference, f"seed {seed}")


def test_ids_that_come_back_start_another_document(case, one_device_loss, seed):
    """Document ids 0, 1, 0 (a library user's own batch): the third document is a third, for
    attention as for the positions and the loss. The one-device loss and gradients are the
    documents apart, as with ids 0, 1, 2; and the step's split (every shard_map layout's entry)
    gives the segment ids 0, 1, 2, in zigzag order over sequence=4."""
    *_, packed, _, reference = case
    again = packed.copy()
    again[:, 2] = packed[:, 2] % 2  # 0, 1, 2 -> 0, 1, 0
    assert (again[:, 2, 0] == again[:, 2, -1]).all(), "the first id comes back at the row's end"
    assert_is_the_documents_apart(one_device_loss, again, reference, f"ids 0, 1, 0, seed {seed}")
    split = split_tokens(build_mesh(dew.MeshSpec(sequence=4)), SEQ)(jnp.asarray(again))
    order = dew.parallel.sequence.zigzag_positions(SEQ, 4)
    np.testing.assert_array_equal(split[4], packed[:, 2, :-1][:, order], err_msg=f"seed {seed}")


M = dew.MeshSpec
LAYOUTS = {
    "fsdp8": (M(fsdp=8), {}),
    # Accumulation's microbatches count different numbers of targets: the mean is the batch's.
    "data2_tensor4_accumulation2": (M(data=2, tensor=4), {"accumulation": 2}),
    # The ring: each visiting K/V block's document ids are the owner's, gathered once. (The
    # all-to-all scheme is checked at the attention call, tests/test_sequence_ops.py.)
    "sequence4_ring": (M(sequence=4), {}),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_a_packed_row_trains_as_its_documents_apart(case, seed, name):
    objective, key, packed, _, reference = case
    mesh, trainer_args = LAYOUTS[name]
    run = sharded_run(
        objective, smooth_optimizer(), key, [packed], mesh, reference["initial"], **trainer_args
    )
    assert_matches(run, reference, seed, name)
    # The step's count of the targets whose loss counts: what the documents apart have.
    assert run["metrics"][0]["useful_tokens"] == reference_targets(packed), f"seed {seed}"


class Validation:
    """What ``Trainer.evaluate`` reads of a data set: ``batch`` its one validation batch."""

    def __init__(self, batch):
        self.batch, self.batch_size, self.seq_len = batch, len(batch), SEQ

    def validation(self, rows=slice(None)):
        return [self.batch[rows]]


@pytest.mark.parametrize(
    "mesh",
    [M(fsdp=8), M(sequence=4), M(stage=2, fsdp=4, microbatches=2)],
    ids=["fsdp8", "sequence4_ring", "stage2_fsdp4"],
)
def test_evaluating_a_packed_row_is_the_documents_apart(case, seed, mesh):
    """The evaluation forward (``Trainer.evaluate``, its own program: plain, and a pipeline's)
    keeps each document to itself as the step does: the packed rows' validation loss is the
    documents apart's first loss (before any update)."""
    objective, key, packed, _, reference = case
    trainer = dew.Trainer(
        objective, smooth_optimizer(), key, mesh=mesh, layout=dew.Layout(min_shard=1)
    )
    loss = trainer.evaluate(host_state(trainer, reference["initial"]), Validation(packed))
    np.testing.assert_allclose(loss, reference["losses"][0], rtol=TOL, err_msg=f"{mesh}, {seed}")


def reference_targets(packed) -> int:
    """Targets that count, by hand: mask 1 and not a document's first token."""
    return int(
        sum(
            packed[r, 1, j + 1] and packed[r, 2, j + 1] == packed[r, 2, j]
            for r in range(packed.shape[0])
            for j in range(SEQ)
        )
    )


# --- The data: tokenizer's document starts, windows' document ids --------------------------------


class ByteWithEnd(ByteTokenizer):
    """Bytes and an end-of-text id 256: each document's ids are followed by it."""

    name = "byte-with-end"
    vocab_size = 257
    eos_id = 256


def write_inputs(tmp_path, kind):
    """``(inputs, documents, fields)``: files of ``kind`` and the texts of their documents, in
    order, as the tokenizer sees them (a chat rendered by the template)."""
    if kind == "text":
        texts = ["one document.", "a second, longer document\n", "x"]
        paths = []
        for i, text in enumerate(texts):
            (tmp_path / f"{i}.txt").write_text(text)
            paths.append(tmp_path / f"{i}.txt")
        return paths, texts, None
    if kind == "prompt_completion":
        pairs = [("Q: 2+2?\n", "4"), ("", "no prompt"), ("Q: hi\n", "hello there")]
        with open(tmp_path / "pairs.jsonl", "w") as f:
            for p, c in pairs:
                f.write(json.dumps({"prompt": p, "completion": c}) + "\n")
        return [tmp_path / "pairs.jsonl"], [p + c for p, c in pairs], ("prompt", "completion")
    chats = [
        [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "2+2"},
            {"role": "assistant", "content": "4"},
        ],
    ]
    with open(tmp_path / "chats.jsonl", "w") as f:
        for chat in chats:
            f.write(json.dumps({"messages": chat}) + "\n")
    rendered = ["".join(f"<|{m['role']}|>\n{m['content']}\n" for m in chat) for chat in chats]
    return [tmp_path / "chats.jsonl"], rendered, ("messages",)


@pytest.mark.parametrize("kind", ["text", "prompt_completion", "chat"])
@pytest.mark.parametrize("tokenizer", [ByteTokenizer(), ByteWithEnd()], ids=["bytes", "eos"])
def test_tokenize_records_where_each_document_starts(tmp_path, kind, tokenizer):
    inputs, texts, fields = write_inputs(tmp_path, kind)
    report = tokenize_files(
        inputs, tmp_path / "out", tokenizer=tokenizer, val_fraction=0, fields=fields
    )
    meta = report.meta
    ends = tokenizer.eos_id is not None
    lengths = [len(text.encode()) + ends for text in texts]
    starts = open_document_starts(meta, "train")
    assert meta.document_starts and meta.version == 2 and meta.train_documents == len(texts)
    np.testing.assert_array_equal(starts, np.cumsum([0, *lengths[:-1]]))
    assert meta.train_tokens == sum(lengths)
    # Packed prompt/completion and chat data reads as separate documents by default.
    data = TokenWindows(tmp_path / "out", seq_len=4, loading=Loading(threads=0)).load(batch=1)
    assert data.documents == ("separate" if fields else "joined"), kind


def test_padded_rows_start_each_document_at_a_row(tmp_path):
    inputs, texts, fields = write_inputs(tmp_path, "prompt_completion")
    meta = tokenize_files(
        inputs,
        tmp_path / "out",
        tokenizer=ByteWithEnd(),
        val_fraction=0,
        fields=fields,
        rows="pad",
        seq_len=8,
    ).meta
    rows = [-(-(len(text.encode()) + 1) // 8) for text in texts]
    np.testing.assert_array_equal(
        open_document_starts(meta, "train"), 8 * np.cumsum([0, *rows[:-1]])
    )


def test_document_starts_count_from_the_split_not_the_chunk(tmp_path, seed):
    """An input of many chunks (``chunk_bytes`` lowered from 1 MiB to 64, so 60 short documents
    make about 20): each split's starts are its own token indices, counted here from the end-of-
    text ids in its tokens, not offsets within each chunk."""
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    texts = ["".join(rng.choice(list("abcdef "), int(rng.integers(10, 40)))) for _ in range(60)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    report = tokenize_files(
        [tmp_path / "docs.jsonl"],
        tmp_path / "out",
        tokenizer=ByteWithEnd(),
        val_fraction=0.3,
        seed=seed,
        chunk_bytes=64,
    )
    meta, total = report.meta, 0
    for split in ("train", "val"):
        ids = np.asarray(open_tokens(meta, split))
        ends = np.flatnonzero(ids == ByteWithEnd.eos_id)
        np.testing.assert_array_equal(
            open_document_starts(meta, split), [0, *(ends[:-1] + 1)], err_msg=f"{split}, {seed}"
        )
        total += ends.size
    assert total == len(texts) and min(meta.train_documents, meta.val_documents) > 1, seed
    assert report.bytes_read > 10 * 64  # many chunks


def test_windows_give_each_token_its_document_within_the_window(tmp_path, seed):
    rng = np.random.default_rng(seed)
    starts = np.concatenate([[0], np.sort(rng.choice(np.arange(1, 200), 30, replace=False))])
    tokens = rng.integers(0, VOCAB, 200)
    write_token_folder(
        tmp_path / "f", tokens, tokens[:40], vocab_size=VOCAB, train_starts=starts, val_starts=[0]
    )
    data = TokenWindows(
        tmp_path / "f", seq_len=SEQ, documents="separate", loading=Loading(threads=0)
    ).load(batch=4)
    batch = data.batch(0)
    assert batch.shape == (4, 3, SEQ + 1)
    for row, window in zip(batch, data.windows_of(0)):
        index = window * SEQ + np.arange(SEQ + 1)
        # By hand: how many documents start after the window's first token, up to each token.
        expected = [sum(index[0] < s <= i for s in starts) for i in index]
        assert row[2].tolist() == expected, f"seed {seed}"
        assert np.array_equal(row[0], tokens[index]) and row[1].min() == 1


def test_a_folder_without_document_starts_says_so(tmp_path):
    write_token_folder(tmp_path / "old", np.arange(60) % VOCAB, np.arange(20), vocab_size=VOCAB)
    meta_json = json.loads((tmp_path / "old" / "meta.json").read_text())
    assert "document_starts" not in meta_json
    with pytest.raises(ValueError, match="records no document starts .* tokenize it again"):
        TokenWindows(tmp_path / "old", seq_len=SEQ, documents="separate").load(batch=1)
    joined = TokenWindows(tmp_path / "old", seq_len=SEQ).load(batch=1)  # auto: as before
    assert joined.documents == "joined" and joined.batch(0).shape == (1, SEQ + 1)
    # A version-1 folder (no "version", as Dew wrote before) still loads; a newer one is refused.
    del meta_json["version"]
    (tmp_path / "old" / "meta.json").write_text(json.dumps(meta_json))
    assert TokenWindows(tmp_path / "old", seq_len=SEQ).load(batch=1).meta.version == 1
    (tmp_path / "old" / DOCS["train"]).write_bytes(b"")
    with pytest.raises(ValueError, match='holds train.docs but meta.json has no "document_starts"'):
        TokenWindows(tmp_path / "old", seq_len=SEQ).load(batch=1)
    (tmp_path / "old" / DOCS["train"]).unlink()
    (tmp_path / "old" / "meta.json").write_text(json.dumps({**meta_json, "version": 3}))
    with pytest.raises(ValueError, match="format version 3 is newer than this Dew reads"):
        TokenWindows(tmp_path / "old", seq_len=SEQ).load(batch=1)


# --- Attention: segment ids and windows against their formulas ----------------------------------


def loop_attention(q, k, v, q_ids, kv_ids, window):
    """float64 causal attention ``[batch, heads, seq, d]`` by loops over rows, heads and queries:
    query ``i`` sees key ``j`` when ``j <= i``, ``j > i - window`` and their ids agree; a query
    that sees none gives zeros."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, h, s, d = q.shape
    groups = h // k.shape[1]
    out = np.zeros_like(q)
    for r in range(b):
        for head in range(h):
            for i in range(s):
                seen = [
                    j
                    for j in range(i + 1)
                    if q_ids[r, i] == kv_ids[r, j] and (window is None or j > i - window)
                ]
                if not seen:
                    continue
                logits = np.array([q[r, head, i] @ k[r, head // groups, j] for j in seen])
                p = np.exp(logits / np.sqrt(d) - logits.max() / np.sqrt(d))
                out[r, head, i] = (p / p.sum()) @ v[r, head // groups, seen]
    return out


@pytest.mark.parametrize("window", [None, 1, 3, 40])
def test_xla_attention_keeps_each_query_to_its_ids_and_window(seed, window):
    """Unsorted ids and a pair whose queries' ids the keys lack (rows that see no key: zeros, and
    gradients that stay finite); windows of 1, of a few keys and of more than the sequence."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, 4, 12, 8)).astype(np.float32)
    k, v = (rng.standard_normal((2, 2, 12, 8)).astype(np.float32) for _ in range(2))
    q_ids = rng.integers(0, 3, (2, 12)).astype(np.int32)
    kv_ids = np.where(rng.random((2, 12)) < 0.5, q_ids, 7).astype(np.int32)
    for ids in ((q_ids, q_ids), (q_ids, kv_ids)):

        def attend(q, k, v, ids=ids):
            return dew.nn.attention.xla_attention(
                q, k, v, segment_ids=ids, window=window, layout="bhsd"
            )

        out, lse = attend(q, k, v)
        want = loop_attention(q, k, v, *ids, window)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6, err_msg=f"seed {seed}")
        grads = jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v)[0] ** 2), (0, 1, 2))(q, k, v)
        assert all(np.isfinite(g).all() for g in grads), f"seed {seed}"
    # The bshd layout reads the same arrays transposed.
    bshd = dew.nn.attention.xla_attention(
        *(np.swapaxes(x, 1, 2) for x in (q, k, v)), segment_ids=q_ids, window=window
    )[0]
    np.testing.assert_allclose(
        np.swapaxes(bshd, 1, 2),
        loop_attention(q, k, v, q_ids, q_ids, window),
        rtol=1e-5,
        atol=1e-6,
        err_msg=f"seed {seed}",
    )


def test_the_models_window_reaches_its_attention(seed):
    """One layer of window 3: the logits at position j move with token j - 2 and not with token
    j - 3 (the first outside the window); without the window both move them."""
    tokens = np.random.default_rng(seed).integers(0, VOCAB, (1, SEQ))
    j = SEQ - 1
    changed = {}
    for window in (3, None):
        model = tiny_objective(num_layers=1, attention_window=window).model
        params = model.init(seeded_key(seed))
        apply = jax.jit(model.apply)
        logits = apply(params, tokens)[0, j]
        for back in (2, 3):
            other = tokens.copy()
            other[0, j - back] = (other[0, j - back] + 1) % VOCAB
            moved = np.abs(apply(params, other)[0, j] - logits).max()
            changed[window, back] = bool(moved > 1e-6)
    assert changed == {(3, 2): True, (3, 3): False, (None, 2): True, (None, 3): True}, seed


def test_a_window_past_a_chunk_on_a_ring_of_the_kernels_is_refused_and_auto_takes_xla():
    # SEQ 16 on sequence 4: zigzag chunks of 2 positions, shorter than the window of 4.
    model = tiny_objective(attention_window=4, attention_impl="pallas").model
    message = (
        r"attention window 4 on a sequence ring of 4 is longer than a zigzag chunk "
        r"\(seq_len / 8 = 2 positions\), so the ring runs it with attention 'xla' only"
    )
    with pytest.raises(ValueError, match=message):
        dew.Trainer(LMObjective(model, SEQ), smooth_optimizer(), seeded_key(0), mesh=M(sequence=4))
    # On sequence 2 the chunks are 4 positions: the window fits one, and the ring's halo exchange
    # runs the kernels with it.
    dew.Trainer(LMObjective(model, SEQ), smooth_optimizer(), seeded_key(0), mesh=M(sequence=2))
    # The all-to-all scheme hands each device the whole sequence: the kernels take the window.
    assert model.attention_for("tpu", {"sequence": 4}, "all_to_all") == "pallas"
    # "auto" runs what runs: XLA's blocks on a ring whose chunks are shorter than the window (or
    # whose length it is not told), the kernels everywhere else. (head_dim 16: one the Triton
    # kernels take.)
    auto = tiny_objective(attention_window=4, attention_impl="auto", emb_features=64).model
    for platform in ("tpu", "gpu"):
        assert auto.attention_for(platform, {"sequence": 4}, "ring", seq_len=SEQ) == "xla"
        assert auto.attention_for(platform, {"sequence": 4}, "ring") == "xla"
        assert auto.attention_for(platform, {"sequence": 2}, "ring", seq_len=SEQ) == "pallas"
        assert auto.attention_for(platform, {"sequence": 4}, "all_to_all") == "pallas"
        assert auto.attention_for(platform, {"sequence": 1}, "ring") == "pallas"
    dense = tiny_objective(attention_impl="auto", emb_features=64).model
    assert dense.attention_for("tpu", {"sequence": 4}, "ring") == "pallas"


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_a_windowed_model_trains_on_a_sequence_ring_as_on_one_device(seed, impl):
    """A window of 3 on sequence 2 (chunks of 4 positions): the ring's halo exchange, with XLA's
    attention and with the Pallas kernels (the interpreter on CPU): the loss, every gradient and
    the updated weights of one device (float32, 1e-5)."""
    from tests.helpers import fresh_batch

    objective = tiny_objective(attention_window=3, attention_impl=impl)
    key = seeded_key(seed)
    batches = [fresh_batch(ROWS, (seed, 2))]
    reference = reference_run(objective, smooth_optimizer(), key, batches)
    run = sharded_run(
        objective, smooth_optimizer(), key, batches, M(sequence=2), reference["initial"]
    )
    assert_matches(run, reference, seed, f"sequence2, window 3, {impl}")
