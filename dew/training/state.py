"""``TrainState``: everything a training run carries from one step to the next."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """A pytree; each array laid out on the mesh as the layout says.

    Attributes:
      step: optimizer steps taken (int32 scalar).
      params: the model's weights, ``{"params": ...}``.
      opt_state: the optax optimizer's state; its moments follow their parameter's layout.
      ema: an exponential moving average of ``params``, or ``None`` when the objective keeps none.
      key: the run's PRNG key (typed key array); steps that need randomness fold the step into it.
      frozen: weights the step uses and never changes, ``None`` but for a LoRA model: its base
        (``dew.models.lora``), whose adapters are ``params``. No gradient, optimizer state or EMA
        exists for it, and checkpoints name it rather than hold it.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    ema: Any
    key: jax.Array
    frozen: Any = None

    def replace(self, **changes) -> "TrainState":
        return dataclasses.replace(self, **changes)
