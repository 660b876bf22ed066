"""Checkpoints on object storage: any fsspec URL, in the format of a local directory.

Most tests run against a real GCS API server on this machine (`gcp-storage-emulator`, in a thread
of this process), which gcsfs reaches through `STORAGE_EMULATOR_HOST`; `memory://` covers the fsspec
path without one.
"""

import importlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.parse
import uuid
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import dew
from dew.checkpoints import Checkpoints
from dew.data import TokenWindows
from tests.helpers import SEQ, child_env, random_token_folder, tiny_objective
from tests.remote_checkpoint_worker import STORAGE_OPTIONS, host_tree, mismatches, sharded, target

REPO = Path(__file__).resolve().parents[1]
BUCKET = "dew-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Emulator:
    """The GCS server: fresh URLs in its bucket, what it holds, and the bytes it served."""

    def __init__(self, served: list[tuple[str, int]]):
        self.served = served  # (request path, bytes of object data sent) of every download
        import fsspec

        self.fs = fsspec.filesystem("gs", **STORAGE_OPTIONS)

    def url(self, name: str) -> str:
        return f"gs://{BUCKET}/{name}-{uuid.uuid4().hex[:8]}"

    def names(self, url: str) -> set[str]:
        """Every object under `url`, relative to it."""
        root = url.removeprefix("gs://")
        self.fs.invalidate_cache()
        return {path[len(root) + 1 :] for path in self.fs.find(root)}

    def served_bytes(self, url: str, name_part: str) -> int:
        """Bytes of object data served from objects under `url` whose name contains `name_part`."""
        prefix = url.removeprefix(f"gs://{BUCKET}/") + "/"
        return sum(
            size
            for path, size in self.served
            if f"/o/{prefix}" in urllib.parse.unquote(path)
            and name_part in urllib.parse.unquote(path)
        )

    @staticmethod
    def child_environment() -> dict:
        """For processes that use the server: this environment (which points at it), without the
        8-device XLA settings of tests/conftest.py."""
        env = child_env()
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        return env


@pytest.fixture(scope="module")
def gcs():
    if any(importlib.util.find_spec(name) is None for name in ("gcsfs", "gcp_storage_emulator")):
        pytest.skip("needs gcsfs and gcp-storage-emulator (pip install -e '.[test]')")
    with pytest.MonkeyPatch.context() as patch:
        # gcsfs 2026.x makes gs:// an ExtendedGcsFileSystem, which asks each bucket's type over
        # gRPC (a server the emulator lacks) and waits 60 s per question; this variable, read when
        # gcsfs is imported, keeps the plain GCSFileSystem.
        patch.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        import fsspec
        import gcsfs
        from gcp_storage_emulator.server import Response, create_server

        assert fsspec.get_filesystem_class("gs") is gcsfs.core.GCSFileSystem, (
            "gcsfs was imported before GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false was set: each "
            "request would wait 60 s for the bucket-type probe"
        )
        served: list[tuple[str, int]] = []
        real_write_file = Response.write_file

        def write_file(self, content, *args, **kwargs):  # every download goes through here
            served.append((self._handler.path, len(content)))
            return real_write_file(self, content, *args, **kwargs)

        patch.setattr(Response, "write_file", write_file)
        port = free_port()
        server = create_server("127.0.0.1", port, in_memory=True, default_bucket=BUCKET)
        server.start()
        patch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
        gcsfs.GCSFileSystem.clear_instance_cache()  # instances fix their endpoint when made
        try:
            yield Emulator(served)
        finally:
            server.stop()
            gcsfs.GCSFileSystem.clear_instance_cache()


def leaves_equal(a, b) -> bool:
    """Same structure, and every leaf the same dtype, shape and bits."""
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(la) == len(lb) and all(
        np.asarray(x).dtype == np.asarray(y).dtype
        and np.asarray(x).shape == np.asarray(y).shape
        and np.asarray(x).tobytes() == np.asarray(y).tobytes()
        for x, y in zip(la, lb)
    )


