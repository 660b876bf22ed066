"""The GSPMD baseline's attention kernel: a shard_map around it, as a user's GSPMD code writes it.

XLA's partitioner cannot split a Pallas kernel: off the CPU it is one custom call (Mosaic on a
TPU, Triton on a GPU), and JAX refuses it under a GSPMD program over several devices ("Mosaic
kernels cannot be automatically partitioned"). GSPMD code that runs such kernels wraps them in a
``shard_map`` over the axes that split the batch and the heads, as MaxText wraps splash attention.
``kernel_on_mesh`` is that wrapper for the GSPMD engine (``dew.training.step``), so that the
baseline runs the kernels Dew's own step runs, not XLA's attention.

The split it asks for: rows over the batch axes above 1 (``data``, ``expert``, ``fsdp``: the
pinned activations' split), heads over ``tensor`` where it divides both the query and the
key/value heads, positions and head_dim whole (q, k, v in the model's ``[batch, heads, seq,
head_dim]``; segment ids, when the batch packs documents, ``[batch, seq]`` on the same rows). A
GSPMD step with the sequence split gathers the positions into the call: the baseline's attention
is not a ring. No bytes move when q, k and v already have this split (they do under the pinned
activations); otherwise XLA reshards them around the call.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from dew.mesh import BATCH_AXES
from dew.parallel import ragged

HEADS_AXIS = "tensor"
# The attention choices that are one custom call off the CPU (Mosaic, Triton, cuDNN).
KERNEL_CALLS = ("pallas", "cudnn")


def wraps(impl: str, platform: str) -> bool:
    """Whether attention ``impl`` on ``platform`` needs ``kernel_on_mesh`` where it is traced:
    a kernel that is one custom call (off the CPU, where the kernels run interpreted) in a
    computation XLA partitions over several devices (``ragged.partitioned_devices``)."""
    return impl in KERNEL_CALLS and platform != "cpu" and ragged.partitioned_devices() > 1


def _rows(mesh) -> tuple[str, ...] | None:
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    return tuple(a for a in BATCH_AXES if sizes.get(a, 1) > 1) or None


def call_spec(mesh, heads: int, kv_heads: int) -> P:
    """The ``PartitionSpec`` of ``[batch, heads, seq, head_dim]`` q, k, v and the output (the
    model's layout, ``dew.nn.attention.LAYOUT``) inside the wrapper on ``mesh`` (an abstract or
    concrete mesh)."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    split = sizes.get(HEADS_AXIS, 1)
    heads_axis = HEADS_AXIS if split > 1 and heads % split == 0 and kv_heads % split == 0 else None
    return P(_rows(mesh), heads_axis, None, None)


def kernel_on_mesh(attend, heads: int, kv_heads: int):
    """``attend`` (``(q, k, v, *, causal, segment_ids=None, window=None) -> (out, lse)``, the
    model's layout) run per device of the abstract mesh the step is traced on, each on its rows
    and heads (``call_spec``; segment ids ``[batch, seq]`` on its rows). Returns the same kind of
    function; its lse is ``None`` (the decoder uses the output only)."""

    def call(q, k, v, *, causal=True, segment_ids=None, window=None):
        mesh = jax.sharding.get_abstract_mesh()
        spec = call_spec(mesh, heads, kv_heads)
        extra = {} if window is None else {"window": window}
        if segment_ids is None:
            local = jax.shard_map(
                lambda q, k, v: attend(q, k, v, causal=causal, **extra)[0],
                mesh=mesh,
                in_specs=(spec, spec, spec),
                out_specs=spec,
            )
            return local(q, k, v), None
        local = jax.shard_map(
            lambda q, k, v, ids: attend(q, k, v, causal=causal, segment_ids=ids, **extra)[0],
            mesh=mesh,
            in_specs=(spec, spec, spec, P(_rows(mesh), None)),
            out_specs=spec,
        )
        return local(q, k, v, segment_ids), None

    return call
