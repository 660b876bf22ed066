"""``dew train``'s memory check: what a device needs, said before anything is allocated, and a
run that cannot fit refused in one line that names what would.

Two counts, both the planner's (``dew.planning``): the training state a device holds in the
mesh's layout (weights, optimizer state, EMA: exact from the shardings, no compile), then,
once the step is compiled (``Trainer.compile_step``: nothing allocated, and ``fit`` reuses the
executable), all the step needs on a device by the compiler's count (arguments + outputs -
donated + temporaries + code: ``dew.training.step_memory.program_bytes``).

Where it must fit: on an accelerator, the memory the device reports (``bytes_limit``; a CPU
reports none). On simulated CPU devices every device lives in this process, so the host holds
the count times what one device needs, against what the host has: ``MemAvailable`` of
``/proc/meminfo``, and, under an address-space limit (``ulimit -v``, ``RLIMIT_AS``), what the
limit leaves above the process's present size.

``dew train --model gpt2-small --steps 1`` on a CPU machine says, before and after compiling:

    8 simulated CPU devices, mesh fsdp=8: 176.80 MiB of training state a device; the host
    holds 8: 1.38 GiB of 22.33 GiB available
    a device needs 613.75 MiB for the step, the state included; the host holds 8: 4.79 GiB of
    22.33 GiB available

(each one line). With ``--mesh data=8`` a device would hold 1.38 GiB of state, 11.05 GiB for the
host's 8: where the host has less, the run is refused at once, naming ``--mesh fsdp=8``.
"""

from __future__ import annotations

import resource

from dew.benchmark.measure import bytes_text, layout_name

# What the host has, read from these (tests give their own text).
MEMINFO = "/proc/meminfo"
PROCESS_STATUS = "/proc/self/status"


def _kib_field(text: str, name: str) -> int | None:
    """``name: 1234 kB`` of a /proc file's ``text``, in bytes; ``None`` when absent."""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return int(value.split()[0]) * 1024
    return None


def _read(path: str) -> str:
    try:
        with open(path) as file:
            return file.read()
    except OSError:  # not Linux: nothing to read
        return ""


def host_available(meminfo: str | None = None, status: str | None = None, limit=None):
    """``(bytes, what)``: the memory this process can still take, and where the figure comes
    from (``"MemAvailable"``, or ``"the address-space limit, ulimit -v"`` when that leaves less);
    ``(None, "")`` where neither is known. ``meminfo``, ``status`` (``/proc/self/status``) and
    ``limit`` (``RLIMIT_AS``'s soft limit in bytes) replace the real ones in tests."""
    meminfo = _read(MEMINFO) if meminfo is None else meminfo
    status = _read(PROCESS_STATUS) if status is None else status
    limit = resource.getrlimit(resource.RLIMIT_AS)[0] if limit is None else limit
    found = []
    available = _kib_field(meminfo, "MemAvailable")
    if available is not None:
        found.append((available, "MemAvailable"))
    size = _kib_field(status, "VmSize")
    if limit != resource.RLIM_INFINITY and size is not None:
        found.append((max(limit - size, 0), "the address-space limit, ulimit -v"))
    return min(found) if found else (None, "")


def devices_text(devices) -> str:
    """``"8 simulated CPU devices"``, ``"1 TPU v5 lite device"``, ``"8 NVIDIA H100 devices"``."""
    count, first = len(devices), devices[0]
    plural = "s" if count > 1 else ""
    if first.platform == "cpu":
        return f"{count} simulated CPU device{plural}" if count > 1 else "1 CPU device"
    return f"{count} {first.device_kind} device{plural}"


