"""The numbers the guides print, from their commands run as the guides give them (issue 52: the
sample output of docs/getting-started.md went stale while the code moved on).

docs/getting-started.md trains with ``dew train`` (fully sharded over 8 simulated CPU devices, the
defaults on a machine without an accelerator), then resumes the run in another
layout, and shows what each command printed. Both run here as a user runs them, in an empty
folder, the command line read from the guide: the first by ``main`` in this process (its 8 CPU
devices are the command's; a child process would import JAX again), the resume in a fresh
``python -m dew`` process, so that it has only what the first run left on disk. Every line the
guide shows is compared with the line printed, in order:

- the losses, gradient norms and learning rates to the printed digit: they are deterministic, the
  same on any machine and in any layout (the guide says so);
- the header, the devices and mesh line with the state a device holds, the phases before the first
  step, the mesh and the resume lines word for word (where the guide shortens with ``…``, as a path
  ``/…/runs``, the host's memory or a phase's seconds, anything matches);
- the step times, tokens/s and the goodput by their form alone: they are the machine's.

docs/metrics.md's JSON line is step 20 of the same run: its loss, gradient norm and learning rate
are compared with the printed ones. One run of the guide's two commands (40 steps of the example
decoder, two compiles) is all this costs; the same run checks that a resume keeps the run's
corpus, and that another ``--batch`` cannot resume it.
"""

import json
import re
import shlex
from pathlib import Path

from tests.helpers import parse_log_line
from tests.test_cli import dew

DOCS = Path(__file__).resolve().parents[1] / "docs"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
GOODPUT = re.compile(r"Goodput: first step after \d+\.\d\d s, \d+\.\d% of the wall time in steps")


def documented_runs(text: str) -> list[tuple[str, list[str]]]:
    """``(command, the lines it printed)`` for each ``dew train`` command of ``text``'s bash
    blocks that shows its output: the plain block right after it, or its block's ``# `` comment
    lines after it."""
    blocks = [(m.group(1), m.group(2).splitlines()) for m in FENCE.finditer(text)]
    runs = []
    for i, (language, lines) in enumerate(blocks):
        if language != "bash":
            continue
        for j, line in enumerate(lines):
            command = line.split("  #")[0].strip()
            if not command.startswith("dew train"):
                continue
            comments = [c.removeprefix("# ") for c in lines[j + 1 :] if c.startswith("# ")]
            if comments:
                runs.append((command, comments))
            elif i + 1 < len(blocks) and blocks[i + 1][0] == "":
                runs.append((command, blocks[i + 1][1]))
    return runs


def assert_printed_as_documented(documented: list[str], printed: list[str]) -> None:
    """Each documented line against the printed line in its place (see the module's docstring);
    the same number of lines."""
    assert len(printed) == len(documented), (documented, printed)
    for want, got in zip(documented, printed):
        if ": loss " in want:
            want_numbers, got_numbers = parse_log_line(want), parse_log_line(got)
            for field in ("step", "loss", "grad_norm", "lr", "mfu"):
                assert got_numbers[field] == want_numbers[field], (field, want, got)
        elif want.startswith("Goodput:"):
            assert GOODPUT.fullmatch(got), (want, got)
        else:
            pattern = ".*".join(re.escape(part) for part in want.split("…"))
            assert re.fullmatch(pattern, got), (want, got)


def test_getting_started_prints_what_it_says_and_metrics_md_agrees(tmp_path, dew_here):
    runs = documented_runs((DOCS / "getting-started.md").read_text())
    assert [command for command, _ in runs] == [
        "dew train",
        "dew train --mesh data=2,fsdp=4 --steps 40",
    ], runs
    printed = {}  # step -> its log line's numbers, over both runs
    for (command, documented), how in zip(runs, (dew_here, dew)):
        run = how(*shlex.split(command)[1:], cwd=tmp_path)
        assert run.returncode == 0, run.stderr[-3000:]
        lines = run.stdout.splitlines()
        assert_printed_as_documented(documented, lines)
        numbers = [parse_log_line(line) for line in lines if ": loss " in line]
        printed.update((n["step"], n) for n in numbers)
    assert (tmp_path / "runs" / "dew-train" / "corpus" / "meta.json").exists()

    # docs/metrics.md: "step 20 of `dew train --mesh fsdp=8 ...`", one JSON line.
    metrics_md = (DOCS / "metrics.md").read_text()
    (sample,) = [body for language, body in FENCE.findall(metrics_md) if language == "json"]
    line = json.loads(sample)
    step = printed[line["step"]]
    # Shortened to the digits the log line prints, and every digit shown compared.
    shown = tuple(str(line[field]) for field in ("loss", "grad_norm", "lr"))
    assert shown == (step["loss"], step["grad_norm"], step["lr"]), (line, step)

    # Another batch cannot resume the run: the data's order of batches is the batch's. The error
    # says which flag, the run's value, and the two ways on (in this process: nothing compiles).
    other = dew_here("train", "--steps", "50", "--batch", "32", cwd=tmp_path)
    assert other.returncode == 2, other.stdout
    assert "compiling the step..." not in other.stdout, other.stdout  # refused before it
    assert other.stderr.splitlines() == [
        "dew train: the run in runs/dew-train was trained with --batch 16, and this command "
        "gives --batch 32: give --batch 16 to resume it, or another --run-dir to start a new run"
    ]
