"""``dew train --init-from`` a Hugging Face folder and back out by ``dew convert --to hf``: the
export's ``config.json`` is the folder's model (its context kept, or lengthened only by
``--extend-context``) with the folder's special tokens' ids, the tokenizer the run's token folder
was written with travels into the export (its end-of-text id too, where the folder gives none),
and ``dew.load_checkpoint`` gives the trained model and weights back in Python.

The run takes one step at a learning rate of 1e-3, so that its steps differ: step 0 is the
folder's weights (compared with transformers' logits, tests/data/hf, scripts/make_hf_reference.py)
and step 1 is one AdamW step on from them, which moves each weight by the learning rate.
"""

import json
from pathlib import Path

import jax
import numpy as np
import pytest

import dew
from dew.cli import convert
from dew.data import write_token_folder
from dew.models import hf
from tests.helpers import relative_error

TIED = Path(__file__).resolve().parent / "data" / "hf" / "llama3_tied"
LR = 1e-3
TRAIN = ("--steps", "1", "--lr", str(LR), "--mesh", "fsdp=8", "--batch", "8")


def exported_model(folder):
    """The model a folder's ``config.json`` describes, and its context as written."""
    config = hf.read_config(folder)
    return hf.model_from_config(config, str(folder)), config["max_position_embeddings"]


def special_ids(folder) -> dict:
    """``bos_token_id`` and ``eos_token_id`` of a folder's ``config.json``, where it has them."""
    config = hf.read_config(folder)
    return {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}


