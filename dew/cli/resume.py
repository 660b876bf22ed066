"""Why ``dew train`` cannot resume the run in ``--run-dir`` with this command's flags, in the
flags' words: the checkpoint (``Trainer.place``) raises ``CheckpointMismatchError`` with the
state's paths (``.opt_state.mu['lora']...``) or, for a LoRA run, the two bases' checksums
(``dew.training.lora_base.BaseMismatchError``); ``mismatch`` names the flags whose values differ,
the run's value and this command's, and the two ways on: resume with the run's values, or start a
new run in another ``--run-dir``.

The run's values are those its latest checkpoint records (``metadata["model"]["config"]``, which
``Trainer.save`` writes).
"""

from __future__ import annotations

import dataclasses
import json

# The model fields a checkpoint's state depends on, by the dew train flag that sets each (the
# others, such as --remat or --lora-alpha, may change when a run resumes).
STATE_FLAGS = {
    "num_layers": "--layers",
    "emb_features": "--width",
    "num_heads": "--heads",
    "param_dtype": "--param-dtype",
    "num_experts": "--experts",
    "moe_every": "--moe-every",
}
LORA_STATE_FLAGS = {"rank": "--lora-rank", "targets": "--lora-targets"}
# LoRA flags a resumed run keeps though the state's shapes do not depend on them: the adapters'
# scale (alpha / rank) is part of the function they learned, and the base's dtype is the base
# they learned it on. (--lora-dropout may change, as a regularizer.)
LORA_KEPT_FLAGS = {"alpha": "--lora-alpha", "base_dtype": "--base-dtype"}

WAYS_ON = "or give another --run-dir to start a new run"


def saved_model(checkpoints) -> dict | None:
    """The model configuration the latest checkpoint in ``checkpoints`` records, or ``None``
    (none recorded, or unreadable)."""
    from dew.checkpoints.errors import CheckpointError

    try:
        return (checkpoints.metadata().get("model") or {}).get("config")
    except (CheckpointError, OSError, ValueError):
        return None


def flag_text(flag: str, value) -> str:
    """``value`` as the user types ``flag``: ``--lora-targets q_proj,v_proj``, ``no --lora-rank``
    (``None``)."""
    if value is None:
        return f"no {flag}"
    if isinstance(value, (list, tuple)):
        value = ",".join(value)
    if isinstance(value, float):
        value = f"{value:g}"  # --lora-alpha 16, as typed, not 16.0
    return f"{flag} {value}"


def state_flags(config: dict) -> dict:
    """``{flag: value}`` of the flags that set the state's shapes and dtypes, as the model
    configuration ``config`` holds them (``--lora-rank`` alone, ``None``, without LoRA)."""
    flags = {flag: config.get(field) for field, flag in STATE_FLAGS.items()}
    lora = config.get("lora")
    if lora is None:
        return {**flags, "--lora-rank": None}
    lora_flags = {**LORA_STATE_FLAGS, **LORA_KEPT_FLAGS}
    return {**flags, **{flag: lora.get(field) for field, flag in lora_flags.items()}}


def flags_mismatch(saved: dict | None, model, run_dir) -> str | None:
    """The line for resuming the run in ``run_dir``, whose latest checkpoint records the model
    configuration ``saved``, with this command's ``model`` when a flag that sets the state's
    shapes or dtypes (``STATE_FLAGS``, ``LORA_STATE_FLAGS``) or one a run keeps
    (``LORA_KEPT_FLAGS``) differs; ``None`` when they agree or nothing is recorded. Read from the
    checkpoint's metadata alone: ``dew train`` asks it before compiling anything. (Fields no flag
    of these sets, such as ``--remat``, may change when a run resumes.)"""
    if saved is None:
        return None
    now = json.loads(json.dumps(dataclasses.asdict(model)))  # as Trainer.save records it
    was_flags, now_flags = state_flags(saved), state_flags(now)
    if (saved.get("lora") is None) != (now.get("lora") is None):
        differ = ["--lora-rank"]  # the other LoRA flags go with it
    else:
        differ = [flag for flag in now_flags if now_flags[flag] != was_flags[flag]]
        if "--lora-rank" in differ and "--lora-alpha" in differ:
            differ.remove("--lora-alpha")  # its default follows the rank: say the rank alone
    if not differ:
        return None
    was = ", ".join(flag_text(flag, was_flags[flag]) for flag in differ)
    given = ", ".join(flag_text(flag, now_flags[flag]) for flag in differ)
    return (
        f"the run in {run_dir} was trained with {was}, and this command gives {given}: "
        f"resume it with {was}, {WAYS_ON}"
    )


