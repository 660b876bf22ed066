"""dew.data: the byte tokenizer, the token folder, the example corpus, windows, order, loading,
resume."""

import json
import threading
from pathlib import Path

import numpy as np
import pytest

from dew.data import (
    BatchStream,
    ByteTokenizer,
    Loading,
    TokenWindows,
    WindowDataset,
    read_meta,
    write_example_corpus,
    write_token_folder,
)


def _numbered_folder(path, train_tokens, val_tokens=0):
    """A token folder whose token at position i of train.bin is i (and 100000 + i in val.bin), so a
    window's values say exactly where it was read from."""
    train = np.arange(train_tokens)
    val = 100_000 + np.arange(val_tokens)
    write_token_folder(path, train, val, vocab_size=200_000)
    return train, val


def _reader_threads():
    return [t for t in threading.enumerate() if t.name.startswith("dew-data-reader")]


# --- tokenizer ---------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "the cat sees the ball.\n", "naïve café — 東京 🌧"])
def test_byte_tokenizer_round_trip(text):
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(isinstance(i, int) and 0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(np.asarray(ids, np.int32)) == text
    assert tokenizer.vocab_size == 256


def test_byte_tokenizer_decode_replaces_broken_utf8_and_rejects_out_of_range_ids():
    tokenizer = ByteTokenizer()
    cut = tokenizer.encode("é")[:1]  # half of a two-byte character
    assert tokenizer.decode(cut + tokenizer.encode("x")) == "\ufffdx"
    with pytest.raises(ValueError, match="256"):
        tokenizer.decode([65, 256])
    with pytest.raises(ValueError, match="-1"):
        tokenizer.decode([-1])


# --- the token folder --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "vocab_size, dtype", [(256, "uint8"), (257, "uint16"), (65536, "uint16"), (65537, "uint32")]
)
def test_write_token_folder_picks_smallest_dtype_little_endian(tmp_path, vocab_size, dtype):
    train = [0, 1, vocab_size - 1, 7, 3]
    meta = write_token_folder(
        tmp_path / "tok", train, [vocab_size - 1], vocab_size=vocab_size, eos_id=3
    )
    assert meta.dtype == dtype
    saved = json.loads((tmp_path / "tok" / "meta.json").read_text())
    assert saved == {
        "tokenizer": "byte",
        "vocab_size": vocab_size,
        "dtype": dtype,
        "train_tokens": 5,
        "val_tokens": 1,
        "eos_id": 3,
        "version": 2,  # the format's version (docs/data.md); 1 had no field
    }
    raw = (tmp_path / "tok" / "train.bin").read_bytes()
    assert raw == np.asarray(train, np.dtype(dtype).newbyteorder("<")).tobytes()
    assert sorted(p.name for p in (tmp_path / "tok").iterdir()) == [
        "meta.json",
        "train.bin",
        "val.bin",
    ]
    assert read_meta(tmp_path / "tok") == meta


def test_write_token_folder_rejects_bad_ids_and_keeps_existing_folders(tmp_path):
    with pytest.raises(ValueError, match=r"300.*vocab_size=256"):
        write_token_folder(tmp_path / "a", [1, 300], [])
    with pytest.raises(ValueError, match="-2"):
        write_token_folder(tmp_path / "a", [1], [-2])
    with pytest.raises(ValueError, match="float"):
        write_token_folder(tmp_path / "a", [1.5], [])
    with pytest.raises(ValueError, match="eos_id"):
        write_token_folder(tmp_path / "a", [1], [], eos_id=256)
    assert not (tmp_path / "a" / "meta.json").exists()

    write_token_folder(tmp_path / "b", [1, 2, 3], [4])
    with pytest.raises(FileExistsError, match="overwrite"):
        write_token_folder(tmp_path / "b", [9], [9])
    assert (tmp_path / "b" / "train.bin").read_bytes() == bytes([1, 2, 3])
    meta = write_token_folder(tmp_path / "b", [9], [9], overwrite=True)
    assert meta.train_tokens == 1 and (tmp_path / "b" / "train.bin").read_bytes() == bytes([9])


