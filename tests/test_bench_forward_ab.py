"""bench/forward_ab.py compiles each version of the forward on its own: JAX caches the traces of
flash_attention's inner functions, and without clearing them the second version compiled would
run the first one's kernel and every row would read "equal to the bit"."""

from __future__ import annotations

import importlib.util
import json
import pathlib

from dew.kernels import mosaic_forward

PATH = pathlib.Path(__file__).resolve().parent.parent / "bench" / "forward_ab.py"
spec = importlib.util.spec_from_file_location("bench_forward_ab", PATH)
forward_ab = importlib.util.module_from_spec(spec)
spec.loader.exec_module(forward_ab)


def test_the_other_version_runs_its_own_kernel(tmp_path):
    # The installed file against itself is equal to the bit; a copy whose logits are scaled by
    # 1.001 more is not (in TPU interpret mode, toy sizes, one call each).
    source = pathlib.Path(mosaic_forward.__file__).read_text()
    scaled = source.replace(
        "mosaic.dot(q, k, (1, 1)) * scale", "mosaic.dot(q, k, (1, 1)) * scale * 1.001"
    )
    assert scaled != source
    results = {}
    for name, text in (("same", source), ("scaled", scaled)):
        (tmp_path / f"{name}.py").write_text(text)
        out = tmp_path / f"{name}.jsonl"
        args = [str(tmp_path / f"{name}.py"), "--tiny", "--rows", "window", "--calls", "1"]
        assert forward_ab.main([*args, "--rounds", "1", "--json", str(out)]) == 0
        results[name] = json.loads(out.read_text())
    assert results["same"]["bit_equal"] is True, results
    assert results["scaled"]["bit_equal"] is False, results
