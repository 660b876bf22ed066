"""bench/attention.py's timing: a row's cells timed round robin, so a drift of the machine's speed
lands on every contestant alike, and one that raises does not stop the others."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

PATH = pathlib.Path(__file__).resolve().parent.parent / "bench" / "attention.py"
spec = importlib.util.spec_from_file_location("bench_attention", PATH)
attention = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = attention  # its dataclasses look their module up by name
spec.loader.exec_module(attention)


class Clock:
    """A fake ``time.perf_counter``: each program advances it by its own call's duration."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_calls_go_round_the_programs_in_turn_and_each_gets_its_median(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(attention.time, "perf_counter", clock)
    calls = []

    def program(name, durations):
        def run(x):
            calls.append(name)
            clock.now += durations[min(len(durations) - 1, calls.count(name) - 1)]
            return x

        return run

    # a's warm-up and one timed call are slow (a drift, or a first call): the median ignores both
    fast = program("a", [50.0, 1.0, 9.0, 1.0, 1.0, 1.0])
    slow = program("b", [2.0])

    def broken(x):
        calls.append("c")
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")

    got = attention.median_seconds_round_robin([(fast, (0,)), (broken, (0,)), (slow, (0,))], 5)

    assert calls == ["a", "c", "b"] + ["a", "b"] * 5  # warm-ups, then rounds; c never again
    assert got[0] == 1.0 and got[2] == 2.0
    assert isinstance(got[1], RuntimeError)
    assert attention.short_error(got[1]) == "OOM"