def test_read_meta_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        read_meta(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="meta.json"):
        read_meta(tmp_path / "empty")

    folder = tmp_path / "tok"
    write_token_folder(folder, list(range(100)), list(range(10)))
    good = json.loads((folder / "meta.json").read_text())

    def broken(**changes):
        (folder / "meta.json").write_text(json.dumps({**good, **changes}))
        return folder

    with pytest.raises(ValueError, match=r"train_tokens = 120.*holds 100 bytes"):
        read_meta(broken(train_tokens=120))
    with pytest.raises(ValueError, match=r"val_tokens = 9.*holds 10 bytes"):
        read_meta(broken(val_tokens=9))
    with pytest.raises(ValueError, match=r"unknown dtype 'float16'.*uint8, uint16, uint32"):
        read_meta(broken(dtype="float16"))
    with pytest.raises(ValueError, match="vocab_size 300 does not fit dtype uint8"):
        read_meta(broken(vocab_size=300))
    with pytest.raises(ValueError, match="eos_id"):
        read_meta(broken(eos_id=256))
    with pytest.raises(ValueError, match="train_tokens must be an integer"):
        read_meta(broken(train_tokens="100"))
    (folder / "meta.json").write_text(json.dumps({k: v for k, v in good.items() if k != "dtype"}))
    with pytest.raises(ValueError, match="lacks field.*dtype"):
        read_meta(folder)
    (folder / "meta.json").write_text('{"tokenizer": "byte",')
    with pytest.raises(ValueError, match="not valid JSON"):
        read_meta(folder)
    broken()  # valid again
    (folder / "val.bin").unlink()
    with pytest.raises(FileNotFoundError, match="val.bin"):
        read_meta(folder)


# --- the example corpus ------------------------------------------------------------------------


def _notebook_corpus(data_dir: Path):
    """The data cell of the user's example notebook (kept outside the repository), copied here as
    it is written there: this test needs no file beside the repository."""
    rng = np.random.default_rng(0)
    subjects = ["the cat", "a dog", "the bird", "my friend", "the child"]
    verbs = ["sees", "likes", "finds", "wants", "hears"]
    objects = ["the ball", "a tree", "the river", "some food", "the moon"]
    text = "".join(
        f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}.\n" for _ in range(4000)
    )
    data_dir.mkdir(parents=True, exist_ok=True)
    ids = np.asarray(ByteTokenizer().encode(text), np.uint8)
    val_len = len(ids) // 50
    ids[:val_len].tofile(data_dir / "val.bin")
    ids[val_len:].tofile(data_dir / "train.bin")
    (data_dir / "meta.json").write_text(
        json.dumps(
            {
                "tokenizer": "byte",
                "vocab_size": 256,
                "dtype": "uint8",
                "train_tokens": len(ids) - val_len,
                "val_tokens": val_len,
                "eos_id": None,
            }
        )
    )


def test_notebook_corpus_has_2987_training_windows(tmp_path):
    _notebook_corpus(tmp_path / "data" / "07-tokens")
    data = TokenWindows(
        path=str(tmp_path / "data" / "07-tokens"),
        seq_len=32,
        val_batches=2,
        loading=Loading(workers=0, threads=1, read_buffer=2),
    ).load(batch=16)
    assert data.records == 2987
    assert data.records == (read_meta(data.path).train_tokens - 32 - 1) // 32 + 1
    assert data.batches_per_epoch == 2987 // 16
    assert (data.batch_size, data.seq_len, data.vocab_size, data.seed) == (16, 32, 256, 0)
    assert [v.shape for v in data.validation()] == [(16, 33), (16, 33)]


