"""``dew.parallel.gspmd_kernel``: the GSPMD baseline's attention kernel in a shard_map.

On the CPU the kernels run interpreted and need no wrapper; these tests put it on anyway (the
interpreted Pallas kernel in it), so that what a TPU or GPU runs is checked here: its split, the
bytes it moves (none, on the pinned activations' split) and the GSPMD step through it against
the one-device reference. tests/test_kernels_tpu.py checks that a GSPMD step compiled for a TPU
slice runs the Mosaic kernels through it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dew
from dew.nn import attention
from dew.objectives.lm import LMObjective
from dew.parallel import gspmd_kernel, ragged
from tests.equivalence import assert_matches, layout_case, reference_run, sharded_run
from tests.helpers import SEQ, VOCAB, relative_error, smooth_optimizer


def test_the_split_is_the_batch_axes_and_the_heads_where_tensor_divides_them():
    mesh = jax.make_mesh(
        (2, 1, 2, 2, 1, 1), ("data", "expert", "fsdp", "tensor", "sequence", "stage")
    )
    # [batch, heads, seq, head_dim]: the model's layout.
    assert gspmd_kernel.call_spec(mesh, 4, 2) == P(("data", "fsdp"), "tensor", None, None)
    # 3 kv heads do not split over 2 devices: the heads stay whole.
    assert gspmd_kernel.call_spec(mesh, 6, 3) == P(("data", "fsdp"), None, None, None)
    one = jax.make_mesh(
        (1, 1, 1, 1, 1, 1), ("data", "expert", "fsdp", "tensor", "sequence", "stage")
    )
    assert gspmd_kernel.call_spec(one, 4, 2) == P(None, None, None, None)


def test_the_wrapped_kernel_is_attention_and_moves_nothing_on_its_split(seed):
    """On packed rows: each row's segment ids (documents of random lengths) go to the kernel on
    the row's device. The Mosaic kernels (in TPU interpret mode), which the wrapper runs on a TPU
    slice. (The GSPMD step below runs the wrapper without ids.)"""
    print(f"seed {seed}")
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"))
    spec = gspmd_kernel.call_spec(mesh, 4, 2)
    keys = jax.random.split(jax.random.key(seed), 3)
    shapes = [(8, 4, 32, 16), (8, 2, 32, 16), (8, 2, 32, 16)]  # [batch, heads, seq, head_dim]
    q, k, v = (jax.random.normal(key, shape, jnp.float32) for key, shape in zip(keys, shapes))
    rng = np.random.default_rng(seed)
    ids = np.cumsum(rng.random((8, 32)) < 0.15, axis=1).astype(np.int32)
    wrapped = gspmd_kernel.kernel_on_mesh(attention.IMPLEMENTATIONS["pallas_tpu_interpret"], 4, 2)

    def run(q, k, v, ids):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return wrapped(q, k, v, causal=True, segment_ids=ids)[0]

    placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)]
    placed.append(jax.device_put(ids, NamedSharding(mesh, P(spec[0], None))))
    compiled = jax.jit(run).lower(*placed).compile()
    got = compiled(*placed)
    want, _ = attention.xla_attention(q, k, v, causal=True, segment_ids=ids, layout="bhsd")
    assert relative_error(got, want) < 1e-5
    # q, k and v arrive split as the call wants them: no collective at all.
    hlo = compiled.as_text()
    moved = [
        op for op in ("all-gather", "all-reduce", "all-to-all", "collective-permute") if op in hlo
    ]
    assert not moved, moved


@pytest.fixture(scope="module")
def case(module_seed):
    return layout_case(module_seed)


def test_the_gspmd_step_through_the_wrapper_equals_one_device(case, seed, monkeypatch):
    # The wrapper forced on the CPU (its rule keeps it for a kernel that is a custom call).
    monkeypatch.setattr(
        gspmd_kernel,
        "wraps",
        lambda impl, platform: impl == "pallas" and ragged.partitioned_devices() > 1,
    )
    model = dew.models.build(
        "causal_transformer",
        vocab_size=VOCAB,
        emb_features=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        max_seq_len=SEQ,
        attention_impl="pallas",
    )
    objective = LMObjective(model, SEQ)
    key, batches, _ = case
    reference = reference_run(objective, smooth_optimizer(), key, batches)
    mesh = dew.MeshSpec(data=2, fsdp=2, tensor=2)
    # From the reference's initial weights (the trainer's initialisation, the same for every
    # engine, is checked against them in tests/test_equivalence.py): the step is the one program
    # compiled.
    run = sharded_run(
        objective, smooth_optimizer(), key, batches, mesh, reference["initial"], engine="gspmd"
    )
    assert_matches(run, reference, seed, "gspmd, the kernel in a shard_map")
    # And the wrapper was in the step: its shard_map shows in the step's jaxpr.
    trainer = dew.Trainer(objective, smooth_optimizer(), key, mesh=mesh, engine="gspmd")
    jaxpr = jax.make_jaxpr(trainer.train_step(32))(*trainer.step_arguments(32))
    assert "shard_map" in str(jaxpr)
