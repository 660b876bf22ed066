"""``dew generate``: completions of prompts by a trained model, decoded with a KV cache on the
devices (``dew.generation``).

    dew generate runs/dew-train --prompt "Once upon a time" --max-new-tokens 64
    dew generate Llama-3.2-1B-Instruct --chat --prompt "Name three rivers." --temperature 0.7
    dew generate runs/sft --prompts prompts.jsonl --output completions.jsonl --mesh fsdp=4,tensor=2

SOURCE is a run directory of ``dew train`` (its latest step, or ``--step``), a Dew checkpoint
directory or a Hugging Face Llama folder. A LoRA run generates with its adapters on its frozen
base, unmerged, the int8 base as int8 (``dew.models.checkpoint.load_lora``). The tokenizer is the
one the run kept (``checkpoints/tokenizer/``, ``dew.cli.convert.keep_tokenizer``) or the Hugging
Face folder's ``tokenizer.json``; the byte tokenizer where the run trained on bytes; ``--tokenizer``
overrides. The flags are read here; the loading and decoding are the library's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dew.cli.flags import add_device_flag, add_mesh_flag, add_min_shard_flag

SOURCE = "model and checkpoint"
PROMPTS = "prompts"
SAMPLING = "sampling"
DEVICES = "devices and mesh"
OUTPUT = "output"


def add_parser(commands) -> argparse.ArgumentParser:
    """Adds ``generate`` to the ``dew`` command's subparsers."""
    parser = commands.add_parser(
        "generate",
        help="complete prompts with a trained model (a run, a Dew checkpoint or a Hugging Face "
        "folder), decoded with a KV cache on the devices",
        description="Completes each prompt with the model of SOURCE: a run directory of dew "
        "train (its latest step, or --step), a Dew checkpoint directory, or a Hugging Face "
        "Llama folder. Greedy by default; --temperature samples. Prompts of different lengths "
        "run as one batch (left-padded, the padding never attended). The completions are "
        "printed, and with --output written as JSON lines {prompt, completion, completion_ids}.",
    )
    parser.add_argument(
        "source", help="a run directory, a Dew checkpoint directory or a Hugging Face folder"
    )
    groups = {t: parser.add_argument_group(t) for t in (SOURCE, PROMPTS, SAMPLING, DEVICES, OUTPUT)}
    source = groups[SOURCE]
    source.add_argument(
        "--step", type=int, default=None, help="the checkpoint step (default: the latest)"
    )
    source.add_argument(
        "--tokenizer",
        default=None,
        metavar="T",
        help="bytes, a tokenizer.json file or a folder holding one (default: the run's kept "
        "tokenizer, the Hugging Face folder's tokenizer.json, or bytes)",
    )
    source.add_argument(
        "--merge-lora",
        action="store_true",
        help="a LoRA run: fold the adapters into the base first (W + alpha/R A B, an int8 base "
        "dequantized); default: the adapters run beside the base as they trained",
    )
    prompts = groups[PROMPTS]
    prompts.add_argument(
        "--prompt",
        action="append",
        default=[],
        metavar="TEXT",
        help="a prompt (repeat the flag for several, run as one batch)",
    )
    prompts.add_argument(
        "--prompts",
        default=None,
        metavar="FILE",
        help='a .jsonl file, one prompt a line: {"prompt": TEXT} (or a bare JSON string)',
    )
    prompts.add_argument(
        "--chat",
        action="store_true",
        help="wrap each prompt as a user's message in the tokenizer's chat template "
        "(tokenizer_config.json's chat_template; needs jinja2)",
    )
    sampling = groups[SAMPLING]
    sampling.add_argument(
        "--max-new-tokens",
        type=int,
        default=64,
        metavar="N",
        help="at most N new tokens a prompt (default 64)",
    )
    sampling.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        metavar="T",
        help="0 (default): greedy; above 0: sample from softmax(logits / T)",
    )
    sampling.add_argument(
        "--top-k",
        type=int,
        default=0,
        metavar="K",
        help="sample among the K most likely tokens (default 0: all)",
    )
    sampling.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        metavar="P",
        help="then among the fewest whose probability reaches P (default 1.0: all)",
    )
    sampling.add_argument("--seed", type=int, default=0, help="the sampling seed (default 0)")
    sampling.add_argument(
        "--stop",
        action="append",
        default=None,
        metavar="TOKEN",
        help="a token (its string or its id) that ends a completion, kept in it; repeat for "
        "several (default: the model's eos_token_id, else the tokenizer's end-of-text "
        "token)",
    )
    devices = groups[DEVICES]
    add_device_flag(devices)
    add_mesh_flag(devices)
    add_min_shard_flag(devices)
    groups[OUTPUT].add_argument(
        "--output",
        default=None,
        metavar="FILE",
        help="write one JSON object a prompt: prompt, completion, completion_ids",
    )
    parser.set_defaults(run=generate_command)
    return parser