def test_example_corpus_is_the_notebooks_and_is_not_rewritten(tmp_path):
    _notebook_corpus(tmp_path / "notebook")
    meta = write_example_corpus(tmp_path / "example")
    for name in ("train.bin", "val.bin"):
        assert (tmp_path / "example" / name).read_bytes() == (
            tmp_path / "notebook" / name
        ).read_bytes()
    # The notebook writes a version-1 meta.json by hand (no "version"); Dew writes version 2.
    notebook = json.loads((tmp_path / "notebook" / "meta.json").read_text())
    assert meta.to_json() == {**notebook, "version": 2}
    assert read_meta(tmp_path / "notebook").version == 1
    text = ByteTokenizer().decode(np.fromfile(tmp_path / "example" / "train.bin", np.uint8))
    assert text.endswith(".\n") and " sees " in text

    # The same corpus again: nothing written. Another corpus: refused unless overwrite.
    before = (tmp_path / "example" / "meta.json").stat().st_mtime_ns
    write_example_corpus(tmp_path / "example")
    assert (tmp_path / "example" / "meta.json").stat().st_mtime_ns == before
    with pytest.raises(FileExistsError):
        write_example_corpus(tmp_path / "example", seed=1)
    other = write_example_corpus(tmp_path / "example", seed=1, sentences=100, overwrite=True)
    assert other.train_tokens + other.val_tokens < meta.train_tokens


# --- windows -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tokens, seq_len", [(9, 8), (16, 8), (17, 8), (24, 8), (25, 8), (100, 1), (101, 7)]
)
def test_record_count_formula_and_window_slices(tmp_path, tokens, seq_len):
    train, _ = _numbered_folder(tmp_path / "tok", tokens)
    data = TokenWindows(tmp_path / "tok", seq_len=seq_len).load(batch=1)
    starts = [s for s in range(0, tokens, seq_len) if s + seq_len + 1 <= tokens]
    assert data.records == len(starts) == (tokens - seq_len - 1) // seq_len + 1
    seen = {}
    for k in range(data.batches_per_epoch):
        (window,) = data.windows_of(k)
        row = data.batch(k)[0]
        assert row.dtype == np.int32 and row.shape == (seq_len + 1,)
        np.testing.assert_array_equal(row, train[window * seq_len : window * seq_len + seq_len + 1])
        seen[int(window)] = row
    for w in range(data.records - 1):  # neighbours share one token: a target becomes the next input
        assert seen[w][-1] == seen[w + 1][0]


def test_order_is_a_permutation_per_epoch_deterministic_and_reshuffled(tmp_path):
    _numbered_folder(tmp_path / "tok", 8 * 40 + 1)  # 40 windows of seq_len 8
    data = TokenWindows(tmp_path / "tok", seq_len=8, seed=3).load(batch=6)
    assert (data.records, data.batches_per_epoch) == (40, 6)

    def epoch(dataset, e):
        return np.concatenate(
            [
                dataset.windows_of(e * dataset.batches_per_epoch + j)
                for j in range(dataset.batches_per_epoch)
            ]
        )

    e0, e1 = epoch(data, 0), epoch(data, 1)
    for e in (e0, e1):
        assert len(e) == 36 and len(set(e.tolist())) == 36 and set(e.tolist()) <= set(range(40))
    np.testing.assert_array_equal(np.sort(data.order(0)), np.arange(40))
    assert not np.array_equal(e0, e1)
    assert not np.array_equal(e0, np.arange(36))  # shuffled, not file order

    again = TokenWindows(tmp_path / "tok", seq_len=8, seed=3).load(batch=6)
    np.testing.assert_array_equal(epoch(again, 0), e0)
    np.testing.assert_array_equal(again.batch(9), data.batch(9))
    other = TokenWindows(tmp_path / "tok", seq_len=8, seed=4).load(batch=6)
    assert not np.array_equal(epoch(other, 0), e0)
    # Global batch k of epoch 1 is read from epoch 1's order, whatever was read before.
    np.testing.assert_array_equal(again.windows_of(6), data.order(1)[:6])


