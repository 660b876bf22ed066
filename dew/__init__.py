"""Dew: train one JAX model across many devices, every byte between them an explicit collective."""

from dew import models
from dew.checkpoints import Checkpoints
from dew.collective_report import CollectiveReport, collectives
from dew.layout import Layout
from dew.mesh import AXES, MeshSpec
from dew.training import TrainState, Trainer

__all__ = [
    "AXES",
    "Checkpoints",
    "CollectiveReport",
    "collectives",
    "Layout",
    "MeshSpec",
    "TrainState",
    "Trainer",
    "models",
]
