"""TokenWindows: fixed-length training windows over a token folder, in a seeded shuffled order.

Window rule: window ``w`` of a token array is ``tokens[w * seq_len : w * seq_len + seq_len + 1]``,
``seq_len + 1`` tokens (inputs and their next-token targets) starting every ``seq_len`` tokens, so
neighbouring windows share one token and a file of ``n`` tokens gives
``(n - seq_len - 1) // seq_len + 1`` windows (the tail that does not fill a window is not used).

Order: epoch ``e`` visits the training windows in the permutation
``np.random.default_rng([seed, e]).permutation(records)``; an epoch is ``records // batch``
batches (the last ``records % batch`` windows of each epoch's order are dropped), and global batch
``k`` is batch ``k % batches_per_epoch`` of epoch ``k // batches_per_epoch``. Batch ``k`` therefore
holds the same windows whatever the mesh, the number of processes or the loading settings; each
process reads its own rows of it with ``rows=``.

Loss mask: a folder with one (``dew.data.folder``) gives batches ``[rows, 2, seq_len + 1]``, the
window's tokens at ``[:, 0]`` and their mask (0 or 1) at ``[:, 1]``, cut by the same rule; a
folder without one gives ``[rows, seq_len + 1]`` tokens, as always.

Documents (``documents=``): ``"separate"`` gives batches ``[rows, 3, seq_len + 1]``: tokens, their
loss mask (all 1 for a folder without one) and, at ``[:, 2]``, each token's document id within its
window (0 for the window's first document, then 1, 2, ... at each document start the folder
records). The step then keeps attention inside each document, restarts rotary positions at each
document's first token in the window, and drops the targets that would predict one document's
first token from the document before (``dew.objectives.lm``). A window that starts inside a
document holds that document's tail as its document 0, positions from 0 (the window holds
nothing of its head to attend to). ``"joined"``: the batches above, documents joined by the
end-of-text id only. ``"auto"`` (the default): ``"separate"`` for a packed folder with a loss mask
and document starts (prompt/completion and chat data from ``dew tokenize --jsonl-fields``),
``"joined"`` otherwise (plain text, padded rows, folders without document starts).
"""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import Any

import numpy as np

from dew.checks import nonnegative_int, positive_int
from dew.data.folder import TokenMeta, open_document_starts, open_mask, open_tokens, read_meta
from dew.data.loading import BatchStream, Loading

# Windows are returned as int32; ids must fit.
_INT32_VOCAB = 2**31
# How documents share a window (``TokenWindows(documents=...)``).
DOCUMENTS = ("auto", "separate", "joined")


def resolve_documents(documents: str, meta: TokenMeta) -> str:
    """``"separate"`` or ``"joined"``: what ``documents`` means for the folder of ``meta``
    (module doc); ValueError for an unknown choice, or ``"separate"`` on a folder without document
    starts (they are never guessed)."""
    if documents not in DOCUMENTS:
        raise ValueError(f"documents must be one of {', '.join(DOCUMENTS)}, got {documents!r}")
    if documents == "auto":
        packed_sft = meta.loss_mask and meta.pad_seq_len is None
        return "separate" if packed_sft and meta.document_starts else "joined"
    if documents == "separate" and not meta.document_starts:
        open_document_starts(meta, "train")  # raises, naming the folder and what to do
    return documents


def _check_int(name: str, value: Any, minimum: int) -> int:
    return positive_int(name, value) if minimum == 1 else nonnegative_int(name, value)


class DataPositionMismatch(ValueError):
    """A saved data position (``WindowDataset.position``) that describes another order of batches
    than this dataset's: ``differ`` maps each field that differs (``batch_size``, ``seq_len``,
    ``seed``, ``records``) to ``(saved, now)``."""

    def __init__(self, message: str, differ: dict):
        super().__init__(message)
        self.differ = differ


def window_count(tokens: int, seq_len: int) -> int:
    """How many ``seq_len + 1``-token windows, starting every ``seq_len`` tokens, fit in
    ``tokens``."""
    if tokens < seq_len + 1:
        return 0
    return (tokens - seq_len - 1) // seq_len + 1