def test_batch_rows_are_slices_of_the_whole_batch(tmp_path):
    _numbered_folder(tmp_path / "tok", 8 * 40 + 1)
    data = TokenWindows(tmp_path / "tok", seq_len=8).load(batch=8)
    for k in (0, 3, 11):
        whole = data.batch(k)
        assert whole.shape == (8, 9)
        parts = [data.batch(k, data.process_rows(p, 4)) for p in range(4)]
        assert [p.shape for p in parts] == [(2, 9)] * 4
        np.testing.assert_array_equal(np.concatenate(parts), whole)
        np.testing.assert_array_equal(data.batch(k, slice(1, 8, 3)), whole[1:8:3])
    with pytest.raises(ValueError, match="batch 8 does not split evenly over 3 processes"):
        data.process_rows(0, 3)
    with pytest.raises(ValueError, match="rows must be a slice"):
        data.batch(0, rows=[0, 1])


# --- background reading ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "loading",
    [
        Loading(threads=0),
        Loading(threads=1, read_buffer=1),
        Loading(threads=3, read_buffer=4),
        Loading(workers=2, threads=0),
    ],
)
def test_batches_yield_what_batch_reads_and_close_their_threads(tmp_path, loading):
    _numbered_folder(tmp_path / "tok", 8 * 40 + 1)
    data = TokenWindows(tmp_path / "tok", seq_len=8, loading=loading).load(batch=8)
    rows = slice(2, 6)
    with data.batches(start=3, rows=rows) as stream:  # 5 batches an epoch: 3..14 crosses two epochs
        got = [next(stream) for _ in range(12)]
        assert stream.alive_threads == loading.readers
    assert [index for index, _ in got] == list(range(3, 15))
    for index, array in got:
        np.testing.assert_array_equal(array, data.batch(index, rows))
    assert stream.alive_threads == 0 and not _reader_threads()
    with pytest.raises(StopIteration):
        next(stream)


class _ParkingCondition(threading.Condition):
    """A Condition that knows which threads wait in it and have not been notified since, and tells
    `observer` each time one starts waiting.

    When every reader is parked here and the consumer does nothing, nothing can wake them: no reader
    is running to notify. So "all parked" is a stable state to check the reads in, with no timing.
    """

    def __init__(self):
        super().__init__()
        self.parked: set[int] = set()
        self.observer = threading.Condition()

    def wait(self, timeout=None):
        self.parked.add(threading.get_ident())
        with self.observer:
            self.observer.notify_all()
        return super().wait(timeout)

    def notify(self, n=1):
        # notify_all() calls notify(); BatchStream wakes every waiter at once, so all are unparked.
        self.parked.clear()
        super().notify(n)


@pytest.fixture
def parking(monkeypatch):
    """Every BatchStream made in the test uses a _ParkingCondition (as `stream._shared.cond`);
    returns the list of the streams' shared states, each added before its readers start."""
    from dew.data import loading as loading_module

    made = []

    class Shared(loading_module._Shared):
        def __init__(self, start, depth):
            super().__init__(start, depth)
            self.cond = _ParkingCondition()
            made.append(self)

    monkeypatch.setattr(loading_module, "_Shared", Shared)
    return made


