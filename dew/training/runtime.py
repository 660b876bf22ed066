"""Process setup before JAX starts its backends."""

from __future__ import annotations

import os
import sys

from dew.checks import nonnegative_int, positive_int

# What `dew launch` puts in each process's environment (dew/cli/launch.py), read here.
COORDINATOR_VARIABLE = "DEW_COORDINATOR_ADDRESS"
NUM_PROCESSES_VARIABLE = "DEW_NUM_PROCESSES"
PROCESS_ID_VARIABLE = "DEW_PROCESS_ID"
CPU_DEVICES_VARIABLE = "DEW_CPU_DEVICES"
LAUNCH_VARIABLES = (COORDINATOR_VARIABLE, NUM_PROCESSES_VARIABLE, PROCESS_ID_VARIABLE)

# The clusters `jax.distributed.initialize()` detects by itself, and what it looks for in each
# (jax/_src/clusters/*.py, JAX 0.10), for the error when none is there.
CLUSTERS_LOOKED_FOR = (
    f"dew launch ({', '.join(LAUNCH_VARIABLES)})",
    "a Cloud TPU pod (the TPU VM's metadata server, or TPU_WORKER_HOSTNAMES / "
    "TPU_PROCESS_ADDRESSES with TPU_WORKER_ID on GKE)",
    "Slurm (SLURM_JOB_ID, SLURM_STEP_NODELIST, SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID)",
    "Open MPI (OMPI_MCA_orte_hnp_uri, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_RANK)",
    "Kubernetes (KUBERNETES_SERVICE_HOST, with the `kubernetes` package installed)",
)


# The simulated CPU devices a ``dew`` command makes where no accelerator is found: 8, so that the
# README's layouts (fsdp=8, data=2,fsdp=4, tensor=8) run on any machine.
DEFAULT_CPU_DEVICES = 8

# The accelerators ``find_accelerator`` looks for: the device files the kernel driver makes, and
# the module JAX loads the backend from (its PJRT plugin). JAX uses the accelerator only when both
# are there (a plugin without a device falls back to the CPU; so does a device without one: libtpu
# is installed on CPU machines to compile for TPUs).
ACCELERATORS = (
    ("tpu", ("/dev/accel[0-9]*", "/dev/vfio/[0-9]*"), ("libtpu",)),
    ("gpu", ("/dev/nvidia[0-9]*",), ("jax_plugins.xla_cuda*",)),
    ("gpu", ("/dev/kfd",), ("jax_plugins.xla_rocm*",)),
)


def _module_installed(pattern: str) -> bool:
    """Whether a module matching ``pattern`` (``libtpu``, ``jax_plugins.xla_cuda*``) is installed,
    found without importing it."""
    import fnmatch
    import importlib.util
    import pkgutil

    parent, _, child = pattern.rpartition(".")
    if not parent:
        return importlib.util.find_spec(pattern) is not None
    spec = importlib.util.find_spec(parent)  # jax_plugins: a namespace package, nothing runs
    if spec is None or not spec.submodule_search_locations:
        return False
    names = (m.name for m in pkgutil.iter_modules(spec.submodule_search_locations))
    return any(fnmatch.fnmatch(name, child) for name in names)


