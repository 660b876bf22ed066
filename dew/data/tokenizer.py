"""Tokenizers: ``ByteTokenizer`` (text as its UTF-8 bytes), ``HFTokenizer`` (any ``tokenizer.json``
of the Hugging Face ``tokenizers`` library), the ``Tokenizer`` protocol both follow,
``tokenizer_for``, which picks one from a name or a path, and ``train_bpe``, which trains a
byte-level BPE ``tokenizer.json`` on text (``dew tokenize --tokenizer bpe:VOCAB``). Nothing here
downloads anything."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Tokenizer(Protocol):
    """What Dew asks of a tokenizer (``dew tokenize``, ``TokenWindows`` users decoding a window).

    - ``name``: what a token folder's ``meta.json`` records as its ``tokenizer``; ``tokenizer_for``
      takes it back (``"byte"``, or the path of a ``tokenizer.json``).
    - ``vocab_size``: every id ``encode`` returns lies in ``[0, vocab_size)``.
    - ``eos_id``: the end-of-text id that separates documents, or ``None`` when there is none.
    - ``encode(text) -> list[int]`` and ``decode(ids) -> str``.

    A ``typing.Protocol`` checked at run time: any object with these is one.

    Examples:
        >>> from dew.data import ByteTokenizer, Tokenizer
        >>> isinstance(ByteTokenizer(), Tokenizer)
        True
    """

    name: str
    vocab_size: int
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int] | np.ndarray) -> str: ...


def _id_list(ids: Iterable[int] | np.ndarray, who: str, vocab_size: int) -> np.ndarray:
    """``ids`` as a flat integer array, each in ``[0, vocab_size)`` (ValueError otherwise)."""
    array = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids).reshape(-1)
    if array.size == 0:
        return array.astype(np.int64)
    if not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{who}.decode takes integer token ids, got dtype {array.dtype}")
    low, high = int(array.min()), int(array.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(
            f"{who}.decode: token ids must lie in [0, {vocab_size}), "
            f"got values from {low} to {high}"
        )
    return array


class ByteTokenizer:
    """Encodes text as the UTF-8 bytes it is made of.

    Every string round-trips exactly: ``decode(encode(s)) == s``. A byte sequence that is not valid
    UTF-8 (a window cut in the middle of a multi-byte character, say) decodes with U+FFFD in place
    of the broken bytes instead of raising. There is no end-of-sequence token: ``eos_id`` is
    ``None``.

    Examples:
        >>> from dew.data import ByteTokenizer
        >>> ByteTokenizer().encode("hé")
        [104, 195, 169]
        >>> ByteTokenizer().decode([104, 195, 169])
        'hé'
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
        array = _id_list(ids, "ByteTokenizer", self.vocab_size)
        # astype first: bytes() of a wider integer array would read its raw memory, not its values.
        return array.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


# The end-of-text tokens HFTokenizer looks for, in this order, when no ``eos`` is given: GPT-2 and
# most byte-level BPEs, Llama 3, Llama 2 / T5 / SentencePiece models, Gemma.
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
TOKENIZER_FILE = "tokenizer.json"
TEXT_EXTRA = "pip install -e '.[text]' (the tokenizers library)"


def _tokenizers_library():
    try:
        import tokenizers
    except ImportError as error:
        from dew.targets import MissingExtra

        raise MissingExtra(f"HFTokenizer needs the tokenizers library: {TEXT_EXTRA}") from error
    return tokenizers


