"""``dew convert``: a Hugging Face Llama folder to a Dew checkpoint and back, a LoRA run's
adapters to a PEFT adapter folder; and what ``dew train --init-from`` does with either. A model
with an attention window goes both ways as a Mistral folder (``sliding_window``:
``dew.models.hf_config``).

    dew convert Llama-3.2-1B ckpt/llama                 # HF folder -> Dew checkpoint (step 0)
    dew convert runs/x/checkpoints hf-out --to hf       # a Dew checkpoint -> HF folder
    dew convert runs/lora adapter --to peft             # a LoRA run -> PEFT adapter folder
    dew convert runs/lora adapter --to peft --base-out base   # ... and its base as an HF folder
    dew train --init-from Llama-3.2-1B --data tokens/   # fine-tune from either

A converted checkpoint holds the weights alone (``{"params": ...}``, metadata ``contents:
"params"``) and records its model; a checkpoint of ``dew train`` holds the whole training state,
whose ``.params`` are the weights. Either converts back, and either starts ``dew train``.
The conversion runs in one process, on its devices (``--cpu-devices``; the weights are put on the
first of them).

Tokenizer files travel with the weights: ``dew convert`` keeps the folder's (``TOKENIZER_FILES``)
in ``CKPT_DIR/tokenizer/``, ``dew train`` keeps there the tokenizer its token folder was written
with (``meta.json``'s ``tokenizer``, when it is a file), and ``--to hf`` copies them into the
Hugging Face folder, or says that the checkpoint has none.

The special tokens' ids travel the same way (``CARRIED_FILE``): ``dew convert`` and ``dew train
--init-from`` keep the ``bos_token_id``, ``eos_token_id`` and ``pad_token_id`` of the folder's
``config.json`` (or of the Dew checkpoint started from), ``dew train`` the end-of-text id of its
token folder where the source gave no ``eos_token_id``, and ``--to hf`` writes them into the
export's ``config.json``, or says that the checkpoint records none.

Layout: the command (``add_parser``, ``check_flags``, ``convert_command``), the tokenizer files
(``tokenizer_files``, ``keep_tokenizer``), the special tokens' ids (``read_carried``,
``keep_carried``, ``source_carried``), the three directions (``to_checkpoint``, ``to_hf``,
``to_peft``), then ``dew train --init-from`` (``init_source``, ``check_size_flags``, ``init_model``,
``init_from``). It is one module because the three directions and ``--init-from`` handle a source
alike (a damaged latest step, its tokenizer files and token ids); the formats live in
``dew.models.hf`` and ``dew.models.peft``.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import NamedTuple

from dew.cli.flags import DEVICES, add_device_flag, topics

# dew convert --help's heading of its own, beside dew.cli.flags' devices.
CONVERSION = "conversion"


def add_parser(commands) -> argparse.ArgumentParser:
    """Adds ``convert`` to the ``dew`` command's subparsers."""
    parser = commands.add_parser(
        "convert",
        help="convert a Hugging Face Llama folder to a Dew checkpoint, or back with --to hf, or "
        "a LoRA run's adapters to a PEFT adapter folder with --to peft",
        description="Converts a Hugging Face Llama or Mistral folder (config.json and "
        "safetensors weights) into a Dew checkpoint directory (one step, 0, of the weights "
        "alone); with --to hf a Dew checkpoint directory (of dew convert or dew train) into a "
        "Hugging Face folder (Mistral's, with sliding_window, for a model trained with "
        "--attention-window); with --to peft a LoRA run's checkpoint into a PEFT adapter folder.",
    )
    parser.add_argument("source", help="a Hugging Face folder, or a Dew checkpoint directory")
    parser.add_argument(
        "dest", help="the Dew checkpoint directory, Hugging Face folder or PEFT folder to write"
    )
    groups = topics(parser, CONVERSION, DEVICES)
    conversion = groups[CONVERSION]
    conversion.add_argument(
        "--to",
        choices=("dew", "hf", "peft"),
        default="dew",
        help="dew (default): SOURCE is a Hugging Face folder; hf: SOURCE is a Dew checkpoint (a "
        "LoRA run's: the merged model, base + alpha/R B A); peft: SOURCE is a LoRA run's "
        "checkpoint, written as a PEFT adapter folder",
    )
    conversion.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="the weights' dtype in the Dew checkpoint (default float32); --to dew only",
    )
    conversion.add_argument(
        "--step",
        type=int,
        default=None,
        help="the step to convert (default: the latest, refused when it is damaged); --to hf "
        "and --to peft",
    )
    conversion.add_argument(
        "--max-shard-bytes",
        type=int,
        default=None,
        metavar="N",
        help="largest safetensors file (default 5 GB; transformers 5's save_pretrained writes "
        "50 GB); --to hf only",
    )
    conversion.add_argument(
        "--base-out",
        default=None,
        metavar="FOLDER",
        help="--to peft only: write the run's base into FOLDER as a Hugging Face folder (Mistral "
        "with sliding_window for a windowed run), or check that FOLDER holds it, and name it as "
        "the adapter's base; needed when the base is a Dew checkpoint or lacks the run's window",
    )
    add_device_flag(groups[DEVICES])
    parser.set_defaults(run=convert_command)
    return parser


