"""What ``dew train`` does with no device or mesh flag (issue 67): the accelerator JAX finds, else
8 simulated CPU devices; fully sharded over them; one line of what a device needs before the step
compiles, and a run that does not fit the host refused in one line before anything is allocated.

The accelerator probes (device files, JAX's plugins, ``JAX_PLATFORMS``) are replaced by fakes:
this machine has none. The memory lines are checked against counts made here from the model's
shapes; the refusals in a child process whose address space is limited (``RLIMIT_AS``).
"""

import math
import re
import resource
import subprocess
import sys
import time
import types

import jax
import optax
import pytest

from dew import Layout, MeshSpec, Trainer
from dew.cli import preflight
from dew.cli.flags import default_mesh
from dew.cli.main import _setup_devices, build_parser
from dew.training import runtime
from dew.training.optimizer import adamw
from dew.training.runtime import DEFAULT_CPU_DEVICES, default_cpu_devices, find_accelerator
from tests.helpers import child_env, tiny_objective
from tests.test_cli import ROOT


def probes(files=(), modules=(), environ=None):
    """``find_accelerator``'s probes, faked: the device files there, the modules installed."""

    def paths(pattern):
        import fnmatch

        return [f for f in files if fnmatch.fnmatch(f, pattern)]

    def installed(pattern):
        import fnmatch

        return any(fnmatch.fnmatch(m, pattern) for m in modules)

    return dict(environ={} if environ is None else environ, paths=paths, installed=installed)


def test_the_accelerator_is_found_by_its_device_files_and_jax_plugin():
    assert find_accelerator(**probes(["/dev/accel0", "/dev/accel1"], ["libtpu"])) == "tpu"
    assert find_accelerator(**probes(["/dev/vfio/0", "/dev/vfio/vfio"], ["libtpu"])) == "tpu"
    cuda = ["jax_plugins.xla_cuda12", "jax_cuda12_plugin"]
    assert find_accelerator(**probes(["/dev/nvidia0", "/dev/nvidiactl"], cuda)) == "gpu"
    assert find_accelerator(**probes(["/dev/kfd"], ["jax_plugins.xla_rocm7"])) == "gpu"
    # libtpu without a chip (installed here, to compile for TPUs), a GPU without JAX's plugin
    # (JAX would run on the CPU), the vfio control file alone: the CPU.
    assert find_accelerator(**probes([], ["libtpu"])) is None
    assert find_accelerator(**probes(["/dev/nvidia0", "/dev/nvidiactl"], ["libtpu"])) is None
    assert find_accelerator(**probes(["/dev/vfio/vfio"], ["libtpu"])) is None
    # JAX_PLATFORMS says which, whatever the probes find.
    tpu = probes(["/dev/accel0"], ["libtpu"], environ={"JAX_PLATFORMS": "cpu"})
    assert find_accelerator(**tpu) is None
    assert find_accelerator(**probes(environ={"JAX_PLATFORMS": "cuda,cpu"})) == "cuda"


def test_cpu_devices_simulated_only_where_no_accelerator_is_found():
    tpu, none = probes(["/dev/accel0"], ["libtpu"]), probes([], ["libtpu"])
    assert default_cpu_devices(None, **tpu) is None  # JAX's own devices: the chips
    assert default_cpu_devices(None, **none) == DEFAULT_CPU_DEVICES == 8
    assert default_cpu_devices(0, **none) is None  # --cpu-devices 0: JAX's own, as before
    assert default_cpu_devices(3, **tpu) == 3  # --cpu-devices N: N simulated, always


@pytest.mark.parametrize(
    "flags, accelerator, expected",
    [([], "tpu", None), ([], None, 8), (["--cpu-devices", "2"], "tpu", 2)],
)
def test_dew_train_sets_up_the_devices_the_rule_gives(monkeypatch, flags, accelerator, expected):
    # The parsed flag through main's setup to prepare_process, the accelerator faked.
    args = build_parser().parse_args(["train", *flags])
    given = []
    monkeypatch.setattr(runtime, "find_accelerator", lambda *a, **k: accelerator)
    monkeypatch.setattr(runtime, "prepare_process", lambda cpu_devices: given.append(cpu_devices))
    _setup_devices(args.cpu_devices)
    assert given == [expected]


