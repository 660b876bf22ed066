"""Dew: train one JAX model across many devices, every byte between them an explicit collective."""

from dew import models
from dew.layout import Layout
from dew.mesh import AXES, MeshSpec
from dew.training import TrainState, Trainer

__all__ = ["AXES", "Layout", "MeshSpec", "TrainState", "Trainer", "models"]