# The flags that apply to some values of --to only: (flag, attribute, the --to values).
_ONLY_FOR = (
    ("--dtype", "dtype", ("dew",)),
    ("--step", "step", ("hf", "peft")),
    ("--max-shard-bytes", "max_shard_bytes", ("hf",)),
    ("--base-out", "base_out", ("peft",)),
)


def check_flags(args) -> None:
    """``ValueError`` naming the flag when one is given with a ``--to`` it does not apply to
    (it would be ignored)."""
    for flag, name, applies in _ONLY_FOR:
        if getattr(args, name) is not None and args.to not in applies:
            where = " or ".join(f"--to {to}" for to in applies)
            raise ValueError(f"{flag} applies to {where} only, not --to {args.to}; leave it out")


def convert_command(args) -> int:
    check_flags(args)
    if args.to == "peft":
        export = to_peft(args.source, args.dest, step=args.step, base_out=args.base_out)
        if export.base_written:
            print(
                f"Wrote {', '.join(export.base_written)} to {args.base_out}: the run's base as a "
                "Hugging Face folder"
            )
        elif args.base_out is not None:
            print(f"{args.base_out} holds the run's base, bit for bit")
        on = (
            f"on the base {export.base}"
            if export.base is not None
            else "on the model's initial weights drawn from the run's key (the run named no base "
            "folder: base_model_name_or_path is null; --base-out FOLDER writes them as its base)"
        )
        print(f"Wrote {', '.join(export.written)} to {args.dest}: a PEFT adapter {on}")
        return 0
    if args.to == "dew":
        copied = to_checkpoint(args.source, args.dest, dtype=args.dtype or "float32")
        kept = f", with its {', '.join(copied)}" if copied else ", no tokenizer files beside it"
        print(f"Wrote {args.source} as a Dew checkpoint (step 0) in {args.dest}{kept}")
    else:
        written, copied, carried = to_hf(
            args.source, args.dest, step=args.step, max_shard_bytes=args.max_shard_bytes
        )
        print(f"Wrote {', '.join(written + copied)} to {args.dest}")
        if carried:
            ids = ", ".join(f"{field} {value}" for field, value in carried.items())
            print(f"config.json carries {ids}, as {args.source} records them")
        missing = [f for f in ("bos_token_id", "eos_token_id") if f not in carried]
        if missing:
            print(
                f"config.json has no {' or '.join(missing)}: {args.source} records none (its run "
                "started from no Hugging Face folder that gives it, and its tokens were not "
                "written with a tokenizer.json; or it was written before Dew kept them). Add "
                "them from the model's config.json if generation needs them"
            )
        if not copied:
            print(
                f"No tokenizer files: {args.source} records none (its run read bytes or the "
                "example corpus, or it was written before Dew kept them). Copy tokenizer.json "
                f"and tokenizer_config.json from the model's folder into {args.dest}"
            )
    return 0


# --- Tokenizer files ---------------------------------------------------------------------------