@pytest.mark.parametrize("loading", [Loading(threads=0), Loading(threads=2, read_buffer=3)])
def test_a_reader_error_reaches_the_consumer(tmp_path, loading, parking):
    _numbered_folder(tmp_path / "tok", 8 * 40 + 1)
    data = TokenWindows(tmp_path / "tok", seq_len=8, loading=loading).load(batch=4)
    read = data.batch

    def failing(index, rows=slice(None)):
        if index == 3 and loading.readers:
            # Batch 3 is read only once batch 4's error is in and the consumer, waiting for
            # batch 3, has seen it and waits on: the error must not overtake the batch before it.
            (shared,) = parking
            with shared.cond.observer:
                seen = shared.cond.observer.wait_for(
                    lambda: shared.error is not None and consumer.ident in shared.cond.parked,
                    timeout=60,
                )
            if not seen:
                raise AssertionError("the consumer did not wait for batch 3 after batch 4 failed")
        if index == 4:
            raise OSError(f"disk gone at batch {index}")
        return read(index, rows)

    data.batch = failing
    delivered, raised = [], []

    def consume():  # in a thread with a deadline: a swallowed error would otherwise hang the suite
        try:
            for index, array in stream:
                delivered.append(index)
                np.testing.assert_array_equal(array, read(index))
        except OSError as error:
            raised.append(error)

    consumer = threading.Thread(target=consume)  # its ident is None until it starts
    stream = data.batches(start=1)
    consumer.start()
    consumer.join(timeout=60)
    if consumer.is_alive():
        stream.close()
        pytest.fail("the consumer is still waiting: the reader's error never reached it")
    assert [str(e) for e in raised] == ["disk gone at batch 4"]
    assert delivered == [1, 2, 3]  # the batches before the failing one still arrive, in order
    assert stream.alive_threads == 0 and not _reader_threads()


def test_readers_fill_the_read_buffer_and_no_more(parking):
    read, lock = [], threading.Lock()

    def record(index):
        with lock:
            read.append(index)
        return index

    def reads_once_every_reader_parks(stream):
        """The indices read by the time every reader waits, un-notified, for room in the buffer."""
        cond = stream._shared.cond
        readers = {thread.ident for thread in stream._threads}
        with cond.observer:
            if not cond.observer.wait_for(lambda: readers <= cond.parked, timeout=60):
                with lock:
                    count, last = len(read), max(read, default=None)
                pytest.fail(
                    f"the readers never all waited: they read {count} batches, up to {last}"
                )
        with lock:
            return sorted(read)

    with BatchStream(record, start=10, loading=Loading(threads=3, read_buffer=4)) as stream:
        assert reads_once_every_reader_parks(stream) == [10, 11, 12, 13]
        assert [next(stream) for _ in range(3)] == [(10, 10), (11, 11), (12, 12)]
        assert reads_once_every_reader_parks(stream) == list(range(10, 17))


def test_an_abandoned_stream_does_not_block_and_can_close_later(tmp_path):
    _numbered_folder(tmp_path / "tok", 8 * 40 + 1)
    data = TokenWindows(
        tmp_path / "tok", seq_len=8, loading=Loading(threads=2, read_buffer=2)
    ).load(batch=4)
    stream = data.batches()
    next(stream)
    stream.close()
    stream.close()
    assert stream.alive_threads == 0 and not _reader_threads()


# --- validation --------------------------------------------------------------------------------


def test_validation_reads_val_windows_in_order(tmp_path):
    _, val = _numbered_folder(tmp_path / "tok", 8 * 40 + 1, val_tokens=8 * 7 + 1)  # 7 val windows
    data = TokenWindows(tmp_path / "tok", seq_len=8, val_batches=3).load(batch=2)
    batches = data.validation()
    assert len(batches) == 3
    for v, array in enumerate(batches):
        assert array.dtype == np.int32 and array.shape == (2, 9)
        for r in range(2):
            w = 2 * v + r
            np.testing.assert_array_equal(array[r], val[w * 8 : w * 8 + 9])
    np.testing.assert_array_equal(data.validation(rows=slice(1, 2))[2], batches[2][1:])
    for a, b in zip(data.validation(), batches):  # the same every call
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match=r"val_batches 4 x batch 2 needs 8 windows.*holds 7"):
        TokenWindows(tmp_path / "tok", seq_len=8, val_batches=4).load(batch=2)
    assert TokenWindows(tmp_path / "tok", seq_len=8).load(batch=2).validation() == []


# --- positions -----------------------------------------------------------------------------------


