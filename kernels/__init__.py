"""Pallas kernels of Dew (installed as `dew.kernels`).

`flash_attention(q, k, v, *, causal=True, sm_scale=None, block_q=None, block_k=None,
interpret=None)`: blockwise softmax attention, forward and backward in Pallas; see
docs/kernels.md.
"""

from .attention import flash_attention

__all__ = ["flash_attention"]
