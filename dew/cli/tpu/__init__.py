"""``dew-tpu``: Cloud TPU slices for Dew runs, through ``gcloud compute tpus``.

    dew-tpu init --project my-project --zones us-east5-a,us-central1-a --type v5e-8 \\
        --bucket gs://my-bucket
    dew-tpu create my-slice --spot
    dew-tpu setup my-slice
    dew-tpu train my-slice --job lm --spot-restart -- python3 train.py
    dew-tpu delete my-slice --yes

Every command prints the gcloud commands it runs, and ``--dry-run`` prints them without running
anything. The package's modules: ``config`` (the TOML settings, flags over file over defaults),
``gcloud`` (running command lines), ``slices`` (create, delete, start, stop, list, describe,
status), ``remote`` (ssh, run, copy, sync, setup, reset, logs, and the shell they run on the
workers), ``jobs`` (train with its spot restarts, spawn) and ``cli`` (the arguments, ``main``).
docs/multi-host.md walks through a run.
"""

from dew.cli.tpu.cli import build_parser, main
from dew.cli.tpu.config import RUNTIME_VERSIONS, TpuError
from dew.cli.tpu.gcloud import QUEUED, TPU_VM, Gcloud

__all__ = ["QUEUED", "RUNTIME_VERSIONS", "TPU_VM", "Gcloud", "TpuError", "build_parser", "main"]
