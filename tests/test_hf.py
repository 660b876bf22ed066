"""Hugging Face Llama checkpoints in and out (dew.models.hf), held to transformers' own model.

tests/data/hf/ holds two small random ``LlamaForCausalLM`` written by transformers'
``save_pretrained`` (scripts/make_hf_reference.py: torch 2.13.0, transformers 5.25.0) with their
float32 logits on fixed rows of 40 tokens, longer than their ``original_max_position_embeddings``
(32 and 16), so Llama 3's frequency scaling shapes them. Nothing here imports torch: the logits
are the reference.
"""

import dataclasses
import json
import math
import shutil
import struct
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import dew
from dew.models import hf, safetensors
from dew.models.presets import PRESETS
from dew.nn import rotary
from dew.objectives.lm import LMObjective
from tests.equivalence import layout_logits
from tests.helpers import relative_error

DATA = Path(__file__).resolve().parent / "data" / "hf"
MODELS = ("llama3_tied", "llama3_untied")
TOL = 1e-5
M = dew.MeshSpec
LAYOUTS = {
    "one_device": M(),
    "fsdp8": M(fsdp=8),
    "fsdp2_tensor4": M(fsdp=2, tensor=4),
    "sequence4": M(sequence=4),
}


def reference(name):
    folder = DATA / name
    return folder, np.load(folder / "tokens.npy"), np.load(folder / "logits.npy")


# --- Llama 3's rotary frequencies and the presets ------------------------------------------------


