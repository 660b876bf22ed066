"""One contestant: a layout and an engine training the benchmarked model, and what it measures.

A ``Contestant`` builds its ``Trainer``, state and batch (``prepare``), compiles its step
(``compile``: the compile time, the temporary memory and the collectives), and runs steps when its
turn comes (``run``); ``result`` turns what it measured into a ``Result``:

- ``step_ms``: the median wall time of one training step, blocked until the new state and the loss
  are ready;
- ``compile_s``: trace, lower and compile of the step;
- ``state_bytes_per_device``: the bytes of the train state (weights, optimizer moments, EMA, key)
  that one device holds, the most any device holds;
- ``temp_bytes_per_device``: the compiled step's temporary memory (``memory_analysis()``);
- ``wire_bytes``: bytes one device sends per step, read from the compiled step's HLO by
  ``dew.collectives.hlo_collectives`` (the same reader for every engine, so they compare byte for
  byte); ``collectives``: the collective calls the compiled step runs;
- ``tokens_per_s`` (the batch's tokens over ``step_ms``) and ``mfu``: the model's FLOPs per second
  per device (PaLM's count, ``dew.training.flops``) over the device's peak, where Dew knows the
  device (an NVIDIA GPU or a TPU; ``None`` on a CPU).

Between its turns a contestant holds nothing on the devices: ``prepare`` parks the state it
builds in host memory (``park``), and ``run`` puts it back, runs its steps and parks it again, so
contestants that each fit a device alone also fit one after another. Its compiled step stays.

A contestant that does not fit (the compiler refuses its step, or placing its state or running a
step runs out of device memory: ``out_of_memory``) is a ``DidNotFit`` row instead of a ``Result``:
what it needed (``needed_bytes``) and what the device has (``device_bytes``).

Which contestants run, and in what order, is ``dew.benchmark.rounds``'s business.

Layout: the benchmarked model (``ModelSize``); the two kinds of row (``Result``, ``DidNotFit``) and
the reading of an out-of-memory error (``out_of_memory``, ``figures_in``, ``device_memory``); the
rows' names (``layout_name``, ``row_name``); two measurements (``state_bytes_per_device``,
``measured_bubble``); parking a state in host memory (``Parked``, ``park``, ``unpark``, ``free``);
and ``Contestant``, built on them. It is one module because a contestant's build, its compile, its
timed rounds and its out-of-memory row share one ``Trainer`` and its parked state; the rounds' order
lives in ``dew.benchmark.rounds``.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dew.checks import positive_int
from dew.collectives import hlo_collectives
from dew.layout import Layout
from dew.mesh import MeshSpec
from dew.parallel import pipeline
from dew.parallel.options import StepOptions
from dew.training import flops
from dew.training.step_memory import program_bytes, refused_for_memory
from dew.training.trainer import Trainer

# The engine name of the one-device row: the model and global batch on one device, a plain
# ``jit`` with no mesh to split over (on simulated CPU devices, which share the machine's cores,
# the compute limit).
ONE_DEVICE = "one_device"


@dataclasses.dataclass(frozen=True)
class ModelSize:
    """The benchmarked decoder (``causal_transformer``, byte vocabulary) and its batch.

    The default is larger than the notebook's example: 4,262,144 weights, 4096 tokens a step;
    8 heads of 32, so that the heads, the MLP width (1024) and the vocabulary split over up to 8
    tensor devices.
    """

    layers: int = 4
    width: int = 256
    heads: int = 8
    seq_len: int = 128
    batch: int = 32
    vocab: int = 256
    # A mixture of experts: ``moe`` holds ``build``'s MoE arguments (``num_experts``,
    # ``experts_per_token``, ``moe_every``, ``capacity_factor``, and ``expert_exchange`` and
    # ``expert_buffer_factor`` when given); empty for a dense model.
    moe: tuple = ()
    # The rest of ``build``'s shape arguments (``num_kv_heads``, ``mlp_features``,
    # ``tie_embeddings``), as a preset gives them; empty for the model's defaults.
    shape: tuple = ()

    def __post_init__(self):
        for name in ("layers", "width", "heads", "seq_len", "batch", "vocab"):
            positive_int(f"ModelSize.{name}", getattr(self, name))
        object.__setattr__(self, "moe", tuple(sorted(dict(self.moe).items())))
        object.__setattr__(self, "shape", tuple(sorted(dict(self.shape).items())))

    @classmethod
    def of(cls, config: dict, batch: int, seq_len: int | None = None) -> "ModelSize":
        """The size of ``build("causal_transformer", **config)``
        (``dew.cli.model_flags.model_config``) on global batches of ``batch`` rows of ``seq_len``
        tokens (default: the model's ``max_seq_len``)."""
        config = dict(config)
        context = config.pop("max_seq_len")
        sizes = dict(
            layers=config.pop("num_layers"),
            width=config.pop("emb_features"),
            heads=config.pop("num_heads"),
            seq_len=context if seq_len is None else seq_len,
            vocab=config.pop("vocab_size"),
        )
        moe_keys = (
            "num_experts",
            "experts_per_token",
            "moe_every",
            "capacity_factor",
            "expert_exchange",
            "expert_buffer_factor",
        )
        moe = {k: config.pop(k) for k in moe_keys if k in config}
        return cls(**sizes, batch=batch, moe=moe, shape=config)

    def objective(self, **overrides):
        """The ``LMObjective`` of this model, with ``overrides`` of ``build``'s arguments (a
        variant: ``remat="dots"``); raises ``ValueError`` on sizes the model refuses."""
        from dew import models
        from dew.objectives.lm import LMObjective

        model = models.build(
            "causal_transformer",
            vocab_size=self.vocab,
            emb_features=self.width,
            num_layers=self.layers,
            num_heads=self.heads,
            max_seq_len=self.seq_len,
            **{**dict(self.moe), **dict(self.shape), **overrides},
        )
        return LMObjective(model, self.seq_len)


@dataclasses.dataclass(frozen=True)
class Result:
    """One contestant's measurements (see the module docstring); a row of the table and of the
    ``--json`` file."""

    layout: str
    engine: str
    step_ms: float
    compile_s: float
    state_bytes_per_device: int
    temp_bytes_per_device: int
    wire_bytes: int
    collectives: int
    steps_timed: int
    round_ms: tuple[float, ...] = ()  # the median step of each timed round, in round order
    sequence_parallel: bool = False  # sequence-parallel activations were in effect
    # The shard_map step's attention scheme over a sequence axis above 1; None elsewhere.
    sequence_scheme: str | None = None
    # Over a stage axis above 1: the microbatches (every engine's row), and for the shard_map
    # step its schedule, the formula's bubble, the measured one and the 2M twin's step time
    # (``dew.benchmark.rounds``); None elsewhere.
    microbatches: int | None = None
    pipeline_schedule: str | None = None
    bubble_formula: float | None = None
    bubble_measured: float | None = None
    double_step_ms: float | None = None
    # The step's speed (``dew.training.flops.throughput``): tokens per second, and the model
    # FLOPs per second over the devices' peak where Dew knows the device (None on a CPU).
    tokens_per_s: float | None = None
    mfu: float | None = None
    # The same with causal attention's FLOPs halved (MaxText's count: dew.training.flops).
    mfu_causal: float | None = None
    # The model's choices this row ran with where several were compared (``dew bench --attention
    # xla cudnn``): ``"attention_impl=cudnn"``; empty when one model ran.
    variant: str = ""

    @property
    def name(self) -> str:
        """The layout, and the sequence scheme and pipeline schedule where there are:
        ``row_name``."""
        return row_name(self.layout, self.sequence_scheme, self.pipeline_schedule, self.variant)

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "fits": True}


