"""Hugging Face Llama checkpoints in and out: ``config.json`` and safetensors weights (a model with
an attention window as Mistral's, the Llama with ``sliding_window``: ``dew.models.hf_config``).

    from dew.models import hf

    model, params = hf.load("Llama-3.2-1B")            # one device, float32
    model, params = hf.load(folder, trainer=trainer)   # laid out on the trainer's mesh and layout
    logits = model.apply(params, tokens)
    hf.save(model, params, "out")                      # config.json + model.safetensors

A folder holds ``config.json`` of a ``LlamaForCausalLM`` (``model_type: "llama"``; or of a
``MistralForCausalLM``, ``"mistral"``, the same tensors) and its weights,
``model.safetensors`` or ``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json``.

Names. Hugging Face's ``model.embed_tokens.weight`` ``[vocab, embed]``,
``model.layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``.mlp.{gate,up,down}_proj.weight``,
``.input_layernorm.weight``, ``.post_attention_layernorm.weight``, ``model.norm.weight`` and
``lm_head.weight`` (untied only) become Dew's parameters: the layers stacked on a leading axis,
the projections transposed to ``x @ w`` and their heads a dimension of their own (``q``
``[embed, heads, head_dim]`` is ``q_proj.weight`` ``[heads * head_dim, embed]`` transposed and
split). No permutation of q and k: Hugging Face's checkpoints are already permuted for its
``rotate_half`` rotary, pairs ``(x[i], x[i + d/2])``, which is Dew's (``dew.nn.rotary``).

Loading reads, for each parameter, only the slices that this process's devices hold: each slice
is filled, in the parameter's dtype, from the safetensors files by positioned reads of the rows it
needs, a few rows at a time (at most ``safetensors.SCRATCH_BYTES`` of whole rows, and the part of
them kept), and sent to its devices before the next is read (``dew.checkpoints.reader``'s
placement). Its host buffer is 64-byte aligned, so the CPU backend adopts it as the device buffer
instead of copying it. No host ever holds the whole model: a process holds its devices' share
and two scratch-sized buffers (measured in docs/results/cpu-layouts.md, "Hugging Face load: host
memory").
Everything that can be checked before reading is checked first (the config, the names, shapes and
dtypes of every tensor, the files' sizes): a ``ValueError`` naming the problem, and no parameters.

Layout: the mapping of names and shapes (``Mapping``, ``mappings``); ``config_of``; reading a folder
(``_tensors``, ``_checked``, the ``_Reader`` that fills a device's slices, ``_place``,
``_place_quantized``, ``load``); writing one (``_to_hf``, ``save``); and the Dew checkpoint's side
(``describe``, ``model_of_metadata``, ``params_prefix``). It is one module because loading and
saving are one mapping of names and shapes read in both directions; the config's side is
``dew.models.hf_config``, the file format ``dew.models.safetensors``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from dew.checkpoints import reader
from dew.checkpoints.memory import aligned_empty
from dew.models import safetensors
from dew.models.causal_transformer import ARCHITECTURE_FIELDS, CausalTransformer, resolve_dtype
from dew.models.hf_config import (
    ARCHITECTURE,
    CARRIED_FIELDS,
    CONFIG,
    WINDOWED_ARCHITECTURE,
    architecture,
    carried_fields,
    is_hf_folder,
    model_from_config,
    read_config,
)
from dew.nn.int8 import Quantized, host_quantize

# The config's side (``dew.models.hf_config``) is part of this module's API.
__all__ = [
    "load",
    "save",
    "mappings",
    "config_of",
    "describe",
    "model_of_metadata",
    "params_prefix",
    "model_from_config",
    "read_config",
    "is_hf_folder",
    "architecture",
    "carried_fields",
    "CARRIED_FIELDS",
    "CONFIG",
    "SINGLE",
    "INDEX",
    "ARCHITECTURE",
    "WINDOWED_ARCHITECTURE",
]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# Dew's default shard size: transformers 4.x's save_pretrained default (5.x writes 50 GB files).
MAX_SHARD_BYTES = 5 * 10**9

# How a Dew parameter is laid out in a Hugging Face tensor.
SAME = "same"  # the same array
TRANSPOSED = "transposed"  # Dew [a, b] = HF [b, a]
IN_HEADS = "in_heads"  # Dew [embed, heads, head_dim] = HF [heads * head_dim, embed]
OUT_HEADS = "out_heads"  # Dew [heads, head_dim, embed] = HF [embed, heads * head_dim]


@dataclasses.dataclass(frozen=True)
class Mapping:
    """Where one Dew parameter lives: ``name`` (with ``{}`` for the layer of a stacked one)."""

    path: tuple[str, ...]  # under params["params"]
    name: str
    kind: str
    stacked: bool


def mappings(model: CausalTransformer) -> list[Mapping]:
    """The Hugging Face tensor of every Dew parameter of ``model``, in Hugging Face's order."""
    if model.num_experts:
        raise ValueError(
            f"a mixture-of-experts model (num_experts {model.num_experts}) has no Llama "
            "checkpoint layout; dew.models.hf reads and writes dense Llama models"
        )
    layer = "model.layers.{}."
    out = [Mapping(("embed_tokens", "embedding"), "model.embed_tokens.weight", SAME, False)]
    for proj, kind in (("q", IN_HEADS), ("k", IN_HEADS), ("v", IN_HEADS), ("o", OUT_HEADS)):
        out.append(
            Mapping(("layers", "attn", proj), layer + f"self_attn.{proj}_proj.weight", kind, True)
        )
    for proj in ("gate", "up", "down"):
        out.append(
            Mapping(("layers", "mlp", proj), layer + f"mlp.{proj}_proj.weight", TRANSPOSED, True)
        )
    out += [
        Mapping(("layers", "attn_norm", "scale"), layer + "input_layernorm.weight", SAME, True),
        Mapping(
            ("layers", "mlp_norm", "scale"), layer + "post_attention_layernorm.weight", SAME, True
        ),
        Mapping(("final_norm", "scale"), "model.norm.weight", SAME, False),
    ]
    if not model.tie_embeddings:
        out.append(Mapping(("lm_head", "kernel"), "lm_head.weight", TRANSPOSED, False))
    return out


