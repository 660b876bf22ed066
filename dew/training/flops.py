"""Model FLOPs per token, device peaks, and model FLOPs utilisation (MFU).

The count is PaLM's (Chowdhery et al. 2022, "PaLM: Scaling Language Modeling with Pathways",
appendix B, https://arxiv.org/abs/2204.02311): a training step costs, per token,

    6 N + 12 L H Q T

- ``N``: the weights each token is multiplied by, counted once: every weight but the input
  embedding table (a lookup, no FLOPs), plus the output head (``vocab x width``: the tied table,
  counted once as the head, or an untied ``lm_head``). For a tied model that is PaLM's ``N``, the
  whole parameter count. ``2 N`` is the forward's multiply-adds, ``4 N`` the backward's (the
  gradients of the activations and of the weights).
- ``12 L H Q T``: attention's scores and weighted sums, ``L`` layers, ``H`` query heads of ``Q``
  features (``H Q`` is the model's width), ``T`` positions per row: ``q.k`` and ``p.v`` are each
  ``2 T H Q`` FLOPs per token forward, times 3 for the backward. Like PaLM, this counts every query
  against all ``T`` keys: the causal mask's half is *not* taken off. Dew's XLA attention computes
  the whole ``T x T`` square and masks it, as the count says; a kernel that skips masked blocks
  does about half of this term's work.
- Causal attention halved (``causal_halved=True``): ``6 N + 6 L H Q T``, the count MaxText has used
  since 2025 (``calculate_tflops_training_per_device`` in ``maxtext_utils.py``: the attention's
  ``4 B T^2 H Q`` forward FLOPs per layer "/ 2" for the causal mask, times 3 for forward and
  backward). Every MFU Dew prints comes with both: PaLM's (``mfu``) and this one
  (``mfu_causal``), which compares with MaxText's figures.
- Sliding-window attention (the model's ``attention_window`` ``W``): attention's term counts the
  keys ``K`` a query sees, ``12 L H Q K``. PaLM's way (every query against all the keys it may
  see, no causal discount): ``K = W' = min(W, T)``. Causal, halved: a query at position ``t`` sees
  ``min(t, W')`` keys, and the count is the area under that over the row, per query::

      K = (1 / T) * integral_0^T min(t, W') dt = W' - W'^2 / (2 T)

  which is ``T / 2`` at ``W' = T`` (MaxText's halved count above, unchanged for a window that
  hides nothing) and near ``W`` for ``W`` far below ``T``. The exact mean of the keys visible in
  the ``T x T`` mask, ``sum_{i=1..T} min(i, W') / T = W' - (W'^2 - W') / (2 T)``, is larger by
  ``W' / (2 T)`` of a key, as the exact causal mean ``(T + 1) / 2`` is larger than MaxText's
  ``T / 2``: the continuous count keeps the windowed and the plain counts one formula. (MaxText's
  Gemma 2 count halves the window too, ``min(W, T) / 2`` keys a query: for ``W`` far below ``T``
  half the keys a query sees.)
- Mixture of experts: each token runs ``k`` of an MoE layer's ``E`` experts, so ``N`` counts the
  experts' weights times ``k / E`` (the active weights; the router counts whole). Copies a capacity
  drops are not taken off: the count is the model's, not the run's luck.

LoRA (a model with ``lora``: ``dew.models.lora``): the base is frozen, so the backward computes
the activations' gradients through it and not its weights': per token

    4 N + 12 L H Q T + 6 N_lora

``4 N``: the base's forward and input gradients (``N`` as above, the head included: its input
gradient is needed, its weight gradient is not); attention as above (its backward computes
gradients of q, k and v, inputs all); ``6 N_lora``: the adapters' own forward, input and weight
gradients (``N_lora`` their weights, ``R (in + out)`` a matrix). An int8 base counts as any base:
the matmuls run in the activations' dtype.

Model FLOPs leave out what a layout or a memory saving adds: Dew's layers run under
``jax.checkpoint``, so the backward recomputes each layer's forward (all but its last matmul,
the MLP's ``down``, whose output the backward does not need); XLA's count of the one-device step is
about 1.25 times this one for that reason (tests/test_flops.py measures it, and docs/metrics.md
says by how much). Norms, softmax, rotary and the cross-entropy's elementwise work are left out
too (under 0.5% of XLA's count at width 256, 4.6% at width 32).

MFU is model FLOPs per second per device over the device's peak dense bf16 FLOP/s
(``peak_flops``): TPU generations from ``dew.targets.GENERATIONS``, NVIDIA GPUs from their data
sheets (below). Nothing is guessed for other devices (a CPU): ``peak_flops`` returns ``None`` and
the metrics carry no ``mfu``.
"""

from __future__ import annotations

import math

import jax

from dew.targets import GENERATIONS

# NVIDIA's peak dense BF16 tensor-core FLOP/s per GPU. The data sheets give the figure with 2:4
# structured sparsity; the dense peak is half of it.
# - A100 (SXM and PCIe, 40 and 80 GB): 312 TFLOPS, 624 with sparsity. NVIDIA A100 Tensor Core GPU
#   data sheet, https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/
#   nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
# - H100 SXM 1,979, H100 NVL 1,671 and H100 PCIe 1,513 TFLOPS with sparsity.
#   https://www.nvidia.com/en-us/data-center/h100/ (data sheet tab; PCIe from the 2022 sheet)
# - H200 SXM 1,979 and H200 NVL 1,671 TFLOPS with sparsity.
#   https://www.nvidia.com/en-us/data-center/h200/
# Matched against ``jax.Device.device_kind`` (CUDA's device name, e.g. "NVIDIA H100 80GB HBM3",
# "NVIDIA A100-SXM4-80GB", "NVIDIA H200"): the first row whose words all appear wins, so the
# PCIe and NVL rows come before the SXM one.
GPU_PEAK_BF16_FLOPS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("A100",), 312e12),
    (("H100", "NVL"), 1671e12 / 2),
    (("H100", "PCIE"), 1513e12 / 2),
    (("H100",), 1979e12 / 2),
    (("H200", "NVL"), 1671e12 / 2),
    (("H200",), 1979e12 / 2),
)


