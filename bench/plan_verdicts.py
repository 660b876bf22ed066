"""Does the chip agree with ``dew plan``? Train a few steps of one configuration on the attached
chip and say whether it ran, with the memory it held, or how the chip refused it.

    python -P bench/plan_verdicts.py --model gpt2-small --batch 44 --seq-len 1024 --json out.jsonl

The step is the one ``dew plan --target v5e-1 --model gpt2-small --batch 44 --seq-len 1024``
compiles: the preset's model with its defaults (or ``--remat``), AdamW at 1e-3, one device, the
default layout. One configuration per process: a step the chip refused leaves nothing behind for
the next (``bash`` loops over them; docs/planning.md has the commands and the verdicts).
``--cpu`` runs it at whatever size on one CPU device, to check the script itself.

``peak_bytes_in_use`` in the verdict is what the device's allocator gave JAX's arrays (the
state, the batch), not the program's heap, which the runtime reserves apart: GPT-2 small at
44 x 1024 tokens read 1.4 GiB there with a 13.8 GiB heap. The plan's figures are the compiler's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a preset: gpt2-small, llama-3.2-1b, ...")
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument(
        "--remat", default=None, help="the model's recompute policy (default: the preset's)"
    )
    parser.add_argument("--layers", type=int, default=None, help="override the preset's depth")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", default=None, help="append the verdict to this file (JSON lines)")
    parser.add_argument("--cpu", action="store_true", help="one CPU device (a check of the script)")
    args = parser.parse_args()

    from dew.training.runtime import prepare_process

    prepare_process(cpu_devices=1 if args.cpu else None)

    import jax
    import numpy as np
    import optax

    import dew
    from dew.models.presets import preset
    from dew.objectives.lm import LMObjective

    overrides = {"remat": args.remat} if args.remat else {}
    if args.layers:
        overrides["num_layers"] = args.layers
    model = dew.models.build("causal_transformer", **preset(args.model, **overrides))
    objective = LMObjective(model, args.seq_len)
    device = jax.devices()[0]
    trainer = dew.Trainer(objective, optax.adamw(1e-3), jax.random.key(0), devices=[device])
    verdict = dict(
        model=args.model,
        batch=args.batch,
        seq_len=args.seq_len,
        remat=model.remat,
        device=device.device_kind,
    )
    rng = np.random.default_rng(0)
    batch = trainer.device_batch(
        rng.integers(0, model.vocab_size, (args.batch, args.seq_len + 1), dtype=np.int32),
        args.batch,
    )
    start = time.perf_counter()
    try:
        state = trainer.init_state()
        step = trainer.train_step(args.batch)
        losses = []
        for _ in range(args.steps):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        verdict.update(ran=True, steps=args.steps, losses=losses)
    except Exception as error:  # noqa: BLE001  (the chip's refusal is the answer)
        verdict.update(ran=False, error=f"{type(error).__name__}: {str(error)[:600]}")
    verdict["seconds"] = round(time.perf_counter() - start, 1)
    stats = device.memory_stats() or {}
    for key in ("peak_bytes_in_use", "bytes_limit"):
        if key in stats:
            verdict[key] = int(stats[key])
    line = json.dumps(verdict)
    print(line, flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
