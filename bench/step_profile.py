"""Where a training step's device time goes, op by op: a `jax.profiler` trace of it, read back.

    python bench/step_profile.py [--model gpt2-small] [--batch 16] [--seq-len 1024]
                                 [--attention auto] [--remat attention] [--loss-chunk N]
                                 [--engine gspmd] [--steps 5] [--top 40] [--depth 2]
                                 [--hlo FILE] [--trace-dir DIR] [--set NAME=VALUE ...]

Runs the Trainer's one-device step (``--engine``: GSPMD, as ``bench/step_parts.py``, or
shard_map) ``--steps`` times under ``jax.profiler.trace`` after a warm-up, and reads the trace
back with ``jax.profiler.ProfileData`` (no TensorBoard needed). Every op the device ran is grouped:

- by op, the ``--top`` ops by device time per step: the HLO instruction's name, what it is
  (``fusion`` and its kind, ``convolution``, ``custom-call``), its output shape, and the line of
  Dew's code it came from (the compiled HLO's stack-frame tables: ``rotary.py:rotate:124``), with
  its JAX primitive and ``(bwd)`` for an op of the backward;
- by where it came from: the same time summed over the innermost ``--depth`` frames of each op.

Loops (``while``) are printed first with their whole time: the ops inside them are counted in the
tables once, on their own. Times are per step (the sum over the trace divided by ``--steps``); the
step's own wall time and the ops' summed time are printed beside them, so what the ops leave idle
shows too. A Pallas kernel's op carries the kernel's name. ``--hlo`` writes the compiled step's HLO
text, for reading an op in full; ``--trace-dir`` keeps the trace (TensorBoard reads it). On a
backend whose trace has no device plane (the CPU), the host's XLA threads stand in, which time ops
but overlap them.
"""

from __future__ import annotations

import argparse
import collections
import glob
import re
import statistics
import tempfile
import time

import jax
import numpy as np
import optax

from dew import MeshSpec, Trainer, models
from dew.models.presets import preset
from dew.objectives.lm import LMObjective
from dew.training.flops import model_flops_per_token, peak_flops

NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
OP_NAME = re.compile(r'op_name="([^"]*)"')
FRAME = re.compile(r"stack_frame_id=(\d+)")
KIND = re.compile(r"kind=(k\w+)")
TARGET = re.compile(r'custom_call_target="([^"]*)"')
CONTAINERS = {"while", "conditional", "call"}


def hlo_instructions(hlo_text: str) -> dict[str, dict]:
    """Every instruction of the HLO text by name: its opcode (a fusion's kind, a custom call's
    target beside it), output shape, ``op_name`` metadata and stack frame."""
    found = {}
    for line in hlo_text.splitlines():
        m = NAME.match(line)
        if not m:
            continue
        name, rest = m.group(1), line[m.end() :]
        # The shape: one token, or a tuple "(...)" whose parts hold parentheses of their own.
        depth, end = 0, 0
        for end, char in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(char, 0)
            if char == " " and depth == 0:
                break
        shape, opcode = rest[:end], rest[end + 1 :].split("(", 1)[0]
        if not opcode.replace("-", "").isalnum():
            continue
        what = opcode
        if kind := KIND.search(line):
            what += f" {kind.group(1)[1:]}"
        if target := TARGET.search(line):
            what += f" {target.group(1)}"
        op_name = OP_NAME.search(line)
        frame = FRAME.search(line)
        found[name] = dict(
            what=what,
            shape=shape,
            op_name=op_name.group(1) if op_name else "",
            frame=int(frame.group(1)) if frame else None,
        )
    return found


