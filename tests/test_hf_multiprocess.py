"""Two processes of four CPU devices each load one Hugging Face Llama folder on fsdp=8
(``hf.load(folder, trainer=...)``): every shard each process's devices hold is bit-equal to the
same slice of the tensors read from the safetensors files directly with numpy, and so to what one
process loading the whole model gets."""

import json
import struct
from pathlib import Path

import jax
import numpy as np

import dew
from dew.models import hf
from tests.test_multiprocess import run_two

# A few MB of float32 in several files with an index: untied head, grouped kv heads, every kind
# of tensor split eight ways by fsdp.
CONFIG = dict(
    vocab_size=512,
    emb_features=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    mlp_features=384,
    tie_embeddings=False,
    max_seq_len=16,
)


def write_folder(folder: Path, seed: int) -> None:
    """A random model (every weight drawn, norms included, so a misplaced slice shows) written
    by ``hf.save`` in files of at most 1 MB."""
    model = dew.models.build("causal_transformer", **CONFIG)
    abstract = jax.eval_shape(model.init, jax.random.key(0))
    rng = np.random.default_rng(seed)
    params = jax.tree_util.tree_map(
        lambda a: rng.standard_normal(a.shape).astype(a.dtype), abstract
    )
    written = hf.save(model, params, folder, max_shard_bytes=10**6)
    assert hf.INDEX in written and len(written) > 4, written


def read_safetensors(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor of the folder's files, by name, read with numpy alone (the format: an 8-byte
    little-endian header length, the JSON header, the data)."""
    files = set(json.loads((folder / hf.INDEX).read_text())["weight_map"].values())
    out = {}
    for name in files:
        data = (folder / name).read_bytes()
        (length,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + length])
        header.pop("__metadata__", None)
        for tensor, entry in header.items():
            assert entry["dtype"] == "F32", entry
            begin, end = (8 + length + o for o in entry["data_offsets"])
            out[tensor] = np.frombuffer(data[begin:end], "<f4").reshape(entry["shape"])
    return out


def expected_params(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Dew's parameters (``params/...`` paths) from Hugging Face's tensors, written from the
    mapping table of docs/hf.md: projections transposed to ``x @ w``, heads split out."""
    layers = CONFIG["num_layers"]
    head_dim = CONFIG["emb_features"] // CONFIG["num_heads"]
    embed = CONFIG["emb_features"]

    def stack(name, convert):
        return np.stack(
            [convert(tensors[f"model.layers.{i}.{name}.weight"]) for i in range(layers)]
        )

    def heads_in(w):  # [heads * hd, embed] -> [embed, heads, hd]
        return w.T.reshape(embed, -1, head_dim)

    return {
        "params/embed_tokens/embedding": tensors["model.embed_tokens.weight"],
        "params/layers/attn/q": stack("self_attn.q_proj", heads_in),
        "params/layers/attn/k": stack("self_attn.k_proj", heads_in),
        "params/layers/attn/v": stack("self_attn.v_proj", heads_in),
        # [embed, heads * hd] -> [heads, hd, embed]
        "params/layers/attn/o": stack(
            "self_attn.o_proj", lambda w: w.T.reshape(-1, head_dim, embed)
        ),
        "params/layers/mlp/gate": stack("mlp.gate_proj", np.transpose),
        "params/layers/mlp/up": stack("mlp.up_proj", np.transpose),
        "params/layers/mlp/down": stack("mlp.down_proj", np.transpose),
        "params/layers/attn_norm/scale": stack("input_layernorm", np.asarray),
        "params/layers/mlp_norm/scale": stack("post_attention_layernorm", np.asarray),
        "params/final_norm/scale": tensors["model.norm.weight"],
        "params/lm_head/kernel": tensors["lm_head.weight"].T,
    }


