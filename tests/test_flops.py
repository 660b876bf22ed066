"""Model FLOPs per token (``dew.training.flops``) against XLA's own count of the one-device step,
and the table of device peaks.

XLA's count is ``compiled.cost_analysis()["flops"]`` of ``jit(value_and_grad(objective.loss))``
on one device. Two things stand between it and the model's count, and the test takes each out or
adds it back explicitly:

- XLA's cost analysis counts a while loop's body once, not times its trip count, and the layers
  run under ``lax.scan``: the test unrolls the scan (``jax.lax.scan`` with ``unroll=True``) so
  every layer is counted.
- The layers run under ``jax.checkpoint``: the backward recomputes each layer's forward but for
  its last matmul (the MLP's ``down``, whose output the backward does not need), which the model's
  count leaves out. Measured (docs/metrics.md): with the recompute turned off, XLA counts 1.005x
  to 1.011x the model FLOPs at widths 256 and 128; with it, 1.25x to 1.26x, and 1.005x to 1.012x
  the model FLOPs plus that recompute. What is left is elementwise work the count leaves out:
  norms, softmax, rotary, SiLU, the cross-entropy.
- The rotary embedding swaps the halves of q and k by a matmul with a ``[head_dim, head_dim]``
  signed permutation (``dew.nn.rotary``), forward and in its backward: XLA counts those as
  matmuls, the model's count does not; the test adds them (``rotary_flops_per_token``).
"""

import jax
import jax.numpy as jnp
import pytest

from dew import models
from dew.objectives.lm import LMObjective
from dew.targets import GENERATIONS
from dew.training.flops import model_flops_per_token, peak_flops

# Grouped queries, an MLP width of its own, an untied head: every term of the count differs from
# a default model's.
CONFIG = dict(
    vocab_size=256,
    emb_features=256,
    num_layers=2,
    num_heads=8,
    num_kv_heads=2,
    mlp_features=384,
    tie_embeddings=False,
)
SEQ = 64
ROWS = 2
# XLA's count over the model's (or the model's plus the recompute), measured 1.009 for CONFIG: the
# elementwise work. Its floor is 1: XLA counts every matmul the model FLOPs count.
MARGIN = 1.02


def xla_flops_per_token(objective, monkeypatch) -> float:
    real_scan = jax.lax.scan
    monkeypatch.setattr(
        jax.lax, "scan", lambda *args, **kwargs: real_scan(*args, **{**kwargs, "unroll": True})
    )
    params = jax.eval_shape(objective.model.init, jax.random.key(0))
    batch = jax.ShapeDtypeStruct((ROWS, SEQ + 1), jnp.int32)
    compiled = jax.jit(jax.value_and_grad(objective.loss)).lower(params, batch).compile()
    return compiled.cost_analysis()["flops"] / (ROWS * SEQ)


def recompute_flops_per_token(model) -> float:
    """What ``jax.checkpoint`` adds: each layer's forward again, less the MLP's ``down``."""
    layers = jax.eval_shape(model.init, jax.random.key(0))["params"]["layers"]
    weights = sum(leaf.size for leaf in jax.tree_util.tree_leaves(layers))
    down = layers["mlp"]["down"].size
    return 2 * (weights - down) + 4 * model.num_layers * model.emb_features * SEQ


def rotary_flops_per_token(model, forwards: int) -> float:
    """The rotation's matmuls: q's and k's heads times a ``[head_dim, head_dim]`` permutation, in
    ``forwards`` forward passes and the one backward."""
    one = 2 * (model.num_heads + model.kv_heads) * model.head_dim**2
    return model.num_layers * one * (forwards + 1)


def test_model_flops_match_xla_without_the_recompute(monkeypatch):
    objective = LMObjective(models.build("causal_transformer", max_seq_len=SEQ, **CONFIG), SEQ)
    monkeypatch.setattr(jax, "checkpoint", lambda f, **kwargs: f)  # the layers read it per call
    model = objective.model
    count = model_flops_per_token(model, SEQ) + rotary_flops_per_token(model, forwards=1)
    ratio = xla_flops_per_token(objective, monkeypatch) / count
    print(f"XLA / model FLOPs, no recompute: {ratio:.4f}")
    assert 1.0 <= ratio < MARGIN, ratio


def test_model_flops_plus_the_recompute_match_the_steps_xla_count(monkeypatch):
    model = models.build("causal_transformer", max_seq_len=SEQ, **CONFIG)
    xla = xla_flops_per_token(LMObjective(model, SEQ), monkeypatch)
    count = model_flops_per_token(model, SEQ)
    print(f"XLA / model FLOPs: {xla / count:.4f}")
    rotary = rotary_flops_per_token(model, forwards=2)
    ratio = xla / (count + recompute_flops_per_token(model) + rotary)
    print(f"XLA / (model FLOPs + recompute): {ratio:.4f}")
    assert 1.0 <= ratio < MARGIN, ratio


