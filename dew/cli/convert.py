"""``dew convert``: a Hugging Face Llama folder to a Dew checkpoint and back; and what ``dew train
--init-from`` does with either.

    dew convert Llama-3.2-1B ckpt/llama                 # HF folder -> Dew checkpoint (step 0)
    dew convert runs/x/checkpoints hf-out --to hf       # a Dew checkpoint -> HF folder
    dew train --init-from Llama-3.2-1B --data tokens/   # fine-tune from either

A converted checkpoint holds the weights alone (``{"params": ...}``, metadata ``contents:
"params"``) and records its model; a checkpoint of ``dew train`` holds the whole training state,
whose ``.params`` are the weights. Either converts back, and either starts ``dew train``.
The conversion runs in one process, on its devices (``--cpu-devices``; the weights are put on the
first of them).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from dew.cli.flags import add_device_flag


def add_parser(commands) -> argparse.ArgumentParser:
    """Adds ``convert`` to the ``dew`` command's subparsers."""
    parser = commands.add_parser(
        "convert",
        help="convert a Hugging Face Llama folder to a Dew checkpoint, or back with --to hf",
        description="Converts a Hugging Face Llama folder (config.json and safetensors weights) "
        "into a Dew checkpoint directory (one step, 0, of the weights alone), or with --to hf a "
        "Dew checkpoint directory (of dew convert or dew train) into a Hugging Face folder.",
    )
    parser.add_argument("source", help="a Hugging Face folder, or a Dew checkpoint directory")
    parser.add_argument("dest", help="the Dew checkpoint directory or Hugging Face folder to write")
    parser.add_argument(
        "--to",
        choices=("dew", "hf"),
        default="dew",
        help="dew (default): SOURCE is a Hugging Face folder; hf: SOURCE is a Dew checkpoint",
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="the weights' dtype in the Dew checkpoint (default float32; --to dew)",
    )
    parser.add_argument(
        "--step", type=int, default=None, help="the step to convert (default: the latest; --to hf)"
    )
    parser.add_argument(
        "--max-shard-bytes",
        type=int,
        default=None,
        metavar="N",
        help="largest safetensors file (default 5 GB, as save_pretrained); --to hf",
    )
    add_device_flag(parser)
    parser.set_defaults(run=convert_command)
    return parser


def convert_command(args) -> int:
    if args.to == "dew":
        to_checkpoint(args.source, args.dest, dtype=args.dtype)
        print(f"Wrote {args.source} as a Dew checkpoint (step 0) in {args.dest}")
    else:
        written = to_hf(
            args.source, args.dest, step=args.step, max_shard_bytes=args.max_shard_bytes
        )
        print(f"Wrote {', '.join(written)} to {args.dest}")
    return 0


def to_checkpoint(folder, directory, dtype: str = "float32") -> None:
    """The Hugging Face folder ``folder`` as step 0 of a new Dew checkpoint ``directory``."""
    from dew.checkpoints import Checkpoints
    from dew.models import hf

    checkpoints = Checkpoints(directory)
    if checkpoints.latest is not None:
        raise FileExistsError(f"{directory} already holds checkpoints {checkpoints.steps}")
    model, params = hf.load(folder, dtype=dtype)
    metadata = {"contents": "params", "model": hf.describe(model), "converted_from": str(folder)}
    checkpoints.save(0, params, metadata=metadata)
    checkpoints.wait()


def checkpoint_model(directory, step: int | None = None):
    """``(checkpoints, model, prefix)`` of a Dew checkpoint directory: the model its metadata
    records, and where its weights are (``hf.params_prefix``)."""
    from dew.checkpoints import Checkpoints
    from dew.models import hf

    checkpoints = Checkpoints(directory)
    if checkpoints.latest is None:
        raise ValueError(f"{directory} holds no Dew checkpoint")
    metadata = checkpoints.metadata(step)
    model = hf.model_of_metadata(metadata, f"the checkpoint in {directory}")
    return checkpoints, model, hf.params_prefix(checkpoints, step)


def restore_params(checkpoints, model, prefix: str, shardings, step: int | None = None):
    """The weights of a Dew checkpoint laid out by ``shardings`` (a tree shaped like them)."""
    import jax

    from dew.models.causal_transformer import resolve_dtype

    abstract = jax.eval_shape(model.init, jax.random.key(0))
    dtype = resolve_dtype(model.param_dtype)
    target = jax.tree_util.tree_map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, dtype, sharding=s), abstract, shardings
    )
    params, _ = checkpoints.restore(target, step, under=prefix)
    return params


def to_hf(directory, folder, step: int | None = None, max_shard_bytes: int | None = None):
    """Step ``step`` (default: the latest) of a Dew checkpoint as a Hugging Face folder."""
    import jax

    from dew.models import hf

    checkpoints, model, prefix = checkpoint_model(directory, step)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.eval_shape(model.init, jax.random.key(0))
    shardings = jax.tree_util.tree_map(lambda _: one, abstract)
    params = restore_params(checkpoints, model, prefix, shardings, step)
    extra = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
    return hf.save(model, params, folder, **extra)


# --- dew train --init-from ---------------------------------------------------------------------


def init_objective(objective, path):
    """``objective`` with the model of ``path`` (a Hugging Face folder's config.json, or the model
    a Dew checkpoint records), run as ``objective.model`` runs (attention, activations' dtype).
    The data's vocabulary (``objective.model.vocab_size``) must fit the model's."""
    from dew.models import hf

    run = objective.model
    if hf.is_hf_folder(path):
        model = hf.model_from_config(hf.read_config(path), f"{Path(path) / hf.CONFIG}")
    else:
        _, model, _ = checkpoint_model(path)
    model = dataclasses.replace(
        model,
        attention_impl=run.attention_impl,
        dtype=run.dtype,
        max_seq_len=max(model.max_seq_len, objective.seq_len),
    )
    if run.vocab_size > model.vocab_size:
        raise ValueError(
            f"the token folder's vocabulary of {run.vocab_size} does not fit the vocabulary "
            f"{model.vocab_size} of {path}: tokenize with that model's tokenizer.json"
        )
    return dataclasses.replace(objective, model=model)


def init_from(trainer, path) -> None:
    """Starts ``trainer``'s run from the weights of ``path`` (a Hugging Face folder or a Dew
    checkpoint directory), laid out on its mesh, with a fresh optimizer state: written as step 0
    of its checkpoints, from which ``fit`` starts. A run that already has checkpoints resumes from
    them instead (``path`` is not read)."""
    import jax
    import jax.numpy as jnp

    from dew.models import hf
    from dew.training.state import TrainState

    if trainer.checkpoints.latest is not None:
        print(f"--init-from {path}: resuming from {trainer.checkpoints.directory} instead")
        return
    shardings = trainer.state_shardings
    if hf.is_hf_folder(path):
        _, params = hf.load(path, trainer=trainer)
    else:
        checkpoints, model, prefix = checkpoint_model(path)
        mismatch = hf.architecture(model) != hf.architecture(trainer.objective.model)
        if mismatch:
            raise ValueError(f"the checkpoint in {path} is not the model being trained")
        params = restore_params(checkpoints, model, prefix, shardings.params)
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
    print(f"Initialized from {path}")
