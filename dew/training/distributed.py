"""Meshes over the devices of every process in the run: ``dew.mesh`` under another name.

Kept because the example notebook imports ``dew.training.distributed`` (``from
dew.training.distributed import build_mesh``); new code imports from ``dew.mesh``.
"""

from dew.mesh import AXES, MeshSpec, build_mesh

__all__ = ["AXES", "MeshSpec", "build_mesh"]
