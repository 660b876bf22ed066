"""What only a real TPU chip can show (every test here is marked ``tpu``; without a chip they skip,
so CI, on CPUs, stays green):

- Dew's Mosaic kernels, compiled for the chip, match a float64 reference at real sizes (grouped
  queries, odd lengths, causal and not), output and gradients, and with segment ids of packed
  documents and sliding windows at 2048 and 4096 positions;
- ``attention_impl="auto"`` runs Dew's Mosaic kernels on the chip, and its step gives the loss XLA's
  attention gives;
- the shard_map step equals the GSPMD step on the chip;
- the rotary embedding in float32 is exact on the chip (its swap of halves is a matmul, which a TPU
  would round to bfloat16 at the default precision);
- ``dew plan --target v5e-1``, which compiles the step for a chip this process does not use,
  predicts the temporaries of the same step compiled for the chip it runs on.

Run them on a machine with a TPU, in one process (only one process can hold the chip; ``-o
addopts=`` drops the suite's ``-n 3`` workers):

    DEW_TEST_TPU=1 python -m pytest -o addopts= -ra -m tpu tests/test_on_tpu.py

With Dew installed from a wheel over the machine's JAX (docs/benchmarks.md, "On a TPU machine"), the
clone's ``dew/`` folder must not come first (it holds no ``kernels/``) while ``tests`` must still
import: run Python with ``-P`` and give it a folder that holds only a link to ``tests/``:

    mkdir -p /tmp/troot && ln -sfn "$PWD/tests" /tmp/troot/tests
    DEW_TEST_TPU=1 PYTHONPATH=$PYTHONPATH:/tmp/troot python -P -m pytest -o addopts= -ra -m tpu \
        tests/test_on_tpu.py

``DEW_TEST_TPU=1`` makes tests/conftest.py leave JAX's platform alone and skip every test not
marked ``tpu``. The sizes are small (a few MiB of weights; one v5e chip has 16 GiB), nothing is
downloaded, and each test compiles at most three steps.
"""

import functools
import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dew
from dew.cli import plan as plan_command
from dew.cli.main import build_parser
from dew.kernels import flash_attention
from dew.nn import rotary
from dew.objectives.lm import LMObjective
from dew.targets import GENERATIONS, Target, target
from tests.equivalence import ROWS, sharded_run
from tests.helpers import fresh_batch, relative_error, seeded_key, smooth_optimizer
from tests.test_kernels import TOLERANCE, random_inputs, reference_attention
from tests.test_kernels import relative_error as kernel_relative_error
from tests.test_rotary import halves_rotation

# Relative, against float64. The output holds the CPU's 1e-5 on the chip (1e-6 measured). The
# gradients do not: on one v5e chip (2026-12-05) dq, dk and dv were 2.5e-5 to 2.9e-5 from float64
# in every case (these and bench/attention.py's checks), where TPU interpret mode on the CPU gives
# 3e-7 with the same kernels. The cause is in the chip's float32 arithmetic inside the backward and
# is not found yet (an lse computed by XLA rather than in the kernel changed nothing): this bound
# holds what was measured, about twice over, and is not the library's 1e-5.
KERNEL_OUT_TOL = TOLERANCE[jnp.float32]
KERNEL_GRAD_TOL = 5e-5

pytestmark = pytest.mark.tpu


@pytest.fixture(autouse=True)
def chip():
    """The chip this process runs on: a test that asked for one (DEW_TEST_TPU=1) and got another
    platform fails here, rather than passing on the CPU."""
    device = jax.devices()[0]
    assert device.platform == "tpu", (
        f"DEW_TEST_TPU=1, but JAX's first device is {device} ({device.platform}); is "
        "JAX_PLATFORMS set to something without tpu, or does another process hold the chip?"
    )
    return device


def decoder(seq_len: int, **choices) -> LMObjective:
    """A small decoder of shapes the TPU's tiles take whole (heads of 128 features, a vocabulary
    of 256) with ``choices`` (dtype, attention_impl), as the objective of rows of ``seq_len``."""
    config = dict(vocab_size=256, emb_features=256, num_layers=2, num_heads=2, max_seq_len=seq_len)
    return LMObjective(dew.models.build("causal_transformer", **config, **choices), seq_len)


def one_chip_trainer(objective, optimizer=None, **kwargs) -> dew.Trainer:
    return dew.Trainer(
        objective,
        optax.adamw(1e-3) if optimizer is None else optimizer,
        jax.random.key(0),
        devices=jax.devices()[:1],
        **kwargs,
    )


