"""The step engine (``step``), ``Trainer``, ``TrainState``, process setup (``runtime``), the
trackers ``fit`` reports to (``tracking``) and model FLOPs (``flops``).

Also here, under the names code written for Dew's predecessor imports them by
(``from dew.training import prepare_process, Layout, MeshSpec, Checkpoints``): ``prepare_process``
(``dew.training.runtime``), ``Layout`` and ``DEFAULT_RULES`` (``dew.layout``), ``MeshSpec``
(``dew.mesh``) and ``Checkpoints`` (``dew.checkpoints``).
"""

from dew.checkpoints import Checkpoints
from dew.layout import DEFAULT_RULES, Layout
from dew.mesh import MeshSpec
from dew.training.runtime import prepare_process
from dew.training.state import TrainState
from dew.training.tracking import JsonLines, TensorBoard, Tracker
from dew.training.trainer import Trainer

__all__ = [
    "Checkpoints",
    "DEFAULT_RULES",
    "JsonLines",
    "Layout",
    "MeshSpec",
    "TensorBoard",
    "Tracker",
    "TrainState",
    "Trainer",
    "prepare_process",
]
