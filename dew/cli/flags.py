"""Flags that more than one ``dew`` command reads, defined once.

Nothing here imports JAX's backends: the device flags must be read before any device is created.
"""

from __future__ import annotations

import argparse
import dataclasses


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


class Parser(argparse.ArgumentParser):
    """The ``dew`` command's parser (and its subcommands'): a flag given twice is an error, or
    adds up where the flag takes several values (``_GivenOnce``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register("action", None, _GivenOnce)
        self.register("action", "store", _GivenOnce)


def engine_names() -> tuple[str, ...]:
    """The step engines, from their one definition (``dew.training.step.ENGINES``)."""
    from dew.training.step import ENGINES

    return ENGINES


def sequence_scheme_names() -> tuple[str, ...]:
    """The sequence-parallel attention schemes, from their one definition
    (``dew.parallel.sequence.SCHEMES``)."""
    from dew.parallel.sequence import SCHEMES

    return tuple(SCHEMES)


def add_device_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cpu-devices",
        type=int,
        default=8,
        metavar="N",
        help="simulate N devices on the CPU (default 8); 0 uses JAX's own backend",
    )


def preset_names() -> tuple[str, ...]:
    from dew.models.presets import PRESETS

    return tuple(PRESETS)


def add_model_flags(
    parser: argparse.ArgumentParser,
    *,
    batch: int,
    seq_len: int,
    layers: int,
    width: int,
    heads: int,
    several: tuple[str, ...] = (),
) -> None:
    """The decoder, its precision, recompute and attention, and its batch: a ``--model`` preset
    (``dew.models.presets``) or the example decoder (a byte vocabulary) of ``layers``, ``width``
    and ``heads``; ``--layers``, ``--width`` and ``--heads`` override either. ``--dtype``,
    ``--param-dtype``, ``--remat`` and ``--attention`` default to the model's own (a preset's:
    bfloat16 activations and the fastest attention for the devices; the example decoder's:
    float32 and XLA attention). ``several`` names those of ``dtype``, ``remat`` and
    ``attention`` that take one or more values, each a contestant of its own (read them with
    ``model_variants``); read the rest with ``model_config``."""
    from dew.models.causal_transformer import DTYPES, REMAT_CHOICES
    from dew.nn.attention import CHOICES as ATTENTION_CHOICES

    parser.add_argument(
        "--model",
        default=None,
        choices=preset_names(),
        metavar="PRESET",
        help="a published model's shapes: " + ", ".join(preset_names()) + " (default: the "
        "example decoder, byte vocabulary); --layers, --width and --heads override its sizes",
    )
    parser.add_argument(
        "--batch", type=int, default=batch, help=f"global batch rows (default {batch})"
    )
    parser.add_argument(
        "--seq-len",
        type=int,
        default=seq_len,
        help=f"tokens per row (default {seq_len}); a preset keeps its own context "
        "(max_seq_len), which --seq-len may not pass",
    )
    parser.add_argument(
        "--layers", type=int, default=None, help=f"decoder layers (default {layers})"
    )
    parser.add_argument(
        "--width", type=int, default=None, help=f"embedding features (default {width})"
    )
    parser.add_argument(
        "--heads", type=int, default=None, help=f"attention heads (default {heads})"
    )

    def takes(name: str) -> dict:
        """``--name``'s nargs and the words its help ends with."""
        if name in several:
            return dict(nargs="+"), "; several: one contestant each"
        return {}, ""

    nargs, more = takes("dtype")
    parser.add_argument(
        "--dtype",
        default=None,
        choices=tuple(DTYPES),
        help="activations' dtype (default: the model's own, bfloat16 for a preset and float32 "
        "for the example decoder); softmax, norms and the loss run in float32 regardless" + more,
        **nargs,
    )
    parser.add_argument(
        "--param-dtype",
        default=None,
        choices=tuple(DTYPES),
        help="the weights' dtype (default float32; the optimizer's moments follow it)",
    )
    nargs, more = takes("remat")
    parser.add_argument(
        "--remat",
        default=None,
        choices=REMAT_CHOICES,
        metavar="POLICY",
        help="what each layer keeps for the backward (default: the model's own): full "
        "(nothing: the layer is recomputed), dots (the matmul outputs), attention (those and "
        "the attention output), none (everything)" + more,
        **nargs,
    )
    nargs, more = takes("attention")
    parser.add_argument(
        "--attention",
        default=None,
        choices=ATTENTION_CHOICES,
        help="the attention kernel (default: the model's own, auto for a preset, xla for the "
        "example decoder): auto (Pallas on TPU, cuDNN on GPU where it takes the shapes, else "
        "Pallas, XLA on CPU, by the devices the step is compiled for), xla, pallas, cudnn (GPU "
        "only), pallas_tpu_interpret (the TPU kernels interpreted, for tests)" + more,
        **nargs,
    )
    parser.set_defaults(
        example_model=dict(
            vocab_size=EXAMPLE_VOCAB, num_layers=layers, emb_features=width, num_heads=heads
        )
    )


