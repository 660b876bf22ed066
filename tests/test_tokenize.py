"""Tokenizers (``ByteTokenizer``, ``HFTokenizer``, the protocol, ``tokenizer_for``),
``dew tokenize`` (text, ``.jsonl``, ``.parquet`` into a token folder: the split, workers,
overwrite refusal, atomicity) and ``dew train --data`` on its folder with the folder's vocabulary.

A small BPE tokenizer is trained once per module with ``tokenizers``' own trainer on generated
text (``module_seed``) and saved as ``tokenizer.json``; nothing is downloaded. The commands run by
``main`` in this process.
"""

import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

from dew.cli.tokenize import _documents
from dew.data import (
    ByteTokenizer,
    HFTokenizer,
    TokenFolderWriter,
    Tokenizer,
    read_meta,
    tokenizer_for,
    write_token_folder,
)
from dew.data.folder import open_tokens

tokenizers = pytest.importorskip("tokenizers", reason="the text extra (tokenizers) is missing")

WORDS = "the cat dog bird sees likes finds river moon ball tree über naïve ✓ 日本 emoji🙂".split()
EOS = "<|endoftext|>"


def documents(rng, count):
    """``count`` generated documents of 3 to 30 words, some with newlines."""
    return [
        " ".join(rng.choice(WORDS, size=int(rng.integers(3, 30)))) + rng.choice([".", ".\n", "!"])
        for _ in range(count)
    ]


def train_bpe(texts, vocab_size, special_tokens):
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


@pytest.fixture(scope="module")
def bpe(tmp_path_factory, module_seed):
    """The path of a byte-level BPE ``tokenizer.json`` (about 320 ids, ``<|endoftext|>`` first)."""
    texts = documents(np.random.default_rng(module_seed), 300)
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    train_bpe(texts, 320, [EOS]).save(str(path))
    return path


@pytest.fixture
def dew_cli(capsys, monkeypatch):
    """``dew_cli(*args, **flags)``: ``dew ARGS --FLAG VALUE...`` run by ``main`` in this process,
    returned as a CompletedProcess (the ``dew_here`` fixture of tests/conftest.py)."""
    from dew.cli.main import main

    for name in ("XLA_FLAGS", "JAX_PLATFORMS"):
        monkeypatch.setenv(name, os.environ[name])

    def run(*args, **flags):
        argv = [str(a) for a in args]
        for name, value in flags.items():  # out=x -> --out x, force=True -> --force
            argv += [f"--{name.replace('_', '-')}"] + ([] if value is True else [str(value)])
        capsys.readouterr()
        code = main(argv)
        printed = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, printed.out, printed.err)

    return run


def folder_documents(path):
    """The documents of a token folder of ``bpe``'s: each split cut after each end-of-text id
    and decoded, ``{"train": [...], "val": [...]}``."""
    meta = read_meta(path)
    tokenizer = tokenizer_for(meta.tokenizer)
    out = {}
    for split in ("train", "val"):
        ids = np.asarray(open_tokens(meta, split))
        assert ids.size == 0 or ids[-1] == meta.eos_id  # every document ends with it
        cuts = np.flatnonzero(ids == meta.eos_id) + 1
        out[split] = [tokenizer.decode(part[:-1]) for part in np.split(ids, cuts)[:-1]]
    return out


