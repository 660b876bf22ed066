"""Dew's Mosaic forward against another version of its kernel file, on one TPU, in one process.

    git show REV:kernels/mosaic_forward.py > /tmp/before.py
    python -P bench/forward_ab.py /tmp/before.py [--rows causal8192 window ...] [--calls 20]
        [--rounds 5] [--json FILE] [--tiny]

For each row (``ROWS``: causal and windowed calls at 8192 keys, packed documents, GPT-2 small's
and Llama-3.2-1B's attention shapes), the call is compiled twice: once with the installed
`kernels.mosaic_forward` and once with the given file loaded in its place (the rest of Dew, the
blocks and the tuning are the installed ones), on the same bfloat16 inputs in the kernels' own
layout (``layout="bhsd"``). It prints whether the two outputs are equal to the bit, then the
milliseconds a call of each: ``--calls`` calls back to back, blocked on the last (the device's
queue stays full, so this is the device's time plus one dispatch), ``--rounds`` times, the two
versions taken in turn twice over, and the median. Only the forward is timed.

``--tiny``: toy shapes in TPU interpret mode on any backend, to show the script runs (its times
mean nothing).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import dew.kernels.attention as attention_module
from dew.kernels import flash_attention, mosaic_forward

# name: (batch, heads, kv_heads, seq, head_dim, window, (block_q, block_k) or None for the
# defaults, mean document length or 0 for none)
ROWS = {
    "causal8192": (2, 16, 16, 8192, 128, None, None, 0),
    "window1024-512x512": (2, 16, 16, 8192, 128, 1024, (512, 512), 0),
    "window1024-512x1024": (2, 16, 16, 8192, 128, 1024, (512, 1024), 0),
    "window1024-defaults": (2, 16, 16, 8192, 128, 1024, None, 0),
    "window1024-1024x1024": (2, 16, 16, 8192, 128, 1024, (1024, 1024), 0),
    "docs300-512x1024": (2, 16, 16, 8192, 128, None, (512, 1024), 300),
    "gpt2-small": (16, 12, 12, 1024, 64, None, None, 0),
    "llama-3.2-1b": (4, 32, 8, 2048, 64, None, None, 0),
}
TINY = {
    "causal": (1, 4, 2, 512, 128, None, (128, 128), 0),
    "window": (1, 4, 4, 512, 128, 100, (128, 128), 0),
    "docs": (1, 4, 4, 512, 128, None, (128, 128), 40),
}


def load_other(path: str):
    """The kernel file at ``path`` as a module of the package (its relative imports resolve to
    the installed Dew)."""
    spec = importlib.util.spec_from_file_location("dew.kernels.mosaic_forward_other", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def document_ids(rng, batch: int, seq: int, mean: int):
    """int32 ``[batch, seq]``: documents of lengths uniform in ``[1, 2 mean)``, ids in order."""
    rows = []
    for _ in range(batch):
        lengths = []
        while sum(lengths) < seq:
            lengths.append(int(rng.integers(1, 2 * mean)))
        rows.append(np.repeat(np.arange(len(lengths)), lengths)[:seq])
    return jnp.asarray(np.stack(rows), jnp.int32)


def compile_with(module, row, inputs, interpret):
    """The jitted forward with ``module`` as the Mosaic forward. JAX caches traces of
    flash_attention's inner functions, so the caches are cleared first: the other module's trace
    would be reused otherwise."""
    batch, heads, kv_heads, seq, head_dim, window, blocks, documents = row
    q, k, v, ids = inputs
    blocks = {} if blocks is None else dict(block_q=blocks[0], block_k=blocks[1])

    def forward(q, k, v, ids):
        return flash_attention(
            q, k, v, causal=True, window=window, segment_ids=ids, layout="bhsd",
            interpret=interpret, **blocks,
        )  # fmt: skip

    jax.clear_caches()
    installed = attention_module._mosaic_forward
    attention_module._mosaic_forward = module
    try:
        return jax.jit(forward).lower(q, k, v, ids).compile()
    finally:
        attention_module._mosaic_forward = installed


def time_calls(compiled, inputs, calls: int, rounds: int) -> list[float]:
    compiled(*inputs).block_until_ready()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            out = compiled(*inputs)
        out.block_until_ready()
        times.append((time.perf_counter() - start) / calls * 1e3)
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("other", help="another version of kernels/mosaic_forward.py")
    parser.add_argument("--rows", nargs="*", help="row names (default: all of them)")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="append one JSON line a row to this file")
    parser.add_argument("--tiny", action="store_true", help="toy shapes, TPU interpret mode")
    args = parser.parse_args(argv)
    table = TINY if args.tiny else ROWS
    unknown = sorted(set(args.rows or ()) - set(table))
    if unknown:
        parser.error(f"unknown rows {unknown}; the rows are {sorted(table)}")
    interpret = "tpu" if args.tiny else None
    versions = {"installed": mosaic_forward, "other": load_other(args.other)}
    print(f"devices {jax.devices()}; the other forward: {args.other}")
    for name in args.rows or table:
        row = table[name]
        batch, heads, kv_heads, seq, head_dim, _, _, documents = row
        rng = np.random.default_rng(0)
        q, k, v = (
            jnp.asarray(rng.standard_normal((batch, n, seq, head_dim)), jnp.bfloat16)
            for n in (heads, kv_heads, kv_heads)
        )
        ids = document_ids(rng, batch, seq, documents) if documents else None
        inputs = (q, k, v, ids)
        compiled = {key: compile_with(m, row, inputs, interpret) for key, m in versions.items()}
        equal = bool(jnp.array_equal(compiled["installed"](*inputs), compiled["other"](*inputs)))
        times = {key: [] for key in versions}
        for _ in range(2):
            for key in versions:
                times[key] += time_calls(compiled[key], inputs, args.calls, args.rounds)
        median = {key: statistics.median(t) for key, t in times.items()}
        record = {
            "row": name,
            "installed_ms": round(median["installed"], 4),
            "other_ms": round(median["other"], 4),
            "installed_over_other": round(median["installed"] / median["other"], 4),
            "bit_equal": equal,
            "range_ms": {key: [round(min(t), 4), round(max(t), 4)] for key, t in times.items()},
        }
        print(json.dumps(record), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
