"""SwiGLU MLP: ``down(silu(gate(x)) * up(x))``."""

import math

import jax
from jax.ad_checkpoint import checkpoint_name

from dew.nn.param import PLAIN, Param, Projections, normal

# The gate projection's output, by name for a remat policy (the model's "attention_gate" keeps it).
GATE_NAME = "mlp_gate"


def mlp_params(features: int, hidden: int, out_scale: float) -> dict:
    return {
        "gate": Param((features, hidden), ("embed", "mlp"), normal(1.0 / math.sqrt(features))),
        "up": Param((features, hidden), ("embed", "mlp"), normal(1.0 / math.sqrt(features))),
        "down": Param((hidden, features), ("mlp", "embed"), normal(out_scale / math.sqrt(hidden))),
    }


def swiglu(p: dict, x: jax.Array, projections: Projections = PLAIN) -> jax.Array:
    """``x``: ``[batch, seq, embed]`` -> same shape. ``projections``: how ``gate`` and ``up``
    (columns, one input) and ``down`` (the row) run (``dew.nn.param.Projections``; a tensor
    region's, ``dew.parallel.tensor_ring.Region``, may take ``x`` as this device's positions and
    return them)."""
    # As [batch * seq, embed] matrices: XLA:CPU then compiles the weight-gradient matmuls to its
    # fast fused kernels (measured: docs/results/cpu-layouts.md, "Choices in the model").
    rows = x.reshape(-1, x.shape[-1])
    gate, up = projections.columns("te,ef->tf", rows, (p["gate"], p["up"]))
    gate = checkpoint_name(gate, GATE_NAME)
    return projections.row("tf,fe->te", jax.nn.silu(gate) * up, p["down"]).reshape(x.shape)
