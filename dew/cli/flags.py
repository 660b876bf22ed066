"""Flags that more than one ``dew`` command reads, defined once.

Nothing here imports JAX: the device flags must be read before any device is created, and
``dew COMMAND --help`` needs no JAX at all (the choices are ``dew.cli.choices``' copies).
"""

from __future__ import annotations

import argparse
import re

from dew.cli import choices


class _GivenOnce(argparse._StoreAction):
    """``store``, except that a flag given twice is refused, or added up when it takes several
    values: ``--mesh fsdp=8 --mesh tensor=2`` is two layouts where a command compares several,
    and an error where it runs one (argparse would silently keep the last)."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = namespace.__dict__.setdefault("_given_flags", set())
        if option_string is not None and self.dest in given:
            if self.nargs in ("+", "*"):
                values = [*getattr(namespace, self.dest), *values]
            else:
                before = getattr(namespace, self.dest)
                hint = REPEAT_HINTS.get(self.dest, "")
                parser.error(
                    f"{option_string} given twice ({before} and {values}); it takes one value"
                    + (f": {hint}" if hint else "")
                )
        given.add(self.dest)
        setattr(namespace, self.dest, values)


# What to write instead of repeating a flag that takes one value.
REPEAT_HINTS = {
    "mesh": "a command that runs one layout takes its axes in one --mesh, e.g. fsdp=8,tensor=2 "
    "(dew bench and dew plan compare several: --mesh fsdp=8 tensor=2)",
}


# A negative number as a flag's value, in every spelling float() takes that a flag could be
# mistaken for: argparse's own pattern (-1, -.5) leaves out exponents, so "--lr -1e-3" was read as
# a flag "-1e-3" ("expected one argument") instead of a value to refuse by name.
_NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|nan)$", re.IGNORECASE)


class Parser(argparse.ArgumentParser):
    """The ``dew`` command's parser (and its subcommands'): a flag given twice is an error, or
    adds up where the flag takes several values (``_GivenOnce``); a negative number is a value
    (``--lr -1e-3``), which the command then refuses by its flag's name where it must be
    positive."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register("action", None, _GivenOnce)
        self.register("action", "store", _GivenOnce)
        self._negative_number_matcher = _NEGATIVE_NUMBER


# The headings of dew COMMAND --help, by topic (issue 67: 236 lines under one "options:" heading).
DEVICES = "devices and mesh"
MODEL = "model"
LORA = "LoRA"
DATA = "data"
PRECISION = "precision and memory"
OPTIMIZER = "optimizer and schedule"
CHECKPOINTS = "checkpoints and resume"
LOGGING = "logging and evaluation"


def topics(parser: argparse.ArgumentParser, *titles: str) -> dict:
    """``{title: argument group}``, one group per title, shown in this order in ``--help``; the
    flag helpers take a group where they take a parser."""
    return {title: parser.add_argument_group(title) for title in titles}


# The library's names for what a model-building command's flags set (it is a Python API too, and
# its messages name its arguments: "num_experts", "Layout.min_shard", "sequence_parallel=True"),
# by the flag; a plain word (batch, accumulation) only where a value follows it.
FLAG_OF = {
    "num_experts": "--experts",
    "experts_per_token": "--experts-per-token",
    "moe_every": "--moe-every",
    "capacity_factor": "--capacity-factor",
    "expert_exchange": "--expert-exchange",
    "expert_buffer_factor": "--expert-buffer-factor",
    "loss_chunk_tokens": "--loss-chunk",
    "attention_impl": "--attention",
    "attention_window": "--attention-window",
    "num_layers": "--layers",
    "emb_features": "--width",
    "num_heads": "--heads",
    "seq_len": "--seq-len",
    "param_dtype": "--param-dtype",
    "Layout.min_shard": "--min-shard",
    "min_shard": "--min-shard",
    "sequence_parallel": "--sequence-parallel",
    "sequence_scheme": "--sequence-scheme",
    "pipeline_schedule": "--pipeline-schedule",
    "fsdp_scheme": "--fsdp-scheme",
    "tensor_scheme": "--tensor-scheme",
    "gradient_sum_dtype": "--gradient-sum-dtype",
    "quantize": "--quantize",
}
PLAIN_FLAGS = {"batch": "--batch", "accumulation": "--accumulation"}
_NAMED = re.compile(
    r"(?<![\w.-])("
    + "|".join(re.escape(n) for n in sorted(FLAG_OF, key=len, reverse=True))
    # name=True (a switch), name='value' or name=value (a flag and its value)
    + r")(?:=True\b|=(['\"]?)([\w.]+)\2)?(?![\w])"
    + r"|(?<![\w.-])("
    + "|".join(PLAIN_FLAGS)
    + r")(?= \d)"
)