# ------------------------------------------------------------------------------ rotary


def test_rotary_in_float32_is_the_halves_formula_to_the_bit_on_the_chip(seed):
    print(f"seed {seed}")
    key_x, key_g = jax.random.split(jax.random.key(seed))
    x = 3 * jax.random.normal(key_x, (2, 512, 4, 128), jnp.float32)
    grad = jax.random.normal(key_g, x.shape, jnp.float32)
    positions = jnp.arange(512) + 1000
    out, vjp = jax.jit(lambda x: jax.vjp(lambda x: rotary.rotate(x, positions), x))(x)
    want, want_vjp = jax.jit(lambda x: jax.vjp(lambda x: halves_rotation(x, positions), x))(x)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(vjp(grad)[0]), np.asarray(want_vjp(grad)[0]))


# ------------------------------------------------------------------------------ the kernels

KERNEL_CASES = [
    # batch, q_len, kv_len, heads, kv_heads, head_dim, causal
    (1, 2048, 2048, 8, 2, 128, True),  # grouped queries, a key block of 2048 on the diagonal
    (1, 1000, 1537, 4, 4, 64, True),  # odd lengths, bottom-right causal, padded tails
    (2, 777, 777, 4, 1, 128, False),  # one kv head, no mask, an odd length
    (1, 4096, 4096, 2, 2, 128, True),  # several (512, 2048) causal blocks, with pieces
]


@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: "x".join(map(str, c)))
def test_kernels_match_float64_on_the_chip(chip, seed, case):
    """float32 out (within 1e-5, relative) and dq, dk, dv (within 5e-5: see KERNEL_GRAD_TOL) of
    the compiled Mosaic kernels against attention written from its formulas in float64
    (tests/test_kernels.py's reference, run on the host's CPU: the chip has no float64)."""
    batch, q_len, kv_len, heads, kv_heads, head_dim, causal = case
    rng = np.random.default_rng(seed)
    q, k, v, do = random_inputs(rng, batch, q_len, kv_len, heads, kv_heads, head_dim, np.float32)

    def kernel(q, k, v, do):
        out, vjp = jax.vjp(lambda q, k, v: flash_attention(q, k, v, causal=causal), q, k, v)
        return out, vjp(do)

    compiled = jax.jit(kernel).lower(q, k, v, do).compile()
    assert FORWARD in kernels_called(compiled), "not the Mosaic kernels"
    got = jax.tree.map(lambda x: np.asarray(x, np.float64), compiled(q, k, v, do))
    sm_scale = 1.0 / math.sqrt(head_dim)
    cpu = jax.devices("cpu")[0]
    with jax.enable_x64(True), jax.default_device(cpu):
        as64 = [jax.device_put(np.asarray(x, np.float64), cpu) for x in (q, k, v, do)]

        def reference(q, k, v, do):
            attend = functools.partial(reference_attention, causal=causal, sm_scale=sm_scale)
            out, vjp = jax.vjp(attend, q, k, v)
            return out, vjp(do)

        want = jax.tree.map(np.asarray, jax.jit(reference)(*as64))
    for name, g, w in zip(("out", "dq", "dk", "dv"), jax.tree.leaves(got), jax.tree.leaves(want)):
        error = kernel_relative_error(g, w)
        tol = KERNEL_OUT_TOL if name == "out" else KERNEL_GRAD_TOL
        assert error < tol, f"{name} of {case}: relative error {error:.3g} (seed {seed})"


SEGMENT_CASES = [
    # batch, seq, heads, kv_heads, head_dim, mean document length (0: one document), window
    (2, 2048, 8, 2, 128, 300, None),  # documents of random lengths, ids shuffled in row 1
    (1, 4096, 4, 2, 128, 0, 1024),  # a window of 1024 keys, no ids
    (1, 4096, 4, 4, 128, 300, 700),  # both
]


