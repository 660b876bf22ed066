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
    # One of every other command.
    ("train --cpu-devices -1", "--cpu-devices must be >= 0, got -1"),
    ("train --steps 0", "steps must be an integer >= 1, got 0"),
    ("collectives --mesh bogus=2", "mesh entry 'bogus=2' is not AXIS=SIZE"),
    ("bench --mesh fsdp=3", "fsdp 3 = 3 devices does not divide the 8 devices"),
    ("plan --target v9z-8", "unknown TPU generation 'v9z'"),
    ("tokenize {tmp}/missing.txt --tokenizer bytes --out {tmp}/t", "missing.txt' does not exist"),
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