def device_op_times(trace_dir: str) -> tuple[dict[str, list[float]], str]:
    """``{op name: [durations in ms]}`` from the trace's device plane (``/device:TPU:0``'s or a
    GPU's "XLA Ops" line), or the host's XLA threads where no device plane has one; and which."""
    path = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0]
    data = jax.profiler.ProfileData.from_file(path)
    times = collections.defaultdict(list)
    for plane in data.planes:
        if not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            if line.name != "XLA Ops":
                continue
            for event in line.events:
                # A TPU names the event by the instruction's whole HLO text, a GPU by its name.
                times[event.name.lstrip("%").split(" ", 1)[0]].append(event.duration_ns / 1e6)
        if times:
            return times, plane.name
    for plane in data.planes:
        if plane.name != "/host:CPU":
            continue
        for line in plane.lines:
            if "XLA" not in line.name and "PjRt" not in line.name:
                continue
            for event in line.events:
                hlo_op = dict(event.stats).get("hlo_op")
                if hlo_op:
                    times[hlo_op].append(event.duration_ns / 1e6)
    return times, "/host:CPU (XLA threads; they overlap)"


def stack_frames(hlo_text: str) -> dict[int, list[str]]:
    """``{stack_frame_id: ["file.py:function:line", ...]}``, innermost frame first, from the
    FileNames, FunctionNames, FileLocations and StackFrames tables at the head of the HLO text."""
    tables = collections.defaultdict(dict)
    section = None
    for line in hlo_text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = line
            continue
        if not line.strip():
            section = None
            continue
        if section:
            key, _, value = line.partition(" ")
            tables[section][int(key)] = value
    files = {k: v.strip('"').rsplit("/", 1)[-1] for k, v in tables["FileNames"].items()}
    functions = {k: v.strip('"').rsplit(".", 1)[-1] for k, v in tables["FunctionNames"].items()}

    def field(value: str, name: str) -> int:
        return int(re.search(rf"{name}=(\d+)", value).group(1))

    def where(value: str) -> str:
        file = files.get(field(value, "file_name_id"), "?")
        function = functions.get(field(value, "function_name_id"), "?")
        return f"{file}:{function}:{field(value, 'line')}"

    locations = {k: where(v) for k, v in tables["FileLocations"].items()}
    frames = {}
    for frame in tables["StackFrames"]:
        chain, seen, at = [], set(), frame
        while at in tables["StackFrames"] and at not in seen:
            seen.add(at)
            value = tables["StackFrames"][at]
            chain.append(locations.get(field(value, "file_location_id"), "?"))
            # The table names a parent by its id plus one (0: none).
            at = field(value, "parent_frame_id") - 1
        frames[frame] = chain
    return frames


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-small")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--remat", default=None, help="the preset's policy if not given")
    parser.add_argument("--loss-chunk", type=int, default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--engine", default="gspmd", choices=["gspmd", "shard_map"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hlo", default=None, help="write the compiled step's HLO text here")
    parser.add_argument("--trace-dir", default=None, help="keep the trace here (TensorBoard's)")
    parser.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="NAME=VALUE",
        help="more model settings (e.g. num_layers=2 for a check on the CPU)",
    )
    args = parser.parse_args(argv)

    config = {**preset(args.model), "attention_impl": args.attention, "dtype": args.dtype}
    if args.remat:
        config["remat"] = args.remat
    if args.loss_chunk:
        config["loss_chunk_tokens"] = args.loss_chunk
    for item in args.set:
        name, _, value = item.partition("=")
        config[name] = int(value) if value.isdigit() else value
    model = models.build("causal_transformer", **config)
    print(
        f"seed {args.seed}; {args.model}, batch {args.batch} x {args.seq_len}, attention "
        f"{model.attention_impl}, remat {model.remat}, loss chunk {model.loss_chunk_tokens}, "
        f"{jax.devices()[0].device_kind}"
    )
    trainer = Trainer(
        LMObjective(model, args.seq_len),
        optax.adamw(1e-3),
        key=jax.random.key(args.seed),
        mesh=MeshSpec(),
        engine=args.engine,
        devices=jax.devices()[:1],
    )
    rng = np.random.default_rng(args.seed)
    rows = rng.integers(0, model.vocab_size, (args.batch, args.seq_len + 1)).astype(np.int32)
    state = trainer.init_state()
    step = trainer.compiled_step(args.batch)
    hlo = step.as_text()
    if args.hlo:
        with open(args.hlo, "w") as f:
            f.write(hlo)
    instructions = hlo_instructions(hlo)
    data = trainer.device_batch(rows, args.batch)
    state, metrics = step(state, data)
    jax.block_until_ready(metrics)
    trace_dir = args.trace_dir or tempfile.mkdtemp(prefix="dew-profile-")
    walls = []
    with jax.profiler.trace(trace_dir):
        for _ in range(args.steps):
            began = time.perf_counter()
            state, metrics = step(state, data)
            jax.block_until_ready(metrics)
            walls.append(time.perf_counter() - began)
    frames = stack_frames(hlo)

    def origin(name: str, depth: int) -> str:
        """Where op ``name`` came from: its innermost ``depth`` frames of Dew's code, and whether
        it runs in the backward (a transpose in its ``op_name``)."""
        info = instructions.get(name)
        if not info:
            return name.rsplit(".", 1)[0]
        chain = frames.get(info["frame"], [])[:depth]
        primitive = info["op_name"].rsplit("/", 1)[-1] if info["op_name"] else info["what"]
        label = " < ".join(chain) if chain else info["what"]
        backward = " (bwd)" if "transpose(" in info["op_name"] else ""
        return f"{label} [{primitive}]{backward}"

    times, source = device_op_times(trace_dir)
    # Loops and calls hold the ops they run: their time is their ops', counted once, below them.
    loops = {
        name: durations
        for name, durations in times.items()
        if instructions.get(name, {}).get("what", "").split(" ")[0] in CONTAINERS
    }
    for name in loops:
        del times[name]
    wall = 1e3 * statistics.median(walls)
    busy = sum(sum(t) for t in times.values()) / args.steps
    tokens = args.batch * args.seq_len
    flops = model_flops_per_token(model, args.seq_len) * tokens
    halved = model_flops_per_token(model, args.seq_len, causal_halved=True) * tokens
    device = jax.devices()[0]
    peak = peak_flops(getattr(device, "device_kind", device.platform))
    mfu = (
        f", MFU {100 * flops / (wall / 1e3) / peak:.1f}% PaLM, "
        f"{100 * halved / (wall / 1e3) / peak:.1f}% causal-halved"
        if peak
        else ""
    )
    print(
        f"step {wall:.1f} ms (median wall of {args.steps}, traced){mfu}; ops summed {busy:.1f} "
        f"ms a step on {source}"
    )
    for name, durations in sorted(loops.items(), key=lambda kv: -sum(kv[1])):
        ms = sum(durations) / args.steps
        print(
            f"  {instructions[name]['what']} {name}: {ms:.1f} ms a step, the ops inside it "
            f"included ({origin(name, args.depth)})"
        )

    per_op = sorted(times.items(), key=lambda kv: -sum(kv[1]))
    print(f"\nTop {args.top} ops, ms a step (share of the step's wall time):")
    print(f"{'ms':>8} {'share':>6} {'calls':>5}  {'op':<24} {'what':<24} {'shape':<30} from")
    for name, durations in per_op[: args.top]:
        info = instructions.get(name, dict(what="?", shape="?"))
        ms = sum(durations) / args.steps
        print(
            f"{ms:8.2f} {100 * ms / wall:5.1f}% {len(durations) // args.steps:5d}  {name[:24]:<24} "
            f"{info['what'][:24]:<24} {info['shape'][:30]:<30} {origin(name, 1)}"
        )

    by_origin = collections.defaultdict(float)
    for name, durations in times.items():
        by_origin[origin(name, args.depth)] += sum(durations) / args.steps
    print(f"\nBy where it came from (the innermost {args.depth} frames), ms a step:")
    for label, ms in sorted(by_origin.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"{ms:8.2f} {100 * ms / wall:5.1f}%  {label}")


if __name__ == "__main__":
    main()
