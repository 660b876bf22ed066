"""The phases before a run's first step, reported as they happen (issue 67: nothing moved for 93 s
while the 1B compiled): a live line on a terminal, plain lines elsewhere; and ``fit``'s own
phases, with a step ``compile_step`` compiled ahead not compiled again."""

import io
import logging
import re
import time

import jax
import optax
import pytest

from dew import MeshSpec, Trainer
from dew.data import TokenWindows
from dew.training.progress import Progress
from tests.helpers import SEQ, VOCAB, parse_log_line, random_token_folder, tiny_objective


def clock(*times):
    """A clock that reads ``times`` in turn."""
    readings = iter(times)
    return lambda: next(readings)


def test_plain_lines_where_the_output_is_not_a_terminal():
    out = io.StringIO()  # not a terminal: isatty() is False
    progress = Progress(out, clock=clock(10.0, 22.34))
    assert not progress.live
    with progress.phase("compiling the step", "compiled the step"):
        assert out.getvalue() == "compiling the step...\n"  # said as the phase starts
    assert out.getvalue() == "compiling the step...\ncompiled the step in 12.3 s\n"


def test_a_live_line_on_a_terminal_redrawn_until_the_phase_ends():
    out = io.StringIO()
    progress = Progress(out, live=True, interval=0.02)
    with progress.phase("reading the checkpoint", "read the checkpoint"):
        time.sleep(0.25)
    text = out.getvalue()
    # Redrawn in place (a carriage return, no newline) with the time so far, then replaced by
    # the phase's end, blanked out to the longest line drawn.
    *drawn, last = text.split("\r")[1:]
    assert len(drawn) >= 4, text
    assert all(re.fullmatch(r"reading the checkpoint\.\.\. \d+\.\d s", d) for d in drawn), text
    assert [float(d.split()[-2]) for d in drawn] == sorted(float(d.split()[-2]) for d in drawn)
    assert re.fullmatch(r"read the checkpoint in 0\.[2-9] s +\n", last), text
    assert len(last) - 1 >= max(map(len, drawn))
    time.sleep(0.1)
    assert out.getvalue() == text  # the thread has stopped


def test_a_phase_that_raises_ends_its_line_and_says_nothing_more():
    for live, printed in ((False, "compiling the step...\n"), (True, None)):
        out = io.StringIO()
        with pytest.raises(ValueError, match="too big"):
            with Progress(out, live=live, interval=10).phase("compiling the step", "compiled"):
                raise ValueError("too big")
        if printed is not None:
            assert out.getvalue() == printed
        else:
            assert out.getvalue() == "\rcompiling the step... 0.0 s\n"


@pytest.fixture
def tiny_run(tmp_path, seed):
    random_token_folder(tmp_path / "tokens", seed, train=64 * (SEQ + 1), val=0)
    data = TokenWindows(tmp_path / "tokens", seq_len=SEQ).load(batch=8)
    trainer = Trainer(
        tiny_objective(vocab_size=VOCAB),
        optax.adamw(1e-3),
        key=jax.random.key(seed),
        mesh=MeshSpec(fsdp=8),
    )
    return trainer, data


# JAX's log of a step compiled, or read back from the suite's compilation cache.
STEP_COMPILED = re.compile(
    r"Finished XLA compilation of jit\(step\)|Persistent compilation cache hit for 'jit_step'"
)


def _step_compiles(records) -> int:
    return sum(bool(STEP_COMPILED.match(r.getMessage())) for r in records)


def test_fit_reports_its_phases_and_a_step_compiled_ahead_is_not_compiled_again(
    tiny_run, capsys, caplog
):
    trainer, data = tiny_run
    out = io.StringIO()
    progress = Progress(out)
    with caplog.at_level(logging.DEBUG), jax.log_compiles(True):
        trainer.compile_step(data, progress)
        capsys.readouterr()
        trainer.fit(data, steps=2, log_every=1, progress=progress)
    assert _step_compiles(caplog.records) == 1, [r.getMessage()[:80] for r in caplog.records]
    lines = out.getvalue().splitlines()
    assert lines[0] == "compiling the step..." and lines[1].startswith("compiled the step in ")
    assert lines[2:3] == ["initializing the weights..."], lines
    assert re.fullmatch(r"initialized the weights in \d+\.\d s", lines[3]), lines
    assert len(lines) == 4, lines  # fit did not compile the step
    # fit's own lines are as they were: the step lines and the goodput line.
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("Training from step 0 to 2 on "), printed
    assert [line.split(":")[0] for line in printed[1:]] == ["step 1", "step 2", "Goodput"]
    # The first step's line says its time is the compiled step's first run, not a compile.
    assert parse_log_line(printed[1])["first"] == "compiled ahead, includes warm-up", printed


def test_fit_compiles_the_step_as_a_phase_and_says_nothing_without_progress(tiny_run, capsys):
    trainer, data = tiny_run
    out = io.StringIO()
    trainer.fit(data, steps=1, progress=Progress(out))
    lines = out.getvalue().splitlines()
    assert lines[0] == "initializing the weights..." and lines[2] == "compiling the step..."
    assert re.fullmatch(r"compiled the step in \d+\.\d s", lines[3]), lines
    # A second run resumes nothing (no checkpoints) and reports nothing without progress: the
    # library prints what it printed before (the user's notebook compares its lines).
    capsys.readouterr()
    trainer.fit(data, steps=1)
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("Training from step 0 to 1 on "), printed
    assert not any(line.startswith(("compil", "initializ")) for line in printed), printed


@pytest.mark.parametrize("base_dtype", ["int8", None])
def test_placing_a_lora_base_is_a_phase_that_says_whether_it_quantizes(base_dtype):
    # The base read from a Hugging Face folder (and quantized as it is placed: issue 67's 298 s of
    # silence for the 8B int8 LoRA run) as a phase of its own.
    from dew.models import hf, lora
    from dew.objectives.lm import LMObjective
    from tests.lora_reference import HF_BASE

    adapters = lora.Lora(rank=4, base_dtype=base_dtype)
    model = hf.model_from_config(hf.read_config(HF_BASE), str(HF_BASE), lora=adapters)
    trainer = Trainer(
        LMObjective(model, 40),
        optax.adamw(1e-3),
        jax.random.key(0),
        mesh=MeshSpec(fsdp=8),
        base=HF_BASE,
    )
    out = io.StringIO()
    trainer.place(Progress(out))
    doing = "reading the frozen base" + (", quantized to int8" if base_dtype else "")
    lines = out.getvalue().splitlines()
    assert lines[0] == doing + "...", lines
    assert re.fullmatch(r"read the frozen base in \d+\.\d s", lines[1]), lines