def _hf_shape(kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The Hugging Face tensor's shape for one layer's Dew ``shape``."""
    if kind == SAME:
        return shape
    if kind == TRANSPOSED:
        return shape[::-1]
    if kind == IN_HEADS:
        embed, heads, head_dim = shape
        return (heads * head_dim, embed)
    heads, head_dim, embed = shape
    return (embed, heads * head_dim)


# --- config.json ---------------------------------------------------------------------------------


def config_of(model: CausalTransformer, dtype: str) -> dict:
    """``config.json`` of ``model`` for transformers' ``LlamaForCausalLM`` (weights in
    ``dtype``), with ``rope_theta`` and ``rope_scaling`` as Meta's published files spell them;
    for a model with an ``attention_window``, ``MistralForCausalLM``'s: the same fields and
    ``sliding_window``, the window itself (``hf_config``'s docstring: the two windows agree)."""
    mappings(model)  # refuses an MoE model
    if model.attention_window is not None:
        config = config_of(dataclasses.replace(model, attention_window=None), dtype)
        del config["attention_bias"], config["mlp_bias"]  # Mistral has neither field
        return {
            **config,
            "architectures": [WINDOWED_ARCHITECTURE],
            "model_type": "mistral",
            "sliding_window": model.attention_window,
        }
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "vocab_size": model.vocab_size,
        "hidden_size": model.emb_features,
        "intermediate_size": model.hidden,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_heads,
        "num_key_value_heads": model.kv_heads,
        "head_dim": model.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "max_position_embeddings": model.max_seq_len,
        "rms_norm_eps": model.rms_norm_eps,
        "rope_theta": model.rope_theta,
        "rope_scaling": model.rope_scaling.as_config() if model.rope_scaling else None,
        "tie_word_embeddings": model.tie_embeddings,
        "torch_dtype": dtype,
    }


# --- Reading a folder ----------------------------------------------------------------------------


def _tensors(folder: Path) -> dict[str, safetensors.Tensor]:
    """Every tensor of the folder's safetensors files, by name, their headers checked."""
    index_path = folder / INDEX
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{index_path} has no readable weight_map ({error})") from None
        files = sorted(set(weight_map.values()))
    elif (folder / SINGLE).is_file():
        weight_map, files = None, [SINGLE]
    else:
        raise ValueError(f"{folder} holds neither {SINGLE} nor {INDEX}")
    tensors: dict[str, safetensors.Tensor] = {}
    for name in files:
        if Path(name).name != name:
            raise ValueError(f"{index_path}: file {name!r} is not a file name in the folder")
        header = safetensors.Header.read(folder / name)
        for tensor_name, tensor in header.tensors.items():
            if tensor_name in tensors:
                raise ValueError(f"{folder}: tensor {tensor_name!r} is in two files")
            tensors[tensor_name] = tensor
    if weight_map is not None:
        for tensor_name, file in weight_map.items():
            found = tensors.get(tensor_name)
            if found is None or found.path.name != file:
                raise ValueError(f"{index_path}: tensor {tensor_name!r} is not in {file}")
    return tensors