class HFTokenizer:
    """A ``tokenizer.json`` of the Hugging Face ``tokenizers`` library, read from disk (nothing is
    downloaded).

    ``path_or_json`` is the path of a ``tokenizer.json`` (or of a folder holding one), the JSON
    text itself, or a ``tokenizers.Tokenizer``. Needs ``pip install -e '.[text]'``.

    - ``encode(text)`` adds no special tokens (no BOS/CLS a post-processor would add), and text that
      spells a special token (a document quoting ``"<|endoftext|>"``) is encoded as plain text, so
      the only special token in a token folder is the end-of-text id ``dew tokenize`` puts after
      each document. ``decode`` keeps special tokens. For byte-level BPE tokenizers (GPT-2's kind)
      ``decode(encode(s)) == s`` for every string.
    - ``vocab_size`` is the largest id of the vocabulary, added tokens included, plus one (which is
      ``get_vocab_size()`` unless the ids have holes): every id ``encode`` returns is below it.
    - ``eos_id``, the end-of-text id, is the id of the token named ``eos`` when it is given, and
      otherwise of the first of ``EOS_CANDIDATES`` (``"<|endoftext|>"``, ``"<|end_of_text|>"``,
      ``"</s>"``, ``"<eos>"``) in the vocabulary. A given ``eos`` the vocabulary lacks, or no
      candidate when none is given, is a ValueError naming what was looked for; ``eos_token`` is the
      token found.
    - ``name`` is the file's absolute path (what a token folder records; ``tokenizer_for`` reads
      it back), or ``"tokenizer.json (JSON text)"`` for one built from text or an object.

    Raises:
      dew.targets.MissingExtra: the ``tokenizers`` library is not installed.
      FileNotFoundError: no ``tokenizer.json`` at the path.
      ValueError: a file the library cannot read, an empty vocabulary, or no end-of-text token
        (above).
      TypeError: ``path_or_json`` is none of the three.

    Examples:
        >>> from dew.data import HFTokenizer
        >>> tokenizer = HFTokenizer("llama-3.2-1b/tokenizer.json")  # a folder holding it works too
        >>> tokenizer.eos_token, tokenizer.vocab_size
        ('<|end_of_text|>', 128256)
        >>> tokenizer.decode(tokenizer.encode("Hello world")) == "Hello world"
        True
    """

    def __init__(self, path_or_json: str | os.PathLike | Any, *, eos: str | None = None):
        tokenizers = _tokenizers_library()
        if isinstance(path_or_json, tokenizers.Tokenizer):
            self._tokenizer = tokenizers.Tokenizer.from_str(path_or_json.to_str())
            self.name = f"{TOKENIZER_FILE} (JSON text)"
        elif isinstance(path_or_json, str) and path_or_json.lstrip().startswith("{"):
            self._tokenizer = self._parse(
                lambda: tokenizers.Tokenizer.from_str(path_or_json), "the JSON text given"
            )
            self.name = f"{TOKENIZER_FILE} (JSON text)"
        elif isinstance(path_or_json, (str, os.PathLike)):
            path = Path(path_or_json)
            if path.is_dir():
                path = path / TOKENIZER_FILE
            if not path.is_file():
                raise FileNotFoundError(f"no tokenizer file at {str(path)!r}")
            self._tokenizer = self._parse(
                lambda: tokenizers.Tokenizer.from_file(str(path)), repr(str(path))
            )
            self.name = str(path.resolve())
        else:
            raise TypeError(
                "HFTokenizer takes a path, JSON text or a tokenizers.Tokenizer, got "
                f"{type(path_or_json).__name__}"
            )
        # A document's text never turns into special tokens: "<|endoftext|>" in it stays text.
        self._tokenizer.encode_special_tokens = True
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        if not vocab:
            raise ValueError(f"tokenizer {self.name!r} has an empty vocabulary")
        self.vocab_size = max(vocab.values()) + 1
        self.eos_token, self.eos_id = _find_eos(vocab, eos, self.name)

    @staticmethod
    def _parse(load, what: str):
        try:
            return load()
        except Exception as error:  # tokenizers raises a bare Exception for a file it can't read
            raise ValueError(
                f"{what} is not a tokenizer.json the tokenizers library reads: {error}"
            ) from None

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``, with no special tokens added."""
        if not isinstance(text, str):
            raise TypeError(f"HFTokenizer.encode takes a str, got {type(text).__name__}")
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """The text of ``ids`` (any int sequence or integer array, read flat), special tokens
        kept; ValueError for an id outside ``[0, vocab_size)``."""
        array = _id_list(ids, "HFTokenizer", self.vocab_size)
        return self._tokenizer.decode(array.tolist(), skip_special_tokens=False)

    # Pickled (to dew tokenize's worker processes) as its JSON, then rebuilt as here.
    def __getstate__(self) -> dict:
        return {"json": self._tokenizer.to_str(), "eos": self.eos_token, "name": self.name}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["json"], eos=state["eos"])
        self.name = state["name"]

    def __repr__(self) -> str:
        return (
            f"HFTokenizer({self.name!r}, vocab_size={self.vocab_size}, "
            f"eos={self.eos_token!r} (id {self.eos_id}))"
        )


def _find_eos(vocab: dict[str, int], eos: str | None, name: str) -> tuple[str, int]:
    if eos is not None:
        if eos not in vocab:
            raise ValueError(f"tokenizer {name!r} has no token {eos!r} (the eos asked for)")
        return eos, vocab[eos]
    for candidate in EOS_CANDIDATES:
        if candidate in vocab:
            return candidate, vocab[candidate]
    raise ValueError(
        f"tokenizer {name!r} has none of the end-of-text tokens "
        f"{', '.join(repr(c) for c in EOS_CANDIDATES)}; name its own with eos=... "
        "(dew tokenize --eos TOKEN)"
    )


# Names tokenizer_for takes for ByteTokenizer.
BYTE_NAMES = ("byte", "bytes")


def tokenizer_for(spec: str | os.PathLike | Tokenizer, *, eos: str | None = None) -> Tokenizer:
    """The tokenizer ``spec`` names.

    - ``"byte"`` or ``"bytes"``: ``ByteTokenizer()`` (a name wins over a file of that name);
    - the path of a file: ``HFTokenizer(path, eos=eos)`` (a ``tokenizer.json``, whatever its name);
    - the path of a folder holding ``tokenizer.json``: ``HFTokenizer`` of that file;
    - a ``Tokenizer`` already: itself.

    A token folder's ``meta.json`` ``tokenizer`` field is such a spec. Anything else is a
    ValueError saying what is accepted; nothing is downloaded, so a hub name such as ``"gpt2"``
    must first be saved as a ``tokenizer.json``.

    Args:
      spec: a name, a path, or a ``Tokenizer``.
      eos: the end-of-text token of a ``tokenizer.json`` (``HFTokenizer``'s ``eos``); refused
        for the byte tokenizer and for a ``Tokenizer`` given.

    Raises:
      ValueError: a spec that names no tokenizer (above), or ``eos`` where it does not apply.
      TypeError: ``spec`` is neither a name, a path nor a ``Tokenizer``.

    Examples:
        >>> from dew.data import read_meta, tokenizer_for
        >>> tokenizer_for("bytes")
        ByteTokenizer()
        >>> tokenizer = tokenizer_for(read_meta("tokens").tokenizer)  # the folder's own
    """
    if not isinstance(spec, (str, os.PathLike)):
        if isinstance(spec, Tokenizer):
            if eos is not None:
                raise ValueError("eos applies to a tokenizer named by a path, not to an object")
            return spec
        raise TypeError(f"tokenizer_for takes a name or a path, got {type(spec).__name__}")
    if isinstance(spec, str) and spec in BYTE_NAMES:
        if eos is not None:
            raise ValueError("the byte tokenizer has no end-of-text token; --eos does not apply")
        return ByteTokenizer()
    path = Path(spec)
    if path.is_file() or (path.is_dir() and (path / TOKENIZER_FILE).is_file()):
        return HFTokenizer(path, eos=eos)
    if path.is_dir():
        raise ValueError(f"tokenizer folder {str(path)!r} holds no {TOKENIZER_FILE}")
    raise ValueError(
        f"unknown tokenizer {str(spec)!r}: give {' or '.join(repr(n) for n in BYTE_NAMES)}, "
        f"the path of a {TOKENIZER_FILE}, or a folder holding one (nothing is downloaded: save "
        f"a hub tokenizer's {TOKENIZER_FILE} first)"
    )


# --- Training a byte-level BPE (dew tokenize --tokenizer bpe:VOCAB) ------------------------------

BPE_PREFIX = "bpe:"
# The trained tokenizer's one special token, GPT-2's end-of-text: id 0, the folder's eos_id.
BPE_EOS = "<|endoftext|>"
# The 256 byte tokens and the end-of-text token: a byte-level BPE with no merge at all.
BPE_MIN_VOCAB = 256 + 1
# The largest id a token folder stores (uint32).
BPE_MAX_VOCAB = 2**32


def bpe_vocab(spec: Any, flag: str = "tokenizer") -> int | None:
    """The vocabulary size ``VOCAB`` of a ``"bpe:VOCAB"`` spec (``dew tokenize --tokenizer
    bpe:8192``), ``None`` for any other spec (a name wins over a file of that name, as ``"bytes"``
    does). A ``VOCAB`` that is not a decimal integer in ``[BPE_MIN_VOCAB, BPE_MAX_VOCAB]`` (257:
    the 256 byte tokens and ``<|endoftext|>``) is a ValueError naming ``flag`` and the value.

    Examples:
        >>> bpe_vocab("bpe:8192"), bpe_vocab("bytes")
        (8192, None)
    """
    if not (isinstance(spec, str) and spec.startswith(BPE_PREFIX)):
        return None
    text = spec[len(BPE_PREFIX) :]
    # Decimal digits only: int() would also take " 300", "3_00" and other scripts' digits.
    vocab = int(text) if re.fullmatch(r"[0-9]+", text) else None
    if vocab is None or not BPE_MIN_VOCAB <= vocab <= BPE_MAX_VOCAB:
        raise ValueError(
            f"{flag} {spec}: VOCAB must be an integer from {BPE_MIN_VOCAB} (the 256 byte tokens "
            f"and {BPE_EOS}) to {BPE_MAX_VOCAB}, got {text!r}"
        )
    return vocab


def train_bpe(texts: Iterable[str], vocab_size: int, path: str | os.PathLike) -> HFTokenizer:
    """Trains a byte-level BPE on ``texts`` with the ``tokenizers`` library's ``BpeTrainer``,
    writes it to ``path`` (a ``tokenizer.json``) and returns ``HFTokenizer(path)``.

    GPT-2's design: the ``ByteLevel`` pre-tokenizer (GPT-2's split into words, numbers,
    punctuation and runs of spaces; no prefix space added) and decoder, no normalizer, so
    ``decode(encode(s)) == s`` for every string; the 256 byte tokens are all in the vocabulary
    whatever ``texts`` holds, so any text encodes. ``<|endoftext|>`` (``BPE_EOS``) is the one
    special token, id 0: ``eos_id``.

    - ``texts`` is read once, as a stream (``train_from_iterator``): the trainer keeps the count
      of each distinct word, not the text. Each string is a sequence of its own (no merge crosses
      two).
    - The vocabulary is ``vocab_size`` ids (1 special, 256 bytes, ``vocab_size - 257`` merges),
      fewer only when the texts run out of pairs to merge first (every word of ``texts`` one
      token): a pair seen once is merged too.
    - Deterministic: the same texts give the same file, byte for byte, in any process (the
      trainer has no randomness, and breaks a tie between pairs of equal count by their ids,
      assigned in a fixed order).

    Raises:
      dew.targets.MissingExtra: the ``tokenizers`` library is not installed.
      ValueError: ``vocab_size`` outside ``[BPE_MIN_VOCAB, BPE_MAX_VOCAB]``.
    """
    tokenizers = _tokenizers_library()
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if not (
        isinstance(vocab_size, int)
        and not isinstance(vocab_size, bool)
        and BPE_MIN_VOCAB <= vocab_size <= BPE_MAX_VOCAB
    ):
        raise ValueError(
            f"vocab_size must be an integer from {BPE_MIN_VOCAB} (the 256 byte tokens and "
            f"{BPE_EOS}) to {BPE_MAX_VOCAB}, got {vocab_size!r}"
        )
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BPE_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(str(path))
    return HFTokenizer(path, eos=BPE_EOS)