# The example decoder reads bytes.
EXAMPLE_VOCAB = 256
# The sizes ``dew train``, ``collectives`` and ``plan`` give the example decoder (``dew bench``
# times a larger one by default: ``dew.benchmark.ModelSize``, named in its header).
EXAMPLE_SIZES = dict(batch=16, seq_len=32, layers=2, width=64, heads=4)


def add_accumulation_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--accumulation",
        type=int,
        default=1,
        metavar="K",
        help="microbatches per step, their gradients summed before one update (default 1); "
        "the batch must split into K microbatches over the batch's devices",
    )


# ``model_config``'s arguments from the flags that set one model field each, when given.
_MODEL_CHOICE_FLAGS = {
    "dtype": "dtype",
    "param_dtype": "param_dtype",
    "remat": "remat",
    "attention": "attention_impl",
}


def model_config(args) -> dict:
    """``models.build("causal_transformer", ...)``'s arguments from ``add_model_flags``' and
    ``add_moe_flags``' flags: the ``--model`` preset's shapes or the example decoder's, with
    ``--layers``/``--width``/``--heads``, ``--dtype``, ``--param-dtype``, ``--remat`` and
    ``--attention`` applied where given, and the MoE flags (``moe_config``).

    A preset keeps its own context (``max_seq_len``); ``--seq-len`` above it is a ``ValueError``.
    The example decoder's ``max_seq_len`` is ``--seq-len``.
    """
    from dew.models.presets import preset

    config = preset(args.model) if args.model else dict(args.example_model)
    given = dict(num_layers=args.layers, emb_features=args.width, num_heads=args.heads)
    given.update({field: getattr(args, flag, None) for flag, field in _MODEL_CHOICE_FLAGS.items()})
    config.update({k: v for k, v in given.items() if v is not None})
    if not args.model:
        config["max_seq_len"] = args.seq_len
    elif args.seq_len > config["max_seq_len"]:
        raise ValueError(
            f"--seq-len {args.seq_len} is above {args.model}'s context of "
            f"{config['max_seq_len']} tokens"
        )
    config.update(moe_config(args))
    return config


def model_variants(args) -> tuple[dict, list[dict]]:
    """``(config, variants)`` for a command whose model choices take several values
    (``add_model_flags(several=...)``): ``model_config`` of the flags with those choices left to
    the model, and one dict of ``build`` arguments per combination of the values given
    (``--remat full dots --attention xla pallas``: four), ``[{}]`` when none was given."""
    import itertools

    several = {
        field: values
        for flag, field in _MODEL_CHOICE_FLAGS.items()
        if isinstance(values := getattr(args, flag, None), list)
    }
    plain = argparse.Namespace(**{**vars(args), **{f: None for f in _MODEL_CHOICE_FLAGS}})
    config = model_config(plain)
    for flag, field in _MODEL_CHOICE_FLAGS.items():
        value = getattr(args, flag, None)
        if value is not None and not isinstance(value, list):
            config[field] = value
    for field in several:  # a preset's own choice gives way to the values given
        config.pop(field, None)
    fields = list(several)
    variants = [dict(zip(fields, combo)) for combo in itertools.product(*several.values())]
    return config, variants


def sizes_text(config: dict, args, name: str | None = None) -> str:
    """What a command runs, for its header: ``"llama-3.2-1b: 16 layers, width 2048, 32 heads
    (8 kv), vocab 128256, context 8192; bfloat16 activations, float32 weights, remat full,
    attention auto; batch 16 x 32 tokens"``, from ``model_config``'s ``config`` (or a model's
    fields); ``name`` says where the model comes from when it is neither a preset nor the
    example decoder (``--init-from``)."""
    from dew.models.causal_transformer import CausalTransformer

    defaults = {f.name: f.default for f in dataclasses.fields(CausalTransformer)}
    value = {**defaults, **config}
    kv = value["num_kv_heads"]
    return (
        f"{name or args.model or 'example decoder'}: {value['num_layers']} layers, width "
        f"{value['emb_features']}, {value['num_heads']} heads"
        + (f" ({kv} kv)" if kv not in (None, value["num_heads"]) else "")
        + f", vocab {value['vocab_size']}, context {value['max_seq_len']}"
        + (f", {value['num_experts']} experts" if value.get("num_experts") else "")
        + f"; {value['dtype']} activations, {value['param_dtype']} weights, remat "
        f"{value['remat']}, attention {value['attention_impl']}; batch {args.batch} x "
        f"{args.seq_len} tokens"
    )


# The MoE flags' defaults when --experts is given; without it, giving any of them is an error.
MOE_DEFAULTS = {"experts_per_token": 2, "moe_every": 1, "capacity_factor": None}
# MoE flags passed on only when given (the model's defaults apply otherwise), with the same rule.
MOE_EXCHANGE_FLAGS = ("expert_exchange", "expert_buffer_factor")