class Room:
    """Where a step's memory must fit: each device's own (``per_device``) or the host's, which
    holds all ``count`` devices of a CPU run (``host``, read once, by ``host_available`` unless
    ``host`` gives it); ``None`` when unknown (nothing is refused)."""

    def __init__(self, devices, host=None):
        import jax

        from dew.training.step_memory import device_memory_limit

        # The devices this process holds (all of them, but in a run of several processes).
        self.count = sum(d.process_index == jax.process_index() for d in devices)
        self.devices = devices_text(devices)
        self.on_host = devices[0].platform == "cpu"
        self.per_device = None if self.on_host else device_memory_limit(devices[0])
        self.host, self.source = (host or host_available)() if self.on_host else (None, "")

    def fits(self, per_device: int) -> bool:
        if self.on_host:
            return self.host is None or self.count * per_device <= self.host
        return self.per_device is None or per_device <= self.per_device

    def text(self, per_device: int) -> str:
        """The room ``per_device`` bytes a device take, for the line said before the step:
        ``"the host holds 8: 1.39 GiB of 21.57 GiB available"``; ``"a device has 15.75 GiB"``."""
        if self.on_host:
            have = "" if self.host is None else f" of {bytes_text(self.host)} available"
            return f"the host holds {self.count}: {bytes_text(self.count * per_device)}{have}"
        return "" if self.per_device is None else f"a device has {bytes_text(self.per_device)}"

    def short(self, per_device: int) -> str:
        """``", 1.39 GiB on this host"`` on the host, nothing on an accelerator."""
        return f", {bytes_text(self.count * per_device)} on this host" if self.on_host else ""

    def over(self, per_device: int) -> str:
        """Why ``per_device`` bytes a device do not fit, after a ``;``."""
        if self.on_host:
            return (
                f"{self.devices} hold {bytes_text(self.count * per_device)} on this host, which "
                f"has {bytes_text(self.host)} available ({self.source})"
            )
        return f"a device has {bytes_text(self.per_device)}"


def state_bytes(trainer) -> int:
    """The training state one device holds in ``trainer``'s layout (``dew.planning``'s count)."""
    from dew.planning import _state_bytes

    return _state_bytes(trainer)


def _on_mesh(trainer, mesh, optimizer=None):
    """``trainer``'s model and layout on ``mesh``, with its optimizer or ``optimizer`` (for the
    state a flag would give)."""
    from dew.training.trainer import Trainer

    return Trainer(
        trainer.objective,
        trainer.optimizer if optimizer is None else optimizer,
        key=trainer.key,
        mesh=mesh,
        layout=trainer.layout,
        accumulation=trainer.accumulation,
        engine=trainer.engine,
    )


def _sharded(trainer):
    """``(--mesh text, its trainer)`` of the fully sharded layout over ``trainer``'s devices;
    ``None`` where ``trainer`` is already fully sharded or the model refuses it."""
    from dew.mesh import MeshSpec

    count = trainer.mesh.devices.size
    if dict(trainer.mesh.shape)["fsdp"] == count:
        return None
    try:
        return f"fsdp={count}", _on_mesh(trainer, MeshSpec(fsdp=count))
    except ValueError:
        return None


def check_state(trainer, room: Room, optimizers: dict | None = None) -> str:
    """The line said before the step compiles: the devices, the mesh and the state a device
    holds, against the room it has; ``ValueError`` when the state alone does not fit, naming
    what would: the fully sharded ``--mesh``, else the first of ``optimizers`` (the flag as
    typed, ``"--moments-dtype bfloat16"``, to the optimizer it gives) whose smaller state fits
    on that mesh (each counted as this one is), else a smaller ``--model``."""
    state = state_bytes(trainer)
    mesh = layout_name(dict(trainer.mesh.shape))
    line = f"{room.devices}, mesh {mesh}: {bytes_text(state)} of training state a device"
    if room.text(state):
        line += f"; {room.text(state)}"
    if room.fits(state):
        return line
    what = (
        f"the training state (weights, optimizer, EMA) needs {bytes_text(state)} a device on "
        f"--mesh {mesh}; {room.over(state)}"
    )
    # The fully sharded mesh first, then each smaller optimizer on the mesh that holds least.
    mesh_flags, spec, least = [], trainer.mesh_spec, state
    sharded = _sharded(trainer)
    if sharded is not None:
        name, other = sharded
        mesh_flags, spec, least = [f"--mesh {name}"], other.mesh_spec, state_bytes(other)
        if room.fits(least):
            raise ValueError(
                f"{what}: give --mesh {name}, fully sharded, where a device holds "
                f"{bytes_text(least)}{room.short(least)}"
            )
    for flag, optimizer in (optimizers or {}).items():
        smaller = state_bytes(_on_mesh(trainer, spec, optimizer))
        if room.fits(smaller):
            raise ValueError(
                f"{what}: give {' and '.join([*mesh_flags, flag])}, where a device holds "
                f"{bytes_text(smaller)}{room.short(smaller)}"
            )
        least = min(least, smaller)
    tried = " ".join(
        [f"--mesh {layout_name(spec.shape(trainer.mesh.devices.size))}", *(optimizers or {})]
    )
    raise ValueError(
        f"{what}; with {tried} a device would still hold {bytes_text(least)}"
        f"{room.short(least)}: give a smaller --model"
    )


