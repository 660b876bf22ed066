"""Bad input gets a clear error naming the values, before anything compiles."""

import json

import jax
import numpy as np
import optax
import pytest

import dew
from dew.data import TokenWindows, write_token_folder
from dew.objectives.lm import LMObjective
from tests.helpers import SEQ, tiny_objective


@pytest.fixture
def folder(tmp_path):
    rng = np.random.default_rng(0)
    write_token_folder(
        tmp_path / "tokens", rng.integers(0, 64, 4000), rng.integers(0, 64, 400), vocab_size=64
    )
    return tmp_path / "tokens"


def trainer(**kwargs):
    kwargs.setdefault("mesh", dew.MeshSpec(fsdp=8))
    return dew.Trainer(tiny_objective(), optax.sgd(0.1), jax.random.key(0), **kwargs)


def refuse_compiling(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("compiled before checking the input")

    monkeypatch.setattr(jax, "jit", boom)


def test_batch_that_does_not_split(folder, monkeypatch):
    data = TokenWindows(folder, seq_len=SEQ).load(batch=12)
    t = trainer()
    refuse_compiling(monkeypatch)
    with pytest.raises(
        ValueError, match=r"batch 12 does not split evenly over 8 devices \(data 1 x fsdp 8\)"
    ):
        t.fit(data, steps=1)


def test_batch_that_does_not_split_into_microbatches(folder, monkeypatch):
    data = TokenWindows(folder, seq_len=SEQ).load(batch=16)
    t = trainer(mesh=dew.MeshSpec(fsdp=4), accumulation=4)
    refuse_compiling(monkeypatch)
    with pytest.raises(
        ValueError,
        match=r"batch 16 over 8 devices \(data 2 x fsdp 4\) leaves 2 rows per "
        r"device, which do not split into accumulation 4 microbatches",
    ):
        t.fit(data, steps=1)


def test_data_seq_len_not_the_objectives(folder):
    data = TokenWindows(folder, seq_len=8).load(batch=16)
    with pytest.raises(ValueError, match="the data's seq_len 8 is not the objective's seq_len 16"):
        trainer().fit(data, steps=1)


def test_unknown_model_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown model 'gpt5'; available: causal_transformer"):
        dew.models.build("gpt5", vocab_size=10)
    assert "causal_transformer" in dew.models.available()


SMALL_MODEL = dict(vocab_size=64, emb_features=32, num_layers=1, num_heads=4, max_seq_len=16)


def test_seq_len_above_max_seq_len():
    model = dew.models.build("causal_transformer", **SMALL_MODEL)
    with pytest.raises(ValueError, match="seq_len 32 is above the model's max_seq_len 16"):
        LMObjective(model, 32)


@pytest.mark.parametrize("field", ["dtype", "param_dtype"])
def test_unknown_dtype(field):
    with pytest.raises(
        ValueError, match="unknown dtype 'float13'; expected one of float32, bfloat16"
    ):
        dew.models.build("causal_transformer", **SMALL_MODEL, **{field: "float13"})


@pytest.mark.parametrize(
    "config, message",
    [
        (dict(num_heads=5), "emb_features 32 does not split over num_heads 5"),
        (dict(num_kv_heads=3), "num_heads 4 is not a multiple of num_kv_heads 3"),
        (dict(num_layers=0), "num_layers must be an integer >= 1, got 0"),
        (
            dict(attention_impl="flash"),
            "unknown attention_impl 'flash'; expected one of xla, pallas",
        ),
    ],
)
def test_bad_model_config(config, message):
    with pytest.raises(ValueError, match=message):
        dew.models.build("causal_transformer", **{**SMALL_MODEL, **config})


def test_missing_token_folder_and_meta(tmp_path, folder):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        TokenWindows(tmp_path / "nowhere", seq_len=SEQ).load(batch=8)
    (folder / "meta.json").unlink()
    with pytest.raises(FileNotFoundError, match="meta.json"):
        TokenWindows(folder, seq_len=SEQ).load(batch=8)


def test_meta_that_disagrees_with_train_bin(folder):
    meta = json.loads((folder / "meta.json").read_text())
    meta["train_tokens"] += 5
    (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(
        ValueError,
        match=f"{meta['train_tokens']}.*{meta['train_tokens'] - 5}|"
        f"{meta['train_tokens'] - 5}.*{meta['train_tokens']}",
    ):
        TokenWindows(folder, seq_len=SEQ).load(batch=8)


def test_a_stage_axis_without_microbatches(monkeypatch):
    # Every axis is split by the step now; a pipeline must say how many microbatches it runs.
    refuse_compiling(monkeypatch)
    with pytest.raises(
        ValueError,
        match=r"MeshSpec\(stage=4\) needs microbatches=M \(M >= 4\): .* 3/7 at M = 4, "
        r"3/11 at M = 8, 3/19 at M = 16",
    ):
        trainer(mesh=dew.MeshSpec(stage=4))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(accumulation=0), "accumulation must be an integer >= 1, got 0"),
        (dict(engine="pjit"), "unknown engine 'pjit'; expected one of shard_map, gspmd"),
    ],
)
def test_bad_trainer_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        trainer(**kwargs)


def test_bad_fit_arguments(folder):
    data = TokenWindows(folder, seq_len=SEQ).load(batch=8)
    with pytest.raises(ValueError, match="checkpoint_every needs a Trainer built with checkpoints"):
        trainer().fit(data, steps=1, checkpoint_every=5)
    with pytest.raises(ValueError, match="log_every must be an integer >= 1, got 0"):
        trainer().fit(data, steps=1, log_every=0)
