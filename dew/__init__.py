"""Dew: train one JAX model across many devices, every byte between them an explicit collective.

``import dew`` imports no JAX: the public names load on first use (PEP 562 ``__getattr__``), so
the ``dew.*`` modules that need no JAX (``dew.cli``'s parsers: ``dew --help``, ``dew COMMAND
--help``) load without it. ``from dew import Trainer``, ``dew.Trainer`` and ``from dew import *``
work as before.
"""

import importlib as _importlib
import importlib.util as _importlib_util

from dew.quiet_libtpu import quiet_libtpu

# No libtpu start-up errors on a machine without a TPU: set before JAX starts a backend. Every
# ``dew.*`` import runs this module first, so this runs before any of Dew imports JAX.
quiet_libtpu()

# Each public name: the module it is defined in, and its name there (None: the module itself).
_PUBLIC = {
    "AXES": ("dew.mesh", "AXES"),
    "Checkpoints": ("dew.checkpoints", "Checkpoints"),
    "CollectiveReport": ("dew.collectives", "CollectiveReport"),
    # The package, callable as its function (dew/collectives/__init__.py).
    "collectives": ("dew.collectives", None),
    "Layout": ("dew.layout", "Layout"),
    "generate": ("dew.generation", "generate"),
    "load_checkpoint": ("dew.models.checkpoint", "load_checkpoint"),
    "MeshSpec": ("dew.mesh", "MeshSpec"),
    "StepOptions": ("dew.parallel.options", "StepOptions"),
    "TrainState": ("dew.training", "TrainState"),
    "Trainer": ("dew.training", "Trainer"),
    "models": ("dew.models", None),
}

__all__ = list(_PUBLIC)


def _load_public() -> None:
    """Imports every public name at once, as ``import dew`` did when it was eager: the modules
    they import along the way (``dew.training.step``, ``dew.objectives.lm``, ...) are then
    attributes of their packages, as code written for that ``import dew`` expects."""
    for name, (module_name, attribute) in _PUBLIC.items():
        module = _importlib.import_module(module_name)
        globals()[name] = module if attribute is None else getattr(module, attribute)


def __getattr__(name: str):
    """A public name (``_PUBLIC``), all of them imported on the first use of one; or the
    submodule ``dew.name`` no import has reached yet (``dew.data``), after the public names, so
    that its own submodules are there as the eager ``import dew`` left them
    (``dew.objectives.lm``). Importing a submodule by name (``import dew.targets``,
    ``from dew.cli import main``) never comes here, and imports only what that module does."""
    if name in _PUBLIC:
        _load_public()
        return globals()[name]
    if not name.startswith("_") and _importlib_util.find_spec(f"{__name__}.{name}") is not None:
        _load_public()
        return _importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
