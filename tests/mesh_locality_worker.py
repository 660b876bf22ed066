"""One process of a ``dew launch --processes 2 --devices-per-process 4`` run
(tests/test_mesh_locality.py): builds meshes over both processes' devices and prints, as one JSON
line, the processes each group of each axis spans, ``{mesh: {axis: [[process, ...], ...]}}``."""

import json

from dew.training.runtime import prepare_process

prepare_process(multi_host=True)

import jax  # noqa: E402
import numpy as np  # noqa: E402

import dew  # noqa: E402
from dew.mesh import build_mesh  # noqa: E402

MESHES = ("fsdp=4", "tensor=2,fsdp=2", "sequence=2,tensor=2", "expert=2,fsdp=2", "fsdp=8")

assert jax.process_count() == 2 and jax.local_device_count() == 4
spans = {}
for text in MESHES:
    mesh = build_mesh(dew.MeshSpec.parse(text))
    processes = np.vectorize(lambda device: device.process_index)(mesh.devices)
    spans[text] = {}
    for position, axis in enumerate(mesh.axis_names):
        # One row per group of the axis: the devices that differ only in their place on it.
        groups = np.moveaxis(processes, position, -1).reshape(-1, mesh.shape[axis])
        spans[text][axis] = [sorted({int(p) for p in group}) for group in groups]
print(json.dumps(spans), flush=True)
