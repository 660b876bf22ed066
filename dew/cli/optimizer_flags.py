"""``dew train``'s optimizer flags: the learning rate, its schedule, clipping, weight decay and the
optimizer state's dtype and memory (``dew.training.optimizer.adamw``).

Nothing here imports JAX: ``dew train --help`` reads these flags before any device exists.
"""

from __future__ import annotations

import argparse

# dew.training.schedule's SCHEDULES, dew.training.optimizer's MOMENTS_DTYPES, MASTER_WEIGHTS and
# defaults, written out so that building the parser imports no JAX (tests/test_optimizer.py
# checks they agree).
SCHEDULES = ("constant", "cosine", "linear")
MOMENTS_DTYPES = ("float32", "bfloat16")
MASTER_WEIGHTS = ("vectors", "all")
CLIP_NORM = 1.0
WEIGHT_DECAY = 0.1


def add_optimizer_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=0,
        metavar="N",
        help="raise the learning rate linearly over the first N steps, from lr/N (default 0)",
    )
    parser.add_argument(
        "--lr-schedule",
        choices=SCHEDULES,
        default="constant",
        help="after the warmup: constant, or a cosine or linear decay that reaches --lr-min at "
        "--steps (default constant)",
    )
    parser.add_argument(
        "--lr-min",
        type=float,
        default=0.0,
        help="the learning rate a decay ends at, at --steps (default 0)",
    )
    parser.add_argument(
        "--clip-norm",
        type=float,
        default=CLIP_NORM,
        help="clip the gradients to this global norm, over every weight (default "
        f"{CLIP_NORM}, as MaxText and torchtitan; 0: no clipping)",
    )
    parser.add_argument(
        "--weight-decay",
        type=float,
        default=WEIGHT_DECAY,
        help="AdamW's decoupled weight decay, of every matrix but the embedding; norms' scales "
        f"and biases never decay (default {WEIGHT_DECAY})",
    )
    parser.add_argument(
        "--moments-dtype",
        choices=MOMENTS_DTYPES,
        default="float32",
        help="how AdamW's two moments are stored: bfloat16 halves their bytes (default float32)",
    )
    parser.add_argument(
        "--master-weights",
        choices=MASTER_WEIGHTS,
        default="vectors",
        help="with --param-dtype bfloat16: the weights that keep a float32 master copy in the "
        "optimizer state, vectors (norms' scales, biases) or all (default vectors)",
    )
    parser.add_argument(
        "--optimizer-offload",
        action="store_true",
        help="keep the optimizer's moments (and master copies) in host memory, moved to the "
        "device one weight at a time for the update",
    )


# dew.training.schedule.check_schedule's arguments, as dew train's flags spell them.
SCHEDULE_FLAGS = {
    "learning_rate": "--lr",
    "steps": "--steps",
    "warmup_steps": "--warmup-steps",
    "lr_schedule": "--lr-schedule",
    "lr_min": "--lr-min",
}


def optimizer_from(args):
    """The ``dew.training.optimizer.adamw`` of ``args`` (``ValueError`` naming the flags and the
    values that make no sense, before anything compiles)."""
    from dew.training.optimizer import adamw
    from dew.training.schedule import check_schedule

    check_schedule(
        args.lr, args.steps, args.warmup_steps, args.lr_schedule, args.lr_min, SCHEDULE_FLAGS
    )
    if args.clip_norm < 0:
        raise ValueError(f"--clip-norm must be >= 0 (0: no clipping), got {args.clip_norm}")
    if args.weight_decay < 0:
        raise ValueError(f"--weight-decay must be >= 0, got {args.weight_decay}")
    return adamw(
        args.lr,
        steps=args.steps,
        warmup_steps=args.warmup_steps,
        lr_schedule=args.lr_schedule,
        lr_min=args.lr_min,
        clip_norm=args.clip_norm or None,
        weight_decay=args.weight_decay,
        moments_dtype=args.moments_dtype,
        master_weights=args.master_weights,
        offload=args.optimizer_offload,
    )
