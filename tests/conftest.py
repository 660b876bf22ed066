"""Eight simulated CPU devices, set before JAX is imported anywhere in the test session; and the
seeds of the random tests.

Tests marked ``tpu`` need a real TPU chip and skip without one. ``DEW_TEST_TPU=1`` runs them: JAX's
platform is then left alone (the chip), none of the CPU setup below is made, and every test not
marked ``tpu`` skips, as they assume the 8 CPU devices. One process holds the chip, so run them
without xdist's workers (``-o addopts=`` drops the suite's ``-n 3``):

    DEW_TEST_TPU=1 python -m pytest -o addopts= -ra -m tpu tests/test_on_tpu.py

Random tests take the ``seed`` fixture (an int): drawn fresh for each test, so every run covers new
keys and tokens, or read from the environment variable ``DEW_SEED`` to replay a run. A test's seed
is shown in its report when it fails (and with ``-rA`` when it passes), with the command that
replays it:

    seed: 1234 (replay: DEW_SEED=1234 python -m pytest 'tests/test_x.py::test_y')

A module-scoped fixture (a shared one-device reference) takes ``module_seed`` instead: one seed
for the module, replayed the same way. A test that uses ``module_seed``, directly or through a
fixture, gets that same number from ``seed``, so each test depends on exactly one seed.
"""

import atexit
import gc
import os
import shutil
import subprocess
import tempfile

# Compiling for the CPU, not running, is most of this suite's time: it compiles hundreds of small
# steps. Three flags cut the CPU time of a compile:
# - LLVM's optimization of the machine code at level 0, not 2 (an equivalence test: 39 s of CPU
#   against 92 s for two layouts);
# - XLA:CPU's older elemental emitters instead of its MLIR fusion emitters: three tiny steps
#   (fsdp=8, expert=8, tensor=4 x fsdp=2) take 6.4 s of compile CPU against 21.4 s;
# - the module's machine code generated in one piece rather than split across threads, which on
#   a busy machine only adds work: 5.1 s against 6.4 s (mean of two runs);
# - LLVM's costlier passes left out (xla_llvm_disable_expensive_passes): five equivalence layouts
#   took 32.1 s of CPU against 34.98 and 33.53 without it (2026-12-07).
# What the tests check is decided before code generation: the HLO and its collectives, buffer
# assignment (memory analysis) and the arithmetic are XLA's, however the machine code is made.
FAST_COMPILE = " ".join(
    [
        "--xla_backend_optimization_level=0",
        "--xla_cpu_use_fusion_emitters=false",
        "--xla_cpu_parallel_codegen_split_count=1",
        "--xla_llvm_disable_expensive_passes=true",
    ]
)
# DEW_TEST_TPU=1: the tpu-marked tests, on the real chip. Everything below that sets up the CPU
# (the flags, the platform, the shared compilation cache, libtpu told it only compiles, which would
# hide the chip from it) is left out, and the other tests skip (pytest_collection_modifyitems).
ON_TPU = os.environ.get("DEW_TEST_TPU") == "1"
TPU_COMMAND = "DEW_TEST_TPU=1 python -m pytest -o addopts= -ra -m tpu tests/test_on_tpu.py"


def _set_up_cpu_devices() -> None:
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + f" {FAST_COMPILE} --xla_force_host_platform_device_count=8"
    ).strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
    _share_a_compilation_cache()
    # The TPU compile tests (dew plan, dew.targets) load libtpu in every worker, compiling only.
    # (Importing dew imports JAX: the flags above are set first.)
    from dew.targets import compile_only_environment

    compile_only_environment()


# One compilation cache for the run, shared by its workers and every process they start: a
# program that several tests compile (a tiny step on the same mesh, a one-device reference, each
# rank of a launched run, a benchmark contestant) is compiled once and read back after (measured
# on four of the costliest files, equivalence, MoE, resume and pipelines: 278 s against 308 s).
# The first process of the run (xdist's controller) creates it, its workers and their children
# inherit the variable, and it is removed when that process exits, so every run starts empty.
# (TPU programs compiled without a TPU are written but cannot be read back: JAX warns and compiles
# them again.)
_RUN_CACHE = "DEW_TEST_COMPILATION_CACHE"


