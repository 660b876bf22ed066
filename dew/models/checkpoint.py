"""A trained model back from its Dew checkpoint: ``load_checkpoint``.

    import dew

    model, params = dew.load_checkpoint("runs/dew-train")           # the latest step
    model, params = dew.load_checkpoint("runs/dew-train", step=200)
    logits = model.apply(params, tokens)                             # [batch, seq, vocab]

A checkpoint of ``dew train`` (``Trainer.save``) records its model in its metadata (``"model"``:
the ``CausalTransformer``'s fields) and holds the whole training state, whose ``.params`` are the
weights; a checkpoint of ``dew convert`` holds the weights alone (metadata ``"contents":
"params"``). Either loads. ``dew convert --to hf`` and ``dew train --init-from`` read checkpoints
through the same two functions, ``checkpoint_model`` and ``restore_params``.

A LoRA run's checkpoint holds its adapters and names its frozen base: ``load_lora`` gives both,
and ``read_lora_base`` reads a base (for it and for a ``Trainer``, ``dew.training.lora_base``).
"""

from __future__ import annotations

import os
from pathlib import Path

# A run directory of dew train keeps its checkpoints here (RUN_DIR/checkpoints).
RUN_CHECKPOINTS = "checkpoints"


def checkpoint_directory(path: str | os.PathLike) -> Path:
    """The checkpoint directory of ``path``: ``path/checkpoints`` when ``path`` is a run
    directory of ``dew train`` (``--run-dir``), else ``path`` itself. ``FileNotFoundError`` when
    ``path`` does not exist, ``NotADirectoryError`` when it is a file."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    if not path.is_dir():
        raise NotADirectoryError(f"{path} is a file, not a run or checkpoint directory")
    inner = path / RUN_CHECKPOINTS
    return inner if inner.is_dir() and not _has_steps(path) else path


def _has_steps(directory: Path) -> bool:
    from dew.checkpoints import Checkpoints

    return Checkpoints(directory).latest is not None


def checkpoint_model(directory, step: int | None = None):
    """``(checkpoints, model, prefix)`` of a Dew checkpoint directory: the model its metadata
    records, and where its weights are (``hf.params_prefix``). ``ValueError`` naming the steps
    there are when ``step`` is not one of them, or when ``directory`` holds no checkpoint."""
    from dew.checkpoints import Checkpoints
    from dew.models import hf

    checkpoints = Checkpoints(directory)
    steps = checkpoints.steps
    if not steps:
        raise ValueError(f"{directory} holds no Dew checkpoint (no step_NNNNNNNN folder)")
    if step is not None and step not in steps:
        raise ValueError(f"{directory} has no step {step}; its steps are {_few_steps(steps)}")
    metadata = checkpoints.metadata(step)
    model = hf.model_of_metadata(metadata, f"the checkpoint in {directory}")
    return checkpoints, model, hf.params_prefix(checkpoints, step)


def _few_steps(steps: list[int]) -> str:
    shown = ", ".join(str(s) for s in steps[-8:])
    return ("..., " if len(steps) > 8 else "") + shown


def restore_params(checkpoints, model, prefix: str, shardings, step: int | None = None):
    """The weights of a Dew checkpoint laid out by ``shardings`` (a tree shaped like them), in
    the model's ``param_dtype``: step ``step``, or the latest. A damaged latest step raises
    ``dew.checkpoints.DamagedLatestStepError`` (naming it and the intact steps): an older step is
    another model, which a load or an export must not give in its place (resuming a run falls
    back; ``Checkpoints.restore``)."""
    import jax

    from dew.models.causal_transformer import resolve_dtype

    abstract = jax.eval_shape(model.init, jax.random.key(0))
    dtype = resolve_dtype(model.param_dtype)
    target = jax.tree_util.tree_map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, dtype, sharding=s), abstract, shardings
    )
    params, _ = checkpoints.restore(target, step, under=prefix, fall_back=False)
    return params


def load_checkpoint(run_dir: str | os.PathLike, step: int | None = None):
    """``(model, params)`` of a Dew checkpoint, for inference or export.

    Args:
      run_dir: a run directory of ``dew train`` (its ``--run-dir``, which holds
        ``checkpoints/``), or a checkpoint directory itself (``Trainer(checkpoints=...)``'s, or
        one ``dew convert`` wrote).
      step: the step to load (default: the latest complete one).

    Returns:
      ``(model, params)``: the ``CausalTransformer`` the checkpoint records and its weights
      ``{"params": ...}`` on one device (``jax.devices()[0]``), in the model's ``param_dtype``:
      ``model.apply(params, tokens)`` gives float32 logits ``[batch, seq, vocab]``. A LoRA run's
      checkpoint gives the merged model: its model without ``lora`` and the base with the
      adapters folded in (``W + alpha / R * A @ B``, an int8 base dequantized first:
      ``lora.merge``); ``load_lora`` gives base and adapters apart.

    Raises:
      FileNotFoundError: ``run_dir`` is missing (``NotADirectoryError``: it is a file).
      ValueError: a directory with no checkpoint, a ``step`` it does not have (naming the steps
        it has), or a checkpoint written before Dew recorded its model.
      dew.checkpoints.CorruptCheckpointError: a damaged step; with ``step=None`` and the latest
        step damaged, its kind ``DamagedLatestStepError``, naming the intact steps (never an
        older step loaded in its place: give ``step=N`` to load one).

    Examples:
        >>> import jax.numpy as jnp
        >>> from dew import load_checkpoint
        >>> model, params = load_checkpoint("runs/dew-train")  # dew train's default --run-dir
        >>> logits = model.apply(params, jnp.array([[1, 2, 3]]))  # [1, 3, vocab_size] float32
    """
    import dataclasses

    import jax

    from dew.checkpoints import DamagedLatestStepError

    directory = checkpoint_directory(run_dir)
    checkpoints, model, prefix = checkpoint_model(directory, step)
    try:
        if model.lora is not None:
            from dew.models import lora

            model, base, adapters = load_lora(directory, step)
            merged = jax.jit(lambda b, a: lora.merge(model, b, a))(base, adapters)
            return dataclasses.replace(model, lora=None), merged
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        abstract = jax.eval_shape(model.init, jax.random.key(0))
        shardings = jax.tree_util.tree_map(lambda _: one, abstract)
        return model, restore_params(checkpoints, model, prefix, shardings, step)
    except DamagedLatestStepError as error:
        raise error.naming("load_checkpoint(..., step=N)") from None


def load_lora(run_dir: str | os.PathLike, step: int | None = None):
    """``(model, base, adapters)`` of a LoRA run's checkpoint, on one device: its model (with
    ``lora`` set), the frozen base it names (``metadata["lora_base"]``: read again from its path,
    a Dew checkpoint's at the step recorded, or drawn from the run's key when it had none, and
    checked against the recorded checksum) and
    the adapters (``{"lora": ...}``, float32). ``lora.combine(model, base, adapters)`` runs them
    joined; ``lora.merge`` folds the adapters into the base. ``ValueError`` for a checkpoint of no
    LoRA run, and ``CheckpointMismatchError`` when the base found is not the one recorded."""
    import jax

    from dew.checkpoints.errors import CheckpointMismatchError
    from dew.models import lora

    directory = checkpoint_directory(run_dir)
    checkpoints, model, prefix = checkpoint_model(directory, step)
    if model.lora is None:
        raise ValueError(
            f"the checkpoint in {directory} is not a LoRA run's (its model has no lora)"
        )
    metadata = checkpoints.metadata(step)
    recorded = metadata.get("lora_base") or {}
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.eval_shape(lambda k: lora.init_adapters(model, k), jax.random.key(0))
    target = jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one), abstract
    )
    adapters, _ = checkpoints.restore(target, step, under=prefix, fall_back=False)
    key = None
    if recorded.get("path") is None:  # the base was the model's initial weights from the run's key
        data = jax.ShapeDtypeStruct((2,), jax.numpy.uint32, sharding=one)
        key_data, _ = checkpoints.restore(data, step, under=".key", fall_back=False)
        key = jax.random.wrap_key_data(key_data)
    shardings = jax.tree_util.tree_map(
        lambda _: one,
        jax.eval_shape(lambda k: lora.frozen_of(model, model.init(k)), jax.random.key(0)),
    )
    base = read_lora_base(model, recorded.get("path"), shardings, key, recorded.get("step"))
    checksum = lora.base_checksum(model, base)
    if recorded.get("checksum") != checksum:
        raise CheckpointMismatchError(
            f"the checkpoint in {directory} was trained on the base {recorded.get('path')} "
            f"(checksum {recorded.get('checksum')}), and what is there now has checksum "
            f"{checksum}: it is another base"
        )
    return model, base, adapters


# --- A LoRA run's frozen base ---------------------------------------------------------------


def float_shardings(shardings):
    """The frozen base's shardings with each ``Quantized`` replaced by its ``values``' sharding:
    those of the weights before they are quantized (the same shapes)."""
    import jax

    from dew.nn.int8 import Quantized

    def quantized(x) -> bool:
        return isinstance(x, Quantized)

    return jax.tree_util.tree_map(
        lambda x: x.values if quantized(x) else x, shardings, is_leaf=quantized
    )


def read_lora_base(model, path, shardings, key, step: int | None = None) -> dict:
    """The frozen base of the LoRA ``model`` laid out by ``shardings``: read from ``path`` (a
    Hugging Face Llama folder, quantized as it is read when the base is int8:
    ``dew.models.hf.load``; or a Dew checkpoint directory of the same model, its step ``step``
    (default: the latest), quantized on the devices), or, with ``path`` ``None``, the model's
    initial weights from ``key``. ``ValueError`` naming the difference when the source is another
    model, or naming the steps there are when the checkpoint has no step ``step``; a damaged step
    is a ``CorruptCheckpointError`` naming the base (never another step read in its place)."""
    import dataclasses

    import jax

    from dew.checkpoints import CorruptCheckpointError, DamagedLatestStepError
    from dew.models import hf, lora

    if path is None:
        init = jax.jit(lambda k: lora.frozen_of(model, model.init(k)), out_shardings=shardings)
        return init(key)
    plain = dataclasses.replace(model, lora=None)
    int8 = model.lora.base_dtype == "int8"
    if hf.is_hf_folder(path):  # an int8 base quantized box by box as it is read
        _, params = hf.load(path, model=plain, shardings=shardings)
        return params
    checkpoints, saved, prefix = checkpoint_model(checkpoint_directory(path), step)
    if saved.lora is not None:
        raise ValueError(
            f"base {path} is a LoRA run (its checkpoint holds adapters, not a model's weights): "
            "export it merged (dew convert RUN OUT --to hf) and give that folder as the base"
        )
    if hf.architecture(saved) != hf.architecture(plain):
        raise ValueError(f"base {path}: the checkpoint is not the model being trained")
    try:
        params = restore_params(checkpoints, plain, prefix, float_shardings(shardings), step)
    except DamagedLatestStepError as error:
        # Not the caller's latest step (the adapters'): a step of the base, which no flag of
        # the caller names. Said as the base's damage.
        raise CorruptCheckpointError(f"the LoRA base {path}: {error.message}") from None
    if not int8:
        return params
    return jax.jit(lambda p: lora.frozen_of(model, p), out_shardings=shardings)(params)
