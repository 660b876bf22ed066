"""The learning-rate schedule ``dew.training.optimizer.adamw`` follows: a linear warmup, then a
constant rate or a linear or cosine decay to ``lr_min`` at ``steps``.

    lr = schedule(3e-4, steps=1000, warmup_steps=100, lr_schedule="cosine", lr_min=3e-5)
    lr(count)  # the rate of the update after ``count`` updates (optax's step count)
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp

from dew.checks import nonnegative_int, positive_int

SCHEDULES = ("constant", "cosine", "linear")


def schedule(
    learning_rate: float,
    *,
    steps: int | None = None,
    warmup_steps: int = 0,
    lr_schedule: str = "constant",
    lr_min: float = 0.0,
) -> Callable[[jax.Array], jax.Array]:
    """``count -> lr``: the learning rate of the update after ``count`` updates (``count`` is the
    optimizer's step count, 0 at the first update; a run's step ``s`` of its log and metrics is
    update ``count = s - 1``).

    With ``s = count + 1``: ``lr * s / warmup_steps`` for ``s <= warmup_steps`` (linear from
    ``lr / warmup_steps``, never 0), then with ``p = (s - warmup_steps) / (steps -
    warmup_steps)`` (clipped to 1): ``constant``: ``lr``; ``linear``: ``lr - (lr - lr_min) p``;
    ``cosine``: ``lr_min + (lr - lr_min) (1 + cos(pi p)) / 2``. Both decays reach ``lr_min`` at
    step ``steps`` and stay there. ``steps`` is needed by the decays alone.
    """
    check_schedule(learning_rate, steps, warmup_steps, lr_schedule, lr_min)
    peak, low, warmup = float(learning_rate), float(lr_min), int(warmup_steps)

    def lr(count):
        s = jnp.asarray(count, jnp.float32) + 1.0
        if lr_schedule == "constant":
            decayed = jnp.float32(peak)
        else:
            p = jnp.clip((s - warmup) / max(steps - warmup, 1), 0.0, 1.0)
            if lr_schedule == "linear":
                decayed = peak - (peak - low) * p
            else:
                decayed = low + (peak - low) * 0.5 * (1.0 + jnp.cos(jnp.pi * p))
        if warmup:
            decayed = jnp.where(s <= warmup, peak * s / warmup, decayed)
        return decayed.astype(jnp.float32)

    return lr


def check_schedule(
    learning_rate, steps, warmup_steps, lr_schedule, lr_min, names: dict | None = None
) -> None:
    """``ValueError`` naming the values for a schedule that makes no sense: a learning rate not
    above 0, an unknown schedule, a decay without ``steps``, ``lr_min`` negative or above the
    learning rate, ``warmup_steps`` negative or above ``steps``.

    ``names``: how the caller spells each argument in its messages, by argument name (``dew
    train`` passes its flags: ``{"lr_min": "--lr-min", ...}``); an argument it leaves out is
    named as here."""
    name = {
        "learning_rate": "the learning rate",
        "steps": "steps",
        "warmup_steps": "warmup_steps",
        "lr_schedule": "lr_schedule",
        "lr_min": "lr_min",
        **(names or {}),
    }
    lr_name, schedule_name, min_name = name["learning_rate"], name["lr_schedule"], name["lr_min"]
    if isinstance(learning_rate, bool) or not isinstance(learning_rate, (int, float)):
        raise ValueError(f"{lr_name} must be a number above 0, got {learning_rate!r}")
    if not (math.isfinite(learning_rate) and learning_rate > 0):
        raise ValueError(f"{lr_name} must be a number above 0, got {learning_rate!r}")
    if lr_schedule not in SCHEDULES:
        raise ValueError(
            f"unknown {schedule_name} {lr_schedule!r}; expected one of {', '.join(SCHEDULES)}"
        )
    nonnegative_int(name["warmup_steps"], warmup_steps)
    if steps is not None:
        positive_int(name["steps"], steps)
        if warmup_steps > steps:
            raise ValueError(
                f"{name['warmup_steps']} {warmup_steps} is above {name['steps']} {steps}"
            )
    if lr_schedule != "constant" and steps is None:
        raise ValueError(
            f"{schedule_name} {lr_schedule!r} decays to {min_name} at {name['steps']}: give "
            f"{name['steps']}"
        )
    if isinstance(lr_min, bool) or not isinstance(lr_min, (int, float)) or not lr_min >= 0:
        raise ValueError(f"{min_name} must be a number >= 0, got {lr_min!r}")
    if lr_min > learning_rate:
        raise ValueError(f"{min_name} {lr_min} is above {lr_name} {learning_rate}")
    if lr_schedule == "constant" and lr_min:
        raise ValueError(
            f"{min_name} {lr_min} is the end of a decay; {schedule_name} 'constant' has none "
            f"(give {schedule_name} 'cosine' or 'linear')"
        )
