"""Eight simulated CPU devices, set before JAX is imported anywhere in the test session; and the
seeds of the random tests.

Random tests take the ``seed`` fixture (an int): drawn fresh for each test, so every run covers new
keys and tokens, or read from the environment variable ``DEW_SEED`` to replay a run. A test's seed
is shown in its report when it fails (and with ``-rA`` when it passes), with the command that
replays it:

    seed: 1234 (replay: DEW_SEED=1234 python -m pytest 'tests/test_x.py::test_y')

A module-scoped fixture (a shared one-device reference) takes ``module_seed`` instead: one seed
for the module, replayed the same way. A test that uses ``module_seed``, directly or through a
fixture, gets that same number from ``seed``, so each test depends on exactly one seed.
"""

import os

# LLVM's optimization of the CPU code (level 0 here, 2 by default) is most of what compiling a
# step costs, and this suite compiles hundreds of small steps: at level 0 an equivalence test
# takes 2.4 times less CPU (measured: 39 s against 92 s for two layouts). What the tests check
# is decided before that stage: the HLO and its collectives, buffer assignment (memory analysis)
# and the arithmetic are XLA's, whatever the machine code's optimization level.
FAST_COMPILE = "--xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" {FAST_COMPILE} --xla_force_host_platform_device_count=8"
).strip()
os.environ["JAX_PLATFORMS"] = "cpu"
# The TPU compile tests (dew plan, dew.targets) load libtpu in both workers, compiling only.
# (Importing dew imports JAX: the flags above are set first.)
from dew.targets import compile_only_environment  # noqa: E402

compile_only_environment()

import jax  # noqa: E402
import pytest  # noqa: E402

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
