"""Microbenchmarks of the training step per layout and engine, and checks of ``dew bench``'s parts.

    python -m pytest bench/test_layouts.py --benchmark-enable

The default test run collects this file too, with the timing disabled (``--benchmark-disable`` in
pyproject.toml): each benchmark then runs its step once, and the checks still hold. Each benchmark
times one step of a small model (2 layers, width 64, batch 16 x 32 tokens) on 8 simulated CPU
devices, and records the step's wire bytes, train state and temporary memory per device in
``extra_info`` (kept by ``--benchmark-json``). Compare layouts and engines from one run only: the
machines are shared.
"""

import json
import os

# Eight simulated CPU devices, before JAX starts (tests/conftest.py does the same for tests/).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from dew import benchmark  # noqa: E402
from dew.cli import main as cli  # noqa: E402
from dew.mesh import MeshSpec  # noqa: E402

if jax.device_count() != 8:
    pytest.skip(
        f"needs 8 devices, JAX started with {jax.device_count()} (set XLA_FLAGS="
        "--xla_force_host_platform_device_count=8 before JAX starts)",
        allow_module_level=True,
    )

SMALL = benchmark.ModelSize(layers=2, width=64, heads=4, seq_len=32, batch=16)
MIN_SHARD = 1024  # at this size the default 65536 would keep every weight whole
LAYOUTS = ("data=8", "fsdp=8", "data=2,fsdp=4")
ENGINES = ("shard_map", "gspmd")


@pytest.fixture(scope="module")
def objective():
    return SMALL.objective()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_step(benchmark, objective, layout, engine):
    contestant = benchmark_contestant(objective, layout, engine)
    benchmark.extra_info.update(
        layout=contestant.layout,
        engine=engine,
        compile_s=contestant.compile_s,
        wire_bytes=contestant.report.wire_bytes(),
        collectives=contestant.report.count(),
        state_bytes_per_device=contestant.state_bytes,
        temp_bytes_per_device=contestant.temp_bytes,
    )
    # Between turns the state is parked in host memory (NumPy arrays).
    before = contestant.parked.tree().params
    calls = []

    def one_step():
        calls.append(1)
        return contestant.run(1)

    benchmark.pedantic(one_step, rounds=5, warmup_rounds=1)
    # What was timed is a training step: each call advanced the step count and moved the weights.
    after = contestant.parked.tree()
    assert calls and int(after.step) == len(calls)
    moved = jax.tree_util.tree_map(lambda b, a: bool(np.any(b != a)), before, after.params)
    assert all(jax.tree_util.tree_leaves(moved)), moved


def benchmark_contestant(objective, layout, engine):
    contestant = benchmark.Contestant(
        objective, SMALL, MeshSpec.parse(layout), engine, min_shard=MIN_SHARD
    )
    contestant.prepare()
    contestant.compile()
    return contestant


# ------------------------------------------------------------------------------------------------
# The parts of `dew bench`


def test_state_bytes_per_device_counts_one_devices_shards(objective):
    contestant = benchmark.Contestant(
        objective, SMALL, MeshSpec(fsdp=8), "shard_map", min_shard=MIN_SHARD
    )
    contestant.prepare()
    # The same state as it was laid out before prepare parked it.
    leaves = [
        jax.random.key_data(x) if jax.numpy.issubdtype(x.dtype, jax.dtypes.prng_key) else x
        for x in jax.tree_util.tree_leaves(contestant.trainer.init_state())
    ]
    device = jax.devices()[3]
    by_hand = 0
    for leaf in leaves:
        index = leaf.sharding.devices_indices_map(leaf.shape)[device]
        by_hand += np.asarray(leaf)[index].nbytes
    assert contestant.state_bytes == by_hand
    whole = sum(np.asarray(x).nbytes for x in leaves)
    assert whole / 8 < contestant.state_bytes < whole / 4  # most of it split 8 ways, not all


