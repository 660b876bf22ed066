"""Process setup before JAX starts its backends."""

from __future__ import annotations

import os

from dew.checks import positive_int


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
      multi_host: call ``jax.distributed.initialize`` (on a TPU pod or a SLURM/Kubernetes cluster
        the coordinator is found from the environment; elsewhere pass the three arguments below).
      cpu_devices: split the CPU into this many devices and use the CPU backend (tests, examples).
      coordinator_address, num_processes, process_id: passed to ``jax.distributed.initialize``.
    """
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
    if multi_host:
        if os.environ.get("JAX_PLATFORMS", "") == "cpu" or cpu_devices is not None:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        kwargs = {
            k: v
            for k, v in dict(
                coordinator_address=coordinator_address,
                num_processes=num_processes,
                process_id=process_id,
            ).items()
            if v is not None
        }
        jax.distributed.initialize(**kwargs)
