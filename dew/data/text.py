"""Text files into a token folder: what ``dew tokenize`` runs.

``tokenize_files(inputs, out, tokenizer=...)`` reads documents, tokenizes them in one or more
processes, and writes the token folder ``out`` (``dew.data.folder``'s format):

- Documents: a text file (``.txt``, ``.text``, ``.md``) is one document; a ``.jsonl`` file holds
  one document per line, the string in ``field`` of the line's object; a ``.parquet`` file one per
  row, the string in column ``field`` (needs ``pyarrow``). A folder stands for the files under it
  with those suffixes, in sorted path order (hidden names skipped). Empty and null documents are
  skipped; a missing field, a non-string value or a line that is not JSON is a ValueError naming
  the file and line (or row).
- The tokenizer: ``"bytes"``, a ``tokenizer.json`` given, or ``"bpe:VOCAB"``, a byte-level BPE
  trained here on the train documents alone (a first pass over the inputs, streamed to the
  trainer; the split is drawn by the rule below first, so no validation text shapes the
  vocabulary) and written into the folder as ``tokenizer.json``.
- Each document's ids are followed by the tokenizer's end-of-text id (documents are joined by it;
  the byte tokenizer has none, so its documents follow each other directly).
- The validation split is by document: in input order, each document goes to ``val.bin`` when
  ``np.random.default_rng(seed).random() < val_fraction`` (one draw per non-empty document), so
  the same inputs and seed give the same split, whatever the number of workers.
- ``workers > 1`` tokenizes chunks of documents in that many processes; the chunks are made and
  written in input order, so the folder is byte for byte the one ``workers=1`` writes. The
  processes are forked from a fresh server process (``multiprocessing``'s forkserver), so a
  script that calls this with ``workers > 1`` needs the usual ``if __name__ == "__main__":``.
- Atomic: the folder is written as a temporary sibling ``.NAME.tmp-PID`` and renamed to ``out``
  when complete. An error removes the temporary folder; a process killed outright leaves it
  behind (delete it), never a half-written ``out``. An existing ``out`` is left alone
  (FileExistsError) unless ``force=True``, and even then only a token folder (its files are
  ``meta.json``, ``train.bin`` and ``val.bin``) or an empty folder is replaced.

Prompt-masked data (``fields``, ``dew tokenize --jsonl-fields``) writes a loss mask beside the
tokens (``train.mask``, ``val.mask``: 1 where predicting the token counts in the loss):

- ``fields=("prompt", "completion")``: each ``.jsonl`` line (``.parquet`` row) is a prompt and its
  completion, tokenized apart and joined; the completion's tokens count, the prompt's do not.
- ``fields=("messages",)``: a chat, a list of ``{"role": str, "content": str}``, rendered by
  ``CHAT_TEMPLATE``: each message as ``<|ROLE|>\n`` then its content and ``\n``; an assistant
  message's content and its closing ``\n`` count, nothing else does (headers, other roles).
- The end-of-text id that follows a document counts when the document's last token does (a
  completion, an assistant's last turn): the model learns to stop. Text files count every token.

``rows="pad"`` (``--rows pad --seq-len S``) starts every document at a multiple of ``S`` tokens
(``pad_seq_len`` in ``meta.json``), filling the rest of its last row with the end-of-text id (0
without one), masked, so that no window of ``seq_len = S`` holds two documents: no token attends
to another document. A document's first token never counts there (the row before would predict
it). ``rows="pack"`` (the default) joins documents by the end-of-text id alone.

Every folder records where each document starts (``train.docs``, ``val.docs``: the folder's
format version 2), whatever the input and the rows, so that ``dew train`` can keep each packed
document to itself (``dew.data.windows``' ``documents="separate"``, the default for masked packed
folders).

Layout: ``TokenizeReport``; reading documents (``input_files``, ``read_documents``, ``render_chat``,
and the ``.jsonl`` and ``.parquet`` readers); the split and the train text a BPE is trained on
(``split_documents``, ``train_texts``); cutting them into chunks (``_chunks``); tokenizing a chunk
(``MaskRule``, ``encode_masked``, ``encode_chunk``), here or in worker processes (``_encoded``);
putting the folder in place (``_check_out``, ``_install``); and ``mask_rule`` and
``tokenize_files``, which runs them all. It is one module because reading text, jsonl and parquet,
the prompt/chat masks and the pack/pad rows are one pass over the documents that writes tokens and
mask together.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from dew.data.folder import (
    DOCS,
    MASKS,
    META,
    TRAIN,
    VAL,
    TokenFolderWriter,
    TokenMeta,
    _fsync_folder,
    read_meta,
)
from dew.data.tokenizer import (
    BPE_EOS,
    BYTE_NAMES,
    TOKENIZER_FILE,
    HFTokenizer,
    Tokenizer,
    _tokenizers_library,
    bpe_vocab,
    tokenizer_for,
    train_bpe,
)

TEXT_SUFFIXES = (".txt", ".text", ".md")
SUFFIXES = (*TEXT_SUFFIXES, ".jsonl", ".parquet")
# Text per chunk of documents handed to a worker (a chunk ends after the document that reaches it).
CHUNK_BYTES = 1 << 20
ROWS = ("pack", "pad")
# How a chat renders (fields=("messages",)): each message is the header, then its content, then
# the end; the content and the end count in the loss for an assistant message only. Documented in
# docs/data.md: a model fine-tuned on it must be prompted the same way.
CHAT_TEMPLATE = {"header": "<|{role}|>\n", "end": "\n", "trained_role": "assistant"}

# A document: plain text (every token counts), or pieces ``(text, counts)`` tokenized one by one.
Document = str | list[tuple[str, bool]]


@dataclasses.dataclass(frozen=True)
class TokenizeReport:
    """What ``tokenize_files`` wrote.

    Attributes:
      meta: the folder's ``TokenMeta`` (token counts, vocabulary, ...).
      train_documents, val_documents: documents per split.
      bytes_read: the input bytes the documents came from: a text file's (and a ``.parquet``
        document's) UTF-8 text, a ``.jsonl`` line whole.
      seconds: the wall time it took (training the tokenizer included).
      bpe_vocab: the vocabulary asked of a tokenizer trained here (``tokenizer="bpe:VOCAB"``),
        else ``None``; ``meta.vocab_size`` is what it got (less when BPE ran out of pairs).
      tokenizer_seconds: the wall time training it took (``None``: none was trained).
    """

    meta: TokenMeta
    train_documents: int
    val_documents: int
    bytes_read: int
    seconds: float
    bpe_vocab: int | None = None
    tokenizer_seconds: float | None = None


def input_files(inputs: Sequence[str | os.PathLike]) -> list[Path]:
    """The files ``inputs`` stand for, in order: each file itself, each folder the files under it
    with a known suffix, sorted. FileNotFoundError for a missing input, ValueError for a file of
    another suffix or a folder holding none."""
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted(
                p
                for p in path.rglob("*")
                if p.is_file()
                and p.suffix in SUFFIXES
                and not any(part.startswith(".") for part in p.relative_to(path).parts)
            )
            if not found:
                raise ValueError(f"folder {str(path)!r} holds no {', '.join(SUFFIXES)} files")
            files.extend(found)
        elif path.is_file():
            if path.suffix not in SUFFIXES:
                raise ValueError(
                    f"{str(path)!r}: unknown kind of input {path.suffix or '(no suffix)'}; "
                    f"dew tokenize reads {', '.join(SUFFIXES)}"
                )
            files.append(path)
        else:
            raise FileNotFoundError(f"input {str(path)!r} does not exist")
    if not files:
        raise ValueError("no inputs given")
    return files


def read_documents(
    path: Path, field: str = "text", fields: Sequence[str] | None = None
) -> Iterator[tuple[Document, int]]:
    """``(document, bytes)`` for each document of the file ``path`` (the rules are the module's):
    text, or with ``fields`` the pieces of a prompt and completion or of a chat."""
    if path.suffix == ".jsonl":
        yield from _jsonl(path, field, fields)
    elif path.suffix == ".parquet":
        yield from _parquet(path, field, fields)
    else:
        data = path.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"{str(path)!r} is not UTF-8 text: {error}") from None
        if text:
            yield text, len(data)


def _document(value, where: str, field: str) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ValueError(f"{where}: field {field!r} is a {type(value).__name__}, not a string")
    return value


def _text_piece(value, where: str, field: str) -> str:
    """A prompt's or completion's text: ``""`` for null."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"{where}: field {field!r} is a {type(value).__name__}, not a string")
    return value


def render_chat(messages, where: str = "chat") -> list[tuple[str, bool]]:
    """The pieces ``(text, counts)`` of a chat by ``CHAT_TEMPLATE``: ``messages`` a list of
    ``{"role": str, "content": str}``; ValueError naming ``where`` for anything else."""
    if not isinstance(messages, list):
        raise ValueError(f"{where}: messages must be a list, got a {type(messages).__name__}")
    pieces = []
    for number, message in enumerate(messages):
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise ValueError(
                f"{where}: message {number} must be an object with string 'role' and "
                f"'content', got {message!r:.80}"
            )
        counts = message["role"] == CHAT_TEMPLATE["trained_role"]
        pieces.append((CHAT_TEMPLATE["header"].format(role=message["role"]), False))
        pieces.append((message["content"] + CHAT_TEMPLATE["end"], counts))
    return pieces


def _record_document(record, where: str, fields: Sequence[str]) -> list[tuple[str, bool]] | None:
    """The pieces of one record under ``fields`` (prompt and completion, or messages); ``None``
    for one with nothing to learn (no completion, no assistant message)."""
    missing = [name for name in fields if name not in record]
    if missing:
        raise ValueError(
            f"{where}: no field {missing[0]!r} (it has {', '.join(map(repr, record))}); "
            "choose them with --jsonl-fields"
        )
    if len(fields) == 2:
        prompt = _text_piece(record[fields[0]], where, fields[0])
        completion = _text_piece(record[fields[1]], where, fields[1])
        return [(prompt, False), (completion, True)] if completion else None
    pieces = render_chat(record[fields[0]], where)
    return pieces if any(counts for _, counts in pieces) else None


def _jsonl(path: Path, field: str, fields: Sequence[str] | None = None):
    with open(path, "rb") as file:
        for number, line in enumerate(file, 1):
            where = f"{path}:{number}"
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                raise ValueError(f"{where}: not a line of JSON: {error}") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: a {type(record).__name__}, not a JSON object")
            if fields:
                document = _record_document(record, where, fields)
                if document is not None:
                    yield document, len(line)
                continue
            if field not in record:
                raise ValueError(
                    f"{where}: no field {field!r} (it has {', '.join(map(repr, record))}); "
                    "choose one with --field"
                )
            text = _document(record[field], where, field)
            if text is not None:
                yield text, len(line)


def _parquet(path: Path, field: str, fields: Sequence[str] | None = None):
    try:
        import pyarrow.parquet as parquet
    except ImportError:
        from dew.targets import MissingExtra

        raise MissingExtra(
            f"reading {str(path)!r} needs pyarrow, which is not installed: pip install pyarrow"
        ) from None
    file = parquet.ParquetFile(path)
    names = file.schema_arrow.names
    if fields:
        missing = [name for name in fields if name not in names]
        if missing:
            raise ValueError(
                f"{str(path)!r} has no column {missing[0]!r} (it has "
                f"{', '.join(map(repr, names))}); choose them with --jsonl-fields"
            )
        row = 0
        for batch in file.iter_batches(columns=list(fields), batch_size=1024):
            for record in batch.to_pylist():
                document = _record_document(record, f"{path}: row {row}", fields)
                row += 1
                if document is not None:
                    yield document, sum(len(text.encode("utf-8")) for text, _ in document)
        return
    if field not in names:
        raise ValueError(
            f"{str(path)!r} has no column {field!r} (it has {', '.join(map(repr, names))}); "
            "choose one with --field"
        )
    row = 0
    for batch in file.iter_batches(columns=[field], batch_size=1024):
        for value in batch.column(0).to_pylist():
            text = _document(value, f"{path}: row {row}", field)
            row += 1
            if text is not None:
                yield text, len(text.encode("utf-8"))


# One chunk: its documents, whether each goes to val, and the input bytes they came from.
Chunk = tuple[list[Document], list[bool], int]


def split_documents(
    files: Sequence[Path],
    field: str,
    val_fraction: float,
    seed: int,
    fields: Sequence[str] | None = None,
) -> Iterator[tuple[Document, int, bool]]:
    """``(document, bytes, to_val)`` for each document of ``files`` in input order: the split
    rule, one ``np.random.default_rng(seed).random() < val_fraction`` draw per document (none at
    ``val_fraction=0``). Both the tokenizer's training (the train documents only) and the
    tokenizing read the split from here, so the two passes agree on it."""
    rng = np.random.default_rng(seed)
    for path in files:
        for document, nbytes in read_documents(path, field, fields):
            yield document, nbytes, bool(val_fraction > 0 and rng.random() < val_fraction)


def train_texts(
    files: Sequence[Path],
    field: str,
    val_fraction: float,
    seed: int,
    fields: Sequence[str] | None = None,
) -> Iterator[str]:
    """The text of each train document (the ones ``split_documents`` keeps out of ``val.bin``),
    streamed: a text document whole, a prompt/completion or chat piece by piece (they are
    tokenized apart)."""
    for document, _, to_val in split_documents(files, field, val_fraction, seed, fields):
        if to_val:
            continue
        if isinstance(document, str):
            yield document
        else:
            yield from (text for text, _ in document if text)


def _chunks(
    files: Sequence[Path],
    field: str,
    val_fraction: float,
    seed: int,
    chunk_bytes: int,
    fields: Sequence[str] | None = None,
) -> Iterator[Chunk]:
    texts: list[Document] = []
    to_val: list[bool] = []
    size = 0
    for text, nbytes, val in split_documents(files, field, val_fraction, seed, fields):
        texts.append(text)
        to_val.append(val)
        size += nbytes
        if size >= chunk_bytes:
            yield texts, to_val, size
            texts, to_val, size = [], [], 0
    if texts:
        yield texts, to_val, size


@dataclasses.dataclass(frozen=True)
class MaskRule:
    """How a masked folder's documents are laid out: ``pad_seq_len`` (rows="pad") or ``None``
    (packed)."""

    pad_seq_len: int | None = None


def encode_masked(tokenizer: Tokenizer, document: Document, rule: MaskRule):
    """``(ids, mask)`` of one document, int64 and uint8 ``[tokens]``: its pieces tokenized one
    by one, the end-of-text id after them (counting when the last token does), padded to whole
    rows under ``rows="pad"``."""
    pieces = [(document, True)] if isinstance(document, str) else document
    ids: list[int] = []
    mask: list[int] = []
    for text, counts in pieces:
        encoded = tokenizer.encode(text)
        ids.extend(encoded)
        mask.extend([int(counts)] * len(encoded))
    eos = tokenizer.eos_id
    if eos is not None and ids:
        ids.append(eos)
        mask.append(mask[-1])
    if rule.pad_seq_len is not None and ids:
        mask[0] = 0  # the last target of the row before: another document's prediction
        rows = -(-len(ids) // rule.pad_seq_len)
        fill = rows * rule.pad_seq_len - len(ids)
        ids.extend([pad_id(tokenizer)] * fill)
        mask.extend([0] * fill)
    return np.asarray(ids, np.int64), np.asarray(mask, np.uint8)


def pad_id(tokenizer: Tokenizer) -> int:
    """The id that fills a padded row (never a target): the end-of-text id, else 0."""
    return 0 if tokenizer.eos_id is None else tokenizer.eos_id


@dataclasses.dataclass(frozen=True)
class EncodedChunk:
    """One chunk's documents, tokenized: per split (``"train"``, ``"val"``) the ids (each
    document followed by the end-of-text id), the loss mask (``None`` for an unmasked folder),
    the offset of each document's first id, and the number of documents."""

    ids: dict[str, np.ndarray]
    masks: dict[str, np.ndarray] | None
    starts: dict[str, np.ndarray]
    documents: dict[str, int]


def encode_chunk(tokenizer: Tokenizer, chunk: Chunk, rule: MaskRule | None = None) -> EncodedChunk:
    """The ``EncodedChunk`` of one chunk: its documents' ids per split, each followed by the
    end-of-text id, with a ``MaskRule`` (a masked folder) their loss masks, and always where each
    document starts."""
    texts, to_val, _ = chunk
    pieces: dict[str, list] = {"train": [], "val": []}
    eos = tokenizer.eos_id
    for document, val in zip(texts, to_val):
        if rule is not None:
            ids, mask = encode_masked(tokenizer, document, rule)
        else:
            ids = tokenizer.encode(document)
            if eos is not None:
                ids.append(eos)
            ids, mask = np.asarray(ids, np.int64), None
        if ids.size:  # a document that encodes to nothing is no document
            pieces["val" if val else "train"].append((ids, mask))

    def joined(parts, which, dtype):
        arrays = [part[which] for part in parts]
        return np.concatenate(arrays) if arrays else np.zeros(0, dtype)

    ids = {split: joined(parts, 0, np.int64) for split, parts in pieces.items()}
    masks = None
    if rule is not None:
        masks = {split: joined(parts, 1, np.uint8) for split, parts in pieces.items()}
    starts = {
        split: np.cumsum([0] + [part[0].size for part in parts[:-1]], dtype=np.int64)
        if parts
        else np.zeros(0, np.int64)
        for split, parts in pieces.items()
    }
    documents = {split: len(parts) for split, parts in pieces.items()}
    return EncodedChunk(ids=ids, masks=masks, starts=starts, documents=documents)


# A worker process's tokenizer and mask rule, set once by _start_worker.
_worker_tokenizer: Tokenizer | None = None
_worker_rule: MaskRule | None = None


def _start_worker(tokenizer: Tokenizer, rule: MaskRule | None = None) -> None:
    global _worker_tokenizer, _worker_rule
    _worker_tokenizer = tokenizer
    _worker_rule = rule


def _encode_in_worker(chunk: Chunk):
    return encode_chunk(_worker_tokenizer, chunk, _worker_rule)


def _context():
    """Worker processes forked from a fresh server process that imported this module once: not
    from the caller, which may run JAX's threads (forking them is unsafe), and not spawned each
    from scratch (each would import JAX again)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    return context


def _encoded(
    tokenizer: Tokenizer, chunks: Iterator[Chunk], workers: int, rule: MaskRule | None = None
):
    """``(encode_chunk's result, chunk bytes)`` of each chunk, in order."""
    if workers == 1:
        for chunk in chunks:
            yield encode_chunk(tokenizer, chunk, rule), chunk[2]
        return
    with _context().Pool(workers, _start_worker, (tokenizer, rule)) as pool:
        pending: deque = deque()
        for chunk in chunks:  # at most 2 chunks per worker in flight: memory stays bounded
            pending.append((pool.apply_async(_encode_in_worker, (chunk,)), chunk[2]))
            if len(pending) >= 2 * workers:
                result, size = pending.popleft()
                yield result.get(), size
        while pending:
            result, size = pending.popleft()
            yield result.get(), size


# A token folder's files: the tokenizer.json of one whose tokenizer it holds (bpe:VOCAB) too.
_FOLDER_FILES = (META, TRAIN, VAL, *MASKS.values(), *DOCS.values(), TOKENIZER_FILE)


def foreign_files(out: Path) -> list[str]:
    """The names in the folder ``out`` that a token folder does not hold, sorted: ``force``
    replaces a folder only where there is none."""
    return sorted(p.name for p in out.iterdir() if not p.name.startswith(_FOLDER_FILES))


def _check_out(out: Path, force: bool) -> None:
    """Refuses an ``out`` that exists, unless ``force`` and it is a token folder or empty.
    (``dew tokenize`` checks its ``--out`` first, in its flags' words.)"""
    if not out.exists():
        return
    if not out.is_dir():
        raise FileExistsError(f"out {str(out)!r} exists and is not a folder; it is left alone")
    if not force and any(out.iterdir()):
        raise FileExistsError(f"out {str(out)!r} already exists; force=True replaces it")
    others = foreign_files(out)
    if others:
        raise FileExistsError(
            f"out {str(out)!r} holds files a token folder does not ({', '.join(others[:5])}); "
            "force=True replaces only a token folder, so it is left alone"
        )


def _install(temp: Path, out: Path, force: bool) -> None:
    """Renames the complete folder ``temp`` to ``out``; an old ``out`` is moved aside first and
    removed after, so ``out`` is at every moment absent, the old folder, or the new one."""
    _check_out(out, force)
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.rename(out, old)
        try:
            os.rename(temp, out)
        except BaseException:
            os.rename(old, out)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(temp, out)
    _fsync_folder(out.parent)


def mask_rule(fields: Sequence[str] | None, rows: str, seq_len: int | None) -> MaskRule | None:
    """The ``MaskRule`` of these settings (``None``: an unmasked, packed folder, as without
    them), or a ValueError naming the values that do not go together."""
    if rows not in ROWS:
        raise ValueError(f"rows must be one of {', '.join(ROWS)}, got {rows!r}")
    if fields is not None:
        fields = tuple(fields)
        if len(fields) not in (1, 2) or not all(isinstance(f, str) and f for f in fields):
            raise ValueError(
                "fields must be two names (prompt, completion) or one (a chat's messages), "
                f"got {fields!r}"
            )
    if rows == "pad":
        if not (isinstance(seq_len, int) and not isinstance(seq_len, bool) and seq_len >= 1):
            raise ValueError(
                f"rows='pad' needs seq_len, the model's: documents start at its "
                f"multiples; got {seq_len!r}"
            )
        return MaskRule(pad_seq_len=seq_len)
    if seq_len is not None:
        raise ValueError(f"seq_len {seq_len} is for rows='pad' only (packed rows ignore it)")
    return MaskRule() if fields else None


def tokenize_files(
    inputs: Sequence[str | os.PathLike],
    out: str | os.PathLike,
    *,
    tokenizer: str | os.PathLike | Tokenizer,
    eos: str | None = None,
    val_fraction: float = 0.01,
    field: str = "text",
    workers: int = 1,
    seed: int = 0,
    force: bool = False,
    progress: Callable[[int, int], None] | None = None,
    chunk_bytes: int | None = None,
    fields: Sequence[str] | None = None,
    rows: str = "pack",
    seq_len: int | None = None,
) -> TokenizeReport:
    """Tokenizes the documents of ``inputs`` into the token folder ``out`` (the module's rules):
    what ``dew tokenize`` runs.

    Args:
      inputs: text, ``.jsonl`` and ``.parquet`` files, and folders of them.
      out: the token folder to write (atomically).
      tokenizer: a ``Tokenizer``, a spec for ``tokenizer_for`` (``"bytes"``, a
        ``tokenizer.json``), or ``"bpe:VOCAB"``: a byte-level BPE of ``VOCAB`` ids trained
        (``train_bpe``) on the train documents only, the split drawn first by the rule above,
        written to ``out/tokenizer.json`` (``meta.json`` names it ``"tokenizer.json"``: the
        folder's own) and then used as a given ``tokenizer.json`` is.
      eos: the end-of-text token of a ``tokenizer.json`` (``tokenizer_for``'s); refused with
        ``"bpe:VOCAB"``, whose is ``<|endoftext|>``.
      val_fraction: the share of documents drawn into ``val.bin``, in ``[0, 1)`` (default
        0.01).
      field: the ``.jsonl`` key (``.parquet`` column) that holds a document (default
        ``"text"``).
      workers: processes that tokenize (default 1; the folder is the same for any number).
      seed: the validation split's draw (default 0).
      force: replace an existing token folder (or empty folder) at ``out``.
      progress: ``progress(bytes_read, tokens_written)``, called after each chunk is written,
        and with ``(0, 0)`` as tokenizing starts (after training a tokenizer).
      chunk_bytes: about how much input a chunk holds (default ``CHUNK_BYTES``, 1 MiB).
      fields: ``(prompt, completion)`` or ``(messages,)`` field names of ``.jsonl`` lines
        (``.parquet`` columns) for prompt-masked data, in place of ``field``; writes a loss mask.
      rows: ``"pack"`` (the default) or ``"pad"`` (with ``seq_len``, the model's).
      seq_len: the row length documents are padded to, with ``rows="pad"`` only.

    Returns:
      a ``TokenizeReport`` of what it wrote.

    Raises:
      ValueError: a bad setting (``val_fraction``, ``workers``, ``rows``, ``fields``,
        ``seq_len``, a ``bpe:VOCAB`` below 257 or not an integer), a document that cannot be
        read (naming the file and line), or no documents at all.
      dew.targets.MissingExtra: a ``tokenizer.json`` or ``bpe:VOCAB`` without the
        ``tokenizers`` library (before anything is read).
      FileExistsError: ``out`` exists and ``force`` is not set (or it is not a token folder).

    Examples:
        >>> from dew.data import tokenize_files
        >>> report = tokenize_files(["corpus/", "notes.jsonl"], "my-tokens", tokenizer="bytes")
        >>> report.train_documents  # a document per text file and per .jsonl line
        3
    """
    if not (isinstance(val_fraction, (int, float)) and 0 <= val_fraction < 1):
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction!r}")
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
    rule = mask_rule(fields, rows, seq_len)
    vocab = bpe_vocab(tokenizer)
    if vocab is not None:
        if eos is not None:
            raise ValueError(
                f"eos {eos!r}: a tokenizer trained here (bpe:VOCAB) ends documents with "
                f"{BPE_EOS}; leave eos out"
            )
        _tokenizers_library()  # MissingExtra before anything is read
    out = Path(out)
    _check_out(out, force)
    files = input_files(inputs)
    if vocab is None:
        tokenizer = _given_tokenizer(tokenizer, eos)
    start = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    temp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(temp, ignore_errors=True)
    documents = {"train": 0, "val": 0}
    bytes_read = 0
    tokenizer_seconds = None
    try:
        # The name meta.json gives the tokenizer: its file's absolute path, or TOKENIZER_FILE
        # for the folder's own (read_meta resolves it in the folder, wherever it was moved).
        name = tokenizer.name if vocab is None else TOKENIZER_FILE
        temp.mkdir()
        if vocab is not None:
            trained = time.perf_counter()
            texts = train_texts(files, field, val_fraction, seed, fields)
            # Written beside the tokens and read back as a given tokenizer.json is.
            tokenizer = train_bpe(texts, vocab, temp / TOKENIZER_FILE)
            tokenizer_seconds = time.perf_counter() - trained
        elif isinstance(tokenizer, HFTokenizer) and Path(tokenizer.name).parent == out.resolve():
            # Tokenizing again (--force) with the folder's own tokenizer: the new folder keeps a
            # copy, as the old one goes.
            shutil.copyfile(tokenizer.name, temp / TOKENIZER_FILE)
            name = TOKENIZER_FILE
        writer = TokenFolderWriter(
            temp,
            tokenizer=name,
            vocab_size=tokenizer.vocab_size,
            eos_id=tokenizer.eos_id,
            loss_mask=rule is not None,
            pad_seq_len=None if rule is None else rule.pad_seq_len,
            document_starts=True,
        )
        try:
            if progress is not None:
                progress(0, 0)
            chunks = _chunks(files, field, val_fraction, seed, chunk_bytes or CHUNK_BYTES, fields)
            for encoded, size in _encoded(tokenizer, chunks, workers, rule):
                for split in ("train", "val"):
                    mask = None if encoded.masks is None else encoded.masks[split]
                    writer.append(split, encoded.ids[split], mask, encoded.starts[split])
                    documents[split] += encoded.documents[split]
                bytes_read += size
                if progress is not None:
                    progress(bytes_read, writer.counts["train"] + writer.counts["val"])
            if not documents["train"] + documents["val"]:
                raise ValueError(f"no documents in {', '.join(map(str, files))}")
            if rule is not None and rule.pad_seq_len is not None:
                # The last row's last target: one more pad, so that the last row is whole.
                # It belongs to the split's last document (no start).
                for split in ("train", "val"):
                    if writer.counts[split]:
                        writer.append(split, [pad_id(tokenizer)], [0], [])
            writer.extra.update(val_fraction=val_fraction, seed=seed)
            if vocab is not None:
                writer.extra["trained_tokenizer"] = {"kind": "byte-level BPE", "vocab": vocab}
            writer.close()
        finally:
            writer.abort()
        _install(temp, out, force)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return TokenizeReport(
        meta=read_meta(out),
        train_documents=documents["train"],
        val_documents=documents["val"],
        bytes_read=bytes_read,
        seconds=time.perf_counter() - start,
        bpe_vocab=vocab,
        tokenizer_seconds=tokenizer_seconds,
    )


def _given_tokenizer(spec, eos: str | None) -> Tokenizer:
    """``tokenizer_for(spec, eos=eos)``, with ``bpe:VOCAB`` among the choices an unknown name
    is told about."""
    if isinstance(spec, str) and spec not in BYTE_NAMES and not Path(spec).exists():
        raise ValueError(
            f"unknown tokenizer {spec!r}: give {' or '.join(repr(n) for n in BYTE_NAMES)}, "
            f"'bpe:VOCAB' (train a byte-level BPE of VOCAB tokens on the inputs' train "
            f"documents), the path of a {TOKENIZER_FILE}, or a folder holding one (nothing is "
            f"downloaded: save a hub tokenizer's {TOKENIZER_FILE} first)"
        )
    return tokenizer_for(spec, eos=eos)