# Where a contestant ran out of device memory (``DidNotFit.failed_at``): the compiler refused its
# step, or building or placing its state, or running a step, ran out.
COMPILE, PREPARE, RUN = "compile", "prepare", "run"
_FAILED_AT = {
    COMPILE: "refused by the compiler",
    PREPARE: "out of memory building its state",
    RUN: "out of memory running a step",
}


@dataclasses.dataclass(frozen=True)
class DidNotFit:
    """A contestant that did not fit its devices' memory: a row of one line in the table, and an
    object with ``"fits": false`` in the ``--json`` file.

    ``needed_bytes``: what its step needs on one device, by the compiled step's
    ``memory_analysis()`` (``dew.training.step_memory.program_bytes``: arguments + outputs -
    donated + temporaries + code) where it compiled, else the figure the error states (the TPU
    compiler's ``HLO temporaries (X)`` or ``Used X of Y hbm``, the runtime's ``allocate X``);
    ``None`` when neither says.
    ``device_bytes``: the device's memory, ``memory_stats()["bytes_limit"]`` where the backend
    reports it, else the figure the error states, else ``None``. ``failed_at``: ``COMPILE``,
    ``PREPARE`` or ``RUN``; ``error``: the first line of the error.
    """

    layout: str
    engine: str
    needed_bytes: int | None
    device_bytes: int | None
    failed_at: str
    error: str
    sequence_parallel: bool = False
    sequence_scheme: str | None = None
    microbatches: int | None = None
    pipeline_schedule: str | None = None
    variant: str = ""

    @property
    def name(self) -> str:
        """As ``Result.name``."""
        return row_name(self.layout, self.sequence_scheme, self.pipeline_schedule, self.variant)

    @property
    def verdict(self) -> str:
        """``"does not fit: needs 20.47 GiB per device, the device has 15.75 GiB (refused by
        the compiler)"``; a figure not known is ``?``."""
        return (
            f"does not fit: needs {bytes_text(self.needed_bytes)} per device, the device has "
            f"{bytes_text(self.device_bytes)} ({_FAILED_AT[self.failed_at]})"
        )

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "fits": False}


