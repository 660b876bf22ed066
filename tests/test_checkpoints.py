"""Dew checkpoints: format, background writer, resharding loader, crash safety, damage detection."""

import dataclasses
import errno
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import warnings
import zipfile
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dew.checkpoints import (
    CheckpointError,
    CheckpointMismatchError,
    Checkpoints,
    CorruptCheckpointError,
    NotACheckpointError,
    npz,
    reader,
)

AXES = ("data", "expert", "fsdp", "tensor", "sequence", "stage")
REPO = Path(__file__).resolve().parents[1]


def mesh(data: int, fsdp: int) -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(data, 1, fsdp, 1, 1, 1), AXES)


MESHES = {"data8": (8, 1), "fsdp8": (1, 8), "data2_fsdp4": (2, 4), "data4_fsdp2": (4, 2)}


class AdamLike(NamedTuple):
    count: object
    mu: object
    nu: object


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class State:
    step: object
    params: dict
    opt: tuple
    ema: dict
    key_data: object


PARAM_SHAPES = {"embed": (64, 16), "mlp": {"w": (16, 32), "b": (32,)}, "norm": (16,)}
SPLIT = {"embed", "w"}  # split over fsdp; the rest are replicated


def _spec(path) -> P:
    name = jax.tree_util.keystr(path[-1:]).strip("[]'")
    return P("fsdp") if name in SPLIT else P()


def host_state(seed: int = 0) -> State:
    """Distinct random values in every leaf, so a mix-up of two leaves cannot pass."""
    rng = np.random.default_rng(seed)
    params = jax.tree.map(
        lambda shape: rng.standard_normal(shape).astype(np.float32),
        PARAM_SHAPES,
        is_leaf=lambda x: isinstance(x, tuple),
    )
    like = lambda: jax.tree.map(lambda x: rng.standard_normal(x.shape).astype(np.float32), params)  # noqa: E731
    return State(
        step=np.array(20, np.int32),
        params=params,
        opt=(AdamLike(np.array(20, np.int32), like(), like()), ()),
        ema=like(),
        key_data=rng.integers(0, 2**32, size=(2,), dtype=np.uint32),
    )


def shardings_for(tree, m: Mesh):
    return jax.tree_util.tree_map_with_path(lambda path, _: NamedSharding(m, _spec(path)), tree)


def place(tree, m: Mesh):
    return jax.tree.map(jax.device_put, tree, shardings_for(tree, m))


def target_for(tree, m: Mesh):
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=s),
        tree,
        shardings_for(tree, m),
    )


def assert_bits_equal(restored, expected):
    got, want = jax.tree.leaves(restored), jax.tree.leaves(expected)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()


def index_of(step_dir: Path) -> dict:
    return json.loads((step_dir / "index.json").read_text())


# --- the reshard matrix -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_by_mesh(tmp_path_factory):
    """One checkpoint per mesh of the same state, written by Checkpoints.save."""
    state = host_state()
    out = {}
    for name, (data, fsdp) in MESHES.items():
        ckpt = Checkpoints(tmp_path_factory.mktemp(name))
        ckpt.save(20, place(state, mesh(data, fsdp)), metadata={"mesh": name, "data_position": 320})
        ckpt.wait()
        out[name] = ckpt
    return state, out


@pytest.mark.parametrize("saved_on", list(MESHES))
def test_reshard_matrix_restores_bit_for_bit_into_every_layout(saved_by_mesh, saved_on):
    state, checkpoints = saved_by_mesh
    ckpt = checkpoints[saved_on]
    for restore_on, (data, fsdp) in MESHES.items():
        m = mesh(data, fsdp)
        restored, metadata = ckpt.restore(target_for(state, m))
        assert metadata == {"mesh": saved_on, "data_position": 320}
        assert isinstance(restored, State) and isinstance(restored.opt[0], AdamLike)
        assert_bits_equal(restored, state)
        for leaf, sharding in zip(
            jax.tree.leaves(restored), jax.tree.leaves(shardings_for(state, m))
        ):
            assert leaf.sharding == sharding, (saved_on, restore_on)


def test_each_distinct_piece_is_written_once(saved_by_mesh):
    state, checkpoints = saved_by_mesh
    index = index_of(checkpoints["data2_fsdp4"].step_path(20))
    pieces = {array["path"]: array["pieces"] for array in index["arrays"]}
    assert len(pieces[".params['embed']"]) == 4  # fsdp 4, replicated over data 2: 4 pieces, not 8
    assert len(pieces[".params['norm']"]) == 1
    assert sorted(p["slice"][0] for p in pieces[".params['embed']"]) == [
        [0, 16],
        [16, 32],
        [32, 48],
        [48, 64],
    ]
    total = sum(p["nbytes"] for array in index["arrays"] for p in array["pieces"])
    assert total == sum(np.asarray(x).nbytes for x in jax.tree.leaves(state))
    # The index also records the tree it came from, and the format name and version.
    assert index["format"] == "dew-checkpoint" and index["version"] == 1 and index["step"] == 20
    assert "AdamLike" in index["treedef"] and "State" in index["treedef"]


def test_pieces_are_raw_bytes_at_the_recorded_offsets_of_a_plain_npz(saved_by_mesh):
    state, checkpoints = saved_by_mesh
    step_dir = checkpoints["fsdp8"].step_path(20)
    index = index_of(step_dir)
    data = (step_dir / "process_00000.npz").read_bytes()
    members = np.load(step_dir / "process_00000.npz", allow_pickle=False)
    assert zipfile.ZipFile(step_dir / "process_00000.npz").testzip() is None
    embed = next(a for a in index["arrays"] if a["path"] == ".params['embed']")
    for piece in embed["pieces"]:
        (a, b), _ = piece["slice"]
        expected = state.params["embed"][a:b]
        assert piece["offset"] % 64 == 0
        assert data[piece["offset"] : piece["offset"] + piece["nbytes"]] == expected.tobytes()
        assert np.array_equal(members[piece["member"].removesuffix(".npy")], expected)


