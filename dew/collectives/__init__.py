"""What a step sends between devices: one row per (collective, mesh axes), read from a program.

Two readers fill the same ``CollectiveReport`` (``report.py``), so two ways of writing a step
compare byte for byte:

- ``collectives(fn, *args)`` (``jaxpr.py``) traces ``fn`` (anything that uses ``jax.shard_map``,
  jitted or not) to a jaxpr and lists every collective in it, inside ``jit``, ``scan``, ``while``,
  ``cond``, ``checkpoint``, custom-derivative calls and nested ``shard_map`` alike.
- ``hlo_collectives(compiled, mesh)`` (``hlo.py``) reads the collectives XLA put in a compiled
  executable (the GSPMD baseline, where the partitioner invents the communication) and maps their
  replica groups back to mesh axes.
- ``hlo_overlap(compiled, mesh)`` (``overlap.py``) splits those bytes by what the scheduled HLO
  runs beside each collective: compute (overlapped) or nothing (exposed).

The names JAX and XLA give each collective are in one table, ``primitives.py``.

Calling the package calls its function: ``dew.collectives(fn, *args)`` is
``dew.collectives.collectives(fn, *args)``. The package and the function share the name
``dew.collectives``; had ``dew`` bound the function over the package instead, every import that
walks the attribute path would find a function where it needs a package (``import
dew.collectives.hlo as hlo``, ``monkeypatch.setattr("dew.collectives.jaxpr...")``).
"""

import sys
import types

from dew.collectives.hlo import hlo_collectives
from dew.collectives.jaxpr import collectives
from dew.collectives.overlap import hlo_overlap
from dew.collectives.primitives import OPS
from dew.collectives.report import CollectiveReport, CollectiveRow, format_bytes

__all__ = [
    "OPS",
    "CollectiveReport",
    "CollectiveRow",
    "collectives",
    "format_bytes",
    "hlo_collectives",
    "hlo_overlap",
]


class _CallablePackage(types.ModuleType):
    """The ``dew.collectives`` package, callable as its ``collectives`` function."""

    def __call__(self, fn, *args, **kwargs) -> CollectiveReport:
        """``collectives(fn, *args, **kwargs)``: the collectives one call of ``fn`` runs."""
        return collectives(fn, *args, **kwargs)


# Python's documented way to give a module behaviour of its own: set its class to a ModuleType
# subclass (https://docs.python.org/3/reference/datamodel.html#customizing-module-attribute-access).
sys.modules[__name__].__class__ = _CallablePackage
