"""What a compiled training step needs of a device, by the compiler's own figures.

- ``measure_step(trainer, batch)``: a ``Trainer``'s step compiled (nothing runs) and read:
  ``StepMemory``, the arguments, the heap (``heap_bytes``, from the buffer assignment XLA writes:
  ``compile_measured``) and the total (``program_bytes``), or the compiler's refusal.
- ``refused_for_memory(message)``: the bytes needed and available when ``message`` is the TPU
  compiler refusing a program that does not fit its chip (it checks while compiling).
- ``device_memory_limit(device)``: what a device lets a program use, where it says.

``dew.training.remat_choice`` (``remat="auto"``), ``dew plan`` (``dew.planning``), ``dew bench``
and the ``dew`` command's one-line out-of-memory errors read steps through these. The module
depends on no ``Trainer`` (it takes one), so the step engine and the planner both import it.
"""

from __future__ import annotations

import dataclasses
import re
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = [
    "StepMemory",
    "compile_measured",
    "device_memory_limit",
    "heap_bytes",
    "measure_step",
    "program_bytes",
    "refused_for_memory",
]


_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
# The TPU compiler's refusals of a program that does not fit, in the spellings libtpu uses.
_REFUSALS = (
    re.compile(
        r"required for HLO temporaries \(([\d.]+)([KMGT]?)\) exceeds available HBM "
        r"\(([\d.]+)([KMGT]?)\)"
    ),
    re.compile(r"Used ([\d.]+)([KMGT]?) of ([\d.]+)([KMGT]?) hbm"),
)


def refused_for_memory(message: str) -> tuple[int, int] | None:
    """``(bytes needed, bytes available)`` when ``message`` is the TPU compiler refusing a
    program that does not fit its chip's memory (it checks while compiling), else None. Also
    ``dew bench``'s reading of a contestant the compiler refuses."""
    for pattern in _REFUSALS:
        m = pattern.search(message)
        if m:
            needed = float(m.group(1)) * _UNITS[m.group(2)]
            available = float(m.group(3)) * _UNITS[m.group(4)]
            return int(needed), int(available)
    return None


def program_bytes(memory, temp_bytes: int | None = None) -> int:
    """All a compiled program needs on one device, from its ``memory_analysis()``: arguments +
    outputs - donated (aliased, counted in both) + temporaries + the program's code.
    ``temp_bytes``: the temporaries to count (the compiler's heap, ``heap_bytes``); default the
    analysis's own ``temp_size_in_bytes``."""
    temp = memory.temp_size_in_bytes if temp_bytes is None else temp_bytes
    return int(
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
        + temp
        + memory.generated_code_size_in_bytes
    )


# One allocation of a buffer assignment as XLA writes it: "allocation 103: size 117440512, color
# 1, preallocated-temp:" (the memory space is absent for the device's main memory, space 0).
_ALLOCATION = re.compile(r"^allocation \d+: size (\d+), (.*)$", re.MULTILINE)
_OTHER_SPACE = re.compile(r"\bcolor [1-9]")


def heap_bytes(buffer_assignment: str) -> int:
    """The heap of a compiled program: the bytes its buffer assignment (the text XLA writes as
    ``*-buffer-assignment.txt``) gives the program's temporaries in the device's main memory,
    every ``preallocated-temp`` and ``thread-local`` allocation of memory space 0.

    Parameters, outputs and constants are the program's arguments and results, counted apart;
    the other memory spaces (``color 1``: a TPU core's VMEM; 2 and 6: small on-core ones) are not
    HBM. On TPU this is the ``HLO temp`` of the compiler's log ("Program hbm requirement",
    ``TPU_STDERR_LOG_LEVEL=0``), the figure it checks against the chip, to within the 512-byte
    thread-local scalars (tens of KiB, which the log counts in part): 268.16 MiB read and logged
    for a small step, 65.89 against 65.86 MiB for a tiny one. ``memory_analysis()``'s
    ``temp_size_in_bytes`` adds the heap's fragmentation once more (349.29 MiB and 67.57 MiB)."""
    total = 0
    for size, kinds in _ALLOCATION.findall(buffer_assignment):
        if _OTHER_SPACE.search(kinds):
            continue
        if "preallocated-temp" in kinds or "thread-local" in kinds:
            total += int(size)
    return total


