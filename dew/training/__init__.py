"""The step engine (``step``), ``Trainer``, ``TrainState``, and process setup (``runtime``)."""

from dew.training.state import TrainState
from dew.training.trainer import Trainer

__all__ = ["TrainState", "Trainer"]
