"""The collective tables of docs/ (collectives.md, design.md, distributed.md), from the ``dew
collectives`` command each is shown for (issue 67: every block that shows a command's printed
numbers is produced by a test).

A table is a plain block whose first line is ``op ...`` or ``Collectives of one ...``; its command
is the last ```dew collectives ...``` in the text since the block before it, or, for a
paragraph that opens ``With `--flag ...` ``, the table before it's command with those flags. Each
runs by ``main`` in this process (its 8 CPU devices are the command's; the step is traced, not
compiled), and the table must be lines of what it printed, in a row, as shown: counts and bytes to
the digit (they are the jaxpr's, the same on any machine).
"""

import re
import shlex
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
TABLE = re.compile(r"(op |Collectives of one )")


def tables(name: str) -> list[tuple[str, list[str]]]:
    """``(command, the table's lines)`` of each collective table of docs/``name``."""
    text = (DOCS / name).read_text()
    found, end, command = [], 0, None
    for m in FENCE.finditer(text):
        before, end = text[end : m.start()], m.end()
        if m.group(1) or not TABLE.match(m.group(2)):
            continue
        prose = " ".join(before.split())  # a command's inline code may span a line break
        given = re.findall(r"`(dew collectives [^`]*)`", prose)
        if given:
            command = given[-1]
        elif (more := re.match(r"With `(--[^`]*)`", prose)) and command:
            command = f"{command} {more.group(1)}"
        else:
            raise AssertionError(f"docs/{name}: no dew collectives command before {m.group(2)!r}")
        found.append((command, m.group(2).splitlines()))
    return found


NAMES = sorted(str(path.relative_to(DOCS)) for path in DOCS.rglob("*.md"))
CASES = [(name, *table) for name in NAMES for table in tables(name)]


def test_the_docs_show_their_tables():
    # The tables found, so that one the parsing misses cannot go untested unnoticed.
    assert [(name, command) for name, command, _ in CASES] == [
        ("collectives.md", "dew collectives --mesh tensor=4"),
        ("collectives.md", "dew collectives --mesh tensor=4 --sequence-parallel"),
        ("collectives.md", "dew collectives --mesh sequence=4"),
        ("collectives.md", "dew collectives --mesh sequence=4 --sequence-scheme all_to_all"),
        ("collectives.md", "dew collectives --mesh stage=4,microbatches=8 --layers 4"),
        ("design.md", "dew collectives --mesh fsdp=8"),
        ("distributed.md", "dew collectives --mesh tensor=2"),
        ("distributed.md", "dew collectives --mesh tensor=2 --sequence-parallel"),
        (
            "distributed.md",
            "dew collectives --mesh tensor=4 --tensor-scheme ring --sequence-parallel",
        ),
        ("distributed.md", "dew collectives --mesh sequence=4 --seq-len 32"),
        (
            "distributed.md",
            "dew collectives --mesh sequence=4 --seq-len 32 --sequence-scheme all_to_all",
        ),
    ]


@pytest.mark.parametrize("name, command, shown", CASES, ids=[f"{n}: {c}" for n, c, _ in CASES])
def test_a_collectives_table_is_what_its_command_prints(name, command, shown, dew_here, tmp_path):
    run = dew_here(*shlex.split(command)[1:], cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    printed = [line.rstrip() for line in run.stdout.splitlines()]
    shown = [line.rstrip() for line in shown]
    starts = [i for i, line in enumerate(printed) if line == shown[0]]
    assert any(printed[i : i + len(shown)] == shown for i in starts), (
        f"docs/{name} shows\n" + "\n".join(shown) + f"\nand {command} printed\n" + run.stdout
    )
