"""One process of a two-process run that shares checkpoints on a GCS server with a one-process
run (started by tests/test_checkpoints_remote.py, which also imports the trees and layouts below).

argv: port process_id seed saved_by_one saved_by_two

Restores step 3 of `saved_by_one` (written by the test's single process of 8 devices) into a
layout split over both processes, checks every local shard bit for bit, then saves another tree
together as step 5 of `saved_by_two`, for the test to restore in one process.
"""

import sys

import ml_dtypes
import numpy as np

# The emulator takes anonymous requests; real credentials never reach it.
STORAGE_OPTIONS = {"token": "anon"}

# The 8 devices as a (2, 4) mesh: with two processes, axis "a" is the process.
AXES = ("a", "b")
# Per leaf, the PartitionSpec axes of each layout; "count" stays a numpy leaf throughout.
LAYOUTS = {
    "saved_by_one": {"w": (("a", "b"),), "b": ("b", "a"), "r": ()},
    "restored_by_two": {"w": ("a",), "b": (None, "b"), "r": ()},
    "saved_by_two": {"w": ("a", "b"), "b": ("b",), "r": ()},
    "restored_by_one": {"w": (None, ("a", "b")), "b": (("a", "b"),), "r": ("a",)},
}


def host_tree(seed: int, which: int) -> dict:
    """Distinct random values for tree `which` of a test's `seed`: `w` is the bulk of the bytes
    (so a whole-file download shows in the bytes served), `b` is bfloat16."""
    rng = np.random.default_rng((seed, which))
    return {
        "w": rng.standard_normal((256, 48)).astype(np.float32),
        "b": rng.standard_normal((16, 32)).astype(ml_dtypes.bfloat16),
        "r": rng.standard_normal(8).astype(np.float32),
        "count": np.int32(rng.integers(1 << 30)),
    }


def _sharding(layout: str, name: str):
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), AXES)
    return NamedSharding(mesh, PartitionSpec(*LAYOUTS[layout][name]))


def sharded(tree: dict, layout: str) -> dict:
    """`tree` as jax.Arrays laid out by `layout` (each process builds its own shards)."""
    import jax

    out = {"count": tree["count"]}
    for name in LAYOUTS[layout]:
        host = tree[name]
        out[name] = jax.make_array_from_callback(
            host.shape, _sharding(layout, name), lambda index, host=host: host[index]
        )
    return out


def target(tree: dict, layout: str) -> dict:
    """A restore target for `tree` in `layout`."""
    import jax

    out = {"count": np.int32(0)}
    for name in LAYOUTS[layout]:
        host = tree[name]
        out[name] = jax.ShapeDtypeStruct(host.shape, host.dtype, sharding=_sharding(layout, name))
    return out


def mismatches(restored: dict, expected: dict) -> list[str]:
    """Names of the leaves of `restored` whose local shards differ, in any bit, from `expected`."""
    wrong = []
    for name, host in expected.items():
        leaf = restored[name]
        if isinstance(leaf, np.ndarray | np.generic):
            same = np.asarray(leaf).dtype == host.dtype and leaf.tobytes() == host.tobytes()
        else:
            same = leaf.dtype == host.dtype and all(
                np.asarray(shard.data).tobytes() == host[shard.index].tobytes()
                for shard in leaf.addressable_shards
            )
        if not same:
            wrong.append(name)
    return wrong


if __name__ == "__main__":
    port, process_id, seed, saved_by_one, saved_by_two = sys.argv[1:]
    seed = int(seed)

    from dew.training.runtime import prepare_process

    prepare_process(
        multi_host=True,
        cpu_devices=4,
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=int(process_id),
    )

    import jax

    from dew.checkpoints import Checkpoints

    assert jax.process_count() == 2 and jax.local_device_count() == 4

    first = host_tree(seed, 1)
    restored, metadata = Checkpoints(saved_by_one, storage_options=STORAGE_OPTIONS).restore(
        target(first, "restored_by_two")
    )
    wrong = mismatches(restored, first)
    assert not wrong and metadata == {"saved_by": 1}, (wrong, metadata)

    out = Checkpoints(saved_by_two, storage_options=STORAGE_OPTIONS)
    out.save(5, sharded(host_tree(seed, 2), "saved_by_two"), metadata={"saved_by": 2})
    out.wait()
    print(f"process {process_id}: restored and saved", flush=True)
