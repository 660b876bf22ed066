"""Runs the user's example notebook (less its %pip line) and checks the lines it prints.

The notebook is the user's, kept beside the repository (``../shared/spec/``) on the machines this
project is built on; it is not part of a clone, so these tests skip where it is absent.
``DEW_NOTEBOOK=path/to/scale-across-devices.ipynb`` points them at a copy elsewhere. The project's
own example, which every clone runs, is ``docs/examples/scale_across_devices.py``
(tests/test_example.py).
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import child_env

NOTEBOOK = Path(
    os.environ.get("DEW_NOTEBOOK")
    or Path(__file__).resolve().parents[2] / "shared" / "spec" / "scale-across-devices.ipynb"
)


def _code_only(line: str) -> str:
    """The line without string literals and comments (enough to count brackets and find a colon)."""
    line = re.sub(r"(?s)(\"\"\"|\'\'\'|\"|\')(?:\\.|(?!\1).)*\1", "''", line)
    return line.split("#", 1)[0]


def restore_indentation(source: str) -> str:
    """The stored notebook's indentation was collapsed to one space per line, whatever its depth
    (a loop inside a function reads ``def f():\\n x = 1\\n for a in b:\\n print(a)``). Rebuild
    four-space indentation: the line after a block opener goes one level deeper than the opener; a
    line indented like the line above stays at its level; a smaller indentation closes blocks. Lines
    inside brackets keep their text. Ambiguous cases (a block closing back to a non-zero indent) do
    not occur here, and the result is compiled before it runs.
    """
    out, stack, opener, depth = [], [(0, 0)], None, 0
    for line in source.splitlines():
        if not line.strip() or depth > 0:
            out.append(line)
        else:
            raw = len(line) - len(line.lstrip(" "))
            if opener is not None:
                level = opener + 1
                stack.append((raw, level))
            else:
                while stack and stack[-1][0] > raw:
                    stack.pop()
                level = stack[-1][1] if stack else 0
            out.append("    " * level + line.lstrip(" "))
            opener = None
        code = _code_only(line)
        depth += sum(code.count(c) for c in "([{") - sum(code.count(c) for c in ")]}")
        if depth == 0 and line.strip() and code.rstrip().endswith(":"):
            opener = (len(out[-1]) - len(out[-1].lstrip(" "))) // 4
    return "\n".join(out)


def notebook_script() -> str:
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    code = [
        "\n".join(line for line in cell.splitlines() if not line.lstrip().startswith("%"))
        for cell in code
    ]
    script = restore_indentation("\n\n".join(code)) + "\n"
    compile(script, str(NOTEBOOK), "exec")
    return script


# One worker runs every test of this module: its module fixture runs a costly subprocess once.
pytestmark = pytest.mark.xdist_group("notebook")


@pytest.fixture(scope="module")
def printed(tmp_path_factory):
    if not NOTEBOOK.is_file():
        pytest.skip(
            f"the user's notebook is not at {NOTEBOOK}: it lives outside the repository, and a "
            "clone has none (set DEW_NOTEBOOK to a copy of scale-across-devices.ipynb to run it)"
        )
    work = tmp_path_factory.mktemp("notebook")
    (work / "notebook.py").write_text(notebook_script())
    env = child_env()
    env["PYTHONPATH"] = (
        str(Path(__file__).resolve().parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
    )
    run = subprocess.run(
        [sys.executable, "notebook.py"],
        check=False,
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    return run.stdout, work


def losses(text: str) -> list[tuple[int, str]]:
    found = re.findall(r"^step (\d+): loss (\d+\.\d{4}), ", text, re.MULTILINE)
    return [(int(step), loss) for step, loss in found]


def test_meshes_and_placement(printed):
    out, _ = printed
    assert (
        "data parallel: {'data': 8, 'expert': 1, 'fsdp': 1, 'tensor': 1, 'sequence': 1, 'stage': 1}"
        in out
    )
    assert (
        "fully sharded: {'data': 1, 'expert': 1, 'fsdp': 8, 'tensor': 1, 'sequence': 1, 'stage': 1}"
        in out
    )
    assert "data parallel P()\n" in out
    assert "fully sharded P('fsdp',)\n" in out
    assert "training windows: 2987\n" in out


def test_both_layouts_train_to_the_same_losses(printed):
    out, _ = printed
    runs = out.split("Training from step ")
    assert (
        runs[1].startswith("0 to 20 on {'data': 8, 'expert': 1, 'fsdp': 1,")
        and "(1 process(es))" in runs[1]
    )
    assert runs[2].startswith("0 to 20 on {'data': 1, 'expert': 1, 'fsdp': 8,")
    replicated, sharded = losses(runs[1]), losses(runs[2])
    assert [s for s, _ in replicated] == [10, 20]
    assert replicated == sharded
    assert float(replicated[1][1]) < float(replicated[0][1]) < 5.6  # it learns (ln 256 = 5.55)
    goodput = re.findall(
        r"^Goodput: first step after \d+\.\d\d s, \d+\.\d% of the wall time in steps$", out, re.M
    )
    assert len(goodput) == 3


def test_shard_descriptions(printed):
    out, _ = printed
    assert "spec: P()\n cpu:0: rows slice(None, None, None), local shape (256, 64)\n" in out
    assert " cpu:2: rows slice(None, None, None), local shape (256, 64)\n" in out
    sharded = (
        "spec: P('fsdp',)\n cpu:0: rows slice(0, 32, None), local shape (32, 64)\n"
        " cpu:1: rows slice(32, 64, None), local shape (32, 64)\n"
        " cpu:2: rows slice(64, 96, None), local shape (32, 64)\n"
    )
    assert out.count(sharded) == 2  # the sharded run, and the state restored into fsdp 8


def test_checkpoint_moves_between_layouts(printed):
    out, work = printed
    directory = (work / "runs" / "07-scaling" / "replicated").resolve()
    assert out.count(f"Resumed from step 20 in {directory}\n") == 2  # place(), then fit()
    assert "restored weights equal the data-parallel run's: True\n" in out
    runs = out.split("Training from step ")
    assert runs[3].startswith("20 to 30 on {'data': 1, 'expert': 1, 'fsdp': 8,")
    assert [s for s, _ in losses(runs[3])] == [30]
    assert out.rstrip().endswith("continued to step 30")
