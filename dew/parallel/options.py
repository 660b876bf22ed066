"""``StepOptions``: what shapes the shard_map step beyond the mesh and the layout, in one value.

    Trainer(objective, optimizer, key=key, mesh=MeshSpec(fsdp=2, tensor=4),
            options=StepOptions(sequence_parallel=True))

The mesh says how many devices each axis takes and the layout where each weight lives; these
options say how the step's code uses an axis it has: Megatron's sequence-parallel activations on
``tensor``, the attention scheme over ``sequence``, the schedule over ``stage``. ``Shards`` carries
them into the step; the ``Trainer``, ``dew.benchmark`` and every ``dew`` command take one.

Every check of an option lives here: its own values when it is built, and what it asks of a mesh
and a sequence length in ``check`` (called by the ``Trainer`` before anything compiles). An option
that cannot take effect on the mesh it is given is an error, not a silent no-op.
"""

from __future__ import annotations

import dataclasses

from dew.parallel import fsdp, pipeline, sequence

# How weights cross the fsdp axis (``StepOptions.fsdp_scheme``): "auto" is resolved per platform
# and mesh (``StepOptions.resolve``) into one of the others.
AUTO = "auto"
FSDP_SCHEMES = (AUTO, "gather", "ring")

# How activations cross the tensor axis (``StepOptions.tensor_scheme``); "auto" as for fsdp.
TENSOR_SCHEMES = (AUTO, "plain", "ring")

# The dtypes gradients may be summed across devices in (``StepOptions.gradient_sum_dtype``).
GRADIENT_SUM_DTYPES = ("float32", "bfloat16")

