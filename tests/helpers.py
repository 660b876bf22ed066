"""Small builders shared by the tests."""

import functools
import os
import re

import jax
import numpy as np
import optax

import dew
from dew.objectives.lm import LMObjective

SEQ = 16
VOCAB = 64


# One of fit's log lines (Trainer.fit's log_every): "step N: loss L, T ms/step, K tokens/s", then
# ", MFU M% PaLM, C% causal-halved" where the device's peak is known (then " of the bf16 peak"
# for an int8 step); an MoE model's router statistics in parentheses after the loss;
# " (first step: includes compiling)" when the first step is the line's only one (" (first step:
# compiled ahead, includes warm-up)" where Trainer.compile_step or an earlier fit compiled it);
# then the gradients' global norm and, where the optimizer says it, the learning rate.
LOG_LINE = re.compile(
    r"step (?P<step>\d+): loss (?P<loss>\d+\.\d{4})(?: \([^)]*\))?, "
    r"(?P<ms>[\d,]+\.\d) ms/step, (?P<tokens_per_s>[\d,]+) tokens/s"
    r"(?:, MFU (?P<mfu>\d+\.\d)% PaLM, (?P<mfu_causal>\d+\.\d)% causal-halved"
    r"(?P<int8_peak> of the bf16 peak)?)?"
    r"(?: \(first step: (?P<compiled>includes compiling|compiled ahead, includes warm-up)\))?"
    r"(?:, grad norm (?P<grad_norm>[\d.e+-]+|nan|inf))?(?:, lr (?P<lr>[\d.e+-]+))?"
)


def parse_log_line(line: str) -> dict:
    """The numbers of one of fit's log lines: ``step``, ``loss``, ``ms`` (per step),
    ``tokens_per_s``, ``mfu`` and ``mfu_causal`` (in percent; ``None`` when the line has none),
    ``first`` (where the line's speed is the first step's alone, what its note says: ``"includes
    compiling"`` or ``"compiled ahead, includes warm-up"``; else ``None``), and ``grad_norm`` and
    ``lr`` as printed (text; ``None`` when the line has none); an ``AssertionError`` showing the
    line when it is not one."""
    found = LOG_LINE.fullmatch(line)
    assert found, f"not a log line of fit: {line!r}"

    def number(name):
        return float(found[name].replace(",", ""))

    return dict(
        step=int(found["step"]),
        loss=found["loss"],
        ms=number("ms"),
        tokens_per_s=number("tokens_per_s"),
        mfu=None if found["mfu"] is None else number("mfu"),
        mfu_causal=None if found["mfu_causal"] is None else number("mfu_causal"),
        first=found["compiled"],
        grad_norm=found["grad_norm"],
        lr=found["lr"],
    )


def assert_line_speed(line: dict, step_times, tokens: int, mfu_at=None, causal_at=None) -> None:
    """That ``line`` (``parse_log_line``'s) prints the speed of the steps that took
    ``step_times`` seconds each (their ``step_time_s``): their mean in ms, ``tokens`` (per step)
    over it, and ``mfu_at(seconds)`` and ``causal_at(seconds)`` (fractions: PaLM's MFU and the
    one with causal attention halved) at it, or no MFU when ``mfu_at`` is ``None``; each to the
    printed digit."""
    mean = sum(step_times) / len(step_times)
    what = f"{line} against step times {list(step_times)}"
    assert abs(line["ms"] - 1e3 * mean) <= 0.05 + 1e-9 * line["ms"], what
    assert abs(line["tokens_per_s"] - tokens / mean) <= 0.5 + 1e-9 * line["tokens_per_s"], what
    if mfu_at is None:
        assert line["mfu"] is None and line["mfu_causal"] is None, what
        return
    assert line["mfu"] is not None, what
    assert abs(line["mfu"] - 100 * mfu_at(mean)) <= 0.05 + 1e-9, what
    assert abs(line["mfu_causal"] - 100 * causal_at(mean)) <= 0.05 + 1e-9, what


def child_env() -> dict:
    """The environment of a child process that sets up its own devices (``dew``, a worker): this
    one's, less the device count, keeping the other XLA flags (conftest.py's faster compile).
    The platform stays the CPU off a TPU run: ``dew`` with no ``--cpu-devices`` takes an
    accelerator it finds (a GPU machine with JAX's plugin), and the tests' children run on
    simulated CPU devices, as this process does."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    if os.environ.get("DEW_TEST_TPU") != "1":
        env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = " ".join(
        f
        for f in os.environ.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    )
    return env


def tiny_objective(ema_decay=None, **overrides):
    config = dict(vocab_size=VOCAB, emb_features=32, num_layers=2, num_heads=4, max_seq_len=SEQ)
    config.update(overrides)
    return LMObjective(dew.models.build("causal_transformer", **config), SEQ, ema_decay=ema_decay)


def fresh_batch(rows, seed, vocab=VOCAB, seq=SEQ):
    """Random tokens ``[rows, seq + 1]`` int32 in ``[0, vocab)``, a function of ``seed`` alone.

    ``seed``: an int, or a tuple of ints to draw several independent batches from one test's seed
    (``fresh_batch(rows, (seed, i))``). Tests pass the ``seed`` fixture of tests/conftest.py, which
    is fresh each run, shown in the report of a failing test and replayed with ``DEW_SEED``.
    """
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, (rows, seq + 1)).astype(np.int32)


def seeded_key(seed, stream=0) -> jax.Array:
    """A PRNG key from a test's ``seed`` (below 2**31); each ``stream`` an independent key."""
    return jax.random.fold_in(jax.random.key(seed), stream)


