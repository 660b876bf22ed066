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
