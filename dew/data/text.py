"""Text files into a token folder: what ``dew tokenize`` runs.

``tokenize_files(inputs, out, tokenizer=...)`` reads documents, tokenizes them in one or more
processes, and writes the token folder ``out`` (``dew.data.folder``'s format):

- Documents: a text file (``.txt``, ``.text``, ``.md``) is one document; a ``.jsonl`` file holds
  one document per line, the string in ``field`` of the line's object; a ``.parquet`` file one per
  row, the string in column ``field`` (needs ``pyarrow``). A folder stands for the files under it
  with those suffixes, in sorted path order (hidden names skipped). Empty and null documents are
  skipped; a missing field, a non-string value or a line that is not JSON is a ValueError naming
  the file and line (or row).
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
    META,
    TRAIN,
    VAL,
    TokenFolderWriter,
    TokenMeta,
    _fsync_folder,
    read_meta,
)
from dew.data.tokenizer import Tokenizer, tokenizer_for

TEXT_SUFFIXES = (".txt", ".text", ".md")
SUFFIXES = (*TEXT_SUFFIXES, ".jsonl", ".parquet")
# Text per chunk of documents handed to a worker (a chunk ends after the document that reaches it).
CHUNK_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class TokenizeReport:
    """What ``tokenize_files`` wrote: the folder's meta, documents per split, the text's UTF-8
    bytes and the seconds it took."""

    meta: TokenMeta
    train_documents: int
    val_documents: int
    bytes_read: int
    seconds: float


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


def read_documents(path: Path, field: str = "text") -> Iterator[tuple[str, int]]:
    """``(text, bytes)`` for each document of the file ``path`` (the rules are the module's)."""
    if path.suffix == ".jsonl":
        yield from _jsonl(path, field)
    elif path.suffix == ".parquet":
        yield from _parquet(path, field)
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


def _jsonl(path: Path, field: str) -> Iterator[tuple[str, int]]:
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
            if field not in record:
                raise ValueError(
                    f"{where}: no field {field!r} (it has {', '.join(map(repr, record))}); "
                    "choose one with --field"
                )
            text = _document(record[field], where, field)
            if text is not None:
                yield text, len(line)


def _parquet(path: Path, field: str) -> Iterator[tuple[str, int]]:
    try:
        import pyarrow.parquet as parquet
    except ImportError:
        from dew.targets import MissingExtra

        raise MissingExtra(
            f"reading {str(path)!r} needs pyarrow, which is not installed: pip install pyarrow"
        ) from None
    file = parquet.ParquetFile(path)
    names = file.schema_arrow.names
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
Chunk = tuple[list[str], list[bool], int]


def _chunks(
    files: Sequence[Path], field: str, val_fraction: float, seed: int, chunk_bytes: int
) -> Iterator[Chunk]:
    rng = np.random.default_rng(seed)
    texts: list[str] = []
    to_val: list[bool] = []
    size = 0
    for path in files:
        for text, nbytes in read_documents(path, field):
            texts.append(text)
            to_val.append(bool(val_fraction > 0 and rng.random() < val_fraction))
            size += nbytes
            if size >= chunk_bytes:
                yield texts, to_val, size
                texts, to_val, size = [], [], 0
    if texts:
        yield texts, to_val, size


def encode_chunk(tokenizer: Tokenizer, chunk: Chunk) -> tuple[np.ndarray, np.ndarray, int, int]:
    """The train ids, val ids (each document followed by the end-of-text id) and the number of
    train and val documents of one chunk."""
    texts, to_val, _ = chunk
    ids: dict[bool, list[int]] = {False: [], True: []}
    eos = tokenizer.eos_id
    for text, val in zip(texts, to_val):
        ids[val].extend(tokenizer.encode(text))
        if eos is not None:
            ids[val].append(eos)
    val_docs = sum(to_val)
    return (
        np.asarray(ids[False], np.int64),
        np.asarray(ids[True], np.int64),
        len(texts) - val_docs,
        val_docs,
    )


# A worker process's tokenizer, set once by _start_worker.
_worker_tokenizer: Tokenizer | None = None


def _start_worker(tokenizer: Tokenizer) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer


def _encode_in_worker(chunk: Chunk):
    return encode_chunk(_worker_tokenizer, chunk)


def _context():
    """Worker processes forked from a fresh server process that imported this module once: not
    from the caller, which may run JAX's threads (forking them is unsafe), and not spawned each
    from scratch (each would import JAX again)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    return context


def _encoded(tokenizer: Tokenizer, chunks: Iterator[Chunk], workers: int):
    """``(encode_chunk's result, chunk bytes)`` of each chunk, in order."""
    if workers == 1:
        for chunk in chunks:
            yield encode_chunk(tokenizer, chunk), chunk[2]
        return
    with _context().Pool(workers, _start_worker, (tokenizer,)) as pool:
        pending: deque = deque()
        for chunk in chunks:  # at most 2 chunks per worker in flight: memory stays bounded
            pending.append((pool.apply_async(_encode_in_worker, (chunk,)), chunk[2]))
            if len(pending) >= 2 * workers:
                result, size = pending.popleft()
                yield result.get(), size
        while pending:
            result, size = pending.popleft()
            yield result.get(), size


_FOLDER_FILES = (META, TRAIN, VAL)


def _check_out(out: Path, force: bool) -> None:
    """Refuses an ``out`` that exists, unless ``force`` and it is a token folder or empty."""
    if not out.exists():
        return
    if not out.is_dir():
        raise FileExistsError(f"{str(out)!r} exists and is not a folder; dew tokenize leaves it")
    names = [p.name for p in out.iterdir()]
    if names and not force:
        raise FileExistsError(
            f"{str(out)!r} already exists; pass --force (force=True) to replace it"
        )
    others = [n for n in names if not n.startswith(_FOLDER_FILES)]
    if others:
        raise FileExistsError(
            f"{str(out)!r} holds files a token folder does not ({', '.join(sorted(others)[:5])}); "
            "--force replaces only a token folder, so it is left alone"
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
) -> TokenizeReport:
    """Tokenizes the documents of ``inputs`` into the token folder ``out`` (the module's rules)
    and returns what it wrote. ``tokenizer`` is a ``Tokenizer`` or a spec for ``tokenizer_for``;
    ``progress(bytes_read, tokens_written)`` is called after each chunk is written; a chunk holds
    about ``chunk_bytes`` of input (default ``CHUNK_BYTES``)."""
    if not (isinstance(val_fraction, (int, float)) and 0 <= val_fraction < 1):
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction!r}")
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
    out = Path(out)
    _check_out(out, force)
    files = input_files(inputs)
    tokenizer = tokenizer_for(tokenizer, eos=eos)
    start = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    temp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(temp, ignore_errors=True)
    documents = {"train": 0, "val": 0}
    bytes_read = 0
    try:
        writer = TokenFolderWriter(
            temp, tokenizer=tokenizer.name, vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eos_id
        )
        try:
            chunks = _chunks(files, field, val_fraction, seed, chunk_bytes or CHUNK_BYTES)
            for (train, val, train_docs, val_docs), size in _encoded(tokenizer, chunks, workers):
                writer.append("train", train)
                writer.append("val", val)
                documents["train"] += train_docs
                documents["val"] += val_docs
                bytes_read += size
                if progress is not None:
                    progress(bytes_read, writer.counts["train"] + writer.counts["val"])
            if not documents["train"] + documents["val"]:
                raise ValueError(f"no documents in {', '.join(map(str, files))}")
            writer.extra.update(
                train_documents=documents["train"],
                val_documents=documents["val"],
                val_fraction=val_fraction,
                seed=seed,
            )
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
    )
