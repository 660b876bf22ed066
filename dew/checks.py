"""Argument checks shared by every public entry point, so that each refusal reads alike and comes
before anything is traced or compiled."""

from __future__ import annotations

import numbers


def is_int(value) -> bool:
    """An integer (Python or NumPy), and not a ``bool``."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def positive_int(name: str, value) -> int:
    """``value`` if it is an integer >= 1.

    Raises ``ValueError("NAME must be an integer >= 1, got V")`` otherwise.
    """
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def nonnegative_int(name: str, value) -> int:
    """``value`` if it is an integer >= 0.

    Raises ``ValueError("NAME must be an integer >= 0, got V")`` otherwise.
    """
    if not is_int(value) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return int(value)


def comma_names(name: str, text: str) -> tuple[str, ...]:
    """``"a, b,c"`` -> ``("a", "b", "c")``: a comma-separated list, each entry stripped.

    Raises ``ValueError`` naming ``name`` (the flag as typed) and ``text`` for an empty entry
    (``"q_proj,,v_proj"``, a comma at an end, nothing at all): dropping it would hide a typo,
    or a name lost from a script's variable."""
    names = tuple(part.strip() for part in text.split(","))
    if not all(names):
        raise ValueError(
            f"{name} {text!r} has an empty entry (two commas together, one at an end, or no "
            "name at all): give the names with one comma between each two"
        )
    return names