def _windows(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """A ``[windows, seq_len + 1]`` view of ``tokens`` (no copy: still backed by the memory map)."""
    count = window_count(tokens.shape[0], seq_len)
    if count == 0:
        return np.zeros((0, seq_len + 1), tokens.dtype)
    return np.lib.stride_tricks.sliding_window_view(tokens, seq_len + 1)[::seq_len][:count]


def _row_indices(rows: slice, batch_size: int) -> range:
    if not isinstance(rows, slice):
        raise ValueError(f"rows must be a slice of the batch's {batch_size} rows, got {rows!r}")
    return range(batch_size)[rows]


@dataclasses.dataclass(frozen=True)
class TokenWindows:
    """Training (and validation) windows of ``seq_len + 1`` tokens from the token folder at
    ``path``: what to read, checked when built; ``load(batch=B)`` opens the folder and returns a
    ``WindowDataset`` of global batches of ``B`` windows.

    Args:
      path: a token folder (``dew tokenize``, ``write_token_folder``; docs/data.md).
      seq_len: tokens a model sees per row; each window holds ``seq_len + 1``.
      val_batches: how many validation batches ``validation()`` returns (default 0).
      loading: how ``batches()`` reads ahead (default ``Loading()``); it never changes what is
        read.
      seed: fixes the shuffled order (default 0).
      documents: ``"auto"`` (the default), ``"separate"`` or ``"joined"`` (the module doc).

    Raises:
      ValueError: ``seq_len`` below 1, ``val_batches`` or ``seed`` below 0, ``loading`` not a
        ``Loading``, or an unknown ``documents``.

    Examples:
        >>> from dew.data import TokenWindows, write_example_corpus
        >>> meta = write_example_corpus("tokens")
        >>> data = TokenWindows("tokens", seq_len=32, val_batches=1).load(batch=16)
        >>> data.batch(0).shape, data.batch(0).dtype
        ((16, 33), dtype('int32'))
    """

    path: str | os.PathLike
    seq_len: int
    val_batches: int = 0
    loading: Loading = Loading()
    seed: int = 0
    documents: str = "auto"

    def __post_init__(self):
        _check_int("seq_len", self.seq_len, 1)
        _check_int("val_batches", self.val_batches, 0)
        _check_int("seed", self.seed, 0)
        if not isinstance(self.loading, Loading):
            raise ValueError(f"loading must be a dew.data.Loading, got {self.loading!r}")
        if self.documents not in DOCUMENTS:
            raise ValueError(
                f"documents must be one of {', '.join(DOCUMENTS)}, got {self.documents!r}"
            )

    def load(self, batch: int) -> WindowDataset:
        """Opens the folder (memory maps, nothing read yet).

        Args:
          batch: windows per global batch (all processes together).

        Returns:
          the ``WindowDataset`` of global batches of ``batch`` windows.

        Raises:
          FileNotFoundError: no folder or ``meta.json`` at ``path`` (``read_meta``).
          ValueError: a bad folder (``read_meta``), ``batch < 1``, ``train.bin`` shorter than
            one window, ``batch`` more than the training windows, ``val.bin`` holding fewer than
            ``val_batches * batch`` windows, or a folder padded for another ``seq_len``.
        """
        batch = _check_int("batch", batch, 1)
        meta = read_meta(self.path)
        return WindowDataset(
            meta,
            seq_len=int(self.seq_len),
            batch_size=batch,
            val_batches=int(self.val_batches),
            loading=self.loading,
            seed=int(self.seed),
            documents=resolve_documents(self.documents, meta),
        )


class WindowDataset:
    """Global batches of training windows, int32 ``[batch_size, seq_len + 1]``, indexed over epochs
    (``[batch_size, 2, seq_len + 1]``, tokens then their loss mask, for a folder with a mask;
    ``[batch_size, 3, seq_len + 1]``, tokens, mask and document ids, with ``documents`` of
    ``"separate"``). ``TokenWindows(...).load(batch=B)`` makes one; ``Trainer.fit`` reads it.

    Attributes:
      records: training windows in ``train.bin``: ``(train_tokens - seq_len - 1) // seq_len + 1``.
      batch_size: rows of a global batch.
      seq_len: tokens a model sees per row; a row holds ``seq_len + 1`` (inputs, shifted targets).
      batches_per_epoch: ``records // batch_size``.
      vocab_size, seed, path: from the folder and the ``TokenWindows`` that opened it.
      val_batches: how many batches ``validation()`` returns.
      meta: the folder's ``TokenMeta``.
      loss_mask: whether batches carry the folder's loss mask (``[rows, 2, seq_len + 1]``).
      documents: ``"separate"`` (batches ``[rows, 3, seq_len + 1]`` with document ids) or
        ``"joined"``.

    Examples:
        >>> data = TokenWindows("tokens", seq_len=32).load(batch=16)
        >>> with data.batches(start=0) as stream:
        ...     index, rows = next(stream)  # batch 0: int32 [16, 33]
        >>> data.position(1)["next_batch"]  # what a checkpoint records; resume() reads it back
        1
    """

    def __init__(
        self,
        meta: TokenMeta,
        *,
        seq_len: int,
        batch_size: int,
        val_batches: int,
        loading: Loading,
        seed: int,
        documents: str = "joined",
    ):
        if meta.vocab_size > _INT32_VOCAB:
            raise ValueError(
                f"vocab_size {meta.vocab_size} does not fit the int32 batches (max {_INT32_VOCAB})"
            )
        self.meta = meta
        self.path = meta.path
        self.vocab_size = meta.vocab_size
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_batches = val_batches
        self.loading = loading
        self.seed = seed
        self.documents = resolve_documents(documents, meta)
        self.loss_mask = meta.loss_mask or self.documents == "separate"

        if meta.pad_seq_len is not None and meta.pad_seq_len != seq_len:
            raise ValueError(
                f"the token folder {str(meta.path)!r} was padded for seq_len {meta.pad_seq_len} "
                f"(dew tokenize --rows pad), so its documents start every {meta.pad_seq_len} "
                f"tokens; read at seq_len {seq_len} its rows would cut and join documents. Use "
                f"seq_len {meta.pad_seq_len}, or tokenize again for {seq_len}"
            )
        if meta.train_tokens < seq_len + 1:
            raise ValueError(
                f"train.bin in {str(meta.path)!r} holds {meta.train_tokens} tokens, "
                f"fewer than one window of seq_len + 1 = {seq_len + 1}"
            )
        self._train = _windows(open_tokens(meta, "train"), seq_len)
        self.records = self._train.shape[0]
        if batch_size > self.records:
            raise ValueError(
                f"batch {batch_size} is larger than the {self.records} training windows of seq_len "
                f"{seq_len} in {str(meta.path)!r}"
            )
        self.batches_per_epoch = self.records // batch_size

        self._val = _windows(open_tokens(meta, "val"), seq_len)
        masks = {split: open_mask(meta, split) for split in ("train", "val")}
        self._train_mask = None if masks["train"] is None else _windows(masks["train"], seq_len)
        self._val_mask = None if masks["val"] is None else _windows(masks["val"], seq_len)
        self._starts = None
        if self.documents == "separate":
            self._starts = {split: open_document_starts(meta, split) for split in ("train", "val")}
        if val_batches * batch_size > self._val.shape[0]:
            raise ValueError(
                f"val_batches {val_batches} x batch {batch_size} needs "
                f"{val_batches * batch_size} windows of seq_len {seq_len}, "
                f"but val.bin ({meta.val_tokens} tokens) holds {self._val.shape[0]}"
            )

        # Permutations of the two epochs last asked for (readers straddle an epoch boundary);
        # shared by the reader threads.
        self._order_lock = threading.Lock()
        self._orders: dict[int, np.ndarray] = {}

    def order(self, epoch: int) -> np.ndarray:
        """The window indices of ``epoch`` in the order its batches read them, shape
        ``[records]``."""
        epoch = _check_int("epoch", epoch, 0)
        with self._order_lock:
            if epoch not in self._orders:
                if len(self._orders) >= 2:
                    del self._orders[min(self._orders)]
                self._orders[epoch] = np.random.default_rng([self.seed, epoch]).permutation(
                    self.records
                )
            return self._orders[epoch]

    def windows_of(self, index: int) -> np.ndarray:
        """The window indices (into train.bin's windows) that global batch ``index`` holds,
        ``[batch_size]``."""
        index = _check_int("batch index", index, 0)
        epoch, within = divmod(index, self.batches_per_epoch)
        start = within * self.batch_size
        return self.order(epoch)[start : start + self.batch_size]

    def batch(self, index: int, rows: slice = slice(None)) -> np.ndarray:
        """Rows ``rows`` of global batch ``index`` (counting over epochs): int32
        ``[len(rows), seq_len + 1]`` (``[len(rows), 2, seq_len + 1]``, tokens then mask, for a
        folder with a loss mask; ``[len(rows), 3, seq_len + 1]`` with document ids, for
        ``documents="separate"``). Reads only those rows' windows from the memory map."""
        picked = self.windows_of(index)[_row_indices(rows, self.batch_size)]
        return self._read("train", picked)

    def batches(self, start: int = 0, rows: slice = slice(None)) -> BatchStream:
        """``(index, batch(index, rows))`` for index = start, start + 1, ... forever, read ahead as
        ``loading`` says. Close it (``close()`` or ``with``) to stop its reader threads; an error in
        a reader is raised here, by ``next()``, at the batch that failed."""
        start = _check_int("start", start, 0)
        _row_indices(rows, self.batch_size)
        return BatchStream(lambda index: self.batch(index, rows), start, self.loading)

    def validation(self, rows: slice = slice(None)) -> list[np.ndarray]:
        """The ``val_batches`` validation batches, rows ``rows`` of each: int32
        ``[len(rows), seq_len + 1]`` (``[len(rows), 2, seq_len + 1]`` with a loss mask,
        ``[len(rows), 3, seq_len + 1]`` with document ids too, as ``batch``). Batch
        ``v`` holds val.bin's windows ``v * batch_size`` to ``(v + 1) * batch_size - 1``, in
        order, the same every call."""
        picked = np.asarray(_row_indices(rows, self.batch_size), np.int64)
        return [self._read("val", v * self.batch_size + picked) for v in range(self.val_batches)]

    def _read(self, split: str, picked) -> np.ndarray:
        """Windows ``picked`` of ``split`` as int32 ``[rows, seq_len + 1]``, with their mask
        ``[rows, 2, seq_len + 1]``, or with their mask and document ids ``[rows, 3, seq_len +
        1]`` (``documents="separate"``; the mask all 1 for a folder without one). A mask byte
        other than 0 or 1 (a damaged file: values are not checked when the folder is opened) is
        a ValueError here, before it can train."""
        windows, masks = (
            (self._train, self._train_mask) if split == "train" else (self._val, self._val_mask)
        )
        tokens = windows[picked].astype(np.int32)
        if not self.loss_mask:
            return tokens
        if masks is None:
            mask = np.ones_like(tokens)
        else:
            mask = masks[picked]
            if mask.size and mask.max() > 1:
                raise ValueError(
                    f"{split}.mask in {str(self.path)!r} holds the value {int(mask.max())} where "
                    "a loss mask holds only 0 and 1: the file is damaged; tokenize the folder "
                    "again"
                )
        channels = [tokens, mask.astype(np.int32)]
        if self._starts is not None:
            channels.append(self._document_ids(split, np.asarray(picked)))
        return np.stack(channels, axis=1)

    def _document_ids(self, split: str, picked: np.ndarray) -> np.ndarray:
        """int32 ``[rows, seq_len + 1]``: each token's document within its window, 0 for the
        window's first (the document it starts in) and one more at each document start."""
        first = picked.astype(np.int64) * self.seq_len
        tokens = first[:, None] + np.arange(self.seq_len + 1)
        # The document of each token: the last start at or before it.
        document = np.searchsorted(self._starts[split], tokens, side="right")
        return (document - document[:, :1]).astype(np.int32)

    def process_rows(self, process_index: int, process_count: int) -> slice:
        """The contiguous rows of each global batch that process ``process_index`` of
        ``process_count`` reads: ``slice(p * B / P, (p + 1) * B / P)``. ValueError unless
        ``process_count`` divides B."""
        process_count = _check_int("process_count", process_count, 1)
        process_index = _check_int("process_index", process_index, 0)
        if process_index >= process_count:
            raise ValueError(
                f"process_index {process_index} is not below process_count {process_count}"
            )
        if self.batch_size % process_count:
            raise ValueError(
                f"batch {self.batch_size} does not split evenly over {process_count} processes"
            )
        share = self.batch_size // process_count
        return slice(process_index * share, (process_index + 1) * share)

    def position(self, next_index: int) -> dict[str, int]:
        """Where a run stands, as a JSON-serialisable dict: the next global batch it will read, and
        what identifies this order of batches (batch size, seq_len, seed, records). ``epoch`` is
        informative."""
        next_index = _check_int("next_index", next_index, 0)
        return {
            "next_batch": next_index,
            "epoch": next_index // self.batches_per_epoch,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "seed": self.seed,
            "records": self.records,
        }

    def resume(self, position: dict[str, Any]) -> int:
        """The next batch index of a saved ``position(...)``, after checking that it describes this
        dataset's order of batches: ValueError naming every field that differs (saved vs now)."""
        if not isinstance(position, dict):
            raise ValueError(
                f"a data position is a dict from position(), got {type(position).__name__}"
            )
        fields = ("next_batch", "batch_size", "seq_len", "seed", "records")
        missing = [name for name in fields if name not in position]
        if missing:
            raise ValueError(f"data position {position!r} lacks field(s) {', '.join(missing)}")
        mine = self.position(0)
        differ = {
            name: (position[name], mine[name])
            for name in fields[1:]
            if position[name] != mine[name]
        }
        if differ:
            raise DataPositionMismatch(
                f"the data position does not belong to this dataset ({str(self.path)!r}): "
                + "; ".join(
                    f"{name} {saved!r} (saved) != {now!r} (this dataset)"
                    for name, (saved, now) in differ.items()
                ),
                differ,
            )
        return _check_int("next_batch", position["next_batch"], 0)

    def __repr__(self) -> str:
        return (
            f"WindowDataset(path={str(self.path)!r}, records={self.records}, batch_size="
            f"{self.batch_size}, seq_len={self.seq_len}, "
            f"batches_per_epoch={self.batches_per_epoch}, seed={self.seed})"
        )
