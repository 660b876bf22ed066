"""Write the LoRA references tests/test_lora_export.py reads: tests/data/lora/.

Two steps, in two environments:

1. In Dew's environment, ``python scripts/make_lora_reference.py dew``: a LoRA run's checkpoint
   (``tests/lora_reference.write_run``: rank 4, alpha 6, all seven projections, on
   ``tests/data/hf/llama3_untied``) exported by ``dew convert --to peft`` into
   ``tests/data/lora/adapter/`` and by ``--to hf`` (merged) into ``tests/data/lora/merged/``.
2. In an environment of its own with torch, transformers and peft (Dew and its tests never import
   them), ``python scripts/make_lora_reference.py torch``: transformers' ``LlamaForCausalLM`` of
   the base with ``peft.PeftModel.from_pretrained`` of the adapter folder, and
   ``LlamaForCausalLM.from_pretrained`` of the merged folder, each run in float32 with eager
   attention on ``tests/data/hf/llama3_untied/tokens.npy``: ``peft_logits.npy`` and
   ``merged_logits.npy`` (float32 ``[2, 40, 256]``).

The windowed run (``tests/lora_reference.write_windowed_run``: an attention window of 5, its base
a Dew checkpoint) goes the same way into ``tests/data/lora/window/``: ``--to peft --base-out``
writes ``adapter/`` and its base ``base/`` (a ``MistralForCausalLM`` folder, ``sliding_window`` 5),
and the torch step writes ``peft_logits.npy``, PEFT's ``AutoPeftModelForCausalLM`` of ``adapter/``
(which finds ``base/`` by its ``base_model_name_or_path``, the absolute path it was written at:
run the torch step in the clone that ran the Dew step), and ``base_logits.npy``, transformers'
``AutoModelForCausalLM`` of ``base/`` alone, both on ``tests/data/hf/mistral_window/tokens.npy``
(float32 ``[2, 24, 96]``). ``plain`` or ``window`` after ``dew`` or ``torch`` does one of the
two (default both); the Dew step refuses to overwrite, so remove the old folders first.

The committed files were written with torch 2.13.0+cpu, transformers 5.25.0 and peft 0.21.2 (the
versions the script prints), Python 3.11.7, on 2026-12-06; the windowed run's with peft 0.22.0 on
2026-12-07:

    python -m venv /tmp/peftvenv
    /tmp/peftvenv/bin/pip install torch==2.13.0 && /tmp/peftvenv/bin/pip install transformers peft
    python scripts/make_lora_reference.py dew                 # Dew's environment
    cd /tmp && /tmp/peftvenv/bin/python /path/to/dew/scripts/make_lora_reference.py torch

(The second runs from outside the clone: its ``kernels/`` folder would shadow the ``kernels``
package transformers imports.)
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "lora"
BASE = ROOT / "tests" / "data" / "hf" / "llama3_untied"


def dew_step(parts) -> None:
    sys.path.insert(0, str(ROOT))
    from dew.cli import convert
    from tests.lora_reference import WINDOW_OUT, write_run, write_windowed_run

    with tempfile.TemporaryDirectory() as tmp:
        if "plain" in parts:
            write_run(f"{tmp}/plain")
            convert.to_peft(f"{tmp}/plain", OUT / "adapter")
            convert.to_hf(f"{tmp}/plain", OUT / "merged")
        if "window" in parts:
            write_windowed_run(f"{tmp}/window")
            convert.to_peft(f"{tmp}/window", WINDOW_OUT / "adapter", base_out=WINDOW_OUT / "base")


def torch_step(parts) -> None:
    import numpy as np
    import peft
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    def logits(model, tokens):
        with torch.no_grad():
            return model.float().eval()(tokens).logits.float().numpy()

    if "plain" in parts:
        tokens = torch.from_numpy(np.load(BASE / "tokens.npy").astype(np.int64))
        base = LlamaForCausalLM.from_pretrained(BASE, attn_implementation="eager").float().eval()
        adapted = peft.PeftModel.from_pretrained(base, OUT / "adapter").eval()
        np.save(OUT / "peft_logits.npy", logits(adapted, tokens))
        merged = LlamaForCausalLM.from_pretrained(OUT / "merged", attn_implementation="eager")
        np.save(OUT / "merged_logits.npy", logits(merged, tokens))
    if "window" in parts:
        window = OUT / "window"
        rows = ROOT / "tests" / "data" / "hf" / "mistral_window" / "tokens.npy"
        tokens = torch.from_numpy(np.load(rows).astype(np.int64))
        adapted = peft.AutoPeftModelForCausalLM.from_pretrained(
            window / "adapter", attn_implementation="eager"
        )
        print(
            type(adapted.base_model.model).__name__, adapted.base_model.model.config.sliding_window
        )
        np.save(window / "peft_logits.npy", logits(adapted, tokens))
        base = AutoModelForCausalLM.from_pretrained(window / "base", attn_implementation="eager")
        np.save(window / "base_logits.npy", logits(base, tokens))
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"peft {peft.__version__}"
    )


if __name__ == "__main__":
    parts = sys.argv[2:] or ["plain", "window"]
    {"dew": dew_step, "torch": torch_step}[sys.argv[1]](parts)