# --- fsspec in general, without a server --------------------------------------------------------


def test_a_memory_url_writes_the_local_format_byte_for_byte(tmp_path, seed):
    """The same save to a local folder and to memory:// gives identical process files and indexes,
    so a step copied either way loads; each restores bit for bit into another layout."""
    import fsspec

    tree = sharded(host_tree(seed, 1), "saved_by_one")
    url = f"memory://dew-{uuid.uuid4().hex[:8]}/run"
    local, remote = Checkpoints(tmp_path / "run"), Checkpoints(url)
    for ckpt in (local, remote):
        ckpt.save(7, tree, metadata={"seed": seed})
        ckpt.wait()
    assert remote.directory == url and remote.step_path(7) == f"{url}/step_00000007"
    assert remote.steps == [7] and remote.latest == 7, f"seed {seed}"
    fs, root = fsspec.core.url_to_fs(url)
    try:
        step = f"{root}/step_00000007"
        assert sorted(fs.ls(step, detail=False)) == [
            f"{step}/index.json",
            f"{step}/process_00000.npz",
        ]
        local_step = local.step_path(7)
        assert (
            fs.cat_file(f"{step}/process_00000.npz")
            == (local_step / "process_00000.npz").read_bytes()
        ), f"seed {seed}"
        indexes = [json.loads(fs.cat_file(f"{step}/index.json"))]
        indexes.append(json.loads((local_step / "index.json").read_bytes()))
        for index in indexes:
            del index["writer"]["time"]
        assert indexes[0] == indexes[1], f"seed {seed}"

        expected = host_tree(seed, 1)
        for ckpt in (local, remote):
            restored, metadata = ckpt.restore(target(expected, "restored_by_one"))
            assert not mismatches(restored, expected) and metadata == {"seed": seed}, f"seed {seed}"

        # A step copied from local disk to memory:// and back loads in both places.
        fs.put(str(local_step), f"{root}-copy/step_00000007", recursive=True)
        fs.get(step, str(tmp_path / "copy" / "step_00000007"), recursive=True)
        for copy in (Checkpoints(f"{url}-copy"), Checkpoints(tmp_path / "copy")):
            restored, _ = copy.restore(target(expected, "restored_by_two"))
            assert not mismatches(restored, expected), f"seed {seed}: {copy}"
    finally:
        for path in (root, f"{root}-copy"):
            if fs.exists(path):
                fs.rm(path, recursive=True)


def test_a_url_whose_filesystem_is_missing_is_an_error_naming_the_extra(tmp_path, monkeypatch):
    """No gcsfs (or no fsspec): Checkpoints("gs://...") raises at once, naming the extra, and
    never makes a local folder; an unknown protocol is a ValueError."""
    pytest.importorskip("fsspec")
    monkeypatch.chdir(tmp_path)
    registry = importlib.import_module("fsspec.registry")
    for protocol in ("gs", "gcs"):  # forget the class, if an earlier test imported it
        monkeypatch.delitem(registry._registry, protocol, raising=False)
    monkeypatch.setitem(sys.modules, "gcsfs", None)  # `import gcsfs` now fails
    with pytest.raises(
        ImportError,
        match=r"Checkpoints\('gs://bucket/run'\) needs the filesystem for gs://.*"
        r"pip install -e '\.\[gcs\]'",
    ):
        Checkpoints("gs://bucket/run")
    monkeypatch.setitem(sys.modules, "fsspec", None)
    with pytest.raises(ImportError, match=r"needs fsspec.*pip install -e '\.\[gcs\]'"):
        Checkpoints("gs://bucket/run", keep=1)
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"no filesystem for nosuchstore://"):
        Checkpoints("nosuchstore://bucket/run")
    assert list(tmp_path.iterdir()) == []  # in particular, no folder named "gs:"
    # A file:// URL is a local directory, written with the local code.
    assert Checkpoints(f"file://{tmp_path}/run").directory == tmp_path / "run"