@pytest.mark.parametrize("case", SEGMENT_CASES, ids=lambda c: "x".join(map(str, c)))
def test_segment_ids_and_windows_match_float64_on_the_chip(chip, seed, case):
    """Segment ids and windows at real sizes, compiled for the chip: out, lse (within 1e-5),
    dq, dk, dv (within 5e-5) of `flash_attention_forward`'s vjp against the float64 reference of
    tests/test_kernel_segments.py (numpy on the host)."""
    from dew.kernels import flash_attention_forward
    from tests.test_kernel_segments import reference_with, visibility

    batch, seq, heads, kv_heads, head_dim, mean, window = case
    rng = np.random.default_rng(seed)
    q, k, v, do = random_inputs(rng, batch, seq, seq, heads, kv_heads, head_dim, np.float32)
    d_lse = rng.standard_normal((batch, heads, seq)).astype(np.float32)
    ids = np.zeros((batch, seq), np.int32)
    if mean:
        for b in range(batch):
            lengths = []
            while sum(lengths) < seq:
                lengths.append(int(rng.integers(1, 2 * mean)))
            labels = np.arange(len(lengths)) if b % 2 == 0 else rng.permutation(len(lengths))
            ids[b] = np.repeat(labels, lengths)[:seq]

    ids_args = (ids,) if mean else ()  # without documents, no ids at all

    def kernel(q, k, v, do, d_lse, *ids):
        attend = functools.partial(
            flash_attention_forward, segment_ids=ids[0] if ids else None, window=window
        )
        (out, lse), vjp = jax.vjp(attend, q, k, v)
        return out, lse, *vjp((do, d_lse))

    compiled = jax.jit(kernel).lower(q, k, v, do, d_lse, *ids_args).compile()
    assert FORWARD in kernels_called(compiled), "not the Mosaic kernels"
    got = [np.asarray(x, np.float64) for x in compiled(q, k, v, do, d_lse, *ids_args)]
    visible = visibility(ids, ids, seq, seq, window)
    want = reference_with(q, k, v, do, d_lse, visible, 1.0 / math.sqrt(head_dim))
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        error = kernel_relative_error(g, w)
        tol = KERNEL_OUT_TOL if name in ("out", "lse") else KERNEL_GRAD_TOL
        assert error < tol, f"{name} of {case}: relative error {error:.3g} (seed {seed})"


# ------------------------------------------------------------------------------ auto attention

SEQ = 512
BATCH = 8
FORWARD = "dew_flash_attention_forward"  # the Mosaic forward kernel's name in the HLO
LOSS_TOL = 1e-3  # relative: the Mosaic kernels' step against XLA attention's, in bfloat16


def kernels_called(compiled) -> set[str]:
    """The names of Dew's kernels (``dew_flash_attention_*``) among the compiled program's
    ``tpu_custom_call`` s: the Mosaic kernels (the CPU's interpreted form has none)."""
    calls = [line for line in compiled.as_text().splitlines() if "tpu_custom_call" in line]
    return {name for line in calls for name in re.findall(r"dew_flash_attention_\w+", line)}


def test_auto_attention_runs_the_mosaic_kernels_on_the_chip(chip, seed):
    auto = decoder(SEQ, dtype="bfloat16", attention_impl="auto")
    assert auto.model.attention_for(chip.platform) == "pallas", chip
    trainer = one_chip_trainer(auto)
    compiled = trainer.compiled_step(BATCH)
    # The forward kernel and a backward one: the backward's kernels (dq and dk/dv, or one fused
    # kernel) are the kernels' business, and may change.
    called = kernels_called(compiled)
    assert FORWARD in called and called - {FORWARD}, called

    # The step runs, and its loss is the loss of the same weights and batch with XLA's attention.
    # bfloat16 activations: the two differ by the rounding of attention's output, 2.5e-5 to 2.9e-5
    # of the loss (three seeds, one v5e chip, 2026-12-05), which LOSS_TOL holds 30 times over.
    tokens = fresh_batch(BATCH, seed, vocab=256, seq=SEQ)
    _, metrics = compiled(trainer.init_state(), trainer.device_batch(tokens, BATCH))
    xla = one_chip_trainer(decoder(SEQ, dtype="bfloat16", attention_impl="xla"))
    _, want = xla.train_step(BATCH)(xla.init_state(), xla.device_batch(tokens, BATCH))
    loss, want = float(metrics["loss"]), float(want["loss"])
    assert math.isfinite(loss) and abs(loss - want) <= LOSS_TOL * want, (loss, want, f"seed {seed}")


# ------------------------------------------------------------------------------ the two engines

ENGINE_SEQ = 256
# Relative, per leaf, as tests/equivalence.py's TOL on the CPU: float32 rounding. Every matmul runs
# at float32's precision ("highest"; at the chip's default precision a float32 matmul rounds its
# inputs to bfloat16, about 3 digits, and two programs that order a product's sums differently may
# part by far more than this). Measured on one v5e chip (2026-12-05): the two engines' losses,
# gradients, weights and optimizer state were bit for bit equal.
ENGINE_TOL = 1e-5