def random_token_folder(path, seed, train: int, val: int):
    """Writes a token folder at ``path`` of ``train`` and ``val`` random tokens drawn from
    ``seed``; returns ``path``."""
    from dew.data import write_token_folder

    rng = np.random.default_rng(seed)
    write_token_folder(
        path, rng.integers(0, VOCAB, train), rng.integers(0, VOCAB, val), vocab_size=VOCAB
    )
    return path


def relative_error(actual, expected) -> float:
    """The largest, over the leaves, of ||actual - expected|| / ||expected||; ``inf`` when any
    leaf's error is not finite (a NaN must fail a ``< tolerance`` check, not pass it)."""
    worst = 0.0
    for a, e in zip(
        jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected), strict=True
    ):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        assert a.shape == e.shape, (a.shape, e.shape)
        error = float(np.linalg.norm(a - e) / max(np.linalg.norm(e), 1e-30))
        if not np.isfinite(error):
            return float("inf")
        worst = max(worst, error)
    return worst


def smooth_optimizer():
    """Momentum SGD with weight decay: an update that is a smooth function of the gradient. (Adam's
    first steps are close to sign(g), which turns float32 rounding of a near-zero gradient element
    into a full-size difference of the update, in any two correct implementations alike.)"""
    return optax.chain(optax.add_decayed_weights(1e-2), optax.sgd(0.1, momentum=0.9))


def two_process_trainer(mesh, checkpoint_dir=None):
    """The trainer of tests/test_multiprocess.py, built alike in its two processes and in the
    one-process run it is compared with."""
    import dew

    return dew.Trainer(
        tiny_objective(),
        smooth_optimizer(),
        jax.random.key(5),
        mesh=mesh,
        layout=dew.Layout(min_shard=1),
        checkpoints=None if checkpoint_dir is None else dew.Checkpoints(checkpoint_dir),
    )


def one_device_and_mesh_gradients(trainer, batch):
    """``(path, one_device, on_mesh)`` numpy arrays for each weight: the gradient of
    ``trainer.objective``'s loss over ``batch`` (``[rows, seq + 1]`` tokens) from the initial
    weights of ``jax.random.key(0)`` (the key ``trainer`` must be built with), on one device and
    on ``trainer``'s mesh. ``path`` is the weight's key path."""
    objective = trainer.objective
    one = jax.devices()[0]
    params = jax.jit(objective.model.init)(jax.device_put(jax.random.key(0), one))
    expected = jax.jit(jax.grad(objective.loss))(params, jax.device_put(batch, one))
    state = trainer.init_state()
    rows = np.asarray(batch)
    grads, _ = trainer.gradients(state.params, trainer.device_batch(rows, rows.shape[0]))
    out = []
    for path, a in jax.tree_util.tree_leaves_with_path(expected):
        b = functools.reduce(lambda tree, key: tree[key.key], path, grads)
        out.append((path, np.asarray(a), np.asarray(b)))
    return out


# The decoders of the gradient-sum tests (test_tpu_gradient_sums, test_gradient_sum_dtype,
# test_fsdp_matmul): 2 layers of 4 heads over a 256-token vocabulary, rows of 32 tokens, and a
# width of the test's choosing (the TPU compiles find the compiler's rewrites at 512 and 1024).
WIDE_SEQ = 32
WIDE_VOCAB = 256


def width_objective(width, dtype="float32", **overrides):
    config = dict(
        dtype=dtype,
        vocab_size=WIDE_VOCAB,
        emb_features=width,
        num_layers=2,
        num_heads=4,
        max_seq_len=WIDE_SEQ,
    )
    config.update(overrides)
    return LMObjective(dew.models.build("causal_transformer", **config), WIDE_SEQ)


def tpu_width_step(slice_, width, mesh, fsdp_scheme="gather", gradient_sum_dtype=None):
    """``(trainer, compiled)``: ``width_objective(width, "bfloat16")`` on the TPU slice ``slice_``
    (compile only), mesh ``mesh`` (a tuple of ``(axis, size)``), ``min_shard=4096``, and its step
    on 16 rows compiled for that slice. Cached: the TPU compile tests of several files read the
    same few steps, and they run in one worker (xdist group ``tpu``), where a step compiled for a
    TPU is not read back from the compilation cache but compiled again (4 to 10 s each)."""
    return _tpu_width_step(slice_, width, tuple(mesh), fsdp_scheme, gradient_sum_dtype)


@functools.cache  # every argument given, so that a defaulted one keys the same step
def _tpu_width_step(slice_, width, mesh, fsdp_scheme, gradient_sum_dtype):
    from dew.parallel.options import StepOptions
    from dew.targets import target

    trainer = dew.Trainer(
        width_objective(width, "bfloat16"),
        optax.adamw(1e-3),
        jax.random.key(0),
        mesh=dew.MeshSpec(**dict(mesh)),
        layout=dew.Layout(min_shard=4096),
        devices=target(slice_).devices(),
        options=StepOptions(fsdp_scheme=fsdp_scheme, gradient_sum_dtype=gradient_sum_dtype),
    )
    return trainer, trainer.compiled_step(16)


def width_batch(seed, rows=16, attempt=0) -> jax.Array:
    """``[rows, WIDE_SEQ + 1]`` random tokens of ``width_objective``'s vocabulary, drawn from
    ``seed`` (and, past the first, from ``attempt``: an MoE test's draw away from routing ties,
    tests/equivalence.away_from_ties)."""
    key = jax.random.key(seed)
    key = jax.random.fold_in(key, attempt) if attempt else key
    return jax.random.randint(key, (rows, WIDE_SEQ + 1), 0, WIDE_VOCAB)