def write_inputs(folder, docs, text_files=5):
    """The first ``text_files`` documents as ``folder/text/NNN.txt`` (one each), the rest as
    ``folder/docs.jsonl``; returns the two inputs, in that order."""
    (folder / "text").mkdir(parents=True)
    for i, doc in enumerate(docs[:text_files]):
        (folder / "text" / f"{i:03d}.txt").write_text(doc, encoding="utf-8")
    lines = [json.dumps({"text": doc, "id": i}) for i, doc in enumerate(docs[text_files:])]
    (folder / "docs.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder / "text", folder / "docs.jsonl"


def is_subsequence(part, whole):
    items = iter(whole)
    return all(any(x == y for y in items) for x in part)


# --- tokenizers ---------------------------------------------------------------------------------


def test_hf_tokenizer_round_trips_and_finds_its_vocabulary_and_eos(bpe, seed):
    tokenizer = HFTokenizer(bpe)
    library = tokenizers.Tokenizer.from_file(str(bpe))
    assert tokenizer.vocab_size == library.get_vocab_size() > 256
    assert (tokenizer.eos_token, tokenizer.eos_id) == (EOS, library.token_to_id(EOS))
    assert tokenizer.name == str(bpe.resolve())
    rng = np.random.default_rng(seed)
    texts = documents(rng, 20) + [
        "",
        "  two  spaces\n\ttab",
        "".join(map(chr, rng.integers(32, 0x2FFF, 50))),
    ]
    for text in texts:
        ids = tokenizer.encode(text)
        assert all(isinstance(i, int) and 0 <= i < tokenizer.vocab_size for i in ids)
        assert tokenizer.decode(ids) == text
        assert tokenizer.decode(np.asarray(ids, np.uint16)) == text
    # A document that spells the end-of-text token is text, not a document boundary.
    quoted = f"a {EOS} b"
    assert tokenizer.eos_id not in tokenizer.encode(quoted)
    assert tokenizer.decode(tokenizer.encode(quoted)) == quoted
    assert tokenizer.decode([tokenizer.eos_id]) == EOS
    # The same tokenizer from its JSON text, its folder, a library object, and a pickle.
    text = texts[0]
    for other in (
        HFTokenizer(bpe.read_text()),
        HFTokenizer(bpe.parent),
        HFTokenizer(library),
        pickle.loads(pickle.dumps(tokenizer)),
    ):
        assert other.encode(quoted) == tokenizer.encode(quoted)
        assert (other.encode(text), other.vocab_size, other.eos_id) == (
            tokenizer.encode(text),
            tokenizer.vocab_size,
            tokenizer.eos_id,
        )
    with pytest.raises(ValueError, match=rf"\[0, {tokenizer.vocab_size}\)"):
        tokenizer.decode([1, tokenizer.vocab_size])
    with pytest.raises(ValueError, match="not a tokenizer.json"):
        HFTokenizer('{"not": "a tokenizer"}')


def test_hf_tokenizer_end_of_text_lookup(tmp_path):
    texts = ["a few words of text", "and a few more"]
    eos_only = HFTokenizer(train_bpe(texts, 280, ["<pad>", "</s>"]))
    assert (eos_only.eos_token, eos_only.eos_id) == ("</s>", 1)
    # The defaults' order: <|endoftext|> before </s>.
    both = HFTokenizer(train_bpe(texts, 280, ["</s>", EOS]))
    assert (both.eos_token, both.eos_id) == (EOS, 1)
    assert HFTokenizer(train_bpe(texts, 280, ["</s>", EOS]), eos="</s>").eos_id == 0
    plain = train_bpe(texts, 280, ["<pad>"])
    with pytest.raises(
        ValueError, match=r"'<\|endoftext\|>', '<\|end_of_text\|>', '</s>', '<eos>'"
    ):
        HFTokenizer(plain)
    assert HFTokenizer(plain, eos="<pad>").eos_id == 0
    with pytest.raises(ValueError, match="no token '<sep>'"):
        HFTokenizer(plain, eos="<sep>")


def test_protocol_and_tokenizer_for(bpe, tmp_path):
    assert isinstance(ByteTokenizer(), Tokenizer) and isinstance(HFTokenizer(bpe), Tokenizer)
    assert not isinstance(object(), Tokenizer)
    assert not isinstance(tokenizers.Tokenizer.from_file(str(bpe)), Tokenizer)
    for name in ("byte", "bytes"):
        assert isinstance(tokenizer_for(name), ByteTokenizer)
    for spec in (bpe, str(bpe), bpe.parent):
        chosen = tokenizer_for(spec)
        assert isinstance(chosen, HFTokenizer) and chosen.name == str(bpe.resolve())
    assert tokenizer_for(ByteTokenizer().name).name == "byte"  # a folder's meta names it back
    assert tokenizer_for(HFTokenizer(bpe).name).encode("cat") == HFTokenizer(bpe).encode("cat")
    mine = ByteTokenizer()
    assert tokenizer_for(mine) is mine
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no tokenizer.json"):
        tokenizer_for(tmp_path / "empty")
    with pytest.raises(
        ValueError, match=r"unknown tokenizer 'gpt2'.*'byte' or 'bytes'.*downloaded"
    ):
        tokenizer_for("gpt2")
    with pytest.raises(ValueError, match="no end-of-text"):
        tokenizer_for("bytes", eos="</s>")


def test_token_folder_writer_appends_in_pieces(tmp_path):
    whole = write_token_folder(tmp_path / "whole", list(range(300)), [5, 6], vocab_size=300)
    with TokenFolderWriter(tmp_path / "pieces", vocab_size=300, extra={"documents": 3}) as writer:
        for start in range(0, 300, 70):
            writer.append("train", np.arange(start, min(start + 70, 300)))
        writer.append("val", [5, 6])
        assert not (tmp_path / "pieces" / "meta.json").exists()  # nothing in place until close
    for name in ("train.bin", "val.bin"):
        assert (tmp_path / "pieces" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes()
    assert writer.meta.to_json() == whole.to_json() and writer.meta.dtype == "uint16"
    assert json.loads((tmp_path / "pieces" / "meta.json").read_text())["documents"] == 3
    with pytest.raises(ValueError, match="300"):
        with TokenFolderWriter(tmp_path / "bad", vocab_size=300) as writer:
            writer.append("train", [1, 300])
    assert sorted(os.listdir(tmp_path / "bad")) == []  # aborted: no temporary files left


# --- dew tokenize -------------------------------------------------------------------------------


def test_dew_tokenize_text_and_jsonl(bpe, tmp_path, dew_cli, seed):
    docs = documents(np.random.default_rng(seed), 60)
    inputs = write_inputs(tmp_path, docs)
    out = tmp_path / "tokens"
    run = dew_cli("tokenize", *inputs, tokenizer=bpe, out=out, val_fraction=0.3, seed=seed)
    assert run.returncode == 0, run.stderr
    meta = read_meta(out)
    tokenizer = HFTokenizer(bpe)
    assert (meta.vocab_size, meta.dtype, meta.eos_id) == (tokenizer.vocab_size, "uint16", 0)
    assert meta.tokenizer == str(bpe.resolve())
    split = folder_documents(out)
    # Every document lands whole in one split, each split keeping the input order.
    assert sorted(split["train"] + split["val"]) == sorted(docs)
    assert is_subsequence(split["train"], docs) and is_subsequence(split["val"], docs)
    assert split["train"] and split["val"]
    first = split["train"][0] if docs[0] in split["train"] else split["val"][0]
    assert first == docs[0]
    extra = json.loads((out / "meta.json").read_text())
    assert (extra["train_documents"], extra["val_documents"]) == tuple(map(len, split.values()))
    assert run.stdout.strip().startswith(
        f"Wrote {out}: {meta.train_tokens:,} train tokens ({_documents(len(split['train']))}), "
        f"{meta.val_tokens:,} val tokens ({_documents(len(split['val']))}); vocab_size "
        f"{meta.vocab_size}, dtype uint16, eos_id 0"
    )
    text_bytes = sum(len(d.encode()) for d in docs[:5]) + (tmp_path / "docs.jsonl").stat().st_size
    assert (
        f"tokenize: {text_bytes / 1000:.1f} KB read, "
        f"{meta.train_tokens + meta.val_tokens:,} tokens written, " in run.stderr
    )

    # The byte tokenizer: no end-of-text id, the documents follow each other; uint8.
    run = dew_cli("tokenize", *inputs, tokenizer="bytes", out=tmp_path / "b", val_fraction=0)
    assert run.returncode == 0, run.stderr
    meta = read_meta(tmp_path / "b")
    assert (meta.vocab_size, meta.dtype, meta.eos_id, meta.val_tokens) == (256, "uint8", None, 0)
    assert (tmp_path / "b" / "train.bin").read_bytes() == "".join(docs).encode()


def test_validation_split_is_by_document_and_reproducible(bpe, tmp_path, dew_cli, seed):
    docs = documents(np.random.default_rng(seed), 40)
    inputs = write_inputs(tmp_path, docs, text_files=0)[1:]

    def split(name, split_seed):
        out = tmp_path / name
        run = dew_cli(
            "tokenize", *inputs, tokenizer=bpe, out=out, val_fraction=0.5, seed=split_seed
        )
        assert run.returncode == 0, run.stderr
        return folder_documents(out)

    first, again, other = split("a", seed), split("b", seed), split("c", seed + 1)
    assert first == again
    assert (tmp_path / "a" / "val.bin").read_bytes() == (tmp_path / "b" / "val.bin").read_bytes()
    # 40 documents at one half each: another seed giving the same split has odds 2**-40.
    assert first["val"] != other["val"]
    for result in (first, other):
        assert sorted(result["train"] + result["val"]) == sorted(docs)


def test_workers_write_the_same_folder(bpe, tmp_path, dew_cli, seed, monkeypatch):
    from dew.data import text

    monkeypatch.setattr(text, "CHUNK_BYTES", 300)  # many chunks, so order across workers matters
    docs = documents(np.random.default_rng(seed), 80)
    inputs = write_inputs(tmp_path, docs, text_files=10)
    folders = {}
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        run = dew_cli(
            "tokenize", *inputs, tokenizer=bpe, out=out, workers=workers, val_fraction=0.2
        )
        assert run.returncode == 0, run.stderr
        folders[workers] = {
            n: (out / n).read_bytes() for n in ("train.bin", "val.bin", "meta.json")
        }
    assert folders[1] == folders[2]
    assert sorted(sum(folder_documents(tmp_path / "w2").values(), [])) == sorted(docs)


def test_dew_tokenize_refuses_to_overwrite_without_force(bpe, tmp_path, dew_cli):
    inputs = write_inputs(tmp_path, ["one document.", "two documents.", "three."], text_files=1)
    out = tmp_path / "tokens"
    assert dew_cli("tokenize", *inputs, tokenizer=bpe, out=out).returncode == 0
    before = (out / "train.bin").read_bytes()
    refused = dew_cli("tokenize", inputs[0], tokenizer=bpe, out=out)
    assert refused.returncode == 2
    assert f"dew tokenize: --out {out} already exists; give --force" in refused.stderr
    assert (out / "train.bin").read_bytes() == before and read_meta(out).train_tokens > 0
    forced = dew_cli("tokenize", inputs[0], tokenizer=bpe, out=out, force=True, val_fraction=0)
    assert forced.returncode == 0, forced.stderr
    assert folder_documents(out) == {"train": ["one document."], "val": []}
    # --force replaces a token folder only, and never a file.
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "mine.txt").write_text("keep me")
    kept = dew_cli("tokenize", inputs[0], tokenizer=bpe, out=tmp_path / "notes", force=True)
    assert kept.returncode == 2 and "holds files a token folder does not (mine.txt)" in kept.stderr
    assert (tmp_path / "notes" / "mine.txt").read_text() == "keep me"
    assert sorted(os.listdir(tmp_path)) == ["docs.jsonl", "notes", "text", "tokens"]


@pytest.mark.parametrize("existing", [False, True])
def test_a_crash_mid_write_leaves_no_folder_that_loads(
    bpe, tmp_path, dew_cli, monkeypatch, existing
):
    from dew.data import text

    monkeypatch.setattr(text, "CHUNK_BYTES", 50)
    inputs = write_inputs(tmp_path, [f"document number {i}." for i in range(20)], text_files=0)[1:]
    out = tmp_path / "tokens"
    if existing:  # --force over a folder: the old one stays whole until the new one is complete
        write_token_folder(out, [1, 2, 3], [4])
    appended = []
    original = TokenFolderWriter.append

    def crash_on_the_third(self, split, ids, *mask_and_starts):
        appended.append(split)
        if len(appended) == 3:
            raise KeyboardInterrupt("simulated crash")
        original(self, split, ids, *mask_and_starts)

    monkeypatch.setattr(TokenFolderWriter, "append", crash_on_the_third)
    with pytest.raises(KeyboardInterrupt):
        dew_cli("tokenize", *inputs, tokenizer=bpe, out=out, force=True)
    assert len(appended) == 3  # it crashed after writing a chunk
    if existing:
        assert (read_meta(out).train_tokens, read_meta(out).dtype) == (3, "uint8")
    else:
        assert not out.exists()
    assert sorted(os.listdir(tmp_path)) == ["docs.jsonl", "text"] + ["tokens"] * existing

    # A crash as the complete folder is renamed into place: the old folder is back.
    monkeypatch.setattr(TokenFolderWriter, "append", original)
    rename = os.rename

    def crash_on_install(source, target):
        if os.path.basename(source).startswith(".tokens.tmp-"):
            raise KeyboardInterrupt("simulated crash")
        rename(source, target)

    monkeypatch.setattr(text.os, "rename", crash_on_install)
    with pytest.raises(KeyboardInterrupt):
        dew_cli("tokenize", *inputs, tokenizer=bpe, out=out, force=True)
    monkeypatch.setattr(text.os, "rename", rename)
    if existing:
        assert read_meta(out).train_tokens == 3
    else:
        assert not out.exists()
    assert sorted(os.listdir(tmp_path)) == ["docs.jsonl", "text"] + ["tokens"] * existing

    # A process killed outright cleans nothing up: its half-written folder is not at --out.
    monkeypatch.setattr(text.shutil, "rmtree", lambda *a, **k: None)
    monkeypatch.setattr(TokenFolderWriter, "abort", lambda self: None)
    monkeypatch.setattr(TokenFolderWriter, "append", crash_on_the_third)
    appended.clear()
    with pytest.raises(KeyboardInterrupt):
        dew_cli("tokenize", *inputs, tokenizer=bpe, out=out, force=True)
    if existing:
        assert read_meta(out).train_tokens == 3
    else:
        with pytest.raises(FileNotFoundError):
            read_meta(out)
    (left,) = [p for p in tmp_path.iterdir() if p.name.startswith(".tokens.tmp-")]
    with pytest.raises(FileNotFoundError, match="meta.json"):
        read_meta(left)


def test_dew_tokenize_bad_inputs_are_clear_errors(bpe, tmp_path, dew_cli):
    (tmp_path / "a.jsonl").write_text('{"content": "hello"}\n{"text": 3}\n')
    (tmp_path / "b.csv").write_text("x")
    (tmp_path / "c.parquet").write_bytes(b"PAR1")
    out = ("--tokenizer", bpe, "--out", tmp_path / "out")
    cases = [
        ((tmp_path / "a.jsonl",), f"{tmp_path / 'a.jsonl'}:1: no field 'text' (it has 'content')"),
        (
            (tmp_path / "a.jsonl", "--field", "content"),
            f"{tmp_path / 'a.jsonl'}:2: no field 'content'",
        ),
        ((tmp_path / "b.csv",), "unknown kind of input .csv; dew tokenize reads .txt"),
        ((tmp_path / "nothing.txt",), "does not exist"),
        ((tmp_path / "a.jsonl", "--tokenizer", "gpt2"), "unknown tokenizer 'gpt2'"),
        ((tmp_path / "a.jsonl", "--val-fraction", "1"), "--val-fraction must be in [0, 1)"),
    ]
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        cases.append(((tmp_path / "c.parquet",), "needs pyarrow, which is not installed"))
    for args, message in cases:
        given = out if "--tokenizer" not in args else out[2:]  # a flag given twice is refused
        run = dew_cli("tokenize", *given, *args)
        assert run.returncode == 2 and message in run.stderr, (args, run.stderr)
        assert not (tmp_path / "out").exists()


def test_dew_tokenize_parquet(bpe, tmp_path, dew_cli):
    parquet = pytest.importorskip(
        "pyarrow.parquet", reason="pyarrow is not installed (optional; .parquet needs it)"
    )
    import pyarrow

    docs = ["first row.", None, "third row!", ""]
    parquet.write_table(pyarrow.table({"body": docs}), tmp_path / "d.parquet")
    flags = dict(field="body", tokenizer=bpe, out=tmp_path / "out", val_fraction=0)
    run = dew_cli("tokenize", tmp_path / "d.parquet", **flags)
    assert run.returncode == 0, run.stderr
    assert folder_documents(tmp_path / "out") == {"train": ["first row.", "third row!"], "val": []}


# --- dew train --data ---------------------------------------------------------------------------


def test_dew_train_takes_the_vocabulary_from_the_folder(bpe, tmp_path, dew_cli, seed):
    inputs = write_inputs(tmp_path, documents(np.random.default_rng(seed), 60), text_files=0)[1:]
    data = tmp_path / "tokens"
    assert dew_cli("tokenize", *inputs, tokenizer=bpe, out=data).returncode == 0
    vocab = read_meta(data).vocab_size
    assert 256 < vocab <= 384
    tiny = dict(steps=2, log_every=1, batch=8, seq_len=16, layers=1, width=16, heads=2)
    run = dew_cli("train", data=data, run_dir=tmp_path / "run", **tiny)
    assert run.returncode == 0, run.stderr
    assert "step 2: loss" in run.stdout
    index = tmp_path / "run" / "checkpoints" / "step_00000002" / "index.json"
    shapes = {a["path"]: a["shape"] for a in json.loads(index.read_text())["arrays"]}
    # The folder's vocabulary rounded up to a multiple of 128 (the example decoder's 256 would
    # leave ids without an embedding row).
    assert shapes[".params['params']['embed_tokens']['embedding']"] == [384, 16]


def test_dew_train_refuses_a_model_vocabulary_smaller_than_the_folders(tmp_path, dew_cli):
    write_token_folder(tmp_path / "big", [59999] * 40, [], tokenizer="mine", vocab_size=60000)
    run = dew_cli(
        "train", data=tmp_path / "big", model="gpt2-small", run_dir=tmp_path / "run", steps=1
    )
    assert run.returncode == 2
    assert (
        "dew train: model gpt2-small has a vocabulary of 50304, smaller than the vocab_size "
        f"60000 of the token folder '{tmp_path / 'big'}' (tokenizer 'mine')"
    ) in run.stderr


# --- prompt-masked data: --jsonl-fields, --rows ---------------------------------------------------


def folder_masks(path):
    """``{split: (ids, mask)}`` of a token folder with a loss mask, as numpy arrays."""
    from dew.data.folder import open_mask

    meta = read_meta(path)
    assert meta.loss_mask
    return {
        split: (np.asarray(open_tokens(meta, split)), np.asarray(open_mask(meta, split)))
        for split in ("train", "val")
    }


def test_dew_tokenize_prompt_completion_masks_the_prompt(bpe, tmp_path, dew_cli, seed):
    rng = np.random.default_rng(seed)
    pairs = [(doc, answer) for doc, answer in zip(documents(rng, 20), documents(rng, 20))]
    lines = [json.dumps({"q": q, "a": a, "id": i}) for i, (q, a) in enumerate(pairs)]
    lines.append(json.dumps({"q": "no answer", "a": ""}))  # nothing to learn: skipped
    (tmp_path / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "sft"
    run = dew_cli(
        "tokenize",
        tmp_path / "pairs.jsonl",
        tokenizer=bpe,
        out=out,
        val_fraction=0,
        jsonl_fields="q,a",
    )
    assert run.returncode == 0, run.stderr
    assert "Loss mask: train.mask, val.mask; documents packed" in run.stdout
    tokenizer = HFTokenizer(bpe)
    ids, mask = folder_masks(out)["train"]
    expected_ids, expected_mask = [], []
    for prompt, completion in pairs:
        p, c = tokenizer.encode(prompt), tokenizer.encode(completion)
        expected_ids += p + c + [tokenizer.eos_id]
        expected_mask += [0] * len(p) + [1] * (len(c) + 1)  # the end-of-text id counts
    assert ids.tolist() == expected_ids
    assert mask.tolist() == expected_mask
    assert json.loads((out / "meta.json").read_text())["train_documents"] == len(pairs)


def test_dew_tokenize_chat_counts_the_assistant_turns_only(tmp_path, dew_cli):
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi?"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye?"},
        {"role": "assistant", "content": "Bye."},
    ]
    no_assistant = [{"role": "user", "content": "anyone?"}]
    lines = [json.dumps({"messages": chat}), json.dumps({"messages": no_assistant})]
    (tmp_path / "chat.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "chat"
    run = dew_cli(
        "tokenize",
        tmp_path / "chat.jsonl",
        tokenizer="bytes",
        out=out,
        val_fraction=0,
        jsonl_fields="messages",
    )
    assert run.returncode == 0, run.stderr
    ids, mask = folder_masks(out)["train"]
    text = bytes(ids.tolist()).decode()
    assert text == (
        "<|system|>\nBe brief.\n<|user|>\nHi?\n<|assistant|>\nHello.\n<|user|>\nBye?\n"
        "<|assistant|>\nBye.\n"
    )
    counted = bytes(ids[mask == 1].tolist()).decode()
    assert counted == "Hello.\nBye.\n"

    (tmp_path / "bad.jsonl").write_text(json.dumps({"messages": [{"role": "user"}]}) + "\n")
    run = dew_cli(
        "tokenize",
        tmp_path / "bad.jsonl",
        tokenizer="bytes",
        out=tmp_path / "x",
        jsonl_fields="messages",
    )
    assert run.returncode == 2
    assert f"{tmp_path / 'bad.jsonl'}:1: message 0 must be an object with string 'role'" in (
        run.stderr
    )


def test_a_chats_end_of_text_counts_only_after_an_assistant_turn(bpe, tmp_path, dew_cli):
    # With a tokenizer that has an end-of-text id: a chat that ends on the assistant's turn
    # counts the id after it (the model learns to stop), one that ends on the user's does not.
    # The expected ids and mask are written from docs/data.md's template, piece by piece.
    ends_with_assistant = [
        {"role": "user", "content": "the cat?"},
        {"role": "assistant", "content": "sees the moon."},
    ]
    ends_with_user = ends_with_assistant + [{"role": "user", "content": "and the dog?"}]
    lines = [json.dumps({"messages": m}) for m in (ends_with_assistant, ends_with_user)]
    (tmp_path / "chat.jsonl").write_text("\n".join(lines) + "\n")
    run = dew_cli(
        "tokenize",
        tmp_path / "chat.jsonl",
        tokenizer=bpe,
        out=tmp_path / "chat",
        val_fraction=0,
        jsonl_fields="messages",
    )
    assert run.returncode == 0, run.stderr
    tokenizer = HFTokenizer(bpe)
    eos = tokenizer.eos_id
    expected_ids, expected_mask = [], []
    for chat in (ends_with_assistant, ends_with_user):
        for message in chat:
            header = tokenizer.encode(f"<|{message['role']}|>\n")
            content = tokenizer.encode(message["content"] + "\n")
            counts = int(message["role"] == "assistant")
            expected_ids += header + content
            expected_mask += [0] * len(header) + [counts] * len(content)
        expected_ids.append(eos)
        expected_mask.append(int(chat[-1]["role"] == "assistant"))
    ids, mask = folder_masks(tmp_path / "chat")["train"]
    assert ids.tolist() == expected_ids
    assert mask.tolist() == expected_mask
    ends = np.flatnonzero(ids == eos)
    assert len(ends) == 2 and mask[ends].tolist() == [1, 0]


def test_dew_tokenize_rows_pad_keeps_each_document_to_its_own_rows(bpe, tmp_path, dew_cli, seed):
    from dew.data import Loading, TokenWindows

    seq = 8
    rng = np.random.default_rng(seed)
    pairs = list(zip(documents(rng, 12), documents(rng, 12)))
    pairs[3] = ("", pairs[3][1])  # no prompt: the first token still never counts
    lines = [json.dumps({"prompt": p, "completion": c}) for p, c in pairs]
    (tmp_path / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "padded"
    run = dew_cli(
        "tokenize",
        tmp_path / "pairs.jsonl",
        tokenizer=bpe,
        out=out,
        val_fraction=0,
        jsonl_fields="prompt,completion",
        rows="pad",
        seq_len=seq,
    )
    assert run.returncode == 0, run.stderr
    assert f"documents padded to rows of {seq}" in run.stdout
    assert read_meta(out).pad_seq_len == seq
    tokenizer = HFTokenizer(bpe)
    ids, mask = folder_masks(out)["train"]
    records = TokenWindows(out, seq_len=seq, loading=Loading(threads=0)).load(batch=1).records
    # The windows by the folder format's rule: window w = tokens[w * seq : w * seq + seq + 1].
    rows = np.stack([np.stack([ids, mask])[:, w * seq : w * seq + seq + 1] for w in range(records)])
    # Walk the rows in file order: each document's tokens start a row, fill whole rows, and
    # the inputs of a row never hold two documents.
    row = 0
    for prompt, completion in pairs:
        p, c = tokenizer.encode(prompt), tokenizer.encode(completion)
        document = p + c + [tokenizer.eos_id]
        used = -(-len(document) // seq)
        inputs = np.concatenate([rows[row + k, 0, :seq] for k in range(used)])
        assert inputs[: len(document)].tolist() == document
        assert (inputs[len(document) :] == tokenizer.eos_id).all()  # padding
        targets = np.concatenate([rows[row + k, 0, 1:] for k in range(used)])
        weights = np.concatenate([rows[row + k, 1, 1:] for k in range(used)])
        counted = (c if p else c[1:]) + [tokenizer.eos_id]  # the row before would predict c[0]
        assert targets[weights == 1].tolist() == counted
        row += used
    assert row == records

    with pytest.raises(ValueError, match=f"padded for seq_len {seq}.*seq_len {2 * seq}"):
        TokenWindows(out, seq_len=2 * seq).load(batch=1)


def test_dew_tokenize_mask_flags_that_do_not_go_together_are_errors(tmp_path, dew_cli):
    (tmp_path / "a.jsonl").write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    base = ("tokenize", tmp_path / "a.jsonl", "--tokenizer", "bytes", "--out", tmp_path / "out")
    cases = [
        (("--rows", "pad"), "--rows pad needs --seq-len S"),
        (("--seq-len", "8"), "--seq-len 8 is for --rows pad only"),
        (("--jsonl-fields", "a,b,c"), "--jsonl-fields takes PROMPT,COMPLETION or MESSAGES"),
        (("--jsonl-fields", "prompt,answer"), "no field 'answer'"),
    ]
    for args, message in cases:
        run = dew_cli(*base, *args)
        assert run.returncode == 2 and message in run.stderr, (args, run.stderr)
        assert not (tmp_path / "out").exists()


# --- dew tokenize --tokenizer bpe:VOCAB: a tokenizer trained on the inputs ----------------------


def rich_documents(rng, count):
    """``count`` documents of 5 to 40 words from a lexicon of 80 random words of 2 to 8 letters,
    some of them non-ASCII (2, 3 and 4 UTF-8 bytes): hundreds of pairs for BPE to merge, many of
    them tied in count."""
    letters = list("abcdefghijklmnopqrstuvwxyz") + ["é", "ü", "ß", "日", "本", "🙂"]
    lexicon = ["".join(rng.choice(letters, size=int(rng.integers(2, 9)))) for _ in range(80)]
    return [
        " ".join(rng.choice(lexicon, size=int(rng.integers(5, 40))))
        + rng.choice([".", ".\n", "!\n\n"])
        for _ in range(count)
    ]


def test_dew_tokenize_trains_a_byte_level_bpe_that_round_trips(tmp_path, dew_cli, seed):
    docs = rich_documents(np.random.default_rng(seed), 60)
    docs[3] = "  indented:\n\tcode = 'naïve'  # ✓ 日本語 🙂\r\n"  # whitespace kept exactly
    inputs = write_inputs(tmp_path, docs)
    out = tmp_path / "tokens"
    flags = dict(val_fraction=0.25, seed=seed)
    run = dew_cli("tokenize", *inputs, tokenizer="bpe:400", out=out, **flags)
    assert run.returncode == 0, run.stderr
    meta = read_meta(out)
    own = out / "tokenizer.json"
    library = tokenizers.Tokenizer.from_file(str(own))
    assert library.get_vocab_size() == meta.vocab_size == 400
    (special,) = json.loads(own.read_text())["added_tokens"]
    assert (special["content"], special["special"], special["id"]) == (EOS, True, meta.eos_id)
    # meta.json names the folder's own tokenizer.json, which read_meta gives as its path.
    assert json.loads((out / "meta.json").read_text())["tokenizer"] == "tokenizer.json"
    assert meta.tokenizer == str(own.resolve())
    split = folder_documents(out)  # every document ends with eos_id; decoded by tokenizer_for
    assert sorted(split["train"] + split["val"]) == sorted(docs)
    assert split["train"] and split["val"]
    assert (
        f"Trained {own}: a byte-level BPE of 400 tokens on {_documents(len(split['train']))}, in "
    ) in run.stdout
    # Merged: fewer tokens than bytes; any text at all round-trips, not only the inputs'.
    tokenizer = HFTokenizer(own)
    assert meta.train_tokens < 0.6 * sum(len(d.encode()) for d in split["train"])
    text = "".join(map(chr, np.random.default_rng(seed).integers(1, 0x2FFF, 200)))
    assert tokenizer.decode(tokenizer.encode(text)) == text

    # The same ids as the trained tokenizer.json given as --tokenizer (its folder) writes.
    again = tmp_path / "again"
    assert dew_cli("tokenize", *inputs, tokenizer=out, out=again, **flags).returncode == 0
    for name in ("train.bin", "val.bin", "train.docs", "val.docs"):
        assert (again / name).read_bytes() == (out / name).read_bytes(), name

    # The folder moves with its tokenizer; tokenized again in place (--force), it keeps it.
    moved = tmp_path / "moved"
    os.rename(out, moved)
    assert read_meta(moved).tokenizer == str((moved / "tokenizer.json").resolve())
    before = (moved / "tokenizer.json").read_bytes()
    run = dew_cli("tokenize", *inputs, tokenizer=moved, out=moved, force=True, **flags)
    assert run.returncode == 0, run.stderr
    assert (moved / "tokenizer.json").read_bytes() == before
    assert (moved / "train.bin").read_bytes() == (again / "train.bin").read_bytes()
    assert read_meta(moved).tokenizer == str((moved / "tokenizer.json").resolve())
    os.remove(moved / "tokenizer.json")
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json, which its meta.json"):
        read_meta(moved)


def test_bpe_stops_early_when_the_train_documents_run_out_of_pairs(tmp_path, dew_cli):
    # Every document is the one word "abcdé" (6 UTF-8 bytes): 5 merges make it one token, and
    # then no pair is left, so the vocabulary is 256 bytes + <|endoftext|> + 5, not the 300 asked.
    (tmp_path / "in").mkdir()
    for i in range(6):
        (tmp_path / "in" / f"{i}.txt").write_text("abcdé", encoding="utf-8")
    out = tmp_path / "tokens"
    run = dew_cli("tokenize", tmp_path / "in", tokenizer="bpe:300", out=out, val_fraction=0)
    assert run.returncode == 0, run.stderr
    meta = read_meta(out)
    assert len("abcdé".encode()) == 6 and meta.vocab_size == 256 + 1 + 5
    assert (
        "a byte-level BPE of 262 tokens (asked 300: the train documents ran out of pairs to "
        "merge) on 6 documents"
    ) in run.stdout
    (word,) = HFTokenizer(out).encode("abcdé")
    assert open_tokens(meta, "train").tolist() == [word, meta.eos_id] * 6


def test_the_validation_documents_do_not_shape_the_bpe(tmp_path, dew_cli, seed):
    # The split by its documented rule, drawn here: document i goes to val.bin when the i-th
    # np.random.default_rng(seed).random() < 0.3. " quokka" fills the val documents only, whose
    # text must not reach the trainer: its bytes stay unmerged. " giraffe", as frequent in the
    # train documents, becomes one token. Training on val too merges " quokka" (4x the count of
    # any other word there) into one token as well.
    count, fraction = 40, 0.3
    draws = np.random.default_rng(seed).random(count)
    to_val = draws < fraction
    assert 0 < to_val.sum() < count
    rng = np.random.default_rng(seed + 1)
    docs = [
        (" quokka" * 20 if val else " giraffe" * 10) + " " + documents(rng, 1)[0] for val in to_val
    ]
    inputs = write_inputs(tmp_path, docs, text_files=7)
    out = tmp_path / "tokens"
    flags = dict(val_fraction=fraction, seed=seed)
    run = dew_cli("tokenize", *inputs, tokenizer="bpe:300", out=out, **flags)
    assert run.returncode == 0, run.stderr
    split = folder_documents(out)
    assert split == {
        "train": [d for d, val in zip(docs, to_val) if not val],
        "val": [d for d, val in zip(docs, to_val) if val],
    }
    tokenizer = HFTokenizer(out)
    assert len(tokenizer.encode(" giraffe")) == 1
    assert len(tokenizer.encode(" quokka")) == len(b" quokka")  # one token a byte


def test_the_trained_tokenizer_json_is_the_same_every_time(tmp_path, dew_cli, seed):
    # Once in this process and once in a fresh one (another hash seed: the trainer counts words
    # in hash maps), on a corpus with many pairs tied in count.
    docs = rich_documents(np.random.default_rng(seed), 80)
    inputs = write_inputs(tmp_path, docs, text_files=20)
    flags = ["--tokenizer", "bpe:500", "--val-fraction", "0.1", "--seed", str(seed)]
    run = dew_cli("tokenize", *inputs, *flags, "--out", tmp_path / "a")
    assert run.returncode == 0, run.stderr
    fresh = subprocess.run(
        [sys.executable, "-m", "dew.cli.main", "tokenize", *map(str, inputs), *flags]
        + ["--out", str(tmp_path / "b")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONHASHSEED": "random"},
    )
    assert fresh.returncode == 0, fresh.stderr
    for name in ("tokenizer.json", "train.bin", "val.bin", "meta.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert read_meta(tmp_path / "a").vocab_size == 500


def test_dew_train_and_generate_use_the_folders_trained_tokenizer(tmp_path, dew_cli, seed):
    from dew.cli.evaluate import train_tokenizer

    inputs = write_inputs(tmp_path, rich_documents(np.random.default_rng(seed), 60))
    data = tmp_path / "tokens"
    # 384: a multiple of 128, so the model has no rows past the tokenizer's ids to generate.
    assert dew_cli("tokenize", *inputs, tokenizer="bpe:384", out=data).returncode == 0
    tiny = dict(steps=2, log_every=1, batch=8, seq_len=16, layers=1, width=16, heads=2)
    run = dew_cli("train", data=data, run_dir=tmp_path / "run", **tiny)
    assert run.returncode == 0, run.stderr
    checkpoints = tmp_path / "run" / "checkpoints"
    index = json.loads((checkpoints / "step_00000002" / "index.json").read_text())
    shapes = {a["path"]: a["shape"] for a in index["arrays"]}
    assert shapes[".params['params']['embed_tokens']['embedding']"] == [384, 16]
    kept = checkpoints / "tokenizer" / "tokenizer.json"
    assert kept.read_bytes() == (data / "tokenizer.json").read_bytes()
    assert train_tokenizer(data, tmp_path / "run")[1] == kept  # dew train --eval-tasks's
    out = tmp_path / "out.jsonl"
    run = dew_cli("generate", tmp_path / "run", prompt="the", max_new_tokens=6, output=out)
    assert run.returncode == 0, run.stderr
    record = json.loads(out.read_text())
    ids = record["completion_ids"]
    assert ids and record["completion"] == HFTokenizer(data).decode(ids)


def test_bpe_vocabulary_and_flags_refused_before_reading(tmp_path, dew_cli, monkeypatch):
    # The input does not exist: each refusal comes before anything is read.
    base = ("tokenize", tmp_path / "missing.txt", "--out", tmp_path / "out")
    low = "VOCAB must be an integer from 257 (the 256 byte tokens and <|endoftext|>)"
    cases = [
        (("--tokenizer", "bpe:256"), f"--tokenizer bpe:256: {low} to 4294967296, got '256'"),
        (("--tokenizer", "bpe:abc"), f"--tokenizer bpe:abc: {low}"),
        (("--tokenizer", "bpe:"), f"--tokenizer bpe:: {low}"),
        (("--tokenizer", "bpe:-300"), f"--tokenizer bpe:-300: {low}"),
        (("--tokenizer", "bpe:3e3"), f"--tokenizer bpe:3e3: {low}"),
        (("--tokenizer", "bpe:300", "--eos", "</s>"), "--eos </s> does not apply to --tokenizer"),
    ]
    for args, message in cases:
        run = dew_cli(*base, *args)
        assert run.returncode == 2 and message in run.stderr, (args, run.stderr)
    # An unknown name (read after the inputs are listed) is told of bpe:VOCAB.
    (tmp_path / "a.txt").write_text("text")
    run = dew_cli("tokenize", tmp_path / "a.txt", tokenizer="gpt2", out=tmp_path / "out")
    assert run.returncode == 2
    assert "unknown tokenizer 'gpt2': give 'byte' or 'bytes', 'bpe:VOCAB' (train a" in run.stderr
    with pytest.raises(ValueError, match="tokenizer bpe:12: VOCAB must be"):
        from dew.data import tokenize_files

        tokenize_files([tmp_path / "missing.txt"], tmp_path / "out", tokenizer="bpe:12")
    # Without the text extra: the one-line error naming it, before the inputs are looked at.
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    run = dew_cli(*base, "--tokenizer", "bpe:300")
    assert run.returncode == 2 and "pip install -e '.[text]'" in run.stderr, run.stderr
    assert len(run.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
