"""The token folder: ``train.bin``, ``val.bin`` and the ``meta.json`` that describes them.

A token folder holds two flat arrays of token ids, stored as raw little-endian unsigned integers
with no header, and one JSON object::

    {"tokenizer": "byte", "vocab_size": 256, "dtype": "uint8",
     "train_tokens": 391286, "val_tokens": 7985, "eos_id": null}

``train_tokens`` and ``val_tokens`` count tokens (not bytes): ``train.bin`` must be exactly
``train_tokens * itemsize`` bytes long, and ``read_meta`` refuses a folder where it is not, so a
truncated or swapped file is caught before training reads garbage. Token values are *not* checked
against ``vocab_size`` when a folder is read (that would mean reading every token);
``write_token_folder`` checks them when it writes.

``tokenizer`` is ``"byte"`` or the absolute path of a ``tokenizer.json``; ``"tokenizer.json"``
names the folder's own (``dew tokenize --tokenizer bpe:VOCAB`` trains one there), which
``read_meta`` gives as its absolute path, so that the folder can move with its tokenizer.

A folder may also hold a loss mask (``"loss_mask": true`` in ``meta.json``): ``train.mask`` and
``val.mask``, one byte per token (``uint8``, 0 or 1), exactly ``train_tokens`` / ``val_tokens``
bytes long, ``mask[i] = 1`` when predicting token ``i`` counts in the loss (``dew tokenize
--jsonl-fields``: a completion's tokens count, its prompt's do not). A folder without one counts
every token. ``"pad_seq_len": S`` records that each document starts at a multiple of ``S`` tokens
(``dew tokenize --rows pad``), so windows of ``seq_len = S`` never hold two documents.

Document starts (format version 2, ``"document_starts": true``): ``train.docs`` and ``val.docs``
hold, as little-endian ``uint64``, the index of each document's first token in ``train.bin`` /
``val.bin``, increasing from 0, ``train_documents`` / ``val_documents`` of them (``dew tokenize``
records them for every kind of input). A folder without them (version 1, written before Dew
recorded them, or by ``write_token_folder`` without starts) says so (``TokenMeta.document_starts``
is False) and is never read as if it had them: where documents come from is not guessed from the
end-of-text id. ``"version"`` is the format's version: absent in version 1 folders, 2 in those
written now; a larger one is refused (a newer Dew wrote it).

Layout: the format (its file names, ``FORMAT_VERSION``, ``TokenMeta``, ``storage_dtype``,
``smallest_dtype``), its checked reader (``read_meta``, ``open_tokens``, ``open_mask``,
``open_document_starts``), then its writer (the checks of what is written, ``TokenFolderWriter``,
and ``write_token_folder``, which writes a folder through it). It is one module because the format,
its writer and its checked reader, masks and document starts included, are one contract; apart, a
change to the format could reach one side only.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from dew.checks import positive_int

META = "meta.json"
TRAIN = "train.bin"
VAL = "val.bin"
# The loss mask beside each token file (only where meta.json says "loss_mask": true).
MASKS = {"train": "train.mask", "val": "val.mask"}
MASK_DTYPE = np.dtype("uint8")
# Each document's first token index beside each token file (where meta.json says
# "document_starts": true).
DOCS = {"train": "train.docs", "val": "val.docs"}
DOCS_DTYPE = np.dtype("uint64").newbyteorder("<")
# The folder format's version: 1 had no "version" field and no document starts; 2 may hold them.
FORMAT_VERSION = 2
# The tokenizer.json a folder holds itself: meta.json's "tokenizer" names it so, without a path.
OWN_TOKENIZER = "tokenizer.json"
# Accepted storage dtypes, all unsigned and stored little-endian whatever the machine.
DTYPES = ("uint8", "uint16", "uint32")
_REQUIRED = ("tokenizer", "vocab_size", "dtype", "train_tokens", "val_tokens", "eos_id")


@dataclasses.dataclass(frozen=True)
class TokenMeta:
    """A validated ``meta.json``, with the folder it came from (``read_meta``).

    Attributes:
      path: the folder.
      tokenizer: the tokenizer's name (``"byte"``, or a ``tokenizer.json``'s absolute path; the
        folder's own ``tokenizer.json``, recorded as ``"tokenizer.json"``, resolved to its path).
      vocab_size: ids are in ``[0, vocab_size)``.
      dtype: the ids' storage dtype: ``"uint8"``, ``"uint16"`` or ``"uint32"``, little-endian.
      train_tokens, val_tokens: ids in ``train.bin`` and ``val.bin``.
      eos_id: the end-of-text id that joins documents, or ``None`` (the byte tokenizer).
      loss_mask: whether ``train.mask`` and ``val.mask`` weight each token's loss (0 or 1);
        ``False``: all tokens count.
      pad_seq_len: the ``seq_len`` whose rows each document starts (``dew tokenize --rows
        pad``), or ``None`` (packed).
      document_starts: whether ``train.docs`` and ``val.docs`` say where each document starts.
      train_documents, val_documents: documents per split (``None`` without document starts).
      version: the format version (1: before document starts were recorded).

    Examples:
        >>> from dew.data import read_meta, write_example_corpus
        >>> meta = write_example_corpus("tokens")
        >>> read_meta("tokens").vocab_size, read_meta("tokens").dtype
        (256, 'uint8')
    """

    path: Path
    tokenizer: str
    vocab_size: int
    dtype: str
    train_tokens: int
    val_tokens: int
    eos_id: int | None
    # True when train.mask and val.mask weight each token's loss (0 or 1); False: all tokens count.
    loss_mask: bool = False
    # The seq_len whose rows each document starts (dew tokenize --rows pad), or None (packed).
    pad_seq_len: int | None = None
    # True when train.docs and val.docs say where each document starts (format version 2).
    document_starts: bool = False
    # Documents in each split: their starts' counts (None without document starts).
    train_documents: int | None = None
    val_documents: int | None = None
    # The format version the folder was written in (1: before document starts were recorded).
    version: int = FORMAT_VERSION

    @property
    def numpy_dtype(self) -> np.dtype:
        """The on-disk dtype, little-endian."""
        return storage_dtype(self.dtype)

    def to_json(self) -> dict[str, Any]:
        """The ``meta.json`` object (without ``path``)."""
        meta = {name: getattr(self, name) for name in _REQUIRED}
        if self.version > 1:
            meta["version"] = self.version
        if self.loss_mask:
            meta["loss_mask"] = True
        if self.pad_seq_len is not None:
            meta["pad_seq_len"] = self.pad_seq_len
        if self.document_starts:
            meta["document_starts"] = True
            meta["train_documents"] = self.train_documents
            meta["val_documents"] = self.val_documents
        return meta


def storage_dtype(name: str) -> np.dtype:
    """The little-endian numpy dtype for an accepted dtype name; ValueError for any other."""
    if name not in DTYPES:
        raise ValueError(f"unknown token dtype {name!r}; accepted: {', '.join(DTYPES)}")
    return np.dtype(name).newbyteorder("<")


def smallest_dtype(vocab_size: int) -> str:
    """The smallest accepted unsigned dtype that holds every id in ``[0, vocab_size)``."""
    for name in DTYPES:
        if vocab_size - 1 <= np.iinfo(name).max:
            return name
    raise ValueError(
        f"vocab_size {vocab_size} does not fit any accepted dtype ({', '.join(DTYPES)})"
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_meta(path: str | os.PathLike) -> TokenMeta:
    """Reads and validates the ``meta.json`` of the token folder at ``path``.

    Args:
      path: the token folder.

    Returns:
      its ``TokenMeta``.

    Raises:
      FileNotFoundError: naming the path, when the folder, ``meta.json``, ``train.bin`` or
        ``val.bin`` is missing, or the ``tokenizer.json`` it names as its own; with
        ``"loss_mask": true``, a missing ``train.mask`` / ``val.mask`` (and under
        ``"document_starts": true``, a missing ``train.docs`` / ``val.docs``).
      ValueError: JSON that does not parse, a missing or ill-typed field, an unknown dtype, a
        ``vocab_size`` the dtype cannot hold, an ``eos_id`` outside the vocabulary, a
        ``train.bin`` / ``val.bin`` whose size disagrees with ``train_tokens`` /
        ``val_tokens``, a mask file whose size is not its token count or that ``meta.json``
        does not describe (a mask must never be silently ignored), the same for the document
        starts (``train_documents`` / ``val_documents`` uint64 each), or a ``version`` above
        ``FORMAT_VERSION``.

    Examples:
        >>> meta = read_meta("tokens")  # the example corpus (write_example_corpus)
        >>> meta.train_tokens, meta.eos_id
        (95598, None)
    """
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"token folder {str(folder)!r} does not exist (or is not a folder)")
    meta_path = folder / META
    if not meta_path.is_file():
        raise FileNotFoundError(
            f"token folder {str(folder)!r} has no {META} (expected {str(meta_path)!r})"
        )
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{str(meta_path)!r} is not valid JSON: {error}") from error
    if not isinstance(meta, dict):
        raise ValueError(f"{str(meta_path)!r} must hold a JSON object, got {type(meta).__name__}")
    missing = [name for name in _REQUIRED if name not in meta]
    if missing:
        raise ValueError(f"{str(meta_path)!r} lacks field(s) {', '.join(missing)}")

    def fail(message: str):
        raise ValueError(f"{str(meta_path)!r}: {message}")

    if not isinstance(meta["tokenizer"], str):
        fail(f"tokenizer must be a string, got {meta['tokenizer']!r}")
    tokenizer = meta["tokenizer"]
    if tokenizer == OWN_TOKENIZER:  # the folder's own (dew tokenize --tokenizer bpe:VOCAB)
        own = folder / OWN_TOKENIZER
        if not own.is_file():
            raise FileNotFoundError(
                f"token folder {str(folder)!r} has no {OWN_TOKENIZER}, which its {META} names "
                f"as its tokenizer (expected {str(own)!r})"
            )
        tokenizer = str(own.resolve())
    vocab_size = meta["vocab_size"]
    if not _is_int(vocab_size) or vocab_size < 1:
        fail(f"vocab_size must be an integer >= 1, got {vocab_size!r}")
    dtype = meta["dtype"]
    if dtype not in DTYPES:
        fail(f"unknown dtype {dtype!r}; accepted: {', '.join(DTYPES)}")
    if vocab_size - 1 > np.iinfo(dtype).max:
        fail(
            f"vocab_size {vocab_size} does not fit dtype {dtype} (largest id {np.iinfo(dtype).max})"
        )
    for name in ("train_tokens", "val_tokens"):
        if not _is_int(meta[name]) or meta[name] < 0:
            fail(f"{name} must be an integer >= 0, got {meta[name]!r}")
    eos_id = meta["eos_id"]
    if eos_id is not None and (not _is_int(eos_id) or not 0 <= eos_id < vocab_size):
        fail(f"eos_id must be null or an integer in [0, {vocab_size}), got {eos_id!r}")

    loss_mask = meta.get("loss_mask", False)
    if not isinstance(loss_mask, bool):
        fail(f"loss_mask must be true or false, got {loss_mask!r}")
    pad_seq_len = meta.get("pad_seq_len")
    if pad_seq_len is not None and (not _is_int(pad_seq_len) or pad_seq_len < 1):
        fail(f"pad_seq_len must be null or an integer >= 1, got {pad_seq_len!r}")
    version = meta.get("version", 1)
    if not _is_int(version) or version < 1:
        fail(f"version must be an integer >= 1, got {version!r}")
    if version > FORMAT_VERSION:
        fail(
            f"format version {version} is newer than this Dew reads (up to {FORMAT_VERSION}); "
            "upgrade Dew to read it"
        )
    document_starts = meta.get("document_starts", False)
    if not isinstance(document_starts, bool):
        fail(f"document_starts must be true or false, got {document_starts!r}")
    if document_starts:
        for name in ("train_documents", "val_documents"):
            if not _is_int(meta.get(name)) or meta[name] < 0:
                fail(
                    f'{name} must be an integer >= 0 with "document_starts": true, got '
                    f"{meta.get(name)!r}"
                )

    itemsize = np.dtype(dtype).itemsize
    files = [(TRAIN, "train_tokens", itemsize, dtype), (VAL, "val_tokens", itemsize, dtype)]
    if loss_mask:
        files += [
            (MASKS["train"], "train_tokens", 1, "uint8"),
            (MASKS["val"], "val_tokens", 1, "uint8"),
        ]
    else:
        stray = [name for name in MASKS.values() if (folder / name).exists()]
        if stray:
            fail(
                f'the folder holds {", ".join(stray)} but meta.json has no "loss_mask": true; '
                "remove the mask files to count every token, or set loss_mask to use them"
            )
    if document_starts:
        files += [
            (DOCS["train"], "train_documents", DOCS_DTYPE.itemsize, "uint64"),
            (DOCS["val"], "val_documents", DOCS_DTYPE.itemsize, "uint64"),
        ]
    else:
        stray = [name for name in DOCS.values() if (folder / name).exists()]
        if stray:
            fail(
                f'the folder holds {", ".join(stray)} but meta.json has no "document_starts": '
                "true; remove them, or set document_starts (with train_documents and "
                "val_documents) to use them"
            )
    for file, count_name, file_itemsize, file_dtype in files:
        file_path = folder / file
        if not file_path.is_file():
            raise FileNotFoundError(
                f"token folder {str(folder)!r} has no {file} (expected {str(file_path)!r})"
            )
        size = file_path.stat().st_size
        expected = meta[count_name] * file_itemsize
        if size != expected:
            fail(
                f"{count_name} = {meta[count_name]} ({expected} bytes of {file_dtype}) "
                f"but {file} holds {size} bytes ({size / file_itemsize:g} tokens)"
            )

    return TokenMeta(
        path=folder,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        dtype=dtype,
        train_tokens=meta["train_tokens"],
        val_tokens=meta["val_tokens"],
        eos_id=eos_id,
        loss_mask=loss_mask,
        pad_seq_len=pad_seq_len,
        document_starts=document_starts,
        train_documents=meta["train_documents"] if document_starts else None,
        val_documents=meta["val_documents"] if document_starts else None,
        version=version,
    )


def open_tokens(meta: TokenMeta, split: str) -> np.ndarray:
    """A read-only memory map of ``train.bin`` (``split="train"``) or ``val.bin`` (``"val"``), shape
    ``[tokens]`` in the stored dtype. Nothing is read until it is indexed."""
    file, count = {"train": (TRAIN, meta.train_tokens), "val": (VAL, meta.val_tokens)}[split]
    if count == 0:
        # mmap cannot map an empty file.
        return np.zeros(0, meta.numpy_dtype)
    return np.memmap(meta.path / file, dtype=meta.numpy_dtype, mode="r", shape=(count,))


def open_mask(meta: TokenMeta, split: str) -> np.ndarray | None:
    """A read-only memory map of ``train.mask`` or ``val.mask``, ``uint8 [tokens]``, or ``None``
    for a folder without a loss mask."""
    if not meta.loss_mask:
        return None
    count = {"train": meta.train_tokens, "val": meta.val_tokens}[split]
    if count == 0:
        return np.zeros(0, MASK_DTYPE)
    return np.memmap(meta.path / MASKS[split], dtype=MASK_DTYPE, mode="r", shape=(count,))


def open_document_starts(meta: TokenMeta, split: str) -> np.ndarray:
    """The document starts of ``split`` (``"train"`` or ``"val"``), uint64 ``[documents]``, each
    document's first token index, checked: the first is 0 (when the split has tokens), each
    larger than the one before and below the token count. ValueError naming the file for a
    folder without document starts (``meta.document_starts`` False: it is never guessed) or for
    starts that break the rule (a damaged file). Reads the whole file (8 bytes a document)."""
    if not meta.document_starts:
        raise ValueError(
            f"the token folder {str(meta.path)!r} records no document starts (format version "
            f"{meta.version}, written before Dew recorded them or without them): tokenize it "
            "again with dew tokenize to mask attention by document"
        )
    tokens = {"train": meta.train_tokens, "val": meta.val_tokens}[split]
    count = {"train": meta.train_documents, "val": meta.val_documents}[split]
    if count == 0:
        starts = np.zeros(0, DOCS_DTYPE)
    else:
        starts = np.fromfile(meta.path / DOCS[split], dtype=DOCS_DTYPE, count=count)
    file = str(meta.path / DOCS[split])
    if tokens and (count == 0 or starts[0] != 0):
        raise ValueError(f"{file!r}: the first document must start at token 0")
    if count and not tokens:
        raise ValueError(f"{file!r} holds {count} document starts for a split without tokens")
    if count > 1 and not np.all(starts[1:] > starts[:-1]):
        raise ValueError(f"{file!r}: document starts must increase")
    if count and starts[-1] >= tokens:
        raise ValueError(
            f"{file!r}: a document starts at token {int(starts[-1])}, past the {tokens} tokens"
        )
    return starts


def _as_starts_array(starts: Any, name: str, tokens: int) -> np.ndarray:
    """``starts`` (offsets into a piece of ``tokens`` ids where documents begin) checked:
    increasing integers in ``[0, tokens)``."""
    array = np.asarray(starts)
    if array.ndim != 1 or (array.size and not np.issubdtype(array.dtype, np.integer)):
        raise ValueError(f"{name} must be a flat sequence of token offsets, got {array!r:.80}")
    if array.size and (
        int(array.min()) < 0 or int(array.max()) >= tokens or np.any(np.diff(array) <= 0)
    ):
        raise ValueError(
            f"{name} must increase, each in [0, {tokens}) (the ids appended with them), got "
            f"{array.tolist()!r:.80}"
        )
    return array.astype(np.int64)


def _as_mask_array(mask: Any, name: str, tokens: int) -> np.ndarray:
    array = np.asarray(mask)
    if array.shape != (tokens,):
        raise ValueError(
            f"{name} must hold one 0 or 1 per token ({tokens}), got shape {array.shape}"
        )
    if array.size and not (
        (np.issubdtype(array.dtype, np.integer) or array.dtype == bool)
        and int(array.min()) >= 0
        and int(array.max()) <= 1
    ):
        raise ValueError(
            f"{name} must hold only 0 and 1 (dtype {array.dtype}, values from {array.min()} to "
            f"{array.max()})"
        )
    return array.astype(MASK_DTYPE)


def _as_token_array(ids: Any, name: str, vocab_size: int, dtype: str) -> np.ndarray:
    array = np.asarray(ids)
    if array.ndim != 1:
        raise ValueError(f"{name} must be a flat sequence of token ids, got shape {array.shape}")
    if array.size == 0:
        return np.zeros(0, storage_dtype(dtype))
    if not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{name} must hold integer token ids, got dtype {array.dtype}")
    low, high = int(array.min()), int(array.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(
            f"{name} holds ids from {low} to {high}, outside [0, vocab_size={vocab_size})"
        )
    return array.astype(storage_dtype(dtype))


def _write_file(path: Path, data: bytes | np.ndarray) -> None:
    with open(path, "wb") as file:
        if isinstance(data, np.ndarray):
            data.tofile(file)
        else:
            file.write(data)
        file.flush()
        os.fsync(file.fileno())


def _check_header(tokenizer: Any, vocab_size: Any, eos_id: Any) -> None:
    positive_int("vocab_size", vocab_size)
    if eos_id is not None and (not _is_int(eos_id) or not 0 <= eos_id < vocab_size):
        raise ValueError(f"eos_id must be None or an integer in [0, {vocab_size}), got {eos_id!r}")
    if not isinstance(tokenizer, str):
        raise ValueError(f"tokenizer must be a name (str), got {tokenizer!r}")


# The fields a writer with document starts sets itself.
_DOCUMENT_FIELDS = ("document_starts", "train_documents", "val_documents")


def _check_extra(extra: dict[str, Any], reserved: tuple[str, ...] = ()) -> None:
    clash = sorted(set(extra) & {*_REQUIRED, "version", *reserved})
    if clash:
        raise ValueError(f"extra meta fields may not replace {', '.join(clash)}")


class TokenFolderWriter:
    """Writes a token folder a piece at a time, for corpora larger than memory.

    ``append("train" | "val", ids)`` adds ids to the end of ``train.bin`` or ``val.bin`` (checked
    against ``vocab_size`` as ``write_token_folder`` checks them), any number of times; ``close()``
    puts the files in place as ``write_token_folder`` does (flushed, renamed, ``meta.json`` last)
    and returns the folder's meta. Until then everything lives under temporary names in the
    folder; ``abort()`` removes them. As a context manager it closes on success and aborts on an
    exception. ``extra`` (the argument, or the ``extra`` dict until ``close``) adds fields to
    ``meta.json``, which ``read_meta`` ignores. The rule for existing files is
    ``write_token_folder``'s, checked when the writer is made.

    ``loss_mask=True`` writes ``train.mask`` and ``val.mask`` too: every ``append`` then takes
    ``mask``, one 0 or 1 per id (checked). ``pad_seq_len`` is recorded in ``meta.json`` (the
    caller lays the documents out; ``dew.data.text`` does for ``--rows pad``).

    ``document_starts=True`` writes ``train.docs`` and ``val.docs``: every ``append`` then takes
    ``starts``, the offsets into its ids where a document begins (ids before the first offset
    continue the split's last document; a split's first id must begin one), and ``meta.json``
    gets ``"document_starts": true`` with the counts ``train_documents`` and ``val_documents``.

    Args:
      path: the folder (created if missing).
      tokenizer, vocab_size, eos_id: ``meta.json``'s header (default ``"byte"``, 256, ``None``).
      overwrite: replace a token folder's files already at ``path`` (default ``False``).
      extra: more ``meta.json`` fields.
      loss_mask, pad_seq_len, document_starts: as above (default off).

    Raises:
      FileExistsError: ``path`` already holds a token folder's files, without ``overwrite``.
      ValueError: a bad header (a ``vocab_size`` below 1 or an ``eos_id`` outside it), an
        ``extra`` field that is a reserved name; ``append``: an id outside the vocabulary, a
        mask or starts given against the writer's settings.

    Examples:
        >>> from dew.data import TokenFolderWriter
        >>> with TokenFolderWriter("tokens", vocab_size=1000, eos_id=0) as writer:
        ...     for ids in [[5, 6, 7, 0], [8, 9, 0]]:  # documents, each ending in eos
        ...         writer.append("train", ids)
        ...     writer.append("val", [10, 11, 0])
        >>> writer.meta.train_tokens, writer.meta.dtype
        (7, 'uint16')
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        tokenizer: str = "byte",
        vocab_size: int = 256,
        eos_id: int | None = None,
        overwrite: bool = False,
        extra: dict[str, Any] | None = None,
        loss_mask: bool = False,
        pad_seq_len: int | None = None,
        document_starts: bool = False,
    ):
        _check_header(tokenizer, vocab_size, eos_id)
        _check_extra(extra or {})
        if pad_seq_len is not None:
            positive_int("pad_seq_len", pad_seq_len)
        self.folder = Path(path)
        existing = [
            name
            for name in (META, TRAIN, VAL, *MASKS.values(), *DOCS.values())
            if (self.folder / name).exists()
        ]
        if existing and not overwrite:
            raise FileExistsError(
                f"{str(self.folder)!r} already holds {', '.join(existing)}; "
                "pass overwrite=True to replace them"
            )
        self.dtype = smallest_dtype(vocab_size)
        self.meta: TokenMeta | None = None
        self._header = {"tokenizer": tokenizer, "vocab_size": vocab_size, "eos_id": eos_id}
        self.extra = dict(extra or {})
        self.loss_mask = bool(loss_mask)
        self.pad_seq_len = pad_seq_len
        self.document_starts = bool(document_starts)
        if self.document_starts:
            _check_extra(self.extra, _DOCUMENT_FIELDS)
        self.folder.mkdir(parents=True, exist_ok=True)
        suffix = f".tmp-{os.getpid()}"
        self._temps = {
            "train": self.folder / (TRAIN + suffix),
            "val": self.folder / (VAL + suffix),
            "meta": self.folder / (META + suffix),
        }
        # Mask files are keyed "train.mask" / "val.mask", beside the splits.
        streams = ["train", "val"]
        if self.loss_mask:
            for split, name in MASKS.items():
                self._temps[name] = self.folder / (name + suffix)
                streams.append(name)
        if self.document_starts:
            for split, name in DOCS.items():
                self._temps[name] = self.folder / (name + suffix)
                streams.append(name)
        self.counts = {"train": 0, "val": 0}
        self.documents = {"train": 0, "val": 0}
        self._files = {}
        try:
            for stream in streams:
                self._files[stream] = open(self._temps[stream], "wb")
        except BaseException:
            self.abort()
            raise

    def append(self, split: str, ids: Any, mask: Any = None, starts: Any = None) -> None:
        """Adds ``ids`` (a flat integer sequence) to the end of ``split`` ("train" or "val"), and
        ``mask`` (one 0 or 1 per id) to its loss mask: required with ``loss_mask=True``, refused
        without; ``starts`` (offsets into ``ids`` where documents begin) to its document starts:
        required with ``document_starts=True``, refused without."""
        if split not in self.counts:
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        if self.meta is not None or not self._files:
            raise ValueError("this TokenFolderWriter is closed")
        if (mask is None) == self.loss_mask:
            raise ValueError(
                f"this writer has loss_mask={self.loss_mask}: "
                + ("append needs a mask" if self.loss_mask else "it takes no mask")
            )
        if (starts is None) == self.document_starts:
            raise ValueError(
                f"this writer has document_starts={self.document_starts}: "
                + ("append needs starts" if self.document_starts else "it takes no starts")
            )
        array = _as_token_array(ids, f"{split} ids", self._header["vocab_size"], self.dtype)
        # Everything checked before anything is written: the files never disagree.
        if self.loss_mask:
            mask_array = _as_mask_array(mask, f"{split} mask", array.size)
        if self.document_starts:
            offsets = _as_starts_array(starts, f"{split} starts", array.size)
            if self.counts[split] == 0 and array.size and (not offsets.size or offsets[0] != 0):
                raise ValueError(
                    f"the first id of {split} must start a document (starts begin with 0), got "
                    f"starts {offsets.tolist()!r:.80}"
                )
            (offsets + self.counts[split]).astype(DOCS_DTYPE).tofile(self._files[DOCS[split]])
            self.documents[split] += int(offsets.size)
        if self.loss_mask:
            mask_array.tofile(self._files[MASKS[split]])
        array.tofile(self._files[split])
        self.counts[split] += int(array.size)

    def close(self) -> TokenMeta:
        """Flushes the files to disk, renames them into place (``meta.json`` last) and returns the
        folder's validated meta."""
        if self.meta is not None:
            return self.meta
        if not self._files:
            raise ValueError("this TokenFolderWriter was aborted")
        _check_extra(self.extra)
        meta = {
            "tokenizer": self._header["tokenizer"],
            "vocab_size": self._header["vocab_size"],
            "dtype": self.dtype,
            "train_tokens": self.counts["train"],
            "val_tokens": self.counts["val"],
            "eos_id": self._header["eos_id"],
            **self.extra,
        }
        if self.loss_mask:
            meta["loss_mask"] = True
        if self.pad_seq_len is not None:
            meta["pad_seq_len"] = self.pad_seq_len
        meta["version"] = FORMAT_VERSION
        if self.document_starts:
            _check_extra(self.extra, _DOCUMENT_FIELDS)
            meta["document_starts"] = True
            meta["train_documents"] = self.documents["train"]
            meta["val_documents"] = self.documents["val"]
        try:
            for file in self._files.values():
                file.flush()
                os.fsync(file.fileno())
                file.close()
            _write_file(self._temps["meta"], (json.dumps(meta, indent=2) + "\n").encode("utf-8"))
            (self.folder / META).unlink(missing_ok=True)
            os.replace(self._temps["train"], self.folder / TRAIN)
            os.replace(self._temps["val"], self.folder / VAL)
            for name in MASKS.values():
                if self.loss_mask:
                    os.replace(self._temps[name], self.folder / name)
                else:  # an overwritten folder's old mask would not describe these tokens
                    (self.folder / name).unlink(missing_ok=True)
            for name in DOCS.values():
                if self.document_starts:
                    os.replace(self._temps[name], self.folder / name)
                else:  # nor would its old document starts
                    (self.folder / name).unlink(missing_ok=True)
            os.replace(self._temps["meta"], self.folder / META)
        finally:
            self.abort()
        _fsync_folder(self.folder)
        self.meta = read_meta(self.folder)
        return self.meta

    def abort(self) -> None:
        """Closes and removes the temporary files (the folder's existing files stay as they are)."""
        for file in self._files.values():
            file.close()
        self._files = {}
        for temp in self._temps.values():
            temp.unlink(missing_ok=True)

    def __enter__(self) -> TokenFolderWriter:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()