def find_accelerator(environ=None, paths=None, installed=None) -> str | None:
    """The accelerator JAX will find here (``"tpu"``, ``"gpu"``), or ``None`` for the CPU alone,
    read without starting any JAX backend (simulated CPU devices must be set up before one
    starts).

    ``JAX_PLATFORMS`` decides when it is set: its first platform (``"cuda"``, ``"tpu"``), ``None``
    when that is ``cpu``.
    Otherwise an accelerator is found where its device files (``/dev/accel0`` or
    ``/dev/vfio/0`` for a TPU, ``/dev/nvidia0`` for an NVIDIA GPU, ``/dev/kfd`` for AMD) and JAX's
    plugin for it (``libtpu``, ``jax-cuda12-plugin``, ...) are both there. ``environ``, ``paths``
    (a glob pattern to the paths it matches) and ``installed`` (a module name to whether it is
    installed) replace the real probes in tests."""
    import glob

    environ = os.environ if environ is None else environ
    paths = glob.glob if paths is None else paths
    installed = _module_installed if installed is None else installed
    platforms = [p.strip() for p in environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms:
        first = platforms[0].lower()
        return None if first == "cpu" else first
    for kind, device_files, plugins in ACCELERATORS:
        if any(paths(pattern) for pattern in device_files) and any(map(installed, plugins)):
            return kind
    return None


def default_cpu_devices(cpu_devices: int | None, environ=None, **probes) -> int | None:
    """The simulated CPU devices a ``dew`` command sets up for ``--cpu-devices`` (``None``: not
    given): ``N`` for ``N`` given, none (JAX's own devices) for 0 or where ``find_accelerator``
    finds an accelerator, else ``DEFAULT_CPU_DEVICES``."""
    if cpu_devices is not None:
        return cpu_devices or None
    return None if find_accelerator(environ, **probes) else DEFAULT_CPU_DEVICES


# Where ``use_compilation_cache`` keeps compiled programs: under ``$XDG_CACHE_HOME`` (else
# ``~/.cache``), one folder for every run of this user.
CACHE_SUBFOLDER = ("dew", "jax")


def use_compilation_cache(platform: str, environ=None) -> str | None:
    """Points JAX's persistent compilation cache at ``~/.cache/dew/jax`` (``$XDG_CACHE_HOME/dew/
    jax``) for a command that compiles a step on an accelerator (``dew train``, ``generate``,
    ``eval``), so a rerun (a resumed or preempted run, the same command again) reads its compiled
    programs back instead of compiling them again: minutes for a large model on a TPU slice. JAX
    keys each program by its HLO, compiler flags, devices and versions, so only the same program
    is read back.

    Left to JAX where the user set ``JAX_COMPILATION_CACHE_DIR`` (JAX reads it itself; empty turns
    the cache off) or ``jax.config``'s ``jax_compilation_cache_dir``; off on the CPU
    (``platform`` ``"cpu"``: simulated devices compile in seconds, and an XLA:CPU executable
    read back from the cache has corrupted the heap under some ``XLA_FLAGS``, with JAX 0.10.2).
    ``JAX_ENABLE_COMPILATION_CACHE=false`` turns it off everywhere. Call it before the first
    compile.

    Args:
      platform: the platform the command runs on (``jax.default_backend()``).
      environ: replaces ``os.environ`` in tests.

    Returns:
      the cache folder in use, or ``None`` where the cache is off.
    """
    import jax

    environ = os.environ if environ is None else environ
    if "JAX_COMPILATION_CACHE_DIR" in environ:
        return environ["JAX_COMPILATION_CACHE_DIR"] or None
    if jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    if platform == "cpu":
        return None
    from pathlib import Path

    home = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    folder = str(Path(home).joinpath(*CACHE_SUBFOLDER))
    jax.config.update("jax_compilation_cache_dir", folder)
    return folder


class NoClusterError(RuntimeError):
    """``prepare_process(multi_host=True)`` found no coordinator: neither ``dew launch``'s
    variables nor a cluster ``jax.distributed.initialize()`` detects."""


def no_cluster_message() -> str:
    return (
        "prepare_process(multi_host=True) found no multi-process run to join. It looked for: "
        + "; ".join(CLUSTERS_LOOKED_FOR)
        + ". Start the processes with `dew launch --processes N -- COMMAND`, run them under one of "
        "these clusters, or pass coordinator_address, num_processes and process_id."
    )


def _variable_int(name: str) -> int:
    text = os.environ[name]
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not an integer") from None


def launch_settings() -> tuple[dict, int | None] | None:
    """``dew launch``'s variables: ``jax.distributed.initialize``'s three arguments and the
    simulated CPU device count (``None`` when ``DEW_CPU_DEVICES`` is unset); ``None`` when none of
    the variables is set. Some set and not others, or a value out of range, is a ``ValueError``."""
    present = [name for name in LAUNCH_VARIABLES if name in os.environ]
    if not present:
        return None
    if len(present) < len(LAUNCH_VARIABLES):
        missing = [name for name in LAUNCH_VARIABLES if name not in present]
        raise ValueError(
            f"{', '.join(present)} set but not {', '.join(missing)}; dew launch sets all of "
            + ", ".join(LAUNCH_VARIABLES)
        )
    num_processes = positive_int(NUM_PROCESSES_VARIABLE, _variable_int(NUM_PROCESSES_VARIABLE))
    process_id = nonnegative_int(PROCESS_ID_VARIABLE, _variable_int(PROCESS_ID_VARIABLE))
    if process_id >= num_processes:
        raise ValueError(
            f"{PROCESS_ID_VARIABLE}={process_id} is not below "
            f"{NUM_PROCESSES_VARIABLE}={num_processes}"
        )
    cpu_devices = None
    if CPU_DEVICES_VARIABLE in os.environ:
        cpu_devices = positive_int(CPU_DEVICES_VARIABLE, _variable_int(CPU_DEVICES_VARIABLE))
    arguments = dict(
        coordinator_address=os.environ[COORDINATOR_VARIABLE],
        num_processes=num_processes,
        process_id=process_id,
    )
    return arguments, cpu_devices


def prepare_process(
    multi_host: bool = False,
    *,
    cpu_devices: int | None = None,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> None:
    """Joins a multi-process run and/or sets up simulated CPU devices.

    Call it before any other JAX use.

    Args:
      multi_host: join a multi-process run with ``jax.distributed.initialize``. Without the three
        arguments below, the run is found from the environment: first ``dew launch``'s variables
        (``DEW_COORDINATOR_ADDRESS``, ``DEW_NUM_PROCESSES``, ``DEW_PROCESS_ID``, and
        ``DEW_CPU_DEVICES`` for ``cpu_devices`` when that is not given), else the clusters JAX
        detects (a Cloud TPU pod, Slurm, Open MPI, Kubernetes). Finding none raises
        ``NoClusterError`` naming what was looked for. Prints ``process i of n`` to stderr once
        joined.
      cpu_devices: split the CPU into this many devices and use the CPU backend (tests, examples);
        a multi-process run on the CPU then uses gloo collectives. ``None`` (the default): the
        devices JAX finds.
      coordinator_address, num_processes, process_id: passed to ``jax.distributed.initialize``
        with ``multi_host=True`` (ignored without it); any one given skips the search above.

    Raises:
      ValueError: ``cpu_devices`` is below 1.
      NoClusterError: ``multi_host=True`` and no run was given or found.

    Examples:
        >>> from dew.training.runtime import prepare_process
        >>> prepare_process(cpu_devices=8)  # before anything else touches JAX
        >>> import jax
        >>> jax.device_count()
        8
    """
    explicit = {
        k: v
        for k, v in dict(
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
        ).items()
        if v is not None
    }
    if multi_host and not explicit and (launched := launch_settings()) is not None:
        explicit, launched_cpu_devices = launched
        if cpu_devices is None:
            cpu_devices = launched_cpu_devices
    if cpu_devices is not None:
        positive_int("cpu_devices", cpu_devices)
        flags = [
            f
            for f in os.environ.get("XLA_FLAGS", "").split()
            if not f.startswith("--xla_force_host_platform_device_count")
        ]
        os.environ["XLA_FLAGS"] = " ".join(
            flags + [f"--xla_force_host_platform_device_count={cpu_devices}"]
        )
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    if cpu_devices is not None:
        jax.config.update("jax_platforms", "cpu")
    if not multi_host:
        return
    if os.environ.get("JAX_PLATFORMS", "") == "cpu" or cpu_devices is not None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # Checked before initialize(), which would otherwise stop at "coordinator_address should be
    # defined" without saying where it looked.
    from dew._jax_compat import detected_cluster  # imports jax: only once the flags are set

    if not explicit and detected_cluster() is None:
        raise NoClusterError(no_cluster_message())
    jax.distributed.initialize(**explicit)
    print(f"process {jax.process_index()} of {jax.process_count()}", file=sys.stderr, flush=True)
