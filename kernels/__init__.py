"""Pallas kernels of Dew (installed as `dew.kernels`); see docs/kernels.md.

- `flash_attention(q, k, v, *, causal=True, segment_ids=None, window=None, sm_scale=None,
  block_q=None, block_k=None, interpret=None, layout="bshd") -> out`: blockwise softmax
  attention, forward and backward in Pallas; segment ids keep each query to the keys of its own
  id (packed documents), a window to its ``window`` most recent keys.
- `flash_attention_forward(q, k, v, *, <same>) -> (out, lse)`: the same, with each query row's
  natural-log log-sum-exp of its logits (float32 [batch, heads, q_len]); differentiable.
- `flash_attention_backward(q, k, v, out, lse, d_out, d_lse=None, *, <same>) -> (dq, dk, dv)`:
  the backward kernels alone, for the cotangents of out and (optionally) lse.

Two kernel families behind one contract, chosen per call from the devices it is compiled for
(`platform.py`): Mosaic on TPU (`mosaic_forward.py`, `mosaic_backward.py`, `mosaic.py`), Triton on
GPU (`forward.py`, `backward.py`); on CPU, Pallas' interpreter (``interpret=None`` or ``True``) or
TPU interpret mode for the Mosaic kernels (``interpret="tpu"``). Block skipping: by position in
`schedule.py` and `tiling.py`, by segment ids in `segments.py`.

Imported as a top-level ``kernels`` (from the repository's root), this file hands the import to
an installed package of that name instead (below).
"""

if __name__ == "dew.kernels":
    from .attention import flash_attention, flash_attention_backward, flash_attention_forward

    __all__ = ["flash_attention", "flash_attention_backward", "flash_attention_forward"]
else:
    # This folder is Dew's ``dew.kernels`` (pyproject maps it), never a top-level ``kernels``:
    # from the repository's root Python finds it first under that name (the current directory
    # leads sys.path), hiding a package of that name installed there (transformers imports
    # Hugging Face's ``kernels``). The import goes to the package the path holds past the
    # repository, or fails as if this folder were not here. The standard library alone: the
    # importer may have no JAX.
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _path = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _root]
    _spec = _machinery.PathFinder.find_spec(__name__, _path)
    if _spec is None:
        raise ModuleNotFoundError(f"No module named {__name__!r}", name=__name__)
    _installed = _util.module_from_spec(_spec)
    _sys.modules[__name__] = _installed  # what the import statement returns
    _spec.loader.exec_module(_installed)