def test_the_shard_map_step_equals_the_gspmd_step_on_the_chip(seed):
    # Three steps of float32 training (auto attention: the Mosaic kernels in both programs), each
    # step's loss and gradients, then the weights and optimizer state, from the same key.
    objective = decoder(ENGINE_SEQ, attention_impl="auto")
    key = seeded_key(seed)
    batches = [fresh_batch(ROWS, (seed, i), vocab=256, seq=ENGINE_SEQ) for i in range(3)]
    with jax.default_matmul_precision("highest"):
        runs = {
            engine: sharded_run(
                objective,
                smooth_optimizer(),
                key,
                batches,
                dew.MeshSpec(),
                engine=engine,
                devices=jax.devices()[:1],
            )
            for engine in ("shard_map", "gspmd")
        }
    ours, xla = runs["shard_map"], runs["gspmd"]
    where = f"shard_map against gspmd on the chip, seed {seed}"
    assert relative_error(ours["initial"], xla["initial"]) == 0.0, where
    np.testing.assert_allclose(ours["losses"], xla["losses"], rtol=ENGINE_TOL, err_msg=where)
    for step, (a, b) in enumerate(zip(ours["grads"], xla["grads"], strict=True)):
        error = relative_error(a, b)
        assert error < ENGINE_TOL, f"gradients of step {step + 1} differ by {error:.3g}, {where}"
    for part in ("params", "opt_state"):
        error = relative_error(ours[part], xla[part])
        assert error < ENGINE_TOL, f"{part} after 3 steps differ by {error:.3g}, {where}"


# ------------------------------------------------------------------------------ dew plan


class AttachedChip(Target):
    """A one-chip ``Target`` whose device is the chip this process runs on, not libtpu's
    compile-only one: ``dew plan`` given it compiles the step for the real chip."""

    def devices(self) -> list:
        return jax.devices()[:1]


def one_chip_target(chip) -> Target:
    """``v5e-1`` on a v5e chip (``v6e-1`` on a v6e): the plan target of this chip alone."""
    kinds = {g.device_kind: g for g in GENERATIONS.values()}
    generation = kinds.get(chip.device_kind)
    if generation is None or generation.dims != 2:
        # v4 and v5p slices are counted in TensorCores, from 2 chips up: no one-chip target.
        pytest.skip(f"no one-chip plan target for {chip.device_kind!r}")
    return target(f"{generation.name}-1")


def plan_rows(argv, tmp_path, attached=None) -> list[dict]:
    """``dew plan ARGV --json FILE``'s rows, run by the command's own ``run`` in this process
    (``main`` would first set the process up for the CPU); with ``attached``, the target it asks
    for is that one."""
    path = tmp_path / ("attached.json" if attached else "planned.json")
    args = build_parser().parse_args(["plan", *argv, "--json", str(path)])
    with pytest.MonkeyPatch.context() as patch:
        if attached is not None:
            patch.setattr(dew.targets, "target", lambda name: attached)
        assert plan_command.run(args) == 0
    return json.loads(path.read_text())


@pytest.mark.parametrize(
    "flags",
    [
        pytest.param([], id="example-float32-xla"),
        pytest.param(
            ["--dtype", "bfloat16", "--attention", "auto", "--remat", "dots"],
            id="example-bfloat16-mosaic-dots",
        ),
    ],
)
def test_dew_plan_temporaries_equal_the_same_step_compiled_on_the_chip(chip, flags, tmp_path):
    # The same command twice: as a user runs it (libtpu's compile-only v5e-1), and with the target
    # swapped for this chip, so the model, batch, layout and optimizer are dew plan's in both.
    one = one_chip_target(chip)
    argv = ["--target", one.name, "--mesh", "data=1", *flags]
    (planned,) = plan_rows(argv, tmp_path)
    (attached,) = plan_rows(argv, tmp_path, AttachedChip("this chip", one.generation, one.shape))
    for row in (planned, attached):
        assert row["error"] is None and row["refused"] is None, row
    what = {k: (planned[k], attached[k]) for k in ("argument_bytes", "temp_bytes", "total_bytes")}
    assert planned["temp_bytes"] == attached["temp_bytes"], f"(planned, on the chip): {what}"
