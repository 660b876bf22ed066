"""Write the Hugging Face reference models that tests/test_hf.py loads: tests/data/hf/<name>/.

Each folder is a small random ``LlamaForCausalLM`` (or ``MistralForCausalLM``) saved by
transformers' own ``save_pretrained`` (``config.json`` and ``model.safetensors``, float32), with
``tokens.npy`` (int32 ``[2, 40]``, fixed token rows) and ``logits.npy`` (float32 ``[2, 40, 256]``,
transformers' logits of those rows in float32, eager attention). Rows of 40 tokens are longer than
the models' ``original_max_position_embeddings``, so Llama 3's frequency scaling changes what they
compute.

- ``llama3_tied``: 2 layers, width 64, 4 heads of 16, 2 kv heads, MLP 96, vocabulary 256, tied
  embeddings, rope_theta 10000, llama3 scaling factor 8, low 1, high 4, original 32: the three
  bands of the scaling (pair 0 kept, pair 1 interpolated, pairs 2-7 stretched), rms_norm_eps 1e-5;
  also ``tokenizer.json``, a byte-level BPE of 256 tokens with no merges, for ``dew tokenize``.
- ``llama3_untied``: the same sizes with its own output head, rope_theta 500000, factor 32,
  original 16.
- ``mistral_window``: a ``MistralForCausalLM`` (Llama with a sliding window) of ``sliding_window``
  6, smaller (2 layers, width 32, 4 heads of 8, 2 kv heads, MLP 48, vocabulary 96, tied
  embeddings, llama3 scaling factor 4 at an original 8) on rows of 24 tokens (``[2, 24]``,
  logits ``[2, 24, 96]``), four times the window: Dew's import must give it the same window.

``python scripts/make_hf_reference.py NAME ...`` writes only those (default: all).

Weights are drawn with standard deviation 0.15 (about 1/sqrt(width)) and the norms' scales as
1 + 0.1 x normal, so that attention is far from uniform and every weight matters to the logits.

Needs torch and transformers, which Dew and its tests do not use; run it in an environment of
its own (the committed files were written with torch 2.13.0+cpu, transformers 5.25.0,
safetensors 0.8.0, tokenizers 0.23.x, numpy 2.4.6, Python 3.11.7):

    python -m venv /tmp/hfvenv
    /tmp/hfvenv/bin/pip install torch==2.13.0 transformers safetensors
    /tmp/hfvenv/bin/python scripts/make_hf_reference.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "hf"
ROWS, SEQ, VOCAB = 2, 40, 256

MODELS = {
    "llama3_tied": dict(
        tie_word_embeddings=True,
        rope={"rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 32},
        seed=1,
    ),
    "llama3_untied": dict(
        tie_word_embeddings=False,
        rope={"rope_theta": 500000.0, "factor": 32.0, "original_max_position_embeddings": 16},
        seed=2,
    ),
}


# The windowed model's sizes: its own rows and vocabulary.
WINDOW, WINDOW_SEQ, WINDOW_VOCAB = 6, 24, 96


def mistral_config() -> MistralConfig:
    return MistralConfig(
        vocab_size=WINDOW_VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=32,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        initializer_range=0.2,
        sliding_window=WINDOW,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8,
        },
        attn_implementation="eager",
    )


def config(tie_word_embeddings: bool, rope: dict) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=0.15,
        rope_parameters={
            "rope_type": "llama3",
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            **rope,
        },
        attn_implementation="eager",
    )


def byte_tokenizer_json(path: Path) -> None:
    """A byte-level BPE tokenizer.json with the 256 byte tokens and no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(path))


def main(names) -> int:
    for name in names or [*MODELS, "mistral_window"]:
        if name == "mistral_window":
            spec = {"seed": 3}
            torch.manual_seed(spec["seed"])
            model = MistralForCausalLM(mistral_config()).float().eval()
            vocab, seq = WINDOW_VOCAB, WINDOW_SEQ
        else:
            spec = MODELS[name]
            torch.manual_seed(spec["seed"])
            model = LlamaForCausalLM(config(spec["tie_word_embeddings"], spec["rope"]))
            model = model.float().eval()
            vocab, seq = VOCAB, SEQ
        with torch.no_grad():
            for key, weight in model.named_parameters():
                if key.endswith("norm.weight"):
                    weight.copy_(1 + 0.1 * torch.randn_like(weight))
        rng = np.random.default_rng(spec["seed"])
        tokens = rng.integers(0, vocab, (ROWS, seq)).astype(np.int32)
        with torch.no_grad():
            logits = model(torch.from_numpy(tokens.astype(np.int64))).logits.float().numpy()
        folder = OUT / name
        folder.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(folder, safe_serialization=True)
        np.save(folder / "tokens.npy", tokens)
        np.save(folder / "logits.npy", logits.astype(np.float32))
        if name == "llama3_tied":
            byte_tokenizer_json(folder / "tokenizer.json")
        (folder / "generation_config.json").unlink(missing_ok=True)
        written = json.loads((folder / "config.json").read_text())
        print(name, written.get("rope_parameters"), written.get("sliding_window"))
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
