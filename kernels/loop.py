"""`block_loop`: the one loop construct the kernels use.

`lax.fori_loop` becomes a scan when both bounds are static, and a while loop otherwise. Inside
`jax.shard_map(check_vma=True)`, Pallas' interpreter (JAX 0.10) drops the varying-axes type of a
scan's carry and fails the check; so the kernels always loop with `lax.while_loop`, written in
the exact shape of fori_loop's own while loop (carry ``(i, upper, x)``, condition ``i < upper``,
``i + 1`` in the body) that Pallas' Triton lowering pattern-matches into an ``scf.for``, which it
can software-pipeline.
"""

from __future__ import annotations

from jax import lax

from .tiling import as_index


def block_loop(lower, upper, body, carry):
    """``for i in range(lower, upper): carry = body(i, carry)``; bounds static or traced int32
    (the counter ``i`` is ``INDEX_DTYPE``, int32, also under x64)."""

    def cond(state):
        i, stop, _ = state
        return i < stop

    def step(state):
        i, stop, x = state
        return i + 1, stop, body(i, x)

    start = (as_index(lower), as_index(upper), carry)
    return lax.while_loop(cond, step, start)[2]
