"""Pallas kernels of Dew (installed as `dew.kernels`); see docs/kernels.md.

- `flash_attention(q, k, v, *, causal=True, sm_scale=None, block_q=None, block_k=None,
  interpret=None) -> out`: blockwise softmax attention, forward and backward in Pallas.
- `flash_attention_forward(q, k, v, *, <same>) -> (out, lse)`: the same, with each query row's
  natural-log log-sum-exp of its logits (float32 [batch, heads, q_len]); differentiable.
- `flash_attention_backward(q, k, v, out, lse, d_out, d_lse=None, *, <same>) -> (dq, dk, dv)`:
  the backward kernels alone, for the cotangents of out and (optionally) lse.

Two kernel families behind one contract, chosen per call from the devices it is compiled for
(`platform.py`): Mosaic on TPU (`mosaic_forward.py`, `mosaic_backward.py`, `mosaic.py`), Triton on
GPU (`forward.py`, `backward.py`); on CPU, Pallas' interpreter (``interpret=None`` or ``True``) or
TPU interpret mode for the Mosaic kernels (``interpret="tpu"``).
"""

from .attention import flash_attention, flash_attention_backward, flash_attention_forward

__all__ = ["flash_attention", "flash_attention_backward", "flash_attention_forward"]
