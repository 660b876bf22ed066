"""``TrainState``: everything a training run carries from one step to the next."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything a training run carries from one step to the next: a pytree (a frozen
    dataclass), each array laid out on the mesh as the layout says.

    ``Trainer.init_state``, ``Trainer.place`` and ``Trainer.fit`` make one; the step takes one and
    gives the next. ``replace(**changes)`` gives a copy with some fields changed.

    Attributes:
      step: optimizer steps taken (int32 scalar).
      params: the model's weights, ``{"params": ...}`` (a LoRA model's: its adapters), in the
        model's ``param_dtype``.
      opt_state: the optax optimizer's state; its moments follow their parameter's layout.
      ema: an exponential moving average of ``params``, or ``None`` when the objective keeps none.
      key: the run's PRNG key (typed key array); steps that need randomness fold the step into it.
      frozen: weights the step uses and never changes, ``None`` but for a LoRA model: its base
        (``dew.models.lora``), whose adapters are ``params``. No gradient, optimizer state or EMA
        exists for it, and checkpoints name it rather than hold it.

    Examples:
        >>> state = trainer.init_state()
        >>> int(state.step), state.params["params"]["embed_tokens"]["embedding"].shape
        (0, (256, 64))
        >>> state.params["params"]["embed_tokens"]["embedding"].sharding.spec  # Layout(min_shard=1)
        P('fsdp',)
    """

    step: jax.Array
    params: Any
    opt_state: Any
    ema: Any
    key: jax.Array
    frozen: Any = None

    def replace(self, **changes) -> "TrainState":
        """A copy with ``changes`` (field names to values) in place of those fields."""
        return dataclasses.replace(self, **changes)