# The files of a Hugging Face folder that make up its tokenizer, copied where they exist.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# Where a Dew checkpoint directory keeps them (beside its step folders, which it alone lists).
TOKENIZER_DIR = "tokenizer"


def _copy_files(pairs) -> list[str]:
    """Copies each ``(source, dest)`` file, refusing to overwrite; returns the dest names."""
    import shutil

    taken = [str(dest) for _, dest in pairs if dest.exists()]
    if taken:
        raise FileExistsError(f"{', '.join(taken)} already exists; not overwriting")
    for source, dest in pairs:
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, dest)
    return [dest.name for _, dest in pairs]


def tokenizer_files(folder) -> list[Path]:
    """The tokenizer files (``TOKENIZER_FILES``) that ``folder`` holds."""
    return [Path(folder) / name for name in TOKENIZER_FILES if (Path(folder) / name).is_file()]


def keep_tokenizer(checkpoint_dir, data_dir) -> list[str]:
    """Keeps the tokenizer of the token folder ``data_dir`` in ``checkpoint_dir/tokenizer/``
    when its ``meta.json`` names a tokenizer file that still exists (``dew tokenize
    --tokenizer``), with the ``tokenizer_config.json`` and ``special_tokens_map.json`` beside
    it; nothing for bytes, or when the checkpoint directory has a tokenizer already (a resumed
    run). Its end-of-text id (``meta.json``'s ``eos_id``) is kept as the export's
    ``eos_token_id`` where the run's source gave none (``keep_carried``). Returns the names
    copied."""
    from dew.data import read_meta

    kept = Path(checkpoint_dir) / TOKENIZER_DIR
    meta = read_meta(data_dir)
    source = Path(meta.tokenizer)
    if kept.exists() or not source.is_file():
        return []
    pairs = [(source, kept / TOKENIZER_FILES[0])]
    if source.name == TOKENIZER_FILES[0]:  # a model's folder: its companions too
        pairs += [(f, kept / f.name) for f in tokenizer_files(source.parent) if f != source]
    copied = _copy_files(pairs)
    if meta.eos_id is not None:
        keep_carried(checkpoint_dir, {"eos_token_id": meta.eos_id}, replace=False)
    return copied


# --- The special tokens' ids ---------------------------------------------------------------------

# Where a Dew checkpoint directory keeps the config.json fields its export carries
# (``hf_config.CARRIED_FIELDS``: the special tokens' ids), beside its step folders.
CARRIED_FILE = "hf_carried.json"


def read_carried(checkpoint_dir) -> dict:
    """The ``config.json`` fields ``checkpoint_dir`` keeps for its export (``CARRIED_FILE``;
    empty when it keeps none)."""
    import json

    from dew.models.hf_config import carried_fields

    path = Path(checkpoint_dir) / CARRIED_FILE
    if not path.is_file():
        return {}
    try:
        fields = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} cannot be read as JSON ({error})") from None
    if not isinstance(fields, dict):
        raise ValueError(f"{path} is not a JSON object")
    return carried_fields(fields, str(path))


def keep_carried(checkpoint_dir, fields: dict, *, replace: bool) -> dict:
    """Adds ``fields`` to those ``checkpoint_dir`` keeps for its export: over the ones kept
    (``replace``: the source's own ids), or only where none is kept yet (a tokenizer's
    end-of-text id, which the source's gives way to). Returns what it now keeps."""
    import json

    kept = read_carried(checkpoint_dir)
    kept = {**kept, **fields} if replace else {**fields, **kept}
    if kept:
        path = Path(checkpoint_dir) / CARRIED_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(kept, indent=2) + "\n")
    return kept


def source_carried(path) -> dict:
    """The special tokens' ids of ``path``, a Hugging Face folder (its ``config.json``'s) or a
    Dew checkpoint directory (those it keeps)."""
    from dew.models import hf

    if hf.is_hf_folder(path):
        return hf.carried_fields(hf.read_config(path), str(Path(path) / hf.CONFIG))
    return read_carried(path)


