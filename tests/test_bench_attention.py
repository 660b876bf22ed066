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
