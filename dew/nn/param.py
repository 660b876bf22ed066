"""Parameter declarations: shape, logical axis names, initializer.

A layer declares its weights as ``Param`` s; a model collects them into a tree, and
``init_params`` draws them. Each weight's values depend on the key and its path in the tree alone,
never on the layout the state is created in, and adding a weight does not change the others.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Callable

import jax
import jax.numpy as jnp

from dew.layout import path_names

Initializer = Callable[[jax.Array, tuple[int, ...], Any], jax.Array]


def normal(stddev: float) -> Initializer:
    """Gaussian weights with standard deviation ``stddev``."""
    return lambda key, shape, dtype: (stddev * jax.random.normal(key, shape, jnp.float32)).astype(
        dtype
    )


def ones(key, shape, dtype):
    del key
    return jnp.ones(shape, dtype)


@dataclasses.dataclass(frozen=True)
class Param:
    """One weight: its shape, the logical name of each dimension, and how to draw it."""

    shape: tuple[int, ...]
    axes: tuple[str, ...]
    init: Initializer

    def __post_init__(self):
        if len(self.shape) != len(self.axes):
            raise ValueError(
                f"Param of shape {self.shape} declares {len(self.axes)} axes {self.axes}"
            )

    def stacked(self, n: int) -> "Param":
        """The same weight for ``n`` layers, stacked on a leading ``layers`` dimension."""
        return Param((n, *self.shape), ("layers", *self.axes), self.init)


def is_param(x) -> bool:
    return isinstance(x, Param)


def init_params(declared: Any, key: jax.Array, dtype) -> Any:
    """Draws every ``Param`` of ``declared``; each from ``fold_in(key, crc32(its path))``."""

    def draw(path, p: Param):
        tag = zlib.crc32("/".join(path_names(path)).encode()) & 0x7FFFFFFF
        return p.init(jax.random.fold_in(key, tag), p.shape, dtype)

    return jax.tree_util.tree_map_with_path(draw, declared, is_leaf=is_param)


def logical_axes(declared: Any) -> Any:
    """The tree of logical-axis tuples of ``declared`` (what ``Layout.specs`` takes as ``axes``)."""
    return jax.tree_util.tree_map(lambda p: p.axes, declared, is_leaf=is_param)