def to_checkpoint(folder, directory, dtype: str = "float32") -> list[str]:
    """The Hugging Face folder ``folder`` as step 0 of a new Dew checkpoint ``directory``, its
    tokenizer files kept in ``directory/tokenizer/``. Returns those files' names."""
    from dew.checkpoints import Checkpoints
    from dew.models import hf

    folder = Path(folder)
    if not folder.is_dir():
        raise (FileNotFoundError if not folder.exists() else NotADirectoryError)(
            f"{folder} is not a folder" if folder.exists() else f"{folder} does not exist"
        )
    checkpoints = Checkpoints(directory)
    if checkpoints.latest is not None:
        raise FileExistsError(f"{directory} already holds checkpoints {checkpoints.steps}")
    model, params = hf.load(folder, dtype=dtype)
    carried = source_carried(folder)
    metadata = {"contents": "params", "model": hf.describe(model), "converted_from": str(folder)}
    checkpoints.save(0, params, metadata=metadata)
    checkpoints.wait()
    keep_carried(directory, carried, replace=True)
    kept = Path(directory) / TOKENIZER_DIR
    if kept.exists():
        return []
    return _copy_files([(f, kept / f.name) for f in tokenizer_files(folder)])


def to_hf(directory, folder, step: int | None = None, max_shard_bytes: int | None = None):
    """Step ``step`` (default: the latest) of a Dew checkpoint (or of the run directory holding
    it) as a Hugging Face folder, with the tokenizer files and the special tokens' ids
    (``read_carried``) the checkpoint keeps. Returns ``(weights and config written, tokenizer
    files copied, config.json fields carried)``."""
    from dew.checkpoints import DamagedLatestStepError
    from dew.models import hf
    from dew.models.checkpoint import checkpoint_directory, load_checkpoint

    directory = checkpoint_directory(directory)
    tokenizer = tokenizer_files(directory / TOKENIZER_DIR)
    taken = [f.name for f in tokenizer if (Path(folder) / f.name).exists()]
    if taken:  # refused before the weights are written, not after
        raise FileExistsError(f"{folder} already holds {', '.join(taken)}; not overwriting")
    carried = read_carried(directory)
    try:
        model, params = load_checkpoint(directory, step)
    except DamagedLatestStepError as error:
        raise error.naming("export one with --step N") from None
    extra = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
    written = hf.save(model, params, folder, carried=carried, **extra)
    return written, _copy_files([(f, Path(folder) / f.name) for f in tokenizer]), carried


class PeftExport(NamedTuple):
    """What ``to_peft`` wrote: the adapter's files, the base it names (``None``: null) and the
    files written into ``base_out`` (none when it held the base already, or was not given)."""

    written: list[str]
    base: str | None
    base_written: list[str]


def _window(window) -> str:
    return "no attention window" if window is None else f"an attention window of {window}"


def _base_refusal(model, path) -> str | None:
    """Why the base a LoRA run records at ``path`` cannot be the adapter's
    ``base_model_name_or_path`` (``None`` when it can, or names none): a Dew checkpoint, which
    transformers cannot load, or a Hugging Face folder whose window is not the run's, on which
    transformers would run the adapter without the window trained with (or with another)."""
    from dew.models import hf

    if path is None or not Path(path).is_dir():  # none: null; missing: load_lora says so
        return None
    if not hf.is_hf_folder(path):
        return (
            f"the run's base {path} is a Dew checkpoint, which transformers cannot load as the "
            "adapter's base_model_name_or_path"
        )
    where = str(Path(path) / hf.CONFIG)
    theirs = hf.model_from_config(hf.read_config(path), where).attention_window
    if theirs != model.attention_window:
        return (
            f"the run trained with {_window(model.attention_window)} (--attention-window) on "
            f"the base {path}, whose {hf.CONFIG} has {_window(theirs)}: transformers would run "
            "the adapter on it "
            + ("without the window" if theirs is None else "with another window than the one")
            + " trained with"
        )
    return None