def _zip64_fields(extra: bytes) -> tuple[int, ...] | None:
    """The 8-byte values of the ZIP64 record (header id 0x0001) in a ZIP extra field, or None."""
    position = 0
    while position + 4 <= len(extra):
        header_id, size = struct.unpack_from("<HH", extra, position)
        if header_id == 0x0001:
            return struct.unpack_from(f"<{size // 8}Q", extra, position + 4)
        position += 4 + size
    return None


def test_members_over_the_zip64_limit_get_zip64_records_and_restore_bit_for_bit(
    tmp_path, monkeypatch, seed
):
    """ZIP64 starts at 0xFFFFFFFF bytes; with the writer's limit lowered to 4096 bytes, a save of
    small arrays takes the same path: ZIP64 sizes for the members over the limit (local header and
    central directory), ZIP64 offsets for members that start past it, and the ZIP64 end records."""
    limit = 4096
    real_write = npz.write
    monkeypatch.setattr(
        npz, "write", lambda *args, **kwargs: real_write(*args, **kwargs, zip64_limit=limit)
    )
    rng = np.random.default_rng(seed)
    tree = {
        "a_small": rng.standard_normal(16).astype(np.float32),  # 64 bytes, first: no ZIP64 at all
        "b_big": rng.standard_normal((256, 32)).astype(np.float32),  # 4 pieces of 8 KiB: over it
        "c_small": rng.integers(0, 2**16, 8, dtype=np.uint16).view(ml_dtypes.bfloat16),
    }
    ckpt = Checkpoints(tmp_path)
    ckpt.save(
        1,
        {
            "a_small": tree["a_small"],
            "b_big": jax.device_put(tree["b_big"], NamedSharding(mesh(2, 4), P("fsdp"))),
            "c_small": tree["c_small"],
        },
    )
    ckpt.wait()
    path = ckpt.step_path(1) / "process_00000.npz"
    data = path.read_bytes()
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None, f"seed {seed}"
        infos = archive.infolist()
        assert len(infos) == 6, [info.filename for info in infos]  # 1 + 4 pieces of b_big + 1
        for info in infos:
            member_bytes = info.file_size
            over, past = member_bytes >= limit, info.header_offset >= limit
            central = _zip64_fields(info.extra)
            expected = (member_bytes, member_bytes) * over + (info.header_offset,) * past
            assert (central or ()) == expected, (info.filename, central, expected)
            local = struct.unpack_from("<IHHHHHIIIHH", data, info.header_offset)
            assert local[0] == 0x04034B50, info.filename
            name_length, extra_length = local[9], local[10]
            extra_start = info.header_offset + 30 + name_length
            local_zip64 = _zip64_fields(data[extra_start : extra_start + extra_length])
            if over:
                assert local[7] == local[8] == 0xFFFFFFFF, info.filename
                assert local_zip64 == (member_bytes, member_bytes), info.filename
            else:
                assert local[7] == local[8] == member_bytes and local_zip64 is None, info.filename
        assert any(info.file_size >= limit for info in infos)
        assert any(info.file_size < limit and info.header_offset >= limit for info in infos)
    # The end: ZIP64 end record, its locator, then the classic end record pointing to them.
    end = data[-22:]
    locator = data[-42:-22]
    assert end[:4] == b"PK\x05\x06" and struct.unpack_from("<I", end, 16)[0] == 0xFFFFFFFF
    assert locator[:4] == b"PK\x06\x07"
    zip64_end_offset = struct.unpack_from("<Q", locator, 8)[0]
    assert data[zip64_end_offset : zip64_end_offset + 4] == b"PK\x06\x06"
    count, _, directory_offset = struct.unpack_from("<QQQ", data, zip64_end_offset + 32)
    assert count == 6 and directory_offset >= limit
    # Every reader finds the same bytes: numpy through the ZIP structure, Dew through the index.
    members = np.load(path, allow_pickle=False)
    index = index_of(ckpt.step_path(1))
    for array in index["arrays"]:
        for piece in array["pieces"]:
            stored = members[piece["member"].removesuffix(".npy")]
            assert stored.tobytes() == data[piece["offset"] : piece["offset"] + piece["nbytes"]]
    target = {
        "a_small": np.zeros(16, np.float32),
        "b_big": jax.ShapeDtypeStruct(
            (256, 32), np.float32, sharding=NamedSharding(mesh(8, 1), P())
        ),
        "c_small": np.zeros(8, ml_dtypes.bfloat16),
    }
    restored, _ = ckpt.restore(target)
    for name, value in tree.items():
        assert np.asarray(restored[name]).tobytes() == value.tobytes(), (name, f"seed {seed}")


# --- dtypes -------------------------------------------------------------------------------------