# --- on the GCS server ---------------------------------------------------------------------------


def trainer(url, mesh):
    return dew.Trainer(
        tiny_objective(),
        optax.adamw(1e-2),
        jax.random.key(11),
        mesh=mesh,
        layout=dew.Layout(min_shard=1),
        checkpoints=dew.Checkpoints(url, storage_options=STORAGE_OPTIONS),
    )


def test_an_fsdp_run_on_gcs_resumes_bit_for_bit_as_data_parallel_writing_nothing_locally(
    gcs, tmp_path, monkeypatch, capsys, seed
):
    folder = random_token_folder(tmp_path / "tokens", seed, 3000, 300)
    data = TokenWindows(folder, seq_len=SEQ, seed=3).load(batch=16)
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    url = gcs.url("fsdp")

    saved = trainer(url, dew.MeshSpec(fsdp=8)).fit(data, steps=2)
    assert list(workdir.iterdir()) == [], "a checkpoint of a gs:// URL was written locally"
    assert gcs.names(url) == {"step_00000002/index.json", "step_00000002/process_00000.npz"}

    data_parallel = trainer(url, dew.MeshSpec())
    restored, shardings, position = data_parallel.place()
    assert position["next_batch"] == 2
    assert leaves_equal(restored.params, saved.params), f"seed {seed}"
    assert leaves_equal(restored.opt_state, saved.opt_state), f"seed {seed}"
    assert leaves_equal(jax.random.key_data(restored.key), jax.random.key_data(saved.key))
    table = restored.params["params"]["embed_tokens"]["embedding"]
    assert table.sharding == shardings.params["params"]["embed_tokens"]["embedding"]
    assert table.sharding.spec == P() and len(table.sharding.device_set) == 8  # replicated
    capsys.readouterr()

    trained_on = data_parallel.fit(data, steps=3, log_every=1)
    out = capsys.readouterr().out
    assert out.startswith(f"Resumed from step 2 in {url}\n"), out
    assert "step 3: loss " in out and int(trained_on.step) == 3
    assert data_parallel.checkpoints.steps == [2, 3]

    assert list(workdir.iterdir()) == [], "a checkpoint of a gs:// URL was written locally"
    assert not (REPO / "gs:").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cwd", "tokens"]


def test_two_processes_and_one_restore_each_others_checkpoints_on_gcs(gcs, seed):
    """One process (this one, 8 devices) saves; two processes of 4 devices restore it into a
    layout split between them, reading only their byte ranges, and save another step together;
    this process restores that."""
    saved_by_one, saved_by_two = gcs.url("one"), gcs.url("two")
    first = host_tree(seed, 1)
    ckpt = Checkpoints(saved_by_one, storage_options=STORAGE_OPTIONS)
    ckpt.save(3, sharded(first, "saved_by_one"), metadata={"saved_by": 1})
    ckpt.wait()
    file_size = json.loads(gcs.fs.cat_file(f"{saved_by_one[5:]}/step_00000003/index.json"))[
        "files"
    ][0]["bytes"]
    gcs.served.clear()

    port = free_port()
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                str(REPO / "tests" / "remote_checkpoint_worker.py"),
                str(port),
                str(i),
                str(seed),
                saved_by_one,
                saved_by_two,
            ],
            env=gcs.child_environment(),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    try:
        for i, process in enumerate(processes):
            out, err = process.communicate(timeout=120)
            assert process.returncode == 0, f"seed {seed}, process {i}: {err[-4000:]}"
            assert f"process {i}: restored and saved" in out
    finally:
        for process in processes:
            process.kill()

    # Each process read about half the file: ranged reads, not two whole downloads.
    read = gcs.served_bytes(saved_by_one, "process_00000.npz")
    assert first["w"].nbytes <= read < 1.5 * file_size, (read, file_size)

    assert gcs.names(saved_by_two) == {
        "step_00000005/index.json",
        "step_00000005/process_00000.npz",
        "step_00000005/process_00001.npz",
    }
    second = host_tree(seed, 2)
    restored, metadata = Checkpoints(saved_by_two, storage_options=STORAGE_OPTIONS).restore(
        target(second, "restored_by_one")
    )
    assert not mismatches(restored, second) and metadata == {"saved_by": 2}, f"seed {seed}"