@pytest.fixture
def no_cache_dir():
    """JAX's ``jax_compilation_cache_dir`` unset while the test runs (the suite sets its own),
    then restored."""
    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    yield
    jax.config.update("jax_compilation_cache_dir", before)


def test_an_accelerator_run_caches_its_compiles_under_the_users_cache(tmp_path, no_cache_dir):
    folder = runtime.use_compilation_cache("tpu", environ={"XDG_CACHE_HOME": str(tmp_path)})
    assert folder == str(tmp_path / "dew" / "jax")
    assert jax.config.jax_compilation_cache_dir == folder


def test_the_cpu_and_a_users_own_setting_keep_the_cache_as_they_are(tmp_path, no_cache_dir):
    home = {"XDG_CACHE_HOME": str(tmp_path)}
    assert runtime.use_compilation_cache("cpu", environ=home) is None
    mine = str(tmp_path / "mine")
    assert runtime.use_compilation_cache("tpu", {**home, "JAX_COMPILATION_CACHE_DIR": mine}) == mine
    assert runtime.use_compilation_cache("gpu", {**home, "JAX_COMPILATION_CACHE_DIR": ""}) is None
    assert jax.config.jax_compilation_cache_dir is None  # JAX reads its variable itself
    jax.config.update("jax_compilation_cache_dir", mine)
    assert runtime.use_compilation_cache("tpu", environ=home) == mine


@pytest.mark.parametrize("command, cached", [("train", True), ("plan", False)])
def test_train_asks_for_the_cache_and_plan_which_measures_its_compiles_does_not(
    monkeypatch, command, cached
):
    from dew.cli.main import main

    asked = []
    monkeypatch.setattr(runtime, "use_compilation_cache", lambda platform: asked.append(platform))
    # A flag refused inside the command, after the setup: nothing compiles.
    main(
        [command, "--batch", "0"]
        if command == "train"
        else [command, "--target", "v5e-8", "--batch", "0"]
    )
    assert asked == ([jax.default_backend()] if cached else []), asked


