"""``Layout``: which mesh axis each dimension of each weight is split over.

Every parameter declares logical axis names for its dimensions (``("vocab", "embed")`` for the token
table, ``("layers", "embed", "mlp")`` for a stacked MLP weight). A ``Layout`` holds ordered rules
``(logical name, mesh axis)`` and turns those names into a ``PartitionSpec`` for a given mesh:

- a weight with fewer than ``min_shard`` elements, or with a ``lora_rank`` dimension (a LoRA
  adapter, ``WHOLE_OVER_FSDP``), is not split over fsdp (splitting it costs more in communication
  than it saves in memory); ``stage``, ``tensor`` and ``expert`` rules apply whatever the size,
  because the model computes on those splits (``dew.parallel.pipeline``, ``dew.parallel.tensor``,
  ``dew.parallel.expert``);
- rules are tried in order; a rule places its mesh axis on the first dimension with that logical
  name that is still free and that the axis size divides; a mesh axis of size 1, an axis already
  used by this weight, or a size it does not divide: the rule is skipped and the next one is tried;
- dimensions no rule claims stay whole.

Optimizer moments and EMA copies follow their parameter: a leaf of any tree is matched to the
parameter whose path is a suffix of its own (``opt_state[0].mu['params']['layers']...`` ends with
``['params']['layers']...``) and that has its shape.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dew.checks import nonnegative_int
from dew.mesh import AXES

# Axes the model computes on the split of, so a rule for them applies whatever the weight's size.
COMPUTED_SPLITS = ("expert", "tensor", "stage")
# The stacked layers over stage first (each pipeline stage holds a contiguous run of the layers:
# stage s the s-th block of num_layers / S), then the experts over expert and Megatron's splits
# (the vocabulary, the heads and the MLP width over tensor: dew.parallel.tensor.SPLIT_NAMES). Then
# fsdp, in this order of preference: the vocabulary (the embedding table is usually the largest
# weight), the model width, the MLP width and the heads, each on a dimension tensor left free.
# Nothing else names stage: the embedding, final norm and head are whole on every stage.
DEFAULT_RULES: tuple[tuple[str, str], ...] = (
    ("layers", "stage"),
    ("experts", "expert"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "fsdp"),
    ("embed", "fsdp"),
    ("mlp", "fsdp"),
    ("heads", "fsdp"),
    ("kv_heads", "fsdp"),
)


def path_names(path) -> tuple[str, ...]:
    """The keys of a pytree path as plain strings.

    ``(DictKey('params'), GetAttrKey('mu'))`` -> ``('params', 'mu')``.
    """
    names = []
    for entry in path:
        for attr in ("key", "name", "idx"):
            if hasattr(entry, attr):
                names.append(str(getattr(entry, attr)))
                break
        else:
            names.append(str(entry))
    return tuple(names)


def weight_dimensions(param_specs: Any, logical_axes: Any, shapes: Any = None):
    """Every dimension of every weight: ``(where, names, spec, name, mesh_axes, size)``.

    ``where`` is the weight's path (``"params/layers/attn/q"``), ``names`` its logical axes,
    ``spec`` its ``PartitionSpec``, ``name`` the dimension's logical name, ``mesh_axes`` the tuple
    of mesh axes it is split over (``(None,)`` when whole) and ``size`` its length, read from
    ``shapes`` (a tree of arrays or ``ShapeDtypeStruct`` matching ``param_specs``; ``None`` without
    it). For the layout checks of ``dew.parallel.tensor``, ``dew.parallel.expert`` and
    ``dew.parallel.pipeline``."""
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    axes_leaves = jax.tree_util.tree_flatten_with_path(
        logical_axes, is_leaf=lambda x: isinstance(x, tuple) and not is_spec(x)
    )[0]
    spec_leaves = jax.tree_util.tree_leaves(param_specs, is_leaf=is_spec)
    if shapes is None:
        shape_leaves = [None] * len(spec_leaves)
    else:
        shape_leaves = [leaf.shape for leaf in jax.tree_util.tree_leaves(shapes)]
    for (path, names), spec, shape in zip(axes_leaves, spec_leaves, shape_leaves, strict=True):
        where = "/".join(path_names(path))
        entries = tuple(spec) + (None,) * (len(names) - len(tuple(spec)))
        for dim, (name, entry) in enumerate(zip(names, entries)):
            mesh_axes = entry if isinstance(entry, tuple) else (entry,)
            yield where, names, spec, name, mesh_axes, None if shape is None else shape[dim]


def _is_axes(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(a, str) or a is None for a in x)


# A weight with a dimension of this logical name (a LoRA adapter's rank: ``dew.models.lora``) is
# split only where the model computes on the split (``COMPUTED_SPLITS``), whatever its size: the
# adapters are small, and whole over fsdp their gradients are one psum over the token axes.
WHOLE_OVER_FSDP = "lora_rank"


# One default for Python and every ``dew`` command. Measured on Llama-3.2-1B, fsdp=8, v5e-8 (``dew
# plan``): 4096 splits the stacked norm scales ([16, 2048]) too, and the step's temporaries are
# 1.37 GiB against 1.49 GiB with 65536 (8.6% more), for the same wire bytes. On the example decoder
# (width 64) every weight matrix is split and the norm scales stay whole.
DEFAULT_MIN_SHARD = 4096


@dataclasses.dataclass(frozen=True)
class Layout:
    """Maps logical axis names to mesh axes: where each dimension of each weight is split.

    The ``Trainer`` applies it to the weights, their optimizer state and EMA (the module's
    docstring gives the rules' semantics).

    Args:
      min_shard: weights with fewer elements than this are not split over any axis but
        ``stage``, ``tensor`` and ``expert`` (whose splits the model computes on, whatever the
        size); default ``DEFAULT_MIN_SHARD`` (4096), as every ``dew`` command.
      rules: ordered ``(logical name, mesh axis)`` pairs; default ``DEFAULT_RULES`` (the layers
        over ``stage``, experts over ``expert``, Megatron's splits over ``tensor``, then the
        vocabulary, model width, MLP width and heads over ``fsdp``). No rule may name ``data``:
        a data-parallel replica holds whole weights by definition.

    Raises:
      ValueError: ``min_shard`` below 0, or a rule that is not a pair of strings, names
        ``data``, or names no mesh axis.

    Examples:
        >>> from dew import Layout
        >>> Layout().spec((256, 64), ("vocab", "embed"), {"fsdp": 8, "tensor": 2})
        P('tensor', 'fsdp')
        >>> Layout().spec((64,), ("embed",), {"fsdp": 8})  # 64 elements: below min_shard
        P()
        >>> Layout(min_shard=1).spec((64,), ("embed",), {"fsdp": 8})
        P('fsdp',)
    """

    min_shard: int = DEFAULT_MIN_SHARD
    rules: Sequence[tuple[str, str]] = DEFAULT_RULES

    def __post_init__(self):
        nonnegative_int("Layout.min_shard", self.min_shard)
        rules = tuple(tuple(rule) for rule in self.rules)
        for rule in rules:
            if len(rule) != 2 or not all(isinstance(r, str) for r in rule):
                raise ValueError(
                    f"a layout rule is a (logical name, mesh axis) pair of strings, got {rule!r}"
                )
            if rule[1] == "data":
                raise ValueError(
                    f"layout rule {rule!r}: parameters are never placed on the data axis"
                )
            if rule[1] not in AXES:
                raise ValueError(
                    f"layout rule {rule!r}: mesh axis {rule[1]!r} is not one of {', '.join(AXES)}"
                )
        object.__setattr__(self, "rules", rules)

    def spec(
        self, shape: Sequence[int], axes: Sequence[str | None] | None, mesh_shape: Mapping[str, int]
    ) -> P:
        """The ``PartitionSpec`` of one array of ``shape`` whose dimensions carry logical names
        ``axes``, on a mesh of ``mesh_shape`` (axis name to size).

        ``axes=None`` (a leaf nobody declared) splits over fsdp along the largest dimension fsdp
        divides.

        Raises:
          ValueError: ``axes`` does not name every dimension of ``shape``.
        """
        shape = tuple(shape)
        if not shape:
            return P()
        small = math.prod(shape) < max(self.min_shard, 1) or WHOLE_OVER_FSDP in (axes or ())
        if axes is None:
            if small:
                return P()
            fsdp = mesh_shape.get("fsdp", 1)
            candidates = [d for d in range(len(shape)) if fsdp > 1 and shape[d] % fsdp == 0]
            if not candidates:
                return P()
            dim = max(candidates, key=lambda d: (shape[d], -d))
            return P(*([None] * dim + ["fsdp"]))
        if len(axes) != len(shape):
            raise ValueError(f"logical axes {axes} do not match an array of shape {shape}")
        placed: list[str | None] = [None] * len(shape)
        for logical, mesh_axis in self.rules:
            size = mesh_shape.get(mesh_axis, 1)
            if size == 1 or mesh_axis in placed or (small and mesh_axis not in COMPUTED_SPLITS):
                continue
            for dim, name in enumerate(axes):
                if name == logical and placed[dim] is None and shape[dim] % size == 0:
                    placed[dim] = mesh_axis
                    break
        while placed and placed[-1] is None:
            placed.pop()
        return P(*placed)

    def specs(self, mesh: Mesh, tree: Any, axes: Any = None) -> Any:
        """A tree shaped like ``tree`` of ``PartitionSpec``.

        Args:
          mesh: the mesh the arrays will live on.
          tree: any pytree whose array leaves have ``.shape`` (arrays, ``ShapeDtypeStruct``); other
            leaves (Python numbers) stay whole.
          axes: optional tree of logical-axis tuples for a parameter tree
            (``model.logical_axes()``). A leaf of ``tree`` takes the axes of the parameter whose
            path is the longest suffix of its own and whose rank matches; leaves that match nothing
            stay whole. Without ``axes`` every leaf is undeclared and split over fsdp along its
            largest dimension fsdp divides.
        """
        declared: dict[tuple[str, ...], tuple] = {}
        if axes is not None:
            for path, leaf_axes in jax.tree_util.tree_flatten_with_path(axes, is_leaf=_is_axes)[0]:
                declared[path_names(path)] = leaf_axes
        mesh_shape = dict(mesh.shape)

        def place(path, leaf):
            shape = getattr(leaf, "shape", None)
            if shape is None:
                return P()
            names = path_names(path)
            for start in range(len(names)):
                leaf_axes = declared.get(names[start:])
                if leaf_axes is not None and len(leaf_axes) == len(shape):
                    return self.spec(shape, leaf_axes, mesh_shape)
            # Without declared axes every leaf gets the generic fsdp split; with them, a leaf that
            # matches no parameter (an optimizer's step count, a factored statistic) stays whole.
            return self.spec(shape, None if axes is None else (None,) * len(shape), mesh_shape)

        return jax.tree_util.tree_map_with_path(place, tree)

    def shardings(self, mesh: Mesh, tree: Any, axes: Any = None) -> Any:
        """A tree shaped like ``tree`` of ``NamedSharding`` on ``mesh``; see ``specs``."""
        return jax.tree_util.tree_map(
            lambda spec: NamedSharding(mesh, spec),
            self.specs(mesh, tree, axes),
            is_leaf=lambda x: isinstance(x, P),
        )

    def describe(self) -> dict:
        """A JSON-able record of this layout (kept in checkpoints for information)."""
        return {"min_shard": self.min_shard, "rules": [list(rule) for rule in self.rules]}