_KILLED_SAVE = """
import asyncio, sys
import gcsfs
import numpy as np
from dew.checkpoints import Checkpoints

real_pipe_file = gcsfs.GCSFileSystem._pipe_file

async def pipe_file(self, path, *args, **kwargs):
    if path.endswith("step_00000002/index.json"):  # step 2's files are in; its commit is next
        print("holding", path, flush=True)
        await asyncio.Event().wait()  # until the test kills this process
    return await real_pipe_file(self, path, *args, **kwargs)

gcsfs.GCSFileSystem._pipe_file = pipe_file  # before Checkpoints makes the filesystem
ckpt = Checkpoints(sys.argv[1], storage_options={"token": "anon"})
ckpt.save(1, {"a": np.full(1000, 1.0), "b": np.full(1000, 2.0)})
ckpt.wait()
ckpt.save(2, {"a": np.full(1000, 3.0), "b": np.full(1000, 4.0)})
ckpt.wait()
print("not killed", flush=True)
"""


def test_a_save_killed_before_its_index_on_gcs_leaves_the_previous_step_loadable(gcs):
    url = gcs.url("killed")
    process = subprocess.Popen(
        [sys.executable, "-c", _KILLED_SAVE, url],
        env=gcs.child_environment(),
        stdout=subprocess.PIPE,
        text=True,
    )
    watchdog = threading.Timer(120, process.kill)  # a hung child ends the readline below
    watchdog.start()
    try:
        line = process.stdout.readline()
        assert line.startswith("holding ") and line.rstrip().endswith("index.json"), line
        process.send_signal(signal.SIGKILL)
        assert process.wait(timeout=60) == -signal.SIGKILL
    finally:
        watchdog.cancel()
        process.kill()
    names = gcs.names(url)
    assert "step_00000002/process_00000.npz" in names  # killed with step 2's data uploaded
    assert "step_00000002/index.json" not in names

    ckpt = Checkpoints(url, storage_options=STORAGE_OPTIONS)
    assert ckpt.steps == [1] and ckpt.latest == 1
    restored, _ = ckpt.restore({"a": np.zeros(1000), "b": np.zeros(1000)})
    assert ckpt.restored_step == 1
    assert (restored["a"] == 1.0).all() and (restored["b"] == 2.0).all()
    ckpt.save(3, {"a": np.full(1000, 5.0), "b": np.full(1000, 6.0)})
    ckpt.wait()
    assert {name.partition("/")[0] for name in gcs.names(url)} == {
        "step_00000001",
        "step_00000003",
    }  # the unfinished step 2 is gone


def test_keep_deletes_the_objects_of_old_steps_on_gcs(gcs):
    url = gcs.url("keep")
    ckpt = Checkpoints(url, keep=2, storage_options=STORAGE_OPTIONS)
    for step in (1, 2, 3, 4):
        ckpt.save(step, {"x": np.full(100, step, np.float32)})
    ckpt.save(4, {"x": np.full(100, 40, np.float32)})  # saved again: replaces step 4
    ckpt.wait()
    assert ckpt.steps == [3, 4] and ckpt.latest == 4
    assert gcs.names(url) == {
        f"step_0000000{step}/{name}"
        for step in (3, 4)
        for name in ("index.json", "process_00000.npz")
    }
    restored, _ = ckpt.restore({"x": np.zeros(100, np.float32)})
    assert (restored["x"] == 40).all()
    restored, _ = ckpt.restore({"x": np.zeros(100, np.float32)}, step=3)
    assert (restored["x"] == 3).all()
