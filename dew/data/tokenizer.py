"""ByteTokenizer: text as its UTF-8 bytes, one token per byte (vocabulary of 256)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


class ByteTokenizer:
    """Encodes text as the UTF-8 bytes it is made of.

    Every string round-trips exactly: ``decode(encode(s)) == s``. A byte sequence that is not valid
    UTF-8 (a window cut in the middle of a multi-byte character, say) decodes with U+FFFD in place
    of the broken bytes instead of raising. There is no end-of-sequence token: ``eos_id`` is
    ``None``.
    """

    name = "byte"
    vocab_size = 256
    eos_id = None

    def encode(self, text: str) -> list[int]:
        """Returns the UTF-8 bytes of ``text`` as a list of ints in ``[0, 256)``."""
        if not isinstance(text, str):
            raise TypeError(f"ByteTokenizer.encode takes a str, got {type(text).__name__}")
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """Returns the text whose UTF-8 bytes are ``ids`` (any int sequence or integer array, any
        shape read in C order); invalid UTF-8 becomes U+FFFD."""
        array = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids)
        if array.size == 0:
            return ""
        if not np.issubdtype(array.dtype, np.integer):
            raise ValueError(
                f"ByteTokenizer.decode takes integer token ids, got dtype {array.dtype}"
            )
        low, high = int(array.min()), int(array.max())
        if low < 0 or high >= self.vocab_size:
            raise ValueError(
                f"ByteTokenizer.decode: token ids must lie in [0, {self.vocab_size}), "
                f"got values from {low} to {high}"
            )
        # astype first: bytes() of a wider integer array would read its raw memory, not its values.
        return array.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"
