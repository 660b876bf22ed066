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

The committed files were written with torch 2.13.0+cpu, transformers 5.25.0 and peft 0.21.2 (the
versions the script prints), Python 3.11.7, on 2026-12-06:

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


def dew_step() -> None:
    sys.path.insert(0, str(ROOT))
    from dew.cli import convert
    from tests.lora_reference import write_run

    with tempfile.TemporaryDirectory() as tmp:
        write_run(tmp)
        convert.to_peft(tmp, OUT / "adapter")
        convert.to_hf(tmp, OUT / "merged")


def torch_step() -> None:
    import numpy as np
    import peft
    import torch
    import transformers
    from transformers import LlamaForCausalLM

    tokens = torch.from_numpy(np.load(BASE / "tokens.npy").astype(np.int64))
    base = LlamaForCausalLM.from_pretrained(BASE, attn_implementation="eager").float().eval()
    adapted = peft.PeftModel.from_pretrained(base, OUT / "adapter").eval()
    with torch.no_grad():
        np.save(OUT / "peft_logits.npy", adapted(tokens).logits.float().numpy())
    merged = LlamaForCausalLM.from_pretrained(OUT / "merged", attn_implementation="eager")
    with torch.no_grad():
        np.save(OUT / "merged_logits.npy", merged.float().eval()(tokens).logits.float().numpy())
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"peft {peft.__version__}"
    )


if __name__ == "__main__":
    {"dew": dew_step, "torch": torch_step}[sys.argv[1]]()