def test_position_round_trip_and_mismatches(tmp_path):
    _numbered_folder(tmp_path / "tok", 8 * 40 + 1)
    _numbered_folder(tmp_path / "longer", 8 * 41 + 1)
    data = TokenWindows(tmp_path / "tok", seq_len=8, seed=5).load(batch=4)
    saved = json.loads(json.dumps(data.position(23)))
    assert saved["next_batch"] == 23 and saved["epoch"] == 2
    reopened = TokenWindows(tmp_path / "tok", seq_len=8, seed=5).load(batch=4)
    nxt = reopened.resume(saved)
    assert nxt == 23
    np.testing.assert_array_equal(reopened.batch(nxt), data.batch(23))

    cases = [
        (TokenWindows(tmp_path / "tok", seq_len=8, seed=5).load(batch=8), r"batch_size 4 .*!= 8"),
        (TokenWindows(tmp_path / "tok", seq_len=8, seed=6).load(batch=4), r"seed 5 .*!= 6"),
        (
            TokenWindows(tmp_path / "tok", seq_len=4, seed=5).load(batch=4),
            r"seq_len 8 .*!= 4.*records 40 .*!= 80",
        ),
        (TokenWindows(tmp_path / "longer", seq_len=8, seed=5).load(batch=4), r"records 40 .*!= 41"),
    ]
    for other, message in cases:
        with pytest.raises(ValueError, match=message):
            other.resume(saved)
    with pytest.raises(ValueError, match="lacks field.*seed"):
        data.resume({k: v for k, v in saved.items() if k != "seed"})
    with pytest.raises(ValueError, match="next_batch"):
        data.resume({**saved, "next_batch": -1})


# --- bad input -----------------------------------------------------------------------------------


def test_bad_inputs_name_their_values(tmp_path):
    _numbered_folder(tmp_path / "tok", 8 * 40 + 1)
    with pytest.raises(ValueError, match="seq_len must be an integer >= 1, got 0"):
        TokenWindows(tmp_path / "tok", seq_len=0)
    with pytest.raises(ValueError, match="val_batches must be an integer >= 0, got -1"):
        TokenWindows(tmp_path / "tok", seq_len=8, val_batches=-1)
    with pytest.raises(ValueError, match="seed"):
        TokenWindows(tmp_path / "tok", seq_len=8, seed=-3)
    with pytest.raises(ValueError, match="batch must be an integer >= 1, got 0"):
        TokenWindows(tmp_path / "tok", seq_len=8).load(batch=0)
    with pytest.raises(ValueError, match="batch 41 is larger than the 40 training windows"):
        TokenWindows(tmp_path / "tok", seq_len=8).load(batch=41)
    with pytest.raises(
        ValueError, match="holds 321 tokens, fewer than one window of seq_len \\+ 1 = 401"
    ):
        TokenWindows(tmp_path / "tok", seq_len=400).load(batch=1)
    with pytest.raises(FileNotFoundError, match="missing"):
        TokenWindows(tmp_path / "missing", seq_len=8).load(batch=1)
    for name in ("workers", "threads", "read_buffer"):
        with pytest.raises(ValueError, match=f"Loading.{name} must be an integer >= 0, got -1"):
            Loading(**{name: -1})
    with pytest.raises(ValueError, match="read_buffer must be >= 1"):
        Loading(threads=1, read_buffer=0)
    Loading(threads=0, read_buffer=0)  # nothing reads ahead: no buffer needed
    data = TokenWindows(tmp_path / "tok", seq_len=8).load(batch=4)
    assert isinstance(data, WindowDataset)
    with pytest.raises(ValueError, match="batch index must be an integer >= 0, got -1"):
        data.batch(-1)
    with pytest.raises(ValueError, match="start must be an integer >= 0, got -2"):
        data.batches(start=-2)


# --- the loss mask ------------------------------------------------------------------------------


def _masked_folder(path, seed, train_tokens=100, val_tokens=70):
    """A folder of numbered tokens (``_numbered_folder``'s) with a random loss mask."""
    rng = np.random.default_rng(seed)
    train, val = np.arange(train_tokens), 100_000 + np.arange(val_tokens)
    masks = (rng.integers(0, 2, train_tokens), rng.integers(0, 2, val_tokens))
    write_token_folder(path, train, val, vocab_size=200_000, train_mask=masks[0], val_mask=masks[1])
    return masks