def compile_measured(lowered) -> tuple[Any, int | None]:
    """``(compiled, heap)``: ``lowered`` (a ``jax.stages.Lowered``) compiled, and the heap its
    buffer assignment gives (``heap_bytes``), or ``None`` where the compiler wrote none (an
    executable read back from a persistent compilation cache was not compiled here).

    XLA writes a program's buffer assignment with its dumps: this compile alone gets
    ``xla_dump_to`` (a temporary folder, removed after) with the HLO as text. It adds about a
    second to GPT-2 small's step (a few MiB of text) and changes nothing in the program. A
    compile the TPU compiler refuses raises as without the dump."""
    options = {"xla_dump_to": None, "xla_dump_hlo_as_text": True}
    with tempfile.TemporaryDirectory(prefix="dew-buffer-assignment-") as folder:
        options["xla_dump_to"] = folder
        compiled = lowered.compile(compiler_options=options)
        found = sorted(Path(folder).glob("*-buffer-assignment.txt"))
        # One module compiled, one buffer assignment; anything else is not this program's.
        heap = heap_bytes(found[0].read_text()) if len(found) == 1 else None
    return compiled, heap


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """What one device needs for a compiled step, by the compiler's own figures (``PlanRow``'s
    fields of the same names mean the same). ``refused``: the compiler's message when it refused
    the step for not fitting its chip; then only ``total_bytes`` (the need it stated) and
    ``usable_bytes`` (what it lets a program use) are known."""

    total_bytes: int
    argument_bytes: int | None = None
    temp_bytes: int | None = None
    analysis_temp_bytes: int | None = None
    usable_bytes: int | None = None
    refused: str | None = None
    compile_s: float = 0.0

    def fits(self, limit_bytes: int) -> bool:
        """Accepted by the compiler, and all the program needs within ``limit_bytes``."""
        return self.refused is None and self.total_bytes <= limit_bytes


def measure_step(trainer, batch: int) -> tuple[StepMemory, Any]:
    """``(memory, compiled)``: ``trainer``'s training step on global batches of ``batch`` rows,
    lowered on ``step_arguments`` (nothing is allocated) and compiled (``compile_measured``), and
    what one device needs for it; ``compiled`` is ``None`` when the compiler refused the step
    for memory. Any other failure raises."""
    start = time.perf_counter()
    lowered = trainer.train_step(batch).lower(*trainer.step_arguments(batch))
    try:
        compiled, heap = compile_measured(lowered)
    except Exception as error:  # noqa: BLE001  (a refusal for memory is an answer, not a failure)
        over = refused_for_memory(str(error))
        if over is None:
            raise
        needed, usable = over
        refused = str(error).strip().splitlines()[0]
        seconds = time.perf_counter() - start
        return StepMemory(needed, usable_bytes=usable, refused=refused, compile_s=seconds), None
    seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    return (
        StepMemory(
            total_bytes=program_bytes(memory, heap),
            argument_bytes=memory.argument_size_in_bytes,
            temp_bytes=heap,
            analysis_temp_bytes=memory.temp_size_in_bytes,
            compile_s=seconds,
        ),
        compiled,
    )


def device_memory_limit(device) -> int | None:
    """The bytes ``device`` lets a program use, as it reports them (``memory_stats()``'s
    ``bytes_limit``: TPUs and GPUs), or ``None`` where it reports none (CPU devices, and the
    compile-only devices of a slice this machine does not have: ``Target.usable_bytes``)."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001  (compile-only devices refuse the question)
        return None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None
