"""One training run on eight devices, laid out two ways, and a checkpoint carried between them.

    python docs/examples/scale_across_devices.py [--workdir DIR]

What it shows, in order:

1. Two meshes over the same eight devices: all ``data`` (every device holds whole weights) and all
   ``fsdp`` (every device holds 1/8 of each weight). Both split a batch's rows eight ways.
2. Where the token embedding table (256 x 64) lands in each: whole on every device, or 32 rows each.
3. The same small decoder trained 20 steps in each layout: the printed losses are the same, because
   every layout computes what one device computes.
4. The data-parallel run's checkpoint restored into the fully sharded layout (the weights come back
   bit for bit), and training continued from its step 20 to step 30.

The devices are eight simulated CPU devices, so no accelerator is needed; on real GPUs or TPU
chips, drop ``cpu_devices`` and the code is the same. Everything is written in a fresh temporary
folder, removed at the end, or in ``DIR`` (kept) when ``--workdir`` is given.
tests/test_example.py runs this file and checks the lines it prints.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import jax
import numpy as np
import optax

from dew import Checkpoints, Layout, MeshSpec, Trainer, models
from dew.data import Loading, TokenWindows, write_example_corpus
from dew.mesh import build_mesh
from dew.objectives.lm import LMObjective
from dew.training.runtime import prepare_process

STEPS = 20  # both layouts train to this step; the restored run goes MORE_STEPS further
MORE_STEPS = 10
LOG_EVERY = 10
BATCH = 16  # rows of a global batch: 2 per device on 8 devices
SEQ_LEN = 32
VOCAB, WIDTH, LAYERS, HEADS = 256, 64, 2, 4

# The default min_shard (65,536 elements) would keep every weight of this small model whole; 1
# splits all of them, so the placement is visible.
LAYOUT = Layout(min_shard=1)
LAYOUTS = {"data parallel": MeshSpec(fsdp=1), "fully sharded": MeshSpec(fsdp=8)}


def show_placement(model) -> None:
    """Prints each mesh's axis sizes, then the spec of the embedding table placed on it."""
    meshes = {name: build_mesh(spec) for name, spec in LAYOUTS.items()}
    for name, mesh in meshes.items():
        print(f"{name}:", dict(mesh.shape))

    # The placement comes from the names the model gives each weight's dimensions (the table's are
    # vocab, embed), so only shapes are needed: nothing is initialised here.
    abstract = jax.eval_shape(model.init, jax.random.key(0))
    table = np.ones(abstract["params"]["embed_tokens"]["embedding"].shape, np.float32)
    for name, mesh in meshes.items():
        shardings = LAYOUT.shardings(mesh, abstract, model.logical_axes())
        placed = jax.device_put(table, shardings["params"]["embed_tokens"]["embedding"])
        print(name, placed.sharding.spec)
        draw(placed)


def draw(array) -> None:
    """Draws which device holds which block of ``array``, when ``rich`` is installed (the ``viz``
    extra)."""
    try:
        import rich  # noqa: F401
    except ImportError:
        return
    jax.debug.visualize_array_sharding(array)


def describe(state) -> None:
    """Prints the embedding table's spec and, for three devices, the rows each holds."""
    table = state.params["params"]["embed_tokens"]["embedding"]
    print("spec:", table.sharding.spec)
    for shard in table.addressable_shards[:3]:
        print(f" {shard.device}: rows {shard.index[0]}, local shape {shard.data.shape}")


def trainer(objective, mesh: MeshSpec, checkpoint_dir: Path) -> Trainer:
    # Same key and same optimizer for every trainer: only the mesh (and where it saves) differs.
    return Trainer(
        objective,
        optax.adamw(1e-3),
        key=jax.random.key(0),
        mesh=mesh,
        layout=LAYOUT,
        checkpoints=Checkpoints(checkpoint_dir),
    )


def same_weights(a, b) -> bool:
    return all(
        np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True)
    )


def run(workdir: Path) -> None:
    print(jax.devices())
    model = models.build(
        "causal_transformer",
        vocab_size=VOCAB,
        emb_features=WIDTH,
        num_layers=LAYERS,
        num_heads=HEADS,
        max_seq_len=SEQ_LEN,
        dtype="float32",
        attention_impl="xla",
    )
    show_placement(model)

    # The generated corpus of short sentences that `dew train` also uses, byte-tokenized.
    write_example_corpus(workdir / "tokens")
    data = TokenWindows(
        workdir / "tokens", seq_len=SEQ_LEN, loading=Loading(workers=0, threads=1)
    ).load(batch=BATCH)
    print("training windows:", data.records)

    objective = LMObjective(model, SEQ_LEN)
    runs = workdir / "runs"
    replicated = trainer(objective, LAYOUTS["data parallel"], runs / "replicated")
    replicated_state = replicated.fit(data, steps=STEPS, log_every=LOG_EVERY)
    describe(replicated_state)

    sharded = trainer(objective, LAYOUTS["fully sharded"], runs / "sharded")
    describe(sharded.fit(data, steps=STEPS, log_every=LOG_EVERY))

    # A fully sharded trainer reading the data-parallel run's checkpoints: place() cuts each saved
    # array into the pieces this mesh asks for, and fit() resumes where that run stopped.
    crossed = trainer(objective, LAYOUTS["fully sharded"], runs / "replicated")
    restored, _, _ = crossed.place()
    describe(restored)
    print(
        "restored weights equal the data-parallel run's:",
        same_weights(restored.params, replicated_state.params),
    )
    continued = crossed.fit(data, steps=STEPS + MORE_STEPS, log_every=LOG_EVERY)
    print("continued to step", int(continued.step))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workdir", type=Path, default=None, help="write here and keep it (default: a temp folder)"
    )
    args = parser.parse_args(argv)
    # XLA reads the device count when JAX first creates its backends (at the first device query,
    # not at import), so this comes before any JAX call.
    prepare_process(cpu_devices=8)
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
        run(args.workdir.resolve())
        return
    with tempfile.TemporaryDirectory(prefix="dew-example-") as tmp:
        run(Path(tmp))


if __name__ == "__main__":
    main()