def test_bfloat16_and_other_ml_dtypes_round_trip_as_raw_bits(tmp_path):
    rng = np.random.default_rng(1)
    bits16 = rng.integers(0, 2**16, size=(16, 8), dtype=np.uint16)
    bits16[0, :3] = [0x7FC1, 0xFF81, 0x8000]  # NaNs with payloads and -0.0 must survive bit for bit
    bits8 = rng.integers(0, 2**8, size=(16,), dtype=np.uint8)
    tree = {
        "bf16": bits16.view(ml_dtypes.bfloat16),
        "f8": bits8.view(ml_dtypes.float8_e4m3fn),
        "f8e5": bits8.view(ml_dtypes.float8_e5m2),
        "f16": bits16.view(np.float16),
        "i8": bits8.view(np.int8),
        "flag": np.array([True, False, True]),
        "c64": (rng.standard_normal(4) + 1j * rng.standard_normal(4)).astype(np.complex64),
    }
    m = mesh(1, 8)
    placed = {
        k: jax.device_put(v, NamedSharding(m, P("fsdp") if v.shape[0] % 8 == 0 else P()))
        for k, v in tree.items()
    }
    ckpt = Checkpoints(tmp_path)
    ckpt.save(1, placed)
    ckpt.wait()
    target = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh(8, 1), P()))
        for k, v in tree.items()
    }
    restored, _ = ckpt.restore(target)
    for name, value in tree.items():
        assert restored[name].dtype == value.dtype, name
        assert np.asarray(restored[name]).tobytes() == value.tobytes(), name
    arrays = {a["path"]: a for a in index_of(ckpt.step_path(1))["arrays"]}
    assert arrays["['bf16']"]["dtype"] == "bfloat16" and arrays["['bf16']"]["stored_as"] == "<u2"
    assert arrays["['f8']"]["dtype"] == "float8_e4m3fn" and arrays["['f8']"]["stored_as"] == "|u1"
    # Any npz reader sees the raw bits as unsigned integers.
    members = np.load(ckpt.step_path(1) / "process_00000.npz", allow_pickle=False)
    first = arrays["['bf16']"]["pieces"][0]
    assert members[first["member"][:-4]].dtype == np.uint16


def test_host_leaves_come_back_on_the_host(tmp_path):
    ckpt = Checkpoints(tmp_path)
    ckpt.save(3, {"count": 7, "rate": 0.5, "table": np.arange(6, dtype=np.int16).reshape(2, 3)})
    ckpt.wait()
    restored, _ = ckpt.restore({"count": 0, "rate": 0.0, "table": np.zeros((2, 3), np.int16)})
    assert restored["count"] == 7 and isinstance(restored["count"], int)
    assert restored["rate"] == 0.5
    assert isinstance(restored["table"], np.ndarray) and np.array_equal(
        restored["table"], np.arange(6).reshape(2, 3)
    )


def test_restore_into_concrete_arrays_uses_their_sharding(tmp_path):
    state = host_state()
    ckpt = Checkpoints(tmp_path)
    ckpt.save(1, place(state, mesh(8, 1)))
    ckpt.wait()
    fresh = place(host_state(seed=5), mesh(2, 4))
    restored, _ = ckpt.restore(fresh)
    assert_bits_equal(restored, state)
    assert restored.params["embed"].sharding == fresh.params["embed"].sharding


# --- reading only what is needed ----------------------------------------------------------------


class _CountingReads:
    def __init__(self, monkeypatch):
        self.bytes = 0
        real = os.preadv

        def preadv(fd, buffers, offset):
            count = real(fd, buffers, offset)
            self.bytes += count
            return count

        monkeypatch.setattr(os, "preadv", preadv)


def _one_array_checkpoint(tmp_path, spec, chunk_bytes=1024):
    values = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    ckpt = Checkpoints(tmp_path, chunk_bytes=chunk_bytes)
    ckpt.save(1, {"w": jax.device_put(values, NamedSharding(mesh(1, 8), spec))})
    ckpt.wait()
    step_dir = ckpt.step_path(1)
    return values, step_dir, reader.read_index(step_dir, 1)


def _assemble(step_dir, index, boxes):
    from concurrent.futures import ThreadPoolExecutor

    files = reader._Files(step_dir, index)
    try:
        with ThreadPoolExecutor(2) as pool:
            return reader._assemble(index.arrays[0], boxes, files, index.chunk_bytes, "test", pool)
    finally:
        files.close()


@pytest.mark.parametrize(
    "boxes",
    [
        [((16, 0), (24, 32))],  # what one of 8 fsdp devices needs: 1 KiB
        [
            ((0, 0), (8, 32)),
            ((56, 0), (64, 32)),
        ],  # two devices far apart (other processes own the middle)
    ],
)
def test_a_sharded_target_reads_only_its_byte_ranges_of_a_whole_saved_array(
    tmp_path, monkeypatch, boxes
):
    values, step_dir, index = _one_array_checkpoint(tmp_path, P())  # saved whole: one 8 KiB piece
    counter = _CountingReads(monkeypatch)
    out = _assemble(step_dir, index, boxes)
    for (start, stop), buffer in out.items():
        assert np.array_equal(buffer, values[start[0] : stop[0]])
    # each box's rows, widened to whole checksum chunks of 1 KiB
    assert counter.bytes <= len(boxes) * (1024 + 2 * index.chunk_bytes) < values.nbytes


@pytest.mark.parametrize(
    "saved_spec, boxes",
    [
        (P("fsdp"), [((0, 0), (64, 32))]),  # eight pieces into one replicated buffer
        (P(), [((8 * i, 0), (8 * i + 8, 32)) for i in range(8)]),  # one piece into eight row blocks
        (P("fsdp"), [((0, 4 * i), (64, 4 * i + 4)) for i in range(8)]),  # rows into column blocks
    ],
)
def test_each_piece_is_read_once_per_process(tmp_path, monkeypatch, saved_spec, boxes):
    values, step_dir, index = _one_array_checkpoint(tmp_path, saved_spec)
    counter = _CountingReads(monkeypatch)
    out = _assemble(step_dir, index, boxes)
    for (start, stop), buffer in out.items():
        assert np.array_equal(buffer, values[start[0] : stop[0], start[1] : stop[1]])
    assert counter.bytes == values.nbytes  # not once per device


