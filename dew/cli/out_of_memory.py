"""A step that does not fit the device's memory, as one line of the ``dew`` command.

The TPU compiler checks a program against the chip's memory while it compiles it and refuses one
that does not fit; JAX raises that refusal from the step's first call as a ``JaxRuntimeError``
(on a v5e chip, 2026-12-06, ``dew train --cpu-devices 0 --model gpt2-small --batch 44 --seq-len
1024``: ``RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO
temporaries (16.00G) exceeds available HBM (15.75G).``, at the end of a 20-line traceback). A
step that compiles can still fail to allocate while it runs (``Attempting to allocate 9.20G``).
``dew.cli.main`` prints ``out_of_memory_line`` for either, from any command that compiles a step
(``train``, ``collectives``, ``bench``, ``plan``), and exits 2 as for any other user error.

The figures are read the way ``dew bench`` reads them for a contestant that does not fit
(``dew.benchmark.measure.figures_in``, over ``dew.training.step_memory.refused_for_memory``).
"""

from __future__ import annotations

import argparse

# dew plan's flags the suggested command leaves out: the search chooses the layout and the
# recompute policy itself (with --mesh it would search only the layouts given, and it keeps a
# --remat it is given fixed).
_SEARCH_CHOOSES = ("--target", "--search", "--mesh", "--remat", "--engines")


def plan_flags(argv: list[str]) -> list[str]:
    """The flags of ``argv`` (a ``dew`` command line, the command first) that ``dew plan`` also
    takes, with their values, as typed: the model's sizes and choices, the batch and the length,
    less those ``dew plan --search`` chooses itself."""
    from dew.cli import plan

    known = plan.add_parser(argparse.ArgumentParser().add_subparsers())._option_string_actions
    kept, keeping = [], False
    for token in argv[1:]:
        if token.startswith("--"):
            name = token.split("=", 1)[0]
            keeping = name in known and name not in _SEARCH_CHOOSES
        elif token.startswith("-") and not _is_number(token):
            keeping = False  # a short flag (-h): none is a size
        if keeping:
            kept.append(token)
    return kept


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def tpu_target_name() -> str | None:
    """The Cloud TPU type of this run's devices (``"v5e-8"``: the generation whose
    ``device_kind`` they report, every device of the run counted), or ``None`` off a TPU or for
    a count that is no slice ``dew plan`` knows."""
    import jax

    from dew import targets

    kind = jax.devices()[0].device_kind
    for generation in targets.GENERATIONS.values():
        if kind.lower() == generation.device_kind.lower():
            name = f"{generation.name}-{jax.device_count() * generation.cores_per_chip}"
            try:
                targets.target(name)
            except ValueError:
                return None
            return name
    return None


def model_field(args, name: str):
    """The field ``name`` of the model a command's parsed ``args`` build (the model's own default
    where the flags and preset leave it); ``None`` for a command that builds no model."""
    from dew.cli.model_flags import model_config
    from dew.models.causal_transformer import CausalTransformer

    if not hasattr(args, "example_model"):  # a command that builds no model (or no args)
        return None
    try:
        return model_config(args).get(name, getattr(CausalTransformer, name))
    except ValueError:
        return None


def out_of_memory_line(error: BaseException, argv: list[str], args=None) -> str | None:
    """One line for ``error`` when it is XLA saying a step does not fit the device's memory
    (``dew.benchmark.measure.out_of_memory``): what the step needs, what the device has, and
    what would fit (``dew plan --search`` with this command's model flags, on a TPU; the flags
    that shrink a step: ``--layer-loop scan`` first where ``args``, the command's parsed flags,
    build a model whose layers are unrolled, and ``--remat auto`` unless its policy is already
    ``full`` or ``auto``). ``None`` for any other error."""
    import jax

    from dew.benchmark.measure import bytes_text, device_memory, figures_in, out_of_memory
    from dew.training.step_memory import refused_for_memory

    if not out_of_memory(error):
        return None
    message = str(error)
    needed, available = figures_in(message)
    if refused_for_memory(message) is not None:
        what = (
            f"the step needs {bytes_text(needed)} per device and the compiler lets a program use "
            f"{bytes_text(available)} of the device's memory (it refused the step)"
        )
    else:
        device = device_memory(jax.devices()[0])
        what = "the step ran out of device memory" + (
            "" if needed is None else f": it could not allocate {bytes_text(needed)}"
        )
        what += "" if device is None else f" on a device of {bytes_text(device)}"
    fixes = ["a smaller --batch (--accumulation K keeps the batch)", "more devices"]
    if model_field(args, "remat") not in ("full", "auto"):  # "full" already keeps the least
        fixes.insert(0, "--remat auto (the least recomputation that fits)")
    if model_field(args, "layer_loop") == "unroll":  # XLA may keep what remat would recompute
        fixes.insert(0, "--layer-loop scan")
    fixes = "use " + ", ".join(fixes[:-1]) + " or " + fixes[-1]
    target = tpu_target_name()
    if target is not None:
        plan = " ".join(["dew plan --target", target, "--search", *plan_flags(argv)])
        fixes = f"`{plan}` compiles the layouts and recompute policies and says which fit; or " + (
            fixes
        )
    return f"{what}; {fixes}"
