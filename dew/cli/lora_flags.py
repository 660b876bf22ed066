"""The LoRA flags of every command that builds a model: ``--lora-rank``, ``--lora-alpha``,
``--lora-targets``, ``--lora-dropout``, ``--base-dtype`` (``dew.models.lora``)."""

from __future__ import annotations

import argparse

from dew.checks import comma_names
from dew.cli.choices import LORA_BASE_DTYPES as BASE_DTYPES
from dew.cli.choices import LORA_TARGETS as DEFAULT_TARGETS


def add_lora_flags(parser: argparse.ArgumentParser) -> None:
    """``--lora-rank R`` (none: every weight trains), and with it ``--lora-alpha``,
    ``--lora-targets`` and ``--base-dtype``."""
    parser.add_argument(
        "--lora-rank",
        type=int,
        default=None,
        metavar="R",
        help="train LoRA adapters of rank R on a frozen base (default: no LoRA, every weight "
        "trains); with --init-from, that folder or checkpoint is the base (without it, a random "
        "one); at most each adapted weight's min(in, out)",
    )
    parser.add_argument(
        "--lora-alpha",
        type=float,
        default=None,
        metavar="ALPHA",
        help="the update's scale ALPHA / R: a layer computes x W + (ALPHA / R) x A B, the "
        "adapter's matrices A [in, R] and B [R, out] (default ALPHA = 2 R, scale 2 as in "
        "torchtune's Llama recipes; PEFT's own default is ALPHA = 8); with --lora-rank",
    )
    parser.add_argument(
        "--lora-targets",
        default=None,
        metavar="NAMES",
        help="comma-separated PEFT target_modules names (default "
        + ",".join(DEFAULT_TARGETS)
        + "); an MoE layer's experts get none; with --lora-rank",
    )
    parser.add_argument(
        "--lora-dropout",
        type=float,
        default=None,
        metavar="P",
        help="dropout on each adapter's input in training steps, PEFT's lora_dropout (default "
        "0: none); with --lora-rank",
    )
    parser.add_argument(
        "--base-dtype",
        default=None,
        choices=BASE_DTYPES,
        help="int8: the frozen base's layer matrices int8 with a float32 scale per output "
        "channel, dequantized inside the matmuls (default: the base in --param-dtype); with "
        "--lora-rank",
    )


def lora_config(args, base=None) -> dict | None:
    """``Lora``'s fields from the flags, or ``None`` without ``--lora-rank``; ``ValueError`` naming
    a LoRA flag given without it, or a value ``Lora`` refuses. ``base``: the model the adapters go
    on (a ``CausalTransformer``, or ``models.build``'s arguments), whose weights bound the rank."""
    rank = getattr(args, "lora_rank", None)
    others = {
        "--lora-alpha": getattr(args, "lora_alpha", None),
        "--lora-targets": getattr(args, "lora_targets", None),
        "--lora-dropout": getattr(args, "lora_dropout", None),
        "--base-dtype": getattr(args, "base_dtype", None),
    }
    if rank is None:
        given = [f"{flag} {value}" for flag, value in others.items() if value is not None]
        if given:
            raise ValueError(
                f"{', '.join(given)} configures LoRA adapters; add --lora-rank R to train them"
            )
        return None
    config = {"rank": rank}
    if args.lora_alpha is not None:
        config["alpha"] = args.lora_alpha
    if args.lora_targets is not None:
        config["targets"] = comma_names("--lora-targets", args.lora_targets)
    if args.base_dtype is not None:
        config["base_dtype"] = args.base_dtype
    if args.lora_dropout is not None:
        config["dropout"] = args.lora_dropout
    import dataclasses

    from dew.models.causal_transformer import CausalTransformer
    from dew.models.lora import Lora

    if isinstance(base, dict):
        base = CausalTransformer(**base)
    try:
        lora = Lora(**config)
        if base is not None:  # the model checks the rank against its weights
            dataclasses.replace(base, lora=lora)
    except ValueError as error:  # said with the flags the user typed
        message = str(error)
        for words, flag in _FLAGS.items():
            message = message.replace(words, flag)
        raise ValueError(message) from None
    return config


# How ``Lora`` and the model name the fields, and the flags that set them.
_FLAGS = {
    "LoRA rank": "--lora-rank",
    "LoRA alpha": "--lora-alpha",
    "LoRA targets": "--lora-targets",
    "LoRA dropout": "--lora-dropout",
}
