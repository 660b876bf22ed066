"""The int8 frozen base against the bfloat16 one, on the CPU: the logits on a held-out batch, and
the loss curve of a short LoRA fine-tune on each (docs/finetune.md, "An int8 base").

    python bench/int8_cpu.py            # about 3 minutes on 2 cores

1. A base worth adapting: the Hugging Face reference model ``tests/data/hf/llama3_untied`` (2
   layers, width 64, its own head, byte vocabulary), trained whole for ``BASE_STEPS`` steps on
   this repository's docs/ as bytes, exported with ``dew convert --to hf``.
2. Its logits on a held-out batch (the docs' validation split) with the base in bfloat16 and in
   int8 (per-output-channel scales): the relative error of the int8 logits against the bfloat16
   ones, and the loss of each.
3. ``dew train --init-from`` that folder with ``--lora-rank 8`` on each base (bfloat16
   activations) on text the base has not seen (Dew's own Python source, as bytes), ``STEPS``
   steps from the same adapters and batches: both loss curves.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BASE = REPO / "tests" / "data" / "hf" / "llama3_untied"
BASE_STEPS, STEPS, SEQ, BATCH = 300, 40, 63, 16


def dew(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "dew", *args], check=True, stdout=subprocess.DEVNULL)


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        dew("tokenize", str(REPO / "docs"), "--tokenizer", "bytes", "--out", str(tmp / "tokens"))
        code = tmp / "code"  # dew tokenize reads .txt: the source under that name
        code.mkdir()
        for i, source in enumerate(sorted((REPO / "dew").rglob("*.py"))):
            (code / f"{i:03d}.txt").write_text(source.read_text())
        dew("tokenize", str(code), "--tokenizer", "bytes", "--out", str(tmp / "code-tokens"))
        common = ["--cpu-devices", "1", "--batch", str(BATCH)]
        common += ["--seq-len", str(SEQ), "--log-every", "10"]
        dew(
            "train",
            "--init-from",
            str(BASE),
            *common,
            "--data",
            str(tmp / "tokens"),
            "--steps",
            str(BASE_STEPS),
            "--run-dir",
            str(tmp / "base-run"),
            "--lr",
            "3e-3",
        )
        dew("convert", str(tmp / "base-run"), str(tmp / "base"), "--to", "hf")
        logits = held_out(tmp / "base", tmp / "tokens")
        curves = {}
        for name, extra in (("bfloat16", []), ("int8", ["--base-dtype", "int8"])):
            metrics = tmp / f"{name}.jsonl"
            dew(
                "train",
                "--init-from",
                str(tmp / "base"),
                *common,
                "--data",
                str(tmp / "code-tokens"),
                "--steps",
                str(STEPS),
                "--lora-rank",
                "8",
                "--dtype",
                "bfloat16",
                "--param-dtype",
                "bfloat16",
                "--lr",
                "2e-3",
                "--warmup-steps",
                "4",
                *extra,
                "--run-dir",
                str(tmp / f"lora-{name}"),
                "--metrics",
                str(metrics),
            )
            curves[name] = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    print(json.dumps(logits))
    print("step  bfloat16 base  int8 base  difference")
    for i, (a, b) in enumerate(zip(curves["bfloat16"], curves["int8"]), start=1):
        if i == 1 or i % 5 == 0:
            print(f"{i:4d}  {a:13.4f}  {b:9.4f}  {b - a:+.4f}")
    return 0


def held_out(folder: Path, tokens: Path) -> dict:
    """The int8 base's logits against the bfloat16 base's on the first validation batch."""
    import dataclasses

    import jax
    import numpy as np

    from dew.data import TokenWindows
    from dew.models import hf, lora
    from dew.objectives.lm import LMObjective

    model, params = hf.load(folder, dtype="bfloat16")

    model = dataclasses.replace(model, dtype="bfloat16", max_seq_len=SEQ + 1)
    data = TokenWindows(str(tokens), seq_len=SEQ, val_batches=1).load(batch=BATCH)
    batch = np.asarray(data.validation()[0])
    int8_model = dataclasses.replace(model, lora=lora.Lora(rank=8, base_dtype="int8"))
    int8 = lora.frozen_of(int8_model, params)
    adapters = lora.init_adapters(int8_model, jax.random.key(0))  # B = 0: the base alone
    tokens_in = batch[:, :-1]
    bf16_logits = np.asarray(jax.jit(model.apply)(params, tokens_in), np.float64)
    int8_logits = np.asarray(
        jax.jit(int8_model.apply)(lora.combine(int8_model, int8, adapters), tokens_in), np.float64
    )
    objective = LMObjective(model, SEQ)
    bf16_loss = float(jax.jit(objective.loss)(params, batch))
    int8_loss = float(jax.jit(objective.loss)(lora.combine(int8_model, int8, adapters), batch))
    error = np.linalg.norm(int8_logits - bf16_logits) / np.linalg.norm(bf16_logits)
    worst = np.max(np.abs(int8_logits - bf16_logits))
    return {
        "held_out_rows": int(batch.shape[0]),
        "logits_relative_error": float(error),
        "logits_max_abs_difference": float(worst),
        "loss_bfloat16_base": bf16_loss,
        "loss_int8_base": int8_loss,
    }


if __name__ == "__main__":
    sys.exit(main())
