"""The model's flags, defined once for every ``dew`` command that builds one: a ``--model`` preset
or the example decoder's sizes, the model's choices (``--dtype``, ``--param-dtype``, ``--remat``,
``--attention``, ``--loss-chunk``, ``--attention-window``, ``--layer-loop``), the
mixture-of-experts flags, and what they make: ``model_config`` (one model), ``model_variants``
(one per value of a choice given several), ``sizes_text`` (a command's first line).

Like ``dew.cli.flags``, nothing here imports JAX at the top, and building the parser imports none
(the choices are ``dew.cli.choices``' copies): the parser is built before the device flags are
read, and ``dew COMMAND --help`` needs no JAX.
"""

from __future__ import annotations

import argparse
import dataclasses

from dew.cli import choices
from dew.cli.flags import check_counts


def preset_names() -> tuple[str, ...]:
    """The presets (``dew.models.presets.PRESETS``' names, as ``dew.cli.choices`` copies them)."""
    return choices.PRESET_NAMES


def add_model_flags(
    parser: argparse.ArgumentParser,
    *,
    batch: int,
    seq_len: int,
    layers: int,
    width: int,
    heads: int,
    several: tuple[str, ...] = (),
    data: argparse._ActionsContainer | None = None,
    precision: argparse._ActionsContainer | None = None,
) -> None:
    """The decoder, its precision, recompute and attention, and its batch: a ``--model`` preset
    (``dew.models.presets``) or the example decoder (a byte vocabulary) of ``layers``, ``width``
    and ``heads``; ``--layers``, ``--width`` and ``--heads`` override either. ``--dtype``,
    ``--param-dtype``, ``--remat`` and ``--attention`` default to the model's own (a preset's:
    bfloat16 activations and the fastest attention for the devices; the example decoder's:
    float32 and XLA attention). ``several`` names those of ``dtype``, ``remat`` and
    ``attention`` that take one or more values, each a contestant of its own (read them with
    ``model_variants``); read the rest with ``model_config``. ``data`` and ``precision``: the
    argument groups (``dew.cli.flags.topics``) that take the batch's flags and the dtypes,
    recompute and loss chunks (default: ``parser``, which takes the rest)."""
    data = parser if data is None else data
    precision = parser if precision is None else precision
    parser.add_argument(
        "--model",
        default=None,
        choices=preset_names(),
        metavar="PRESET",
        help="a published model's shapes: " + ", ".join(preset_names()) + " (default: the "
        "example decoder, byte vocabulary); --layers, --width and --heads override its sizes",
    )
    data.add_argument(
        "--batch", type=int, default=batch, help=f"global batch rows (default {batch})"
    )
    data.add_argument(
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
    precision.add_argument(
        "--dtype",
        default=None,
        choices=choices.DTYPES,
        help="activations' dtype (default: the model's own, bfloat16 for a preset and float32 "
        "for the example decoder); softmax, norms and the loss run in float32 regardless" + more,
        **nargs,
    )
    precision.add_argument(
        "--param-dtype",
        default=None,
        choices=choices.DTYPES,
        help="the weights' dtype (default float32; a LoRA base's too, unless --base-dtype); dew "
        "train keeps the optimizer's moments in --moments-dtype, and float32 master copies of "
        "bfloat16 weights as --master-weights says",
    )
    nargs, more = takes("remat")
    precision.add_argument(
        "--remat",
        default=None,
        choices=(*choices.REMAT_CHOICES, choices.REMAT_AUTO),
        metavar="POLICY",
        help="what each layer keeps for the backward (default: the model's own): full "
        "(nothing: the layer is recomputed), attention_gate (attention's output and the "
        "MLP's gate), dots (the matmul outputs), attention (those and "
        "the attention output), none (everything), auto (the least recomputation whose step "
        "fits the device, a compile per policy tried)" + more,
        **nargs,
    )
    nargs, more = takes("attention")
    parser.add_argument(
        "--attention",
        default=None,
        choices=choices.ATTENTION_CHOICES,
        help="the attention kernel (default: the model's own, auto for a preset, xla for the "
        "example decoder): auto (Pallas on TPU, cuDNN on GPU where it takes the shapes, else "
        "Pallas, XLA on CPU, by the devices the step is compiled for), xla, pallas, cudnn (GPU "
        "only), pallas_tpu_interpret (the TPU kernels interpreted, for tests)" + more,
        **nargs,
    )
    nargs, more = takes("loss_chunk")
    precision.add_argument(
        "--loss-chunk",
        type=int,
        default=None,
        metavar="TOKENS",
        help="tokens whose logits the loss makes at a time (default: chunks of at most 512 MiB "
        "of float32 logits, a multiple of 128 tokens; at least the tokens a device holds: no "
        "chunking)" + more,
        **nargs,
    )
    precision.add_argument(
        "--layer-loop",
        default=None,
        choices=choices.LAYER_LOOPS,
        help="how the layers run (default: the model's own, unroll for gpt2-small, scan for the "
        "others): scan (one loop: a compile that does not grow with depth) or unroll (each layer "
        "compiled on its own: a faster step, a longer compile, and the compiler may keep what "
        "--remat would recompute: dew plan shows the memory)",
    )
    parser.add_argument(
        "--attention-window",
        type=int,
        default=None,
        metavar="W",
        help="sliding-window attention: each token attends to at most the W most recent tokens, "
        "itself included, in every layer (default: all earlier tokens); W below the model's "
        "context",
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


# ``model_config``'s arguments from the flags that set one model field each, when given.
_MODEL_CHOICE_FLAGS = {
    "dtype": "dtype",
    "param_dtype": "param_dtype",
    "remat": "remat",
    "attention": "attention_impl",
    "loss_chunk": "loss_chunk_tokens",
    "attention_window": "attention_window",
    "layer_loop": "layer_loop",
}


def model_config(args) -> dict:
    """``models.build("causal_transformer", ...)``'s arguments from ``add_model_flags``' and
    ``add_moe_flags``' flags: the ``--model`` preset's shapes or the example decoder's, with
    ``--layers``/``--width``/``--heads``, ``--dtype``, ``--param-dtype``, ``--remat``,
    ``--attention`` and ``--attention-window`` applied where given, and the MoE flags
    (``moe_config``).

    A preset keeps its own context (``max_seq_len``); ``--seq-len`` above it is a ``ValueError``.
    The example decoder's ``max_seq_len`` is ``--seq-len``. A size below 1 is a ``ValueError``
    naming its flag.
    """
    from dew.models.presets import preset

    # Named as typed: the model would refuse --seq-len 0 as "max_seq_len".
    check_counts(args, "batch", "seq_len", "layers", "width", "heads", "attention_window")
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
    check_window(args, config["max_seq_len"], _context_of(args, config["max_seq_len"]))
    config.update(moe_config(args))
    from dew.cli.lora_flags import lora_config

    lora = lora_config(args, base=config)
    if lora is not None:
        config["lora"] = lora
    return config


def _context_of(args, context: int) -> str:
    """The model's context and where it comes from, for ``check_window``'s message."""
    if args.model:
        return f"{args.model}'s context of {context} tokens"
    return f"the context of {context} tokens (--seq-len)"


def check_window(args, context: int, said: str) -> None:
    """``ValueError`` naming ``--attention-window`` for a window below 1, or one at or beyond
    the model's ``context`` (``said``: it in words, ``"the context of PATH, 64 tokens"``), which
    hides no token from any other: the flag would change nothing but the attention kernels
    chosen and an export's config, so it is more likely a typo than a wish."""
    check_counts(args, "attention_window")
    window = getattr(args, "attention_window", None)
    if window is not None and window >= context:
        raise ValueError(
            f"--attention-window {window} is not below {said}: every token would see every "
            f"earlier one, as without a window; give a window below {context}, or leave "
            "--attention-window out"
        )


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
    # Named as typed here too: model_config above saw the choice flags as not given.
    check_window(args, config["max_seq_len"], _context_of(args, config["max_seq_len"]))
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
    attention auto; batch 16 x 32 tokens"`` (``", layers unrolled"`` after the attention under
    ``layer_loop="unroll"``), from ``model_config``'s ``config`` (or a model's
    fields); ``name`` says where the model comes from when it is neither a preset nor the
    example decoder (``--init-from``)."""
    from dew.models.causal_transformer import CausalTransformer
    from dew.models.lora import Lora

    defaults = {f.name: f.default for f in dataclasses.fields(CausalTransformer)}
    value = {**defaults, **config}
    kv = value["num_kv_heads"]
    lora = Lora.of(value.get("lora"))
    adapters = ""
    if lora is not None:
        base = "int8" if lora.base_dtype == "int8" else value["param_dtype"]
        adapters = (
            f"; LoRA rank {lora.rank}, alpha {lora.alpha:g} on {','.join(lora.targets)}, "
            f"{base} base frozen"
        )
        # dew train without --init-from: adapters on drawn weights (a test's or a benchmark's
        # run; a user who forgot the flag learns it here, before any step).
        if hasattr(args, "init_from") and not name:
            adapters += " (a random base: no --init-from)"
    window, rows = value.get("attention_window"), args.seq_len
    shown = ""
    if window is not None:
        # One that covers the rows hides nothing in training (an export still carries it).
        covers = f", no narrower than the rows of {rows} tokens: training runs as without it"
        shown = f" (window {window}{covers if window >= rows else ''})"
    return (
        f"{name or args.model or 'example decoder'}: {value['num_layers']} layers, width "
        f"{value['emb_features']}, {value['num_heads']} heads"
        + (f" ({kv} kv)" if kv not in (None, value["num_heads"]) else "")
        + f", vocab {value['vocab_size']}, context {value['max_seq_len']}"
        + (f", {value['num_experts']} experts" if value.get("num_experts") else "")
        + f"; {value['dtype']} activations, {value['param_dtype']} weights, remat "
        f"{value['remat']}, attention {value['attention_impl']}"
        + shown
        + (", layers unrolled" if value.get("layer_loop") == "unroll" else "")
        + f"{adapters}; batch {args.batch} x {args.seq_len} tokens"
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

    Raises ``ValueError`` when an MoE flag is given without ``--experts`` (it would change
    nothing), or a factor at or below 0."""
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
    for name in ("capacity_factor", "expert_buffer_factor"):  # the model says "None" for not given
        if not given.get(name, 1) > 0:
            raise ValueError(
                f"--{name.replace('_', '-')} must be above 0 (leave it out for the default), "
                f"got {given[name]:g}"
            )
    return dict(num_experts=args.experts, **{**MOE_DEFAULTS, **given})
