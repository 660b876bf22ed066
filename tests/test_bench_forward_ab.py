"""bench/forward_ab.py compiles each version of the forward on its own: JAX caches the traces of
flash_attention's inner functions, and without clearing them the second version compiled would
run the first one's kernel and every row would read "equal to the bit". And it times the kernel
alone: at head_dim 64 a program taking arrays in their default layout copies each into the
kernels' 128-lane tiling first."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from dew.kernels import mosaic_forward
from dew.targets import target

PATH = pathlib.Path(__file__).resolve().parent.parent / "bench" / "forward_ab.py"
spec = importlib.util.spec_from_file_location("bench_forward_ab", PATH)
forward_ab = importlib.util.module_from_spec(spec)
spec.loader.exec_module(forward_ab)


def test_the_other_version_runs_its_own_kernel(tmp_path):
    # A copy of the installed kernels folder is equal to the bit; a copy whose forward scales the
    # logits by 1.001 more is not (in TPU interpret mode, toy sizes, one call each).
    kernels = pathlib.Path(mosaic_forward.__file__).parent
    source = (kernels / "mosaic_forward.py").read_text()
    scaled = source.replace(
        "mosaic.dot(q, k, (1, 1)) * scale", "mosaic.dot(q, k, (1, 1)) * scale * 1.001"
    )
    assert scaled != source
    results = {}
    for name, text in (("same", source), ("scaled", scaled)):
        folder = shutil.copytree(kernels, tmp_path / name, ignore=shutil.ignore_patterns("*.pyc"))
        (folder / "mosaic_forward.py").write_text(text)
        out = tmp_path / f"{name}.jsonl"
        args = [str(folder), "--tiny", "--rows", "window", "--calls", "1"]
        assert forward_ab.main([*args, "--rounds", "1", "--json", str(out)]) == 0
        results[name] = json.loads(out.read_text())
    assert results["same"]["bit_equal"] is True, results
    assert results["scaled"]["bit_equal"] is False, results


@pytest.mark.xdist_group("tpu")
@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="compiling for a TPU slice needs libtpu (pip install -e '.[tpu]')",
)
def test_a_d64_row_compiles_to_the_kernel_alone_for_v5e():
    # GPT-2 small's row, a quarter of its batch, compiled for one v5e chip on this CPU host:
    # nothing but the kernel, and no temporaries of the inputs' size (taking them in the default
    # layout, the program copies q, k and v into the kernels' tiling and the output out of it:
    # 4 copies, 50 MB of temporaries).
    batch, heads, _, seq, head_dim, *_ = forward_ab.ROWS["gpt2-small"]
    row = (batch // 4, *forward_ab.ROWS["gpt2-small"][1:])
    mesh = jax.sharding.Mesh(target("v5e-1").devices(), ("x",))
    replicated = NamedSharding(mesh, PartitionSpec())
    x = jax.ShapeDtypeStruct((batch // 4, heads, seq, head_dim), jnp.bfloat16, sharding=replicated)
    with jax.set_mesh(mesh):
        compiled = forward_ab.compile_with(mosaic_forward, row, (x, x, x, None), interpret=None)
    hlo = compiled.as_text()
    assert "dew_flash_attention_forward" in hlo
    copies = [line.strip()[:120] for line in hlo.splitlines() if " copy(" in line]
    assert not copies, copies
    one_input = x.size * 2
    assert compiled.memory_analysis().temp_size_in_bytes < one_input / 4