def _share_a_compilation_cache() -> None:
    if _RUN_CACHE not in os.environ:
        os.environ[_RUN_CACHE] = tempfile.mkdtemp(prefix="dew-test-compilation-cache-")
        atexit.register(shutil.rmtree, os.environ[_RUN_CACHE], ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ[_RUN_CACHE]
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"


if not ON_TPU:
    _set_up_cpu_devices()

import jax  # noqa: E402
import pytest  # noqa: E402

from tests.xdist_groups import ungrouped  # noqa: E402

if not ON_TPU:
    assert jax.device_count() == 8, jax.devices()

SEED_VARIABLE = "DEW_SEED"
# Module node id -> the seed its module_seed fixture drew.
_module_seeds: dict[str, int] = {}


def _draw_seed() -> int:
    """``DEW_SEED`` when set, else 31 fresh bits from the OS (below 2**31, which any seed takes)."""
    given = os.environ.get(SEED_VARIABLE)
    if given is not None:
        try:
            return int(given)
        except ValueError:
            raise ValueError(f"{SEED_VARIABLE}={given!r} is not an integer") from None
    return int.from_bytes(os.urandom(4), "little") % 2**31


def pytest_report_header(config):
    given = os.environ.get(SEED_VARIABLE)
    if given is None:
        return f"seeds: fresh per test ({SEED_VARIABLE}=N replays one)"
    return f"seeds: all {SEED_VARIABLE}={given}"


@pytest.fixture(scope="module")
def module_seed(request) -> int:
    """One seed for a whole module's shared fixtures (``DEW_SEED`` replays it)."""
    value = _draw_seed()
    _module_seeds[request.node.nodeid] = value
    return value


@pytest.fixture
def seed(request) -> int:
    """This test's seed: fresh or ``DEW_SEED``; the module's if the test uses ``module_seed``."""
    if "module_seed" in request.fixturenames:
        value = request.getfixturevalue("module_seed")
    else:
        value = _draw_seed()
    request.node.user_properties.append(("seed", value))
    return value


def seed_of(item) -> int | None:
    """The seed ``item`` ran with, or ``None`` for a test that drew none."""
    for name, value in item.user_properties:
        if name == "seed":
            return value
    if "module_seed" in item.fixturenames:
        module = item.getparent(pytest.Module)
        return _module_seeds.get(module.nodeid if module is not None else "")
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    value = seed_of(item)
    if value is not None and (report.when == "call" or report.failed):
        report.sections.append(
            (
                "seed",
                f"seed: {value} (replay: {SEED_VARIABLE}={value} python -m pytest '{item.nodeid}')",
            )
        )
    return report


# The node ids whose xdist group this worker's pytest dropped (``ungrouped``): they fail at once.
_lost_groups: set[str] = set()


def pytest_collection_finish(session):
    if os.environ.get("PYTEST_XDIST_WORKER") and getattr(session.config.option, "loadgroup", False):
        _lost_groups.update(ungrouped(session.items))
    # What the session holds by now (JAX, Dew, the collected tests) lives until it ends: frozen,
    # the garbage collector no longer walks it on every full collection, which tracing's many
    # short-lived objects trigger often (measured on the equivalence and MoE tests: 11 s in the
    # collector against 15 s). And the young generations collected 30 times less often: tracing
    # allocates millions of objects that reference counting frees (tests/test_moe.py and
    # tests/test_prompt_mask.py: 1,269 collections took 0.82 CPU-s; at these thresholds 92, 0.13).
    gc.collect()
    gc.freeze()
    gc.set_threshold(20000, 20, 20)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # Before the test's fixtures: a group's shared setup is what would run once per worker.
    if item.nodeid in _lost_groups:
        pytest.fail(
            f"pytest {pytest.__version__} dropped this test's xdist_group "
            "(pytest-dev/pytest-xdist#1386): every worker would rerun the group's shared setup. "
            "Install the test extra's pytest: pip install -e '.[test]'",
            pytrace=False,
        )


def pytest_configure(config):
    if ON_TPU and (getattr(config.option, "numprocesses", None) or 0) != 0:
        # Each worker would open the chip, and only one process can hold it.
        raise pytest.UsageError(
            f"DEW_TEST_TPU=1 with -n {config.option.numprocesses}: one process holds the TPU; "
            f"run without workers: {TPU_COMMAND}"
        )


def pytest_collection_modifyitems(items):
    # The modules that run as one group on one worker (xdist_group: a costly shared setup, each
    # a minute or two) go first, so that none of them ends the run on one worker while the
    # others have nothing left to do. The order within each group, and of the other tests, is
    # kept.
    items.sort(key=lambda item: item.get_closest_marker("xdist_group") is None)
    for item in items:
        if item.get_closest_marker("tpu") is not None and not ON_TPU:
            item.add_marker(pytest.mark.skip(reason=f"needs a real TPU chip; run: {TPU_COMMAND}"))
        elif item.get_closest_marker("tpu") is None and ON_TPU:
            item.add_marker(
                pytest.mark.skip(reason="DEW_TEST_TPU=1 runs the tpu-marked tests only")
            )


@pytest.fixture
def dew_here(capsys, monkeypatch):
    """``dew_here(*args, cwd=...)``: ``dew ARGS`` run by ``main`` in this process (8 CPU devices
    already), returned as ``dew`` returns it, with its exit code and what it printed. An error
    ``main`` does not turn into a message (a user would see a traceback) raises here, failing
    the test."""
    from dew.cli.main import main

    # main sets up its devices (the same 8 CPU devices): the variables it writes are restored.
    for name in ("XLA_FLAGS", "JAX_PLATFORMS"):
        monkeypatch.setenv(name, os.environ[name])

    def run(*args, cwd):
        monkeypatch.chdir(cwd)
        capsys.readouterr()
        code = main(list(args))
        printed = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, printed.out, printed.err)

    return run