def fitted(rows) -> list[Result]:
    """The rows of contestants that ran (``Result`` s), the ``DidNotFit`` ones left out."""
    return [r for r in rows if isinstance(r, Result)]


def out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is XLA saying a program does not fit its device's memory: a
    ``jax.errors.JaxRuntimeError`` (the compiler's refusal and the runtime's failed allocation
    alike) whose message says ``RESOURCE_EXHAUSTED`` or ``out of memory``."""
    if not isinstance(error, jax.errors.JaxRuntimeError):
        return False
    message = str(error)
    return "RESOURCE_EXHAUSTED" in message or "out of memory" in message.lower()


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
# The runtime's failed allocation: "Attempting to allocate 9.20G." (TPU), "while trying to
# allocate 123456 bytes" (GPU).
_ALLOCATION = re.compile(r"allocate (\d+(?:\.\d+)?)\s?([KMGT]?)")


def figures_in(message: str) -> tuple[int | None, int | None]:
    """``(bytes needed, bytes available)`` as an out-of-memory ``message`` states them: the
    compiler's refusal gives both (``dew.training.step_memory.refused_for_memory``), the
    runtime's failed allocation the one allocation it could not make; ``None`` for what it does
    not state."""
    refused = refused_for_memory(message)
    if refused is not None:
        return refused
    m = _ALLOCATION.search(message)
    return (int(float(m.group(1)) * _UNITS[m.group(2)]) if m else None), None


def device_memory(device) -> int | None:
    """``device``'s memory in bytes, ``memory_stats()["bytes_limit"]``, where its backend reports
    it (a TPU or GPU; a CPU reports nothing): ``None`` elsewhere."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001  (a backend without the call: the figure is unknown)
        return None
    limit = (stats or {}).get("bytes_limit")
    return None if limit is None else int(limit)


def bytes_text(n: int | None) -> str:
    """``16911433728`` -> ``"15.75 GiB"``, in GiB, MiB or KiB, whichever leaves at least 1
    (KiB below 1 MiB); ``"?"`` for ``None``."""
    if n is None:
        return "?"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n / 2**10:.2f} KiB"


def layout_name(mesh_shape: dict, microbatches: int | None = None) -> str:
    """``{"data": 2, "fsdp": 4, ...}`` -> ``"data=2,fsdp=4"`` (axes of size 1 left out), and
    ``",microbatches=M"`` after them when ``microbatches`` is given."""
    parts = [f"{axis}={size}" for axis, size in mesh_shape.items() if size > 1]
    if microbatches is not None:
        parts.append(f"microbatches={microbatches}")
    return ",".join(parts) or "data=1"


