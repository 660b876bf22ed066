"""A LoRA run's adapters as a PEFT adapter folder: ``adapter_config.json`` and
``adapter_model.safetensors``, what ``peft.PeftModel.from_pretrained(base, folder)`` loads on a
transformers ``LlamaForCausalLM`` of the base (``dew convert RUN OUT --to peft``).

Names and shapes are PEFT's for a ``LlamaForCausalLM``: layer ``i``'s adapter of ``q_proj`` is
``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` ``[R, in]`` and ``...lora_B
.weight`` ``[out, R]``, ``nn.Linear``'s ``[out, in]`` layout: Dew's ``A`` ``[*in_dims, R]``
flattened to ``[in, R]`` and transposed, ``B`` ``[R, *out_dims]`` flattened to ``[R, out]`` and
transposed. The heads flatten head-major (``heads x head_dim``), as ``dew.models.hf`` lays out
q, k, v and o. PEFT scales the update by ``lora_alpha / r``, as Dew does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from dew.models import safetensors
from dew.models.lora import TARGETS

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"


def tensor_name(layer: int, target: str, half: str) -> str:
    """PEFT's name of layer ``layer``'s ``half`` (``"A"`` or ``"B"``) of ``target`` (``q_proj``)."""
    module = TARGETS[target][3]
    return f"base_model.model.model.layers.{layer}.{module}.lora_{half}.weight"


def adapter_config(model, base_path: str | None) -> dict:
    """``adapter_config.json`` of ``model``'s ``lora``."""
    lora = model.lora
    alpha = int(lora.alpha) if float(lora.alpha).is_integer() else lora.alpha
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_path,
        "r": lora.rank,
        "lora_alpha": alpha,
        "lora_dropout": lora.dropout,
        "target_modules": list(lora.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def entries(model, adapters: dict) -> list:
    """``(name, dtype, shape, make)`` of every adapter tensor, layer by layer, in PEFT's layout
    (for ``dew.models.safetensors.write``)."""
    if "moe_layers" in adapters["lora"]:
        raise ValueError("an MoE model's adapters have no PEFT Llama layout")
    out = []
    layers = adapters["lora"].get("layers", {})
    for target in model.lora.targets:
        group, weight, _, _ = TARGETS[target]
        a, b = layers[group][weight]["a"], layers[group][weight]["b"]
        rank = a.shape[-1]
        for i in range(a.shape[0]):
            n_in = int(np.prod(a.shape[1:-1]))
            n_out = int(np.prod(b.shape[2:]))

            def make_a(a=a, i=i, n_in=n_in):
                return np.ascontiguousarray(np.asarray(a[i], np.float32).reshape(n_in, -1).T)

            def make_b(b=b, i=i, n_out=n_out):
                return np.ascontiguousarray(np.asarray(b[i], np.float32).reshape(-1, n_out).T)

            out.append((tensor_name(i, target, "A"), np.dtype(np.float32), (rank, n_in), make_a))
            out.append((tensor_name(i, target, "B"), np.dtype(np.float32), (n_out, rank), make_b))
    return out


def save(model, adapters: dict, folder: str | os.PathLike, base_path: str | None) -> list[str]:
    """Writes the PEFT adapter folder of ``adapters`` (``{"lora": ...}``) of ``model``; refuses a
    folder that already holds one (``FileExistsError``). Files are written under temporary names
    and renamed, the config last. Returns the names written."""
    folder = Path(folder)
    taken = [n for n in (CONFIG, WEIGHTS) if (folder / n).exists()]
    if taken:
        raise FileExistsError(f"{folder} already holds {', '.join(taken)}; not overwriting")
    folder.mkdir(parents=True, exist_ok=True)
    config = adapter_config(model, base_path)
    try:
        safetensors.write(folder / (WEIGHTS + ".tmp"), entries(model, adapters), {"format": "pt"})
        (folder / (CONFIG + ".tmp")).write_text(json.dumps(config, indent=2) + "\n")
    except BaseException:
        for name in (WEIGHTS, CONFIG):
            (folder / (name + ".tmp")).unlink(missing_ok=True)
        raise
    for name in (WEIGHTS, CONFIG):
        os.replace(folder / (name + ".tmp"), folder / name)
    return [WEIGHTS, CONFIG]
