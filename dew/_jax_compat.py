"""Every private or release-dependent JAX API that Dew uses, each behind one function.

A JAX upgrade that moves one of them should break this module and nothing else. Each function says
which public API would replace it, or that there is none yet (checked against JAX 0.10.2). Import
these functions here; never import ``jax._src`` anywhere else in Dew (kernels included: they
install as ``dew.kernels`` and import ``from dew._jax_compat import ...``).
"""

from __future__ import annotations

import jax

# ---- the distributed runtime (dew/checkpoints/processes.py) --------------------------------


def distributed_client():
    """The coordination-service client that ``jax.distributed.initialize()`` started, or None
    before it (or in a single-process run). Used for barriers and key-value exchange from a
    background thread, where device collectives could deadlock."""
    # Public replacement: none. `jax.distributed` exposes initialize, is_initialized and shutdown
    # only; `jax.experimental.multihost_utils` reads this same private field.
    from jax._src import distributed

    return distributed.global_state.client


# ---- cluster detection (dew/training/runtime.py) ------------------------------------------


def detected_cluster() -> str | None:
    """The name of the cluster ``jax.distributed.initialize()`` would join (``"SlurmCluster"``,
    ``"GceTpuCluster"``, ...), or ``None`` when it finds none; ``"unknown"`` when this JAX's
    detectors cannot be asked (then ``initialize`` decides)."""
    # Public replacement: none. `initialize()` runs these detectors itself but does not say which
    # matched, or that none did, before it fails.
    try:
        from jax._src.clusters import ClusterEnv
    except ImportError:
        return "unknown"
    try:
        for cluster in ClusterEnv._cluster_types:
            if not cluster.opt_in_only_method and cluster.is_env_present():
                return cluster.__name__
    except Exception:  # a detector that fails to ask is for initialize() to report
        return "unknown"
    return None


# ---- the runtime's deferred releases (dew/checkpoints/reader.py) ---------------------------


def collect_runtime_garbage() -> bool:
    """Run now the Python releases the runtime deferred (host buffers it let go of from its own
    thread). Returns False, doing nothing, where this jaxlib has no such call: the buffers are
    then freed at the runtime's next call, a little later."""
    # Public replacement: none (jax._src.lib calls it itself at interpreter exit).
    try:
        from jax._src.lib import _jax

        collect = _jax.collect_garbage
    except (ImportError, AttributeError):
        return False
    collect()
    return True


# ---- shard_map's varying-axes type (kernels/varying.py) ------------------------------------


def varying_axes(x) -> frozenset:
    """The mesh axes that ``x`` varies over inside ``jax.shard_map`` (empty outside it)."""
    # Public: `jax.typeof(x)` is, but the field holding this set is named per release: JAX 0.10
    # has `manual_axis_type.varying`, older releases `vma`. There is no accessor function yet.
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", frozenset()))


def shape_dtype_struct_varying_like(shape, dtype, like) -> jax.ShapeDtypeStruct:
    """``jax.ShapeDtypeStruct(shape, dtype)`` that varies over the same mesh axes as ``like``."""
    # Public: `jax.ShapeDtypeStruct` is, but its keyword for the varying axes follows the aval's
    # field name (`manual_axis_type=` in JAX 0.10, `vma=` before).
    aval = jax.typeof(like)
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=manual)
    vma = getattr(aval, "vma", None)
    if vma is not None:
        return jax.ShapeDtypeStruct(shape, dtype, vma=vma)
    return jax.ShapeDtypeStruct(shape, dtype)


# ---- Pallas' Triton lowering, for the tests (tests/test_kernels.py) ------------------------

# Modules whose absence means "this JAX has no Pallas Triton lowering": the lowering itself and
# the Triton MLIR dialect bindings of jaxlib it is built on.
_TRITON_LOWERING_MODULES = (
    "jax._src.pallas.triton",
    "jax._src.pallas.triton.lowering",
    "jax._src.lib.triton",
    "jaxlib.triton",
)


def pallas_triton_lowering():
    """JAX's Pallas-to-Triton lowering module, which has ``lower_jaxpr_to_triton_module``, or
    None when this JAX has none: one of ``_TRITON_LOWERING_MODULES`` (or a submodule of one) is
    not installed, or the module lacks that function. Any other import error is raised."""
    # Public replacement: none. The tests wrap `lower_jaxpr_to_triton_module` to read the Triton
    # IR that `jax.jit(...).lower(lowering_platforms=("cuda",))` produces on a machine without GPU.
    try:
        from jax._src.pallas.triton import lowering
    except ModuleNotFoundError as error:
        missing = error.name or ""
        if any(missing == m or missing.startswith(m + ".") for m in _TRITON_LOWERING_MODULES):
            return None
        raise
    return lowering if hasattr(lowering, "lower_jaxpr_to_triton_module") else None


def has_triton_compiler(platform: str) -> bool:
    """Whether a Triton compiler (from a jaxlib GPU plugin) is registered for ``platform``
    ("cuda" or "rocm"). jaxlib releases after 0.10.2 compile each kernel with it while lowering."""
    # Public replacement: none.
    from jax._src.lib import triton

    return triton.has_compilation_handler(platform)