def mismatch(error, saved: dict | None, model, run_dir, init_from: str | None) -> str:
    """The one line ``dew train`` says for ``error`` (a ``CheckpointMismatchError`` of resuming
    the run in ``run_dir``), given the run's model configuration ``saved`` (``saved_model``), this
    command's ``model`` and its ``--init-from``."""
    from dew.training.lora_base import BaseMismatchError

    now = json.loads(json.dumps(dataclasses.asdict(model)))  # as Trainer.save records it
    if isinstance(error, BaseMismatchError):
        return _base_mismatch(error, saved, now, run_dir, init_from)
    line = flags_mismatch(saved, model, run_dir)
    if line is not None:
        return line
    if saved is not None:
        fields = [f for f in now if f != "lora" and saved.get(f, now[f]) != now[f]]
        if fields:  # set by --model, --init-from or --data (the vocabulary), not a flag each
            what = ", ".join(f"{f} {saved[f]} (the run's) != {now[f]} (now)" for f in fields)
            return (
                f"the run in {run_dir} was trained with another model ({what}): resume it with "
                f"the --model or --init-from and the --data it was trained with, {WAYS_ON}"
            )
    # The same model: the optimizer's state differs (its flags are not recorded), or the run
    # recorded no model.
    return (
        f"the run in {run_dir} holds another training state than this command's ({error}): "
        "resume it with the flags it was trained with (the model's, --moments-dtype, "
        f"--master-weights), {WAYS_ON}"
    )


def _base_mismatch(error, saved: dict | None, now: dict, run_dir, init_from) -> str:
    """``BaseMismatchError``'s line: the LoRA base's dtype flag, or its configuration or weights
    (``base_checksum``'s two parts) changed in place, or another base given."""
    was_lora, now_lora = (saved or {}).get("lora") or {}, now.get("lora") or {}
    if was_lora.get("base_dtype") != now_lora.get("base_dtype"):
        was = flag_text("--base-dtype", was_lora.get("base_dtype"))
        given = flag_text("--base-dtype", now_lora.get("base_dtype"))
        return (
            f"the run in {run_dir} was trained on its base with {was}, and this command gives "
            f"{given}: resume it with {was}, {WAYS_ON}"
        )
    recorded, checksum = error.recorded, error.checksum
    theirs, ours = recorded.get("path"), error.path
    if theirs is None and ours is None:  # a base drawn from the run's key (no --init-from)
        return (
            f"the run in {run_dir} trained its adapters on a random base (no --init-from) of "
            f"checksum {recorded['checksum']}, and this command's random base has checksum "
            f"{checksum}: resume it with the --seed it was trained with, {WAYS_ON}"
        )
    if theirs != ours:
        trained = "a random base (no --init-from)" if theirs is None else f"--init-from {theirs}"
        return (
            f"the run in {run_dir} was trained on {trained}, checksum {recorded['checksum']}, "
            f"and this command's base, {flag_text('--init-from', init_from)}, has checksum "
            f"{checksum}: resume it with {trained}, {WAYS_ON}"
        )
    same_config = recorded["checksum"].split("-")[0] == checksum.split("-")[0]
    changed = "its weights changed" if same_config else "its configuration changed"
    return (
        f"the base --init-from {init_from} changed since the run in {run_dir} was trained on it "
        f"({changed}: checksum {recorded['checksum']} then, {checksum} now): put back the base "
        f"it was trained on to resume it, {WAYS_ON} on this base"
    )


# The fields of a saved data position (dew.data.windows) that a dew train flag sets.
POSITION_FLAGS = {"batch_size": "--batch", "seq_len": "--seq-len"}


def position_mismatch(differ: dict, run_dir) -> str:
    """Why a run cannot resume with this command's data flags (``DataPositionMismatch.differ``),
    and what to do: give the run's values again, or start a new run in another ``--run-dir``."""
    flags = {f: saved_now for f, saved_now in differ.items() if f in POSITION_FLAGS}
    if flags:
        was = ", ".join(f"{POSITION_FLAGS[f]} {saved}" for f, (saved, _) in flags.items())
        now = ", ".join(f"{POSITION_FLAGS[f]} {now}" for f, (_, now) in flags.items())
        return (
            f"the run in {run_dir} was trained with {was}, and this command gives {now}: "
            f"give {was} to resume it, or another --run-dir to start a new run"
        )
    # The flags agree, the data does not: another token folder (or the same one rewritten).
    what = "; ".join(f"{f} {was} (the run's) != {now} (now)" for f, (was, now) in differ.items())
    return (
        f"the run in {run_dir} was trained on other data ({what}): give the --data it was "
        "trained on to resume it, or another --run-dir to start a new run"
    )


def check(trainer, data, run_dir) -> None:
    """A run that this command's flags cannot resume, refused before anything compiles (fit
    would refuse it after the compile and the checkpoint's read): the model (``flags_mismatch``)
    and the data position the latest checkpoint records, against this command's."""
    from dew.checkpoints.errors import CheckpointError
    from dew.data.windows import DataPositionMismatch

    latest = trainer.checkpoints.latest
    if latest is None:
        return
    try:
        metadata = trainer.checkpoints.metadata(latest)
    except CheckpointError:  # a damaged step: fit falls back to an earlier one, and checks it
        return
    saved = (metadata.get("model") or {}).get("config")
    line = flags_mismatch(saved, trainer.objective.model, run_dir)
    if line is not None:
        raise ValueError(line)
    position = metadata.get("data_position")
    try:
        if position is not None:
            data.resume(position)
    except DataPositionMismatch as error:
        raise ValueError(position_mismatch(error.differ, run_dir)) from None