def test_a_masked_folder_gives_each_window_its_mask(tmp_path, seed):
    train_mask, val_mask = _masked_folder(tmp_path, seed)
    meta = read_meta(tmp_path)
    assert meta.loss_mask and meta.to_json()["loss_mask"] is True
    data = TokenWindows(tmp_path, seq_len=8, val_batches=2, loading=Loading(threads=0)).load(4)
    assert data.loss_mask
    batch = data.batch(3)
    assert batch.shape == (4, 2, 9) and batch.dtype == np.int32
    for row in batch:
        start = int(row[0, 0])  # the token at position i is i
        np.testing.assert_array_equal(row[0], np.arange(start, start + 9))
        np.testing.assert_array_equal(row[1], train_mask[start : start + 9], err_msg=f"seed {seed}")
    for v, rows in enumerate(data.validation(rows=slice(1, 3))):
        for r, row in zip((1, 2), rows):
            start = (v * 4 + r) * 8
            np.testing.assert_array_equal(row[1], val_mask[start : start + 9])
    # A folder without a mask still reads [rows, seq_len + 1].
    _numbered_folder(tmp_path / "plain", 100)
    plain = TokenWindows(tmp_path / "plain", seq_len=8).load(4)
    assert not plain.loss_mask and plain.batch(0).shape == (4, 9)


def test_a_damaged_or_stray_mask_is_refused(tmp_path, seed):
    _masked_folder(tmp_path / "f", seed)
    folder = tmp_path / "f"
    (folder / "val.mask").rename(folder / "gone")
    with pytest.raises(FileNotFoundError, match="has no val.mask"):
        read_meta(folder)
    (folder / "gone").rename(folder / "val.mask")
    with open(folder / "train.mask", "ab") as file:
        file.write(b"\x01")
    with pytest.raises(
        ValueError, match=r"train_tokens = 100 \(100 bytes of uint8\) but train.mask"
    ):
        read_meta(folder)
    data = (folder / "train.mask").read_bytes()
    (folder / "train.mask").write_bytes(data[:50] + b"\x07" + data[51:-1])  # a damaged byte
    windows = TokenWindows(folder, seq_len=8, loading=Loading(threads=0)).load(12)
    with pytest.raises(ValueError, match="train.mask .* holds the value 7"):
        windows.batch(0)
    meta = json.loads((folder / "meta.json").read_text())
    meta["loss_mask"] = "yes"
    (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="loss_mask must be true or false, got 'yes'"):
        read_meta(folder)
    del meta["loss_mask"]  # the mask files stay: never silently ignored
    (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match='holds train.mask, val.mask but meta.json has no "loss'):
        read_meta(folder)


def test_masks_are_checked_when_written_and_an_overwrite_drops_the_old_mask(tmp_path):
    with pytest.raises(ValueError, match="only 0 and 1"):
        write_token_folder(tmp_path, [1, 2], [], train_mask=[0, 2], val_mask=[])
    with pytest.raises(ValueError, match=r"one 0 or 1 per token \(2\), got shape \(3,\)"):
        write_token_folder(tmp_path, [1, 2], [], train_mask=[0, 1, 1], val_mask=[])
    with pytest.raises(ValueError, match="both train_mask and val_mask"):
        write_token_folder(tmp_path, [1, 2], [], train_mask=[0, 1])
    assert not list(tmp_path.iterdir())
    write_token_folder(tmp_path, [1, 2], [3], train_mask=[0, 1], val_mask=[1])
    assert read_meta(tmp_path).loss_mask
    write_token_folder(tmp_path, [1, 2, 3], [], overwrite=True)
    assert not read_meta(tmp_path).loss_mask
    assert sorted(p.name for p in tmp_path.iterdir()) == ["meta.json", "train.bin", "val.bin"]
