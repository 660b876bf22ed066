"""Write the lm-eval reference tests/test_evaluation.py reads: tests/data/eval/tiny_mc_hf.json.

lm-eval's Hugging Face backend (``HFLM``, float32, batch 1) runs the local multiple-choice task
``tests/data/eval/tiny_mc.yaml`` (six questions of 2 to 4 choices, its data
``tests/data/eval/tiny_mc.jsonl``) on ``tests/data/hf/llama3_untied`` with the byte-level
``tokenizer.json`` of ``tests/data/hf/llama3_tied`` (copied beside the model in a temporary
folder; it has no special token, so none is added to a request, and ``prefix_token_id`` is 0).
It writes the task's ``acc`` and ``acc_norm`` and every choice's log-likelihood and is-greedy
flag (``filtered_resps`` of each logged sample), in document order.

Needs torch, transformers and lm-eval; run it in an environment of its own, with the
repository's root as the working directory (the task's data path is relative to it), through
``python -P`` so that the clone's ``kernels/`` folder does not shadow the ``kernels`` package
transformers imports. The committed file was written with torch 2.13.0+cpu, transformers 5.25.0
and lm-eval 0.4.13 (Python 3.11) on 2026-12-07:

    /tmp/peftvenv/bin/pip install lm-eval==0.4.13
    cd /path/to/dew && /tmp/peftvenv/bin/python -P scripts/make_eval_reference.py
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"
OUT = DATA / "eval" / "tiny_mc_hf.json"
# The tokenizer names no special token: id 0 (the byte "!") is the prefix of an empty context.
PREFIX = 0


def main() -> int:
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    import lm_eval
    import torch
    import transformers
    from lm_eval.tasks import TaskManager

    with tempfile.TemporaryDirectory() as tmp:
        for name in ("config.json", "model.safetensors"):
            shutil.copy(DATA / "hf" / "llama3_untied" / name, Path(tmp) / name)
        shutil.copy(DATA / "hf" / "llama3_tied" / "tokenizer.json", Path(tmp) / "tokenizer.json")
        results = lm_eval.simple_evaluate(
            model="hf",
            model_args=f"pretrained={tmp},dtype=float32,prefix_token_id={PREFIX}",
            tasks=["dew_tiny_mc"],
            task_manager=TaskManager(include_path=str(DATA / "eval")),
            batch_size=1,
            device="cpu",
            log_samples=True,
            bootstrap_iters=0,
        )
    task = results["results"]["dew_tiny_mc"]
    samples = sorted(results["samples"]["dew_tiny_mc"], key=lambda s: s["doc_id"])
    record = {
        "prefix_token_id": PREFIX,
        "acc": task["acc,none"],
        "acc_norm": task["acc_norm,none"],
        "choices": [[[float(lp), bool(g)] for lp, g in s["filtered_resps"]] for s in samples],
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "lm_eval": lm_eval.__version__,
        },
    }
    OUT.write_text(json.dumps(record, indent=1) + "\n")
    print(record["acc"], record["acc_norm"], record["versions"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
