"""A user's mistake in any ``dew`` command is one line on stderr and exit code 2, never a traceback
(``dew.cli.main.main``: ``ValueError``, ``CheckpointError`` and its kinds, ``OSError`` on a path,
``MissingExtra``); and ``dew train --init-from``'s edges say what is wrong with the path or the
flags, naming both values.

Every case fails before anything compiles: each runs ``main`` in this process (``dew_here``, in
tests/conftest.py), where an error ``main`` does not turn into a message raises and fails the test.
One case runs as the user runs it, ``python -m dew`` in a subprocess, to see the whole stderr.
"""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from dew.cli import convert
from dew.quiet_libtpu import tpu_attached
from dew.targets import COMPILE_ONLY_ENVIRONMENT
from tests.helpers import child_env

HF = Path(__file__).resolve().parent / "data" / "hf"
TIED = HF / "llama3_tied"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """``{name: path}``: the tied reference model (``tied``), it converted to a Dew checkpoint
    (``ckpt``), that checkpoint with its index damaged (``corrupt``), an empty folder."""
    root = tmp_path_factory.mktemp("cli_errors")
    convert.to_checkpoint(TIED, root / "ckpt")
    corrupt = root / "corrupt"
    convert.to_checkpoint(TIED, corrupt)
    (corrupt / "step_00000000" / "index.json").write_text("not json")
    (root / "empty").mkdir()
    return {"tied": TIED, "ckpt": root / "ckpt", "corrupt": corrupt, "empty": root / "empty"}


