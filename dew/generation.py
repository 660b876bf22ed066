"""Text from a trained model: ``dew.generate`` and the ``Generator`` it runs.

    import dew

    model, params = dew.load_checkpoint("runs/dew-train")
    out = dew.generate(model, params, ["Once upon a time"], tokenizer="tokenizer.json",
                       max_new_tokens=64, temperature=0.8, top_p=0.95, seed=1)
    print(out[0].completion)

How it runs (``dew.models.decode`` holds the cached forward):

- The prompts of a call are left-padded to one length, a power of two (``bucket``), and the KV
  cache has a fixed number of slots, the power of two that holds the padded prompt and the new
  tokens. One program is compiled per (rows, prompt bucket, cache bucket, greedy or sampled) and
  reused: the prompt is prefilled, then a ``lax.while_loop`` inside the same program decodes one
  token a row per iteration, until every row has met a stop token or ``max_new_tokens`` (both
  traced values: no compile per length or per token).
- The program is one ``jax.shard_map`` over the mesh with the training step's explicit
  collectives: the rows split over ``data`` and ``fsdp``, each layer's weights gathered over
  ``fsdp`` as it runs, the heads, the MLP and the vocabulary split over ``tensor`` (its regions'
  all-reduces, and the logits gathered over ``tensor`` for sampling). ``sequence``, ``stage`` and
  ``expert`` axes are refused.
- Sampling (``sample``): the logits over ``temperature``, the ``top_k`` most likely tokens, then
  the fewest of those whose probability (renormalized) reaches ``top_p`` (the most likely always
  kept); ``temperature=0`` is greedy (the argmax, the lowest id among ties). Each row's draw
  depends on the seed, its index among the prompts and the token's index only, so a layout
  changes no sample.

It is one module, past 450 lines, because the generator, the program it compiles per bucket and
the sampling share the buckets, the mesh and the layout of the weights; the cached forward itself
is ``dew.models.decode``'s.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dew.layout import Layout
from dew.mesh import MeshSpec, build_mesh
from dew.models import decode
from dew.parallel import Shards
from dew.parallel.options import StepOptions

# The smallest prompt bucket: shorter prompts share one program.
MIN_PROMPT_BUCKET = 16
# The axes generation runs on; the others are refused (``Generator``).
AXES_RUN = ("data", "fsdp", "tensor")


def bucket(n: int, least: int = 1) -> int:
    """The power of two at or above ``max(n, least)``."""
    return 1 << (max(n, least) - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class Completion:
    """One prompt's result: ``prompt`` (its text, or its ids when given ids), ``completion`` (the
    new tokens' text; ``None`` without a tokenizer) and ``completion_ids`` (the new ids, the stop
    token included where one ended it)."""

    prompt: Any
    completion: str | None
    completion_ids: list[int]

    def as_json(self) -> dict:
        return {
            "prompt": self.prompt,
            "completion": self.completion,
            "completion_ids": self.completion_ids,
        }


def sample(logits, keys, temperature, top_k, top_p) -> jax.Array:
    """int32 ``[rows]``: one token a row drawn from float32 ``logits`` ``[rows, vocab]`` with the
    PRNG ``keys`` ``[rows]``: from ``softmax(logits / temperature)`` restricted to the ``top_k``
    largest (``top_k <= 0``: all), then to the fewest of those, most likely first, whose
    probabilities (renormalized over the ``top_k``) sum to at least ``top_p`` (``1``: all); the
    most likely token is always kept. Ties rank by id. All three may be traced scalars."""
    vocab = logits.shape[-1]
    order = jnp.argsort(-logits, axis=-1, stable=True)
    ranked = jnp.take_along_axis(logits, order, axis=-1) / temperature
    rank = jnp.arange(vocab)
    keep = (top_k <= 0) | (rank < top_k)
    ranked = jnp.where(keep, ranked, -jnp.inf)
    probs = jax.nn.softmax(ranked, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # the probability of the tokens ranked above
    keep = keep & ((before < top_p) | (rank == 0))
    ranked = jnp.where(keep, ranked, -jnp.inf)
    choice = jax.vmap(jax.random.categorical)(keys, ranked)
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


def check_sampling(temperature, top_k, top_p, max_new_tokens, names=None) -> None:
    """``ValueError`` naming the argument (or the flag, from ``names``) for a value out of range."""
    names = names or {}

    def name(n):
        return names.get(n, n)

    if not (isinstance(temperature, (int, float)) and temperature >= 0):
        raise ValueError(f"{name('temperature')} must be 0 (greedy) or above, got {temperature}")
    if not (isinstance(top_k, int) and top_k >= 0):
        raise ValueError(
            f"{name('top_k')} must be 0 (all tokens) or a positive integer, got {top_k}"
        )
    if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"{name('top_p')} must be above 0 and at most 1, got {top_p}")
    if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
        raise ValueError(f"{name('max_new_tokens')} must be at least 1, got {max_new_tokens}")


class Generator:
    """A model's weights laid out on a mesh, and the programs that generate from them.

    Args:
      model: a ``CausalTransformer`` (dense; with ``lora`` set, ``params`` is its base and
        ``adapters`` its adapters, run unmerged as they trained, an int8 base as int8).
      params: ``{"params": ...}`` (on any devices: they are laid out here).
      adapters: a LoRA model's ``{"lora": ...}``; ``None`` otherwise.
      mesh: a ``MeshSpec`` over ``data``, ``fsdp`` and ``tensor`` (default: every device on
        ``data``, a whole copy of the weights on each; with ``data`` given, only the first
        ``data x model_devices`` devices: ``MeshSpec(data=1)`` is one device), or a built
        ``jax.sharding.Mesh``.
      layout: where each weight lives (default ``Layout()``, as ``dew train``).

    Raises:
      ValueError: an MoE model, a mesh axis generation does not run on, or a model that does not
        split over the mesh's ``tensor`` (naming the sizes).
    """

    def __init__(self, model, params, adapters=None, mesh=None, layout: Layout | None = None):
        decode.check_model(model)
        if (model.lora is None) != (adapters is None):
            raise ValueError(
                "a LoRA model (model.lora set) generates from its base and its adapters: give "
                "both (adapters=...), or merge them first (dew.models.lora.merge)"
            )
        if model.lora is not None and model.lora.dropout:  # no dropout outside training
            model = dataclasses.replace(model, lora=dataclasses.replace(model.lora, dropout=0.0))
        if not isinstance(mesh, jax.sharding.Mesh):
            mesh = mesh_of(mesh or MeshSpec())
        sizes = dict(mesh.shape)
        others = {a: n for a, n in sizes.items() if n > 1 and a not in AXES_RUN}
        if others:
            raise ValueError(
                f"generation runs on data, fsdp and tensor axes; the mesh has "
                f"{', '.join(f'{a} {n}' for a, n in others.items())}"
            )
        model.check_split(sizes)
        if model.lora is not None:
            from dew.models import lora

            lora.check(model, sizes)
        self.model, self.mesh, self.layout = model, mesh, layout or Layout()
        weights, specs = self._laid_out(params, adapters)
        self.weights, self.specs = weights, specs
        self.shards = Shards(
            axis_sizes=sizes,
            param_specs=specs[0] if adapters is None else self._combined_specs(specs),
            options=StepOptions(fsdp_scheme="gather", tensor_scheme="plain"),
        )
        self.row_axes = self.shards.batch_axes()
        self.row_devices = self.shards.size(*self.row_axes)
        self._programs: dict = {}

    def _laid_out(self, params, adapters):
        from dew.models import lora

        model = self.model
        axes = model.logical_axes() if model.lora is None else lora.state_axes(model)
        trees = (params,) if adapters is None else (params, adapters)
        specs = tuple(self.layout.specs(self.mesh, tree, axes) for tree in trees)
        placed = tuple(
            jax.device_put(
                tree,
                jax.tree_util.tree_map(
                    lambda s: NamedSharding(self.mesh, s), spec, is_leaf=_is_spec
                ),
            )
            for tree, spec in zip(trees, specs)
        )
        return placed, specs

    def set_weights(self, params, adapters=None) -> None:
        """Runs the programs on ``params`` (and a LoRA model's ``adapters``) from now on, laid
        out as the constructor lays them out; an array already there (a ``Trainer``'s state on
        this mesh and layout) is used as it is, not copied. The programs compiled so far are
        reused: ``ValueError`` unless the trees have the structure, shapes and dtypes of the
        weights the generator holds."""
        if (self.model.lora is None) != (adapters is None):
            raise ValueError("set_weights takes adapters exactly when the model has lora set")
        weights, _ = self._laid_out(params, adapters)

        def shapes(tree):
            leaves, structure = jax.tree_util.tree_flatten(tree)
            return structure, [(x.shape, x.dtype) for x in leaves]

        if shapes(weights) != shapes(self.weights):
            raise ValueError(
                "set_weights needs weights shaped as the generator's (the same model's): "
                "their tree, shapes or dtypes differ"
            )
        self.weights = weights

    def _combined_specs(self, specs):
        from dew.models import lora

        return lora.combine(self.model, specs[0], specs[1])

    def _params(self, weights):
        from dew.models import lora

        if self.model.lora is None:
            return weights[0]
        return lora.combine(self.model, weights[0], weights[1])

    def _program(self, rows: int, prompt: int, length: int, greedy: bool):
        key = (rows, prompt, length, greedy)
        if key not in self._programs:
            self._programs[key] = self._build(prompt, length, greedy)
        return self._programs[key]

    def _build(self, prompt: int, length: int, greedy: bool):
        model, shards, row_axes = self.model, self.shards, self.row_axes
        width = length - prompt

        def active(done):
            left = jnp.sum(~done, dtype=jnp.int32)
            return (lax.psum(left, row_axes) if row_axes else left) > 0

        def local(
            weights, tokens, pads, row_ids, stops, max_new, temperature, top_k, top_p, seed, ids
        ):
            params = self._params(weights)
            rows = tokens.shape[0]
            base_key = jax.random.key(seed)

            def pick(logits, t):
                # Rows of a vocabulary padded past the tokenizer's ids are never drawn.
                logits = jnp.where(jnp.arange(logits.shape[-1]) < ids, logits, -jnp.inf)
                if greedy:
                    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
                keys = jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(base_key, r), t))(
                    row_ids
                )
                return sample(logits, keys, temperature, top_k, top_p)

            cache = decode.empty_cache(model, rows, length, pads, shards)
            logits, cache = decode.prefill(model, params, tokens, cache, shards)
            token = pick(logits, 0)
            out = jnp.full((rows, width), -1, jnp.int32).at[:, 0].set(token)
            done = jnp.isin(token, stops)

            def more(state):
                t, _, done, _, _ = state
                return (t < max_new) & active(done)

            def step(state):
                t, token, done, out, cache = state
                logits, cache = decode.decode(model, params, token, prompt + t - 1, cache, shards)
                new = pick(logits, t)
                out = lax.dynamic_update_slice(out, jnp.where(done, -1, new)[:, None], (0, t))
                return t + 1, new, done | jnp.isin(new, stops), out, cache

            state = (jnp.int32(1), token, done, out, cache)
            _, _, _, out, _ = lax.while_loop(more, step, state)
            return out

        rows_spec = P(row_axes) if row_axes else P()
        weight_specs = self.specs
        mapped = jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=(weight_specs, rows_spec, rows_spec, rows_spec, *(P(),) * 7),
            out_specs=rows_spec,
            check_vma=False,
        )
        return jax.jit(mapped)

    def __call__(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop_ids: Sequence[int] = (),
        vocab: int | None = None,
    ) -> list[list[int]]:
        """The new ids of each prompt (lists of ids), a stop id included where one ended it.

        ``vocab``: new ids are drawn from ``[0, vocab)`` only (default: the model's whole
        vocabulary), the tokenizer's ids where the model's vocabulary is padded past them
        (``dew train`` rounds a token folder's vocabulary up to a multiple of 128: GPT-2's
        50,257 ids train a 50,304-row embedding), so every new id decodes."""
        check_sampling(temperature, top_k, top_p, max_new_tokens)
        prompts = [list(map(int, p)) for p in prompts]
        if not prompts or any(not p for p in prompts):
            raise ValueError("every prompt needs at least one token (an empty prompt was given)")
        if vocab is None:
            vocab = self.model.vocab_size
        if not 1 <= vocab <= self.model.vocab_size:
            raise ValueError(
                f"vocab {vocab} must be from 1 to the model's vocabulary of "
                f"{self.model.vocab_size} ids"
            )
        bad = sorted({i for p in prompts for i in p if not 0 <= i < vocab})
        if bad:
            raise ValueError(f"prompt ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        longest = max(map(len, prompts))
        if longest + max_new_tokens > self.model.max_seq_len:
            raise ValueError(
                f"the longest prompt ({longest} tokens) and max_new_tokens {max_new_tokens} "
                f"exceed the model's max_seq_len {self.model.max_seq_len}"
            )
        prompt = bucket(longest, MIN_PROMPT_BUCKET)
        length = bucket(prompt + max_new_tokens)
        # Rows padded to a multiple of the devices they split over (the extra rows dropped).
        rows = math.ceil(len(prompts) / self.row_devices) * self.row_devices
        tokens = np.zeros((rows, prompt), np.int32)
        pads = np.full((rows,), prompt - 1, np.int32)
        for i, p in enumerate(prompts):
            tokens[i, prompt - len(p) :] = p
            pads[i] = prompt - len(p)
        stops = np.asarray(sorted(set(stop_ids)) or [-2], np.int32)
        program = self._program(rows, prompt, length, temperature == 0)
        out = program(
            self.weights,
            tokens,
            pads,
            np.arange(rows, dtype=np.int32),
            stops,
            np.int32(max_new_tokens),
            np.float32(temperature or 1.0),
            np.int32(top_k),
            np.float32(top_p),
            np.int32(seed),
            np.int32(vocab),
        )
        out = to_host(out)[: len(prompts), :max_new_tokens]
        return [[int(i) for i in row if i >= 0] for row in out]


def drawable(model, tokenizer) -> int:
    """The ids generation may draw: the tokenizer's (``vocab_size``) where the model's
    vocabulary is padded past them, else the model's (and without a tokenizer)."""
    size = getattr(tokenizer, "vocab_size", None)
    return model.vocab_size if size is None else min(size, model.vocab_size)


def mesh_of(spec: MeshSpec) -> jax.sharding.Mesh:
    """The mesh of ``spec`` over all devices, or over the first ``data x model_devices`` where
    ``spec`` gives ``data`` (``MeshSpec(data=1)``: one device)."""
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    if spec.data is not None:
        devices = devices[: spec.data * spec.model_devices]
    return build_mesh(spec, devices)


def to_host(array: jax.Array) -> np.ndarray:
    """The whole of ``array`` as numpy on this process: the local copy where one is whole, else
    gathered from every process (a collective: every process of the run calls it)."""
    if array.is_fully_addressable or array.is_fully_replicated:
        return np.asarray(array)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def _is_spec(x) -> bool:
    return isinstance(x, P)


def generate(
    model,
    params,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    *,
    tokenizer=None,
    adapters=None,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    stop: Sequence[str | int] | None = None,
    mesh=None,
    layout: Layout | None = None,
) -> list[Completion]:
    """Completions of ``prompts`` by ``model`` with the weights ``params``, decoded with a KV
    cache in one compiled loop (the module's docstring says how).

    Args:
      model: a dense ``CausalTransformer``; with ``lora`` set, ``params`` is its base and
        ``adapters`` its ``{"lora": ...}`` (as ``dew.models.checkpoint.load_lora`` gives them).
      params: ``{"params": ...}``, as ``dew.load_checkpoint`` or ``dew.models.hf.load`` give them.
      prompts: strings (encoded by ``tokenizer``) or lists of token ids.
      tokenizer: a ``dew.data.tokenizer`` tokenizer, or what ``tokenizer_for`` takes (``"bytes"``,
        a ``tokenizer.json`` path); needed for string prompts and for ``completion`` texts.
      max_new_tokens: at most this many new tokens a prompt (default 64).
      temperature: 0 (the default) for greedy decoding; else sample at this temperature.
      top_k: sample from the ``top_k`` most likely tokens (0, the default: all).
      top_p: then from the fewest whose probability reaches ``top_p`` (1.0, the default: all).
      seed: the sampling seed (default 0).
      stop: tokens that end a completion (included in it): ids, or token strings the tokenizer
        encodes as one id; default the tokenizer's ``eos_id`` (none without one).
      mesh: a ``MeshSpec`` over ``data``, ``fsdp`` and ``tensor`` or a built mesh (default: all
        devices on ``data``).
      layout: where each weight lives (default ``Layout()``).

    Returns:
      One ``Completion`` a prompt, in order.

    Raises:
      ValueError: a sampling value out of range (naming it), string prompts without a
        tokenizer, a stop string that is not one token, prompts longer than ``max_seq_len``
        allows, an MoE model or a mesh axis generation does not run on.

    Examples:
        >>> import jax, dew
        >>> from dew.models.causal_transformer import CausalTransformer
        >>> model = CausalTransformer(vocab_size=256, emb_features=32, num_layers=2,
        ...                           num_heads=4, max_seq_len=64)
        >>> params = model.init(jax.random.key(0))
        >>> out = dew.generate(model, params, ["Hi"], tokenizer="bytes", max_new_tokens=5)
        >>> len(out[0].completion_ids)
        5
    """
    if isinstance(tokenizer, (str, os.PathLike)):  # a name or a path, not a tokenizer
        tokenizer = tokenizer_of(tokenizer)
    texts = [isinstance(p, str) for p in prompts]
    if any(texts) and tokenizer is None:
        raise ValueError("string prompts need a tokenizer (tokenizer=...), or give token ids")
    ids = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    stop_ids = stop_ids_of(stop, tokenizer)
    generator = Generator(model, params, adapters, mesh=mesh, layout=layout)
    new = generator(
        ids,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        stop_ids=stop_ids,
        vocab=drawable(model, tokenizer),
    )
    return [
        Completion(p, None if tokenizer is None else tokenizer.decode(n), n)
        for p, n in zip(prompts, new)
    ]


def tokenizer_of(spec):
    """The tokenizer ``spec`` names (``dew.data.tokenizer.tokenizer_for``: a tokenizer, ``"bytes"``,
    a tokenizer.json or a folder holding one); a tokenizer.json with none of the usual
    end-of-text tokens (a model whose config.json names its own) is read without one."""
    from dew.data.tokenizer import tokenizer_for

    try:
        return tokenizer_for(spec)
    except ValueError:
        path = Path(spec) if isinstance(spec, (str, os.PathLike)) else None
        if path is None or str(spec) in ("bytes", "byte") or not path.exists():
            raise
        return _NoEos(path / "tokenizer.json" if path.is_dir() else path)


class _NoEos:
    """A tokenizer.json read as it is, with no end-of-text token of its own."""

    eos_id = None

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(path))
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def stop_ids_of(stop, tokenizer) -> list[int]:
    """The ids of ``stop`` (ids, decimal strings or token strings the tokenizer encodes as one
    id); ``None``: the tokenizer's ``eos_id``, if any."""
    if stop is None:
        eos = getattr(tokenizer, "eos_id", None)
        return [] if eos is None else [eos]
    out = []
    for s in stop:
        if isinstance(s, (int, np.integer)) or (isinstance(s, str) and s.isdigit()):
            out.append(int(s))
            continue
        ids = _token_id(tokenizer, s)
        if ids is None:
            raise ValueError(
                f"stop {s!r} is not one token of the tokenizer (give its id, or a token string)"
            )
        out.append(ids)
    return out


def _token_id(tokenizer, text: str) -> int | None:
    """The id of the token ``text``: the vocabulary's entry, or a text that encodes to one id."""
    if tokenizer is None:
        return None
    inner = getattr(tokenizer, "_tokenizer", None)
    if inner is not None and inner.token_to_id(text) is not None:
        return inner.token_to_id(text)
    ids = tokenizer.encode(text)
    return ids[0] if len(ids) == 1 else None
