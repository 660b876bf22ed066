"""``remat="auto"`` resolved: the least recomputation whose step fits the devices.

``choose_remat(trainer, batch)`` compiles ``trainer``'s step with each recompute policy in
``REMAT_ORDER`` until one fits (``dew.training.step_memory.measure_step``); the ``Trainer`` calls
it before it builds the step of a model with ``remat="auto"``, and ``dew plan`` orders its choices
the same way (``dew.planning.SEARCH_DIMENSIONS``). It lives beside the step engine, not in the
planner, so that the ``Trainer`` depends on no planning code.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Sequence

from dew.collectives.report import format_bytes
from dew.training import step_memory
from dew.training.step_memory import StepMemory, device_memory_limit

__all__ = ["REMAT_ORDER", "RematChoice", "choose_remat"]

# The recompute policies (``dew.models.causal_transformer.REMAT_CHOICES``), least recomputation
# first: "none" keeps everything, "attention" the weight matmuls' outputs, attention's and the
# MLP's normalized input, "dots" the weight matmuls' outputs, "attention_gate" attention's
# output and the MLP's gate projection, "full" nothing. Memory mostly falls in the same order
# ("attention" can need less than "dots"): each is compiled until one fits.
REMAT_ORDER = ("none", "attention", "dots", "attention_gate", "full")


@dataclasses.dataclass(frozen=True)
class RematChoice:
    """``choose_remat``'s answer: ``policy``, the least recomputation whose step fits
    ``limit_bytes``; ``objective``, the trainer's with that policy; ``tried``, ``(policy,
    StepMemory)`` of each policy compiled, in order, the chosen last."""

    policy: str
    limit_bytes: int
    objective: Any
    tried: tuple

    def reason(self) -> str:
        """``"remat auto: attention, the least recomputation whose step fits 15.8 GiB a device
        (none needs 17.1 GiB; attention needs 14.2 GiB)"``."""
        needs = "; ".join(
            f"{policy} {'refused by the compiler: ' if memory.refused else ''}needs "
            f"{format_bytes(memory.total_bytes)}"
            for policy, memory in self.tried
        )
        return (
            f"remat auto: {self.policy}, the least recomputation whose step fits "
            f"{format_bytes(self.limit_bytes)} a device ({needs})"
        )


# choose_remat's compiles: (the step, batch and policy) -> StepMemory.
_MEASURED: dict = {}


def _measured(trainer, objective, batch: int) -> StepMemory:
    """``measure_step`` of ``trainer``'s step with ``objective`` in place of its own, once per
    step: a copy of the trainer (its mesh, layout and shardings; remat changes none of them)."""
    key = (
        objective,
        trainer.optimizer,
        trainer.mesh,
        trainer.layout,
        trainer.options,
        trainer.accumulation,
        trainer.engine,
        batch,
    )
    try:
        if key in _MEASURED:
            return _MEASURED[key]
    except TypeError:  # something unhashable (an optimizer's closure state): no caching
        key = None
    candidate = copy.copy(trainer)
    candidate.objective = objective
    candidate._steps, candidate._losses, candidate._gradients = {}, {}, {}
    memory, _ = step_memory.measure_step(candidate, batch)
    if key is not None:
        _MEASURED[key] = memory
    return memory


def choose_remat(
    trainer,
    batch: int,
    *,
    memory_limit_bytes: int | None = None,
    policies: Sequence[str] = REMAT_ORDER,
) -> RematChoice:
    """``remat="auto"`` resolved: the least recomputation whose step fits the devices.

    ``trainer``'s training step on global batches of ``batch`` rows is compiled with each of
    ``policies`` in turn (least recomputation first) until one fits ``memory_limit_bytes`` by
    the compiler's own figures (``measure_step``: the compiler accepted it, and arguments + heap
    + code are within the limit). Each compile is kept (per step, batch and policy): a second
    call compiles nothing. The ``Trainer`` calls this before it builds the real step of a model
    with ``remat="auto"``; ``dew plan`` makes the same choice per layout (``plan_choices``).

    ``memory_limit_bytes``: a device's memory for the program; default what the device reports
    (``device_memory_limit``). CPU devices report none: give it there (tests, a rehearsal).
    Raises ``ValueError`` naming every policy's need when none fits, before the real step
    compiles.
    """
    limit = memory_limit_bytes
    if limit is None:
        device = trainer.mesh.devices.flat[0]
        limit = device_memory_limit(device)
        if limit is None:
            raise ValueError(
                f"remat='auto' chooses by the device's memory, and {device.platform} device "
                f"{device.id} does not report it: give memory_limit_bytes (Trainer(..., "
                "memory_limit_bytes=N)) or a remat policy"
            )
    if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
        raise ValueError(f"memory_limit_bytes must be a positive int, got {limit!r}")
    tried = []
    for policy in policies:
        objective = dataclasses.replace(
            trainer.objective, model=dataclasses.replace(trainer.objective.model, remat=policy)
        )
        memory = _measured(trainer, objective, batch)
        tried.append((policy, memory))
        if memory.fits(limit):
            return RematChoice(policy, limit, objective, tuple(tried))
    needs = ", ".join(f"{p} {format_bytes(m.total_bytes)}" for p, m in tried)
    raise ValueError(
        f"remat='auto': no recompute policy's step fits {format_bytes(limit)} a device at batch "
        f"{batch} ({needs} needed); use a smaller batch, accumulation or more devices"
    )