# (command line, with {name} for a path of ``folders`` or the test's own {tmp}; what the line says)
BAD_INPUTS = [
    # The table: a file for --init-from, a step the run lacks, a corrupt checkpoint.
    ("train --init-from {tied}/model.safetensors", "model.safetensors is a file; give the folder"),
    ("convert {ckpt} {tmp}/out --to hf --step 3", "has no step 3; its steps are 0"),
    ("train --init-from {corrupt}", "index.json: not valid JSON"),
    # --init-from's other edges.
    ("train --init-from {tmp}/nowhere", "nowhere: no such file or folder"),
    ("train --init-from {empty}", "is neither a Hugging Face model folder (no config.json) nor"),
    ("train --init-from {tied} --layers 4", "--layers 4 (it has 2 layers) disagrees with it"),
    ("train --init-from {tied} --width 32 --heads 4", "--width 32 (it has 64 width) disagrees"),
    (
        "train --init-from {tied} --model llama-3.2-1b",
        "--model llama-3.2-1b (vocab_size 128256 where it has 256, emb_features 2048 where it "
        "has 64, num_layers 16 where it has 2 and 5 more) disagrees with it",
    ),
    ("train --init-from {tied} --experts 4", "--experts 4 (it has 0 experts)"),
    (
        "train --init-from {tied} --seq-len 128",
        "--seq-len 128 is above the context of {tied}, 64 tokens (max_position_embeddings); "
        "give --extend-context",
    ),
    ("train --extend-context", "--extend-context lengthens the context of an --init-from model"),
    # dew convert's paths.
    ("convert {tmp}/nowhere {tmp}/ckpt", "nowhere does not exist"),
    ("convert {tied} {ckpt}", "already holds checkpoints [0]"),
    ("convert {ckpt}/step_00000000/index.json {tmp}/out --to hf", "index.json is a file"),
    ("convert {empty} {tmp}/out --to hf", "holds no Dew checkpoint"),
    # A flag another --to would take is refused, not ignored.
    ("convert {ckpt} {tmp}/out --to peft --dtype bfloat16", "--dtype applies to --to dew only"),
    (
        "convert {ckpt} {tmp}/out --to peft --max-shard-bytes 1000",
        "--max-shard-bytes applies to --to hf only, not --to peft; leave it out",
    ),
    (
        "convert {tied} {tmp}/c --step 3",
        "--step applies to --to hf or --to peft only, not --to dew",
    ),
    # One of every other command.
    ("train --cpu-devices -1", "--cpu-devices must be >= 0, got -1"),
    ("train --steps 0", "--steps must be an integer >= 1, got 0"),
    # Named by the flag the user typed, not the argument it becomes (issue 52).
    ("train --warmup-steps 30 --steps 10", "--warmup-steps 30 is above --steps 10"),
    ("train --lr-schedule cosine --lr-min 0.1", "--lr-min 0.1 is above --lr 0.001"),
    ("train --lr -1e-3", "--lr must be a number above 0, got -0.001"),
    ("train --seq-len 0", "--seq-len must be an integer >= 1, got 0"),
    ("collectives --seq-len -8", "--seq-len must be an integer >= 1, got -8"),
    ("bench --layers 0", "--layers must be an integer >= 1, got 0"),
    ("train --log-every 0", "--log-every must be an integer >= 1, got 0"),
    ("train --accumulation 0", "--accumulation must be an integer >= 1, got 0"),
    (
        "train --eval-every 5 --eval-batches 100 --run-dir {tmp}/run",
        "--eval-every evaluates on --eval-batches 100 of --batch 16 rows, 1600 windows of "
        "--seq-len 32, and val.bin in {tmp}/run/corpus holds 60: give --eval-batches 3 or fewer",
    ),
    ("train --attention-window 0", "--attention-window must be an integer >= 1, got 0"),
    ("plan --target v5e-1 --attention-window 0", "--attention-window must be an integer >= 1"),
    # The library's messages name its arguments (num_heads, Layout.min_shard); dew says the flags.
    (
        "train --experts 4 --experts-per-token 5",
        "--experts-per-token 5 must be an integer from 1 to --experts 4",
    ),
    ("bench --experts 4 --moe-every 0", "--moe-every must be an integer >= 1, got 0"),
    ("train --loss-chunk 0", "--loss-chunk must be an integer >= 1, got 0"),
    (
        "train --experts 4 --capacity-factor -1",
        "--capacity-factor must be above 0 (leave it out for the default), got -1",
    ),
    ("bench --repeats 0", "--repeats must be an integer >= 1, got 0"),
    ("bench --warmup -1", "--warmup must be an integer >= 0, got -1"),
    ("plan --target v5e-8 --mesh fsdp=8 --accumulation 0", "--accumulation must be an integer"),
    ("train --min-shard -1", "--min-shard must be an integer >= 0, got -1"),
    ("train --sequence-parallel", "--sequence-parallel needs a tensor axis above 1"),
    ("collectives --mesh tensor=8 --heads 2", "--heads 2 does not split over tensor 8"),
    ("train --mesh stage=2", "--mesh stage=2 needs microbatches=M (M >= 2)"),
    (
        "train --mesh data=8 --batch 24 --accumulation 2",
        "--batch 24 over 8 devices (data 8 x fsdp 1) leaves 3 rows per device, which do not "
        "split into --accumulation 2 microbatches",
    ),
    ("train --data {tied}/config.json", "--data {tied}/config.json is a file: give a token folder"),
    ("train --data {empty}", "--data {empty} holds no meta.json: give a token folder"),
    ("collectives --mesh bogus=2", "mesh entry 'bogus=2' is not AXIS=SIZE"),
    ("bench --mesh fsdp=3", "fsdp 3 = 3 devices does not divide the 8 devices"),
    ("plan --target v9z-8", "unknown TPU generation 'v9z'"),
    ("tokenize {tmp}/missing.txt --tokenizer bytes --out {tmp}/t", "missing.txt' does not exist"),
    # dew tokenize's flags, not dew.data.text's arguments (val_fraction, rows='pad', force=True).
    (
        "tokenize {tmp}/a.txt --tokenizer bytes --out {tmp}/t --val-fraction 1.5",
        "--val-fraction must be in [0, 1) (each document's chance of going to val.bin), got 1.5",
    ),
    (
        "tokenize {tmp}/a.txt --tokenizer bytes --out {tmp}/t --rows pad",
        "--rows pad needs --seq-len S",
    ),
    (
        "tokenize {tmp}/a.txt --tokenizer bytes --out {tmp}/t --seq-len 8",
        "--seq-len 8 is for --rows pad only (packed rows ignore it)",
    ),
    (
        "tokenize {tmp}/a.txt --tokenizer bytes --out {ckpt}",
        "--out {ckpt} already exists; give --force to replace it (a token folder only), or "
        "another --out",
    ),
    (
        "tokenize {tmp}/a.txt --tokenizer bytes --out {ckpt} --force",
        "--force replaces only a token folder, so it is left alone: give another --out",
    ),
    ("plot {tmp}/missing.jsonl", "missing.jsonl: no such metrics file"),
    ("launch --processes 0 -- python -c 1", "--processes must be an integer >= 1, got 0"),
]