def peak_flops(device_kind: str) -> float | None:
    """The peak dense bf16 FLOP/s of one device of ``device_kind`` (``jax.Device.device_kind``), or
    ``None`` when Dew does not know it (a CPU, an unlisted accelerator).

    TPUs: ``dew.targets.GENERATIONS`` (one JAX device per chip: "TPU v4", "TPU v5 lite" (v5e),
    "TPU v5" (v5p), "TPU v6 lite" (v6e)), matched exactly; NVIDIA GPUs: ``GPU_PEAK_BF16_FLOPS``.
    """
    kind = device_kind.strip()
    for generation in GENERATIONS.values():
        if kind.lower() == generation.device_kind.lower():
            return generation.peak_bf16_flops
    upper = kind.upper()
    for words, flops in GPU_PEAK_BF16_FLOPS:
        if all(word in upper for word in words):
            return flops
    return None


def _size(tree) -> int:
    return sum(math.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(tree))


def attention_keys(seq_len: int, window: int | None, *, causal_halved: bool = False) -> float:
    """The keys ``K`` attention's FLOPs count per query on rows of ``T = seq_len`` positions with
    the sliding window ``window`` (``None``: none): ``W' = min(window, T)`` (``T`` without a
    window), or with ``causal_halved`` ``W' - W'^2 / (2 T)`` (``T / 2`` without a window; the
    module's docstring derives it)."""
    keys = seq_len if window is None else min(window, seq_len)
    return keys - keys**2 / (2 * seq_len) if causal_halved else float(keys)


def model_flops_per_token(model, seq_len: int, *, causal_halved: bool = False) -> float | None:
    """PaLM's ``6 N + 12 L H Q T`` for a ``CausalTransformer`` training on rows of ``seq_len``
    positions (see the module's docstring for what ``N`` counts, the experts' ``k / E`` and the
    causal mask); with ``causal_halved``, MaxText's ``6 N + 6 L H Q T`` (attention's term halved
    for the causal mask); for a LoRA model ``4 N + 12 L H Q T + 6 N_lora`` (the module's
    docstring; attention halved alike). With the model's ``attention_window``, ``T`` in the
    attention term is the keys a query sees, ``attention_keys``. ``None`` for a model whose
    shapes this does not know.
    """
    try:
        layers, heads, head_dim = model.num_layers, model.num_heads, model.head_dim
        vocab, width = model.vocab_size, model.emb_features
        experts, k = getattr(model, "num_experts", 0), getattr(model, "experts_per_token", 1)
        params = jax.eval_shape(model.init, jax.random.key(0))["params"]
        table = _size(params["embed_tokens"])
    except (AttributeError, KeyError, TypeError):
        return None
    weights = _size(params) - table  # an untied lm_head is among them
    if getattr(model, "tie_embeddings", True):
        weights += vocab * width  # the table once more, as the output head
    if experts:
        expert_weights = _size(params["moe_layers"]["moe"]["experts"])
        weights -= expert_weights * (experts - k) / experts
    window = getattr(model, "attention_window", None)
    keys = attention_keys(seq_len, window, causal_halved=causal_halved)
    attention = 12.0 * layers * heads * head_dim * keys
    if getattr(model, "lora", None) is not None:
        from dew.models import lora

        adapters = _size(
            jax.eval_shape(lambda key: lora.init_adapters(model, key), jax.random.key(0))
        )
        return 4.0 * weights + attention + 6.0 * adapters
    return 6.0 * weights + attention


def throughput(
    tokens: int,
    seconds: float,
    flops_per_token: float | None,
    devices: int,
    peak: float | None,
    causal_flops_per_token: float | None = None,
) -> dict:
    """A step's speed: ``tokens_per_s``; with a FLOP count, ``model_tflops_per_device`` (model
    FLOPs per second per device, in units of 10^12); with a peak too, ``mfu`` (that over the
    device's peak FLOP/s, a fraction). ``causal_flops_per_token`` (the count with causal
    attention halved) adds ``model_tflops_per_device_causal`` and ``mfu_causal`` of it alike."""
    metrics = {"tokens_per_s": tokens / seconds}
    for count, suffix in ((flops_per_token, ""), (causal_flops_per_token, "_causal")):
        if count is not None:
            per_device = count * tokens / seconds / devices
            metrics[f"model_tflops_per_device{suffix}"] = per_device / 1e12
            if peak is not None:
                metrics[f"mfu{suffix}"] = per_device / peak
    return metrics


def speed(model, seq_len: int, tokens: int, devices) -> dict:
    """``throughput``'s arguments but ``seconds`` for ``model`` training on rows of ``seq_len``
    positions, ``tokens`` a step, on ``devices`` (a sequence of ``jax.Device``; the first one's
    peak): both counts, PaLM's and causal attention halved."""
    return dict(
        tokens=tokens,
        flops_per_token=model_flops_per_token(model, seq_len),
        causal_flops_per_token=model_flops_per_token(model, seq_len, causal_halved=True),
        devices=len(devices),
        peak=peak_flops(devices[0].device_kind),
    )
