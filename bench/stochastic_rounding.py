"""What stochastic rounding of bfloat16 weights costs on one device: the step with bfloat16
weights (a float32 master of the norms' scales only), the matrices' updates rounded stochastically
(``adamw``'s default) and to nearest (``rounding="nearest"``), taking turns.

    python bench/stochastic_rounding.py [--model gpt2-small] [--batch 16] [--seq-len 1024]
                                        [--remat dots] [--calls 10] [--turns 2] [--set ...]

It is ``bench/optimizer_choices.py`` (the same columns: bytes, the compiled step's memory, the
median step time, tokens/s and MFU) with one more choice, ``weights bf16, nearest``; each choice
is measured ``--turns`` times, alternating, so that a drift of the machine shows. On a CPU
(``--set num_layers=2 emb_features=64 num_heads=2``) it only checks that the script runs.
"""

from __future__ import annotations

import argparse
import sys

import optimizer_choices  # bench/, beside this script

NEAREST = "weights bf16, nearest"
optimizer_choices.CHOICES[NEAREST] = (dict(rounding="nearest"), "bfloat16")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=2)
    args, rest = parser.parse_known_args(argv)
    turns = ["weights bf16", NEAREST] * args.turns
    return optimizer_choices.main([*rest, "--choices", *turns])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