# What the decoder layers' projections multiply in (``StepOptions.quantize``).
QUANTIZE = ("bfloat16", "int8")


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """How the shard_map step uses the axes it has.

    Attributes:
      sequence_parallel: with ``tensor > 1``, keep the activations between blocks split over
        positions across the tensor group (Megatron's sequence parallelism, unrelated to the
        ``sequence`` axis): norms and residual adds on ``1/tensor`` of the positions, activations
        moved by ``all_gather`` and ``psum_scatter`` instead of ``psum``. Each device's positions
        must split over ``tensor``.
      sequence_scheme: how attention spans a ``sequence`` axis above 1 (``dew.parallel.sequence``):
        ``"ring"`` (the default; K/V blocks travel round the axis by ``ppermute``) or
        ``"all_to_all"`` (DeepSpeed-Ulysses: positions traded for heads, which must divide by
        ``sequence x tensor``). A pipeline (``stage > 1``) needs ``"all_to_all"``.
      pipeline_schedule: over a ``stage`` axis above 1 (``dew.parallel.pipeline.SCHEDULES``):
        ``"1f1b"`` (the default: at most ``stage`` microbatches' inputs held on a stage),
        ``"1f1b_phased"`` (forward and backward ticks alternate: ``(M + S - 1)(forward +
        backward)`` a step, up to ``2 stage - 1`` inputs held) or ``"gpipe"`` (all forwards,
        then all backwards: every stage holds all ``M`` inputs).
      fsdp_scheme: how weights cross an ``fsdp`` axis above 1 (``dew.parallel.fsdp``):
        ``"gather"`` (``all_gather``, its transpose a ``psum_scatter``), ``"ring"`` (rings of
        ``ppermute`` s with the same bytes, at most ``fsdp.RING_MAX`` devices; a layer's
        matrices' gradients summed round the ring as they are computed:
        ``dew.parallel.fsdp_matmul``) or ``"auto"`` (the default), which ``resolve`` turns into
        one of them by a rule: ``"ring"`` on TPU devices wherever a ring can run (fsdp of 2 to
        ``fsdp.RING_MAX``, no ``stage`` axis), ``"gather"`` elsewhere. The TPU compiler runs a
        ring's collective-permutes beside the matmuls and leaves most all-gathers alone (on a
        3-D torus, every one): on v5e-8, Llama-3.2-1B, fsdp=8, the gathers exposed 7.8 x
        GSPMD's bytes and the rings 0.25 x, in less memory than GSPMD's (docs/benchmarks.md,
        "Pods by default"). On CPU and GPU, ``"auto"`` is the gathers: nothing measured there
        says otherwise, and the CPU programs of the tests stay what they were.
      gradient_sum_dtype: the dtype every cross-device sum of a weight's gradient runs in (the
        fsdp ``psum_scatter``, the ``psum`` s over ``data`` and the other axes of
        ``dew.parallel.gradients``): ``None`` (the default) sums each gradient in its weight's
        dtype, float32 for float32 weights, so the sum adds no rounding to what each device
        computed; ``"bfloat16"`` casts each gradient to bfloat16 for its sums and the summed
        shard back to the weight's dtype, as GSPMD's bfloat16 rings do when the activations are
        bfloat16: half the bytes of float32 sums and of their whole-gradient temporaries, with
        bfloat16's rounding at every step of the sum. ``"float32"`` sums bfloat16 weights'
        gradients in float32.
      tensor_scheme: how activations cross a ``tensor`` axis above 1 at the Megatron regions'
        entries and exits: ``"plain"`` (``dew.parallel.tensor``'s pairs, an all-gather or
        all-reduce before or after the matmuls), ``"ring"`` (collective matmuls,
        ``dew.parallel.tensor_ring``: rings of ``ppermute`` s, each block of positions' matmul
        beside the next block's transfer, the same bytes; each device's positions must split
        over ``tensor``, and not with a ``stage`` axis) or ``"auto"`` (the default): the rings
        on TPU devices wherever they can run, the plain pairs elsewhere (``resolve``). On the
        v5e-8 compile of Llama-3.2-1B at fsdp=2,tensor=4 the rings left 0.55 x GSPMD's bytes
        exposed where the plain pairs left 1.10 x, with the same wire bytes and heap, and 0.17 x
        beside the fsdp rings (docs/benchmarks.md).
      quantize: what the decoder layers' projections (q, k, v, o, gate, up, down, the experts')
        multiply in: ``"bfloat16"`` (the default: in the activations' dtype) or ``"int8"``
        (``dew.nn.quantized``: int8 x int8 -> int32 in the forward and both gradients, per-token
        and per-output-channel scales computed in the step, the gradients rounded
        stochastically from the step's key; a LoRA model's int8 base multiplies W8A8).
        Attention, the embedding, the head and the loss stay in the activations' dtype. Under
        ``"int8"`` the projections' weights are gathered whole (by the fsdp rings where those
        run, not fused with the matmuls), as int8 with their whole weights' per-output-channel
        scales (``dew.parallel.fsdp_int8``: one byte an entry on the wire, dequantized to
        exactly the integers and scales the matmul takes; the gradient sums stay in float);
        the tensor regions enter and leave by either scheme, the rings multiplying each block
        in int8 and passing the entries' inputs and the exits' output gradients round as int8
        with their scales (``dew.parallel.tensor_ring``).

    Raises:
      ValueError: a value outside its choices (``sequence_parallel`` not a bool, an unknown
        scheme, schedule or dtype), when built. What an option asks of a mesh is ``check``'s,
        which the ``Trainer`` calls before anything compiles.

    Examples:
        >>> from dew import StepOptions
        >>> options = StepOptions(sequence_parallel=True, gradient_sum_dtype="bfloat16")
        >>> trainer = dew.Trainer(objective, optax.adamw(1e-3), key=jax.random.key(0),
        ...                       mesh=dew.MeshSpec(fsdp=2, tensor=4), options=options)
        >>> trainer.options.tensor_scheme  # "auto" resolved: the rings on TPU only
        'plain'
    """

    sequence_parallel: bool = False
    sequence_scheme: str = "ring"
    pipeline_schedule: str = "1f1b"
    fsdp_scheme: str = AUTO
    gradient_sum_dtype: str | None = None
    tensor_scheme: str = AUTO
    quantize: str = "bfloat16"

    def __post_init__(self):
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(
                f"sequence_parallel must be True or False, got {self.sequence_parallel!r}"
            )
        if self.sequence_scheme not in sequence.SCHEMES:
            raise ValueError(
                f"unknown sequence_scheme {self.sequence_scheme!r}; expected one of "
                f"{', '.join(sequence.SCHEMES)}"
            )
        if self.pipeline_schedule not in pipeline.SCHEDULES:
            raise ValueError(
                f"unknown pipeline_schedule {self.pipeline_schedule!r}; expected one of "
                f"{', '.join(pipeline.SCHEDULES)}"
            )
        if self.fsdp_scheme not in FSDP_SCHEMES:
            raise ValueError(
                f"unknown fsdp_scheme {self.fsdp_scheme!r}; expected one of "
                f"{', '.join(FSDP_SCHEMES)}"
            )
        if self.tensor_scheme not in TENSOR_SCHEMES:
            raise ValueError(
                f"unknown tensor_scheme {self.tensor_scheme!r}; expected one of "
                f"{', '.join(TENSOR_SCHEMES)}"
            )
        if self.quantize not in QUANTIZE:
            raise ValueError(
                f"unknown quantize {self.quantize!r}; expected one of {', '.join(QUANTIZE)}"
            )
        if self.gradient_sum_dtype not in (None, *GRADIENT_SUM_DTYPES):
            raise ValueError(
                f"unknown gradient_sum_dtype {self.gradient_sum_dtype!r}; expected None (each "
                f"weight's dtype) or one of {', '.join(GRADIENT_SUM_DTYPES)}"
            )

    def check(self, axis_sizes: dict, seq_len: int) -> None:
        """Checks that these options can run, and take effect, on a mesh of ``axis_sizes``
        (axis name to size, as ``dict(mesh.shape)``) with rows of ``seq_len`` positions.

        Raises:
          ValueError: naming the values, for any of: ``sequence_parallel`` without a ``tensor``
            axis, or with positions per device that do not split over it; ``sequence_scheme``
            other than the default without a ``sequence`` axis, or the ring inside a pipeline
            (its ``ppermute`` s would sit in the branch a stage takes at a tick, and XLA:CPU
            joins every device of the step in each collective-permute, so stages running
            different branches deadlock); ``pipeline_schedule`` other than the default without
            a ``stage`` axis; ``fsdp_scheme="ring"`` on an fsdp axis outside 2 to
            ``fsdp.RING_MAX``, or with a ``stage`` axis (the ring attention's reason);
            ``tensor_scheme="ring"`` without a ``tensor`` axis, with positions per device that
            do not split over it (the ring's blocks), or with a ``stage`` axis.
        """
        t, n = axis_sizes.get("tensor", 1), axis_sizes.get("sequence", 1)
        stages = axis_sizes.get("stage", 1)
        if self.sequence_parallel:
            if t == 1:
                raise ValueError(
                    "sequence_parallel=True needs a tensor axis above 1: it splits the "
                    "activations between blocks over the tensor group, and this mesh has tensor 1"
                )
            positions = seq_len // n
            if positions % t:
                held = f"seq_len {seq_len}" + (
                    f" over sequence {n} leaves {positions} positions per device, which"
                    if n > 1
                    else ""
                )
                raise ValueError(
                    f"{held} does not split over tensor {t} (sequence_parallel=True splits each "
                    "row's positions across the tensor group)"
                )
        if self.sequence_scheme != "ring" and n == 1:
            raise ValueError(
                f"sequence_scheme={self.sequence_scheme!r} needs a sequence axis above 1; this "
                "mesh has sequence 1"
            )
        if stages > 1 and n > 1 and self.sequence_scheme == "ring":
            raise ValueError(
                f"sequence {n} with stage {stages}: ring attention's ppermutes cannot run inside a "
                "pipeline stage (each stage runs its own branch of the schedule, and a "
                "collective-permute there must be joined by every device); use "
                "sequence_scheme='all_to_all' with a stage axis"
            )
        if self.pipeline_schedule != "1f1b" and stages == 1:
            raise ValueError(
                f"pipeline_schedule={self.pipeline_schedule!r} needs a stage axis above 1; this "
                "mesh has stage 1"
            )
        f = axis_sizes.get("fsdp", 1)
        if self.fsdp_scheme == "ring" and not 1 < f <= fsdp.RING_MAX:
            raise ValueError(
                f"fsdp_scheme='ring' needs an fsdp axis of 2 to {fsdp.RING_MAX} devices (a ring "
                f"is fsdp - 1 ppermutes a gather, written into the step); this mesh has fsdp {f}"
            )
        if self.fsdp_scheme == "ring" and stages > 1:
            raise ValueError(
                f"fsdp_scheme='ring' with stage {stages}: the fsdp rings' ppermutes cannot run "
                "inside a pipeline stage (each stage runs its own branch of the schedule, and a "
                "collective-permute there must be joined by every device); use "
                "fsdp_scheme='gather' with a stage axis"
            )

        if self.tensor_scheme == "ring":
            self._check_tensor_ring(t, stages, seq_len, n)

    def _check_tensor_ring(self, t: int, stages: int, seq_len: int, n: int) -> None:
        if t == 1:
            raise ValueError(
                "tensor_scheme='ring' needs a tensor axis above 1: its rings pass blocks of "
                "positions round the tensor group, and this mesh has tensor 1"
            )
        positions = seq_len // n
        if positions % t:
            held = f"seq_len {seq_len}" + (
                f" over sequence {n} leaves {positions} positions per device, which"
                if n > 1
                else ""
            )
            raise ValueError(
                f"tensor_scheme='ring': {held} does not split into tensor {t} blocks (its rings "
                "pass blocks of each row's positions round the tensor group)"
            )
        if stages > 1:
            raise ValueError(
                f"tensor_scheme='ring' with stage {stages}: the tensor rings' ppermutes cannot run "
                "inside a pipeline stage (each stage runs its own branch of the schedule, and a "
                "collective-permute there must be joined by every device); use "
                "tensor_scheme='plain' with a stage axis"
            )

    def resolve(
        self,
        axis_sizes: dict,
        platform: str,
        seq_len: int | None = None,
        tensor_ringable: bool = True,
    ) -> StepOptions:
        """These options with every ``"auto"`` made a choice, for a step on a mesh of
        ``axis_sizes`` whose devices are ``platform``'s (``"cpu"``, ``"gpu"``, ``"tpu"``), on
        rows of ``seq_len`` positions (``None``: any that split): what the ``Trainer`` builds
        its step with. ``tensor_ringable``: whether some Megatron region of the model has plain
        weights for a tensor ring to run (a LoRA model whose adapters, or int8 base, cover every
        region has none: ``dew.models.lora.some_region_unadapted``). A rule, not a compile
        (docs/distributed.md, "Schemes chosen by default"): the table it stands on is
        docs/benchmarks.md's."""
        chosen = {}
        if self.fsdp_scheme == AUTO:
            chosen["fsdp_scheme"] = auto_fsdp_scheme(axis_sizes, platform)
        if self.tensor_scheme == AUTO:
            ring = tensor_ringable and auto_tensor_scheme(axis_sizes, platform, seq_len) == "ring"
            chosen["tensor_scheme"] = "ring" if ring else "plain"
        return dataclasses.replace(self, **chosen)

    def in_effect(self, axis_sizes: dict) -> dict:
        """The options a mesh of ``axis_sizes`` uses, by name: ``sequence_parallel`` with a
        ``tensor`` axis, ``sequence_scheme`` with a ``sequence`` axis, ``pipeline_schedule`` with
        a ``stage`` axis (for a header or a benchmark row: what shaped this step)."""
        uses = {
            "sequence_parallel": axis_sizes.get("tensor", 1) > 1,
            "sequence_scheme": axis_sizes.get("sequence", 1) > 1,
            "pipeline_schedule": axis_sizes.get("stage", 1) > 1,
            # Named where the rings run (asked or chosen): a layout that gathers says nothing.
            "fsdp_scheme": self.fsdp_scheme == "ring" and axis_sizes.get("fsdp", 1) > 1,
            "gradient_sum_dtype": self.gradient_sum_dtype is not None,
            "tensor_scheme": self.tensor_scheme == "ring" and axis_sizes.get("tensor", 1) > 1,
            "quantize": self.quantize != "bfloat16",
        }
        return {name: getattr(self, name) for name, used in uses.items() if used}

    def describe(self) -> dict:
        """The options as a JSON-ready dict (checkpoint metadata, benchmark rows)."""
        return dataclasses.asdict(self)


