"""Device order is not axis order: ``dict(mesh.shape)`` keeps ``AXES`` order, while the devices
behind the axes put ``tensor`` on neighbouring ids (then sequence, expert, fsdp) and ``data``
outermost (then stage)."""

import jax
import numpy as np
import pytest

import dew
from dew.mesh import AXES, build_mesh


def ids(mesh) -> np.ndarray:
    """The device id at every mesh position, indexed in ``AXES`` order."""
    return np.vectorize(lambda d: d.id)(mesh.devices)


# spec -> the id step along each axis, written by hand from the nesting
# (data, stage, fsdp, expert, sequence, tensor), outermost first, on 8 devices.
STRIDES = [
    (dew.MeshSpec(tensor=4), {"data": 4, "tensor": 1}),
    (dew.MeshSpec(fsdp=2, tensor=2), {"data": 4, "fsdp": 2, "tensor": 1}),
    (dew.MeshSpec(expert=2, sequence=2, tensor=2), {"expert": 4, "sequence": 2, "tensor": 1}),
    (dew.MeshSpec(fsdp=2, stage=2, tensor=2), {"stage": 4, "fsdp": 2, "tensor": 1}),
    (dew.MeshSpec(stage=2, tensor=2), {"data": 4, "stage": 2, "tensor": 1}),
    (dew.MeshSpec(fsdp=2, expert=2), {"data": 4, "fsdp": 2, "expert": 1}),
]


@pytest.mark.parametrize("spec, strides", STRIDES, ids=lambda x: repr(x))
def test_device_ids_follow_the_nesting(spec, strides):
    mesh = build_mesh(spec)
    grid = ids(mesh)
    index = np.indices(grid.shape)
    expected = sum(index[AXES.index(a)] * step for a, step in strides.items())
    np.testing.assert_array_equal(grid, expected, err_msg=repr(spec))
    assert list(mesh.shape) == list(AXES)


def test_tensor_groups_are_consecutive_devices():
    grid = ids(build_mesh(dew.MeshSpec(tensor=4)))
    groups = sorted(grid.reshape(-1, 4).tolist())  # tensor is the last mesh axis of size > 1
    assert groups == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_fsdp_by_tensor_pairs_and_strides():
    grid = ids(build_mesh(dew.MeshSpec(fsdp=2, tensor=2)))  # data 2, fsdp 2, tensor 2
    tensor_groups = {tuple(grid[d, 0, f, :, 0, 0]) for d in range(2) for f in range(2)}
    assert tensor_groups == {(0, 1), (2, 3), (4, 5), (6, 7)}
    fsdp_groups = {tuple(grid[d, 0, :, t, 0, 0]) for d in range(2) for t in range(2)}
    assert fsdp_groups == {(0, 2), (1, 3), (4, 6), (5, 7)}
    assert set(grid[0].reshape(-1)) == {0, 1, 2, 3}, "data is not outermost"


@pytest.mark.parametrize(
    "spec", [dew.MeshSpec(), dew.MeshSpec(fsdp=8), dew.MeshSpec(fsdp=4), dew.MeshSpec(fsdp=2)]
)
def test_data_and_fsdp_layouts_keep_the_plain_reshape(spec):
    """Today's layouts (only data and fsdp above 1): the grid is the device list reshaped in
    ``AXES`` order, data outer, fsdp inner, as before device order was introduced."""
    devices = jax.devices()
    mesh = build_mesh(spec)
    plain = np.asarray(devices, dtype=object).reshape(tuple(dict(mesh.shape).values()))
    assert (mesh.devices == plain).all(), repr(spec)


def test_given_devices_are_nested_in_the_order_given():
    devices = jax.devices()[::-1]
    grid = ids(build_mesh(dew.MeshSpec(fsdp=2, tensor=2), devices=devices))
    assert tuple(grid[0, 0, 0, :, 0, 0]) == (7, 6)
    assert tuple(grid[0, 0, :, 0, 0, 0]) == (7, 5)