@pytest.mark.parametrize("line, says", BAD_INPUTS, ids=[line for line, _ in BAD_INPUTS])
def test_a_users_mistake_is_one_line_and_exit_2(
    line, says, folders, dew_here, tmp_path, monkeypatch
):
    # dew plan's setup tells libtpu it only compiles: the variables are restored after.
    for name, value in COMPILE_ONLY_ENVIRONMENT.items():
        monkeypatch.setenv(name, value)
    paths = {**{k: str(v) for k, v in folders.items()}, "tmp": str(tmp_path)}
    args = line.format(**paths).split()
    run = dew_here(*args, cwd=tmp_path)
    assert run.returncode == 2, (line, run.stdout, run.stderr)
    assert "Traceback" not in run.stdout + run.stderr
    (message,) = run.stderr.splitlines()  # exactly one line
    assert message.startswith(f"dew {args[0]}: "), message
    assert says.format(**paths) in message, message


def test_the_one_line_is_all_a_user_sees(tmp_path):
    # As the user runs it: the whole stderr of the process is the one line.
    run = subprocess.run(
        [sys.executable, "-m", "dew", "train", "--init-from", str(TIED / "model.safetensors")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=child_env(),
        timeout=120,
    )
    assert run.returncode == 2, run.stderr
    assert run.stderr.splitlines() == [
        f"dew train: --init-from {TIED / 'model.safetensors'} is a file; give the folder of a "
        f"Hugging Face model (with its config.json) or a Dew checkpoint directory, e.g. "
        f"--init-from {TIED}"
    ], run.stderr


@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None or tpu_attached(),
    reason="libtpu's start-up errors come from libtpu on a machine without a TPU",
)
def test_importing_dew_quiets_libtpu_without_a_tpu(tmp_path):
    # JAX_PLATFORMS unset: JAX loads libtpu to look for a TPU. Without dew's settings it prints
    # about five lines of errors before falling back to the CPU.
    env = {k: v for k, v in child_env().items() if k not in COMPILE_ONLY_ENVIRONMENT}
    run = subprocess.run(
        [sys.executable, "-c", "import dew, jax; print(jax.devices()[0].platform)"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "cpu" and run.stderr == "", run.stderr


# What JAX raised from dew train's first step on a v5e chip (2026-12-06, `dew train --cpu-devices
# 0 --model gpt2-small --batch 44 --seq-len 1024`): the TPU compiler's refusal, word for word.
CHIP_REFUSAL = (
    "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
    "temporaries (16.00G) exceeds available HBM (15.75G)."
)
# The runtime's failed allocation, as dew bench's tests have it (a step that compiled).
RUNTIME_ALLOCATION = (
    "RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to allocate 9.20G. That was "
    "not possible. There are 3.10G free."
)


def _first_step_raises(monkeypatch, message: str) -> None:
    """The step raises XLA's ``message`` where XLA raises it: the TPU compiler's refusal from its
    compile (``dew train`` compiles the step before it allocates the weights), anything else from
    its first call, after a compile that succeeds (nothing else of ``fit`` is changed)."""
    from types import SimpleNamespace

    import jax

    from dew.training.step_memory import refused_for_memory
    from dew.training.trainer import Trainer

    def step(*_):
        raise jax.errors.JaxRuntimeError(message)

    sizes = ("argument", "output", "alias", "temp", "generated_code")
    analysis = SimpleNamespace(**{f"{size}_size_in_bytes": 0 for size in sizes})
    compiled = SimpleNamespace(memory_analysis=lambda: analysis)
    compile_ = step if refused_for_memory(message) else lambda: compiled
    step.lower = lambda *_: SimpleNamespace(compile=compile_)
    monkeypatch.setattr(Trainer, "train_step", lambda self, batch_size: step)


def test_a_step_that_does_not_fit_the_chip_is_one_line(dew_here, tmp_path, monkeypatch):
    from dew.cli import out_of_memory
    from dew.cli.main import build_parser

    _first_step_raises(monkeypatch, CHIP_REFUSAL)
    monkeypatch.setattr(out_of_memory, "tpu_target_name", lambda: "v5e-1")  # as on the chip
    line = "train --steps 1 --layers 2 --batch 48 --seq-len 32 --remat dots --run-dir {tmp}/run"
    run = dew_here(*line.format(tmp=tmp_path).split(), cwd=tmp_path)
    assert run.returncode == 2 and "Traceback" not in run.stdout + run.stderr
    (message,) = run.stderr.splitlines()
    assert message.startswith(
        "dew train: the step needs 16.00 GiB per device and the compiler lets a program use "
        "15.75 GiB of the device's memory (it refused the step); `dew plan --target v5e-1 "
        "--search --layers 2 --batch 48 --seq-len 32` compiles the layouts and recompute policies"
    ), message
    assert message.endswith(
        "or use --remat auto (the least recomputation that fits), a smaller --batch "
        "(--accumulation K keeps the batch) or more devices"
    ), message
    # The command it suggests is one dew takes, with this run's sizes and none of train's own.
    plan = message.split("`")[1].split()[1:]
    args = build_parser().parse_args(plan)
    assert (args.command, args.target, args.search) == ("plan", "v5e-1", True)
    assert (args.layers, args.batch, args.seq_len, args.remat) == (2, 48, 32, None)


def test_an_unrolled_step_that_does_not_fit_is_told_to_scan_first(dew_here, tmp_path, monkeypatch):
    _first_step_raises(monkeypatch, RUNTIME_ALLOCATION)
    line = "train --steps 1 --layers 2 --layer-loop unroll --run-dir run"
    run = dew_here(*line.split(), cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    assert run.stderr.splitlines() == [
        "dew train: the step ran out of device memory: it could not allocate 9.20 GiB; use "
        "--layer-loop scan, a smaller --batch (--accumulation K keeps the batch) or more devices"
    ]


def test_a_failed_allocation_and_any_other_xla_error(dew_here, tmp_path, monkeypatch):
    import jax

    _first_step_raises(monkeypatch, RUNTIME_ALLOCATION)
    run = dew_here("train", "--steps", "1", "--layers", "1", "--run-dir", "run", cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    # On CPU devices: no figure of the device's memory and no TPU target to plan for.
    assert run.stderr.splitlines() == [
        "dew train: the step ran out of device memory: it could not allocate 9.20 GiB; use "
        "a smaller --batch (--accumulation K keeps the batch) or more devices"
    ]
    # "full" (the example decoder's) already keeps the least: --remat auto is named only for a
    # policy that keeps more.
    run = dew_here(*"train --steps 1 --layers 1 --remat dots --run-dir run2".split(), cwd=tmp_path)
    assert run.stderr.splitlines() == [
        "dew train: the step ran out of device memory: it could not allocate 9.20 GiB; use "
        "--remat auto (the least recomputation that fits), a smaller --batch (--accumulation K "
        "keeps the batch) or more devices"
    ]
    # An XLA error that is not about memory stays a traceback: Dew's bug, not the user's batch.
    _first_step_raises(monkeypatch, "INTERNAL: something broke")
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        dew_here("train", "--steps", "1", "--layers", "1", "--run-dir", "run2", cwd=tmp_path)


def test_the_tpu_target_a_run_plans_for(monkeypatch):
    import jax

    from dew.cli.out_of_memory import tpu_target_name

    class Device:
        def __init__(self, kind):
            self.device_kind = kind

    for kind, count, expected in [
        ("TPU v5 lite", 1, "v5e-1"),
        ("TPU v5 lite", 8, "v5e-8"),
        ("TPU v5", 4, "v5p-8"),  # v5p-N counts TensorCores, two per chip
        ("TPU v5 lite", 3, None),  # no such slice
        ("cpu", 8, None),
    ]:
        monkeypatch.setattr(jax, "devices", lambda kind=kind: [Device(kind)])
        monkeypatch.setattr(jax, "device_count", lambda count=count: count)
        assert tpu_target_name() == expected, (kind, count)


def _flip_a_bit(folder: Path) -> None:
    """One bit of one weight of the Hugging Face folder ``folder``, changed in place."""
    from dew.models import safetensors

    path = folder / "model.safetensors"
    tensor = safetensors.Header.read(path).tensors["model.layers.0.mlp.down_proj.weight"]
    data = bytearray(path.read_bytes())
    data[tensor.offset] ^= 0x40
    path.write_bytes(bytes(data))


def test_a_resume_that_does_not_match_names_the_flags_and_the_ways_on(dew_here, tmp_path):
    """Resuming a LoRA run with other flags names each flag, the run's value and this command's,
    and the two ways on (issue 67: it printed ``.opt_state.mu['lora']...`` paths, and blamed
    "the flags that set its sizes or dtypes" when only the base's weights had changed)."""
    import shutil

    from dew.checkpoints import Checkpoints

    base, other = tmp_path / "base", tmp_path / "other"
    shutil.copytree(TIED, base)
    shutil.copytree(TIED, other)
    _flip_a_bit(other)
    run = ("train", "--seq-len", "16", "--batch", "8", "--run-dir", "run")
    lora = ("--lora-rank", "2")
    trained = dew_here(*run, *lora, "--init-from", str(base), "--steps", "1", cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr
    recorded = Checkpoints(tmp_path / "run" / "checkpoints").metadata()["lora_base"]["checksum"]
    ways_on = "or give another --run-dir to start a new run"
    every = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"  # PEFT's names, the default
    cases = [
        (
            (*lora, "--init-from", base, "--lora-targets", "q_proj,v_proj"),
            f"the run in run was trained with --lora-targets {every}, and this command gives "
            f"--lora-targets q_proj,v_proj: resume it with --lora-targets {every}, {ways_on}",
        ),
        (
            ("--init-from", base, "--lora-rank", "3"),
            "the run in run was trained with --lora-rank 2, and this command gives --lora-rank "
            f"3: resume it with --lora-rank 2, {ways_on}",
        ),
        (
            (*lora, "--init-from", base, "--base-dtype", "int8"),
            "the run in run was trained with no --base-dtype, and this command gives "
            f"--base-dtype int8: resume it with no --base-dtype, {ways_on}",
        ),
        (  # the adapters' scale is part of what they learned (the default alpha is 2 x rank)
            (*lora, "--init-from", base, "--lora-alpha", "6.5"),
            "the run in run was trained with --lora-alpha 4, and this command gives "
            f"--lora-alpha 6.5: resume it with --lora-alpha 4, {ways_on}",
        ),
        (
            (*lora, "--init-from", other),
            f"the run in run was trained on --init-from {base}, checksum {recorded}, and this "
            f"command's base, --init-from {other}, has checksum ",
        ),
        (
            (*lora, "--init-from", base, "--moments-dtype", "bfloat16"),
            "the run in run holds another training state than this command's",
        ),
    ]
    for given, says in cases:
        refused = dew_here(*run, *map(str, given), "--steps", "2", cwd=tmp_path)
        assert refused.returncode == 2, (given, refused.stderr)
        assert "Traceback" not in refused.stdout + refused.stderr
        (line,) = refused.stderr.splitlines()
        assert line.startswith(f"dew train: {says}"), (given, line)
        if "--run-dir" in says:  # a flag's value: read from the checkpoint, before compiling
            assert "compiling the step" not in refused.stdout, (given, refused.stdout)
    # The base's weights changed in place: said so, with both checksums (configuration-weights).
    _flip_a_bit(base)
    refused = dew_here(*run, *lora, "--init-from", str(base), "--steps", "2", cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr
    (line,) = refused.stderr.splitlines()
    then = f"dew train: the base --init-from {base} changed since the run in run was trained on it"
    assert line.startswith(f"{then} (its weights changed: checksum {recorded} then, "), line
    now = line.split(" then, ")[1].split(" now)")[0]
    assert now.split("-")[0] == recorded.split("-")[0] and now != recorded, (now, recorded)
    assert line.endswith(
        f"put back the base it was trained on to resume it, {ways_on} on this base"
    )


def test_an_empty_hostfile_and_a_metrics_line_without_a_step_say_what_was_typed(dew_here, tmp_path):
    (tmp_path / "hosts").write_text("# nobody\n")
    run = dew_here("launch", "--hostfile", "hosts", "--", "python", "-c", "1", cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    assert run.stderr.splitlines() == [
        "dew launch: --hostfile hosts names no host (one host name a line)"
    ]
    (tmp_path / "m.jsonl").write_text('{"loss": 1.5}\n')
    run = dew_here("plot", "m.jsonl", cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    (line,) = run.stderr.splitlines()
    assert "(every line of a metrics file of dew train --metrics has one)" in line, line