def auto_fsdp_scheme(axis_sizes: dict, platform: str) -> str:
    """``fsdp_scheme="auto"`` on a mesh of ``axis_sizes`` of ``platform`` devices: ``"ring"`` on
    TPU where a ring can run (an fsdp axis of 2 to ``fsdp.RING_MAX`` devices, no ``stage`` axis),
    else ``"gather"``."""
    f, stages = axis_sizes.get("fsdp", 1), axis_sizes.get("stage", 1)
    return "ring" if platform == "tpu" and 1 < f <= fsdp.RING_MAX and stages == 1 else "gather"


def auto_tensor_scheme(axis_sizes: dict, platform: str, seq_len: int | None = None) -> str:
    """``tensor_scheme="auto"`` on a mesh of ``axis_sizes`` of ``platform`` devices, rows of
    ``seq_len`` positions: ``"ring"`` on TPU where the rings can run (a tensor axis above 1, no
    ``stage`` axis, each device's positions in whole blocks of ``tensor``), else ``"plain"``."""
    t, n = axis_sizes.get("tensor", 1), axis_sizes.get("sequence", 1)
    splits = seq_len is None or (seq_len // n) % t == 0
    stages = axis_sizes.get("stage", 1)
    return "ring" if platform == "tpu" and t > 1 and stages == 1 and splits else "plain"


DEFAULT = StepOptions()
