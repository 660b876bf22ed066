"""Write a Hugging Face Llama folder of a preset's published shapes with random weights, for the
LoRA chip runs (bench/lora_chip.sh): ``config.json`` and ``model-0000k-of-0000n.safetensors``
files of at most 5 GB, bfloat16, the names and shapes ``dew.models.hf`` reads.

    python bench/lora_folder.py --model llama-3.2-3b --out /tmp/llama-3.2-3b

Nothing is downloaded and no real weights are needed: a step's speed does not depend on them.
Each tensor is drawn when its file is written (``dew.models.safetensors.write`` asks for one at a
time), in row blocks of at most 64 MiB of float32, and written as bfloat16: the host never holds
the model, in float32 or otherwise, only one tensor's bfloat16 bytes (the 8B's embedding: 1 GB).
Matrices (and the embedding, a tied model's head) are drawn with standard deviation ``1 /
sqrt(fan_in)`` and norms' scales as 1, so the activations keep their scale through the layers and
the loss starts near ``ln(vocabulary)`` (Llama-3.2-1B's shapes cut to 1 layer, against
ln(128256) = 11.76: 12.45, measured 2026-12-06).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

BLOCK_BYTES = 64 * 2**20
SHARD_BYTES = 5 * 10**9


def tensors(model) -> list[tuple[str, tuple[int, ...], float]]:
    """``(name, shape, std)`` of every tensor of ``model``'s folder, in Hugging Face's order;
    ``std`` 0 for a norm's scale (ones)."""
    import jax

    from dew.models import hf

    abstract = jax.eval_shape(model.init, jax.random.key(0))["params"]
    out = []
    for m in hf.mappings(model):
        leaf = abstract
        for key in m.path:
            leaf = leaf[key]
        shape = hf._hf_shape(m.kind, leaf.shape[1:] if m.stacked else leaf.shape)
        # [out, in] tensors (and the embedding [vocab, embed], a tied model's head): 1 / sqrt(in)
        std = 0.0 if m.path[-1] == "scale" else 1.0 / math.sqrt(shape[-1])
        for layer in range(leaf.shape[0]) if m.stacked else [None]:
            out.append((m.name.format(layer) if m.stacked else m.name, shape, std))
    return out


def draw(shape, std: float, seed: int) -> np.ndarray:
    """One tensor in bfloat16, drawn in row blocks of at most ``BLOCK_BYTES`` of float32."""
    if std == 0.0:
        return np.ones(shape, ml_dtypes.bfloat16)
    rng = np.random.default_rng(seed)
    out = np.empty(shape, ml_dtypes.bfloat16)
    row = math.prod(shape[1:]) * 4
    step = max(1, BLOCK_BYTES // row)
    for a in range(0, shape[0], step):
        b = min(shape[0], a + step)
        out[a:b] = (rng.standard_normal((b - a, *shape[1:]), np.float32) * std).astype(out.dtype)
    return out


def write_folder(model, folder: Path) -> list[str]:
    from dew.models import hf, safetensors

    folder.mkdir(parents=True, exist_ok=True)
    dtype = np.dtype(ml_dtypes.bfloat16)
    entries = [
        (name, dtype, shape, lambda shape=shape, std=std, i=i: draw(shape, std, i))
        for i, (name, shape, std) in enumerate(tensors(model))
    ]
    groups, size = [[]], 0
    for entry in entries:
        nbytes = math.prod(entry[2]) * 2
        if groups[-1] and size + nbytes > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(entry)
        size += nbytes
    names = [f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))]
    for name, group in zip(names, groups):
        safetensors.write(folder / name, group, metadata={"format": "pt"})
        print(f"wrote {name}: {len(group)} tensors", flush=True)
    index = {
        "metadata": {"total_size": sum(math.prod(e[2]) * 2 for e in entries)},
        "weight_map": {e[0]: name for name, group in zip(names, groups) for e in group},
    }
    (folder / hf.INDEX).write_text(json.dumps(index, indent=2) + "\n")
    (folder / hf.CONFIG).write_text(json.dumps(hf.config_of(model, "bfloat16"), indent=2) + "\n")
    return [*names, hf.INDEX, hf.CONFIG]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a preset (dew.models.presets)")
    parser.add_argument("--out", required=True, help="the folder to write (must not hold one)")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers (a smoke test)")
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # shapes only: no device needed
    import dew
    from dew.models.presets import preset

    config = preset(args.model)
    if args.layers:
        config["num_layers"] = args.layers
    model = dew.models.build("causal_transformer", **config)
    folder = Path(args.out)
    if (folder / "config.json").exists():
        print(f"{folder} already holds a model", file=sys.stderr)
        return 1
    start = time.perf_counter()
    written = write_folder(model, folder)
    print(f"{folder}: {len(written)} files in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
