"""Dew: train one JAX model across many devices, every byte between them an explicit collective."""

from dew import collectives, models  # collectives: the package, callable as its function
from dew.checkpoints import Checkpoints
from dew.collectives import CollectiveReport
from dew.layout import Layout
from dew.mesh import AXES, MeshSpec
from dew.models.checkpoint import load_checkpoint
from dew.parallel.options import StepOptions
from dew.quiet_libtpu import quiet_libtpu
from dew.training import Trainer, TrainState

# No libtpu start-up errors on a machine without a TPU: set before JAX starts a backend (importing
# it starts none).
quiet_libtpu()

__all__ = [
    "AXES",
    "Checkpoints",
    "CollectiveReport",
    "collectives",
    "Layout",
    "load_checkpoint",
    "MeshSpec",
    "StepOptions",
    "TrainState",
    "Trainer",
    "models",
]