def to_peft(directory, folder, step: int | None = None, base_out=None) -> PeftExport:
    """Step ``step`` (default: the latest) of a LoRA run's checkpoint as a PEFT adapter folder
    (``dew.models.peft``) that transformers loads on the base the run trained on.

    The adapter's ``base_model_name_or_path`` is the Hugging Face folder the run's base was read
    from; ``None`` (null) for a base drawn from the run's key. A base transformers would not
    give the run's model (``_base_refusal``: a Dew checkpoint, or a folder without the run's
    attention window) is a ``ValueError`` asking for ``base_out``: with it, the base the run
    held (an int8 base dequantized, as ``--to hf`` merges it) is written there as a Hugging Face
    folder (Mistral's, with ``sliding_window``, for a windowed run), or, where ``base_out``
    holds a model already, checked to hold those weights; the adapter names its absolute path.

    The base is read and held to the checksum the checkpoint records (``load_lora``), as resuming
    and ``--to hf`` do: a base changed in place is a ``CheckpointMismatchError``. A damaged
    latest step (``step=None``) raises ``DamagedLatestStepError`` naming the intact steps: an
    older step's adapters are not exported in its place."""
    import jax
    import jax.numpy as jnp

    from dew.checkpoints import DamagedLatestStepError
    from dew.models import hf, lora, peft
    from dew.models.checkpoint import checkpoint_directory, checkpoint_model, load_lora

    directory = checkpoint_directory(directory)
    checkpoints, model, _ = checkpoint_model(directory, step)
    if model.lora is None:
        raise ValueError(
            f"--to peft: the checkpoint in {directory} is not a LoRA run's (it trained every "
            "weight); --to hf exports it"
        )
    path = (checkpoints.metadata(step).get("lora_base") or {}).get("path")
    refusal = _base_refusal(model, path)
    if refusal is not None and base_out is None:
        mistral = " as a Mistral folder" if model.attention_window is not None else ""
        raise ValueError(
            f"--to peft: {refusal}; give --base-out FOLDER to write the run's base there{mistral} "
            "(or name a folder that holds it), which the adapter then names"
        )
    taken = [n for n in (peft.CONFIG, peft.WEIGHTS) if (Path(folder) / n).exists()]
    if taken:  # refused before the base is read or written, not after
        raise FileExistsError(f"{folder} already holds {', '.join(taken)}; not overwriting")
    try:
        model, base, adapters = load_lora(directory, step)
    except DamagedLatestStepError as error:
        raise error.naming("export one with --step N") from None
    base_written: list[str] = []
    if base_out is not None:
        plain = dataclasses.replace(model, lora=None)  # keeps the window: Mistral's config
        held = base
        if model.lora.base_dtype == "int8":  # dequantized: merged with zero adapters
            zeros = jax.tree_util.tree_map(jnp.zeros_like, adapters)
            held = jax.jit(lambda b, a: lora.merge(model, b, a))(base, zeros)
        if hf.is_hf_folder(base_out):
            _check_base_out(plain, held, base_out, path)
        else:
            tokenizer = [
                (f, Path(base_out) / f.name) for f in tokenizer_files(directory / TOKENIZER_DIR)
            ]
            taken = [str(dest) for _, dest in tokenizer if dest.exists()]
            if taken:  # refused before the weights are written, not after
                raise FileExistsError(f"{', '.join(taken)} already exists; not overwriting")
            base_written = hf.save(plain, held, base_out, carried=read_carried(directory))
            base_written += _copy_files(tokenizer)
        path = str(Path(base_out).resolve())
    return PeftExport(peft.save(model, adapters, folder, path), path, base_written)


def _check_base_out(plain, held, base_out, recorded) -> None:
    """``ValueError`` unless the Hugging Face folder ``base_out`` describes ``plain`` (the
    run's model, its window included) and holds the weights ``held``, bit for bit."""
    import jax
    import numpy as np

    from dew.models import hf

    config = hf.read_config(base_out)
    theirs = hf.model_from_config(config, str(Path(base_out) / hf.CONFIG)).attention_window
    if theirs != plain.attention_window:
        raise ValueError(
            f"--base-out {base_out} has {_window(theirs)} where the run trained with "
            f"{_window(plain.attention_window)}: give a new folder, and the base is written there"
        )
    _, there = hf.load(
        base_out,
        model=plain,
        shardings=jax.tree_util.tree_map(
            lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), held
        ),
    )
    same = jax.tree_util.tree_map(
        lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)), there, held
    )
    if not all(jax.tree_util.tree_leaves(same)):
        raise ValueError(
            f"--base-out {base_out} holds other weights than the run's base "
            f"({recorded or 'drawn from the run key'}): give a new folder, and the base is "
            "written there"
        )


