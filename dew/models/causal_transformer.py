"""A decoder-only language model in plain JAX, read top to bottom.

tokens -> embedding -> num_layers x [RMSNorm -> causal self-attention (rotary, grouped queries)
-> +, RMSNorm -> SwiGLU MLP -> +] -> RMSNorm -> logits through the (tied) embedding table.

With ``num_experts`` set, the MLP of every ``moe_every``-th layer is a mixture of experts
(``dew.nn.moe``): layer ``i`` (from 0) is an MoE layer when ``(i + 1) % moe_every == 0``.

The layers' weights are stacked on a leading ``layers`` dimension, one stack per kind
(``layers`` for dense layers, ``moe_layers`` for MoE ones), and run under ``lax.scan``: by default
(``layer_loop="scan"``) as a loop, so compile time does not grow with depth; ``"unroll"`` compiles
every layer on its own (``LAYER_LOOPS`` says what each costs). Each layer body runs under
``jax.checkpoint`` with the ``remat`` policy: by default (``"full"``) saving nothing, so the
backward recomputes the layer; ``"dots"`` keeps the weight matmuls' outputs, ``"attention"`` the
attention's inputs and output (and the kernels' lse) too, ``"none"`` everything. In every policy
the gathers of fsdp-split weights run again in the backward (a gather is never saved), so only
one layer's whole weights are ever alive (gather forward, gather again backward, scatter the
gradients).

The model is three parts a layout can run apart, ``embed``, ``blocks`` and ``head``; ``apply`` is
their composition (tokens -> logits).

Tensor parallelism is written where it happens, and nowhere else: attention and the MLP are
Megatron regions (``region.enter`` on the way in, ``region.leave`` on the way out:
``dew.parallel.tensor``'s pairs, or, under ``tensor_scheme="ring"``, the layers' own projections as
collective matmuls, ``dew.parallel.tensor_ring``), their first matmuls split by columns (``q``,
``k``, ``v`` over heads; ``gate``, ``up`` over the MLP width) and their second by rows (``o``,
``down``); the embedding, head and loss split the vocabulary. On one device every one of those is
the identity or the plain operation.

Layout: the recompute policies (``REMAT_POLICIES``, ``remat_layer``), then one class,
``CausalTransformer``: its fields and their checks; the weights it declares (``declare``); what a
mesh asks of it (``attention_for``, ``check_split``, ``partial_over_tensor``, ``in_layer_loop``);
``init``; the three parts and what they share (``share_embedding``, ``embed``, ``blocks``, ``head``,
``head_loss_sum``); and ``apply``, their composition. It is one module on purpose: the model read
top to bottom (nanoGPT's rule), with its layers in ``dew.nn`` and every split in ``dew.parallel``;
what is here is the wiring of those, and where each split meets the model.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from dew.checks import positive_int
from dew.layout import path_names
from dew.models import lora
from dew.nn import attention, embed, mlp, moe, norm, quantized, rotary
from dew.nn.param import Param, init_params, logical_axes, normal
from dew.parallel import (
    ONE_DEVICE,
    Shards,
    expert,
    fsdp,
    fsdp_int8,
    gspmd_kernel,
    ragged,
    sequence,
    tensor,
    tensor_ring,
    vocabulary,
)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

# The fields that decide the weights and what they compute (a Llama config.json's); the others
# (max_seq_len aside) are how Dew runs them.
ARCHITECTURE_FIELDS = (
    "vocab_size",
    "emb_features",
    "num_layers",
    "num_heads",
    "kv_heads",
    "hidden",
    "tie_embeddings",
    "rope_theta",
    "rope_scaling",
    "rms_norm_eps",
)

# The MLP's normalized input (before a tensor group gathers it), which "attention" saves too.
MLP_INPUT = "mlp_input"

# What each layer keeps from its forward for the backward (``remat``), named by what is saved.
# "dots" is jax's dots_with_no_batch_dims_saveable: the outputs of the matmuls against weights
# (q, k, v, o, the MLP's three), not attention's q.k and p.v, whose batch dimensions (rows, heads)
# mark them as the seq x seq products a layer must not keep (checkpoint_dots would keep them).
_SAVE_DOTS = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    # "attention_gate" keeps the attention kernel's output and lse and the MLP's gate projection
    # (a dense layer's: an MoE layer's experts recompute theirs), no other matmul's: the backward
    # recomputes q, k, v, o and up (and the norms and rotation), not attention's forward kernel
    # nor the gate, where "full" reruns all of the layer but its down projection. For a model
    # whose "dots" does not fit: Llama-3.2-1B on one v5e chip at 4 x 2048 tokens (bfloat16
    # weights and moments) needs 16.8 GiB with "dots", 13.4 with this, 10.5 with "full", and
    # recomputes 447 of the 790 GFLOP a layer "full" does: 561.0 ms a step against 590.7, 60.9%
    # MFU (docs/benchmarks.md). Keeping q and k rotated too (as "attention" does) took it to 15.1
    # GiB and 592.2 ms, no faster than "full"; keeping them without the gate, 568.0 ms.
    "attention_gate": jax.checkpoint_policies.save_only_these_names(
        attention.OUT_NAME, attention.LSE_NAME, mlp.GATE_NAME
    ),
    # And an int8 projection's output, by its name (dew.nn.quantized): kept, it leaves the int32
    # sums behind it unneeded, which this would keep as a dot's output, twice its bytes.
    "dots": jax.checkpoint_policies.save_from_both_policies(
        _SAVE_DOTS, jax.checkpoint_policies.save_only_these_names(quantized.OUT_NAME)
    ),
    # "attention" also keeps the MLP's normalized input: recomputing it in the backward, XLA fused
    # the norm into both the gate's and the up projection's weight gradients under shard_map
    # (not under GSPMD), each reading the residual in float32. On one v5e chip (GPT-2 small, 16 x
    # 1024 tokens) keeping it took shard_map from 1.03x the GSPMD step to 1.00x, for 245 MiB
    # (docs/benchmarks.md). It keeps q and k rotated, in place of the projections' outputs "dots"
    # would keep (the same bytes): the backward's attention call takes them as they are, where it
    # rotated them again (compiled for v5e, GPT-2 small: no rotation left in the backward).
    "attention": jax.checkpoint_policies.save_from_both_policies(
        _SAVE_DOTS,
        jax.checkpoint_policies.save_only_these_names(
            attention.OUT_NAME,
            attention.LSE_NAME,
            attention.ROTATED_NAME,
            MLP_INPUT,
            quantized.OUT_NAME,
        ),
    ),
    "none": None,
}
REMAT_CHOICES = tuple(REMAT_POLICIES)
# remat="auto": the least recomputation whose step fits the devices, chosen by compiling it
# (``dew.training.remat_choice.choose_remat``, which the Trainer calls before it builds a step).
REMAT_AUTO = "auto"

# How ``blocks`` runs the layers (``layer_loop``). "scan": one loop, whose body is compiled once;
# what a layer keeps for the backward is written into a stack indexed by the loop, and read back
# out of it, and a kernel's operand sliced from a stack is a copy of its own (on one v5e chip,
# GPT-2 small at 16 x 1024 tokens: ops writing into the stacks or copying out of them took 8.8 ms
# of a profiled 142 ms step). "unroll": every layer compiled on its own, each residual a buffer of
# its own: 124.8 ms against 139.6 there (56.9% MFU), for a compile 2.2 times as long (67 s
# against 31) that grows with depth (docs/benchmarks.md). Unrolled, the remat policy says what
# the backward may recompute, not what XLA keeps: ``remat_layer``'s prevent_cse=False lets XLA
# merge a recomputation into the forward, which only a loop rules out (GPT-2 small's
# temporaries, "attention": 6.44 GiB unrolled against 6.71 scanned; Llama-3.2-1B at 4 x 2048,
# "full": 22.7 GiB against 4.8, `dew plan --target v5e-1`). `dew plan` tells what a choice costs.
LAYER_LOOPS = ("scan", "unroll")


def remat_layer(layer, policy: str):
    """``layer`` under ``jax.checkpoint`` with the policy ``policy`` names (``REMAT_POLICIES``);
    ``"none"``: ``layer`` itself, every intermediate kept for the backward."""
    if policy == REMAT_AUTO:
        raise ValueError(
            "remat='auto' is chosen by compiling the step (dew.training.remat_choice."
            "choose_remat; the Trainer does it before its first step): choose it before tracing "
            "the model"
        )
    if policy not in REMAT_POLICIES:
        raise ValueError(
            f"unknown remat policy {policy!r}; expected one of {', '.join(REMAT_CHOICES)}"
        )
    if policy == "none":
        return layer
    # prevent_cse=False: the layers run under lax.scan, which already keeps XLA from merging the
    # recomputation into the forward (jax.checkpoint's documented exception). Unrolled
    # (layer_loop="unroll") XLA may merge it: LAYER_LOOPS says what that does to memory. It stays
    # so: on one v5e chip GPT-2 small's unrolled step took 128.2 ms with prevent_cse=True, 124.7
    # without (docs/benchmarks.md).
    return jax.checkpoint(layer, policy=REMAT_POLICIES[policy], prevent_cse=False)


def resolve_dtype(name: str):
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPES)}")
    return DTYPES[name]


@dataclasses.dataclass(frozen=True)
class CausalTransformer:
    """A Llama-style decoder (RMSNorm, rotary positions, grouped-query attention, SwiGLU MLP or
    mixture of experts): its configuration, and pure functions of its weights.

    A frozen dataclass: ``init(key)`` makes the weights (``{"params": ...}``), ``apply(params,
    tokens)`` runs them; ``embed``, ``blocks`` and ``head`` are its three parts, which the
    ``Trainer``'s step runs apart on each device's shards.

    Args:
      vocab_size, emb_features, num_layers, num_heads, max_seq_len: the usual sizes (required);
        ``emb_features`` must split over ``num_heads`` into an even ``head_dim``.
      dtype: activations' dtype (``"float32"``, the default, ``"bfloat16"``, ``"float16"``);
        softmax, norms and the loss run in float32 regardless.
      attention_impl: ``"xla"`` (plain JAX, the default), ``"pallas"``
        (``dew.kernels.flash_attention``: Mosaic on TPU, Triton on GPU, the Pallas interpreter on
        CPU, by the devices the step is compiled for), ``"pallas_tpu_interpret"`` (its Mosaic
        kernels in TPU interpret mode, on any backend: for tests), ``"cudnn"`` (cuDNN's fused
        attention: GPU, bfloat16 or float16; refused on a ring) or ``"auto"``: Mosaic on TPU, cuDNN
        on GPU where it takes the shapes (else Triton), XLA on CPU and on a sequence ring with an
        ``attention_window`` longer than a zigzag chunk (the kernels take no window there), by the
        devices the step is compiled for (``dew.nn.attention.resolve``; ``attention_for`` tells
        ahead of compiling).
      remat: what each layer saves for the backward (``REMAT_CHOICES``): ``"full"`` (the default)
        nothing (the backward recomputes the layer; least memory), ``"dots"`` the outputs of its
        weight matmuls, ``"attention"`` those, attention's output (and the Pallas kernels' and the
        ring's lse, so the backward does not rerun the forward kernel) and the MLP's normalized
        input, ``"none"`` everything (no ``jax.checkpoint``). ``"attention_gate"``, between
        ``"full"`` and ``"dots"``: attention's output and lse and the dense MLP's gate projection
        (the backward recomputes q, k, v, o and up, not the attention kernel nor the gate).
        Recompute shrinks from ``"full"`` to ``"none"``, and memory mostly grows (``"attention"``
        may need less than ``"dots"``). ``"auto"``: the least recomputation whose step fits the
        devices (``dew.training.remat_choice.choose_remat``).
      num_kv_heads: heads of K and V (grouped-query attention); default ``num_heads``.
      mlp_features: hidden width of the SwiGLU MLP; default ``4 * emb_features``.
      tie_embeddings: the output head is the embedding table transposed (default) or a weight of
        its own.
      param_dtype: the weights' dtype (default ``"float32"``).
      num_experts: ``0`` (the default) for a dense model; else ``E``, the experts of each MoE
        layer (each a SwiGLU of width ``mlp_features``).
      experts_per_token: ``k``, the experts each token is sent to (``1 <= k <= E``; default 2).
      moe_every: every ``moe_every``-th layer is an MoE layer (``num_layers`` must divide by it;
        default 1).
      capacity_factor: ``None`` (the default) for dropless routing; else ``c > 0``: an expert
        takes at most ``ceil(c * seq * k / E)`` copies from each row (see ``dew.nn.moe``).
      expert_exchange: how token copies cross an ``expert`` axis (``dew.parallel.ragged``):
        ``"ragged"`` (``ragged_all_to_all``: each device gets exactly its experts' copies; emulated
        exactly on CPU), ``"padded"`` (``all_to_all`` of a static slot per destination) or
        ``"auto"`` (ragged on TPU and GPU, padded on CPU, by the devices the step is compiled
        for).
      expert_buffer_factor: the ragged exchange's receive buffer, over a device's balanced share
        of copies (``rows * seq * k``; default ``dew.parallel.ragged.DEFAULT_BUFFER_FACTOR``,
        2.0); copies past it are dropped and counted in ``dropped_fraction``. ``None``: the worst
        case, which never drops.
      router_aux_weight, router_z_weight: the weights of the load-balancing loss and the router
        z-loss (each averaged over the MoE layers) in the objective's loss (default 0.01 and
        0.001).
      rope_theta: the base of the rotary frequencies (default 10000; Llama 3: 500000).
      rope_scaling: Llama 3's frequency scaling, a ``dew.nn.rotary.Llama3Scaling`` or a dict of
        its fields (``factor``, ``low_freq_factor``, ``high_freq_factor``,
        ``original_max_position_embeddings``), or ``None`` for none.
      rms_norm_eps: the epsilon every RMSNorm adds to the mean square (default 1e-6; Llama 3:
        1e-5).
      loss_chunk_tokens: tokens whose logits the loss makes at a time (``dew.nn.cross_entropy``):
        ``None``: ``cross_entropy.auto_chunk``, chunks whose float32 logits fit 512 MiB (all tokens
        at once when they fit); a number overrides it (one at least the tokens: no chunking).
      lora: ``None``, or a ``dew.models.lora.Lora`` (or a dict of its fields): the model is
        fine-tuned by LoRA adapters on a frozen base (``dew.models.lora`` says how the training
        state splits; ``apply`` takes the base and adapters joined, ``lora.combine``, or merged,
        ``lora.merge``); its rank at most each adapted weight's ``min(in, out)``
        (``lora.check_rank``).
      attention_window: ``None`` (every earlier token) or ``W >= 1``: sliding-window attention,
        each token attending to at most the ``W`` most recent tokens, itself included (Mistral's
        and Gemma's local attention; ``window=W`` in ``dew.kernels``), in every layer. One at or
        beyond ``max_seq_len`` hides nothing and is accepted, as Hugging Face configs carry such
        windows (``dew train --attention-window`` refuses it: there it is a typo).
      layer_loop: ``"scan"`` (one loop over the layers: a compile that does not grow with depth)
        or ``"unroll"`` (each layer compiled on its own: a faster step, a longer compile, and
        XLA may keep what ``remat`` would recompute; ``LAYER_LOOPS``). The same arithmetic
        either way.

    Raises:
      ValueError: a size below 1, an unknown dtype, ``attention_impl``, ``remat`` or
        ``layer_loop``, ``emb_features`` that does not split into even heads, ``num_heads``
        not a multiple of ``num_kv_heads``, expert settings out of range, or a LoRA rank above
        an adapted weight's ``min(in, out)``.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from dew.models.causal_transformer import CausalTransformer
        >>> model = CausalTransformer(vocab_size=256, emb_features=64, num_layers=2, num_heads=4,
        ...                           max_seq_len=32, num_kv_heads=2)
        >>> params = model.init(jax.random.key(0))
        >>> logits = model.apply(params, jnp.zeros((3, 32), jnp.int32))
        >>> logits.shape, logits.dtype
        ((3, 32, 256), dtype('float32'))
    """

    vocab_size: int
    emb_features: int
    num_layers: int
    num_heads: int
    max_seq_len: int
    dtype: str = "float32"
    attention_impl: str = "xla"
    remat: str = "full"
    num_kv_heads: int | None = None
    mlp_features: int | None = None
    tie_embeddings: bool = True
    param_dtype: str = "float32"
    num_experts: int = 0
    experts_per_token: int = 2
    moe_every: int = 1
    capacity_factor: float | None = None
    expert_exchange: str = "auto"
    expert_buffer_factor: float | None = ragged.DEFAULT_BUFFER_FACTOR
    router_aux_weight: float = 0.01
    router_z_weight: float = 0.001
    rope_theta: float = rotary.DEFAULT_THETA
    rope_scaling: rotary.Llama3Scaling | None = None
    rms_norm_eps: float = 1e-6
    loss_chunk_tokens: int | None = None
    lora: lora.Lora | None = None
    attention_window: int | None = None
    layer_loop: str = "scan"

    def __post_init__(self):
        # A dict (a preset's, a config.json's) becomes the frozen, hashable Llama3Scaling.
        object.__setattr__(self, "rope_scaling", rotary.Llama3Scaling.of(self.rope_scaling))
        # A dict (a checkpoint's record of the model) becomes the Lora it describes.
        object.__setattr__(self, "lora", lora.Lora.of(self.lora))
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a number above 0, got {value!r}")
        for name in ("vocab_size", "emb_features", "num_layers", "num_heads", "max_seq_len"):
            value = getattr(self, name)
            positive_int(name, value)
        if self.loss_chunk_tokens is not None:
            positive_int("loss_chunk_tokens", self.loss_chunk_tokens)
        if self.attention_window is not None:
            positive_int("attention_window", self.attention_window)
        resolve_dtype(self.dtype)
        resolve_dtype(self.param_dtype)
        if self.attention_impl not in attention.CHOICES:
            raise ValueError(
                f"unknown attention_impl {self.attention_impl!r}; expected one of "
                f"{', '.join(attention.CHOICES)}"
            )
        if self.layer_loop not in LAYER_LOOPS:
            raise ValueError(
                f"unknown layer_loop {self.layer_loop!r}; expected one of {', '.join(LAYER_LOOPS)}"
            )
        if self.remat not in REMAT_POLICIES and self.remat != REMAT_AUTO:
            raise ValueError(
                f"unknown remat policy {self.remat!r}; expected one of {', '.join(REMAT_CHOICES)}"
                f" or {REMAT_AUTO!r}"
            )
        if self.emb_features % self.num_heads:
            raise ValueError(
                f"emb_features {self.emb_features} does not split over num_heads {self.num_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"head_dim {self.head_dim} (emb_features / num_heads) must be even for rotary "
                "positions"
            )
        if self.kv_heads < 1 or self.num_heads % self.kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.kv_heads}"
            )
        self._check_experts()
        if self.lora is not None:
            lora.check_rank(self)

    def _check_experts(self) -> None:
        if not isinstance(self.num_experts, int) or self.num_experts < 0:
            raise ValueError(
                f"num_experts must be 0 (dense) or a positive integer, got {self.num_experts!r}"
            )
        ragged.check_exchange(self.expert_exchange, self.expert_buffer_factor)
        if not self.num_experts:
            return
        k, experts = self.experts_per_token, self.num_experts
        if not isinstance(k, int) or not 1 <= k <= experts:
            raise ValueError(
                f"experts_per_token {k!r} must be an integer from 1 to num_experts {experts}"
            )
        positive_int("moe_every", self.moe_every)
        if self.num_layers % self.moe_every:
            raise ValueError(
                f"num_layers {self.num_layers} is not a multiple of moe_every {self.moe_every} "
                "(each group of moe_every layers ends with one MoE layer)"
            )
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(
                f"capacity_factor must be None (dropless) or above 0, got {self.capacity_factor!r}"
            )
        for name in ("router_aux_weight", "router_z_weight"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be 0 or more, got {getattr(self, name)!r}")

    def architecture(self) -> dict:
        """The ``ARCHITECTURE_FIELDS`` of this model, by name (for comparing two models)."""
        return {field: getattr(self, field) for field in ARCHITECTURE_FIELDS}

    @property
    def head_dim(self) -> int:
        """Features per attention head: ``emb_features // num_heads``."""
        return self.emb_features // self.num_heads

    @property
    def kv_heads(self) -> int:
        """Heads of K and V: ``num_kv_heads``, or ``num_heads`` when that is ``None``."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def hidden(self) -> int:
        """The MLP's (each expert's) hidden width: ``mlp_features``, or ``4 * emb_features``."""
        return 4 * self.emb_features if self.mlp_features is None else self.mlp_features

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers // self.moe_every if self.num_experts else 0

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    def declare(self) -> dict:
        """The tree of ``Param`` declarations, under ``{"params": ...}``."""
        # GPT-2's scaling of the residual branches' output projections by 1/sqrt(2 * layers).
        out_scale = (2 * self.num_layers) ** -0.5

        def layer(ffn: dict) -> dict:
            return {
                "attn_norm": norm.rms_norm_params(self.emb_features),
                "attn": attention.attention_params(
                    self.emb_features, self.num_heads, self.kv_heads, self.head_dim, out_scale
                ),
                "mlp_norm": norm.rms_norm_params(self.emb_features),
                **ffn,
            }

        def stacked(tree: dict, n: int) -> dict:
            return jax.tree_util.tree_map(
                lambda p: p.stacked(n), tree, is_leaf=lambda x: isinstance(x, Param)
            )

        params = {"embed_tokens": embed.embed_params(self.vocab_size, self.emb_features)}
        if self.num_dense_layers:
            dense = {"mlp": mlp.mlp_params(self.emb_features, self.hidden, out_scale)}
            params["layers"] = stacked(layer(dense), self.num_dense_layers)
        if self.num_moe_layers:
            experts = moe.moe_params(self.emb_features, self.hidden, self.num_experts, out_scale)
            params["moe_layers"] = stacked(layer({"moe": experts}), self.num_moe_layers)
        params["final_norm"] = norm.rms_norm_params(self.emb_features)
        if not self.tie_embeddings:
            params["lm_head"] = {
                "kernel": Param(
                    (self.emb_features, self.vocab_size),
                    ("embed", "vocab"),
                    normal(self.emb_features**-0.5),
                )
            }
        return {"params": params}

    def logical_axes(self) -> dict:
        return logical_axes(self.declare())

    def attention_for(
        self,
        platform: str,
        axis_sizes: dict | None = None,
        sequence_scheme: str = "ring",
        segmented: bool = False,
        seq_len: int | None = None,
    ) -> str:
        """The attention implementation a step compiled for ``platform`` devices (``"cpu"``,
        ``"gpu"``, ``"tpu"``) on a mesh of ``axis_sizes`` runs: ``attention_impl`` resolved
        (``dew.nn.attention.resolve``) for this model's dtype and head_dim, and for a ring when
        the ``sequence`` axis is above 1 under the ring scheme. ``ValueError`` for ``"cudnn"``
        where cuDNN cannot run (not a GPU, float32, a ring), and for an ``attention_window``
        longer than a zigzag chunk (``seq_len / (2 x sequence)``; any window where ``seq_len``
        is not given) on a ring of the Pallas kernels asked by name
        (``dew.parallel.sequence.window_refusal``; ``"auto"`` takes XLA's blocks there; a window
        within a chunk runs as a halo exchange with any attention): what the step raises while
        tracing, for callers that want to say so before building anything. ``segmented``: the
        batch packs documents (segment ids), which cuDNN does not take."""
        n = (axis_sizes or {}).get(sequence.AXIS, 1)
        ring = n > 1 and sequence_scheme == "ring"
        chunk = None if seq_len is None else seq_len // (2 * n)
        window = self.attention_window
        windowed_ring = ring and window is not None and (chunk is None or window > chunk)
        impl = attention.resolve(
            self.attention_impl,
            platform,
            resolve_dtype(self.dtype),
            self.head_dim,
            ring,
            segmented,
            windowed_ring,
        )
        if windowed_ring and impl != "xla":
            raise ValueError(sequence.window_refusal(impl, n, window, chunk))
        return impl

    def check_split(self, axis_sizes: dict, sequence_scheme: str = "ring") -> None:
        """Raises ``ValueError``, naming the numbers, when this model cannot run on a mesh of
        ``axis_sizes``: heads, kv heads, MLP width or vocabulary that do not split over
        ``tensor``; heads that do not split over ``sequence x tensor`` for the all-to-all
        scheme; an unknown ``sequence_scheme``; experts that do not split over ``expert``, or an
        ``expert`` axis on a dense model; a capacity factor over a ``sequence`` axis; layers that
        do not split over ``stage`` (for an MoE model, its groups of ``moe_every`` layers, each
        stage running whole groups)."""
        self._check_stages(axis_sizes.get("stage", 1))
        t = axis_sizes.get(tensor.AXIS, 1)
        sizes = {
            "num_heads": self.num_heads,
            "num_kv_heads": self.kv_heads,
            "mlp_features": self.hidden,
            "vocab_size": self.vocab_size,
        }
        tensor.check_sizes(t, sizes)
        sequence.check_heads(
            sequence_scheme, axis_sizes.get(sequence.AXIS, 1), self.num_heads, self.kv_heads, t
        )
        if not self.num_experts and axis_sizes.get(expert.AXIS, 1) > 1:
            raise ValueError(
                f"expert {axis_sizes[expert.AXIS]} on a dense model (num_experts=0): the expert "
                "axis splits the experts of MoE layers, which this model has none of; build it "
                "with num_experts=E, or put those devices on data or fsdp"
            )
        if self.num_experts:
            expert.check_experts(axis_sizes.get(expert.AXIS, 1), self.num_experts)
            if self.capacity_factor is not None and axis_sizes.get(sequence.AXIS, 1) > 1:
                raise ValueError(
                    f"capacity_factor {self.capacity_factor} with sequence "
                    f"{axis_sizes[sequence.AXIS]}: capacity is counted over whole rows, which a "
                    "sequence axis splits; use dropless routing (capacity_factor=None) there"
                )

    def _check_stages(self, stages: int) -> None:
        if self.num_layers % stages:
            raise ValueError(
                f"num_layers {self.num_layers} does not split over stage {stages}: each pipeline "
                "stage holds the same number of layers"
            )
        groups = self.num_moe_layers
        if groups % stages:
            raise ValueError(
                f"num_layers {self.num_layers} makes {groups} groups of moe_every "
                f"{self.moe_every} layers (each ending with its MoE layer), which do not split "
                f"over stage {stages}: each pipeline stage runs whole groups"
            )

    def partial_over_tensor(self, shards: Shards) -> dict:
        """A tree of bools shaped like the parameters: the weights replicated over ``tensor``
        whose gradient each device of the tensor group holds only a part of, for
        ``dew.parallel.gradients.sum_axes``.

        - The norm scales and the MoE routers, when activations between blocks are
          sequence-parallel (each device normalizes, and routes, its own positions).
        - ``k`` and ``v``, when there are fewer kv heads than devices (each device uses one head,
          for its own query heads: ``tensor.shared_kv_heads``).
        """
        t = shards.size(tensor.AXIS)
        sequence_split = t > 1 and shards.options.sequence_parallel
        shared_kv = t > 1 and self.kv_heads < t

        def partial(path, _):
            names = path_names(path)
            if names[-1] == "scale" or names[-2:] == ("router", "kernel"):
                return sequence_split
            return shared_kv and names[-2:] in (("attn", "k"), ("attn", "v"))

        return jax.tree_util.tree_map_with_path(
            partial, self.declare(), is_leaf=lambda x: isinstance(x, Param)
        )

    def in_layer_loop(self) -> dict:
        """A tree of bools shaped like the parameters: the stacked layers' weights (``layers``,
        ``moe_layers``), which ``blocks`` gathers inside its layer loop (``Shards.gather(...,
        stacked=True)``), for ``dew.parallel.gradients.sum_axes``'s ``summed_in_loop``."""

        def stacked(path, _):
            return path_names(path)[1] in ("layers", "moe_layers")

        return jax.tree_util.tree_map_with_path(
            stacked, self.declare(), is_leaf=lambda x: isinstance(x, Param)
        )

    def init(self, key: jax.Array) -> dict:
        """Initial weights ``{"params": ...}`` in ``param_dtype``; they depend on ``key`` alone.

        The layers' weights are stacked on a leading layer dimension (a dense model's
        ``params["params"]["layers"]["attn"]["q"]`` is ``[num_layers, embed, heads, head_dim]``).
        """
        return init_params(self.declare(), key, resolve_dtype(self.param_dtype))

    # --- The three parts: embed, blocks, head ------------------------------------------------
    #
    # Each takes the parameters this device holds and the step's ``Shards``, so that a layout can
    # run them apart: a pipeline runs ``blocks`` per stage, a vocabulary split gives ``head`` and
    # the loss this device's slice of the vocabulary, a sequence split passes its own positions.
    # The embedding and the head are ``dew.parallel.tensor``'s, which are the plain lookup and
    # matmul while the tensor axis has size 1.

    def share_embedding(
        self, params: dict, shards: Shards = ONE_DEVICE, tokens: int | None = None
    ) -> tuple[dict, Shards]:
        """Gather the tied embedding table once, for both ``embed`` and ``head``.

        With tied embeddings both ends read the table. Given the returned pair, ``embed`` and
        ``head`` find it whole (the returned ``shards`` say it is no longer split over fsdp) and
        gather nothing more, so a step sends one all_gather of the table (and one reduce-scatter of
        its gradient), as an unsplit model does. Untied, with nothing split, or when both ends
        move the ``tokens`` this device holds rather than the table
        (``dew.parallel.vocabulary``): ``(params, shards)`` unchanged.
        """
        specs = shards.spec_of("params", "embed_tokens")
        if not self.tie_embeddings or specs is None or shards.size(fsdp.AXIS) == 1:
            return params, shards
        if tokens is not None and self._moves_tokens(params, shards, tokens):
            return params, shards
        table = shards.gather(params["params"]["embed_tokens"], "params", "embed_tokens")
        whole_specs = jax.tree_util.tree_map(_drop_fsdp, specs, is_leaf=lambda x: isinstance(x, P))
        param_specs = {
            **shards.param_specs,
            "params": {**shards.param_specs["params"], "embed_tokens": whole_specs},
        }
        params = {**params, "params": {**params["params"], "embed_tokens": table}}
        return params, dataclasses.replace(shards, param_specs=param_specs)

    def _output_table(self, params: dict, shards: Shards):
        """``(local weight, its spec, its vocabulary dimension)`` of the output head: the tied
        table ``[vocab, embed]`` or ``lm_head``'s kernel ``[embed, vocab]``."""
        p = params["params"]
        if self.tie_embeddings:
            spec = shards.spec_of("params", "embed_tokens")
            return p["embed_tokens"]["embedding"], spec and spec["embedding"], 0
        spec = shards.spec_of("params", "lm_head")
        return p["lm_head"]["kernel"], spec and spec["kernel"], 1

    def _moves_tokens(self, params: dict, shards: Shards, tokens: int) -> bool:
        """Whether this step embeds and scores ``tokens`` tokens a device over the vocabulary's
        fsdp split (``dew.parallel.vocabulary``); both ends of a tied table decide alike."""
        spec = shards.spec_of("params", "embed_tokens")
        table = params["params"]["embed_tokens"]["embedding"]
        embeds = vocabulary.moves_tokens(
            spec and spec["embedding"], 0, table.shape[0], tokens, shards
        )
        weight, head_spec, dim = self._output_table(params, shards)
        heads = vocabulary.moves_tokens(head_spec, dim, weight.shape[dim], tokens, shards)
        return embeds and heads

    def embed(self, params: dict, tokens: jax.Array, shards: Shards = ONE_DEVICE) -> jax.Array:
        """``tokens`` ``[rows, seq]`` integer ids -> ``x`` ``[rows, seq, embed]``, in the
        activations' dtype."""
        dtype = resolve_dtype(self.dtype)
        spec = shards.spec_of("params", "embed_tokens")
        local = params["params"]["embed_tokens"]["embedding"]
        if vocabulary.moves_tokens(
            spec and spec["embedding"], 0, local.shape[0], tokens.size, shards
        ):
            return vocabulary.embed(local, tokens, dtype)
        table = shards.gather(params["params"]["embed_tokens"], "params", "embed_tokens")
        return tensor.embed_lookup(table["embedding"], tokens, shards, dtype)

    def blocks(
        self,
        params: dict,
        x: jax.Array,
        positions: jax.Array,
        shards: Shards = ONE_DEVICE,
        segment_ids: jax.Array | None = None,
    ) -> tuple[jax.Array, moe.RouterStats]:
        """The ``num_layers`` decoder layers: ``x`` ``[rows, seq, embed]`` -> ``(x, stats)``, ``x``
        of the same shape (``[rows, seq / n, embed]``, this device's positions, under
        sequence-parallel activations on a tensor group of ``n``) and the MoE layers'
        ``RouterStats``, their losses averaged over the MoE layers (zeros for a dense model).

        ``positions``: the rotary positions of the tokens attention sees, ``[seq]`` integers for
        every row alike (``jnp.arange(seq)`` for a whole sequence) or ``[rows, seq]`` per row
        (packed documents: each token's position in its document). ``segment_ids``: ``None``,
        or int32 ``[rows, seq]``, each token's document: a token attends only to earlier tokens
        of its own document (and, with ``attention_window``, only the most recent). The layers
        run under ``lax.scan``, unrolled with ``layer_loop="unroll"`` (dense and MoE layers
        interleaved: a scan over groups of ``moe_every`` layers, each ``moe_every - 1`` dense
        layers then one MoE layer), each under ``jax.checkpoint`` with the ``remat`` policy;
        ``shards.pin`` constrains each layer's input and the output (the GSPMD baseline's
        activation pinning; a no-op otherwise).
        """

        shared_kv = self.kv_heads < shards.size(tensor.AXIS)
        # The weights only an einsum takes (under fsdp rings they reach it split: Shards.gather);
        # shared kv heads are cut from the whole k and v first. A LoRA model's base is frozen:
        # gathered whole, since a split weight's einsum would sum its gradient round the ring.
        # So are the weights of int8 projections (StepOptions.quantize): their matmuls quantize
        # the whole weight, which the fsdp rings' einsums do not.
        whole = self.lora or shards.options.quantize == "int8"
        # And they travel the fsdp gathers as int8, with their whole weights' scales (a LoRA
        # base, frozen, as it is stored).
        int8 = None
        if shards.options.quantize == "int8" and not self.lora:
            int8 = fsdp_int8.LAYER_PROJECTIONS
        attention_matmuls = () if shared_kv or whole else ("attn",)
        mlp_matmuls = () if whole else ("mlp",)
        # "auto" (and the checks of "cudnn") by the devices this step is compiled for.
        platform = ragged.compiled_platform()
        impl = self.attention_for(
            platform,
            {sequence.AXIS: shards.size(sequence.AXIS)},
            shards.options.sequence_scheme,
            segmented=segment_ids is not None,
            seq_len=positions.shape[-1] * shards.size(sequence.AXIS),
        )
        # Over a sequence axis, attention spans every device's positions (ring or all-to-all);
        # elsewhere it is the plain call.
        attend = sequence.attention(shards, impl)
        if gspmd_kernel.wraps(impl, platform):
            # The GSPMD engine over several devices: XLA cannot split the kernel's custom call,
            # so it runs per device, as a user's GSPMD code runs it.
            attend = gspmd_kernel.kernel_on_mesh(attend, self.num_heads, self.kv_heads)

        def attention_half(x, w, region):
            attn = w["attn"]
            if shared_kv:
                attn = {
                    **attn,
                    "k": tensor.shared_kv_heads(attn["k"], shards),
                    "v": tensor.shared_kv_heads(attn["v"], shards),
                }
            # Two Megatron regions per layer. Each enters with the normalized activations (whole on
            # every device of the tensor group, or gathered from its positions under sequence
            # parallelism) and leaves by summing the devices' partial outputs: by the pairs
            # around the layer, or by its projections (tensor_scheme="ring").
            h = region.enter(norm.rms_norm(w["attn_norm"], x, self.rms_norm_eps))
            h = attention.self_attention(
                attn,
                h,
                positions,
                attend,
                rope_theta=self.rope_theta,
                rope_scaling=self.rope_scaling,
                projections=region,
                segment_ids=segment_ids,
                window=self.attention_window,
            )
            return x + region.leave(h)

        def dense_layer(x, layer):
            layer_shards, number = layer
            # The Megatron regions' entry and exit: tensor's pairs, or collective matmuls.
            region = tensor_ring.region(numbered(number))
            x = shards.pin(x)
            w = shards.gather(
                layer_shards,
                "params",
                "layers",
                stacked=True,
                in_matmuls=(*attention_matmuls, *mlp_matmuls),
                int8=int8,
            )
            x = attention_half(x, w, region)
            h = checkpoint_name(norm.rms_norm(w["mlp_norm"], x, self.rms_norm_eps), MLP_INPUT)
            h = region.enter(h)
            return x + region.leave(mlp.swiglu(w["mlp"], h, region)), None

        def moe_layer(x, layer):
            layer_shards, number = layer
            keyed = numbered(number)
            x = shards.pin(x)
            w = shards.gather(
                layer_shards,
                "params",
                "moe_layers",
                stacked=True,
                in_matmuls=attention_matmuls,
                int8=int8,
            )
            x = attention_half(x, w, tensor_ring.region(keyed))
            # The MoE region enters and leaves inside expert.moe_mlp, around its router.
            out, stats = expert.moe_mlp(
                w["moe"],
                norm.rms_norm(w["mlp_norm"], x, self.rms_norm_eps),
                keyed,
                num_experts=self.num_experts,
                k=self.experts_per_token,
                capacity_factor=self.capacity_factor,
                exchange=self.expert_exchange,
                buffer_factor=self.expert_buffer_factor,
            )
            return x + out, stats

        # Under int8 (Shards.rounding_key) each layer's gradients round from a key of its own,
        # the step's folded with the layer's number in the whole model (a pipeline stage's
        # layers after the earlier stages'), so that no two layers draw the same noise.
        def layer_numbers(count: int) -> jax.Array | None:
            if shards.rounding_key is None:
                return None
            first = 0
            if shards.size("stage") > 1:
                first = lax.axis_index("stage") * count
            return first + jnp.arange(count, dtype=jnp.int32)

        def numbered(number) -> Shards:
            if number is None:
                return shards
            key = quantized.fold_key(shards.rounding_key, number)
            return dataclasses.replace(shards, rounding_key=key)

        dense_layer = remat_layer(dense_layer, self.remat)
        moe_layer = remat_layer(moe_layer, self.remat)
        unroll = self.layer_loop == "unroll"  # lax.scan's True: every iteration inline
        p = params["params"]
        if not self.num_moe_layers:
            numbers = layer_numbers(jax.tree_util.tree_leaves(p["layers"])[0].shape[0])
            x, _ = lax.scan(dense_layer, x, (p["layers"], numbers), unroll=unroll)
            return shards.pin(x), moe.RouterStats.zeros()

        # The MoE layers this call runs (all of them, or one pipeline stage's share).
        groups = jax.tree_util.tree_leaves(p["moe_layers"])[0].shape[0]
        dense_per_group = self.moe_every - 1
        # Group g holds layers g * moe_every + (0 .. moe_every - 2) dense, then one MoE layer.
        numbers = layer_numbers(groups * self.moe_every)
        if numbers is not None:
            numbers = numbers.reshape(groups, self.moe_every)

        def group(carry, group_weights):
            x, stats = carry
            dense_weights, moe_weights, group_numbers = group_weights
            dense_numbers = moe_number = None
            if group_numbers is not None:
                dense_numbers, moe_number = group_numbers[:-1], group_numbers[-1]
            if dense_per_group:
                x, _ = lax.scan(dense_layer, x, (dense_weights, dense_numbers), unroll=unroll)
            x, layer_stats = moe_layer(x, (moe_weights, moe_number))
            return (x, stats + layer_stats), None

        dense = None
        if dense_per_group:
            # [groups * (moe_every - 1), ...] -> [groups, moe_every - 1, ...]: layer order kept.
            dense = jax.tree_util.tree_map(
                lambda w: w.reshape(groups, dense_per_group, *w.shape[1:]), p["layers"]
            )
        (x, stats), _ = lax.scan(
            group, (x, moe.RouterStats.zeros()), (dense, p["moe_layers"], numbers), unroll=unroll
        )
        mean = 1.0 / self.num_moe_layers
        stats = stats._replace(load_balance=stats.load_balance * mean, z_loss=stats.z_loss * mean)
        return shards.pin(x), stats

    def _head_input(self, params: dict, x: jax.Array, shards: Shards):
        """``(final norm of x, the output table [vocab, embed] as stored)``: the tied embedding
        table or ``lm_head``'s kernel transposed, gathered over fsdp (this device's slice of the
        vocabulary once it is split over ``tensor``)."""
        p = params["params"]
        x = norm.rms_norm(
            shards.gather(p["final_norm"], "params", "final_norm"), x, self.rms_norm_eps
        )
        if self.tie_embeddings:
            return x, shards.gather(p["embed_tokens"], "params", "embed_tokens")["embedding"]
        return x, shards.gather(p["lm_head"], "params", "lm_head")["kernel"].T

    def head(self, params: dict, x: jax.Array, shards: Shards = ONE_DEVICE) -> jax.Array:
        """``x`` ``[rows, seq, embed]`` -> float32 logits ``[rows, seq, vocab]`` (this device's
        slice of the vocabulary once it is split over ``tensor``): the final norm, then the
        embedding table transposed (tied) or ``lm_head``. For inference: the loss never makes
        them (``head_loss_sum``)."""
        x, table = self._head_input(params, x, shards)
        return tensor.vocab_logits(x, table.astype(resolve_dtype(self.dtype)), shards)

    def head_loss_sum(
        self,
        params: dict,
        x: jax.Array,
        targets: jax.Array,
        shards: Shards = ONE_DEVICE,
        weights: jax.Array | None = None,
    ) -> jax.Array:
        """The cross-entropy of predicting ``targets`` ``[rows, seq]`` from the blocks' output
        ``x`` ``[rows, seq, embed]``, each token's loss times its ``weights`` (``None``: 1; float32
        ``[rows, seq]``), summed over this device's tokens (float32 scalar).

        The head and the loss run together over chunks of ``loss_chunk_tokens`` tokens
        (``dew.nn.cross_entropy``), so the ``[tokens, vocab]`` logits never exist: through
        ``dew.parallel.tensor.head_loss_sum`` (the vocabulary split over ``tensor``, or not split),
        or, when the vocabulary is split over fsdp and this device holds fewer tokens than table
        rows, ``dew.parallel.vocabulary.loss_sum``."""
        weight, spec, dim = self._output_table(params, shards)
        chunk = self.loss_chunk_tokens
        pinned = shards.pinned_activations
        if pinned is not None and pinned.mesh.size > 1:
            # The GSPMD baseline over several devices scores all tokens at once: the partitioner
            # cannot keep a loop's float32 table gradient as each device's partial sum, and
            # would all-reduce it every chunk. Only shard_map chunks there.
            chunk = targets.size
        options = dict(chunk=chunk, dtype=resolve_dtype(self.dtype))
        if vocabulary.moves_tokens(spec, dim, weight.shape[dim], targets.size, shards):
            p = params["params"]
            x = norm.rms_norm(
                shards.gather(p["final_norm"], "params", "final_norm"), x, self.rms_norm_eps
            )
            table = weight if dim == 0 else weight.T
            return vocabulary.loss_sum(x, table, targets, weights, **options)
        x, table = self._head_input(params, x, shards)
        return tensor.head_loss_sum(x, table, targets, shards, weights, **options)

    def apply(self, params: dict, tokens: jax.Array, shards: Shards = ONE_DEVICE) -> jax.Array:
        """``tokens`` ``[batch, seq]`` -> float32 logits ``[batch, seq, vocab]``:
        ``head(blocks(embed(tokens), arange(seq)))``.

        ``params`` are the shards this device holds; ``shards`` says how they are split. With
        ``ONE_DEVICE`` the weights are whole and no collective runs.
        """
        params, shards = self.share_embedding(params, shards, tokens.size)
        x = self.embed(params, tokens, shards)
        x, _ = self.blocks(params, x, jnp.arange(tokens.shape[1]), shards)
        return self.head(params, x, shards)


def _drop_fsdp(spec: P) -> P:
    """``spec`` with the fsdp axis removed from every dimension: the weight once gathered."""

    def drop(entry):
        names = entry if isinstance(entry, tuple) else (entry,)
        kept = tuple(name for name in names if name is not None and name != fsdp.AXIS)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    return P(*(drop(entry) for entry in spec))