def write_token_folder(
    path: str | os.PathLike,
    train_ids: Any,
    val_ids: Any,
    *,
    tokenizer: str = "byte",
    vocab_size: int = 256,
    eos_id: int | None = None,
    overwrite: bool = False,
    train_mask: Any = None,
    val_mask: Any = None,
    train_starts: Any = None,
    val_starts: Any = None,
) -> TokenMeta:
    """Writes a token folder at ``path`` and returns its validated meta.

    ``train_ids`` and ``val_ids`` are flat integer sequences (lists or arrays) with every id in
    ``[0, vocab_size)`` (checked here, ValueError otherwise); they are stored in the smallest
    unsigned dtype that holds ``vocab_size`` (uint8 up to 256, uint16 up to 65536, else uint32).

    The files are written under temporary names, flushed to disk, and renamed into place,
    ``meta.json`` last: a reader sees either no token folder (no ``meta.json``), or a complete one.
    A folder that already holds any of a token folder's files (``meta.json``, ``train.bin``,
    ``val.bin``, masks, document starts) is left alone (FileExistsError) unless
    ``overwrite=True``; then the old ``meta.json`` is removed first, so an interrupted overwrite
    leaves no ``meta.json`` rather than one that describes the wrong files.

    ``train_mask`` and ``val_mask`` (both or neither): the loss mask, one 0 or 1 per id, written
    as ``train.mask`` / ``val.mask``. ``train_starts`` and ``val_starts`` (both or neither): the
    index of each document's first id (increasing from 0), written as ``train.docs`` /
    ``val.docs``. ``tokenizer``, ``vocab_size`` and ``eos_id`` go into ``meta.json`` (default
    ``"byte"``, 256, ``None``).

    Raises:
      FileExistsError: the folder holds a token folder's files and ``overwrite`` is not set.
      ValueError: an id outside ``[0, vocab_size)``, a mask value other than 0 or 1, a mask or
        starts whose length is wrong, or one of a pair given without the other.

    Examples:
        >>> import numpy as np
        >>> from dew.data import write_token_folder
        >>> ids = np.random.default_rng(0).integers(0, 50_000, 10_000)
        >>> meta = write_token_folder("tokens", ids[:9_000], ids[9_000:], vocab_size=50_000)
        >>> meta.dtype, meta.train_tokens
        ('uint16', 9000)
    """
    _check_header(tokenizer, vocab_size, eos_id)
    dtype = smallest_dtype(vocab_size)
    if (train_mask is None) != (val_mask is None):
        raise ValueError("give both train_mask and val_mask, or neither")
    if (train_starts is None) != (val_starts is None):
        raise ValueError("give both train_starts and val_starts, or neither")
    # Checked before anything is written.
    train = _as_token_array(train_ids, "train_ids", vocab_size, dtype)
    val = _as_token_array(val_ids, "val_ids", vocab_size, dtype)
    masked = train_mask is not None
    if masked:
        train_mask = _as_mask_array(train_mask, "train_mask", train.size)
        val_mask = _as_mask_array(val_mask, "val_mask", val.size)
    with TokenFolderWriter(
        path,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        eos_id=eos_id,
        overwrite=overwrite,
        loss_mask=masked,
        document_starts=train_starts is not None,
    ) as writer:
        writer.append("train", train, train_mask, train_starts)
        writer.append("val", val, val_mask, val_starts)
    return writer.meta


def _fsync_folder(folder: Path) -> None:
    # Makes the renames themselves durable; not every platform can open a folder.
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)
