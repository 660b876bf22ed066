"""Published model shapes, as ``causal_transformer`` configurations.

``models.build("causal_transformer", **PRESETS["llama-3.1-8b"])``, or ``--model llama-3.1-8b`` on
every command that takes model sizes. Each preset is the published model's shapes in Dew's decoder
(RMSNorm, rotary positions, SwiGLU, no biases), so plans and benchmarks are about the sizes people
train. ``PUBLISHED_PARAMETERS`` holds the count each model's authors give; the tests hold every
preset's weight count to it within 1%.

- Llama 3.x: the model cards and ``config.json`` of meta-llama/Llama-3.2-1B, Llama-3.2-3B
  (hidden_size 3072, intermediate_size 8192, 28 layers, 24 heads, 8 kv heads of head_dim 128, tied;
  rope_theta 500000, llama3 rope_scaling factor 32, low 1, high 4, original 8192, the 1B's),
  Llama-3.1-8B and Llama-3.1-70B (hidden_size, intermediate_size, num_hidden_layers,
  num_attention_heads, num_key_value_heads, vocab_size 128256, tie_word_embeddings). Dew's decoder
  is Llama's block, so these are the models' own weights, shape for shape, and the presets carry
  their position and norm settings (``LLAMA_3_2_ROPE``, ``LLAMA_3_1_ROPE``: ``rope_theta``, the
  ``llama3`` ``rope_scaling`` and ``rms_norm_eps`` of the same ``config.json``), so that their
  published weights (``dew.models.hf``) compute the published model. ``max_seq_len`` is 8192, the
  length they were pretrained at before their context was extended.
- GPT-2 small and medium (Radford et al. 2019; the released 124M and 355M checkpoints): widths,
  depths, heads and the 1024-token context are GPT-2's. Dew's block differs: its SwiGLU MLP has
  three matrices where GPT-2's GELU MLP has two, so its width is 2/3 of GPT-2's 4 x width (rounded
  up to a multiple of 16), which keeps the MLP's weights and FLOPs; positions are rotary rather
  than a learned table, and there are no biases. The vocabulary is padded from 50257 to 50304
  (a multiple of 64, as nanoGPT pads it) so that it splits over tensor.
"""

from __future__ import annotations

LLAMA_VOCAB = 128256


