"""``dew-tpu``'s settings: a TOML file, overridden by flags.

The file is ``tpu.toml`` in ``$DEW_CONFIG_DIR`` when that is set, else in ``$XDG_CONFIG_HOME/dew``,
else in ``~/.config/dew``. ``dew-tpu init`` writes it; every command reads it. A value given as a
flag wins over the file, and the file over the defaults (``DEFAULTS``).
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from pathlib import Path

from dew.targets import GENERATIONS, target, valid_types


class TpuError(Exception):
    """A refusal or failure with a message that says what to do; ``code`` is the exit status."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


# The TPU software version ("runtime") for JAX on each generation, as Cloud TPU's runtime versions
# page lists them: https://cloud.google.com/tpu/docs/runtimes ("PyTorch and JAX").
RUNTIME_VERSIONS = {
    "v4": "tpu-ubuntu2204-base",
    "v5e": "v2-alpha-tpuv5-lite",
    "v5p": "v2-alpha-tpuv5",
    "v6e": "v2-alpha-tpuv6e",
}
DEFAULT_PACKAGE = "dew-ml[gcs]"


@dataclasses.dataclass
class Settings:
    """What every command may need. ``None`` (or an empty list) means not set anywhere."""

    project: str | None = None  # None: gcloud's own default project
    zones: list[str] = dataclasses.field(default_factory=list)  # tried in this order by create
    type: str | None = None  # e.g. "v5e-8"
    version: str = "auto"  # "auto": RUNTIME_VERSIONS for the type's generation
    user: str | None = None  # the ssh user on the workers (None: gcloud's, your local user)
    bucket: str | None = None  # gs://... where runs keep their checkpoints


DEFAULTS = Settings()
KEYS = tuple(field.name for field in dataclasses.fields(Settings))


def config_path() -> Path:
    """``$DEW_CONFIG_DIR/tpu.toml``, else ``$XDG_CONFIG_HOME/dew/tpu.toml``, else
    ``~/.config/dew/tpu.toml``."""
    if os.environ.get("DEW_CONFIG_DIR"):
        return Path(os.environ["DEW_CONFIG_DIR"]) / "tpu.toml"
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "dew" / "tpu.toml"


def read_config(path: Path | None = None) -> dict:
    """The file's values (an empty dict when there is no file), checked."""
    path = config_path() if path is None else path
    if not path.exists():
        return {}
    try:
        values = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, OSError) as error:
        raise TpuError(f"cannot read {path}: {error}; fix it or write it again with dew-tpu init")
    unknown = sorted(set(values) - set(KEYS))
    if unknown:
        raise TpuError(
            f"{path}: unknown key(s) {', '.join(unknown)}; the keys are {', '.join(KEYS)}"
        )
    if isinstance(values.get("zones"), str):
        values["zones"] = [values["zones"]]
    for key, value in values.items():
        ok = all(isinstance(v, str) for v in value) if key == "zones" else isinstance(value, str)
        if not ok or (key == "zones" and not isinstance(value, list)):
            kind = "a list of strings" if key == "zones" else "a string"
            raise TpuError(f"{path}: {key} must be {kind}, got {value!r}")
    return values


def resolve(flags: dict, path: Path | None = None) -> Settings:
    """Flags (``None`` where not given) over the config file over ``DEFAULTS``."""
    settings = dataclasses.replace(DEFAULTS, zones=list(DEFAULTS.zones))
    for key, value in read_config(path).items():
        setattr(settings, key, value)
    for key in KEYS:
        if flags.get(key) is not None:
            setattr(settings, key, flags[key])
    return settings


def _toml_string(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def to_toml(settings: Settings) -> str:
    """``key = value`` lines for the values that are set (what ``init`` writes)."""
    lines = ["# dew-tpu's settings (dew-tpu init writes this file; flags override it)."]
    for key in KEYS:
        value = getattr(settings, key)
        if value is None or value == []:
            continue
        if isinstance(value, list):
            lines.append(f"{key} = [{', '.join(_toml_string(v) for v in value)}]")
        else:
            lines.append(f"{key} = {_toml_string(value)}")
    return "\n".join(lines) + "\n"


def write_config(settings: Settings, path: Path | None = None) -> Path:
    path = config_path() if path is None else path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_toml(settings))
    return path


_ZONE = re.compile(r"^[a-z]+-[a-z]+[0-9]+-[a-z]$")


def check_zone(zone: str) -> str:
    if not _ZONE.match(zone):
        raise TpuError(
            f"unknown zone {zone!r}: a zone is written like us-east5-a; "
            "`gcloud compute tpus locations list` lists the TPU zones, and "
            "`gcloud compute tpus accelerator-types list --zone=ZONE` what each one offers",
            code=2,
        )
    return zone


def _all_types() -> str:
    shown = []
    for name in GENERATIONS:
        sizes = valid_types(name)
        shown.append(", ".join(sizes[:4]) + (f", ... {sizes[-1]}" if len(sizes) > 4 else ""))
    return "; ".join(shown)


def slice_target(type_name: str):
    """``dew.targets.target`` for ``type_name``, its refusal turned into a ``TpuError`` that lists
    the valid types."""
    try:
        return target(type_name)
    except ValueError as error:
        raise TpuError(f"unknown --type {type_name!r}: {error}. Valid types: {_all_types()}", 2)


def cloud_type(type_name: str) -> str:
    """Cloud's accelerator type for ``type_name``: ``v5e-8`` -> ``v5litepod-8``."""
    if ":" in type_name:
        raise TpuError(f"--type takes a Cloud TPU type such as v5p-16, not a topology: {type_name}")
    return slice_target(type_name).cloud_type


def runtime_version(type_name: str, version: str) -> str:
    """``version``, or the published one for ``type_name``'s generation when it is ``auto``."""
    if version != "auto":
        return version
    generation = slice_target(type_name).generation.name
    if generation not in RUNTIME_VERSIONS:  # pragma: no cover - every generation has one
        raise TpuError(f"no published runtime for {generation}; give --version")
    return RUNTIME_VERSIONS[generation]


def need(value, what: str, flag: str, init: str):
    """``value``, or a ``TpuError`` saying which flag gives it and how to save it."""
    if value is None or value == []:
        raise TpuError(
            f"no {what}: give {flag}, or save it in {config_path()} with `dew-tpu init {init}`", 2
        )
    return value
