"""Flags that more than one ``dew`` command reads, defined once.

Nothing here imports JAX's backends: the device flags must be read before any device is created.
"""

from __future__ import annotations

import argparse


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


def add_model_flags(
    parser: argparse.ArgumentParser,
    *,
    batch: int,
    seq_len: int,
    layers: int,
    width: int,
    heads: int,
) -> None:
    """The example decoder's size and its batch, with the defaults given."""
    parser.add_argument(
        "--batch", type=int, default=batch, help=f"global batch rows (default {batch})"
    )
    parser.add_argument(
        "--seq-len", type=int, default=seq_len, help=f"tokens per row (default {seq_len})"
    )
    parser.add_argument(
        "--layers", type=int, default=layers, help=f"decoder layers (default {layers})"
    )
    parser.add_argument(
        "--width", type=int, default=width, help=f"embedding features (default {width})"
    )
    parser.add_argument(
        "--heads", type=int, default=heads, help=f"attention heads (default {heads})"
    )


def add_moe_flags(parser: argparse.ArgumentParser) -> None:
    """A mixture-of-experts decoder: ``--experts E`` (0: dense), ``--experts-per-token``,
    ``--moe-every``, ``--capacity-factor``."""
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
        default=2,
        metavar="K",
        help="experts each token is routed to (default 2)",
    )
    parser.add_argument(
        "--moe-every",
        type=int,
        default=1,
        metavar="N",
        help="every N-th layer is an MoE layer (default 1: all of them)",
    )
    parser.add_argument(
        "--capacity-factor",
        type=float,
        default=None,
        metavar="C",
        help="an expert takes at most ceil(C x seq x K / E) copies from each row "
        "(default: dropless)",
    )


def moe_config(args) -> dict:
    """The model arguments of ``add_moe_flags``' flags (empty for a dense model)."""
    if not args.experts:
        return {}
    return dict(
        num_experts=args.experts,
        experts_per_token=args.experts_per_token,
        moe_every=args.moe_every,
        capacity_factor=args.capacity_factor,
    )


def add_min_shard_flag(parser: argparse.ArgumentParser, default: int) -> None:
    parser.add_argument(
        "--min-shard",
        type=int,
        default=default,
        help=f"weights with fewer elements are not split over fsdp; tensor splits always apply "
        f"(default {default})",
    )


def add_sequence_parallel_flag(parser: argparse.ArgumentParser) -> None:
    """``--sequence-parallel``: ``Trainer(..., sequence_parallel=True)``."""
    parser.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="with tensor > 1, keep the activations between blocks split over positions across "
        "the tensor group (Megatron's sequence parallelism: activations move by all_gather and "
        "psum_scatter instead of psum; --seq-len must divide by tensor); no effect on the GSPMD "
        "engines",
    )


SEQUENCE_SCHEME_HELP = (
    "ring: K/V blocks travel round the sequence group by ppermute; all_to_all (DeepSpeed-Ulysses): "
    "positions traded for heads, which must divide by sequence x tensor"
)


def add_sequence_scheme_flag(parser: argparse.ArgumentParser) -> None:
    """``--sequence-scheme``: ``Trainer(..., sequence_scheme=...)``."""
    parser.add_argument(
        "--sequence-scheme",
        default="ring",
        choices=sequence_scheme_names(),
        help="how attention spans a sequence axis above 1 (default ring); " + SEQUENCE_SCHEME_HELP,
    )


def add_seed_flag(parser: argparse.ArgumentParser, seeds: str) -> None:
    """``--seed``; ``seeds`` says what it draws (its help text)."""
    parser.add_argument("--seed", type=int, default=0, help=f"the seed of {seeds} (default 0)")