def test_compare_measures_every_contestant_and_the_one_device_row(objective):
    results = benchmark.compare(
        SMALL, ["data=8", "fsdp=8"], steps=1, repeats=2, min_shard=MIN_SHARD, log=None
    )
    assert [(r.layout, r.engine) for r in results] == [
        ("data=8", "shard_map"),
        ("data=8", "gspmd"),
        ("fsdp=8", "shard_map"),
        ("fsdp=8", "gspmd"),
        ("data=1", "one_device"),
    ]
    for r in results:
        assert r.steps_timed == 2 and len(r.round_ms) == 2 and r.step_ms > 0 and r.compile_s > 0
        assert r.temp_bytes_per_device > 0
        assert set(r.to_json()) >= {
            "layout",
            "engine",
            "step_ms",
            "compile_s",
            "state_bytes_per_device",
            "temp_bytes_per_device",
            "wire_bytes",
        }
    by = {(r.layout, r.engine): r for r in results}
    one = by["data=1", "one_device"]
    # One device: nothing to send, and the whole state on it, as on every data-parallel replica.
    assert one.wire_bytes == 0 and one.collectives == 0
    assert one.state_bytes_per_device == by["data=8", "shard_map"].state_bytes_per_device
    assert by["data=8", "gspmd"].state_bytes_per_device == one.state_bytes_per_device
    # The shard_map data-parallel step sends its gradients in one all-reduce (after XLA merges
    # them).
    assert by["data=8", "shard_map"].collectives == 1
    for layout in ("data=8", "fsdp=8"):
        for engine in ENGINES:
            assert by[layout, engine].wire_bytes > 0 and by[layout, engine].collectives > 0
    # Fully sharded: most of the state split 8 ways.
    fsdp8 = by["fsdp=8", "shard_map"].state_bytes_per_device
    assert one.state_bytes_per_device / 8 <= fsdp8 < one.state_bytes_per_device / 4
    names = {t.name for t in benchmark.targets(results)}
    for layout in ("data=8", "fsdp=8"):
        assert f"{layout}: step time shard_map / one device" in names
        assert f"{layout}: wire bytes gspmd / shard_map" in names
    text = benchmark.table(results)
    assert "time / one device" in text and "one_device" in text


def _result(layout, engine, round_ms, wire, temp=100, state=800):
    return benchmark.Result(
        layout=layout,
        engine=engine,
        step_ms=float(np.median(round_ms)),
        compile_s=1.0,
        state_bytes_per_device=state,
        temp_bytes_per_device=temp,
        wire_bytes=wire,
        collectives=1,
        steps_timed=len(round_ms),
        round_ms=tuple(round_ms),
    )


def test_ratios_and_targets_from_known_times_and_bytes():
    # Rounds chosen so that the median of the per-round ratios (1.5) is not the ratio of the
    # medians (250 / 200 = 1.25): a time ratio is taken within each round.
    results = [
        _result("fsdp=8", "shard_map", (100, 300, 250), wire=30, temp=90, state=100),
        _result("fsdp=8", "gspmd", (200, 200, 100), wire=75, temp=100, state=100),
        _result("data=8", "shard_map", (100, 100, 100), wire=10, state=800),
        _result("data=1", "one_device", (50, 100, 125), wire=0, state=800),
    ]
    ratios = benchmark.layout_ratios(results)
    assert ratios["fsdp=8"]["time_vs_gspmd"] == pytest.approx(1.5)  # 0.5, 1.5, 2.5
    assert ratios["fsdp=8"]["time_vs_one_device"] == pytest.approx(2.0)  # 2, 3, 2
    assert ratios["fsdp=8"]["gspmd_vs_one_device"] == pytest.approx(2.0)  # 4, 2, 0.8
    assert ratios["fsdp=8"]["wire"] == pytest.approx(0.4)
    assert ratios["fsdp=8"]["temp"] == pytest.approx(0.9)
    assert ratios["data=8"] == {"time_vs_one_device": pytest.approx(1.0)}  # 2, 1, 0.8
    found = {(t.name, t.stretch): t for t in benchmark.targets(results)}
    assert not found["fsdp=8: step time shard_map / gspmd", False].met  # 1.5 > 1.05
    assert found["fsdp=8: wire bytes gspmd / shard_map", False].measured == pytest.approx(2.5)
    assert not found["fsdp=8: wire bytes gspmd / shard_map", False].met  # a strawman baseline
    assert found["fsdp=8: temp memory shard_map / gspmd", True].met
    assert found["data=8: step time shard_map / one device", False].met
    state = found["fsdp=8: state per device / (data=8's / 8)", False]
    assert state.measured == pytest.approx(1.0) and state.met  # 100 / (800 / 8)