def _checked(model: CausalTransformer, tensors: dict, folder: Path) -> dict[str, np.dtype]:
    """Every tensor the model needs present with its shape, none other; ``ValueError`` naming
    them otherwise."""
    abstract = jax.eval_shape(model.init, jax.random.key(0))["params"]
    expected = {}
    for m in mappings(model):
        shape = _get(abstract, m.path).shape
        if m.stacked:
            for i in range(shape[0]):
                expected[m.name.format(i)] = _hf_shape(m.kind, shape[1:])
        else:
            expected[m.name] = _hf_shape(m.kind, shape)
    # Rotary frequencies some old checkpoints keep as buffers: derived from the config.
    present = {name for name in tensors if not name.endswith("rotary_emb.inv_freq")}
    missing = sorted(set(expected) - present)
    extra = sorted(present - set(expected))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {_few(missing)}")
        if extra:
            tied = " (tie_word_embeddings is true)" if "lm_head.weight" in extra else ""
            parts.append(f"unexpected {_few(extra)}{tied}")
        raise ValueError(f"{folder} does not hold this model's tensors: " + "; ".join(parts))
    for name, shape in expected.items():
        if tensors[name].shape != shape:
            raise ValueError(
                f"{folder}: tensor {name} has shape {list(tensors[name].shape)}, the config "
                f"needs {list(shape)}"
            )
    return expected