def read_prompts(args) -> list[str]:
    """``--prompt`` s then ``--prompts``' lines; ``ValueError`` naming the flag for none, or a
    line that is not a prompt."""
    prompts = list(args.prompt)
    if args.prompts is not None:
        path = Path(args.prompts)
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"--prompts {path} line {number} is not JSON: {error}") from None
            if isinstance(value, dict):
                value = value.get("prompt")
            if not isinstance(value, str):
                raise ValueError(
                    f'--prompts {path} line {number}: expected {{"prompt": TEXT}} or a JSON string'
                )
            prompts.append(value)
    if not prompts:
        raise ValueError("no prompt: give --prompt TEXT or --prompts FILE.jsonl")
    return prompts


def check_flags(args) -> None:
    """The sampling flags' ranges, by the flags' names, before anything loads."""
    from dew.generation import check_sampling

    names = {
        "temperature": "--temperature",
        "top_k": "--top-k",
        "top_p": "--top-p",
        "max_new_tokens": "--max-new-tokens",
    }
    check_sampling(args.temperature, args.top_k, args.top_p, args.max_new_tokens, names)
    if args.step is not None and args.step < 0:
        raise ValueError(f"--step must be 0 or more, got {args.step}")


def hf_source(path: str) -> bool:
    from dew.models import hf

    return hf.is_hf_folder(path)


def load_source(path: str, step: int | None, merge: bool):
    """``(model, params, adapters, tokenizer_path, carried)`` of SOURCE: ``adapters`` ``None``
    but for an unmerged LoRA run; ``tokenizer_path`` the kept or the folder's tokenizer.json,
    ``None`` where there is none; ``carried`` the run's kept config fields (eos_token_id)."""
    from dew.checkpoints import DamagedLatestStepError
    from dew.models import hf
    from dew.models.checkpoint import checkpoint_directory

    if hf.is_hf_folder(path):
        if step is not None:
            raise ValueError(f"--step {step}: {path} is a Hugging Face folder, which has no steps")
        # The attention kernels where the devices take them, as dew train's default.
        model, params = hf.load(path, attention_impl="auto")
        tokenizer = Path(path) / "tokenizer.json"
        config = hf.read_config(path)
        return model, params, None, tokenizer if tokenizer.is_file() else None, config
    directory = checkpoint_directory(path)
    try:
        return _load_dew(directory, step, merge)
    except DamagedLatestStepError as error:  # said with this command's flag
        raise error.naming("generate from one with --step N") from None


def _load_dew(directory, step, merge):
    from dew.cli.convert import TOKENIZER_DIR, read_carried
    from dew.models.checkpoint import checkpoint_model, load_checkpoint, load_lora

    tokenizer = directory / TOKENIZER_DIR / "tokenizer.json"
    tokenizer = tokenizer if tokenizer.is_file() else None
    carried = read_carried(directory)
    _, model, _ = checkpoint_model(directory, step)
    if model.lora is not None and not merge:
        model, base, adapters = load_lora(directory, step)
        return model, base, adapters, tokenizer, carried
    model, params = load_checkpoint(directory, step)
    return model, params, None, tokenizer, carried


def encode_prompt(tokenizer, text: str, special: bool) -> list[int]:
    """``text``'s ids; ``special``: with the tokens the tokenizer's post-processor adds (a
    Hugging Face model's beginning-of-text), as transformers encodes a prompt."""
    inner = getattr(tokenizer, "_tokenizer", None)
    if special and inner is not None:
        return inner.encode(text, add_special_tokens=True).ids
    return tokenizer.encode(text)


def default_stops(carried: dict, tokenizer) -> list[int]:
    """The model's end-of-text ids (``eos_token_id`` of its config.json or of the run's kept
    fields, one or a list), else the tokenizer's, else none."""
    eos = carried.get("eos_token_id")
    if isinstance(eos, int):
        return [eos]
    if isinstance(eos, list) and all(isinstance(e, int) for e in eos):
        return list(eos)
    return [] if tokenizer.eos_id is None else [tokenizer.eos_id]


