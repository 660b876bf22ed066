"""The choices and defaults the ``dew`` command's parsers offer, written out so that building the
parsers imports no JAX: ``dew --help`` and every ``dew COMMAND --help`` answer without it.

Each is a copy of one definition in a module that imports JAX, named beside it;
tests/test_cli_help.py checks that every copy equals its original.
"""

from __future__ import annotations

# dew.training.step.ENGINES
ENGINES = ("shard_map", "gspmd", "gspmd_unpinned")
# dew.parallel.sequence.SCHEMES' names
SEQUENCE_SCHEMES = ("ring", "all_to_all")
# dew.parallel.pipeline.SCHEDULES' names
PIPELINE_SCHEDULES = ("1f1b", "1f1b_phased", "gpipe")
# dew.parallel.options.FSDP_SCHEMES
FSDP_SCHEMES = ("auto", "gather", "ring")
# dew.parallel.options.TENSOR_SCHEMES
TENSOR_SCHEMES = ("auto", "plain", "ring")
# dew.parallel.options.GRADIENT_SUM_DTYPES
GRADIENT_SUM_DTYPES = ("float32", "bfloat16")
# dew.parallel.options.QUANTIZE
QUANTIZE = ("bfloat16", "int8")
# dew.layout.DEFAULT_MIN_SHARD
DEFAULT_MIN_SHARD = 4096
# dew.models.causal_transformer.DTYPES' names
DTYPES = ("float32", "bfloat16", "float16")
# dew.models.causal_transformer.REMAT_CHOICES and REMAT_AUTO
REMAT_CHOICES = ("full", "attention_gate", "dots", "attention", "none")
REMAT_AUTO = "auto"
# dew.models.causal_transformer.LAYER_LOOPS
LAYER_LOOPS = ("scan", "unroll")
# dew.nn.attention.CHOICES
ATTENTION_CHOICES = ("xla", "pallas", "pallas_tpu_interpret", "cudnn", "auto")
# dew.models.presets.PRESETS' names
PRESET_NAMES = (
    "gpt2-small",
    "gpt2-medium",
    "llama-3.2-1b",
    "llama-3.2-3b",
    "llama-3.1-8b",
    "llama-3.1-70b",
)
# dew.models.lora.BASE_DTYPES and DEFAULT_TARGETS
LORA_BASE_DTYPES = ("int8",)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# dew.benchmark.ModelSize()'s decoder and batch: dew bench's defaults
BENCH_SIZES = dict(batch=32, seq_len=128, layers=4, width=256, heads=8)
