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
import numpy as np

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
    leaves, treedef = jax.tree_util.tree_flatten_with_path(declared, is_leaf=is_param)
    tags = np.array(
        [zlib.crc32("/".join(path_names(path)).encode()) & 0x7FFFFFFF for path, _ in leaves],
        np.uint32,
    )
    # One fold_in over all the tags, the same keys as one per weight: each threefry hash is a loop
    # of its own in the program, which XLA:CPU takes ~40 ms to compile (measured: a 2-layer
    # model's init compiles in 0.65 s against 0.90 s).
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, tags)
    drawn = [p.init(keys[i], p.shape, dtype) for i, (_, p) in enumerate(leaves)]
    return jax.tree_util.tree_unflatten(treedef, drawn)


def logical_axes(declared: Any) -> Any:
    """The tree of logical-axis tuples of ``declared`` (what ``Layout.specs`` takes as ``axes``)."""
    return jax.tree_util.tree_map(lambda p: p.axes, declared, is_leaf=is_param)


def spec_labels(spec: str) -> tuple[str, str, str]:
    """A two-operand einsum's labels: ``"bse,ehd->bshd"`` -> ``("bse", "ehd", "bshd")``."""
    inputs, out = spec.replace(" ", "").split("->")
    x, w = inputs.split(",")
    return x, w, out


def project(spec: str, x: jax.Array, w: Any) -> jax.Array:
    """``jnp.einsum(spec, x, w)`` in ``x``'s dtype: every layer's matmul with a weight.

    ``w`` is the whole weight (an array, cast to ``x``'s dtype), or a weight object that runs the
    einsum itself: one still split over devices, gathering it and summing its gradient round a
    ring beside the matmuls (``dew.parallel.fsdp_matmul.RingSplit``, under
    ``StepOptions(fsdp_scheme="ring")``), a frozen weight with a LoRA adapter
    (``dew.nn.lora.Adapted``), a frozen int8 weight (``dew.nn.int8.Quantized``)."""
    if hasattr(w, "einsum"):
        return w.einsum(spec, x)
    return jnp.einsum(spec, x, w.astype(x.dtype))


class Projections:
    """A layer's matmuls with its weights, in the two kinds a tensor-parallel region needs told
    apart: ``columns``, several projections of one input (q, k and v; gate and up), and ``row``,
    the one projection whose output leaves the layer (o; down). Here each is a plain ``project``;
    ``dew.parallel.tensor_ring.Region`` runs them as the region's entry and exit, collective
    matmuls, so a layer says which of its matmuls share an input and which one ends it, and the
    region decides how they cross devices (as ``attend`` decides how attention spans them)."""

    def columns(self, spec: str, x: jax.Array, weights) -> tuple[jax.Array, ...]:
        """``tuple(project(spec, x, w) for w in weights)``."""
        return tuple(project(spec, x, w) for w in weights)

    def row(self, spec: str, h: jax.Array, weight) -> jax.Array:
        """``project(spec, h, weight)``."""
        return project(spec, h, weight)

    def experts(self, x: jax.Array, weight, group_sizes: jax.Array, name: str = "") -> jax.Array:
        """An MoE layer's grouped matmul ``name`` (``"gate"``...): ``lax.ragged_dot(x, weight,
        group_sizes)`` in ``x``'s dtype (``dew.nn.moe.grouped_swiglu``), ``weight`` ``[groups,
        in, out]``."""
        return jax.lax.ragged_dot(x, weight.astype(x.dtype), group_sizes)


# The plain projections, for a layer outside any tensor-parallel region.
PLAIN = Projections()