def row_name(
    layout: str,
    sequence_scheme: str | None,
    pipeline_schedule: str | None = None,
    variant: str = "",
) -> str:
    """``("sequence=8", "all_to_all")`` -> ``"sequence=8 (all_to_all)"``, ``("stage=4,
    microbatches=8", None, "1f1b")`` -> ``"stage=4,microbatches=8 (1f1b)"``; the layout alone when
    both are ``None``; the model's ``variant`` after it in brackets (``"fsdp=8
    [remat=dots]"``). Tells a layout's contestants apart in the table and the targets."""
    variants = [v for v in (sequence_scheme, pipeline_schedule) if v is not None]
    name = f"{layout} ({', '.join(variants)})" if variants else layout
    return f"{name} [{variant}]" if variant else name


def variant_text(overrides: dict) -> str:
    """``{"remat": "dots", "attention_impl": "xla"}`` -> ``"attention_impl=xla, remat=dots"``."""
    return ", ".join(f"{k}={v}" for k, v in sorted(overrides.items()))


def state_bytes_per_device(state) -> int:
    """The bytes of ``state``'s arrays that one device holds: the most any device holds."""
    per_device: dict = {}
    for leaf in jax.tree_util.tree_leaves(state):
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        for shard in leaf.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values(), default=0)


def measured_bubble(step_m: float, step_2m: float) -> float:
    """The idle share of a pipeline step of ``M`` microbatches that took ``step_m``, when the same
    pipeline with ``2M`` microbatches of the same size took ``step_2m``: ``2 - step_2m /
    step_m`` (``T(M) = M c + b``: the ``M`` more microbatches cost ``M c = step_2m - step_m``,
    the rest of ``step_m`` is the bubble and the step's fixed work). ``(S - 1) / (M + S - 1)``
    for ``T(M) = (M + S - 1) c``."""
    return 2.0 - step_2m / step_m


@dataclasses.dataclass
class Parked:
    """A tree of arrays in host memory (NumPy copies), to be put back in the same layout.

    ``arrays``: the tree's leaves, a typed PRNG key as its key data (``jax.device_get`` would
    leave a key on its devices); ``key_impls``: per leaf, the key's implementation where the leaf
    was a key, else ``None``; ``treedef``: the tree's structure.
    """

    treedef: Any
    arrays: list
    key_impls: list

    def tree(self):
        """The parked tree of NumPy arrays, each key as its key data: to read, not to run."""
        return self.treedef.unflatten(self.arrays)


def park(tree) -> Parked:
    """``tree``'s arrays copied to host memory. The copies own their bytes (on a CPU,
    ``jax.device_get`` gives a view of the device buffer), so the device arrays can be freed."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    keys = [jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key) for leaf in leaves]
    data = [jax.random.key_data(a) if key else a for a, key in zip(leaves, keys)]
    host = [np.array(a, copy=True) for a in jax.device_get(data)]
    impls = [jax.random.key_impl(a) if key else None for a, key in zip(leaves, keys)]
    return Parked(treedef, host, impls)


def unpark(parked: Parked, shardings):
    """The parked tree on the devices again, each array laid out by its entry of
    ``shardings`` (a tree of the same structure), a key wrapped again; waited for, so a step
    timed next does not time the copy. The device arrays are copies (``may_alias=False``): a step
    that donates them writes into device memory, never into the host's."""
    placed = jax.device_put(parked.arrays, parked.treedef.flatten_up_to(shardings), may_alias=False)
    leaves = [
        a if impl is None else jax.random.wrap_key_data(a, impl=impl)
        for a, impl in zip(placed, parked.key_impls)
    ]
    return jax.block_until_ready(parked.treedef.unflatten(leaves))


def free(tree) -> None:
    """Frees the device buffers of ``tree``'s arrays now (deleted or donated ones are skipped),
    rather than when the last reference goes: an exception's traceback can hold one."""
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, jax.Array) and not leaf.is_deleted():
            leaf.delete()