# --- dew train --init-from ---------------------------------------------------------------------


def init_source(path):
    """``(is_hf, model)`` of ``dew train --init-from PATH``: a Hugging Face folder's
    ``config.json`` model, or the model a Dew checkpoint directory records. ``ValueError``
    saying which it is when PATH is missing, a file (naming the folder that holds it), or a
    folder that is neither."""
    from dew.models import hf
    from dew.models.checkpoint import checkpoint_model

    where = Path(path)
    if not where.exists():
        raise ValueError(f"--init-from {path}: no such file or folder")
    if not where.is_dir():
        raise ValueError(
            f"--init-from {path} is a file; give the folder of a Hugging Face model (with its "
            f"{hf.CONFIG}) or a Dew checkpoint directory, e.g. --init-from {where.parent}"
        )
    if hf.is_hf_folder(where):
        return True, hf.model_from_config(hf.read_config(where), f"{where / hf.CONFIG}")
    from dew.checkpoints import Checkpoints

    if Checkpoints(where).latest is None:
        entries = sorted(p.name for p in where.iterdir())
        shown = ", ".join(entries[:6]) + (
            f" and {len(entries) - 6} more" if len(entries) > 6 else ""
        )
        raise ValueError(
            f"--init-from {path} is neither a Hugging Face model folder (no {hf.CONFIG}) nor a "
            f"Dew checkpoint directory (no step_NNNNNNNN folder); it holds {shown or 'nothing'}"
        )
    _, model, _ = checkpoint_model(where)
    return False, model


# --init-from's model is the folder's: each of these flags, when given, must say what it says.
_SIZE_FLAGS = {
    "layers": ("num_layers", "layers"),
    "width": ("emb_features", "width"),
    "heads": ("num_heads", "heads"),
    "experts": ("num_experts", "experts"),
}


def check_size_flags(args, model, path) -> None:
    """``ValueError`` naming both values when a flag that sets the model's sizes (``--model``,
    ``--layers``, ``--width``, ``--heads``, ``--experts``) disagrees with the model of
    ``--init-from`` ``path``: that model is the one trained."""
    from dew.models.causal_transformer import ARCHITECTURE_FIELDS
    from dew.models.presets import preset

    differ = []
    for flag, (field, words) in _SIZE_FLAGS.items():
        given = getattr(args, flag, None)
        if given and given != getattr(model, field):
            differ.append(f"--{flag} {given} (it has {getattr(model, field)} {words})")
    if args.model:
        from dew import models

        named = models.build("causal_transformer", **preset(args.model))
        fields = [f for f in ARCHITECTURE_FIELDS if getattr(named, f) != getattr(model, f)]
        if fields:
            shown = ", ".join(
                f"{f} {getattr(named, f)} where it has {getattr(model, f)}" for f in fields[:3]
            )
            more = f" and {len(fields) - 3} more" if len(fields) > 3 else ""
            differ.append(f"--model {args.model} ({shown}{more})")
    if differ:
        raise ValueError(
            f"--init-from {path} sets the model trained, and "
            + "; ".join(differ)
            + (" disagrees" if len(differ) == 1 else " disagree")
            + " with it: leave "
            + ("it" if len(differ) == 1 else "them")
            + " out"
        )