def check_step(trainer, compiled, batch: int, room: Room) -> str:
    """What a device needs for the compiled step (``compiled.memory_analysis()``, the planner's
    count), against the room it has, said after the compile and before anything is allocated;
    ``ValueError`` naming what would fit (a fully sharded ``--mesh``, a smaller ``--batch``)
    when it does not."""
    from dew.training.step_memory import program_bytes

    need = program_bytes(compiled.memory_analysis())
    line = f"a device needs {bytes_text(need)} for the step, the state included"
    if room.text(need):
        line += f"; {room.text(need)}"
    if room.fits(need):
        return line
    mesh = layout_name(dict(trainer.mesh.shape))
    what = (
        f"the step needs {bytes_text(need)} a device on --mesh {mesh} with --batch {batch}, the "
        f"state included; {room.over(need)}"
    )
    state = state_bytes(trainer)
    fixes = []
    sharded = _sharded(trainer)
    if sharded is not None:  # the step's own part, unchanged, beside the sharded state
        name, other = sharded
        sharded_need = need - state + state_bytes(other)
        if room.fits(sharded_need):
            fixes.append(
                f"--mesh {name} (fully sharded: about {bytes_text(sharded_need)} a device"
                f"{room.short(sharded_need)})"
            )
    # The step's part beyond the state grows with the rows a device takes: the largest batch
    # whose share of it fits, in whole rows per batch device.
    unit = trainer.batch_devices * trainer.accumulation * trainer.microbatches
    needs = {b: int(state + (need - state) * b / batch) for b in range(unit, batch, unit)}
    fitting = [b for b, n in needs.items() if room.fits(n)]
    if fitting:
        most = fitting[-1]
        fixes.append(
            f"--batch {most} (about {bytes_text(needs[most])} a device{room.short(needs[most])})"
        )
    if not fixes:
        fixes.append("a smaller --seq-len or --model")
    raise ValueError(f"{what}: give {' or '.join(fixes)}")


def smaller_optimizers(args) -> dict:
    """The optimizer flags that shrink the training state, as typed, to the optimizer each gives
    with this command's other flags: what a refusal may name."""
    import argparse

    from dew.cli.optimizer_flags import optimizer_from

    if args.moments_dtype == "bfloat16":
        return {}
    halved = argparse.Namespace(**{**vars(args), "moments_dtype": "bfloat16"})
    return {"--moments-dtype bfloat16": optimizer_from(halved)}


def check_and_compile(trainer, data, args):
    """``dew train``'s check, before any weight is allocated: the devices, the mesh and the state
    a device holds, in one line (``check_state``), then the step compiled (a live line while it
    compiles) and what a device needs for it (``check_step``); a run that does not fit is
    refused in one line naming what would. Returns the ``Progress`` that ``fit`` reports its own
    phases on."""
    from dew.training.progress import Progress

    room = Room(list(trainer.mesh.devices.flat))
    print(check_state(trainer, room, smaller_optimizers(args)), flush=True)
    progress = Progress()
    compiled = trainer.compile_step(data, progress)
    print(check_step(trainer, compiled, args.batch, room), flush=True)
    return progress