def test_depth_check_compiles_both_depths(objective):
    depth = benchmark.compile_depth(SMALL, "fsdp=8", deep_layers=4, min_shard=MIN_SHARD)
    assert depth.shallow_layers == 2 and depth.deep_layers == 4
    assert depth.shallow_s > 0 and depth.deep_s > 0
    assert depth.ratio == depth.deep_s / depth.shallow_s


def test_cli_writes_one_object_per_layout_and_engine(tmp_path, capsys):
    # SMALL at MIN_SHARD: the steps test_step compiled, which the run's compilation cache
    # (tests/conftest.py) holds.
    out = tmp_path / "bench.json"
    args = [
        "bench",
        *("--mesh", "fsdp=8", "--layers", str(SMALL.layers), "--width", str(SMALL.width)),
        *("--heads", str(SMALL.heads), "--seq-len", str(SMALL.seq_len)),
        *("--batch", str(SMALL.batch), "--min-shard", str(MIN_SHARD)),
        *("--repeats", "1", "--depth-check", "0", "--json", str(out)),
    ]
    assert cli.main(args) == 0
    printed = capsys.readouterr().out
    assert "time / one device" in printed and "fsdp=8: wire bytes shard_map / gspmd" in printed
    objects = json.loads(out.read_text())
    assert [(o["layout"], o["engine"]) for o in objects] == [
        ("fsdp=8", "shard_map"),
        ("fsdp=8", "gspmd"),
        ("data=1", "one_device"),
    ]
    for o in objects:
        for key in ("step_ms", "compile_s", "state_bytes_per_device", "temp_bytes_per_device"):
            assert o[key] > 0, (key, o)
        assert (o["wire_bytes"] > 0) == (o["engine"] != "one_device"), o


@pytest.mark.parametrize(
    "args, message",
    [
        (["--mesh", "fsdp=3"], "does not divide"),
        (["--mesh", "fdsp=8"], "is not AXIS=SIZE"),
        (["--mesh", "fsdp=8", "fsdp=8"], "given twice"),
        # The step options are the Trainer's to check (StepOptions.check), before compiling too.
        (["--mesh", "stage=2,sequence=2,microbatches=2"], "cannot run inside a pipeline stage"),
        (
            ["--mesh", "tensor=8", "--sequence-parallel", "--seq-len", "12"],
            "--seq-len 12 does not split over tensor 8",
        ),
        (["--batch", "12"], "does not split evenly"),
        (["--width", "30"], "--width 30 does not split over --heads 8"),
        (["--repeats", "0"], "repeats must be"),
        (["--json", "/no/such/folder/out.json"], "does not exist"),
    ],
)
def test_cli_refuses_bad_input_before_compiling(capsys, monkeypatch, args, message):
    def no_compile(self):
        raise AssertionError("compiled before checking the input")

    monkeypatch.setattr(benchmark.Contestant, "compile", no_compile)
    monkeypatch.setattr(benchmark.Contestant, "prepare", no_compile)
    assert cli.main(["bench", "--depth-check", "0", *args]) == 2
    assert message in capsys.readouterr().err