def test_two_processes_load_on_fsdp8_the_slices_of_the_files(tmp_path, seed):
    folder = tmp_path / "llama"
    write_folder(folder, seed)
    run_two("hf_load_worker.py", folder, tmp_path)
    want = expected_params(read_safetensors(folder))

    # Each process's shards: the slices of the reference at their indices, bit for bit.
    covered = {name: np.zeros(array.shape, bool) for name, array in want.items()}
    devices = {0: set(), 1: set()}
    for process in range(2):
        with np.load(tmp_path / f"process_{process}.npz") as shards:
            names = set()
            for key in shards.files:
                name, device, start, stop = key.split("|")
                index = tuple(
                    slice(int(a), int(b)) for a, b in zip(start.split(","), stop.split(","))
                )
                got = shards[key]
                assert got.dtype == np.float32, (key, got.dtype)
                np.testing.assert_array_equal(got, want[name][index], err_msg=f"seed {seed} {key}")
                covered[name][index] = True
                names.add(name)
                devices[process].add(int(device))
            assert names == set(want), (process, sorted(set(want) ^ names))
    # Together they hold every element, on eight distinct devices, four per process.
    assert len(devices[0]) == len(devices[1]) == 4 and not devices[0] & devices[1], devices
    for name, mask in covered.items():
        assert mask.all(), f"{name}: {np.count_nonzero(~mask)} elements on no device"
    # fsdp=8 split each parameter: no process holds one whole (a shard per device, 1/8 each).
    sizes = {name: array.size for name, array in want.items()}
    with np.load(tmp_path / "process_0.npz") as shards:
        for key in shards.files:
            name = key.split("|")[0]
            assert shards[key].size * 8 == sizes[name], (key, shards[key].shape)

    # And one process loading the whole model on one device gets the same reference.
    _, params = hf.load(folder)
    flat = {
        "/".join(str(k.key) for k in path): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    assert set(flat) == set(want)
    for name, array in want.items():
        np.testing.assert_array_equal(flat[name], array, err_msg=f"seed {seed} {name}")


# --- Host memory ---------------------------------------------------------------------------------

# 150 MiB of float32, a 64 MiB embedding and a 64 MiB head among them: each process's devices
# hold 75 MiB, the largest shard 8 MiB (an eighth of the head). The head is loaded last (the
# order of hf.mappings), when the rest of the share is already held: what loading it holds
# beyond its shards adds to the whole share, at the peak.
MEMORY_CONFIG = dict(
    vocab_size=16384,
    emb_features=1024,
    num_layers=1,
    num_heads=8,
    num_kv_heads=2,
    mlp_features=1024,
    tie_embeddings=False,
    max_seq_len=16,
)
# The loader reads through a scratch of this size (safetensors.SCRATCH_BYTES, 16 MiB by default),
# small here so that the bound below sits well under the largest shard.
SCRATCH_BYTES = 2**18


def test_each_process_holds_its_shards_and_a_scratch_while_loading(tmp_path):
    """Each process's peak resident memory while loading exceeds its resident memory before by
    at most its devices' share plus a fixed buffer: the CPU backend adopts each shard's host
    buffer as the device's (no copy), and the reads go through two scratch-sized buffers at
    most (a chunk of whole rows and the part of it kept), so nothing else slice-sized is held.

    The bound: share + 2 x scratch + half the largest shard (4 MiB) for the runtime's and
    Python's own allocations while loading (measured: 0.74 MiB beyond the share in all, the
    two scratches included). A loader that held the head's
    shard a second time (a copy to the device, a slice-sized temporary, the whole tensor) would
    go over by a whole largest shard at least (8 MiB), twice the allowance."""
    model = dew.models.build("causal_transformer", **MEMORY_CONFIG)
    abstract = jax.eval_shape(model.init, jax.random.key(0))
    params = jax.tree_util.tree_map(lambda a: np.full(a.shape, 0.5, a.dtype), abstract)
    hf.save(model, params, tmp_path / "llama", max_shard_bytes=64 * 2**20)
    del params
    run_two("hf_load_worker.py", tmp_path / "llama", tmp_path, SCRATCH_BYTES)
    for process in range(2):
        memory = json.loads((tmp_path / f"memory_{process}.json").read_text())
        assert memory["largest"] == 8 * 2**20, memory
        bound = memory["share"] + 2 * SCRATCH_BYTES + memory["largest"] // 2
        growth = memory["peak"] - memory["baseline"]
        assert growth <= bound, (
            f"process {process}: peak resident memory grew by {growth / 2**20:.1f} MiB while "
            f"loading, over its devices' share + 2 scratch + allowance, {bound / 2**20:.1f} MiB "
            f"({memory})"
        )