@pytest.mark.parametrize(
    "saved_spec, target_spec", [(P("fsdp"), P(None, "fsdp")), (P(), P("fsdp"))]
)
def test_a_full_restore_reads_each_piece_once(tmp_path, monkeypatch, saved_spec, target_spec):
    values, step_dir, _ = _one_array_checkpoint(tmp_path, saved_spec)
    counter = _CountingReads(monkeypatch)
    target = {
        "w": jax.ShapeDtypeStruct(
            values.shape, values.dtype, sharding=NamedSharding(mesh(1, 8), target_spec)
        )
    }
    restored, _ = Checkpoints(step_dir.parent).restore(target)
    assert np.asarray(restored["w"]).tobytes() == values.tobytes()
    assert counter.bytes == values.nbytes


class LoaderHostMemory:
    """Peak numpy memory the loader holds beyond the restored arrays, measured with tracemalloc.

    The CPU backend may adopt a host buffer as a device buffer (zero copy): such buffers are the
    restored arrays, not overhead. Between two placements the adopted bytes are constant, so the
    overhead's peak in that interval is tracemalloc's peak minus them; reset_peak starts the next.
    """

    def __init__(self, monkeypatch):
        import threading
        import tracemalloc

        self.tracemalloc, self.lock, self.adopted, self.peak = tracemalloc, threading.Lock(), 0, 0
        real_place = reader._place

        def place(host, devices):
            placed = real_place(host, devices)
            with self.lock:
                self._close_interval()
                if any(array.unsafe_buffer_pointer() == host.ctypes.data for array in placed):
                    allocation = host
                    while (
                        allocation.base is not None
                    ):  # the whole allocation, alignment padding included
                        allocation = allocation.base
                    self.adopted += allocation.nbytes
            return placed

        monkeypatch.setattr(reader, "_place", place)

    def _close_interval(self):
        self.peak = max(self.peak, self.tracemalloc.get_traced_memory()[1] - self.adopted)
        self.tracemalloc.reset_peak()

    def __enter__(self):
        self.tracemalloc.start()
        return self

    def __exit__(self, *exc):
        self._close_interval()
        self.tracemalloc.stop()


@pytest.mark.parametrize("saved_spec, largest_piece", [(P(), 2 << 20), (P("fsdp"), 256 << 10)])
def test_restoring_a_sharded_state_holds_about_two_pieces_in_host_memory(
    tmp_path, monkeypatch, saved_spec, largest_piece
):
    rng = np.random.default_rng(0)
    state = {
        f"w{i}": rng.standard_normal((2048, 256)).astype(np.float32) for i in range(4)
    }  # 4 x 2 MiB
    ckpt = Checkpoints(tmp_path, read_workers=2)
    ckpt.save(
        1, {k: jax.device_put(v, NamedSharding(mesh(1, 8), saved_spec)) for k, v in state.items()}
    )
    ckpt.wait()
    assert (
        max(p["nbytes"] for a in index_of(ckpt.step_path(1))["arrays"] for p in a["pieces"])
        == largest_piece
    )
    target = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh(1, 8), P("fsdp")))
        for k, v in state.items()
    }
    with LoaderHostMemory(monkeypatch) as memory:
        restored, _ = ckpt.restore(target)
    assert_bits_equal(restored, state)
    assert memory.peak <= 2 * largest_piece + (256 << 10), (
        memory.peak,
        largest_piece,
    )  # plus ~100 KiB of bookkeeping


# --- retention, steps, latest -------------------------------------------------------------------


def test_keep_two_keeps_the_newest_two_steps(tmp_path):
    ckpt = Checkpoints(tmp_path / "run", keep=2)
    assert (
        ckpt.directory == (tmp_path / "run").absolute() and ckpt.latest is None and ckpt.steps == []
    )
    for step in (1, 2, 3, 4):
        ckpt.save(step, {"x": np.full(3, step, np.float32)})
        ckpt.wait()
    assert ckpt.steps == [3, 4] and ckpt.latest == 4
    assert sorted(os.listdir(ckpt.directory)) == ["step_00000003", "step_00000004"]
    restored, _ = ckpt.restore({"x": np.zeros(3, np.float32)}, step=3)
    assert restored["x"].tolist() == [3, 3, 3]
    # A save of an earlier step (a restart from it) is kept; the oldest other step goes.
    ckpt.save(2, {"x": np.full(3, 22, np.float32)})
    ckpt.wait()
    assert ckpt.steps == [2, 4]
    # Saving a step that exists replaces it.
    ckpt.save(4, {"x": np.full(3, 44, np.float32)})
    ckpt.wait()
    assert ckpt.steps == [2, 4]
    assert ckpt.restore({"x": np.zeros(3, np.float32)})[0]["x"].tolist() == [44, 44, 44]


def test_keep_none_keeps_every_step_and_keep_is_validated(tmp_path):
    ckpt = Checkpoints(tmp_path, keep=None)
    for step in (5, 6, 7):
        ckpt.save(step, {"x": np.zeros(1)})
    ckpt.wait()
    assert ckpt.steps == [5, 6, 7]
    with pytest.raises(ValueError, match=re.escape("keep (or None) must be an integer >= 1")):
        Checkpoints(tmp_path, keep=0)


def test_a_relative_directory_is_stored_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert Checkpoints("runs/a").directory == tmp_path / "runs" / "a"


# --- crash safety -------------------------------------------------------------------------------

_KILLED_SAVE = """
import os, sys, time
import numpy as np
from dew.checkpoints import Checkpoints, writer
ckpt = Checkpoints(sys.argv[1])
ckpt.save(1, {"a": np.full(1000, 1.0), "b": np.full(1000, 2.0)})
ckpt.wait()
def stall(member):
    print("wrote", member, flush=True)
    time.sleep(120)
writer.after_member_hook = stall
ckpt.save(2, {"a": np.full(1000, 3.0), "b": np.full(1000, 4.0)})
ckpt.wait()
print("not killed", flush=True)
"""