_MESH_SPEC = re.compile(r"MeshSpec\(([^()]*)\)")


def in_flags(message: str) -> str:
    """``message`` with the library's names of ``FLAG_OF`` and ``PLAIN_FLAGS`` said as the flags
    that set them: ``"num_heads 2 does not split over tensor 8"`` -> ``"--heads 2 does not split
    over tensor 8"``, ``"sequence_parallel=True needs"`` -> ``"--sequence-parallel needs"``,
    ``"MeshSpec(stage=2) needs"`` -> ``"--mesh stage=2 needs"``."""

    def flag(match: re.Match) -> str:
        if match.group(4):
            return PLAIN_FLAGS[match.group(4)]
        value = match.group(3)
        return FLAG_OF[match.group(1)] + (f" {value}" if value else "")

    # MeshSpec(stage=2, microbatches=4) is what --mesh stage=2,microbatches=4 makes.
    message = _MESH_SPEC.sub(lambda m: "--mesh " + m.group(1).replace(", ", ","), message)
    return _NAMED.sub(flag, message)


def check_counts(args: argparse.Namespace, *dests: str) -> None:
    """``ValueError`` naming the flag (``--eval-every``, not ``eval_every``) for each of ``dests``
    given a value below 1 (``dew.checks.positive_int``); a flag left at ``None`` is not given."""
    from dew.checks import positive_int

    for dest in dests:
        value = getattr(args, dest, None)
        if value is not None:
            positive_int("--" + dest.replace("_", "-"), value)


def engine_names() -> tuple[str, ...]:
    """The step engines (``dew.training.step.ENGINES``, as ``dew.cli.choices`` copies it)."""
    return choices.ENGINES


def sequence_scheme_names() -> tuple[str, ...]:
    """The sequence-parallel attention schemes (``dew.parallel.sequence.SCHEMES``' names, as
    ``dew.cli.choices`` copies them)."""
    return choices.SEQUENCE_SCHEMES


def add_device_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cpu-devices",
        type=int,
        default=None,
        metavar="N",
        help="simulate N devices on the CPU; 0 uses the devices JAX finds (default: the "
        "accelerator JAX finds, a TPU or GPU, by its device files and JAX's plugin for it, or "
        "JAX_PLATFORMS where set; 8 simulated CPU devices where there is none)",
    )


def add_accumulation_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--accumulation",
        type=int,
        default=1,
        metavar="K",
        help="microbatches per step, their gradients summed before one update (default 1); "
        "the batch must split into K microbatches over the batch's devices",
    )


def add_min_shard_flag(parser: argparse.ArgumentParser) -> None:
    """``--min-shard``, whose default is ``Layout()``'s (``dew.layout.DEFAULT_MIN_SHARD``, as
    ``dew.cli.choices`` copies it): one default from Python and the CLI."""
    parser.add_argument(
        "--min-shard",
        type=int,
        default=choices.DEFAULT_MIN_SHARD,
        help="weights with fewer elements are not split over fsdp; tensor splits always apply "
        f"(default {choices.DEFAULT_MIN_SHARD}, as Layout())",
    )


MESH_EXAMPLES = (
    "fsdp=8, data=2,fsdp=4, fsdp=2,tensor=4, sequence=4, expert=8 (with --experts) or "
    "stage=2,microbatches=4 (data takes the devices left over)"
)