def init_model(args, model, path, data_vocab: int):
    """The model ``dew train --init-from`` trains: ``model`` (of ``init_source``) run as the
    flags ask (``--dtype``, ``--param-dtype``, ``--remat``, ``--attention``, ...: the model's
    choices; ``--dtype`` and ``--attention`` default to the example decoder's float32 and
    XLA), its context kept unless ``--extend-context`` lengthens it to ``--seq-len``.
    ``ValueError`` when ``--seq-len`` passes the context without it, or the token folder's
    vocabulary ``data_vocab`` does not fit the model's."""
    from dew.cli.model_flags import _MODEL_CHOICE_FLAGS, check_window
    from dew.models.causal_transformer import CausalTransformer

    defaults = {f.name: f.default for f in dataclasses.fields(CausalTransformer)}
    runs = {"dtype": defaults["dtype"], "attention_impl": defaults["attention_impl"]}
    for flag, field in _MODEL_CHOICE_FLAGS.items():  # --dtype, --remat, ... where given
        if getattr(args, flag, None) is not None:
            runs[field] = getattr(args, flag)
    from dew.cli.lora_flags import lora_config

    lora = lora_config(args, base=model)  # --lora-rank: adapters on the folder's weights, frozen
    if lora is not None:
        runs["lora"] = lora
    context = model.max_seq_len
    if args.seq_len > context:
        if not args.extend_context:
            raise ValueError(
                f"--seq-len {args.seq_len} is above the context of {path}, {context} tokens "
                "(max_position_embeddings); give --extend-context to train on longer rows, or a "
                f"--seq-len of at most {context}"
            )
        runs["max_seq_len"] = args.seq_len
        print(
            f"--extend-context: the context goes from {context} to {args.seq_len} tokens (the "
            f"model's max_seq_len, and max_position_embeddings in a --to hf export); the rotary "
            f"frequencies (rope_theta, rope scaling) stay as they are, so positions past "
            f"{context} are ones the model was not trained on",
            flush=True,
        )
    elif args.extend_context:
        print(
            f"--extend-context: changes nothing: --seq-len {args.seq_len} is within the "
            f"context of {path}, {context} tokens",
            flush=True,
        )
    context = runs.get("max_seq_len", context)
    check_window(args, context, f"the context of {path}, {context} tokens")
    if data_vocab > model.vocab_size:
        raise ValueError(
            f"the token folder's vocabulary of {data_vocab} does not fit the vocabulary "
            f"{model.vocab_size} of {path}: tokenize with that model's tokenizer.json"
        )
    return dataclasses.replace(model, **runs)


def init_from(trainer, path) -> None:
    """Starts ``trainer``'s run from the weights of ``path`` (a Hugging Face folder or a Dew
    checkpoint directory), laid out on its mesh, with a fresh optimizer state: written as step 0
    of its checkpoints, from which ``fit`` starts, with the special tokens' ids ``path`` gives
    kept for the export (``source_carried``). A run that already has checkpoints resumes from
    them instead (``path`` is not read)."""
    import jax
    import jax.numpy as jnp

    from dew.checkpoints import DamagedLatestStepError
    from dew.models import hf
    from dew.models.checkpoint import checkpoint_model, restore_params
    from dew.training.state import TrainState

    if trainer.checkpoints.latest is not None:
        print(f"--init-from {path}: resuming from {trainer.checkpoints.directory} instead")
        return
    carried = source_carried(path)  # read (and checked) before anything is written
    shardings = trainer.state_shardings
    if hf.is_hf_folder(path):
        _, params = hf.load(path, trainer=trainer)
    else:
        checkpoints, model, prefix = checkpoint_model(path)
        mismatch = hf.architecture(model) != hf.architecture(trainer.objective.model)
        if mismatch:
            raise ValueError(f"the checkpoint in {path} is not the model being trained")
        try:
            params = restore_params(checkpoints, model, prefix, shardings.params)
        except DamagedLatestStepError as error:
            raise error.naming(
                f"--init-from reads the latest step: dew convert {path} FOLDER --to hf --step N "
                "exports one, for --init-from FOLDER"
            ) from None
    opt_state = jax.jit(trainer.optimizer.init, out_shardings=shardings.opt_state)(params)
    state = TrainState(
        step=jax.device_put(jnp.zeros((), jnp.int32), shardings.step),
        params=params,
        opt_state=opt_state,
        ema=params if trainer.objective.ema_decay is not None else None,
        key=trainer.key,
    )
    trainer.save(state)
    trainer.checkpoints.wait()
    keep_carried(trainer.checkpoints.directory, carried, replace=True)
    print(f"Initialized from {path}")