def add_moe_flags(parser: argparse.ArgumentParser) -> None:
    """A mixture-of-experts decoder: ``--experts E`` (0: dense), ``--experts-per-token``,
    ``--moe-every``, ``--capacity-factor``, ``--expert-exchange``, ``--expert-buffer-factor``;
    all but the first only with ``--experts``."""
    parser.add_argument(
        "--experts",
        type=int,
        default=0,
        metavar="E",
        help="experts per MoE layer (default 0: a dense model); split over the expert axis",
    )
    parser.add_argument(
        "--experts-per-token",
        type=int,
        default=None,
        metavar="K",
        help="experts each token is routed to (default 2; with --experts)",
    )
    parser.add_argument(
        "--moe-every",
        type=int,
        default=None,
        metavar="N",
        help="every N-th layer is an MoE layer (default 1: all of them; with --experts)",
    )
    parser.add_argument(
        "--capacity-factor",
        type=float,
        default=None,
        metavar="C",
        help="an expert takes at most ceil(C x seq x K / E) copies from each row "
        "(default: dropless; with --experts)",
    )
    parser.add_argument(
        "--expert-exchange",
        default=None,
        metavar="HOW",
        help="how token copies cross the expert axis: ragged (ragged_all_to_all, exactly the "
        "copies routed; emulated on CPU), padded (all_to_all of a slot per destination) or auto "
        "(the default: ragged on TPU and GPU, padded on CPU; with --experts)",
    )
    parser.add_argument(
        "--expert-buffer-factor",
        type=float,
        default=None,
        metavar="F",
        help="the ragged exchange's receive buffer over a device's even share of copies "
        "(default 2; copies past it are dropped and counted in dropped_fraction; the expert "
        "axis size or more never drops; with --experts)",
    )


def moe_config(args) -> dict:
    """The model arguments of ``add_moe_flags``' flags (empty for a dense model).

    Raises ``ValueError`` when an MoE flag is given without ``--experts``: it would change
    nothing."""
    names = (*MOE_DEFAULTS, *MOE_EXCHANGE_FLAGS)
    given = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    if not args.experts:
        if given:
            flags = ", ".join(f"--{name.replace('_', '-')} {v}" for name, v in given.items())
            raise ValueError(
                f"{flags} configures mixture-of-experts layers, which a dense model does not "
                "have; add --experts E (E experts per MoE layer)"
            )
        return {}
    return dict(num_experts=args.experts, **{**MOE_DEFAULTS, **given})


def add_min_shard_flag(parser: argparse.ArgumentParser) -> None:
    """``--min-shard``, whose default is ``Layout()``'s: one default from Python and the CLI."""
    from dew.layout import DEFAULT_MIN_SHARD

    parser.add_argument(
        "--min-shard",
        type=int,
        default=DEFAULT_MIN_SHARD,
        help="weights with fewer elements are not split over fsdp; tensor splits always apply "
        f"(default {DEFAULT_MIN_SHARD}, as Layout())",
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
            help="axis sizes, e.g. " + MESH_EXAMPLES + "; default: all data parallel",
        )


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
    from dew.parallel.pipeline import SCHEDULES

    parser.add_argument(
        "--pipeline-schedule",
        nargs="+" if several else None,
        default=["1f1b"] if several else "1f1b",
        choices=list(SCHEDULES),
        metavar="SCHEDULE",
        help="the pipeline's schedule over a stage axis above 1 (default 1f1b"
        + ("; several: one contestant each" if several else "")
        + "): 1f1b holds at most stage microbatches' inputs, 1f1b_phased alternates forward "
        "and backward ticks, gpipe runs all forwards then all backwards",
    )


def add_fsdp_scheme_flag(parser: argparse.ArgumentParser) -> None:
    """``--fsdp-scheme``: ``StepOptions(fsdp_scheme=...)``."""
    from dew.parallel.options import FSDP_SCHEMES

    parser.add_argument(
        "--fsdp-scheme",
        default="gather",
        choices=FSDP_SCHEMES,
        help="how weights cross an fsdp axis above 1 (default gather: all_gather, its gradient a "
        "psum_scatter); ring: rings of ppermutes with the same bytes (fsdp of 2 to 32), which "
        "the TPU compiler overlaps with compute on a 3-D torus (v4, v5p), for more temporary "
        "memory",
    )


def step_options(args):
    """The ``StepOptions`` of one command's flags (``train``, ``collectives``, ``plan``)."""
    from dew.parallel.options import StepOptions

    return StepOptions(
        sequence_parallel=args.sequence_parallel,
        sequence_scheme=args.sequence_scheme,
        pipeline_schedule=args.pipeline_schedule,
        fsdp_scheme=args.fsdp_scheme,
    )


def add_seed_flag(parser: argparse.ArgumentParser, seeds: str) -> None:
    """``--seed``; ``seeds`` says what it draws (its help text)."""
    parser.add_argument("--seed", type=int, default=0, help=f"the seed of {seeds} (default 0)")