def add_mesh_flag(parser: argparse.ArgumentParser, *, several: bool = False) -> None:
    """``--mesh``: the axis sizes (``MeshSpec.parse``); ``several=True`` takes one or more, each
    a layout to compare."""
    if several:
        parser.add_argument(
            "--mesh",
            nargs="+",
            default=None,
            metavar="MESH",
            help="one or more layouts to compare, each axis sizes such as "
            + MESH_EXAMPLES
            + "; default: data=N fsdp=N data=2,fsdp=N/2 on N devices (data=8 fsdp=8 "
            "data=2,fsdp=4 on 8), data=1 on one",
        )
    else:
        parser.add_argument(
            "--mesh",
            default="",
            help="axis sizes, e.g. "
            + MESH_EXAMPLES
            + "; default: fsdp=N over the N devices (fully sharded, as torchtitan and MaxText "
            "default: each device holds 1/N of each large weight and of its optimizer state, "
            "where data=N would hold all of them on every device)",
        )


def default_mesh(mesh: str, devices: int) -> str:
    """``--mesh`` of a command that runs one layout: ``mesh`` as given, or ``fsdp=N`` over the
    ``devices`` devices when none is: fully sharded, never a whole replica on each device (the
    state a device holds is then about 1/N of the model's, where data=N holds all of it)."""
    return mesh if mesh.strip() else f"fsdp={devices}"


def default_layouts(devices: int) -> list[str]:
    """The layouts a command that compares several runs when ``--mesh`` is not given, on
    ``devices`` devices: all data parallel, fully sharded, and both (where the count is even
    and above 2); ``data=1`` alone on one device."""
    if devices == 1:
        return ["data=1"]
    layouts = [f"data={devices}", f"fsdp={devices}"]
    if devices > 2 and devices % 2 == 0:
        layouts.append(f"data=2,fsdp={devices // 2}")
    return layouts


def add_sequence_parallel_flag(parser: argparse.ArgumentParser) -> None:
    """``--sequence-parallel``: ``StepOptions(sequence_parallel=True)``."""
    parser.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="keep the activations between blocks split over positions across the tensor group "
        "(Megatron's sequence parallelism: activations move by all_gather and psum_scatter "
        "instead of psum); needs tensor > 1 and --seq-len dividing by tensor",
    )


SEQUENCE_SCHEME_HELP = (
    "ring: K/V blocks travel round the sequence group by ppermute; all_to_all (DeepSpeed-Ulysses): "
    "positions traded for heads, which must divide by sequence x tensor"
)


def add_sequence_scheme_flag(parser: argparse.ArgumentParser, *, several: bool = False) -> None:
    """``--sequence-scheme``: ``StepOptions(sequence_scheme=...)``; ``several=True`` takes one or
    more, each run side by side on the layouts with a sequence axis."""
    parser.add_argument(
        "--sequence-scheme",
        nargs="+" if several else None,
        default=["ring"] if several else "ring",
        choices=sequence_scheme_names(),
        metavar="SCHEME",
        help="how attention spans a sequence axis above 1 (default ring"
        + ("; several: one contestant each" if several else "")
        + "); "
        + SEQUENCE_SCHEME_HELP,
    )


def add_pipeline_schedule_flag(parser: argparse.ArgumentParser, *, several: bool = False) -> None:
    """``--pipeline-schedule``: ``StepOptions(pipeline_schedule=...)``; ``several=True`` takes one
    or more, each run side by side on the layouts with a stage axis."""
    parser.add_argument(
        "--pipeline-schedule",
        nargs="+" if several else None,
        default=["1f1b"] if several else "1f1b",
        choices=choices.PIPELINE_SCHEDULES,
        metavar="SCHEDULE",
        help="the pipeline's schedule over a stage axis above 1 (default 1f1b"
        + ("; several: one contestant each" if several else "")
        + "): 1f1b holds at most stage microbatches' inputs, 1f1b_phased alternates forward "
        "and backward ticks, gpipe runs all forwards then all backwards",
    )


def add_fsdp_scheme_flag(parser: argparse.ArgumentParser, *, several: bool = False) -> None:
    """``--fsdp-scheme``: ``StepOptions(fsdp_scheme=...)``; ``several=True`` takes one or more,
    each a step of its own (``step_option_variants``)."""
    parser.add_argument(
        "--fsdp-scheme",
        nargs="+" if several else None,
        default=["auto"] if several else "auto",
        choices=choices.FSDP_SCHEMES,
        metavar="SCHEME",
        help="how weights cross an fsdp axis above 1: gather (all_gather, its gradient a "
        "psum_scatter) or ring (rings of ppermutes with the same bytes, fsdp of 2 to 32, which "
        "the TPU compiler runs beside the matmuls, each weight gradient summed round the ring "
        "as it is computed); default auto: ring on TPU where a ring can run, else gather"
        + ("; several: a row each" if several else ""),
    )


