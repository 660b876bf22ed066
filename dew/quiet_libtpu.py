"""libtpu's start-up errors on a machine with no TPU, quieted.

With libtpu installed (the ``tpu`` extra, which ``dew plan`` uses on any machine), JAX loads it to
look for a TPU whenever ``JAX_PLATFORMS`` does not rule the TPU out, and on a machine with no TPU
libtpu prints about five lines of errors (no accelerator type, no worker hostnames) before JAX
falls back to the CPU. ``quiet_libtpu`` gives libtpu the compile-only settings
(``dew.targets.COMPILE_ONLY_ENVIRONMENT``) in that case alone, where the environment does not set
them already: it then loads quietly and finds no TPU, as before. On a TPU machine (a Google TPU
on the PCI bus) nothing changes. ``import dew`` calls it, before JAX can start a backend.

Nothing here imports JAX.
"""

from __future__ import annotations

import glob
import importlib.util
import os

# The PCI vendor id of Google's TPU chips (what JAX's own check for attached TPUs reads).
GOOGLE_PCI_VENDOR = "0x1ae0"


def tpu_attached() -> bool:
    """Whether a TPU chip is on this machine's PCI bus (Linux; elsewhere: False)."""
    for path in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            with open(path) as file:
                if file.read().strip() == GOOGLE_PCI_VENDOR:
                    return True
        except OSError:
            continue
    return False


def quiet_libtpu() -> bool:
    """Sets libtpu's compile-only settings where they are unset, when libtpu is installed, no
    TPU is attached and ``JAX_PLATFORMS`` is unset (JAX then tries every platform it has).
    Returns whether it set them."""
    if os.environ.get("JAX_PLATFORMS", "").strip():
        # JAX loads the platforms named alone: libtpu only when tpu is one, and then it must say
        # why it finds no TPU.
        return False
    if importlib.util.find_spec("libtpu") is None or tpu_attached():
        return False
    from dew.targets import COMPILE_ONLY_ENVIRONMENT

    for name, value in COMPILE_ONLY_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    return True
