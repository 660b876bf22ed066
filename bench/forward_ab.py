"""Dew's Mosaic forward against another version of its kernels, on one TPU, in one process.

    mkdir -p /tmp/before && git archive REV kernels | tar -x -C /tmp/before
    python -P bench/forward_ab.py /tmp/before/kernels [--rows causal8192 window ...] [--calls 20]
        [--rounds 5] [--json FILE] [--tiny]

For each row (``ROWS``: causal and windowed calls at 8192 keys, packed documents, GPT-2 small's and
Llama-3.2-1B's attention shapes), the call is compiled twice: once with the installed
`kernels.mosaic_forward` and once with the other folder's (loaded as a package of its own, so its
forward runs with its own helpers: `kernels.mosaic`, `kernels.schedule`...) in its place; the entry
point, the blocks and the tuning are the installed ones (so the other folder's forward must call
the installed `Tuning` as it is called now: folders whose forward passes ``Tuning.heads_per_step``
the key block and head_dim, since ``kernels.mosaic.FORWARD_LOGITS``; an older folder needs the Dew
of its own revision installed). Both run on the same bfloat16 inputs in the kernels' own layout
(``layout="bhsd"``), laid out in memory as the compiled program takes them (at head_dim 64, tiled
to 128 lanes; until 2026-12-06 the d64 rows also timed a copy of each input and of the output into
and out of that tiling). It prints whether the two outputs are equal to the bit, then the
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
import os
import statistics
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.layout import Format, Layout

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
    "causal": (1, 4, 2, 256, 128, None, (128, 128), 0),
    "window": (1, 4, 4, 256, 128, 100, (128, 128), 0),
    "docs": (1, 4, 4, 256, 128, None, (128, 128), 40),
}


def _attention_bench():
    """bench/attention.py as a module, for its ``document_ids`` (the same documents its rows
    use)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "attention.py")
    spec = importlib.util.spec_from_file_location("bench_attention", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def load_other(folder: str):
    """The Mosaic forward of the kernels folder ``folder``, imported inside a package of its own,
    ``kernels_other`` (its relative imports resolve inside that folder; the folder's
    ``__init__`` is not run: it imports the entry points, which this run takes from Dew)."""
    if not os.path.isfile(os.path.join(folder, "mosaic_forward.py")):
        raise SystemExit(f"{folder} is not a kernels folder: it has no mosaic_forward.py")
    for name in [n for n in sys.modules if n.split(".")[0] == "kernels_other"]:
        del sys.modules[name]  # another folder's, loaded before in this process
    package = types.ModuleType("kernels_other")
    package.__path__ = [os.path.abspath(folder)]
    sys.modules[package.__name__] = package
    return importlib.import_module("kernels_other.mosaic_forward")


def compile_with(module, row, inputs, interpret):
    """The jitted forward with ``module`` as the Mosaic forward. JAX caches traces of
    flash_attention's inner functions, so the caches are cleared first: the other module's trace
    would be reused otherwise. The arrays' layouts in memory are the compiler's choice
    (``Layout.AUTO``), and the inputs are laid out so before they are timed: at head_dim 64 the
    kernels read ``[..., seq, 64]`` tiled to 128 lanes, where a default array is not, and the
    program would otherwise time a copy of each input and of the output too."""
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
    auto = Format(Layout.AUTO)
    formats = (auto, auto, auto, None if ids is None else auto)
    try:
        return jax.jit(forward, in_shardings=formats, out_shardings=auto).lower(*inputs).compile()
    finally:
        attention_module._mosaic_forward = installed


def laid_out(compiled, inputs):
    """``inputs`` in the layouts ``compiled`` takes them in."""
    formats = compiled.input_formats[0]
    return tuple(x if x is None else jax.device_put(x, f) for x, f in zip(inputs, formats))


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
    parser.add_argument("other", help="another version of the kernels/ folder")
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
        ids = None
        if documents:
            ids = jnp.asarray(_attention_bench().document_ids(1, batch, seq, documents))
        inputs = (q, k, v, ids)
        compiled = {key: compile_with(m, row, inputs, interpret) for key, m in versions.items()}
        placed = {key: laid_out(c, inputs) for key, c in compiled.items()}
        # Fetched before converting: an output in the kernels' d64 tiling is not the layout a
        # default-compiled astype takes.
        outputs = [
            np.asarray(jax.device_get(compiled[key](*placed[key]))).astype(np.float32)
            for key in versions
        ]
        equal = bool(np.array_equal(*outputs))
        difference = float(np.max(np.abs(outputs[0] - outputs[1])))
        times = {key: [] for key in versions}
        for _ in range(2):
            for key in versions:
                times[key] += time_calls(compiled[key], placed[key], args.calls, args.rounds)
        median = {key: statistics.median(t) for key, t in times.items()}
        record = {
            "row": name,
            "installed_ms": round(median["installed"], 4),
            "other_ms": round(median["other"], 4),
            "installed_over_other": round(median["installed"] / median["other"], 4),
            "bit_equal": equal,
            "max_abs_difference": difference,
            "range_ms": {key: [round(min(t), 4), round(max(t), 4)] for key, t in times.items()},
        }
        print(json.dumps(record), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
