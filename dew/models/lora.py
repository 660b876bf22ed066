"""LoRA fine-tuning of a ``CausalTransformer``: which weights get adapters, the adapters' tree, the
frozen base, and the two joined for the model.

    model = models.build("causal_transformer", ..., lora=Lora(rank=16))
    trainer = Trainer(LMObjective(model, 2048), adamw(2e-4), key=key, base="Llama-3.2-3B")

A model with ``lora`` set trains its adapters alone. The training state splits in two:

- ``state.params``: the adapters, ``{"lora": {"layers": {"attn": {"q": {"a": A, "b": B}, ...},
  "mlp": {...}}}}``, float32, stacked over the layers as the weights they adapt (an MoE model's
  ``moe_layers`` adapt their attention only: the experts and the router stay frozen, with no
  adapter). The optimizer, its state, the gradients and their sums are the adapters' only.
- ``state.frozen``: the base, ``{"params": ...}`` as the model declares it, in the model's
  ``param_dtype``, or with ``base_dtype="int8"`` every layer matrix (q, k, v, o, gate, up, down)
  as a ``dew.nn.int8.Quantized`` (int8 and a scale per output channel); the embedding, the norms
  and an untied head stay as they are. No gradient is formed for it: the step differentiates the
  adapters alone, with the base a constant of the function.

``combine`` joins them for the model: each adapted weight becomes a ``dew.nn.lora.Adapted`` (base,
A, B, alpha / R), which ``dew.nn.param.project`` runs. The layout of the adapters
(``dew.layout.WHOLE_OVER_FSDP``, docs/distributed.md): ``A`` takes the logical names of the
weight's input dimensions and ``B`` those of its output dimensions, both a ``lora_rank``
dimension, so each is split over ``tensor`` as its weight is (B of q over heads, A of o over
heads; A of q and B of o whole) and over ``stage`` with its layer; never over ``fsdp``: they are
small (``R (in + out)`` a matrix), so their gradients are summed whole (a ``psum`` over the token
axes) and the base's fsdp gathers are the only fsdp collectives of a LoRA step.

Names: ``--lora-targets`` takes PEFT's ``target_modules`` names (``TARGETS``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import zlib
from typing import Any

import jax
import jax.numpy as jnp

from dew.nn.int8 import Quantized, dequantize, quantize
from dew.nn.lora import Adapted
from dew.nn.param import Param, init_params, is_param, logical_axes

# PEFT's target_modules name -> (the group in a Dew layer, the weight, how many of the weight's
# leading dimensions (after ``layers``) are its input dimensions, the Hugging Face module).
TARGETS: dict[str, tuple[str, str, int, str]] = {
    "q_proj": ("attn", "q", 1, "self_attn.q_proj"),
    "k_proj": ("attn", "k", 1, "self_attn.k_proj"),
    "v_proj": ("attn", "v", 1, "self_attn.v_proj"),
    "o_proj": ("attn", "o", 2, "self_attn.o_proj"),
    "gate_proj": ("mlp", "gate", 1, "mlp.gate_proj"),
    "up_proj": ("mlp", "up", 1, "mlp.up_proj"),
    "down_proj": ("mlp", "down", 1, "mlp.down_proj"),
}
DEFAULT_TARGETS = tuple(TARGETS)
# The output of these is split over tensor (Megatron's column-parallel matmuls); o and down take
# their input split (row-parallel).
ROW_PARALLEL = ("o_proj", "down_proj")
# The Megatron regions' projections, an entry's (column-parallel) or an exit's (row-parallel).
REGIONS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
# The layer stacks a model may have (``CausalTransformer.declare``).
STACKS = ("layers", "moe_layers")
BASE_DTYPES = ("int8",)
# The logical name of an adapter's rank dimension (``dew.layout.WHOLE_OVER_FSDP``).
RANK = "lora_rank"


@dataclasses.dataclass(frozen=True)
class Lora:
    """LoRA's settings (the module's docstring).

    Args:
      rank: ``R``, the adapters' rank; a model refuses one above any adapted weight's
        ``min(in, out)`` (``check_rank``).
      alpha: the update is ``alpha / R * x A B``; ``None``: ``2 R`` (the update's scale 2, as
        torchtune's Llama recipes set it, alpha 16 at rank 8, and many others; PEFT's own default
        is alpha 8 whatever the rank).
      targets: PEFT's ``target_modules`` names (``TARGETS``); default all seven projections.
      base_dtype: ``None``: the base in the model's ``param_dtype``; ``"int8"``: its layer
        matrices int8 with a float32 scale per output channel (``dew.nn.int8``).
      dropout: PEFT's ``lora_dropout``, the rate of dropout on each adapter's input in a training
        step (``dropout_keys`` says how the masks are drawn); 0 (the default, PEFT's): none.
    """

    rank: int
    alpha: float | None = None
    targets: tuple[str, ...] = DEFAULT_TARGETS
    base_dtype: str | None = None
    dropout: float = 0.0

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRA rank must be a positive integer, got {self.rank!r}")
        if self.alpha is None:
            object.__setattr__(self, "alpha", float(2 * self.rank))
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)):
            raise ValueError(f"LoRA alpha must be a number, got {self.alpha!r}")
        if not self.alpha > 0:
            raise ValueError(f"LoRA alpha must be above 0, got {self.alpha!r}")
        object.__setattr__(self, "alpha", float(self.alpha))
        targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
        unknown = [t for t in targets if t not in TARGETS]
        if unknown or not targets or len(set(targets)) != len(targets):
            raise ValueError(
                f"LoRA targets {list(targets)}: each must be one of {', '.join(TARGETS)}, once"
            )
        object.__setattr__(self, "targets", tuple(t for t in TARGETS if t in targets))
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)):
            raise ValueError(f"LoRA dropout must be a number, got {self.dropout!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}")
        object.__setattr__(self, "dropout", float(self.dropout))
        if self.base_dtype is not None and self.base_dtype not in BASE_DTYPES:
            raise ValueError(
                f"LoRA base_dtype {self.base_dtype!r}: None (the model's param_dtype) or "
                f"{' or '.join(BASE_DTYPES)}"
            )

    @property
    def scale(self) -> float:
        """``alpha / R``."""
        return self.alpha / self.rank

    @classmethod
    def of(cls, value) -> "Lora | None":
        """``None``, a ``Lora``, or a dict of its fields (a checkpoint's record) as a ``Lora``."""
        if value is None or isinstance(value, Lora):
            return value
        if isinstance(value, dict):
            return cls(**value)
        raise TypeError(f"lora must be a dew.models.lora.Lora, a dict or None, got {value!r}")


# --- The trees ----------------------------------------------------------------------------------


def _stacks(model, declared: dict) -> list[str]:
    return [s for s in STACKS if s in declared["params"]]


def _targets_in(model, stack: str):
    """``(PEFT name, group, weight, input dims)`` of the targets a stack's layers have: all of
    them in dense layers, the attention's alone in MoE layers."""
    for name in model.lora.targets:
        group, weight, inputs, _ = TARGETS[name]
        if stack == "moe_layers" and group == "mlp":
            continue
        yield name, group, weight, inputs


def _uniform(bound_of_shape):
    def init(key, shape, dtype):
        bound = bound_of_shape(shape)
        return jax.random.uniform(key, shape, jnp.float32, -bound, bound).astype(dtype)

    return init


def _zeros(key, shape, dtype):
    del key
    return jnp.zeros(shape, dtype)


def declare_adapters(model) -> dict:
    """The adapters' ``Param`` s: ``{"lora": {stack: {group: {weight: {"a", "b"}}}}}``.

    ``A`` is drawn as PEFT draws it (``kaiming_uniform_(a=sqrt(5))``: uniform within ``1 /
    sqrt(fan_in)``, ``fan_in`` the weight's input size); ``B`` is zero, so that a fresh adapter
    changes nothing."""
    declared = model.declare()
    rank = model.lora.rank
    out: dict = {}
    for stack in _stacks(model, declared):
        for _, group, weight, inputs in _targets_in(model, stack):
            base = declared["params"][stack][group][weight]
            layers, *dims = base.shape
            _, *names = base.axes
            fan_in = math.prod(dims[:inputs])
            a = Param(
                (layers, *dims[:inputs], rank),
                ("layers", *names[:inputs], RANK),
                _uniform(lambda shape, fan_in=fan_in: 1.0 / math.sqrt(fan_in)),
            )
            b = Param((layers, rank, *dims[inputs:]), ("layers", RANK, *names[inputs:]), _zeros)
            out.setdefault(stack, {}).setdefault(group, {})[weight] = {"a": a, "b": b}
    return {"lora": out}


def _matrices(model, declared: dict):
    """``(stack, group, weight, input dims)`` of every layer matrix the int8 base stores as
    int8: q, k, v, o and a dense layer's gate, up, down (not the experts)."""
    for stack in _stacks(model, declared):
        for name, (group, weight, inputs, _) in TARGETS.items():
            if stack == "moe_layers" and group == "mlp":
                continue
            yield stack, group, weight, inputs


def declare_frozen(model) -> dict:
    """The base's declarations: the model's, each layer matrix a ``Quantized`` of an int8
    ``values`` and a float32 ``scale`` (over the ``layers`` and output dimensions) when the base
    is int8."""
    declared = model.declare()
    if model.lora.base_dtype != "int8":
        return declared
    params = jax.tree_util.tree_map(lambda p: p, declared["params"], is_leaf=is_param)
    for stack, group, weight, inputs in _matrices(model, declared):
        p = params[stack][group][weight]
        out_dims = (0, *range(1 + inputs, len(p.shape)))
        scale = Param(
            tuple(p.shape[d] for d in out_dims), tuple(p.axes[d] for d in out_dims), _zeros
        )
        params[stack][group][weight] = Quantized(values=p, scale=scale)
    return {"params": params}


def out_dims(model, weight: str) -> tuple[int, ...]:
    """The output dimensions of a stacked layer matrix ``weight`` (``"q"``, ``"down"``):
    ``layers`` and the dimensions the matmul's output names."""
    inputs = next(t[2] for t in TARGETS.values() if t[1] == weight)
    ndim = 4 if weight in ("q", "k", "v", "o") else 3
    return (0, *range(1 + inputs, ndim))


def state_axes(model) -> dict:
    """The logical axes of both halves of a LoRA state, one tree (``Layout.specs`` matches a
    leaf to the declaration whose path ends its own): ``{"params": base, "lora": adapters}``."""
    return {**logical_axes(declare_frozen(model)), **logical_axes(declare_adapters(model))}


def init_adapters(model, key: jax.Array) -> dict:
    """Fresh adapters (``A`` drawn, ``B`` zero), float32, depending on ``key`` alone."""
    return init_params(declare_adapters(model), key, jnp.float32)


def frozen_of(model, params: dict) -> dict:
    """The base as the state keeps it: ``params`` (``{"params": ...}``, the model's weights), its
    layer matrices quantized when the base is int8 (``dew.nn.int8.quantize``)."""
    if model.lora.base_dtype != "int8":
        return params
    out = jax.tree_util.tree_map(lambda x: x, params["params"])
    for stack, group, weight, _ in _matrices(model, model.declare()):
        values, scale = quantize(out[stack][group][weight], out_dims(model, weight))
        out[stack][group][weight] = Quantized(values=values, scale=scale)
    return {"params": out}


def combine(model, frozen: dict, adapters: dict, keys=None, rate=None) -> dict:
    """The tree the model runs on: ``frozen`` with each adapted weight an ``Adapted`` of its base
    and its adapter. Works alike on trees of ``PartitionSpec`` s.

    With ``model.lora.dropout`` above 0 each ``Adapted`` also takes a dropout key and rate:
    ``keys`` a tree ``{stack: {group: {weight: keys [layers]}}}`` (``dropout_keys``) or one value
    for all (a spec), ``rate`` the rate (a float32 scalar: the model's in a training step, 0 in an
    evaluation) or a spec. Without them, a model with dropout gets the keys of ``jax.random.key(0)``
    and rate 0: the same tree structure as a training step's, dropping nothing."""
    params = dict(frozen["params"])
    dropout = model.lora.dropout > 0
    if dropout and keys is None:
        keys = dropout_keys(model, jax.random.key(0), adapters)
        rate = jnp.zeros((), jnp.float32)
    for stack, groups in adapters["lora"].items():
        layer = dict(params[stack])
        for group, weights in groups.items():
            layer[group] = dict(layer[group])
            for weight, ab in weights.items():
                base = layer[group][weight]
                extra = ()
                if dropout:
                    key = keys[stack][group][weight] if isinstance(keys, dict) else keys
                    # One rate a layer, as one key: the layer loop slices both.
                    shape = getattr(key, "shape", None)
                    extra = (key, rate if shape is None else jnp.broadcast_to(rate, shape))
                layer[group][weight] = Adapted(base, ab["a"], ab["b"], model.lora.scale, *extra)
        params[stack] = layer
    return {"params": params}


def dropout_keys(model, key: jax.Array, adapters: dict, shards=None, tokens=None) -> dict:
    """The dropout keys of one step: ``{stack: {group: {weight: keys}}}``, ``keys`` ``[layers]``
    (this device's layers: a pipeline stage's share), each ``key`` folded with the weight's name
    and the layer's index in the model, and with a hash of ``tokens`` (this device's inputs, a
    microbatch's), so that each microbatch and each device holding other tokens draws its own
    masks. Inside a step (``shards``): a row-parallel weight (o, down), whose input each device of
    a tensor group holds a part of, also folds in the device's tensor index; a column-parallel one
    does not, its input being the same on every device of the group. Masks depend on the layout
    (as they do in any data-parallel run): a layout changes which entries drop, not how many."""
    if tokens is not None:
        flat = tokens.reshape(-1).astype(jnp.uint32)
        weights = jnp.arange(flat.size, dtype=jnp.uint32) * jnp.uint32(2654435761) + 1
        key = jax.random.fold_in(key, jnp.sum(flat * weights))
    t = 1 if shards is None else shards.size("tensor")
    stages = 1 if shards is None else shards.size("stage")
    row = {TARGETS[n][1] for n in ROW_PARALLEL}
    out: dict = {}
    for stack, groups in adapters["lora"].items():
        local = jax.tree_util.tree_leaves(groups)[0].shape[0]
        first = jax.lax.axis_index("stage") * local if stages > 1 else 0
        layers = first + jnp.arange(local)
        for group, weights in groups.items():
            for weight in weights:
                name = f"{stack}/{group}/{weight}"
                weight_key = jax.random.fold_in(key, zlib.crc32(name.encode()) & 0x7FFFFFFF)
                if weight in row and t > 1:
                    weight_key = jax.random.fold_in(weight_key, jax.lax.axis_index("tensor"))
                keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(weight_key, layers)
                out.setdefault(stack, {}).setdefault(group, {})[weight] = keys
    return out


def merge(model, frozen: dict, adapters: dict, dtype=None) -> dict:
    """The model's plain weights with the adapters folded in: ``W + alpha / R * A @ B`` for each
    adapted weight, an int8 base dequantized first; in ``dtype`` (default the model's
    ``param_dtype``). ``model.apply(merge(...), tokens)`` is the adapted model without its
    adapters."""
    dtype = jnp.dtype(model.param_dtype) if dtype is None else dtype
    params = jax.tree_util.tree_map(lambda x: x, frozen["params"])
    for stack, group, weight, _ in _matrices(model, model.declare()):
        w = params[stack][group][weight]
        if isinstance(w, Quantized):
            params[stack][group][weight] = dequantize(
                w.values, w.scale, out_dims(model, weight), jnp.float32
            )
    for stack, groups in adapters["lora"].items():
        for group, weights in groups.items():
            for weight, ab in weights.items():
                a, b = ab["a"].astype(jnp.float32), ab["b"].astype(jnp.float32)
                # [L, *in, R] x [L, R, *out] -> [L, *in, *out], batched over the layers.
                ins, outs = "abc"[: a.ndim - 2], "def"[: b.ndim - 2]
                spec = f"l{ins}r,lr{outs}->l{ins}{outs}"
                w = params[stack][group][weight].astype(jnp.float32)
                params[stack][group][weight] = w + model.lora.scale * jnp.einsum(spec, a, b)
    return {"params": jax.tree_util.tree_map(lambda x: x.astype(dtype), params)}


# --- What the step needs to know about the adapters ---------------------------------------------


def partial_over_tensor(model, adapters_shape: Any, shards) -> dict:
    """A tree of bools shaped like the adapters: those whose gradient each device of a tensor
    group holds a part of (``dew.parallel.gradients.sum_axes``). ``A`` of a column-parallel
    weight (q, k, v, gate, up) is whole on every device and meets each device's heads (or MLP
    columns) of ``B``; ``B`` of a row-parallel weight (o, down) is whole and meets each device's
    partial ``x A``. Nothing on a tensor axis of 1."""
    t = shards.size("tensor")
    row = {TARGETS[n][1] for n in ROW_PARALLEL}

    def partial(path, _):
        names = [str(getattr(k, "key", k)) for k in path]
        weight, half = names[-2], names[-1]
        return t > 1 and (half == "b") == (weight in row)

    return jax.tree_util.tree_map_with_path(partial, adapters_shape)


def some_region_unadapted(lora: Lora) -> bool:
    """Whether some region's projections are all plain weights (no adapter, no int8 base): only
    there can a tensor ring run, ``dew.parallel.tensor_ring`` keeping the plain pair for a weight
    with an einsum of its own (``Adapted``, ``Quantized``)."""
    if lora.base_dtype == "int8":
        return False
    return any(not set(region) & set(lora.targets) for region in REGIONS)


def target_shapes(model) -> dict[str, tuple[int, int]]:
    """``{PEFT name: (in, out)}``: each adapted weight of ``model`` as the matrix ``x W`` takes,
    its input dimensions flattened into ``in`` and its output dimensions into ``out`` (q is
    ``emb x heads * head_dim``)."""
    declared = model.declare()
    shapes = {}
    for stack in _stacks(model, declared):
        for name, group, weight, inputs in _targets_in(model, stack):
            _, *dims = declared["params"][stack][group][weight].shape
            shapes[name] = (math.prod(dims[:inputs]), math.prod(dims[inputs:]))
    return shapes


def check_rank(model) -> None:
    """``ValueError`` when the rank is above an adapted weight's ``min(in, out)``, naming the
    weight whose bound is the lowest: ``A B`` can be of no higher rank than that, so the rest
    of each adapter would be weights that cannot change the update, stored and trained (a rank
    of 100,000 on a 64-wide model was a 2.3 GB checkpoint for a 0.45 MB base)."""
    shapes = target_shapes(model)
    if not shapes:  # an MoE model's MLP targets alone: no weight to adapt
        return
    name = min(shapes, key=lambda n: min(shapes[n]))
    rows, columns = shapes[name]
    if model.lora.rank > min(rows, columns):
        raise ValueError(
            f"LoRA rank {model.lora.rank} is above {name}'s min(in, out) = {min(rows, columns)} "
            f"(its weight is {rows} x {columns})"
        )


def check(model, axis_sizes: dict) -> None:
    """``ValueError`` naming the numbers for a LoRA model a mesh cannot run: kv heads shared over
    ``tensor`` (fewer kv heads than the tensor axis) with k or v adapted or an int8 base."""
    t = axis_sizes.get("tensor", 1)
    if model.kv_heads >= t:
        return
    kv = [n for n in ("k_proj", "v_proj") if n in model.lora.targets]
    if kv or model.lora.base_dtype == "int8":
        what = f"adapters on {' and '.join(kv)}" if kv else "an int8 base"
        raise ValueError(
            f"LoRA with {what} on tensor {t} above num_kv_heads {model.kv_heads}: kv heads shared "
            f"over tensor are not supported with LoRA; use tensor <= {model.kv_heads}"
            + ("" if not kv else ", or targets without k_proj and v_proj")
        )


# --- Which base a run trained on ----------------------------------------------------------------


def _fingerprint(frozen) -> jax.Array:
    """A uint32 hash of every bit of ``frozen``'s weights, the same in every layout: each leaf's
    elements as unsigned integers, times an odd multiplier of their position in the global
    array, summed (mod 2**32, which integer addition keeps exact in any order), each leaf's sum
    mixed with its place in the tree."""
    total = jnp.zeros((), jnp.uint32)
    for i, leaf in enumerate(jax.tree_util.tree_leaves(frozen)):
        unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[leaf.dtype.itemsize]
        bits = jax.lax.bitcast_convert_type(leaf, unsigned).astype(jnp.uint32).reshape(-1)
        position = jnp.arange(bits.size, dtype=jnp.uint32)
        leaf_sum = jnp.sum(bits * (position * jnp.uint32(2654435761) + jnp.uint32(1)))
        total = total * jnp.uint32(1000003) + leaf_sum + jnp.uint32(i)
    return total


def base_checksum(model, frozen) -> str:
    """``"CONFIG-WEIGHTS"``: the CRC-32 of the base's configuration (the model's fields that
    shape its weights and what they compute, and the base's dtype) and ``_fingerprint`` of its
    weights as the state holds them, 8 hex digits each."""
    config = model.architecture()
    config["base_dtype"] = model.lora.base_dtype or model.param_dtype
    text = json.dumps(config, sort_keys=True, default=str)
    crc = zlib.crc32(text.encode()) & 0xFFFFFFFF
    weights = int(jax.jit(_fingerprint)(frozen))
    return f"{crc:08x}-{weights:08x}"
