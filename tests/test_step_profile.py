"""bench/step_profile.py's reading of compiled HLO: every instruction's opcode and shape (tuples
of tiled shapes included) and the line of Python each came from, through the stack-frame tables."""

from __future__ import annotations

import importlib.util
import inspect
import pathlib

import jax
import jax.numpy as jnp
from jax import lax

PATH = pathlib.Path(__file__).resolve().parent.parent / "bench" / "step_profile.py"
spec = importlib.util.spec_from_file_location("step_profile", PATH)
step_profile = importlib.util.module_from_spec(spec)
spec.loader.exec_module(step_profile)


def line_of(function, text: str) -> int:
    """The file line of the first line of ``function``'s source holding ``text``."""
    lines, first = inspect.getsourcelines(function)
    return first + next(i for i, line in enumerate(lines) if text in line)


def inner(x):
    return jnp.sin(x) * 2.0


def outer(x):
    return lax.fori_loop(0, 3, lambda i, y: inner(y) + 1.0, x)


def test_instructions_and_the_lines_they_came_from():
    hlo = jax.jit(outer).lower(jnp.ones((8, 128))).compile().as_text()
    instructions = step_profile.hlo_instructions(hlo)
    frames = step_profile.stack_frames(hlo)

    sines = [i for i in instructions.values() if i["op_name"].endswith("/sin")]
    assert sines, "no sine in the compiled HLO"
    chain = frames[sines[0]["frame"]]
    here = pathlib.Path(__file__).name
    # Innermost first: the sine's own line, then the loop body's call of inner, then outer's loop.
    assert chain[0] == f"{here}:inner:{line_of(inner, 'jnp.sin')}", chain
    assert chain[1] == f"{here}:<lambda>:{line_of(outer, 'fori_loop')}", chain
    assert chain[2] == f"{here}:outer:{line_of(outer, 'fori_loop')}", chain

    # The loop: its shape a tuple (whose parts hold parentheses of their own on a TPU), its opcode
    # read past it.
    loops = [(name, i) for name, i in instructions.items() if i["what"] == "while"]
    assert loops, sorted({i["what"] for i in instructions.values()})
    assert all(i["shape"].startswith("(") and i["shape"].endswith(")") for _, i in loops)


def test_a_tpu_shape_with_tiles_parses():
    line = (
        "  %while.10 = (s32[]{:T(128)}, bf16[16,1024,768]{2,1,0:T(8,128)(2,1)S(1)}) "
        'while(%tuple.172), condition=%cond, body=%body, metadata={op_name="jit(step)/while" '
        "stack_frame_id=7}"
    )
    found = step_profile.hlo_instructions(line)["while.10"]
    assert found["what"] == "while"
    assert found["shape"] == "(s32[]{:T(128)}, bf16[16,1024,768]{2,1,0:T(8,128)(2,1)S(1)})"
    assert found["frame"] == 7 and found["op_name"] == "jit(step)/while"
