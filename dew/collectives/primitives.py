"""Every name the readers recognise: collectives as JAX and XLA spell them, the op each counts as,
and the control flow they follow.

This is the one place that knows JAX's primitive names and XLA's opcodes (checked against JAX
0.10.2): a release that renames a primitive, or an XLA that prints an opcode differently, needs an
edit here and nowhere else. The readers look names up in these tables rather than compare with
literals of their own.
"""

from __future__ import annotations

# The user-facing ops, in the order a report lists them: forward gathers, backward scatters,
# reductions, point to point. The HLO reader may also report `all_reduce_<reduction>` and
# `reduce_scatter_<reduction>` for reductions no user-facing op names (a bitwise `and`, say).
OPS = (
    "all_gather",
    "psum_scatter",
    "psum",
    "pmax",
    "pmin",
    "ppermute",
    "all_to_all",
    "ragged_all_to_all",
    "pbroadcast",
    "psend",
)

# jaxpr primitive name -> op. Several primitives bind one user function in JAX 0.10: `psum` binds
# `psum_invariant` when the shard_map checks varying axes (the default), `psum_scatter` binds
# `reduce_scatter`, and the async `*_start` forms move the same bytes as their sync twins (their
# `*_done` halves move nothing and are not listed).
JAXPR_PRIMITIVES = {
    "psum": "psum",
    "psum_invariant": "psum",
    "unreduced_psum": "psum",
    "psum_start": "psum",
    "psum_invariant_start": "psum",
    "unreduced_psum_start": "psum",
    "pmax": "pmax",
    "pmin": "pmin",
    "all_gather": "all_gather",
    "all_gather_invariant": "all_gather",
    "all_gather_reduced": "all_gather",
    "all_gather_start": "all_gather",
    "all_gather_reduced_start": "all_gather",
    "reduce_scatter": "psum_scatter",
    "unreduced_reduce_scatter": "psum_scatter",
    "reduce_scatter_start": "psum_scatter",
    "unreduced_reduce_scatter_start": "psum_scatter",
    "ppermute": "ppermute",
    "ppermute_start": "ppermute",
    "all_to_all": "all_to_all",
    "all_to_all_start": "all_to_all",
    "ragged_all_to_all": "ragged_all_to_all",
    "pbroadcast": "pbroadcast",
    "pbroadcast_start": "pbroadcast",
    "psend": "psend",
}

# Ops whose bytes are only known at run time: only the first operand is data (the rest are the
# output buffer and offsets). Their rows count that operand whole, the static send buffer: what
# moves when it is full, a bound on what a call sends (docs/collectives.md).
RUNTIME_SIZED_OPS = frozenset({"ragged_all_to_all"})

# Ops that move nothing when every (source, destination) pair of their `perm` is the same device.
POINT_TO_POINT_OPS = frozenset({"ppermute", "psend"})

# The jaxpr control flow the walker treats specially; any other primitive's nested jaxprs are
# walked once each (jit, checkpoint, custom derivatives, shard_map).
JAXPR_SCAN = "scan"  # params: jaxpr, length
JAXPR_WHILE = "while"  # params: cond_jaxpr, body_jaxpr (trip count unknown)
JAXPR_COND = "cond"  # params: branches
JAXPR_PMAP = "xla_pmap"  # params: axis_name, global_axis_size (binds an axis like a shard_map)
# primitive -> the one param holding the jaxpr that runs; the others are there for autodiff.
JAXPR_RUNS_ONLY = {"linear_call": "callee"}


def hlo_opcode(opcode: str) -> str:
    """An HLO opcode in the dashed spelling the tables below use: XLA prints ``all-gather``, some
    dumps and older releases ``all_gather``."""
    return opcode.replace("_", "-")


# HLO opcode (dashed) -> op. An all-reduce or reduce-scatter is refined by the reduction its
# `to_apply` computation ends in (HLO_REDUCTIONS).
HLO_OPCODES = {
    "all-gather": "all_gather",
    "all-gather-start": "all_gather",
    "all-reduce": "psum",
    "all-reduce-start": "psum",
    "reduce-scatter": "psum_scatter",
    "collective-permute": "ppermute",
    "collective-permute-start": "ppermute",
    "all-to-all": "all_to_all",
    "ragged-all-to-all": "ragged_all_to_all",
    "collective-broadcast": "pbroadcast",
}

# The root opcode of an all-reduce's `to_apply` computation -> op. Others become
# `all_reduce_<root>` (and, for a reduce-scatter not of `add`, `reduce_scatter_<root>`).
HLO_REDUCTIONS = {"add": "psum", "maximum": "pmax", "minimum": "pmin"}

# Halves of async pairs that only wait: their `calls=` repeats the start's computation, so
# following it would count the start's collectives twice.
HLO_WAIT_HALVES = frozenset(
    {
        "async-done",
        "async-update",
        "all-gather-done",
        "all-reduce-done",
        "collective-permute-done",
    }
)

# Asynchronous collectives in scheduled HLO: start opcode -> the done that ends it (an
# `async-start` wraps a computation holding the collective, and may be followed by
# `async-update`s before its `async-done`). What runs between the two runs beside the collective.
HLO_ASYNC_WRAPPER = "async-start"
HLO_ASYNC_UPDATE = "async-update"
HLO_ASYNC_PAIRS = {
    "all-gather-start": "all-gather-done",
    "all-reduce-start": "all-reduce-done",
    "collective-permute-start": "collective-permute-done",
    HLO_ASYNC_WRAPPER: "async-done",
}

# HLO control flow the reader follows (dashed spelling): loops multiply by their known trip count,
# conditionals take the larger branch, calls are walked once.
HLO_WHILE = "while"
HLO_CONDITIONAL = "conditional"
HLO_CALL = "call"

# HLO element types that carry no array bytes.
HLO_BYTELESS_TYPES = frozenset({"token", "opaque"})