def test_no_mesh_is_fully_sharded_over_every_device(tmp_path, dew_here):
    assert default_mesh("", 8) == "fsdp=8"
    assert default_mesh("", 1) == "fsdp=1"
    assert default_mesh("data=2,fsdp=4", 8) == "data=2,fsdp=4"  # as given
    args = build_parser().parse_args(["train"])
    assert MeshSpec.parse(default_mesh(args.mesh, 8)).shape(8)["fsdp"] == 8
    # dew collectives shows the step dew train runs: the same default (dew train's own is run
    # in a child process below).
    out = dew_here("collectives", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines()[1].startswith(
        "Collectives of one shard_map step on {'data': 1, 'expert': 1, 'fsdp': 8, 'tensor': 1,"
    ), out.stdout


def _trainer(mesh, optimizer=None):
    return Trainer(
        tiny_objective(),
        optimizer or optax.adamw(1e-3),
        key=jax.random.key(0),
        mesh=mesh,
        layout=Layout(min_shard=1),
    )


def _weights(objective) -> int:
    shapes = jax.eval_shape(objective.model.init, jax.random.key(0))
    return sum(math.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(shapes))


def _text(n) -> str:
    """Bytes as the lines print them: GiB, MiB or KiB, whichever leaves at least 1."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size or unit == "KiB":
            return f"{n / size:.2f} {unit}"


def _host(available):
    return lambda: (available, "MemAvailable")


def test_the_line_before_compiling_names_devices_mesh_and_the_state_a_device_holds():
    # AdamW in float32: the weights and two moments, 12 bytes a weight, and a few scalars (the
    # step, the moments' count, the key). Replicated on data=8 each device holds all of it; on
    # fsdp=8 an eighth (every weight of the tiny model splits over 8 with min_shard=1).
    weights = _weights(tiny_objective())
    devices = jax.devices()
    replicated = preflight.state_bytes(_trainer(MeshSpec(data=8)))
    sharded = preflight.state_bytes(_trainer(MeshSpec(fsdp=8)))
    assert 12 * weights <= replicated <= 12 * weights + 64, (weights, replicated)
    assert 12 * weights / 8 <= sharded <= 12 * weights / 8 + 64, (weights, sharded)

    room = preflight.Room(devices, host=_host(3 * 2**30 + 2**29))
    line = preflight.check_state(_trainer(MeshSpec(fsdp=8)), room)
    assert line == (
        f"8 simulated CPU devices, mesh fsdp=8: {_text(sharded)} of training state a device; "
        f"the host holds 8: {_text(8 * sharded)} of 3.50 GiB available"
    )


def test_a_state_that_does_not_fit_the_host_is_refused_naming_the_mesh_that_fits():
    replicated = preflight.state_bytes(_trainer(MeshSpec(data=8)))
    sharded = preflight.state_bytes(_trainer(MeshSpec(fsdp=8)))
    # Room for the 8 devices' sharded state, not for 8 replicas.
    room = preflight.Room(jax.devices(), host=_host(4 * replicated))
    with pytest.raises(ValueError) as refused:
        preflight.check_state(_trainer(MeshSpec(data=8)), room)
    assert str(refused.value) == (
        f"the training state (weights, optimizer, EMA) needs {_text(replicated)} a device on "
        f"--mesh data=8; 8 simulated CPU devices hold {_text(8 * replicated)} on this host, "
        f"which has {_text(4 * replicated)} available (MemAvailable): give --mesh fsdp=8, fully "
        f"sharded, where a device holds {_text(sharded)}, {_text(8 * sharded)} on this host"
    )
    # Fully sharded already: AdamW's moments in bfloat16, 8 bytes a weight where float32 takes
    # 12, where they fit; else a smaller model, with the least a device would hold.
    halved = {"--moments-dtype bfloat16": adamw(1e-3, moments_dtype="bfloat16")}
    weights = _weights(tiny_objective())
    smaller = preflight.state_bytes(_trainer(MeshSpec(fsdp=8), halved["--moments-dtype bfloat16"]))
    assert 8 * weights / 8 <= smaller <= 8 * weights / 8 + 64, (weights, smaller)
    between = preflight.Room(jax.devices(), host=_host(8 * (smaller + sharded) // 2))
    with pytest.raises(ValueError) as refused:
        preflight.check_state(_trainer(MeshSpec(fsdp=8)), between, halved)
    assert str(refused.value).endswith(
        f": give --moments-dtype bfloat16, where a device holds {_text(smaller)}, "
        f"{_text(8 * smaller)} on this host"
    ), refused.value
    small = preflight.Room(jax.devices(), host=_host(7 * smaller))
    with pytest.raises(ValueError) as refused:
        preflight.check_state(_trainer(MeshSpec(fsdp=8)), small, halved)
    assert str(refused.value).endswith(
        f"; with --mesh fsdp=8 --moments-dtype bfloat16 a device would still hold "
        f"{_text(smaller)}, {_text(8 * smaller)} on this host: give a smaller --model"
    ), refused.value


def _compiled(argument, output, alias, temp, code):
    analysis = types.SimpleNamespace(
        argument_size_in_bytes=argument,
        output_size_in_bytes=output,
        alias_size_in_bytes=alias,
        temp_size_in_bytes=temp,
        generated_code_size_in_bytes=code,
    )
    return types.SimpleNamespace(memory_analysis=lambda: analysis)


def test_the_steps_need_is_the_compilers_count_and_a_step_too_big_names_a_batch_that_fits():
    trainer = _trainer(MeshSpec(fsdp=8))
    state = preflight.state_bytes(trainer)
    # A step of 3 MiB a device: arguments (the state and the batch) + outputs - donated + temp
    # + code, as the compiler counts it.
    compiled = _compiled(state + 4096, state + 16, state, 3 * 2**20 - 4112 - 1024, 1024)
    need = 3 * 2**20 + state
    line = preflight.check_step(trainer, compiled, 64, preflight.Room(jax.devices(), _host(2**30)))
    assert line == (
        f"a device needs {_text(need)} for the step, the state included; the host holds 8: "
        f"{_text(8 * need)} of 1.00 GiB available"
    )
    # Room for 8 x (state + 1.3 MiB): the step's 3 MiB beyond the state grow with the rows, 8
    # a device at --batch 64; 3 rows a device (--batch 24) take 1.125 MiB, 4 rows 1.5 MiB.
    room = preflight.Room(jax.devices(), _host(8 * (state + 13 * 2**20 // 10)))
    with pytest.raises(ValueError) as refused:
        preflight.check_step(trainer, compiled, 64, room)
    message = str(refused.value)
    assert message.startswith(
        f"the step needs {_text(need)} a device on --mesh fsdp=8 with --batch 64, the state "
        f"included; 8 simulated CPU devices hold {_text(8 * need)} on this host"
    ), message
    fits = state + 3 * 2**20 * 3 // 8
    assert message.endswith(
        f": give --batch 24 (about {_text(fits)} a device, {_text(8 * fits)} on this host)"
    ), message


def test_the_host_has_what_meminfo_and_the_address_space_limit_leave():
    meminfo = "MemTotal: 24000000 kB\nMemFree: 1000 kB\nMemAvailable: 20000000 kB\n"
    status = "Name: python\nVmPeak: 3000000 kB\nVmSize: 2000000 kB\n"
    unlimited = resource.RLIM_INFINITY
    assert preflight.host_available(meminfo, status, unlimited) == (20000000 * 1024, "MemAvailable")
    limit = 5000000 * 1024  # 5,000,000 kB, 2,000,000 of them taken
    assert preflight.host_available(meminfo, status, limit) == (
        3000000 * 1024,
        "the address-space limit, ulimit -v",
    )
    assert preflight.host_available("", "", unlimited) == (None, "")


# A child that limits its own address space, then runs ``dew`` (a preexec_fn would fork this
# multithreaded process).
LIMITED_DEW = (
    "import resource, runpy, sys; limit = int(sys.argv[1]); "
    "resource.setrlimit(resource.RLIMIT_AS, (limit, limit)); sys.argv = ['dew', *sys.argv[2:]]; "
    "runpy.run_module('dew', run_name='__main__', alter_sys=True)"
)


def _child(*args, **kwargs):
    env = child_env()
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=600, **kwargs
    )


def _limited(limit, *args, cwd):
    """``dew train ARGS`` in a child process whose address space is limited to ``limit`` bytes
    (``RLIMIT_AS``): ``(completed process, seconds)``."""
    start = time.perf_counter()
    run = _child("-c", LIMITED_DEW, str(int(limit)), "train", *args, cwd=cwd)
    return run, time.perf_counter() - start


@pytest.fixture(scope="module")
def limit():
    """An address space 1.2 GiB above what a child takes once JAX has its 8 CPU devices and
    Dew's CLI is imported (about 1.5 GiB here; more where XLA starts more threads): about 1.18
    GiB for the devices when ``dew train`` checks them."""
    size = _child(
        "-c",
        "from dew.training.runtime import prepare_process; prepare_process(cpu_devices=8); "
        "import jax, dew.cli.main, dew.planning; jax.devices(); "
        "print(open('/proc/self/status').read())",
    )
    assert size.returncode == 0, size.stderr[-3000:]
    return _vm_size(size.stdout) + 12 * 2**30 // 10


def _vm_size(status: str) -> int:
    (kib,) = re.findall(r"^VmSize:\s+(\d+) kB$", status, re.M)
    return int(kib) * 1024


def test_gpt2_small_refused_in_one_line_before_compiling_where_the_host_is_too_small(
    tmp_path, limit
):
    # GPT-2 small's state (weights and AdamW's two moments: 12 bytes a weight, 124M weights) is
    # 1.38 GiB fully sharded over 8 simulated devices: more than the limit leaves. With the
    # moments in bfloat16, 8 bytes a weight, it needs two thirds of that: named where the room
    # the line states holds it (the threads started before the check move it by a few hundred
    # MiB), else a smaller model, with what a device would still hold.
    run, seconds = _limited(limit, "--model", "gpt2-small", "--steps", "1", cwd=tmp_path)
    assert run.returncode == 2, run.stdout + run.stderr[-3000:]
    (line,) = run.stderr.splitlines()
    found = re.fullmatch(
        r"dew train: the training state \(weights, optimizer, EMA\) needs 176.80 MiB a device on "
        r"--mesh fsdp=8; 8 simulated CPU devices hold 1.38 GiB on this host, which has ([\d.]+ "
        r"[MG]iB) available \(the address-space limit, ulimit -v\)(: give --moments-dtype "
        r"bfloat16, where|; with --mesh fsdp=8 --moments-dtype bfloat16) a device "
        r"(?:would still )?holds? "
        r"([\d.]+) MiB, ([\d.]+) MiB on this host(?:: give a smaller --model)?",
        line,
    )
    assert found, line
    available, named, device, host = found.group(1), found.group(2), *found.group(3, 4)
    assert abs(float(host) - 8 * float(device)) < 0.05, line  # each rounded to 0.01
    assert abs(float(device) / 176.80 - 8 / 12) < 0.01, line  # 8 bytes a weight, not 12
    number, unit = available.split()
    room = float(number) * {"MiB": 1, "GiB": 1024}[unit]
    assert named.startswith(": give") == (float(host) <= room), line
    # Refused before the step compiled (its compile alone takes 15 s and more here).
    assert "compiling the step" not in run.stdout, run.stdout
    assert seconds < 30, seconds
    # Replicated (11.05 GiB for the 8) it does not fit 7 GiB for the devices: fully sharded
    # (1.38 GiB) it would, and --mesh fsdp=8 is named.
    seven = limit + 58 * 2**30 // 10
    run, seconds = _limited(seven, "--model", "gpt2-small", "--mesh", "data=8", cwd=tmp_path)
    assert run.returncode == 2, run.stdout + run.stderr[-3000:]
    (line,) = run.stderr.splitlines()
    assert line.startswith(
        "dew train: the training state (weights, optimizer, EMA) needs 1.38 GiB a device on "
        "--mesh data=8; 8 simulated CPU devices hold 11.05 GiB on this host"
    ), line
    assert line.endswith(
        ": give --mesh fsdp=8, fully sharded, where a device holds 176.80 MiB, 1.38 GiB on this "
        "host"
    ), line
    assert "compiling the step" not in run.stdout and seconds < 30, (run.stdout, seconds)


def test_a_model_that_fits_trains_under_the_same_limit(tmp_path, limit):
    # The example decoder (GPT-2 small's fitting run takes minutes here): the same command
    # shape, the same limit, no flag for devices or mesh.
    run, _ = _limited(limit, "--steps", "2", "--layers", "1", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert re.fullmatch(
        r"8 simulated CPU devices, mesh fsdp=8: [\d.]+ KiB of training state a device; the host "
        r"holds 8: [\d.]+ [KM]iB of [\d.]+ [MG]iB available",
        lines[1],
    ), lines
    assert lines[2:4] == ["compiling the step...", lines[3]] and lines[3].startswith(
        "compiled the step in "
    ), lines
    assert lines[4].startswith("a device needs "), lines
    assert "Training from step 0 to 2 on {'data': 1, 'expert': 1, 'fsdp': 8," in run.stdout
    assert re.search(r"^step 2: loss \d+\.\d{4}, ", run.stdout, re.M), run.stdout
