"""``Trainer``: builds the mesh, lays out the state, compiles the step, and runs it.

    trainer = Trainer(objective, optax.adamw(1e-3), key=jax.random.key(0), mesh=MeshSpec(fsdp=8))
    state = trainer.fit(data, steps=1000, log_every=100)

The training code is the same for every layout; ``mesh`` and ``layout`` decide where every array
lives and so which collectives the step runs.

Layout: two helpers of the log line (``_router_line``, ``_optimizer_line``), then one class,
``Trainer``: its constructor, which checks the mesh, the layout and the options against the model;
the state (``init_state``, ``place``, ``save``); ``check_batch``; the step and evaluation
(``train_step``, ``gradients``, ``validation_metrics``, ``device_batch``); ``fit``; and inspection
(``compile_step``, which compiles ahead what ``fit`` then runs, ``step_arguments``,
``compiled_step``, ``collectives``). It is one module because every method
shares the mesh, the layout and the compiled steps the constructor sets up; each piece of
computation it compiles lives elsewhere, in ``dew.training.step``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dew.checks import nonnegative_int, positive_int
from dew.layout import Layout
from dew.mesh import BATCH_AXES, MeshSpec, build_mesh
from dew.models import lora
from dew.nn.param import logical_axes
from dew.parallel import Shards, expert, fsdp, pipeline, sequence, tensor
from dew.parallel.options import StepOptions
from dew.training import flops
from dew.training.optimizer import host_state_shardings
from dew.training.preemption import RUN, stop_signals
from dew.training.progress import Progress, phase
from dew.training.remat_choice import choose_remat
from dew.training.state import TrainState
from dew.training.step import (
    BATCH_SPEC,
    ENGINES,
    build_gradients,
    build_loss,
    build_train_step,
)
from dew.training.tracking import (
    COMPILED_AHEAD_NOTE,
    FIRST_STEP_NOTE,
    INT8_PEAK_NOTE,
    Evaluation,
    FitLog,
    JsonLines,
    LogWindow,
    Tracker,
    check_evaluation,
    check_trackers,
    close_all,
    evaluation_scores,
    scores_line,
)


@jax.jit
def _all_finite(tree) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(tree)]))


# Across processes, fit agrees on a stop request (SIGTERM, Ctrl-C) every this many steps.
STOP_AGREE_EVERY = 10


def _router_line(metrics: dict) -> str:
    """The MoE part of a step's log line (empty for a dense model)."""
    if "load_balance_loss" not in metrics:
        return ""
    return (
        f" (load balance {metrics['load_balance_loss']:.4f}, router z "
        f"{metrics['router_z_loss']:.4f}, dropped {100 * metrics['dropped_fraction']:.1f}%)"
    )


def _optimizer_line(metrics: dict) -> str:
    """The end of a step's log line: the gradients' global norm, and the learning rate where the
    optimizer says it."""
    line = f", grad norm {metrics['grad_norm']:.4g}" if "grad_norm" in metrics else ""
    return line + (f", lr {metrics['lr']:.4g}" if "lr" in metrics else "")