def chat_prompts(prompts: list[str], tokenizer_path) -> list[str]:
    """Each prompt as a user's message in the chat template of ``tokenizer_config.json`` beside
    ``tokenizer_path``, with the assistant's turn opened (``add_generation_prompt``)."""
    where = None if tokenizer_path is None else Path(tokenizer_path)
    where = where / "tokenizer.json" if where is not None and where.is_dir() else where
    config = None if where is None else where.parent / "tokenizer_config.json"
    template = None
    special = {}
    if config is not None and config.is_file():
        data = json.loads(config.read_text())
        template = data.get("chat_template")
        for name in ("bos_token", "eos_token"):
            value = data.get(name)
            special[name] = value.get("content") if isinstance(value, dict) else value or ""
    if not template:
        raise ValueError(
            f"--chat: the tokenizer ({where or 'bytes'}) has no chat template "
            "(tokenizer_config.json's chat_template)"
        )
    try:
        import jinja2
    except ImportError:
        raise ValueError("--chat needs jinja2: pip install jinja2") from None
    render = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(template)
    return [
        render.render(
            messages=[{"role": "user", "content": text}], add_generation_prompt=True, **special
        )
        for text in prompts
    ]


def out_of_memory_line(error: BaseException, prompts: int, mesh) -> str | None:
    """One line for XLA saying the generation does not fit the devices' memory (what it could
    not have, and the flags that shrink it); ``None`` for any other error."""
    from dew.benchmark.measure import bytes_text, figures_in, out_of_memory

    if not out_of_memory(error):
        return None
    needed, available = figures_in(str(error))
    what = "generating does not fit the device's memory"
    if needed is not None:
        what += f" (it needs {bytes_text(needed)}"
        what += ")" if available is None else f", the device has {bytes_text(available)})"
    return (
        f"{what}: the weights and a KV cache for {prompts} prompts; give fewer prompts a run, a "
        "smaller --max-new-tokens, or split the weights over more devices (--mesh fsdp=N or "
        f"tensor=N; now {mesh_text(mesh)})"
    )


def mesh_text(mesh) -> str:
    sizes = {name: getattr(mesh, name) for name in ("data", "fsdp", "tensor")}
    return ",".join(f"{n}={v}" for n, v in sizes.items() if v not in (None, 1)) or "one device"


def generate_command(args) -> int:
    import jax

    from dew.cli.flags import default_mesh
    from dew.generation import Completion, Generator, drawable, stop_ids_of, tokenizer_of
    from dew.layout import Layout
    from dew.mesh import MeshSpec

    check_flags(args)
    prompts = read_prompts(args)
    mesh = MeshSpec.parse(default_mesh(args.mesh, jax.device_count()))
    model, params, adapters, found, carried = load_source(args.source, args.step, args.merge_lora)
    spec = args.tokenizer or (str(found) if found is not None else "bytes")
    tokenizer = tokenizer_of(spec)
    texts = chat_prompts(prompts, None if spec == "bytes" else spec) if args.chat else prompts
    # A Hugging Face model's prompt starts as transformers starts it (its beginning-of-text);
    # a chat template writes its own, and a Dew run's token folder has none.
    special = hf_source(args.source) and not args.chat
    ids = [encode_prompt(tokenizer, text, special) for text in texts]
    longest = max(map(len, ids))
    if longest + args.max_new_tokens > model.max_seq_len:
        raise ValueError(
            f"--max-new-tokens {args.max_new_tokens} after the longest prompt ({longest} tokens) "
            f"exceeds the model's context of {model.max_seq_len} tokens; give at most "
            f"{max(model.max_seq_len - longest, 0)}"
        )
    stop = default_stops(carried, tokenizer) if args.stop is None else None
    stop = stop if stop is not None else stop_ids_of(args.stop, tokenizer)
    generator = Generator(model, params, adapters, mesh=mesh, layout=Layout(args.min_shard))
    try:
        new = generator(
            ids,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            stop_ids=stop,
            vocab=drawable(model, tokenizer),
        )
    except Exception as error:  # XLA's out of memory: the batch or the cache too big, one line
        line = out_of_memory_line(error, len(prompts), mesh)
        if line is None:
            raise
        raise ValueError(line) from None
    records = [Completion(p, tokenizer.decode(n), n).as_json() for p, n in zip(prompts, new)]
    for i, record in enumerate(records):
        print(f"--- prompt {i + 1}: {record['prompt']!r}")
        print(record["completion"])
    sys.stdout.flush()
    if args.output is not None:
        with open(args.output, "w", encoding="utf-8") as out:
            for record in records:
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
        print(f"wrote {len(records)} completions to {args.output}")
    return 0