def _few(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


class _Reader:
    """Builds boxes of Dew parameters from a folder's tensors."""

    def __init__(self, model: CausalTransformer, tensors: dict):
        self.model, self.tensors = model, tensors

    def box(self, m: Mapping, start, stop, dtype) -> np.ndarray:
        """The box ``[start, stop)`` of ``m``'s parameter in ``dtype``: a new array, 64-byte
        aligned so that the CPU backend adopts it as a device buffer instead of copying it."""
        out = aligned_empty(tuple(b - a for a, b in zip(start, stop)), dtype)
        if m.stacked:
            for j, layer in enumerate(range(start[0], stop[0])):
                self.fill(out[j], m, layer, start[1:], stop[1:])
        else:
            self.fill(out, m, None, start, stop)
        return out

    def fill(self, out: np.ndarray, m: Mapping, layer, start, stop) -> None:
        """Writes one layer's box ``[start, stop)`` of ``m``'s parameter into ``out``, reading
        the Hugging Face tensor a few rows at a time (at most ``safetensors.SCRATCH_BYTES`` of
        them): besides ``out``, nothing as large as the box is ever held."""
        tensor = self.tensors[m.name.format(layer) if m.stacked else m.name]
        row_bytes = math.prod(tensor.shape[1:]) * tensor.dtype.itemsize
        head_dim = self.model.head_dim
        if m.kind == IN_HEADS:  # HF rows: heads x head_dim (Dew's axes 1, 2); columns: embed
            (e0, h0, d0), (e1, h1, d1) = start, stop
            for a, b in _chunks(h0, h1, head_dim * row_bytes):
                rows = safetensors.read_block(tensor, (a * head_dim, b * head_dim), (e0, e1))
                block = rows.reshape(b - a, head_dim, e1 - e0)[:, d0:d1]
                out[:, a - h0 : b - h0] = block.transpose(2, 0, 1)
        elif m.kind == OUT_HEADS:  # HF rows: embed (Dew's axis 2); columns: heads x head_dim
            (h0, d0, e0), (h1, d1, e1) = start, stop
            for a, b in _chunks(e0, e1, row_bytes):
                cols = safetensors.read_block(tensor, (a, b), (h0 * head_dim, h1 * head_dim))
                block = cols.reshape(b - a, h1 - h0, head_dim)[:, :, d0:d1]
                out[:, :, a - e0 : b - e0] = block.transpose(1, 2, 0)
        elif m.kind == TRANSPOSED:  # HF rows: Dew's axis 1
            for a, b in _chunks(start[1], stop[1], row_bytes):
                block = safetensors.read_block(tensor, (a, b), (start[0], stop[0]))
                out[:, a - start[1] : b - start[1]] = block.T
        else:  # SAME: HF rows are Dew's axis 0
            cols = (start[1], stop[1]) if len(start) == 2 else None
            for a, b in _chunks(start[0], stop[0], row_bytes):
                out[a - start[0] : b - start[0]] = safetensors.read_block(tensor, (a, b), cols)


def _chunks(first: int, last: int, unit_bytes: int):
    """``[a, b)`` ranges covering ``[first, last)``, each of at most
    ``safetensors.SCRATCH_BYTES`` of units of ``unit_bytes`` (at least one unit)."""
    step = max(1, safetensors.SCRATCH_BYTES // max(unit_bytes, 1))
    for a in range(first, last, step):
        yield a, min(last, a + step)


def _place(shape, dtype, sharding, fill: Callable) -> jax.Array:
    """A global array of ``shape`` laid out by ``sharding``, each distinct slice this process's
    devices hold built by ``fill(start, stop)`` and sent to them before the next is built."""
    arrays = []
    for (start, stop), devices in reader._target_slices(shape, sharding).items():
        host = np.ascontiguousarray(fill(start, stop), dtype)
        arrays.extend(reader._place(host, devices))
        del host
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def _place_quantized(read: _Reader, m: Mapping, shape, sharding: Quantized) -> Quantized:
    """The stacked layer matrix ``m`` of ``shape`` ``[layers, *in_dims, *out_dims]`` as a
    ``Quantized`` laid out by ``sharding`` (a ``Quantized`` of two shardings), int8 with a float32
    scale per output channel (``dew.nn.int8``), quantized box by box as it is read.

    A box's scales need its output channels' every input row, so each box is read with its input
    dimensions whole, one layer at a time (float32: at most one layer's matrix for the box's
    output channels), quantized on the host and cut to the box: a device whose box splits the
    input dimensions reads more of the file than it keeps. The scales the values' pass found are
    kept (they are small) for the scales' pass, which reads the file again only for a box of
    output channels the values' boxes did not have. No host holds more than one layer's matrix
    in float32."""
    inputs = 2 if m.path[-1] == "o" else 1
    out_dims = tuple(range(inputs, len(shape) - 1))
    found: dict = {}  # (layer, start, stop) of output channels -> their scales

    def layer_box(layer, start, stop):
        """``(q, scale)`` of one layer's output channels ``[start, stop)`` (output dims only),
        every input row."""
        first = (layer, *([0] * inputs), *start)
        last = (layer + 1, *shape[1 : 1 + inputs], *stop)
        whole = read.box(m, first, last, np.float32)[0]
        q, scale = host_quantize(whole, out_dims)
        found[(layer, tuple(start), tuple(stop))] = scale
        return q, scale

    def values(start, stop):
        out = aligned_empty(tuple(b - a for a, b in zip(start, stop)), np.int8)
        for j, layer in enumerate(range(start[0], stop[0])):
            q, _ = layer_box(layer, start[1 + inputs :], stop[1 + inputs :])
            cut = tuple(slice(a, b) for a, b in zip(start[1 : 1 + inputs], stop[1 : 1 + inputs]))
            out[j] = q[cut]
        return out

    def scales(start, stop):
        out = aligned_empty(tuple(b - a for a, b in zip(start, stop)), np.float32)
        for j, layer in enumerate(range(start[0], stop[0])):
            scale = found.get((layer, tuple(start[1:]), tuple(stop[1:])))
            out[j] = layer_box(layer, start[1:], stop[1:])[1] if scale is None else scale
        return out

    scale_shape = (shape[0], *shape[1 + inputs :])
    return Quantized(
        values=_place(shape, np.int8, sharding.values, values),
        scale=_place(scale_shape, np.float32, sharding.scale, scales),
    )


def load(
    folder: str | os.PathLike,
    trainer=None,
    *,
    dtype: str | None = None,
    shardings=None,
    model: CausalTransformer | None = None,
    **overrides,
) -> tuple[CausalTransformer, dict]:
    """``(model, params)`` of the Hugging Face Llama folder ``folder``.

    Args:
      trainer: a ``dew.Trainer`` whose model is this checkpoint's (same sizes, heads, rope and
        eps; ``ValueError`` naming the fields that differ): the params are laid out on its mesh
        and layout, in its model's ``param_dtype``, and ``model`` is the trainer's. Without it:
        the model of ``config.json`` and its params on one device (``jax.devices()[0]``).
      dtype: the params' dtype without a trainer (default ``"float32"``, whatever the files hold).
      shardings: instead of ``trainer``, a tree of shardings shaped like the params (with
        ``model``, the model they are for). A layer matrix whose sharding is a
        ``dew.nn.int8.Quantized`` of two (a LoRA model's int8 base, ``dew.models.lora``) is
        quantized as it is read, box by box (``_place_quantized``).
      overrides: fields of the model built from ``config.json`` (``max_seq_len``,
        ``attention_impl``, ``dtype`` of the activations); without a trainer only.

    Each process reads only the slices its devices hold. ``ValueError`` before anything is read
    for a config Dew cannot run, a missing or unexpected tensor, a wrong shape, an unsupported
    dtype or a truncated file.
    """
    folder = Path(folder)
    config = read_config(folder)
    where = str(folder / CONFIG)
    if trainer is not None:
        if getattr(trainer, "lora", None) is not None:
            raise ValueError(
                "hf.load(trainer=...) of a LoRA trainer: its parameters are adapters; the "
                "trainer reads its base itself (Trainer(base=FOLDER))"
            )
        model, shardings = trainer.objective.model, trainer.state_shardings.params
    if model is not None:
        if overrides or dtype is not None:
            raise ValueError("dtype and model overrides go with no trainer (the model is given)")
        described = model_from_config(config, where, max_seq_len=model.max_seq_len)
        differ = {
            field: (getattr(described, field), getattr(model, field))
            for field in ARCHITECTURE_FIELDS
            if getattr(described, field) != getattr(model, field)
        }
        if differ:
            raise ValueError(
                f"{folder} is not this model: "
                + ", ".join(
                    f"{f} {a!r} in the folder, {b!r} in the model" for f, (a, b) in differ.items()
                )
            )
    else:
        model = model_from_config(config, where, **{"param_dtype": dtype or "float32", **overrides})
    tensors = _tensors(folder)
    _checked(model, tensors, folder)
    abstract = jax.eval_shape(model.init, jax.random.key(0))
    if shardings is None:
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree_util.tree_map(lambda _: one, abstract)
    target = resolve_dtype(model.param_dtype)
    read = _Reader(model, tensors)
    params: dict = {"params": {}}
    for m in mappings(model):
        leaf = _get(abstract["params"], m.path)
        sharding = _get(shardings["params"], m.path)
        if isinstance(sharding, Quantized):  # a LoRA model's int8 base: quantized as it is read
            array = _place_quantized(read, m, leaf.shape, sharding)
        else:
            array = _place(
                leaf.shape,
                target,
                sharding,
                lambda start, stop, m=m: read.box(m, start, stop, target),
            )
        node = params["params"]
        for key in m.path[:-1]:
            node = node.setdefault(key, {})
        node[m.path[-1]] = array
    return model, params


# --- Writing a folder ----------------------------------------------------------------------------


def _to_hf(kind: str, block: np.ndarray) -> np.ndarray:
    """One layer's Dew parameter as its Hugging Face tensor."""
    if kind == SAME:
        return block
    if kind == TRANSPOSED:
        return block.T
    if kind == IN_HEADS:
        embed, heads, head_dim = block.shape
        return block.transpose(1, 2, 0).reshape(heads * head_dim, embed)
    heads, head_dim, embed = block.shape
    return block.transpose(2, 0, 1).reshape(embed, heads * head_dim)


def _host(array, index=None) -> np.ndarray:
    """``array`` (or its slice ``index`` of the leading axis) on this host."""
    if isinstance(array, jax.Array) and not array.is_fully_addressable:
        raise ValueError(
            "hf.save writes from one process: these params span several processes; save a "
            "checkpoint and run dew convert CKPT_DIR HF_FOLDER --to hf on one host"
        )
    return np.asarray(array if index is None else array[index])


def save(
    model: CausalTransformer,
    params: dict,
    folder: str | os.PathLike,
    *,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    carried: dict | None = None,
) -> list[str]:
    """Writes ``params`` of ``model`` as a Hugging Face Llama folder: ``config.json`` and
    ``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` files of at most
    ``max_shard_bytes`` each (a larger tensor gets a file of its own) with
    ``model.safetensors.index.json``. Each tensor keeps its parameter's dtype. Returns the files
    written.

    ``carried``: ``config.json`` fields Dew does not model, written as given: the special tokens'
    ids of the folder the weights came from (``hf_config.carried_fields``; ``ValueError`` for a
    field not in ``CARRIED_FIELDS``).

    ``params``: ``{"params": ...}`` on one device or laid out on a mesh of this process's devices;
    one layer's tensor at a time is brought to the host. ``folder`` may exist, but not with a
    ``config.json`` or safetensors weights in it (``FileExistsError``): nothing is overwritten.
    Files are written under temporary names and renamed, ``config.json`` last.
    """
    folder = Path(folder)
    ms = mappings(model)
    carried = dict(carried or {})
    unknown = sorted(set(carried) - set(CARRIED_FIELDS))
    if unknown:
        raise ValueError(
            f"carried config.json fields {', '.join(unknown)} are not among "
            f"{', '.join(CARRIED_FIELDS)}"
        )
    if folder.exists():
        taken = [n for n in (CONFIG, SINGLE, INDEX) if (folder / n).exists()]
        taken += sorted(p.name for p in folder.glob("model-*.safetensors"))
        if taken:
            raise FileExistsError(f"{folder} already holds {', '.join(taken)}; not overwriting")
    p = params["params"]
    entries, dtypes = [], set()
    for m in ms:
        leaf = _get(p, m.path)
        dtype = np.dtype(leaf.dtype)
        if dtype not in safetensors.NAMES:
            raise ValueError(f"parameter {'/'.join(m.path)} has dtype {dtype}, not writable")
        dtypes.add(dtype)
        layers = range(leaf.shape[0]) if m.stacked else [None]
        for i in layers:
            shape = _hf_shape(m.kind, leaf.shape[1:] if m.stacked else leaf.shape)
            make = lambda leaf=leaf, i=i, kind=m.kind: _to_hf(kind, _host(leaf, i))  # noqa: E731
            entries.append((m.name.format(i), dtype, shape, make))
    # Files: consecutive tensors up to max_shard_bytes each.
    groups: list[list] = [[]]
    size = 0
    for entry in entries:
        nbytes = math.prod(entry[2]) * entry[1].itemsize
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(entry)
        size += nbytes
    folder.mkdir(parents=True, exist_ok=True)
    if len(groups) == 1:
        names = [SINGLE]
    else:
        names = [f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))]
    written = []
    try:
        for name, group in zip(names, groups):
            safetensors.write(folder / (name + ".tmp"), group, metadata={"format": "pt"})
            written.append(name)
        if len(groups) > 1:
            index = {
                "metadata": {"total_size": sum(math.prod(e[2]) * e[1].itemsize for e in entries)},
                "weight_map": {e[0]: name for name, group in zip(names, groups) for e in group},
            }
            (folder / (INDEX + ".tmp")).write_text(json.dumps(index, indent=2) + "\n")
            written.append(INDEX)
        dtype_name = str(max(dtypes, key=lambda d: d.itemsize)) if dtypes else "float32"
        (folder / (CONFIG + ".tmp")).write_text(
            json.dumps({**config_of(model, dtype_name), **carried}, indent=2) + "\n"
        )
        written.append(CONFIG)
    except BaseException:
        for name in [*names, INDEX, CONFIG]:
            (folder / (name + ".tmp")).unlink(missing_ok=True)
        raise
    for name in written:
        os.replace(folder / (name + ".tmp"), folder / name)
    return written


# --- Dew checkpoints -----------------------------------------------------------------------------


def describe(model) -> dict:
    """A JSON-able record of ``model`` (``{"name", "config"}``), kept in a checkpoint's
    metadata, from which ``model_of_metadata`` builds it again."""
    config = dataclasses.asdict(model)
    return {"name": type(model).__name__, "config": config}


def model_of_metadata(metadata: dict, where: str) -> CausalTransformer:
    described = metadata.get("model")
    if not isinstance(described, dict) or described.get("name") != CausalTransformer.__name__:
        raise ValueError(
            f"{where} does not record its model (metadata 'model' of a CausalTransformer): "
            "it was written before Dew kept it"
        )
    return CausalTransformer(**described["config"])


def params_prefix(checkpoints, step: int | None = None) -> str:
    """Where a checkpoint keeps the weights: ``".params"`` in a training state (``dew
    train``), ``""`` in a checkpoint of weights alone (``dew convert``)."""
    metadata = checkpoints.metadata(step)
    return "" if metadata.get("contents") == "params" else ".params"
