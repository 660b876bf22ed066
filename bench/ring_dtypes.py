"""``dew plan``, and for each step it compiles the ``ppermute`` bytes by dtype, read from the
compiled HLO as ``dew plan`` reads its wire bytes (``dew.collectives.hlo_collectives``: each
collective-permute counted once per run of the loop around it).

    python bench/ring_dtypes.py --target v5e-8 --model llama-3.2-1b --mesh fsdp=2,tensor=4 \\
        --sequence-parallel --quantize int8 --tensor-scheme plain ring

takes ``dew plan``'s flags and prints its lines and table, with one more line a step:
``ppermute over (axes): DTYPE B (n calls)`` per dtype, from which the int8 tensor rings' bytes
(``dew.parallel.tensor_ring``: the entries' inputs and the exits' output gradients travel as
int8) are told from the float ones.
"""

from __future__ import annotations

import sys

from dew.collectives import hlo
from dew.collectives import tally as tallies_module
from dew.collectives.report import ring_wire_bytes


def _by_dtype(tallies, op, axes, n, operand_bytes, shapes, moves=True, approximate=False):
    """``tally.add_call``, a ``ppermute`` tallied under ``ppermute[DTYPE]`` (the dtype of its
    operand's shape text, ``s8[2,128,2052]``)."""
    if op == "ppermute":
        dtype = shapes.lstrip("(").split("[")[0]
        t = tallies.setdefault((f"ppermute[{dtype}]", axes), tallies_module.Tally())
        t.count += 1
        t.operand_bytes += operand_bytes
        t.wire_bytes += ring_wire_bytes(op, n, operand_bytes, moves)
        t.approximate |= approximate
        t.shapes.add(shapes)
        return
    tallies_module.add_call(tallies, op, axes, n, operand_bytes, shapes, moves, approximate)


def _patched():
    import dew.collectives

    plain = dew.collectives.hlo_collectives

    def with_dtypes(compiled, mesh):
        report = plain(compiled, mesh)
        hlo.add_call = _by_dtype
        try:
            split = plain(compiled, mesh)
        finally:
            hlo.add_call = tallies_module.add_call
        for row in split.rows:
            if row.op.startswith("ppermute["):
                axes = ",".join(row.axes)
                print(
                    f"  {row.op} over ({axes}): {row.operand_bytes:,} B in {row.count} calls "
                    f"({row.operand_bytes / 2**20:,.1f} MiB)",
                    flush=True,
                )
        return report

    dew.collectives.hlo_collectives = with_dtypes


def main(argv: list[str]) -> int:
    _patched()
    from dew.cli.main import main as dew_main

    return dew_main(["plan", *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