def add_tensor_scheme_flag(parser: argparse.ArgumentParser, *, several: bool = False) -> None:
    """``--tensor-scheme``: ``StepOptions(tensor_scheme=...)``; ``several=True`` takes one or
    more (``step_option_variants``)."""
    parser.add_argument(
        "--tensor-scheme",
        nargs="+" if several else None,
        default=["auto"] if several else "auto",
        choices=choices.TENSOR_SCHEMES,
        metavar="SCHEME",
        help="how activations cross a tensor axis above 1 at attention's and the MLP's entry and "
        "exit: plain (all-gather or all-reduce beside the matmuls) or ring (collective "
        "matmuls, rings of ppermutes with the same bytes, each block of positions' matmul "
        "beside the next block's transfer; positions per device must divide by tensor); "
        "default auto: ring on TPU where the rings can run, else plain"
        + ("; several: a row each" if several else ""),
    )


def add_gradient_sum_flag(parser: argparse.ArgumentParser, *, several: bool = False) -> None:
    """``--gradient-sum-dtype``: ``StepOptions(gradient_sum_dtype=...)``; ``several=True``
    takes one or more (``step_option_variants``)."""
    parser.add_argument(
        "--gradient-sum-dtype",
        nargs="+" if several else None,
        default=[None] if several else None,
        choices=choices.GRADIENT_SUM_DTYPES,
        metavar="DTYPE",
        help="the dtype gradients are summed across devices in (default: each weight's own, "
        "float32 for float32 weights); bfloat16 halves the sums' bytes and their temporaries, "
        "with bfloat16's rounding in the sum" + ("; several: a row each" if several else ""),
    )


def add_quantize_flag(parser: argparse.ArgumentParser) -> None:
    """``--quantize``: ``StepOptions(quantize=...)``."""
    parser.add_argument(
        "--quantize",
        default="bfloat16",
        choices=choices.QUANTIZE,
        help="what the decoder layers' projections (q, k, v, o, gate, up, down, the experts') "
        "multiply in: bfloat16 (the default: the activations' dtype) or int8 (int8 x int8 -> "
        "int32 in the forward and both gradients, per-token and per-output-channel scales, "
        "gradients rounded stochastically; a LoRA run's --base-dtype int8 base multiplies "
        "W8A8); attention, embedding, head and loss stay in the activations' dtype",
    )


def step_options(args):
    """The ``StepOptions`` of one command's flags (``train``, ``collectives``, ``plan``); of
    the first of each where a flag takes several."""
    return step_option_variants(args)[0]


def step_option_variants(args) -> list:
    """One ``StepOptions`` per combination of the ``--fsdp-scheme``, ``--gradient-sum-dtype``
    and ``--tensor-scheme`` values given (``dew plan`` takes several of each), in order."""
    import itertools

    from dew.parallel.options import StepOptions

    def listed(value):
        return value if isinstance(value, list) else [value]

    return [
        StepOptions(
            sequence_parallel=args.sequence_parallel,
            sequence_scheme=args.sequence_scheme,
            pipeline_schedule=args.pipeline_schedule,
            fsdp_scheme=scheme,
            gradient_sum_dtype=dtype,
            tensor_scheme=tensor_scheme,
            quantize=getattr(args, "quantize", "bfloat16"),
        )
        for scheme, dtype, tensor_scheme in itertools.product(
            listed(args.fsdp_scheme),
            listed(args.gradient_sum_dtype),
            listed(args.tensor_scheme),
        )
    ]


def add_seed_flag(parser: argparse.ArgumentParser, seeds: str) -> None:
    """``--seed``; ``seeds`` says what it draws (its help text)."""
    parser.add_argument("--seed", type=int, default=0, help=f"the seed of {seeds} (default 0)")
