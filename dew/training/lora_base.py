"""A LoRA run's frozen base: read where ``Trainer(base=...)`` says, named in each checkpoint, and
checked when the run resumes.

A checkpoint of a LoRA run holds the adapters and their optimizer state (``TrainState.frozen`` is
left out: it is the base, which may be 16 GB and is on disk already). Its metadata names the base
(``"lora_base"``: ``{"path": ..., "checksum": ..., "step": ...}``): ``path`` the base's absolute
path (resolved when the ``Trainer`` is built, so the export and ``load_lora`` find it from any
working directory; ``None`` for a base drawn from the run's key), ``step`` the step of a Dew
checkpoint directory the base was read from (its latest when the run started; absent for a
Hugging Face folder), which resuming and ``load_lora`` read again, so a base run that writes
another step later changes nothing; ``dew.models.lora.base_checksum`` makes the checksum: a CRC-32
of the base's configuration and a hash of every bit of its weights as the state holds them (int8
where the base is int8), the same in every layout. Resuming reads the base again and refuses to go
on when its checksum is not the recorded one: adapters trained on one base mean nothing on
another.
"""

from __future__ import annotations

from pathlib import Path

from dew.checkpoints.errors import CheckpointMismatchError
from dew.models import lora
from dew.models.checkpoint import checkpoint_directory, read_lora_base


class BaseMismatchError(CheckpointMismatchError):
    """The checkpoint a LoRA run resumes from was trained on another base: ``recorded``, the
    checkpoint's ``"lora_base"`` (``path``, ``checksum``); ``path`` and ``checksum``, this run's
    base (``None``: drawn from the run's key) and its ``base_checksum``, ``"CONFIG-WEIGHTS"``."""

    def __init__(self, message: str, recorded: dict, path: str | None, checksum: str):
        super().__init__(message)
        self.recorded, self.path, self.checksum = recorded, path, checksum


def resolved(base) -> str | None:
    """``Trainer(base=...)`` as the run keeps it: the absolute path, symlinks resolved (``None``
    stays ``None``)."""
    return None if base is None else str(Path(base).resolve())


def load(trainer, recorded: dict | None = None) -> dict:
    """The frozen base of ``trainer``'s LoRA model, laid out by its ``state_shardings.frozen``:
    ``dew.models.checkpoint.read_lora_base`` of ``trainer.base``; for a Dew checkpoint
    directory, the step ``recorded`` (the ``"lora_base"`` of the checkpoint a run resumes from)
    names, else its latest. The step read is what ``describe`` records."""
    step = None
    if trainer.base is not None and _is_dew_checkpoint(trainer.base):
        step = (recorded or {}).get("step")
        if step is None:
            step = _latest_step(trainer.base)
    trainer._lora_base_step = step
    model, shardings = trainer.objective.model, trainer.state_shardings.frozen
    return read_lora_base(model, trainer.base, shardings, trainer.key, step)


def _is_dew_checkpoint(path) -> bool:
    from dew.models import hf

    return Path(path).is_dir() and not hf.is_hf_folder(path)


def _latest_step(path) -> int | None:
    from dew.checkpoints import Checkpoints

    return Checkpoints(checkpoint_directory(path)).latest


def _checksum(trainer, frozen) -> str:
    cached = getattr(trainer, "_lora_base_checksum", None)
    if cached is None:
        cached = lora.base_checksum(trainer.objective.model, frozen)
        trainer._lora_base_checksum = cached
    return cached


def describe(trainer, frozen) -> dict:
    """The checkpoint metadata's ``"lora_base"``: ``{"path", "checksum"}``, and ``"step"`` for a
    base read from a Dew checkpoint directory (the step ``load`` read)."""
    described = {"path": resolved(trainer.base), "checksum": _checksum(trainer, frozen)}
    step = getattr(trainer, "_lora_base_step", None)
    if step is not None:
        described["step"] = step
    return described


def check_resumed(trainer, frozen, metadata: dict) -> None:
    """``BaseMismatchError`` (a ``CheckpointMismatchError``, a ``ValueError``) naming both bases
    when the checkpoint a run resumes from was trained on another base than ``frozen``;
    ``CheckpointMismatchError`` when it records none."""
    recorded = metadata.get("lora_base")
    where = trainer.checkpoints.directory
    if not isinstance(recorded, dict) or "checksum" not in recorded:
        raise CheckpointMismatchError(
            f"the checkpoint in {where} names no LoRA base (it is not a LoRA run's); resume it "
            "without lora, or start this run in another directory"
        )
    checksum = _checksum(trainer, frozen)
    if recorded["checksum"] != checksum:
        ours = "the model's initial weights" if trainer.base is None else str(trainer.base)
        theirs = recorded.get("path") or "the model's initial weights"
        raise BaseMismatchError(
            f"the checkpoint in {where} was trained on the base {theirs} (checksum "
            f"{recorded['checksum']}), and this run's base, {ours}, has checksum {checksum}: "
            "resume with the base it was trained on, or start this run in another directory",
            recorded,
            resolved(trainer.base),
            checksum,
        )
