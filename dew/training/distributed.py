"""Meshes over the devices of every process in the run."""

from dew.mesh import AXES, MeshSpec, build_mesh

__all__ = ["AXES", "MeshSpec", "build_mesh"]