def test_init_from_keeps_the_folders_model_and_tokenizer_and_loads_back(dew_here, tmp_path):
    run = dew_here(
        *("tokenize", "text.txt", "--tokenizer", str(TIED), "--out", "tokens"),
        *("--eos", "~", "--val-fraction", "0"),
        cwd=_with_text(tmp_path),
    )
    assert run.returncode == 0, run.stderr
    run = dew_here(
        *("train", "--init-from", str(TIED), "--data", "tokens", "--run-dir", "run"),
        *TRAIN,
        *("--seq-len", "16"),
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr
    run = dew_here("convert", "run", "out", "--to", "hf", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "tokenizer.json" in run.stdout and "No tokenizer" not in run.stdout
    assert "config.json carries bos_token_id 1, eos_token_id 2, as run records" in run.stdout

    # config.json: the folder's model, its context (64) kept although the rows were 16 tokens.
    model, context = exported_model(tmp_path / "out")
    want, want_context = exported_model(TIED)
    assert context == want_context == 64
    assert model == want
    # The folder's special tokens' ids, not the end-of-text id the tokens were written with ("~").
    assert json.loads((tmp_path / "tokens" / "meta.json").read_text())["eos_id"] != 2
    assert (
        special_ids(tmp_path / "out") == special_ids(TIED) == {"bos_token_id": 1, "eos_token_id": 2}
    )
    # The tokenizer the tokens were written with, byte for byte.
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (
        TIED / "tokenizer.json"
    ).read_bytes()

    # dew.load_checkpoint, on one device. Step 0 (named, from the checkpoint directory itself):
    # the folder's weights, transformers' logits.
    model, at_zero = dew.load_checkpoint(tmp_path / "run" / "checkpoints", step=0)
    assert hf.architecture(model) == hf.architecture(want) and model.max_seq_len == 64
    tokens, logits = np.load(TIED / "tokens.npy"), np.load(TIED / "logits.npy")
    error = relative_error(np.asarray(jax.jit(model.apply)(at_zero, tokens)), logits)
    assert error < 1e-5, error
    # The run directory's latest step, step 1 (also by number): one AdamW step from step 0. Its
    # bias-corrected moments make the step lr x g / |g| per weight, plus lr x 0.1 x w where the
    # weight decays, and 0 where the gradient is (embedding rows of tokens not in the batch).
    _, latest = dew.load_checkpoint(tmp_path / "run")
    _, at_one = dew.load_checkpoint(tmp_path / "run", step=1)
    assert relative_error(at_one, latest) == 0.0
    for before, after in zip(jax.tree_util.tree_leaves(at_zero), jax.tree_util.tree_leaves(latest)):
        before, after = np.asarray(before, np.float64), np.asarray(after, np.float64)
        moved = np.abs(after - before)
        largest = np.abs(before).max()
        assert np.median(moved[moved > 0]) == pytest.approx(LR, rel=1e-2), moved
        assert moved.max() <= LR * (1 + 0.1 * largest) + 2 * np.spacing(np.float32(largest))
    with pytest.raises(ValueError, match=r"has no step 7; its steps are 0, 1"):
        dew.load_checkpoint(tmp_path / "run", step=7)


def test_a_seq_len_up_to_the_context_needs_no_extend_context(capsys):
    # TIED's context is 64 tokens: rows of 64 train as the folder's model, 65 are refused.
    from dew.cli.main import build_parser

    model, _ = exported_model(TIED)
    for seq_len in (16, 64):
        args = build_parser().parse_args(
            ["train", "--init-from", str(TIED), "--seq-len", str(seq_len)]
        )
        trained = convert.init_model(args, model, TIED, data_vocab=256)
        assert trained.max_seq_len == 64 and hf.architecture(trained) == hf.architecture(model)
    assert "--extend-context" not in capsys.readouterr().out
    args = build_parser().parse_args(["train", "--init-from", str(TIED), "--seq-len", "65"])
    with pytest.raises(ValueError, match="--seq-len 65 is above the context of .*, 64 tokens"):
        convert.init_model(args, model, TIED, data_vocab=256)


def test_extend_context_lengthens_it_and_says_so(dew_here, tmp_path):
    # Without --extend-context the longer rows are refused (tests/test_cli_errors.py); with it
    # the context becomes --seq-len, in the model and the export. The example corpus is bytes:
    # the export says it has no tokenizer files.
    run = dew_here(
        *("train", "--init-from", str(TIED), "--run-dir", "run", "--extend-context"),
        *TRAIN,
        *("--seq-len", "96"),
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr
    assert "--extend-context: the context goes from 64 to 96 tokens" in run.stdout
    run = dew_here("convert", "run/checkpoints", "out", "--to", "hf", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "No tokenizer files" in run.stdout
    assert not (tmp_path / "out" / "tokenizer.json").exists()
    model, context = exported_model(tmp_path / "out")
    assert context == 96
    want, _ = exported_model(TIED)
    assert hf.architecture(model) == hf.architecture(want)
    assert special_ids(tmp_path / "out") == special_ids(TIED)
    assert (
        json.loads((tmp_path / "out" / "config.json").read_text())["rope_scaling"][
            "original_max_position_embeddings"
        ]
        == 32
    )  # the rotary frequencies as they were


def _with_text(folder):
    (folder / "text.txt").write_text("A few words for a tiny Llama to read. " * 100)
    return folder


def weights_alone(source, folder, *, ids: bool, pad_token_id=None):
    """``folder``: ``source``'s config.json (less its special tokens' ids unless ``ids``; with
    ``pad_token_id`` where given) and weights, without its tokenizer (so that a run's tokenizer
    is the one kept)."""
    folder.mkdir()
    config = hf.read_config(source)
    if not ids:
        del config["bos_token_id"], config["eos_token_id"]
    if pad_token_id is not None:
        config["pad_token_id"] = pad_token_id
    (folder / hf.CONFIG).write_text(json.dumps(config))
    (folder / hf.SINGLE).write_bytes((source / hf.SINGLE).read_bytes())
    return folder


def test_the_export_takes_the_tokenizers_end_of_text_id_where_the_folder_gives_none(
    dew_here, tmp_path
):
    # TIED without its special tokens' ids, converted: its checkpoint records none, and its
    # export says so.
    convert.to_checkpoint(weights_alone(TIED, tmp_path / "no_ids", ids=False), tmp_path / "ckpt")
    run = dew_here("convert", "ckpt", "bare", "--to", "hf", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert special_ids(tmp_path / "bare") == {}
    assert "config.json has no bos_token_id or eos_token_id: ckpt records none" in run.stdout

    # A token folder written with TIED's tokenizer.json and end-of-text id 7: a run on it keeps
    # the tokenizer, and its id becomes the export's eos_token_id (no bos_token_id: none known).
    tokens = tmp_path / "tokens"
    tokenizer = str(TIED / "tokenizer.json")
    write_token_folder(tokens, [3, 7] * 8, [3, 7], tokenizer=tokenizer, eos_id=7)
    assert convert.keep_tokenizer(tmp_path / "ckpt", tokens) == ["tokenizer.json"]
    run = dew_here("convert", "ckpt", "out", "--to", "hf", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert special_ids(tmp_path / "out") == {"eos_token_id": 7}
    assert "config.json has no bos_token_id: ckpt records none" in run.stdout

    # Where the folder gives an eos_token_id, the tokenizer's gives way to it. The folder's
    # pad_token_id (null in TIED's own config.json) travels too.
    folder = weights_alone(TIED, tmp_path / "ids", ids=True, pad_token_id=0)
    convert.to_checkpoint(folder, tmp_path / "tied_ckpt")
    assert convert.keep_tokenizer(tmp_path / "tied_ckpt", tokens) == ["tokenizer.json"]
    # What dew train --init-from this checkpoint would keep: the folder's ids.
    assert convert.source_carried(tmp_path / "tied_ckpt") == {
        **special_ids(TIED),
        "pad_token_id": 0,
    }
    run = dew_here("convert", "tied_ckpt", "tied_out", "--to", "hf", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert special_ids(tmp_path / "tied_out") == special_ids(TIED)
    assert hf.read_config(tmp_path / "tied_out")["pad_token_id"] == 0
    assert "config.json carries bos_token_id 1, eos_token_id 2, pad_token_id 0" in run.stdout
    assert "config.json has no" not in run.stdout