def _llama3_rope(factor: float) -> dict:
    """Llama 3's rotary and norm settings (config.json: rope_theta, rope_scaling with rope_type
    "llama3", rms_norm_eps); the scaling ``factor`` is 32 for 3.2 and 8 for 3.1."""
    return dict(
        rope_theta=500000.0,
        rope_scaling=dict(
            factor=factor,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        rms_norm_eps=1e-5,
    )


LLAMA_3_2_ROPE = _llama3_rope(32.0)
LLAMA_3_1_ROPE = _llama3_rope(8.0)

PRESETS: dict[str, dict] = {
    "gpt2-small": dict(
        vocab_size=50304,
        emb_features=768,
        num_layers=12,
        num_heads=12,
        mlp_features=2048,
        tie_embeddings=True,
        max_seq_len=1024,
    ),
    "gpt2-medium": dict(
        vocab_size=50304,
        emb_features=1024,
        num_layers=24,
        num_heads=16,
        mlp_features=2736,
        tie_embeddings=True,
        max_seq_len=1024,
    ),
    "llama-3.2-1b": dict(
        vocab_size=LLAMA_VOCAB,
        emb_features=2048,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        mlp_features=8192,
        tie_embeddings=True,
        max_seq_len=8192,
        **LLAMA_3_2_ROPE,
    ),
    "llama-3.2-3b": dict(
        vocab_size=LLAMA_VOCAB,
        emb_features=3072,
        num_layers=28,
        num_heads=24,
        num_kv_heads=8,
        mlp_features=8192,
        tie_embeddings=True,
        max_seq_len=8192,
        **LLAMA_3_2_ROPE,
    ),
    "llama-3.1-8b": dict(
        vocab_size=LLAMA_VOCAB,
        emb_features=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        mlp_features=14336,
        tie_embeddings=False,
        max_seq_len=8192,
        **LLAMA_3_1_ROPE,
    ),
    "llama-3.1-70b": dict(
        vocab_size=LLAMA_VOCAB,
        emb_features=8192,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        mlp_features=28672,
        tie_embeddings=False,
        max_seq_len=8192,
        **LLAMA_3_1_ROPE,
    ),
}

# How each preset trains unless told otherwise (``dew.models.causal_transformer``'s fields; the
# example decoder and the tests' models keep the float32, XLA, full-recompute defaults):
# - bfloat16 activations, as the models' authors trained them (weights and optimizer state stay
#   float32: ``param_dtype``); softmax, norms and the loss run in float32 regardless.
# - attention "auto": the Mosaic kernels on TPU, cuDNN on GPU (Triton where cuDNN does not take the
#   shapes), XLA on CPU.
# - remat "full" for Llama-3.2-3B, as for 8B: not measured for full training (its state alone,
#   19 GB in bfloat16 with moments, passes one v5e chip); its LoRA runs choose with --remat.
# - remat "dots" (keep the weight matmuls' outputs) for Llama-3.2-1B: on one H200
#   (issue 32) Llama-3.2-1B at 8 x 2048 tokens stepped in 295 ms against full recompute's 329 ms
#   with the Pallas kernels, well within memory. "full" for 8B and 70B: "dots" keeps about 11 times
#   the activations of "full" there (2 e + q + k + v + 2 mlp = 43k values a token a layer for 8B,
#   against e = 4k), 22 GiB of bfloat16 a device at 8k tokens for 8B; not measured, so the
#   memory-safe choice stays until a plan or a run says otherwise.
# - remat "attention" for GPT-2 small: on one v5e chip (2026-12-05) at 16 x 1024 tokens, its
#   step took 172 ms against "dots"' 182 ms (the backward does not rerun the attention kernels'
#   forward), within the chip's 15.75 GiB. With the loss over chunks (dew.nn.cross_entropy) "none"
#   fits too, and is slower: 180 ms against 170 (docs/results/one-chip.md, "GPT-2 small").
# - remat "full" for GPT-2 medium: on one v5e chip at 16 x 1024 tokens "dots" needs 16.6 GiB, over
#   the 15.75 a program may use, and "full" 7.6 (`dew plan --target v5e-1 --model gpt2-medium
#   --remat auto`, 2026-12-05, with the loss over chunks).
# - layer_loop "unroll" for GPT-2 small: on one v5e chip (2026-12-06) at 16 x 1024 tokens, its
#   step took 124.8 ms against the scanned layers' 139.6 (56.9% MFU against 50.9%), for a first
#   step after 67 s against 31 (docs/results/one-chip.md, "GPT-2 small"); on a GPU not timed.
#   The others keep "scan": not timed unrolled, their compile grows with their 16 to 80 layers,
#   and unrolled XLA may keep what their remat would recompute (Llama-3.2-1B at 4 x 2048 under
#   "full": 22.7 GiB of temporaries against 4.8, over one v5e chip).
TRAINING_DEFAULTS = dict(dtype="bfloat16", attention_impl="auto")
REMAT_DEFAULTS = {
    "gpt2-small": "attention",
    "gpt2-medium": "full",
    "llama-3.2-1b": "dots",
    "llama-3.2-3b": "full",
    "llama-3.1-8b": "full",
    "llama-3.1-70b": "full",
}
LAYER_LOOP_DEFAULTS = {"gpt2-small": "unroll"}
for _name, _config in PRESETS.items():
    _config.update(
        TRAINING_DEFAULTS,
        remat=REMAT_DEFAULTS[_name],
        layer_loop=LAYER_LOOP_DEFAULTS.get(_name, "scan"),
    )

# The weight counts the models' authors publish (GPT-2's include its position table and biases).
PUBLISHED_PARAMETERS: dict[str, int] = {
    "gpt2-small": 124_439_808,  # the released checkpoint's count ("124M")
    "gpt2-medium": 354_823_168,  # "355M"
    "llama-3.2-1b": 1_235_814_400,  # "1.23B"
    "llama-3.2-3b": 3_212_749_824,  # "3.21B"
    "llama-3.1-8b": 8_030_261_248,  # "8.03B"
    "llama-3.1-70b": 70_553_706_496,  # "70.6B"
}


def preset(name: str, **overrides) -> dict:
    """The configuration of preset ``name``, with ``overrides`` (``max_seq_len=2048``,
    ``dtype="bfloat16"``) applied; a ``ValueError`` lists the presets for an unknown name."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; available: {', '.join(PRESETS)}")
    return {**PRESETS[name], **overrides}
