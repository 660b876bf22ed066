"""The model's attention in the kernels' own layout: no transpose of q, k, v or the output around
the Mosaic kernels in the compiled TPU step, forward or backward (compiled for one v5e chip on
this CPU host with libtpu; nothing runs).

The q, k and v projections write ``[batch, heads, seq, head_dim]`` (``bse,ehd->bhsd``), the
rotation applies there and the output projection reads it (``bhsd,hde->bse``). In the compiled
HLO every array of attention's size then lies in memory in that order (its dimensions read from
major to minor by its layout: XLA renames dimensions in bitcasts, so the logical shape alone does
not say), and none is made by a ``copy`` or ``transpose``. At head_dim 64, the step that projected
to ``[batch, seq, heads, head_dim]`` (Dew before it took the kernels' layout) compiled a ``copy``
of each projection's output from ``[batch, heads, head_dim, seq]`` in memory into the kernels'
order, forward and backward. The step compiled here is on packed documents, so the Mosaic kernels
also take each row's segment ids there.
"""

import importlib.util
import re

import jax
import optax
import pytest

import dew
from dew.objectives.lm import LMObjective
from dew.targets import target

# Sizes whose attention arrays no other array of the step matches: rows, heads, seq, head_dim.
# Seq 128: the layout, not the length, is the subject (projected to [batch, seq, heads,
# head_dim] and rotated there, the step compiles the same two copies into the kernels' order at
# 128 as at 256), in a compile a quarter shorter.
ROWS, HEADS, SEQ, HEAD_DIM = 2, 4, 128, 64
INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = \w+\[([\d,]*)\]\{([\d,]*)[^}]*\} ([\w-]+)\(")


def attention_arrays(hlo: str):
    """``(name, sizes in memory from major to minor, opcode)`` of every instruction (fused ones
    included) whose result has attention's four sizes, in any order."""
    sizes = sorted((ROWS, HEADS, SEQ, HEAD_DIM))
    for line in hlo.splitlines():
        match = INSTRUCTION.match(line)
        if not match:
            continue
        name, shape, layout, opcode = match.groups()
        dims = tuple(int(x) for x in shape.split(",") if x)
        if sorted(dims) == sizes:
            minor_to_major = [int(x) for x in layout.split(",") if x]
            yield name, tuple(dims[i] for i in reversed(minor_to_major)), opcode


@pytest.mark.xdist_group("tpu")
@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="compiling for a TPU slice needs libtpu (pip install -e '.[tpu]')",
)
def test_no_transpose_sits_around_the_kernels_in_the_compiled_step():
    model = dew.models.build(
        "causal_transformer",
        vocab_size=128,
        emb_features=HEADS * HEAD_DIM,
        num_layers=1,
        num_heads=HEADS,
        max_seq_len=SEQ,
        dtype="bfloat16",
        attention_impl="pallas",
    )
    trainer = dew.Trainer(
        LMObjective(model, SEQ),
        optax.adamw(1e-3),
        jax.random.key(0),
        mesh=dew.MeshSpec(),
        devices=target("v5e-1").devices(),
    )
    # On packed documents: the kernels take the rows' segment ids, the rotation per-row positions.
    hlo = trainer.compiled_step(ROWS, documents=True).as_text()
    assert "dew_flash_attention_forward" in hlo and "dew_flash_attention_backward" in hlo
    arrays = list(attention_arrays(hlo))
    assert arrays, "no array of attention's size: the sizes do not match the model"
    moved = [a for a in arrays if a[2] in ("copy", "transpose")]
    assert not moved, f"copies or transposes of attention's arrays: {moved[:5]}"
    other = [a for a in arrays if a[1] != (ROWS, HEADS, SEQ, HEAD_DIM)]
    assert not other, f"attention's arrays in another order than the kernels': {other[:5]}"