def llama3_frequencies(head_dim, theta, factor, low, high, original):
    """Llama 3's scaled inverse frequencies, written from Meta's formula
    (``apply_scaling`` in llama-models, ``_compute_llama3_parameters`` in transformers), one pair
    at a time in float64."""
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / theta ** (i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:  # high frequencies: kept
            out.append(freq)
        elif wavelen > original / low:  # low frequencies: stretched by factor
            out.append(freq / factor)
        else:  # between: interpolated
            smooth = (original / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(out)


@pytest.mark.parametrize(
    "head_dim, theta, factor, original",
    [(16, 10000.0, 8.0, 32), (128, 500000.0, 32.0, 8192), (64, 500000.0, 8.0, 8192)],
)
def test_llama3_frequencies_follow_the_formula(head_dim, theta, factor, original):
    scaling = rotary.Llama3Scaling(factor, 1.0, 4.0, original)
    got = np.asarray(rotary.frequencies(head_dim, theta, scaling))
    want = llama3_frequencies(head_dim, theta, factor, 1.0, 4.0, original)
    np.testing.assert_allclose(got, want, rtol=2e-6)
    plain = theta ** (-np.arange(head_dim // 2) / (head_dim // 2))
    # Every band shows: some pairs kept, some stretched by the whole factor, some between.
    ratio = plain / want
    assert np.any(np.isclose(ratio, 1)) and np.any(np.isclose(ratio, factor))
    assert np.any((ratio > 1.01) & (ratio < factor * 0.99))


# The published config.json of each model (huggingface.co/meta-llama/<model>/blob/main/config.json):
# rope_theta, rope_scaling (rope_type "llama3") and rms_norm_eps.
PUBLISHED = {
    "llama-3.2-1b": dict(  # meta-llama/Llama-3.2-1B
        rope_theta=500000.0,
        rope_scaling=dict(
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        rms_norm_eps=1e-05,
    ),
    "llama-3.2-3b": dict(  # meta-llama/Llama-3.2-3B
        rope_theta=500000.0,
        rope_scaling=dict(
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        rms_norm_eps=1e-05,
    ),
    "llama-3.1-8b": dict(  # meta-llama/Llama-3.1-8B
        rope_theta=500000.0,
        rope_scaling=dict(
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        rms_norm_eps=1e-05,
    ),
    "llama-3.1-70b": dict(  # meta-llama/Llama-3.1-70B
        rope_theta=500000.0,
        rope_scaling=dict(
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        rms_norm_eps=1e-05,
    ),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_llama_presets_carry_the_published_rope_and_eps(name):
    model = dew.models.build("causal_transformer", **PRESETS[name])
    published = PUBLISHED[name]
    assert model.rope_theta == published["rope_theta"]
    assert model.rope_scaling == rotary.Llama3Scaling(**published["rope_scaling"])
    assert model.rms_norm_eps == published["rms_norm_eps"]


def test_the_example_decoder_keeps_its_rope_and_eps():
    model = dew.models.build(
        "causal_transformer",
        vocab_size=64,
        emb_features=32,
        num_layers=1,
        num_heads=4,
        max_seq_len=8,
    )
    assert (model.rope_theta, model.rope_scaling, model.rms_norm_eps) == (10000.0, None, 1e-6)


# --- Logits against transformers', on every layout ------------------------------------------------


def trainer_for(model, mesh, seq):
    objective = LMObjective(model, seq)
    return dew.Trainer(
        objective, optax.sgd(0.0), jax.random.key(0), mesh=mesh, layout=dew.Layout(min_shard=1)
    )


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", MODELS)
def test_logits_match_transformers(name, layout):
    folder, tokens, want = reference(name)
    model = hf.model_from_config(hf.read_config(folder))
    trainer = trainer_for(model, LAYOUTS[layout], tokens.shape[1])
    loaded, params = hf.load(folder, trainer=trainer)
    assert loaded is model or loaded == model
    rows = np.tile(tokens, (4, 1))  # 8 rows: one per device of fsdp=8
    got = layout_logits(trainer, params, rows)
    for copy in range(4):
        error = relative_error(got[2 * copy : 2 * copy + 2], want)
        assert error < TOL, f"{name} on {layout}: logits differ from transformers' by {error:.3g}"


def test_one_device_load_and_apply():
    folder, tokens, want = reference("llama3_untied")
    model, params = hf.load(folder)
    leaf = params["params"]["layers"]["attn"]["q"]
    assert leaf.dtype == np.float32 and len(leaf.sharding.device_set) == 1
    assert leaf.shape == (2, 64, 4, 16)
    error = relative_error(np.asarray(jax.jit(model.apply)(params, tokens)), want)
    assert error < TOL, error


# --- Export ---------------------------------------------------------------------------------------


def tensors_of(folder):
    """Every tensor of a folder's safetensors files: name -> (dtype name, shape, raw bytes)."""
    out = {}
    for tensor in hf._tensors(Path(folder)).values():
        with open(tensor.path, "rb") as file:
            file.seek(tensor.offset)
            raw = file.read(tensor.nbytes)
        out[tensor.name] = (safetensors.NAMES[tensor.dtype], tensor.shape, raw)
    return out


@pytest.mark.parametrize("name", MODELS)
def test_export_writes_transformers_tensors_back_bit_for_bit(name, tmp_path):
    folder, _, _ = reference(name)
    model, params = hf.load(folder)
    hf.save(model, params, tmp_path / "out")
    assert tensors_of(tmp_path / "out") == tensors_of(folder)
    again, params_again = hf.load(tmp_path / "out")
    assert hf.architecture(again) == hf.architecture(model)
    jax.tree_util.tree_map(np.testing.assert_array_equal, params_again, params)


def special_ids(folder) -> dict:
    """``bos_token_id`` and ``eos_token_id`` of a folder's ``config.json``, where it has them."""
    config = hf.read_config(folder)
    return {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}


def test_a_mistral_folder_keeps_its_sliding_window_both_ways(tmp_path):
    """transformers' MistralForCausalLM of sliding_window 6 loads as Dew's attention_window 6
    and gives transformers' logits at every one of 24 positions (without the window only the
    first 6 agree); written back it is Mistral's config with sliding_window 6, transformers'
    tensors bit for bit; dew convert and --init-from keep the window. A config without the field
    has MistralConfig's default, 4096; null is no window."""
    folder, tokens, want = reference("mistral_window")
    assert tokens.shape == (2, 24)
    model, params = hf.load(folder)
    assert model.attention_window == 6
    error = relative_error(np.asarray(jax.jit(model.apply)(params, tokens)), want)
    assert error < TOL, error
    plain = dataclasses.replace(model, attention_window=None)
    unwindowed = np.asarray(jax.jit(plain.apply)(params, tokens))
    assert relative_error(unwindowed[:, :6], want[:, :6]) < TOL
    assert relative_error(unwindowed, want) > 0.1, "the window changed nothing"
    hf.save(model, params, tmp_path / "out")
    config = hf.read_config(tmp_path / "out")
    theirs = hf.read_config(folder)
    for field in ("model_type", "architectures", "sliding_window", "max_position_embeddings"):
        assert config[field] == theirs[field], field
    assert tensors_of(tmp_path / "out") == tensors_of(folder)
    assert hf.model_from_config({**theirs, "sliding_window": None}).attention_window is None
    del theirs["sliding_window"]
    longer = {**theirs, "max_position_embeddings": 8192}  # a context the default window fits
    assert hf.model_from_config(longer).attention_window == 4096
    # dew convert and dew train --init-from take the folder's window with its weights.
    from dew.cli import convert

    assert convert.init_source(folder)[1].attention_window == 6
    convert.to_checkpoint(folder, tmp_path / "ckpt")
    assert dew.load_checkpoint(tmp_path / "ckpt")[0].attention_window == 6
    # A Llama config's sliding_window is nothing transformers' LlamaForCausalLM reads.
    llama = hf.read_config(DATA / "llama3_tied")
    assert hf.model_from_config({**llama, "sliding_window": 6}).attention_window is None


def test_export_carries_the_special_tokens_ids_given_and_no_other_field(tmp_path):
    folder, _, _ = reference("llama3_tied")
    model, params = hf.load(folder)
    carried = hf.carried_fields(hf.read_config(folder))
    assert carried == {"bos_token_id": 1, "eos_token_id": 2}  # pad_token_id null: left out
    # A pad_token_id that is set (0: a falsy id) is carried like the others.
    with_pad = hf.carried_fields({**hf.read_config(folder), "pad_token_id": 0})
    assert with_pad == {**carried, "pad_token_id": 0}
    hf.save(model, params, tmp_path / "padded", carried=with_pad)
    assert hf.read_config(tmp_path / "padded")["pad_token_id"] == 0
    hf.save(model, params, tmp_path / "out", carried={**carried, "eos_token_id": [2, 5]})
    assert special_ids(tmp_path / "out") == {"bos_token_id": 1, "eos_token_id": [2, 5]}
    hf.save(model, params, tmp_path / "plain")
    assert special_ids(tmp_path / "plain") == {}
    with pytest.raises(ValueError, match="torch_dtype are not among bos_token_id"):
        hf.save(model, params, tmp_path / "refused", carried={"torch_dtype": "bfloat16"})
    with pytest.raises(ValueError, match="config.json: eos_token_id '</s>' is not a token id"):
        hf.carried_fields({"eos_token_id": "</s>"})


def test_export_shards_large_models_with_an_index_and_keeps_bfloat16(tmp_path):
    folder, _, _ = reference("llama3_untied")
    model, params = hf.load(folder, dtype="bfloat16")
    written = hf.save(model, params, tmp_path / "out", max_shard_bytes=40_000)
    assert hf.INDEX in written and len([w for w in written if w.startswith("model-")]) > 2
    index = json.loads((tmp_path / "out" / hf.INDEX).read_text())
    assert set(index["weight_map"]) == set(tensors_of(folder))
    dtypes = {dtype for dtype, _, _ in tensors_of(tmp_path / "out").values()}
    assert dtypes == {"BF16"}
    _, again = hf.load(tmp_path / "out", dtype="bfloat16")
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_array_equal(
            np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16)
        ),
        again,
        params,
    )


def test_export_refuses_to_overwrite(tmp_path):
    folder, _, _ = reference("llama3_tied")
    model, params = hf.load(folder)
    hf.save(model, params, tmp_path / "out")
    with pytest.raises(FileExistsError, match="config.json"):
        hf.save(model, params, tmp_path / "out")


# --- Bad input: a ValueError naming it, before any params ----------------------------------------


def copy_of(name, tmp_path):
    target = tmp_path / name
    shutil.copytree(DATA / name, target)
    return target


def edit_config(folder, **changes):
    config = json.loads((folder / hf.CONFIG).read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (folder / hf.CONFIG).write_text(json.dumps(config))


MISTRAL = {"model_type": "mistral", "architectures": ["MistralForCausalLM"]}


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"model_type": "qwen2"}, "model_type"),
        ({"model_type": "mistral"}, "architectures .* has no MistralForCausalLM"),
        (MISTRAL | {"sliding_window": 0}, "sliding_window 0 is not a number of keys"),
        ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "yarn"),
        ({"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 2.0}}, "linear"),
        ({"head_dim": 32}, "head_dim"),
        ({"hidden_size": None}, "hidden_size"),
    ],
)
def test_a_config_dew_cannot_run_is_refused_naming_the_field(changes, named, tmp_path):
    folder = copy_of("llama3_tied", tmp_path)
    edit_config(folder, **changes)
    with pytest.raises(ValueError, match=named):
        hf.load(folder)


def test_the_published_config_spelling_loads(tmp_path):
    """Meta's files spell the rope as rope_theta and rope_scaling (transformers 4)."""
    folder = copy_of("llama3_untied", tmp_path)
    config = json.loads((folder / hf.CONFIG).read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    (folder / hf.CONFIG).write_text(json.dumps(config))
    model = hf.model_from_config(hf.read_config(folder))
    assert model.rope_theta == 500000.0 and model.rope_scaling.factor == 32.0


def rewrite(folder, change):
    """Rewrites folder's model.safetensors with ``change(tensors)`` applied to its dict of
    name -> numpy array."""
    header = safetensors.Header.read(folder / hf.SINGLE)
    arrays = {
        name: safetensors.read_block(t, (0, t.shape[0])) for name, t in header.tensors.items()
    }
    change(arrays)
    entries = [(n, a.dtype, a.shape, lambda a=a: a) for n, a in arrays.items()]
    safetensors.write(folder / hf.SINGLE, entries)


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
            "missing model.layers.1.mlp.up_proj",
        ),
        (
            lambda t: t.update({"lm_head.weight": np.zeros((256, 64), np.float32)}),
            "unexpected lm_head",
        ),
        (
            lambda t: t.update({"model.norm.weight": np.zeros(32, np.float32)}),
            r"model.norm.weight has shape \[32\]",
        ),
    ],
    ids=["missing", "extra", "shape"],
)
def test_bad_tensors_are_refused(change, message, tmp_path):
    folder = copy_of("llama3_tied", tmp_path)
    rewrite(folder, change)
    with pytest.raises(ValueError, match=message):
        hf.load(folder)


def test_an_unsupported_dtype_is_refused(tmp_path):
    folder = copy_of("llama3_tied", tmp_path)
    path = folder / hf.SINGLE
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    header["model.norm.weight"]["dtype"] = "I32"  # as many bytes as F32: only the dtype is wrong
    text = json.dumps(header, separators=(",", ":")).encode()
    path.write_bytes(struct.pack("<Q", length) + text.ljust(length) + data[8 + length :])
    with pytest.raises(ValueError, match="model.norm.weight.*dtype 'I32'"):
        hf.load(folder)


def test_a_truncated_file_is_refused_before_reading(tmp_path):
    folder = copy_of("llama3_untied", tmp_path)
    path = folder / hf.SINGLE
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match="truncated"):
        hf.load(folder)


def test_a_trainer_of_another_model_is_refused(tmp_path):
    folder, tokens, _ = reference("llama3_tied")
    model = hf.model_from_config(hf.read_config(folder), rms_norm_eps=1e-6)
    trainer = trainer_for(model, M(), tokens.shape[1])
    with pytest.raises(ValueError, match="rms_norm_eps"):
        hf.load(folder, trainer=trainer)


# --- dew convert, dew train --init-from, dew tokenize with the folder's tokenizer.json ----------


def test_dew_convert_both_ways_and_train_init_from(dew_here, tmp_path):
    untied, tokens, want = reference("llama3_untied")
    run = dew_here("convert", str(untied), "ckpt", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    # The converted checkpoint holds the weights: Dew's logits from it are transformers'.
    model = hf.model_from_config(hf.read_config(untied))
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one),
        jax.eval_shape(model.init, jax.random.key(0)),
    )
    params, metadata = dew.Checkpoints(tmp_path / "ckpt").restore(target)
    assert metadata["contents"] == "params"
    error = relative_error(np.asarray(jax.jit(model.apply)(params, tokens)), want)
    assert error < TOL, error
    run = dew_here("convert", "ckpt", "back", "--to", "hf", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert tensors_of(tmp_path / "back") == tensors_of(untied)
    # The folder's special tokens' ids travel through the checkpoint into the export.
    assert (
        special_ids(tmp_path / "back")
        == special_ids(untied)
        == {"bos_token_id": 1, "eos_token_id": 2}
    )

    # Tokenize with the folder's tokenizer.json, fine-tune from the folder one step (lr 1e-3),
    # and convert the run's checkpoint back: the trained weights, the folder's names and dtypes.
    tied, _, _ = reference("llama3_tied")
    (tmp_path / "text.txt").write_text("A few words for a tiny Llama to read. " * 100)
    run = dew_here(
        *("tokenize", "text.txt", "--tokenizer", str(tied), "--out", "tokens"),
        *("--eos", "~", "--val-fraction", "0"),
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr
    run = dew_here(
        *("train", "--init-from", str(tied), "--data", "tokens", "--run-dir", "run"),
        *("--steps", "1", "--lr", "1e-3", "--mesh", "fsdp=8", "--seq-len", "16", "--batch", "8"),
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr
    assert f"Initialized from {tied}" in run.stdout
    run = dew_here("convert", "run/checkpoints", "tuned", "--to", "hf", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    tuned, original = tensors_of(tmp_path / "tuned"), tensors_of(tied)
    assert {n: t[:2] for n, t in tuned.items()} == {n: t[:2] for n, t in original.items()}
    _, trained = dew.load_checkpoint(tmp_path / "run", step=1)
    _, exported = hf.load(tmp_path / "tuned")
    jax.tree_util.tree_map(np.testing.assert_array_equal, exported, trained)
    changed = [n for n in tuned if tuned[n][2] != original[n][2]]
    assert len(changed) == len(tuned), "every tensor trained: the export is step 1, not step 0"
    assert special_ids(tmp_path / "tuned") == special_ids(tied)