class Contestant:
    """One layout and engine: its trainer, compiled step, parked state, batch and step times.

    ``engine=ONE_DEVICE`` is the one-device row: the GSPMD step (a plain ``jit``) on a mesh of the
    first device alone, whatever ``mesh`` says. ``options`` go to the ``Trainer`` as they are, and
    it refuses what cannot run or take effect on ``mesh`` (``StepOptions.check``; the GSPMD engines
    and the one-device row take only the default): ``dew.benchmark.rounds.options_for`` keeps, of
    the options a benchmark asks for, the ones a contestant's layout has the axes for.

    c = Contestant(size.objective(), size, MeshSpec(fsdp=8), "shard_map")
    c.prepare(); c.compile()      # the state parked in host memory
    seconds = c.run(steps=3)      # wall time of each step; on the devices for this call only
    result = c.result()           # after some run()s
    """

    def __init__(
        self,
        objective,
        size: ModelSize,
        mesh: MeshSpec,
        engine: str,
        min_shard: int = Layout().min_shard,
        seed: int = 0,
        options: StepOptions = StepOptions(),
        variant: str = "",
    ):
        one_device = engine == ONE_DEVICE
        self.trainer = Trainer(
            objective,
            optax.adamw(1e-3),
            key=jax.random.key(seed),
            mesh=MeshSpec() if one_device else mesh,
            layout=Layout(min_shard=min_shard),
            engine="gspmd" if one_device else engine,
            devices=jax.devices()[:1] if one_device else None,
            options=options,
        )
        self.trainer.check_batch(size.batch)
        self.size = size
        self.seed = seed
        self.engine = engine
        self.options = options
        mesh_shape = dict(self.trainer.mesh.shape)
        self.microbatches = self.trainer.microbatches if mesh_shape["stage"] > 1 else None
        self.layout = layout_name(mesh_shape, self.microbatches)
        # Contestants of one group (a mesh, whatever its microbatches) run back to back.
        self.group = (layout_name(mesh_shape), one_device, variant)
        # What the row records: the Trainer took the options only where they take effect, so
        # sequence_parallel is in effect as given; the scheme and schedule are named only where
        # there is an axis for them.
        shard_map = engine == "shard_map"
        self.sequence_parallel = options.sequence_parallel
        self.sequence_scheme = (
            options.sequence_scheme if shard_map and mesh_shape["sequence"] > 1 else None
        )
        self.pipeline_schedule = (
            options.pipeline_schedule if shard_map and mesh_shape["stage"] > 1 else None
        )
        self.variant = variant
        self.name = row_name(self.layout, self.sequence_scheme, self.pipeline_schedule, variant)
        # The shard_map pipeline's twin at twice the microbatches and batch (set by
        # ``dew.benchmark.rounds``), whose step time gives ``bubble_measured``.
        self.twin: Contestant | None = None
        self.times: list[float] = []
        self.rounds: list[float] = []

    def prepare(self) -> None:
        """Builds the state and a fixed random batch, and parks them in host memory: between
        turns the contestant holds nothing on its devices. Its small compile also warms JAX up,
        which a step's compile time would otherwise pay for in whichever contestant comes
        first."""
        trainer, size = self.trainer, self.size
        state = trainer.init_state()
        self.state_bytes = state_bytes_per_device(state)
        self.parked = park(state)
        free(state)
        self.rows = (
            np.random.default_rng(self.seed)
            .integers(0, size.vocab, (size.batch, size.seq_len + 1))
            .astype(np.int32)
        )

    def compile(self) -> None:
        """Traces, lowers and compiles the step (timed), and reads its memory and collectives."""
        trainer, size = self.trainer, self.size
        began = time.perf_counter()
        self.compiled = trainer.compiled_step(size.batch)
        self.compile_s = time.perf_counter() - began
        self.temp_bytes = int(self.compiled.memory_analysis().temp_size_in_bytes)
        self.report = hlo_collectives(self.compiled, trainer.mesh)

    def run(self, steps: int, record: bool = True) -> list[float]:
        """One turn (after ``prepare`` and ``compile``): puts the parked state and the batch on
        the devices (untimed), runs ``steps`` steps, and parks the new state again. The wall time
        of each step, in seconds, also kept for ``result`` when ``record``. Whatever a step
        raises, the contestant's device buffers are freed before it propagates; the parked state
        is then the one from before the turn."""
        state = batch = None
        try:
            state = unpark(self.parked, self.trainer.state_shardings)
            batch = self.trainer.device_batch(self.rows, self.size.batch)
            state, times, loss = self._steps(state, batch, steps)
            self.parked = park(state)
        finally:
            free((state, batch))
        if not np.isfinite(loss):
            raise FloatingPointError(f"{self.name} {self.engine}: the loss is {loss}")
        if record:
            self.times.extend(times)
            self.rounds.append(statistics.median(times))
        return times

    def _steps(self, state, batch, steps: int):
        """``(state, seconds of each step, last loss)`` after ``steps`` steps from ``state``."""
        times = []
        for _ in range(steps):
            began = time.perf_counter()
            state, metrics = self.compiled(state, batch)
            jax.block_until_ready((state, metrics))
            times.append(time.perf_counter() - began)
        return state, times, float(metrics["loss"])

    def did_not_fit(self, error: BaseException, failed_at: str) -> DidNotFit:
        """This contestant's row when ``error`` (``out_of_memory``) stopped it at ``failed_at``
        (``COMPILE``, ``PREPARE`` or ``RUN``): the memory its compiled step needs where it
        compiled, else the figure ``error`` states, and the device's."""
        message = str(error)
        needed, available = figures_in(message)
        compiled = getattr(self, "compiled", None)
        if compiled is not None:
            needed = program_bytes(compiled.memory_analysis())
        device = device_memory(self.trainer.mesh.devices.flat[0])
        return DidNotFit(
            layout=self.layout,
            engine=self.engine,
            needed_bytes=needed,
            device_bytes=available if device is None else device,
            failed_at=failed_at,
            error=message.strip().splitlines()[0] if message.strip() else type(error).__name__,
            sequence_parallel=self.sequence_parallel,
            sequence_scheme=self.sequence_scheme,
            microbatches=self.microbatches,
            pipeline_schedule=self.pipeline_schedule,
            variant=self.variant,
        )

    def result(self) -> Result:
        if not self.times:
            raise ValueError(f"{self.name} {self.engine}: no timed steps yet; call run() first")
        bubble = {}
        if self.pipeline_schedule is not None:
            stages = self.trainer.mesh.shape["stage"]
            count = self.microbatches * self.trainer.accumulation
            bubble["bubble_formula"] = pipeline.bubble_formula(stages, count)
        if self.twin is not None and self.twin.times:
            bubble["bubble_measured"] = statistics.median(
                measured_bubble(one, two) for one, two in zip(self.rounds, self.twin.rounds)
            )
            bubble["double_step_ms"] = 1e3 * statistics.median(self.twin.times)
        step_s = statistics.median(self.times)
        speed = flops.throughput(
            seconds=step_s,
            **flops.speed(
                self.trainer.objective.model,
                self.size.seq_len,
                self.size.batch * self.size.seq_len,
                list(self.trainer.mesh.devices.flat),
            ),
        )
        return Result(
            layout=self.layout,
            engine=self.engine,
            step_ms=1e3 * step_s,
            compile_s=self.compile_s,
            state_bytes_per_device=self.state_bytes,
            temp_bytes_per_device=self.temp_bytes,
            wire_bytes=self.report.wire_bytes(),
            collectives=self.report.count(),
            steps_timed=len(self.times),
            round_ms=tuple(1e3 * t for t in self.rounds),
            sequence_parallel=self.sequence_parallel,
            sequence_scheme=self.sequence_scheme,
            microbatches=self.microbatches,
            pipeline_schedule=self.pipeline_schedule,
            tokens_per_s=speed["tokens_per_s"],
            mfu=speed.get("mfu"),
            mfu_causal=speed.get("mfu_causal"),
            variant=self.variant,
            **bubble,
        )

    def release(self) -> None:
        """Drops the parked state, the batch and the compiled step (after ``result``)."""
        self.parked = self.rows = self.compiled = None
