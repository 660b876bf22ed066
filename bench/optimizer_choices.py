"""What each optimizer-state choice costs on one device: the state's bytes, where they live, the
compiled step's memory, and the step time.

    python bench/optimizer_choices.py [--model gpt2-small] [--batch 16] [--seq-len 1024]
                                      [--remat dots] [--calls 10] [--set num_layers=2 ...]

The choices (``dew.training.optimizer.adamw``, ``dew train``'s flags):

- ``float32``: float32 weights and AdamW moments (``dew train``'s default);
- ``moments bf16``: ``--moments-dtype bfloat16``;
- ``weights bf16``: ``--param-dtype bfloat16``, a float32 master of the norms' scales only;
- ``offload``: ``--optimizer-offload``, the moments in host memory (``pinned_host``);
- ``all three``: the three together.

Each row: the weights' and the optimizer state's bytes (device and host), the compiled step's
``memory_analysis`` (arguments and temporaries on the device, and the host's, as XLA reports
them), and the median of ``--calls`` steps after a warm-up (each to ``block_until_ready``), with
tokens/s and MFU (PaLM's count and causal attention halved, ``dew.training.flops``). Every
choice trains from the same weights on the same random tokens. On a CPU (``--set num_layers=2
emb_features=64 ...``) it only checks that the script runs: the CPU's "host memory" is its device
memory.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import jax
import numpy as np

from dew import MeshSpec, Trainer, models
from dew.models.presets import preset
from dew.objectives.lm import LMObjective
from dew.training.flops import model_flops_per_token, peak_flops
from dew.training.optimizer import adamw

CHOICES = {
    "float32": (dict(), "float32"),
    "moments bf16": (dict(moments_dtype="bfloat16"), "float32"),
    "weights bf16": (dict(), "bfloat16"),
    "offload": (dict(offload=True), "float32"),
    "all three": (dict(moments_dtype="bfloat16", offload=True), "bfloat16"),
}


def nbytes(tree, shardings=None, kind=None) -> int:
    """Bytes of the global arrays of ``tree``, only those whose sharding's memory kind is
    ``kind`` when given (``None`` memory kinds count as device memory)."""
    leaves = jax.tree_util.tree_leaves(tree)
    if shardings is None:
        return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in leaves)
    total = 0
    for x, s in zip(leaves, jax.tree_util.tree_leaves(shardings), strict=True):
        where = "pinned_host" if s.memory_kind == "pinned_host" else "device"
        if where == kind:
            total += math.prod(x.shape) * np.dtype(x.dtype).itemsize
    return total


def measure(config: dict, choice: str, batch: int, seq_len: int, calls: int, seed: int) -> dict:
    settings, param_dtype = CHOICES[choice]
    model = models.build("causal_transformer", **{**config, "param_dtype": param_dtype})
    trainer = Trainer(
        LMObjective(model, seq_len),
        adamw(1e-4, **settings),
        key=jax.random.key(seed),
        mesh=MeshSpec(),
        devices=jax.devices()[:1],
    )
    abstract = trainer._abstract_state
    opt_shardings = trainer.state_shardings.opt_state
    compiled = trainer.compiled_step(batch)
    memory = compiled.memory_analysis()
    row = {
        "weights_bytes": nbytes(abstract.params),
        "state_device_bytes": nbytes(abstract.opt_state, opt_shardings, "device"),
        "state_host_bytes": nbytes(abstract.opt_state, opt_shardings, "pinned_host"),
        "argument_bytes": getattr(memory, "argument_size_in_bytes", None),
        "temp_bytes": getattr(memory, "temp_size_in_bytes", None),
        "host_temp_bytes": getattr(memory, "host_temp_size_in_bytes", None),
    }
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, model.vocab_size, (batch, seq_len + 1)).astype(np.int32)
    data = trainer.device_batch(rows, batch)
    step = trainer.train_step(batch)
    state = trainer.init_state()
    state, metrics = step(state, data)  # warm-up (compiles this call's executable)
    jax.block_until_ready(metrics)
    times = []
    for _ in range(calls):
        began = time.perf_counter()
        state, metrics = step(state, data)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - began)
    row["step_ms"] = 1e3 * statistics.median(times)
    row["loss"] = float(metrics["loss"])
    del state
    return row


def gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-small")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--remat", default="dots")
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--choices", nargs="+", default=list(CHOICES), choices=list(CHOICES))
    parser.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="NAME=VALUE",
        help="more model settings (e.g. num_layers=2 emb_features=64 for a CPU check)",
    )
    args = parser.parse_args(argv)
    extra = {}
    for item in args.set:
        name, _, value = item.partition("=")
        extra[name] = int(value) if value.isdigit() else value
    config = {
        **preset(args.model),
        **extra,
        "max_seq_len": args.seq_len,
        "remat": args.remat,
        "attention_impl": args.attention,
    }
    device = jax.devices()[0]
    kind = getattr(device, "device_kind", device.platform)
    peak = peak_flops(kind)
    model = models.build("causal_transformer", **config)
    flops = model_flops_per_token(model, args.seq_len)
    halved = model_flops_per_token(model, args.seq_len, causal_halved=True)
    tokens = args.batch * args.seq_len
    print(
        f"device: {kind}, jax {jax.__version__}; {args.model} {extra or ''}, batch {args.batch} x "
        f"{args.seq_len}, remat {args.remat}; median of {args.calls} steps; GiB"
    )
    print(
        "| choice | weights | state (device) | state (host) | arguments | temporaries | "
        "step ms | tokens/s | MFU PaLM | MFU causal-halved | loss |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for choice in args.choices:
        row = measure(config, choice, args.batch, args.seq_len, args.calls, args.seed)
        seconds = row["step_ms"] / 1e3
        mfu = " | ".join(
            "-" if peak is None else f"{100 * count * tokens / seconds / peak:.1f}%"
            for count in (flops, halved)
        )
        print(
            f"| {choice} | {gib(row['weights_bytes'])} | {gib(row['state_device_bytes'])} | "
            f"{gib(row['state_host_bytes'])} | {gib(row['argument_bytes'])} | "
            f"{gib(row['temp_bytes'])} | {row['step_ms']:.1f} | {tokens / seconds:,.0f} | "
            f"{mfu} | {row['loss']:.4f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
