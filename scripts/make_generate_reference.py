"""Write the greedy-generation references tests/test_generate.py reads: tests/data/generate/.

transformers' greedy ``generate`` (float32, eager attention, no end-of-text stop) of 40 new tokens
after each of three prompts (5, 11 and 2 token ids, fixed), each prompt run alone (no padding), on:

- ``llama3_tied``, ``llama3_untied``: the Hugging Face reference models of tests/data/hf/;
- ``lora``: ``llama3_untied`` with the PEFT adapter tests/data/lora/adapter/ (rank 4, alpha 6, all
  seven projections: ``tests/lora_reference.write_run``'s adapters, which Dew loads from that run).

Each file ``NAME.json`` holds ``{"prompts": [[ids]], "completions": [[40 ids]], "versions": ...}``.

Needs torch, transformers and peft, which Dew and its tests never import; run it in an environment
of its own, from outside the clone (its ``kernels/`` folder would shadow the ``kernels`` package
transformers imports). The committed files were written with torch 2.13.0+cpu, transformers 5.25.0
and peft 0.22.0 (Python 3.11) on 2026-12-07:

    cd /tmp && /tmp/peftvenv/bin/python /path/to/dew/scripts/make_generate_reference.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parent.parent
HF = ROOT / "tests" / "data" / "hf"
OUT = ROOT / "tests" / "data" / "generate"
PROMPTS = [[17, 200, 3, 99, 45], [5, 250, 128, 7, 7, 64, 31, 180, 2, 90, 11], [140, 33]]
NEW = 40


def model_of(name: str):
    from transformers import LlamaForCausalLM

    if name == "lora":
        from peft import PeftModel

        base = LlamaForCausalLM.from_pretrained(HF / "llama3_untied", attn_implementation="eager")
        model = PeftModel.from_pretrained(
            base.float(), ROOT / "tests" / "data" / "lora" / "adapter"
        )
    else:
        model = LlamaForCausalLM.from_pretrained(HF / name, attn_implementation="eager")
    model = model.float().eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def main(names) -> int:
    import peft

    OUT.mkdir(parents=True, exist_ok=True)
    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    versions["peft"] = peft.__version__
    for name in names or ["llama3_tied", "llama3_untied", "lora"]:
        model = model_of(name)
        completions = []
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            with torch.no_grad():
                out = model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=False,
                    max_new_tokens=NEW,
                    min_new_tokens=NEW,
                )
            completions.append(out[0, len(prompt) :].tolist())
        record = {"prompts": PROMPTS, "completions": completions, "versions": versions}
        (OUT / f"{name}.json").write_text(json.dumps(record) + "\n")
        print(name, [c[:6] for c in completions])
    print(versions)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