def test_a_save_killed_mid_write_leaves_the_previous_step_loadable(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    process = subprocess.Popen(
        [sys.executable, "-c", _KILLED_SAVE, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = process.stdout.readline()  # the background write is now between two members
        assert line.startswith("wrote a000000"), line
        assert (tmp_path / "step_00000002.tmp" / "process_00000.npz").exists()
        process.send_signal(signal.SIGKILL)
    finally:
        process.kill()
        process.wait(timeout=60)
    ckpt = Checkpoints(tmp_path)
    assert ckpt.steps == [1] and ckpt.latest == 1
    target = {"a": np.zeros(1000), "b": np.zeros(1000)}
    restored, _ = ckpt.restore(target)
    assert (restored["a"] == 1.0).all() and (restored["b"] == 2.0).all()
    assert (tmp_path / "step_00000002.tmp").exists()
    ckpt.save(3, {"a": np.full(1000, 5.0), "b": np.full(1000, 6.0)})
    ckpt.wait()
    assert sorted(os.listdir(tmp_path)) == ["step_00000001", "step_00000003"]  # leftover cleaned


def test_a_step_caught_between_the_two_renames_of_a_replacement_is_recovered(tmp_path):
    ckpt = Checkpoints(tmp_path, keep=None)
    ckpt.save(1, {"x": np.ones(2)})
    ckpt.wait()
    os.rename(
        ckpt.step_path(1), tmp_path / "step_00000001.replaced"
    )  # killed before the new one landed
    assert ckpt.steps == []
    ckpt.save(2, {"x": np.ones(2)})
    ckpt.wait()
    assert ckpt.steps == [1, 2]


def test_a_failed_background_write_surfaces_at_wait_and_leaves_no_step(tmp_path, monkeypatch):
    ckpt = Checkpoints(tmp_path)
    ckpt.save(1, {"x": np.ones(4)})
    ckpt.wait()

    def disk_full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(npz, "_pwrite_all", disk_full)
    ckpt.save(2, {"x": np.ones(4)})  # returns: the write runs in the background
    with pytest.raises(
        CheckpointError, match=r"saving step 2 to .* failed: OSError: .*No space left"
    ):
        ckpt.wait()
    ckpt.wait()  # reported once
    assert ckpt.steps == [1] and not (tmp_path / "step_00000002.tmp").exists()
    # A failure also surfaces at the next save, which then does not start.
    ckpt.save(3, {"x": np.ones(4)})
    with pytest.raises(CheckpointError, match="saving step 3"):
        ckpt.save(4, {"x": np.ones(4)})
    monkeypatch.undo()
    ckpt.save(4, {"x": np.ones(4)})
    ckpt.wait()
    assert ckpt.steps == [1, 4]


def test_an_error_in_an_early_sync_of_the_data_fails_the_save(tmp_path, monkeypatch):
    """The writer syncs data on a helper thread while it writes the rest; the kernel reports a
    failed writeback to one sync call only, so an error there must fail the save even though the
    later syncs succeed."""
    monkeypatch.setattr(npz, "WRITEBACK_BYTES", 1)  # a sync after every member
    calls, real_fdatasync = [], os.fdatasync

    def first_fails(fd):
        calls.append(fd)
        if len(calls) == 1:
            raise OSError(errno.EIO, "Input/output error")
        real_fdatasync(fd)

    monkeypatch.setattr(os, "fdatasync", first_fails)
    ckpt = Checkpoints(tmp_path)
    ckpt.save(1, {"a": np.ones(4), "b": np.ones(4)})
    with pytest.raises(CheckpointError, match=r"saving step 1 .* failed: OSError: .*Input/output"):
        ckpt.wait()
    assert len(calls) == 3  # after a, after b, and the last one while the CRCs finish
    assert ckpt.steps == [] and not (tmp_path / "step_00000001.tmp").exists()


def test_save_returns_before_the_files_are_written(tmp_path, monkeypatch):
    """save() copies to the host and hands the writing to a thread: with that write held on an
    Event, save has returned and the step is not visible; released, the step commits and
    restores."""
    started, release, finished = threading.Event(), threading.Event(), threading.Event()
    real_write = npz.write

    def held_write(*args, **kwargs):
        started.set()
        if not release.wait(timeout=60):  # only reached if save() never returned to release it
            raise AssertionError("the write was never released: save() waited for it")
        result = real_write(*args, **kwargs)
        finished.set()
        return result

    monkeypatch.setattr(npz, "write", held_write)
    ckpt = Checkpoints(tmp_path)
    values = np.arange(8, dtype=np.float32)
    ckpt.save(1, {"x": jax.device_put(values, NamedSharding(mesh(4, 2), P("fsdp")))})
    assert started.wait(timeout=60), "the background write never started"
    assert not finished.is_set() and ckpt.steps == [] and ckpt.latest is None
    assert not ckpt.step_path(1).exists()
    release.set()
    ckpt.wait()
    assert finished.is_set() and ckpt.steps == [1]
    restored, _ = ckpt.restore({"x": np.zeros(8, np.float32)})
    assert restored["x"].tobytes() == values.tobytes()


@pytest.mark.parametrize("reader_call", ["restore", "metadata"])
def test_restore_and_metadata_raise_the_error_of_a_failed_background_save(
    tmp_path, monkeypatch, reader_call
):
    """restore() and metadata() wait for the save in the background first; if it failed, they raise
    its error (once), as save() and wait() do, rather than quietly reading an older step."""
    ckpt = Checkpoints(tmp_path)
    ckpt.save(1, {"x": np.ones(4)}, metadata={"step": 1})
    ckpt.wait()

    def disk_full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(npz, "_pwrite_all", disk_full)
    ckpt.save(2, {"x": np.full(4, 2.0)}, metadata={"step": 2})
    read = {
        "restore": lambda: ckpt.restore({"x": np.zeros(4)})[1],
        "metadata": lambda: ckpt.metadata(),
    }[reader_call]
    with pytest.raises(
        CheckpointError, match=r"saving step 2 to .* failed: OSError: .*No space left"
    ):
        read()
    assert read() == {"step": 1}  # reported once; step 1 is what is on disk
    assert ckpt.steps == [1]


# --- damage is detected, never loaded -----------------------------------------------------------


@pytest.fixture
def two_steps(tmp_path):
    """Steps 1 and 2 of an fsdp-sharded state; step 2 is the one tests damage."""
    ckpt = Checkpoints(tmp_path, keep=None)
    states = {step: host_state(seed=step) for step in (1, 2)}
    for step, state in states.items():
        ckpt.save(step, place(state, mesh(1, 8)))
        ckpt.wait()
    return ckpt, states, target_for(states[1], mesh(2, 4))


def _matrix(index: dict) -> dict:
    """The first 2-d array of an index (the fsdp-split embedding of the test state)."""
    return next(array for array in index["arrays"] if len(array["shape"]) == 2)


def _rewrite_index(step_dir: Path, edit) -> None:
    index = index_of(step_dir)
    edit(index)
    (step_dir / "index.json").write_text(json.dumps(index))


def _truncate(step_dir):
    path = step_dir / "process_00000.npz"
    os.truncate(path, path.stat().st_size - 100)


def _flip_byte(step_dir):
    piece = _matrix(index_of(step_dir))["pieces"][0]
    path = step_dir / piece["file"]
    data = bytearray(path.read_bytes())
    data[piece["offset"] + piece["nbytes"] // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _delete_file(step_dir):
    (step_dir / "process_00000.npz").unlink()


def _drop_piece(step_dir):
    _rewrite_index(step_dir, lambda index: _matrix(index)["pieces"].pop())


def _corrupt_index(step_dir):
    (step_dir / "index.json").write_text(
        '{"format": "dew-checkpoint", "version": 1, "step": 2, "arr'
    )


def _escape_folder(step_dir):
    def edit(index):
        outside = "../step_00000001/process_00000.npz"
        index["files"][0]["name"] = outside
        for array in index["arrays"]:
            for piece in array["pieces"]:
                piece["file"] = outside

    _rewrite_index(step_dir, edit)


def _symlink_file(step_dir):
    path = step_dir / "process_00000.npz"
    os.rename(path, step_dir.parent / "elsewhere.npz")
    os.symlink(step_dir.parent / "elsewhere.npz", path)


def _absurd_nbytes(step_dir):
    _rewrite_index(step_dir, lambda index: _matrix(index)["pieces"][0].update(nbytes=10**15))


def _offset_past_end(step_dir):
    _rewrite_index(step_dir, lambda index: _matrix(index)["pieces"][0].update(offset=10**9))


def _negative_offset(step_dir):
    _rewrite_index(step_dir, lambda index: _matrix(index)["pieces"][0].update(offset=-64))


def _slice_outside_shape(step_dir):
    def edit(index):
        piece = _matrix(index)["pieces"][0]
        piece["slice"][0] = [piece["slice"][0][0] + 1000, piece["slice"][0][1] + 1000]

    _rewrite_index(step_dir, edit)


def _unknown_dtype(step_dir):
    _rewrite_index(step_dir, lambda index: _matrix(index).update(dtype="object"))


def _step_differs_from_folder(step_dir):
    _rewrite_index(step_dir, lambda index: index.update(step=3))


def _stored_as_mismatch(step_dir):
    _rewrite_index(step_dir, lambda index: _matrix(index).update(stored_as="<f8"))


def _extra_chunk_crc(step_dir):
    _rewrite_index(step_dir, lambda index: _matrix(index)["pieces"][0]["crc32"].append(0))


def _overlapping_pieces(step_dir):
    """The second piece claims the first one's rows: element counts still add up, the rows
    [8, 16) are covered by no piece and [0, 8) by two."""

    def edit(index):
        first, second = _matrix(index)["pieces"][:2]
        second["slice"] = first["slice"]

    _rewrite_index(step_dir, edit)


def _chunk_bytes(value):
    def edit_step(step_dir):
        _rewrite_index(step_dir, lambda index: index["checksum"].update(chunk_bytes=value))

    return edit_step


INDEX_OF_STEP_2 = r"step 2: .*step_00000002[/\\]index\.json: "
DAMAGE = {
    "truncated file": (_truncate, r"process_00000\.npz is truncated"),
    "flipped byte": (_flip_byte, r"process_00000\.npz.*checksum mismatch"),
    "missing file": (_delete_file, r"process_00000\.npz is missing"),
    "missing piece": (_drop_piece, r"its pieces hold \d+ elements, the array \d+"),
    "corrupt index": (_corrupt_index, r"index\.json: not valid JSON"),
    "missing index": (
        lambda step_dir: (step_dir / "index.json").unlink(),
        r"index\.json is missing",
    ),
    "file outside its folder": (
        _escape_folder,
        r"not a process_NNNNN\.npz file in the step folder",
    ),
    "symlinked file": (_symlink_file, r"process_00000\.npz cannot be opened as a regular file"),
    "absurd byte length": (_absurd_nbytes, r"declares 1000000000000000 bytes, but its slice"),
    "offset past the end": (_offset_past_end, r"past the end of process_00000\.npz"),
    "negative offset": (_negative_offset, r"offset must be an integer in \[0"),
    "slice outside the shape": (
        _slice_outside_shape,
        r"slice\[0\] must be an integer in \[0, \d+\]",
    ),
    "unknown dtype": (_unknown_dtype, r"dtype 'object', which Dew does not store"),
    # Section 9 of docs/checkpoint-format.md, each naming the index file of step 2:
    "step differs from its folder": (
        _step_differs_from_folder,
        INDEX_OF_STEP_2 + r"index says step 3, but its folder is step 2",
    ),
    "stored_as mismatch": (
        _stored_as_mismatch,
        INDEX_OF_STEP_2 + r"arrays\[\d+\] \(\.\w+\['embed'\]\) is stored as '<f8', "
        r"but float32 is stored as '<f4'",
    ),
    "wrong CRC count": (
        _extra_chunk_crc,
        INDEX_OF_STEP_2 + r"arrays\[\d+\] .*pieces\[0\] has 2 chunk checksums; 512 bytes need 1",
    ),
    "overlapping pieces": (
        _overlapping_pieces,
        INDEX_OF_STEP_2 + r"arrays\[\d+\] .*pieces \[\(0, 8\), \(0, 16\)\] and "
        r"\[\(0, 8\), \(0, 16\)\] overlap",
    ),
    "chunk_bytes not a multiple of 16": (
        _chunk_bytes(1000),
        INDEX_OF_STEP_2 + r"checksum\.chunk_bytes must be a positive multiple of 16, not 1000",
    ),
    "chunk_bytes zero": (
        _chunk_bytes(0),
        INDEX_OF_STEP_2 + r"checksum\.chunk_bytes must be a positive multiple of 16, not 0",
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damage_is_caught_naming_step_and_file_and_latest_falls_back(two_steps, damage):
    ckpt, states, target = two_steps
    break_it, message = DAMAGE[damage]
    break_it(ckpt.step_path(2))
    with pytest.raises(CorruptCheckpointError, match=message) as caught:
        ckpt.restore(target, step=2)
    assert "step 2" in str(caught.value)
    with pytest.warns(
        UserWarning, match=r"checkpoint step 2 in .* is damaged, trying step 1: .*" + message
    ):
        restored, _ = ckpt.restore(target)
    assert ckpt.restored_step == 1
    assert_bits_equal(restored, states[1])


def test_every_step_damaged_is_an_error_not_a_load(two_steps):
    ckpt, _, target = two_steps
    for step in (1, 2):
        _flip_byte(ckpt.step_path(step))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CorruptCheckpointError, match="every checkpoint in .* is damaged"):
            ckpt.restore(target)


def test_a_foreign_index_in_a_step_folder_is_not_a_dew_checkpoint(two_steps):
    ckpt, _, target = two_steps
    (ckpt.step_path(2) / "index.json").write_text('{"format": "something-else"}')
    with pytest.raises(CorruptCheckpointError, match="not a Dew checkpoint index"):
        ckpt.restore(target, step=2)


def test_a_newer_format_version_is_refused(two_steps):
    ckpt, _, target = two_steps
    _rewrite_index(ckpt.step_path(2), lambda index: index.update(version=2))
    with pytest.raises(CorruptCheckpointError, match="format version 2 .written by a newer Dew."):
        ckpt.restore(target, step=2)


# --- the target must match -----------------------------------------------------------------------


def test_a_shape_mismatch_names_the_parameter_and_both_shapes(two_steps):
    ckpt, _, target = two_steps
    target.params["embed"] = jax.ShapeDtypeStruct(
        (128, 16), jnp.float32, sharding=target.params["embed"].sharding
    )
    with pytest.raises(
        CheckpointMismatchError,
        match=r"\.params\['embed'\] has shape \(64, 16\) in the checkpoint "
        r"but \(128, 16\) in the target",
    ):
        ckpt.restore(target)
    assert issubclass(CheckpointMismatchError, ValueError)


def test_a_tree_mismatch_names_the_paths(two_steps):
    ckpt, _, target = two_steps
    target.params["extra"] = target.params.pop("norm")
    with pytest.raises(
        CheckpointMismatchError,
        match=r"the target has \.params\['extra'\], which the checkpoint "
        r"lacks; the checkpoint has \.params\['norm'\]",
    ):
        ckpt.restore(target)


def test_a_dtype_mismatch_names_the_parameter_and_both_dtypes(two_steps):
    ckpt, _, target = two_steps
    target.params["norm"] = jax.ShapeDtypeStruct(
        (16,), jnp.bfloat16, sharding=target.params["norm"].sharding
    )
    with pytest.raises(
        CheckpointMismatchError,
        match=r"\.params\['norm'\] has dtype float32 in the checkpoint "
        r"but bfloat16 in the target",
    ):
        ckpt.restore(target)


# --- not a checkpoint, bad input ----------------------------------------------------------------


def test_a_directory_that_is_not_a_dew_checkpoint_says_so(tmp_path):
    (tmp_path / "weights.msgpack").write_bytes(b"\x00")
    (tmp_path / "20").mkdir()
    ckpt = Checkpoints(tmp_path)
    assert ckpt.latest is None
    with pytest.raises(
        NotACheckpointError, match=r"is not a Dew checkpoint directory: .*\(it holds: 20, weights"
    ):
        ckpt.restore({"x": np.zeros(1)})
    with pytest.raises(NotACheckpointError, match="the directory does not exist"):
        Checkpoints(tmp_path / "nothing").restore({"x": np.zeros(1)})


def test_a_step_folder_passed_as_the_directory_is_refused(two_steps):
    ckpt, _, _ = two_steps
    with pytest.raises(
        NotACheckpointError, match="one step's folder, not a checkpoint directory; pass its parent"
    ):
        Checkpoints(ckpt.step_path(1))


def test_asking_for_a_step_that_does_not_exist(two_steps):
    ckpt, _, target = two_steps
    with pytest.raises(CheckpointError, match=r"has no complete step 7 \(its steps: \[1, 2\]\)"):
        ckpt.restore(target, step=7)


@pytest.mark.parametrize(
    "step, tree, metadata, message",
    [
        (-1, {"x": np.zeros(1)}, None, "step must be a non-negative integer"),
        (1.5, {"x": np.zeros(1)}, None, "step must be a non-negative integer"),
        (1, {"key": jax.random.key(0)}, None, r"\['key'\]: it holds typed PRNG keys"),
        (
            1,
            {"names": np.array(["a"], dtype=object)},
            None,
            r"\['names'\]: a checkpoint cannot hold dtype object",
        ),
        (1, {"s": "text"}, None, r"\['s'\]: a str is not an array"),
        (1, {"x": np.zeros(1)}, {"loss": object()}, "metadata must be JSON-serialisable"),
        (1, {"x": np.zeros(1)}, {"loss": float("nan")}, "metadata must be JSON-serialisable"),
    ],
)
def test_bad_save_input_is_a_value_error_before_anything_is_written(
    tmp_path, step, tree, metadata, message
):
    ckpt = Checkpoints(tmp_path / "run")
    with pytest.raises(ValueError, match=message):
        ckpt.save(step, tree, metadata=metadata)
    assert not (tmp_path / "run").exists()


def test_a_target_without_a_sharding_is_a_value_error(tmp_path):
    ckpt = Checkpoints(tmp_path)
    ckpt.save(1, {"x": np.zeros(4, np.float32)})
    ckpt.wait()
    with pytest.raises(ValueError, match=r"\['x'\] is a ShapeDtypeStruct without a sharding"):
        ckpt.restore({"x": jax.ShapeDtypeStruct((4,), jnp.float32)})


def test_metadata_is_readable_without_the_arrays(tmp_path):
    ckpt = Checkpoints(tmp_path)
    ckpt.save(9, {"x": np.zeros(1)}, metadata={"data_position": np.int64(144), "mesh": {"fsdp": 8}})
    assert ckpt.metadata() == {"data_position": 144, "mesh": {"fsdp": 8}}  # waits for the save


# --- several processes ---------------------------------------------------------------------------

_TWO_PROCESS_WORKER = """
import os, sys
process_id, port = int(sys.argv[1]), sys.argv[2]
written_by_one, directory = sys.argv[3], sys.argv[4]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from dew.checkpoints import Checkpoints
AXES = ("data", "expert", "fsdp", "tensor", "sequence", "stage")
mesh = lambda d, f: Mesh(np.array(jax.devices()).reshape(d, 1, f, 1, 1, 1), AXES)
values = {
    "w": np.arange(64 * 16, dtype=np.float32).reshape(64, 16),
    "b": np.arange(16, dtype=np.int32),
}

def check(tree):
    for name, value in values.items():
        for shard in tree[name].addressable_shards:
            assert np.asarray(shard.data).tobytes() == value[shard.index].tobytes(), name

def target(m, spec):
    shardings = {k: NamedSharding(m, spec if k == "w" else P()) for k in values}
    return {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k]) for k, v in values.items()
    }

# A checkpoint written by one process (8 devices, data 8), restored by two (fsdp 8 over both).
restored, _ = Checkpoints(written_by_one).restore(target(mesh(1, 8), P("fsdp")))
check(restored)
# Written by two processes in data 2 x fsdp 4, restored by the same two in another layout.
placed = {
    k: jax.make_array_from_callback(
        v.shape,
        NamedSharding(mesh(2, 4), P("fsdp") if k == "w" else P()),
        lambda index, v=v: v[index],
    )
    for k, v in values.items()
}
ckpt = Checkpoints(directory)
ckpt.save(7, placed, metadata={"processes": 2})
ckpt.wait()
restored, metadata = ckpt.restore(target(mesh(4, 2), P(None, "fsdp")))
check(restored)
assert metadata == {"processes": 2}
print("process", process_id, "ok", flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_save_and_restore_across_layouts_and_process_counts(tmp_path):
    """Two subprocesses with 4 CPU devices each (gloo collectives): restore a one-process
    checkpoint, save from both, restore in another layout; then restore theirs in this process."""
    values = {
        "w": np.arange(64 * 16, dtype=np.float32).reshape(64, 16),
        "b": np.arange(16, dtype=np.int32),
    }
    by_one = Checkpoints(tmp_path / "one")
    by_one.save(
        3, {k: jax.device_put(v, NamedSharding(mesh(8, 1), P())) for k, v in values.items()}
    )
    by_one.wait()
    port = _free_port()
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _TWO_PROCESS_WORKER,
                str(i),
                str(port),
                str(tmp_path / "one"),
                str(tmp_path / "two"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    try:
        outputs = [worker.communicate(timeout=120)[0] for worker in workers]
    finally:
        for worker in workers:
            worker.kill()
    for i, (worker, output) in enumerate(zip(workers, outputs)):
        assert worker.returncode == 0 and f"process {i} ok" in output, output[-3000:]
    ckpt = Checkpoints(tmp_path / "two")
    index = index_of(ckpt.step_path(7))
    assert [f["name"] for f in index["files"]] == ["process_00000.npz", "process_00001.npz"]
    assert index["writer"]["process_count"] == 2
    assert sorted(os.listdir(ckpt.step_path(7))) == [
        "index.json",
        "process_00000.npz",
        "process_00001.npz",
    ]
    replicated = NamedSharding(mesh(8, 1), P())
    target = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=replicated) for k, v in values.items()
    }
    restored, _ = ckpt.restore(target)
    assert_bits_equal(restored, values)