class Trainer:
    """Trains ``objective`` with ``optimizer`` over a device mesh.

    The constructor checks the mesh, the layout and the options against the model and lays out
    the state's shapes; it compiles nothing. ``fit`` trains; ``train_step``, ``evaluate`` and
    ``collectives`` give the pieces.

    Args:
      objective: what the step minimizes, with its ``model`` and ``seq_len``: e.g.
        ``dew.objectives.lm.LMObjective(model, seq_len)``.
      optimizer: any ``optax.GradientTransformation``; it gives its one-device result.
        ``dew.training.optimizer.adamw`` adds a schedule (its ``lr`` goes into the metrics),
        clipping, masked weight decay and smaller state (bfloat16 moments, state in host memory).
      key: a PRNG key (``jax.random.key(0)``, or its raw ``uint32`` key data); the initial
        weights depend on it alone.
      mesh: a ``MeshSpec`` (default ``MeshSpec()``: every device on ``data``); ``data`` takes the
        devices the other axes leave.
      layout: a ``Layout`` placing each weight (and its optimizer state and EMA) on the mesh
        (default ``Layout()``).
      checkpoints: a ``dew.Checkpoints``, or ``None`` (the default) to keep nothing on disk.
      accumulation: microbatches per step (default 1); each device's rows are cut into this
        many, run one after another, and their gradients add up to the whole batch's.
      engine: ``"shard_map"`` (explicit collectives, the default), ``"gspmd"`` (XLA's partitioner
        with every block's input pinned to the batch split: the baseline benchmarks compare with) or
        ``"gspmd_unpinned"`` (the partitioner left alone; see ``dew.training.step``).
      devices: the devices to use (default: all of them).
      options: a ``StepOptions``: Megatron's sequence-parallel activations over ``tensor``, the
        attention scheme over ``sequence``, the pipeline schedule over ``stage``
        (``dew.parallel.options``). Checked against the mesh here, before anything compiles: an
        option the mesh gives no axis for is an error. Its ``"auto"`` choices are made here for
        these devices (``StepOptions.resolve``): ``trainer.options`` is what the step runs. The
        shard_map engine's only: the GSPMD engines take the default.
      memory_limit_bytes: a device's memory, for a model with ``remat="auto"``: the first step
        built (``train_step``, at its batch size) takes the least recomputation whose step fits
        it (``dew.training.remat_choice.choose_remat``, a compile per policy tried). Default:
        what the device reports (TPUs and GPUs do; CPU devices do not, so give it there).
      base: for a model with ``lora`` set (``dew.models.lora``), where its frozen base comes
        from: a Hugging Face Llama folder or a Dew checkpoint directory of the same model (its
        latest step when the run starts; the step the run's checkpoint records when it resumes),
        read when the state is placed; ``None``: the model's initial weights from ``key``. Kept
        as an absolute path (``trainer.base``); a checkpoint of the run names it, with the step
        and a checksum that resuming checks (``dew.training.lora_base``).

    Raises:
      TypeError: ``mesh``, ``layout`` or ``options`` is not a ``MeshSpec``, ``Layout`` or
        ``StepOptions``.
      ValueError: a setting that cannot run, found before anything compiles: ``accumulation``
        below 1, an unknown ``engine``, ``options`` other than the default with a GSPMD engine,
        ``stage > 1`` without ``microbatches``, ``base`` for a model without ``lora``, a mesh
        axis the model's sizes do not divide (heads, experts, layers, ``seq_len``), an option
        the mesh gives no axis for, or an attention kernel these devices cannot run.

    Examples:
        >>> import jax, optax, dew
        >>> from dew.data import TokenWindows, write_example_corpus
        >>> from dew.objectives.lm import LMObjective
        >>> model = dew.models.build("causal_transformer", vocab_size=256, emb_features=64,
        ...                          num_layers=2, num_heads=4, max_seq_len=32)
        >>> trainer = dew.Trainer(LMObjective(model, 32), optax.adamw(1e-3), key=jax.random.key(0),
        ...                       mesh=dew.MeshSpec(fsdp=8), layout=dew.Layout(min_shard=1))
        >>> write_example_corpus("tokens")
        >>> state = trainer.fit(TokenWindows("tokens", seq_len=32).load(batch=16), steps=20)
    """

    def __init__(
        self,
        objective,
        optimizer: optax.GradientTransformation,
        key: jax.Array,
        mesh: MeshSpec = MeshSpec(),
        layout: Layout = Layout(),
        checkpoints=None,
        accumulation: int = 1,
        engine: str = "shard_map",
        devices=None,
        options: StepOptions = StepOptions(),
        memory_limit_bytes: int | None = None,
        base=None,
    ):
        if not isinstance(mesh, MeshSpec):
            raise TypeError(f"mesh must be a dew.MeshSpec, got {type(mesh).__name__}")
        if not isinstance(layout, Layout):
            raise TypeError(f"layout must be a dew.Layout, got {type(layout).__name__}")
        positive_int("accumulation", accumulation)
        if engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r}; expected one of {', '.join(ENGINES)}")
        if not isinstance(options, StepOptions):
            raise TypeError(f"options must be a dew.StepOptions, got {type(options).__name__}")
        if engine != "shard_map" and options != StepOptions():
            raise ValueError(
                f"options {options} shape the shard_map step; the {engine} engine runs the "
                "model on global arrays and takes the default StepOptions()"
            )
        if mesh.stage > 1 and mesh.microbatches is None:
            s = mesh.stage
            raise ValueError(
                f"MeshSpec(stage={s}) needs microbatches=M (M >= {s}): the pipeline cuts each "
                f"device's rows into M microbatches and idles (S - 1) / (M + S - 1) of a step, "
                f"{s - 1}/{2 * s - 1} at M = {s}, {s - 1}/{3 * s - 1} at M = {2 * s}, "
                f"{s - 1}/{5 * s - 1} at M = {4 * s}; the rows a device gets per step must "
                "divide by M (times accumulation)"
            )
        self.objective = objective
        self.optimizer = optimizer
        self.key = (
            key if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else jax.random.wrap_key_data(key)
        )
        self.mesh_spec = mesh
        self.mesh = build_mesh(mesh, devices)
        self.layout = layout
        self.checkpoints = checkpoints
        self.accumulation = accumulation
        self.engine = engine
        self.platform = platform = self.mesh.devices.flat[0].platform
        self.memory_limit_bytes = memory_limit_bytes
        # A LoRA model trains its adapters on a frozen base (``TrainState.frozen``).
        self.lora = getattr(objective.model, "lora", None)
        # "auto" (the schemes' default) made a choice for these devices: the options the
        # shard_map step is built with, and what ``options`` reads back; and what no options
        # given resolve to (checkpoint metadata names options that differ from it).
        ringable = self.lora is None or lora.some_region_unadapted(self.lora)
        self.options, self._default_options = (
            asked.resolve(dict(self.mesh.shape), platform, objective.seq_len, ringable)
            for asked in (options, StepOptions())
        )
        if engine != "shard_map":
            self.options = options
        if base is not None and self.lora is None:
            raise ValueError(
                f"base={base!r} is the frozen base of a LoRA model; this model has no lora "
                "(build it with lora=dew.models.lora.Lora(rank=R))"
            )
        if base is not None:  # absolute, so that a checkpoint names it from anywhere
            from dew.training import lora_base

            base = lora_base.resolved(base)
        self.base = base
        # Pipeline microbatches per accumulation microbatch (1 without a stage axis).
        self.microbatches = mesh.microbatches or 1

        mesh_shape = dict(self.mesh.shape)
        objective.model.check_split(mesh_shape, options.sequence_scheme)
        if mesh_shape["sequence"] > 1:  # zigzag chunks only where a sequence axis splits rows
            sequence.check_seq_len(objective.seq_len, mesh_shape["sequence"])
        if engine == "shard_map":
            self.options.check(mesh_shape, objective.seq_len)
        if hasattr(objective.model, "attention_for"):
            # An attention kernel that cannot run on these devices (cuDNN off a GPU, or on a
            # ring) is refused here, before anything is traced, not by the first step.
            objective.model.attention_for(
                platform,
                mesh_shape if engine == "shard_map" else None,
                options.sequence_scheme,
                seq_len=objective.seq_len,
            )
        if self.lora is not None:
            lora.check(objective.model, mesh_shape)
            axes = lora.state_axes(objective.model)
        else:
            axes = objective.model.logical_axes()
        abstract_state = jax.eval_shape(self._fresh_state, self.key)
        # The weights the step differentiates (a LoRA model's adapters), and its frozen base.
        self.param_specs = layout.specs(self.mesh, abstract_state.params, axes)
        self.frozen_specs = None
        model_specs = self.param_specs
        if self.lora is not None:
            self.frozen_specs = layout.specs(self.mesh, abstract_state.frozen, axes)
            # (a dropout key and rate, where the model has them, are whole on every device)
            model_specs = lora.combine(
                objective.model, self.frozen_specs, self.param_specs, keys=P(), rate=P()
            )
        self.shards = Shards(
            axis_sizes=mesh_shape,
            param_specs=model_specs,
            options=self.options,
            microbatches=self.microbatches,
            fsdp_scatter_stages=fsdp.scatter_stages(self.mesh),
            fsdp_tpu_layout=fsdp.on_tpu(self.mesh),
            fsdp_ring=engine == "shard_map" and self.options.fsdp_scheme == "ring",
            tensor_ring=engine == "shard_map" and self.options.tensor_scheme == "ring",
        )
        if engine == "shard_map":
            for specs, tree_axes, shapes in self._weight_trees(abstract_state, axes):
                tensor.check_layout(specs, tree_axes, shapes, mesh_shape["tensor"])
                expert.check_layout(specs, tree_axes, mesh_shape["expert"])
                pipeline.check_layout(specs, tree_axes, mesh_shape["stage"])
        self.state_shardings = layout.shardings(self.mesh, abstract_state, axes)
        # An optimizer that offloads its state keeps it in host memory between steps.
        self.state_shardings = self.state_shardings.replace(
            opt_state=host_state_shardings(optimizer, self.state_shardings.opt_state)
        )
        self._abstract_state = abstract_state
        self._steps: dict[int, Any] = {}
        # The batch sizes whose step compile_step (or fit's first step) has compiled, and the
        # seconds compile_step took, which the next fit counts as its own (goodput's first step).
        self._compiled: set[int] = set()
        self._compile_seconds: dict[int, float] = {}
        self._losses: dict[int, Any] = {}
        self._gradients: dict[int, Any] = {}

    def _weight_trees(self, abstract_state, axes):
        """``(specs, logical axes, shapes)`` of each tree of weights the step takes: the
        parameters, and a LoRA model's frozen base."""
        if self.lora is None:
            return [(self.param_specs, axes, abstract_state.params)]
        model = self.objective.model
        return [
            (self.param_specs, logical_axes(lora.declare_adapters(model)), abstract_state.params),
            (self.frozen_specs, logical_axes(lora.declare_frozen(model)), abstract_state.frozen),
        ]

    # ----------------------------------------------------------------------------- state

    def _fresh_state(self, key: jax.Array, with_base: bool = True) -> TrainState:
        model = self.objective.model
        frozen = None
        if self.lora is None:
            params = model.init(key)
        else:  # the adapters train; the base (the model's initial weights) is frozen
            params = lora.init_adapters(model, key)
            frozen = lora.frozen_of(model, model.init(key)) if with_base else None
        ema = params if self.objective.ema_decay is not None else None
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=self.optimizer.init(params),
            ema=ema,
            key=key,
            frozen=frozen,
        )

    def init_state(self) -> TrainState:
        """A fresh state, created directly in its final layout (no device ever holds all of it).

        A LoRA model's base is read from ``base`` when given (``dew.training.lora_base``).

        Returns:
          a ``TrainState`` at step 0: weights from ``key``, the optimizer's initial state, laid
          out by ``layout`` over the mesh (``trainer.state_shardings``).
        """
        if self.lora is None or self.base is None:
            return self._run_once(self._fresh_state, self.state_shardings)
        from dew.training import lora_base

        shardings = self.state_shardings.replace(frozen=None)
        fresh = self._run_once(lambda key: self._fresh_state(key, with_base=False), shardings)
        return fresh.replace(frozen=lora_base.load(self))

    def _run_once(self, fresh, shardings):
        """``fresh(self.key)`` compiled with ``shardings`` out and run. It runs once, so on CPU
        devices it compiles without LLVM's optimizations: the example's initialization compiled
        in 1.0 s against 5.3 s, its weights within float32 rounding (1.2e-7 relative) of the
        optimized program's, and each layout's equal to the others' as before, every one
        compiled alike (an accelerator's compiler takes no such option)."""
        lowered = jax.jit(fresh, out_shardings=shardings).lower(self.key)
        on_cpu = all(d.platform == "cpu" for d in self.mesh.devices.flat)
        options = {"xla_backend_optimization_level": 0} if on_cpu else None
        return lowered.compile(compiler_options=options)(self.key)

    def place(self, progress: Progress | None = None):
        """The state ``fit`` starts from: the latest checkpoint, else a fresh state.

        Args:
          progress: reports the reading or initializing as a phase (``dew.training.progress``);
            ``None`` (the default): nothing is printed for it.

        Returns:
          ``(state, shardings, data_position)``: the latest checkpoint laid out for this
          trainer's mesh and layout (whatever layout saved it), its ``state_shardings``, and where
          the data stood (``WindowDataset.position``); or ``init_state()`` and position ``None``
          when there is no checkpoint.
        """
        if self.checkpoints is not None and self.checkpoints.latest is not None:
            with phase(progress, "reading the checkpoint", "read the checkpoint"):
                state, metadata = self._restore()
            print(f"Resumed from step {int(state.step)} in {self.checkpoints.directory}")
            return state, self.state_shardings, metadata.get("data_position")
        if self.lora is not None and self.base is not None and self.lora.base_dtype == "int8":
            doing = ("reading the frozen base, quantized to int8", "read the frozen base")
        elif self.lora is not None and self.base is not None:
            doing = ("reading the frozen base", "read the frozen base")
        else:
            doing = ("initializing the weights", "initialized the weights")
        with phase(progress, *doing):
            state = self.init_state()
            if progress is not None:  # the phase's time is the work's, not its dispatch's
                jax.block_until_ready(state)
        return state, self.state_shardings, None

    def _saveable(self, state: TrainState) -> TrainState:
        # Checkpoints hold plain numbers: the typed key goes as its uint32 key data. A LoRA
        # model's frozen base is named in the metadata, not saved.
        return state.replace(key=jax.random.key_data(state.key), frozen=None)

    def _restore(self):
        abstract = jax.eval_shape(self._saveable, self._abstract_state)
        shardings = self._saveable_shardings()
        target = jax.tree_util.tree_map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
        )
        on_device = jax.tree_util.tree_map(
            lambda t: jax.ShapeDtypeStruct(
                t.shape, t.dtype, sharding=t.sharding.with_memory_kind("device")
            ),
            target,
        )
        # The reader places arrays in device memory; an offloaded optimizer state then moves to
        # host memory, where the step takes it.
        tree, metadata = self.checkpoints.restore(on_device)
        tree = jax.device_put(tree, shardings)
        key = jax.random.wrap_key_data(tree.key, impl=jax.random.key_impl(self.key))
        tree = tree.replace(key=key)
        if self.lora is not None:  # the base the adapters were trained on, checked
            from dew.training import lora_base

            recorded = metadata.get("lora_base")
            frozen = lora_base.load(self, recorded if isinstance(recorded, dict) else None)
            lora_base.check_resumed(self, frozen, metadata)
            tree = tree.replace(frozen=frozen)
        return tree, metadata

    def _saveable_shardings(self):
        return self.state_shardings.replace(key=NamedSharding(self.mesh, P()), frozen=None)

    def save(self, state: TrainState, data=None, next_batch: int | None = None) -> None:
        """Writes ``state`` (and where ``data`` stands) to this trainer's checkpoints, in the
        background (``trainer.checkpoints.wait()`` waits for it), as step ``state.step``.

        Args:
          state: the ``TrainState`` to write.
          data: the ``WindowDataset`` trained on, whose position the checkpoint records so that a
            resumed ``fit`` reads on from there; ``None``: no position.
          next_batch: the index of the batch the next step reads (default ``state.step``).

        Raises:
          ValueError: the trainer was built with ``checkpoints=None``.
          FloatingPointError: a weight holds NaN or inf (nothing is written): such a state would
            push a good checkpoint out of the ``keep`` newest.
        """
        if self.checkpoints is None:
            raise ValueError(
                "this Trainer was built with checkpoints=None; there is nowhere to save"
            )
        if not bool(_all_finite(state.params)):
            raise FloatingPointError(
                f"step {int(state.step)}: the weights hold NaN or inf; not saving them "
                f"(latest checkpoint: {self.checkpoints.latest})"
            )
        metadata = {
            "accumulation": self.accumulation,
            "mesh": dict(self.mesh.shape),
            "layout": self.layout.describe(),
            "engine": self.engine,
        }
        if dataclasses.is_dataclass(self.objective.model):
            # The model's configuration, so that the checkpoint converts (dew convert --to hf)
            # and starts a run (dew train --init-from) on its own.
            model = self.objective.model
            described = {"name": type(model).__name__, "config": dataclasses.asdict(model)}
            try:
                json.dumps(described, allow_nan=False)
                metadata["model"] = described
            except (TypeError, ValueError):  # a model field JSON cannot hold: left out
                pass
        if self.lora is not None:
            from dew.training import lora_base

            metadata["lora_base"] = lora_base.describe(self, state.frozen)
        if self.options != self._default_options:
            metadata["options"] = self.options.describe()
        if self.mesh.shape["stage"] > 1:
            metadata["pipeline"] = {
                "microbatches": self.microbatches,
                "schedule": self.options.pipeline_schedule,
            }
        if data is not None:
            metadata["data_position"] = data.position(
                int(state.step) if next_batch is None else next_batch
            )
        self.checkpoints.save(int(state.step), self._saveable(state), metadata=metadata)

    # ----------------------------------------------------------------------------- checks

    @property
    def batch_devices(self) -> int:
        """The devices a global batch's rows are split over: ``data x expert x fsdp``."""
        return math.prod(self.mesh.shape[a] for a in BATCH_AXES)

    def check_batch(self, batch_size: int, seq_len: int | None = None) -> None:
        """Checks that a global batch of ``batch_size`` rows of ``seq_len`` tokens fits the step.

        Raises:
          ValueError: ``batch_size`` does not split over the batch axes (``batch_devices``) into
            ``accumulation`` microbatches (each cut into ``microbatches`` pipeline microbatches
            over a stage axis), or ``seq_len`` (when given) is not the objective's.
        """
        split = " x ".join(
            f"{a} {self.mesh.shape[a]}"
            for a in BATCH_AXES
            if a in ("data", "fsdp") or self.mesh.shape[a] > 1
        )
        if batch_size % self.batch_devices:
            raise ValueError(
                f"batch {batch_size} does not split evenly over {self.batch_devices} devices "
                f"({split})"
            )
        if (batch_size // self.batch_devices) % self.accumulation:
            raise ValueError(
                f"batch {batch_size} over {self.batch_devices} devices ({split}) leaves "
                f"{batch_size // self.batch_devices} rows per device, which do not split into "
                f"accumulation {self.accumulation} microbatches"
            )
        rows = batch_size // self.batch_devices // self.accumulation
        if rows % self.microbatches:
            per = (
                f"{rows} rows per device,"
                if self.accumulation == 1
                else f"{batch_size // self.batch_devices} rows per device, {rows} per accumulation "
                f"microbatch (accumulation {self.accumulation}),"
            )
            raise ValueError(
                f"batch {batch_size} over {self.batch_devices} devices ({split}) leaves {per} "
                f"which do not split into {self.microbatches} pipeline microbatches "
                f"(MeshSpec(stage={self.mesh.shape['stage']}, microbatches={self.microbatches}))"
            )
        if seq_len is not None and seq_len != self.objective.seq_len:
            raise ValueError(
                f"the data's seq_len {seq_len} is not the objective's seq_len "
                f"{self.objective.seq_len}"
            )

    # ----------------------------------------------------------------------------- the step

    def train_step(self, batch_size: int):
        """The step for global batches of ``batch_size`` rows, built once per batch size.

        Returns:
          a jitted ``step(state, batch) -> (state, metrics)``, compiled at its first call: it
          takes a ``TrainState`` laid out as ``init_state`` gives it and an int32 batch
          ``[batch_size, seq_len + 1]`` (or ``[batch_size, 2 or 3, seq_len + 1]`` with a loss mask
          and document ids, ``dew.objectives.lm``) on ``batch_sharding``, and donates the state.
          ``metrics`` are scalars: ``"loss"``, the batch's mean loss, ``"grad_norm"``, and more
          (``dew.training.step.build_train_step``: the MoE entries, ``"lr"``).

        Raises:
          ValueError: ``batch_size`` does not fit the mesh (``check_batch``).
        """
        self.check_batch(batch_size)
        self._choose_remat(batch_size)
        if batch_size not in self._steps:
            self._steps[batch_size] = build_train_step(
                self.objective,
                self.optimizer,
                self.mesh,
                self.shards,
                self.state_shardings,
                accumulation=self.accumulation,
                global_rows=batch_size,
                engine=self.engine,
                param_specs=self.param_specs,
                frozen_specs=self.frozen_specs,
            )
        return self._steps[batch_size]

    def _choose_remat(self, batch_size: int) -> None:
        """A model with ``remat="auto"`` gets its policy here, once, from the first batch size a
        computation is built for: ``dew.training.remat_choice.choose_remat`` (which says what it
        chose)."""
        if getattr(self.objective.model, "remat", None) != "auto":
            return
        choice = choose_remat(self, batch_size, memory_limit_bytes=self.memory_limit_bytes)
        print(choice.reason(), flush=True)
        self.objective = choice.objective

    def gradients(self, params, batch: jax.Array, frozen=None):
        """The gradients of the mean loss of the global ``batch``, computed as the step computes
        them (for tests and inspection; ``fit`` does not call it).

        Args:
          params: the weights (``state.params``; a LoRA model's adapters).
          batch: int32 ``[rows, seq_len + 1]`` tokens (or ``[rows, 2 or 3, seq_len + 1]``, with a
            loss mask and document ids), ``rows`` a batch size ``check_batch`` accepts.
          frozen: a LoRA model's base (``state.frozen``); ``None`` for other models.

        Returns:
          ``(grads, loss)``: a tree shaped and laid out as ``params``, and the scalar float32 loss.
        """
        rows = batch.shape[0]
        self.check_batch(rows)
        self._choose_remat(rows)
        if rows not in self._gradients:
            fn = build_gradients(
                self.objective,
                self.mesh,
                self.shards,
                accumulation=self.accumulation,
                global_rows=rows,
                engine=self.engine,
                param_specs=self.param_specs,
                frozen_specs=self.frozen_specs,
            )
            self._gradients[rows] = jax.jit(
                lambda params, batch, frozen: fn(params, batch, frozen)[:2],
                out_shardings=(self.state_shardings.params, NamedSharding(self.mesh, P())),
            )
        return self._gradients[rows](params, batch, frozen)

    def evaluate(self, state: TrainState, data, params: str = "params") -> float:
        """The mean loss over ``data``'s validation batches (``TokenWindows(val_batches=...)``):
        ``validation_metrics(state, data, params)["loss"]``, the language model's loss alone for
        an MoE model.

        Args:
          state: the ``TrainState`` to evaluate (``fit``'s result).
          data: a ``WindowDataset`` loaded with ``val_batches >= 1``.
          params: ``"params"`` (the default) or ``"ema"``, the EMA weights.

        Returns:
          the mean loss, a Python float.

        Raises:
          ValueError: ``data`` has no validation batches, or ``params`` is neither name.

        Examples:
            >>> data = TokenWindows("tokens", seq_len=32, val_batches=2).load(batch=16)
            >>> state = trainer.fit(data, steps=20)
            >>> loss = trainer.evaluate(state, data)  # the mean over the 2 batches
        """
        return self.validation_metrics(state, data, params)["loss"]

    def validation_metrics(
        self, state: TrainState, data, params: str = "params", batches: int | None = None
    ) -> dict:
        """The objective's ``evaluation_metrics`` over ``data``'s validation batches, each a mean
        over the batches: ``"loss"`` (for an MoE model the cross-entropy alone, comparable with a
        dense model's) and, for an MoE model, the router losses and the dropped fraction beside
        it.

        ``params="ema"`` evaluates the EMA weights instead; ``batches=K`` the first ``K``
        validation batches only. Forward only, with the same layout and collectives as the step,
        compiled at the first call (per batch size) and reused; every validation token counts
        once.

        Returns:
          ``{name: float}``, each the mean over the batches.

        Raises:
          ValueError: ``data`` has no validation batches, ``batches`` is not from 1 to their
            number, or ``params`` is not ``"params"`` or ``"ema"`` (with ``ema_decay`` set).
        """
        every = data.validation(rows=self._process_rows(data.batch_size, data.seq_len + 1))
        if not every:
            raise ValueError("the data has no validation batches; load it with val_batches >= 1")
        if batches is not None and not 1 <= batches <= len(every):
            raise ValueError(f"batches must be from 1 to the data's {len(every)}, got {batches!r}")
        batches = every[:batches]
        weights = {"params": state.params, "ema": state.ema}.get(params)
        if weights is None:
            raise ValueError(
                f"params must be 'params' or 'ema' (with ema_decay set), got {params!r}"
            )
        self.check_batch(data.batch_size)
        self._choose_remat(data.batch_size)
        # Evaluation runs the shard_map forward whatever the step's engine.
        self.options.check(dict(self.mesh.shape), self.objective.seq_len)
        if data.batch_size not in self._losses:
            self._losses[data.batch_size] = build_loss(
                self.objective,
                self.mesh,
                self.shards,
                global_rows=data.batch_size,
                param_specs=self.param_specs,
                frozen_specs=self.frozen_specs,
            )
        loss_fn = self._losses[data.batch_size]
        tokens = data.batch_size * self.objective.seq_len
        per_batch = []
        for rows in batches:
            loss, aux = loss_fn(weights, self.device_batch(rows, data.batch_size), state.frozen)
            metrics = self.objective.evaluation_metrics(loss, aux, tokens)
            per_batch.append({name: float(value) for name, value in metrics.items()})
        return {name: float(np.mean([m[name] for m in per_batch])) for name in per_batch[0]}

    @property
    def batch_sharding(self) -> NamedSharding:
        """Where a global batch lives: rows split over the batch axes, whole otherwise."""
        return NamedSharding(self.mesh, BATCH_SPEC)

    def _process_rows(self, batch_size: int, width: int) -> slice:
        """The rows of a global batch this process's devices hold (all of them in one process)."""
        if jax.process_count() == 1:
            return slice(None)
        index = self.batch_sharding.addressable_devices_indices_map((batch_size, width))
        starts = sorted({idx[0].start or 0 for idx in index.values()})
        stops = sorted({idx[0].stop or batch_size for idx in index.values()})
        lo, hi = starts[0], stops[-1]
        covered = sum(stop - start for start, stop in zip(starts, stops))
        if covered != hi - lo:
            raise ValueError(
                f"this process's batch rows are not contiguous: {sorted(index.values())}"
            )
        return slice(lo, hi)

    def device_batch(self, rows: np.ndarray, batch_size: int) -> jax.Array:
        """A global batch array, on ``batch_sharding``, from this process's ``rows`` of it.

        Args:
          rows: this process's rows (all of them in one process): int32 ``[rows, seq_len + 1]``,
            or ``[rows, 2 or 3, seq_len + 1]`` with a loss mask and document ids.
          batch_size: the global batch's rows.
        """
        if jax.process_count() == 1:
            return jax.device_put(rows, self.batch_sharding)
        return jax.make_array_from_process_local_data(
            self.batch_sharding, rows, (batch_size, *rows.shape[1:])
        )

    # ----------------------------------------------------------------------------- fit

    def fit(
        self,
        data,
        steps: int,
        log_every: int = 100,
        checkpoint_every: int | None = None,
        metrics: str | os.PathLike | None = None,
        eval_every: int | None = None,
        eval_batches: int | None = None,
        trackers: Sequence[Tracker] = (),
        progress: Progress | None = None,
        evaluations: Sequence[Evaluation] = (),
    ) -> TrainState:
        """Trains until ``state.step == steps`` (resuming from the latest checkpoint, if any).

        Args:
          data: a ``dew.data.WindowDataset`` (``TokenWindows(...).load(batch=B)``).
          steps: the step to stop at, counted from the run's start (not from the resumed step).
          log_every: prints ``step N: loss L, T ms/step, K tokens/s, MFU M%`` every this many
            steps, and at the last step (e.g. ``step 20: loss 4.1234, 212.3 ms/step, 77,180
            tokens/s, MFU 35.6%``; an MoE model's router statistics follow the loss, in
            parentheses). The speed is that of the steps since the line before (or since fit
            began): their mean ``step_time_s`` (below), the global batch's tokens over it, and MFU
            from that, only where the device's peak is known. The first step, which includes
            compiling, is left out, unless it is the line's only step (``log_every=1``, or
            ``steps`` one past the resumed step): that line gives its time and says ``(first
            step: includes compiling)``, or ``(first step: compiled ahead, includes warm-up)``
            where the step was compiled before ``fit`` began (``compile_step``, or an earlier
            ``fit`` on this trainer) (``dew.training.tracking.LogWindow``).
          checkpoint_every: saves every this many steps (and always at the end, when checkpoints
            are on).
          metrics: a file to append one JSON line per step to (``dew.training.tracking.JsonLines``:
            ``{"step", "loss", "step_time_s", "tokens_per_s", "model_tflops_per_device", "mfu",
            "grad_norm"}`` and ``"lr"`` where the optimizer says it (``dew.training.optimizer``;
            both also end the log line), for an MoE model ``"load_balance_loss"``,
            ``"router_z_loss"`` and ``"dropped_fraction"``, on a step that evaluated
            ``"val_loss"`` and ``"val_weights"``; docs/metrics.md), written by process 0 and
            flushed as each step ends; its folder is created. ``step_time_s`` is the wall time
            from the step's start (its dispatch, or the end of the step before when later: steps
            queue on the devices) to its loss (the first step of a run includes compiling, unless
            compiled ahead);
            ``mfu`` only where the device's peak is known (``dew.training.flops``). A resumed
            run appends, so steps trained again after the checkpoint it resumed from appear
            twice: the later line is the run's.
          eval_every: evaluates every this many steps, and at the last step: the mean loss over
            ``data``'s validation batches (``validation_metrics``, compiled once, on the step's
            layout) of the EMA weights when the objective keeps them (``ema_decay``), else of the
            weights; prints ``step N: val_loss X`` and adds ``val_loss`` (and an MoE model's
            ``val_`` router statistics) and ``val_weights`` (``"ema"`` or ``"params"``) to that
            step's metrics. Needs ``data`` loaded with ``val_batches >= 1``.
          eval_batches: evaluate on the first this many validation batches (default: all of
            them); only with ``eval_every``.
          evaluations: more to evaluate at each evaluation step (needs ``eval_every``; the data
            then need no validation batches), each called on every process as
            ``evaluation(model, params, adapters, mesh, layout, step) -> {name: float}``
            (``dew.training.tracking.Evaluation``) with the weights validation uses (the EMA
            where kept; a LoRA model's frozen base and adapters) as the step lays them out, on
            the trainer's mesh, after the step's loss is checked; e.g.
            ``dew.evaluation.Tasks``, lm-eval tasks (``{"eval/TASK/METRIC": value}``). Prints
            ``step N: eval/t/acc 0.4375, ... (2.1 s)`` and adds the names, ``eval_time_s``
            (their seconds) and ``val_weights`` to that step's metrics. One with a
            ``check(model, mesh, layout)`` method is checked before anything compiles.
          trackers: where each step's metrics go besides ``metrics`` (``dew.training.tracking``:
            ``TensorBoard(logdir)``, ``JsonLines(path)``, or anything with ``log(step, metrics)``
            and ``close()``). Only process 0 calls ``log``; ``fit`` calls every tracker's ``close``
            when it returns, or raises from its training loop.
          progress: a ``dew.training.progress.Progress`` to report the slow phases before the
            first step on (the state read or initialized, the step compiled, unless
            ``compile_step`` compiled it already): a live line on a terminal, plain lines
            elsewhere (``dew train`` passes one). Default: nothing is printed for them.

        The host never waits for a step before dispatching the next: each step's metrics are read
        (and its loss checked finite) once the next step is dispatched, so printing, logging and a
        non-finite loss come one step late. fit waits for a step where it must: to evaluate or
        save the state it leaves (after checking its loss: a saved state always comes from a
        finite-loss step), at the last step, and, in a run of several processes, every
        ``STOP_AGREE_EVERY`` steps to agree on a stop.

        SIGTERM or Ctrl-C stops the run after the step in flight, with a checkpoint of that step:
        after SIGTERM (or a second Ctrl-C) ``fit`` prints ``Preempted at step N; checkpoint saved``
        and raises ``dew.training.preemption.Preempted``, a ``SystemExit`` with code 143 (130 after
        Ctrl-C); after one Ctrl-C it prints ``Interrupted at step N; checkpoint saved`` and returns
        the state. Every process of a run stops after the same step (``dew.training.preemption``).

        Returns:
          the final ``TrainState``, laid out on the mesh.

        Raises:
          ValueError: before anything compiles: ``steps`` below 0, ``log_every`` or
            ``checkpoint_every`` below 1, ``checkpoint_every`` without checkpoints, ``eval_every``
            on data without validation batches (and no ``evaluations``), ``eval_batches`` or
            ``evaluations`` without ``eval_every``, an evaluation's ``check`` refusing the run,
            or a batch that does not fit the mesh (``check_batch``).
          TypeError: an evaluation that is not callable, or one whose answer is not a dict of
            names to numbers (at the step it answers).
          FloatingPointError: a step's loss is NaN or inf (that state is not saved).
          dew.training.preemption.Preempted: SIGTERM or a second Ctrl-C (above).

        Examples:
            >>> data = TokenWindows("tokens", seq_len=32, val_batches=1).load(batch=16)
            >>> state = trainer.fit(data, steps=100, log_every=10, eval_every=50,
            ...                     metrics="runs/metrics.jsonl")
            >>> int(state.step)
            100
        """
        # A step compiled ahead by compile_step is fit's compile, as if compiled here: the
        # goodput line's first step and wall time include it.
        started = time.perf_counter() - self._compile_seconds.pop(data.batch_size, 0.0)
        compiled_ahead = data.batch_size in self._compiled
        nonnegative_int("steps", steps)
        positive_int("log_every", log_every)
        if checkpoint_every is not None:
            if self.checkpoints is None:
                raise ValueError(
                    "checkpoint_every needs a Trainer built with checkpoints=Checkpoints(...)"
                )
            positive_int("checkpoint_every", checkpoint_every)
        metrics_file = [JsonLines(metrics)] if metrics is not None else []
        trackers = check_trackers([*metrics_file, *trackers])
        evaluations = check_evaluation(data, eval_every, eval_batches, evaluations)
        for evaluation in evaluations:
            if hasattr(evaluation, "check"):
                evaluation.check(self.objective.model, self.mesh, self.layout)
        self.check_batch(data.batch_size, data.seq_len)
        step_fn = self.train_step(data.batch_size)
        if progress is not None and data.batch_size not in self._compiled:
            step_fn = self._compiling_first(step_fn, data.batch_size, progress)

        state, _, position = self.place(progress)
        start = int(state.step)
        mesh_shape = dict(self.mesh.shape)
        if start >= steps:
            print(
                f"Already at step {start}; fit(steps={steps}) has nothing to train on {mesh_shape}"
            )
            close_all(trackers)
            return state
        print(
            f"Training from step {start} to {steps} on {mesh_shape} "
            f"({jax.process_count()} process(es))"
        )

        next_batch = data.resume(position) if position is not None else start
        width = data.seq_len + 1
        speed = flops.speed(
            self.objective.model,
            self.objective.seq_len,
            data.batch_size * data.seq_len,
            list(self.mesh.devices.flat),
        )
        fit_log = FitLog(trackers, **speed)
        # The steps since the last printed line; an int8 step's MFU says which peak it divides by.
        note = INT8_PEAK_NOTE if self.options.quantize == "int8" else None
        window = LogWindow(
            COMPILED_AHEAD_NOTE if compiled_ahead else FIRST_STEP_NOTE, **speed, peak_note=note
        )
        weights = "ema" if self.objective.ema_decay is not None else "params"
        timing = dict(first_step_after=None, in_steps=0.0, last_end=None)
        # A stop request (SIGTERM, Ctrl-C) is seen after every step by one process, which reads
        # its own flag (no wait); several processes agree on it every STOP_AGREE_EVERY steps and
        # wherever fit waits anyway: the agreement is a collective, whose answer waits for the step
        # in flight.
        one_process = jax.process_count() == 1

        def report(
            step: int, step_metrics: dict, began: float, state=None, last: bool = False
        ) -> None:
            """Reads step ``step``'s metrics (waiting for it), stops on a non-finite loss, prints
            and logs them; ``state``: the state after ``step``, to evaluate when it is due;
            ``last``: the run stops after it (a signal), so its loss is printed whatever
            ``log_every`` says."""
            step_metrics = {name: float(v) for name, v in step_metrics.items()}  # waits
            loss = step_metrics["loss"]
            ended = time.perf_counter()
            if not math.isfinite(loss):
                # Stop before this state (or the one after it, already dispatched) can be saved
                # over (and rotate out) good checkpoints.
                raise FloatingPointError(
                    f"step {step}: the loss is {loss}; stopping without saving this state "
                    "(latest checkpoint: "
                    f"{self.checkpoints.latest if self.checkpoints else None})"
                )
            # The device starts a step once it has dispatched and the step before has ended.
            seconds = ended - max(began, timing["last_end"] or began)
            timing["last_end"] = ended
            if timing["first_step_after"] is None:
                timing["first_step_after"] = ended - started
            else:
                timing["in_steps"] += seconds
            window.add(seconds, step_metrics.get("useful_tokens"))
            if step % log_every == 0 or step == steps or last:
                print(
                    f"step {step}: loss {loss:.4f}{_router_line(step_metrics)}, {window.line()}"
                    f"{_optimizer_line(step_metrics)}"
                )
            validation, scores, scores_seconds = None, None, None
            if (
                state is not None
                and eval_every is not None
                and (step % eval_every == 0 or step == steps)
            ):
                if data.val_batches:
                    validation = self.validation_metrics(state, data, weights, eval_batches)
                    print(f"step {step}: val_loss {validation['loss']:.4f}")
                if evaluations:
                    began_scoring = time.perf_counter()
                    scores = self._evaluate_with(evaluations, state, weights, step)
                    scores_seconds = time.perf_counter() - began_scoring
                    print(scores_line(step, scores, scores_seconds), flush=True)
            fit_log.step(step, step_metrics, seconds, validation, weights, scores, scores_seconds)

        with (
            data.batches(
                start=next_batch, rows=self._process_rows(data.batch_size, width)
            ) as batches,
            fit_log,
            stop_signals() as stop,
        ):
            # The step before this one, dispatched and not yet read: (step, metrics, began). Its
            # metrics are read once the next step is dispatched, so the device never waits for the
            # host between steps. fit waits for a step only where it must: to evaluate or save
            # the state the step leaves (the step's loss is checked finite first, so a saved state
            # always comes from a checked step), at the last step, and to agree on a stop.
            pending = None
            for step in range(start + 1, steps + 1):
                index, rows = next(batches)
                batch = self.device_batch(rows, data.batch_size)
                began = time.perf_counter()
                state, step_metrics = step_fn(state, batch)  # dispatched; runs on its own
                self._compiled.add(data.batch_size)  # a later fit's first step compiles nothing
                if pending is not None:
                    report(*pending)  # the step before: read while this one runs
                pending = (step, step_metrics, began)
                saves = checkpoint_every is not None and step % checkpoint_every == 0
                evaluates = eval_every is not None and step % eval_every == 0
                waits = saves or evaluates or step == steps
                if one_process:
                    waits = waits or stop.agreed() != RUN  # its own flag: no collective
                else:
                    waits = waits or step % STOP_AGREE_EVERY == 0
                if not waits:
                    continue
                stopping = stop.agreed()  # SIGTERM or Ctrl-C, on any process
                report(*pending, state=state, last=bool(stopping))  # this step: waits for it
                pending = None
                if saves and step != steps and not stopping:
                    self.save(state, data, index + 1)
                if stopping:
                    break
            if self.checkpoints is not None:  # with the handlers on: a signal cannot cut it short
                self.save(state, data, index + 1)
                self.checkpoints.wait()
        wall = time.perf_counter() - started
        print(
            f"Goodput: first step after {timing['first_step_after']:.2f} s, "
            f"{100.0 * timing['in_steps'] / wall:.1f}% of the wall time in steps"
        )
        stop.finish(step, saved=self.checkpoints is not None, state=state)
        return state

    def _evaluate_with(self, evaluations, state: TrainState, weights: str, step: int) -> dict:
        """The ``evaluations``' scores, merged, of ``state``'s ``weights`` (``"ema"`` or
        ``"params"``) as they lie on the mesh: a LoRA model's frozen base with those adapters."""
        held = state.ema if weights == "ema" else state.params
        params, adapters = (held, None) if self.lora is None else (state.frozen, held)
        model = self.objective.model
        scores: dict[str, float] = {}
        for evaluation in evaluations:
            answer = evaluation(model, params, adapters, self.mesh, self.layout, step)
            answer = evaluation_scores(answer, evaluation)
            twice = sorted(set(answer) & set(scores))
            if twice:
                raise ValueError(f"two evaluations return the same metrics {twice}")
            scores.update(answer)
        return scores

    def _compiling_first(self, step_fn, batch_size: int, progress: Progress):
        """``step_fn`` whose first call (which compiles it, then dispatches it) is reported as
        the phase of compiling the step."""

        def call(*arguments):
            if batch_size in self._compiled:
                return step_fn(*arguments)
            with progress.phase("compiling the step", "compiled the step"):
                result = step_fn(*arguments)
            self._compiled.add(batch_size)
            return result

        return call

    def compile_step(self, data, progress: Progress | None = None):
        """The step on ``data``'s batches (``train_step(data.batch_size)``), lowered on arguments
        shaped as ``fit`` gives them and compiled now, nothing allocated or run. JAX keeps the
        executable: ``fit``'s first step on these batches compiles nothing more.

        Args:
          data: the ``WindowDataset`` ``fit`` will train on.
          progress: reports the compile as a phase (``dew.training.progress``).

        Returns:
          the compiled step (``jax.stages.Compiled``), for its ``memory_analysis()``: what a
          device needs, before any weight is allocated.
        """
        rows = data.batch(0)  # the batch as fit reads it: tokens, or tokens with mask and ids
        state, _ = self.step_arguments(data.batch_size)
        batch = jax.ShapeDtypeStruct(
            (data.batch_size, *rows.shape[1:]), rows.dtype, sharding=self.batch_sharding
        )
        step_fn = self.train_step(data.batch_size)
        start = time.perf_counter()
        with phase(progress, "compiling the step", "compiled the step"):
            compiled = step_fn.lower(state, batch).compile()
        self._compiled.add(data.batch_size)
        self._compile_seconds[data.batch_size] = time.perf_counter() - start
        return compiled

    # ----------------------------------------------------------------------------- inspection

    def step_arguments(self, batch_size: int, documents: bool = False):
        """The step's arguments on global batches of ``batch_size`` rows, as shapes only.

        Args:
          batch_size: the global batch's rows.
          documents: the batch packs documents (tokens, loss mask and document ids, int32
            ``[rows, 3, seq_len + 1]``); ``False`` (the default): plain tokens, int32
            ``[rows, seq_len + 1]``.

        Returns:
          ``(state, batch)`` as ``jax.ShapeDtypeStruct`` s laid out as the step takes them:
          lowering the step on them allocates nothing.
        """
        state = jax.tree_util.tree_map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            self._abstract_state,
            self.state_shardings,
        )
        width = self.objective.seq_len + 1
        shape = (batch_size, 3, width) if documents else (batch_size, width)
        batch = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.batch_sharding)
        return state, batch

    def compiled_step(self, batch_size: int, documents: bool = False):
        """The step on global batches of ``batch_size`` rows, lowered from ``step_arguments`` and
        compiled (nothing is allocated or run).

        Args:
          batch_size: the global batch's rows.
          documents: on packed documents (``[rows, 3, seq_len + 1]`` batches: segment ids).

        Returns:
          the compiled step (``jax.stages.Compiled``), for its ``memory_analysis()`` and its HLO
          (``as_text()``).
        """
        arguments = self.step_arguments(batch_size, documents)
        return self.train_step(batch_size).lower(*arguments).compile()

    def collectives(self, data):
        """The collectives of one training step on batches of ``data`` (anything with ``batch_size``
        and ``seq_len``), as a ``CollectiveReport``.

        For the shard_map engine they are read from the step's jaxpr (what the code asks for); for
        the GSPMD engines from the compiled HLO (what XLA inserted). Nothing runs.

        Returns:
          a ``CollectiveReport``: one entry per collective, with its mesh axes and bytes.

        Raises:
          ValueError: ``data``'s batch does not fit the mesh (``check_batch``).

        Examples:
            >>> report = trainer.collectives(data)
            >>> print(report)  # a table: each collective, its axes, operand and wire bytes
            >>> report.by_axis()  # bytes on the wire per mesh axis
        """
        from dew.collectives import collectives, hlo_collectives

        self.check_batch(data.batch_size, data.seq_len)
        documents = getattr(data, "documents", None) == "separate"  # packed: one more gather
        if self.engine != "shard_map":
            return hlo_collectives(self.compiled_step(data.batch_size, documents), self.mesh)
        arguments = self.step_arguments(data.batch_size, documents)
        return collectives(self.train_step(data.batch_size), *arguments)