def counted_model(d=32, layers=2, vocab=64, seq=16, **overrides):
    """``(model, n)``: a tied decoder of width ``d`` and 4 heads, and ``N`` by hand: the layers'
    weights (q k v o, gate up down, two norm scales), the final norm and the table once (as the
    head)."""
    model = models.build(
        "causal_transformer",
        vocab_size=vocab,
        emb_features=d,
        num_layers=layers,
        num_heads=4,
        max_seq_len=seq,
        **overrides,
    )
    per_layer = 4 * d * d + 3 * d * 4 * d + 2 * d
    return model, layers * per_layer + d + vocab * d


def test_the_formula_by_hand():
    # PaLM's 6 N + 12 L H Q T for the tied default; the attention term counts all T keys (no
    # causal halving).
    d, layers, seq = 32, 2, 16
    model, n = counted_model(d, layers, seq=seq)
    assert model_flops_per_token(model, seq) == 6 * n + 12 * layers * d * seq
    # MaxText's count since 2025 (maxtext_utils.calculate_tflops_training_per_device): attention
    # forward 4 B T^2 H Q per layer, "/ 2" for the causal mask, x 3 for forward and backward, over
    # the B T tokens: 6 L H Q T a token; the weights' 6 N unchanged.
    batch, heads, head_dim = 3, 4, d // 4
    causal_attention = 4 * batch * seq**2 * heads * head_dim / 2 * layers * 3 / (batch * seq)
    assert causal_attention == 6 * layers * d * seq
    assert model_flops_per_token(model, seq, causal_halved=True) == 6 * n + causal_attention


def visible_pairs(seq: int, window: int) -> int:
    """Brute force: the (query, key) pairs a causal window of ``window`` keys lets through on a
    row of ``seq`` positions (key ``j`` of query ``i``: ``i - window < j <= i``)."""
    return sum(1 for i in range(seq) for j in range(seq) if i - window < j <= i)


@pytest.mark.parametrize("window", [1, 5, 15, 16, 40])
def test_a_sliding_window_counts_the_keys_a_query_sees(window):
    # PaLM's count, a window W: 12 L H Q min(W, T), every query against the W' = min(W, T) keys
    # it may see. Causal: the area under min(t, W') over the row, per query W' - W'^2 / (2 T),
    # which is MaxText's T / 2 at W' = T and is the brute-force count of the mask less W' / 2
    # a row (the exact mean is W' - (W'^2 - W') / (2 T)).
    d, layers, seq = 32, 2, 16
    model, n = counted_model(d, layers, seq=seq, attention_window=window)
    shown = min(window, seq)
    assert model_flops_per_token(model, seq) == 6 * n + 12 * layers * d * shown
    causal_keys = shown - shown**2 / (2 * seq)
    halved = model_flops_per_token(model, seq, causal_halved=True)
    assert halved == pytest.approx(6 * n + 12 * layers * d * causal_keys, rel=1e-12)
    assert causal_keys * seq == visible_pairs(seq, window) - shown / 2
    if window >= seq:  # a window that hides nothing: the plain counts
        assert causal_keys == seq / 2


def test_moe_counts_the_k_active_experts_of_e():
    def count(k, experts=4):
        model = models.build(
            "causal_transformer",
            vocab_size=64,
            emb_features=32,
            num_layers=2,
            num_heads=4,
            max_seq_len=16,
            num_experts=experts,
            experts_per_token=k,
        )
        return model_flops_per_token(model, 16)

    one_expert = 3 * 32 * 128  # gate, up, down of one SwiGLU expert of width 128
    # Each token adds one expert's matmuls per MoE layer (2 layers) per extra expert it runs.
    assert count(2) - count(1) == 6 * 2 * one_expert
    assert count(4) - count(1) == 3 * 6 * 2 * one_expert
    # E does not matter, only k (the router, d x E per layer, aside).
    assert count(2, experts=8) - count(2, experts=4) == 6 * 2 * 32 * 4


@pytest.mark.parametrize(
    "kind, peak",
    [
        ("TPU v4", 275e12),
        ("TPU v5 lite", 197e12),
        ("TPU v5", 459e12),  # v5p: not v5e's 197
        ("TPU v6 lite", 918e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100-PCIE-40GB", 312e12),
        ("NVIDIA H100 80GB HBM3", 989.5e12),
        ("NVIDIA H100 PCIe", 756.5e12),
        ("NVIDIA H100 NVL", 835.5e12),
        ("NVIDIA H200", 989.5e12),
        ("NVIDIA H200 NVL", 835.5e12),
        ("cpu", None),
        ("TPU v7", None),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_peak_flops(kind, peak):
    assert peak_flops(kind) == peak


def test_tpu_peaks_are_the_targets_table():
    for generation in GENERATIONS.values():
        assert peak_flops(generation.device_kind) == generation.peak_bf16_flops


def test_the_cpu_has_no_peak():
    assert peak_flops(jax.devices()[0].device_kind) is None
