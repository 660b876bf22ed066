"""bench/forward_ab.py compiles each version of the forward on its own: JAX caches the traces of
flash_attention's inner functions, and without clearing them the second version compiled would
run the first one's kernel and every row would read "equal to the bit"."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import shutil

from dew.kernels import mosaic_forward

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
