"""Dew: train one JAX model across many devices, every byte between them an explicit collective."""

from dew import collectives, models  # collectives: the package, callable as its function
from dew.checkpoints import Checkpoints
from dew.collectives import CollectiveReport
from dew.layout import Layout
from dew.mesh import AXES, MeshSpec
from dew.parallel.options import StepOptions
from dew.training import Trainer, TrainState

__all__ = [
    "AXES",
    "Checkpoints",
    "CollectiveReport",
    "collectives",
    "Layout",
    "MeshSpec",
    "StepOptions",
    "TrainState",
    "Trainer",
    "models",
]
