"""A Hugging Face Llama or Mistral ``config.json`` and Dew's ``CausalTransformer``: which model a
config describes (``model_from_config``, refusing what Dew does not implement, naming the field),
the folder's config (``read_config``, ``is_hf_folder``), and the fields two models must share to
hold the same weights (``architecture``). ``dew.models.hf`` reads and writes the weights.

Mistral is Llama with a sliding window (``sliding_window``; the same tensors, names and rotary):
transformers' window, ``kv_idx > q_idx - sliding_window`` (``sliding_window_overlay`` in its
``masking_utils``), is Dew's ``attention_window`` (the ``W`` most recent keys, the query's own
included), so a window ``W`` is ``sliding_window`` ``W`` both ways.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from dew.models.causal_transformer import CausalTransformer
from dew.nn import rotary

CONFIG = "config.json"
ARCHITECTURE = "LlamaForCausalLM"
# A model with an attention window exports as Mistral, the Llama that carries one.
WINDOWED_ARCHITECTURE = "MistralForCausalLM"
# model_type -> (its architecture, transformers' defaults of the fields Dew reads where a config
# leaves them out: LlamaConfig's and MistralConfig's, so that a folder means what it means there).
MODEL_TYPES = {
    "llama": (ARCHITECTURE, {"max_position_embeddings": 2048, "sliding_window": None}),
    "mistral": (
        WINDOWED_ARCHITECTURE,
        {"max_position_embeddings": 131072, "num_key_value_heads": 8, "sliding_window": 4096},
    ),
}


# config.json fields Dew does not model that an export (``dew convert --to hf``) carries over from
# the Hugging Face folder its weights came from: the special tokens' ids, which transformers'
# ``generate`` reads when a folder has no generation_config.json. Fields that describe the weights
# written (``torch_dtype``, ``dtype``) are the export's own, as are the model's (``config_of``).
CARRIED_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def carried_fields(config: dict, where: str = CONFIG) -> dict:
    """The ``CARRIED_FIELDS`` of a Hugging Face ``config`` that hold a value (null ones left out):
    a token id or a list of them. ``ValueError`` naming the field for anything else."""
    carried = {}
    for field in CARRIED_FIELDS:
        value = config.get(field)
        if value is None:
            continue
        ids = value if isinstance(value, list) else [value]
        if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError(f"{where}: {field} {value!r} is not a token id or a list of them")
        carried[field] = value
    return carried


def _rope(config: dict, where: str) -> tuple[float, rotary.Llama3Scaling | None]:
    """``(rope_theta, scaling)`` of a config: transformers 5's ``rope_parameters`` or the
    ``rope_theta`` and ``rope_scaling`` of earlier versions (Meta's published files)."""
    if config.get("rope_parameters") is not None:
        params = dict(config["rope_parameters"])
        theta = params.pop("rope_theta", config.get("rope_theta", rotary.DEFAULT_THETA))
        field = "rope_parameters"
    else:
        params = dict(config.get("rope_scaling") or {})
        theta = config.get("rope_theta", rotary.DEFAULT_THETA)
        field = "rope_scaling"
    kind = params.pop("rope_type", params.pop("type", "default"))
    if kind == "default":
        leftover = sorted(set(params) - {"partial_rotary_factor"})
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            leftover = ["partial_rotary_factor"]
        if leftover:
            raise ValueError(f"{where}: {field} {', '.join(leftover)} is not supported by Dew")
        return float(theta), None
    if kind != "llama3":
        raise ValueError(
            f"{where}: {field} rope_type {kind!r} is not supported; Dew implements 'default' "
            "and 'llama3'"
        )
    try:
        return float(theta), rotary.Llama3Scaling.of({"rope_type": "llama3", **params})
    except ValueError as error:
        raise ValueError(f"{where}: {field}: {error}") from None


def model_from_config(config: dict, where: str = CONFIG, **overrides) -> CausalTransformer:
    """The ``CausalTransformer`` of a Hugging Face Llama or Mistral ``config`` (``config.json``'s
    dict; Mistral's ``sliding_window`` is the model's ``attention_window``), with ``overrides``
    (``max_seq_len``, ``param_dtype``, ``dtype``, ``attention_impl``, ...). ``ValueError`` naming
    the field for another architecture or a feature Dew does not have."""
    if not isinstance(config, dict):
        raise ValueError(f"{where} is not a JSON object")
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"{where}: model_type {model_type!r} is not supported; dew.models.hf loads Llama "
            "models (model_type 'llama', LlamaForCausalLM) and Mistral models (model_type "
            "'mistral', MistralForCausalLM)"
        )
    expected, defaults = MODEL_TYPES[model_type]
    architectures = config.get("architectures") or [expected]
    if expected not in architectures:
        raise ValueError(f"{where}: architectures {architectures} has no {expected}")
    unsupported = {
        "hidden_act": ("silu", "SwiGLU with SiLU is Dew's MLP"),
        "attention_bias": (False, "Dew's projections have no bias"),
        "mlp_bias": (False, "Dew's MLP has no bias"),
    }
    for field, (wanted, why) in unsupported.items():
        if config.get(field, wanted) != wanted:
            raise ValueError(
                f"{where}: {field} {config[field]!r} is not supported ({why}; needs {wanted!r})"
            )
    required = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
    )
    missing = [field for field in required if field not in config]
    if missing:
        raise ValueError(f"{where} lacks {', '.join(missing)}")
    heads = config["num_attention_heads"]
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim")
    if head_dim is not None and head_dim * heads != hidden:
        raise ValueError(
            f"{where}: head_dim {head_dim} x num_attention_heads {heads} is not hidden_size "
            f"{hidden}; Dew's heads split the width"
        )
    theta, scaling = _rope(config, where)
    window = config.get("sliding_window", defaults["sliding_window"])
    if model_type == "llama":  # LlamaForCausalLM has no window, whatever the file says
        window = None
    elif window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):
        raise ValueError(f"{where}: sliding_window {window!r} is not a number of keys >= 1")
    fields = dict(
        vocab_size=config["vocab_size"],
        emb_features=hidden,
        num_layers=config["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads", defaults.get("num_key_value_heads"))
        or heads,
        mlp_features=config["intermediate_size"],
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        max_seq_len=config.get("max_position_embeddings", defaults["max_position_embeddings"]),
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        attention_window=window,
    )
    try:
        return CausalTransformer(**{**fields, **overrides})
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where}: {error}") from None


def architecture(model: CausalTransformer) -> dict:
    """The fields of ``model`` a Llama checkpoint decides (for comparing two models)."""
    return model.architecture()


def read_config(folder: str | os.PathLike) -> dict:
    path = Path(folder) / CONFIG
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(
            f"{folder} is not a Hugging Face model folder: it has no {CONFIG}"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} cannot be read as JSON ({error})") from None


def is_hf_folder(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder with a ``config.json`` (a Hugging Face model folder)."""
    return (Path(path) / CONFIG).is_file()