def test_a_program_that_raises_mid_row_keeps_its_error_and_the_others_their_times(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(attention.time, "perf_counter", clock)
    runs = {"a": 0}

    def flaky(x):
        runs["a"] += 1
        if runs["a"] == 3:  # the second timed call
            raise ValueError("lost the device")
        clock.now += 1.0
        return x

    def steady(x):
        clock.now += 3.0
        return x

    got = attention.median_seconds_round_robin([(flaky, (0,)), (steady, (0,))], 4)
    assert isinstance(got[0], ValueError)
    assert got[1] == 3.0


class FakeEvent:
    def __init__(self, name, ms):
        self.name, self.duration_ns = name, ms * 1e6


class FakeLine:
    def __init__(self, name, events):
        self.name, self.events = name, events


class FakePlane:
    def __init__(self, name, lines):
        self.name, self.lines = name, lines


def fake_profile(monkeypatch, planes):
    """``jax.profiler.trace`` writes an empty ``.xplane.pb``; reading it gives ``planes``."""
    import contextlib
    import os

    @contextlib.contextmanager
    def trace(directory):
        yield
        os.makedirs(os.path.join(directory, "plugins", "profile", "run"))
        open(os.path.join(directory, "plugins", "profile", "run", "host.xplane.pb"), "w").close()

    class ProfileData:
        @staticmethod
        def from_file(path):
            assert path.endswith(".xplane.pb")
            return type("Data", (), {"planes": planes})

    monkeypatch.setattr(attention.jax.profiler, "trace", trace)
    monkeypatch.setattr(attention.jax.profiler, "ProfileData", ProfileData)


def test_device_times_are_each_programs_own_module_events_and_their_median(monkeypatch):
    device = FakePlane(
        "/device:TPU:0",
        [
            FakeLine("XLA Ops", [FakeEvent("%fusion.1 = f32[8] fusion(...)", 100.0)]),
            FakeLine(
                "XLA Modules",
                [
                    FakeEvent("jit_bench_cell_0(123)", 3.0),
                    FakeEvent("jit_bench_cell_1(456)", 5.0),
                    FakeEvent("jit_bench_cell_0(123)", 4.0),
                    FakeEvent("jit_bench_cell_10(789)", 50.0),  # not cell 1's, by prefix
                    FakeEvent("jit_bench_cell_0(123)", 30.0),
                ],
            ),
        ],
    )
    host = FakePlane("/host:CPU", [FakeLine("XLA Modules", [FakeEvent("jit_bench_cell_1", 9e3)])])
    fake_profile(monkeypatch, [host, device])
    calls = []
    programs = [
        (f"jit_bench_cell_{n}", lambda x, n=n: calls.append(n) or x, (0,)) for n in (0, 1, 2)
    ]
    got = attention.device_seconds_round_robin(programs, 2)
    assert calls == [0, 1, 2, 0, 1, 2]  # round robin
    assert got[0] == 4.0e-3  # the median of its three events
    assert got[1] == 5.0e-3  # the device's, not the host plane's
    assert got[2] is None  # no event of its own


def test_a_trace_without_a_device_plane_gives_no_device_times(monkeypatch):
    fake_profile(monkeypatch, [FakePlane("/host:CPU", [])])
    assert attention.device_seconds_round_robin([("jit_a", lambda: None, ())], 3) == [None]


def test_a_named_function_compiles_to_the_module_its_device_events_carry():
    import jax
    import jax.numpy as jnp

    lowered = jax.jit(attention.named(lambda x: x + 1, "bench_cell_7")).lower(jnp.zeros(3))
    assert lowered.compile().as_text().startswith("HloModule jit_bench_cell_7")


def test_the_ratio_counts_device_times_where_there_are_some():
    cell = attention.Cell
    cells = [
        cell("dew", "a", "fwd", seconds=4.0, device_seconds=3.0),
        cell("dew", "b", "fwd", seconds=3.9, device_seconds=3.3),
        cell("splash", "c", "fwd", seconds=4.2, device_seconds=3.6),
        cell("jax-flash", "d", "fwd", seconds=5.0, device_seconds=3.5),
    ]
    assert attention.dew_ratio(cells, "fwd", lambda c: c.time) == 3.5 / 3.0
    assert attention.dew_ratio(cells, "fwd", lambda c: c.seconds) == 4.2 / 3.9
    assert attention.best(cells, "dew", "fwd").candidate == "a"
    assert attention.dew_ratio(cells, "fwd+bwd", lambda c: c.time) is None


def test_a_row_counts_device_times_only_when_every_cell_has_one(capsys):
    def row():
        return [
            attention.Cell("dew", "a", "fwd", seconds=4.0),
            attention.Cell("splash", "b", "fwd", seconds=4.4),
        ]

    whole = row()
    attention.count_device_times(whole, [3.2, 3.6], "4096, 128")
    assert [c.time for c in whole] == [3.2, 3.6]

    partial = row()  # splash's device time missing: dew's 3.2 must not meet splash's wall 4.4
    attention.count_device_times(partial, [3.2, None], "4096, 128")
    assert [c.device_seconds for c in partial] == [None, None]
    assert [c.time for c in partial] == [4.0, 4.4]
    assert "no device time for splash b fwd" in capsys.readouterr().out


def test_rows_with_documents_and_windows_parse_and_count_their_visible_pairs():
    # docsN and windowW parse into the row; a row's FLOPs count its visible (query, key) pairs,
    # here by a loop over every query and key of the row's ids.
    import numpy as np
    import pytest

    row = attention.Row.parse("512:64:docs40")
    assert (row.documents, row.window, row.causal, row.masked) == (40, 0, True, True)
    assert attention.Row.parse("512:64:window100").window == 100
    assert not attention.Row.parse("512:64").masked
    for bad in ("512:64:docs0", "512:64:window", "512:64:full:window8", "512:64:docsx"):
        with pytest.raises(attention.argparse.ArgumentTypeError):
            attention.Row.parse(bad)
    ids = attention.document_ids(3, 2, 512, 40)
    assert ids.shape == (2, 512) and ids.dtype == np.int32
    assert (np.diff(ids, axis=1) >= 0).all() and len(np.unique(ids[0])) > 5  # documents, in order
    for window in (0, 25):
        row = attention.Row(512, 64, documents=40, window=window)
        pairs = sum(
            1
            for b in range(2)
            for i in range(512)
            for j in range(i + 1)
            if ids[b, i] == ids[b, j] and (not window or i - j < window)
        )
        assert attention.visible_pairs(row, 2, ids) == pairs
        assert attention.forward_flops(row, 2, 8, ids) == 4.0 * 8 * 64 * pairs
    # A window alone: query i sees min(i + 1, window) keys.
    row = attention.Row(512, 64, window=25)
    assert attention.visible_pairs(row, 2) == 2 * sum(min(i + 1, 25) for i in range(512))
