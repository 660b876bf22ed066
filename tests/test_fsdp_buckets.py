"""How finely ``dew.parallel.fsdp.gather`` gathers: small weights share an ``all_gather``, a weight
above ``BUCKET_BYTES`` travels alone, and either way every weight comes back whole and exact."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import dew
from dew.mesh import build_mesh
from dew.parallel import Shards, fsdp


@pytest.mark.parametrize(
    "sizes, limit, expected",
    [
        ([1, 2, 3, 10, 1, 1], 4, [[0, 1], [2], [3], [4, 5]]),  # 10 > 4 alone; 3 + 10 would pass
        ([4, 4], 8, [[0, 1]]),  # exactly the limit still fits
        ([5], 4, [[0]]),
        ([], 4, []),
    ],
)
def test_buckets_pack_in_order_up_to_the_limit(sizes, limit, expected):
    assert fsdp.buckets(sizes, limit) == expected


def test_a_weight_above_the_limit_is_gathered_alone(monkeypatch, seed):
    mesh = build_mesh(dew.MeshSpec(fsdp=4))
    rng = np.random.default_rng(seed)
    layout = {  # name: (whole shape, spec); float32, so bytes = 4 x elements
        "small_a": ((8, 4), P("fsdp")),  # 128 B
        "small_b": ((4, 8), P(None, "fsdp")),  # 128 B
        "large": ((16, 32), P(None, "fsdp")),  # 2 KiB
        "small_c": ((2, 4, 8), P(None, None, "fsdp")),  # 256 B
    }
    full = {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, (s, _) in layout.items()}
    specs = {k: spec for k, (_, spec) in layout.items()}
    shards = Shards(axis_sizes=dict(mesh.shape), param_specs=specs)
    monkeypatch.setattr(fsdp, "BUCKET_BYTES", 1024)

    def gather_step():
        """The gather on the mesh, traced anew so that it reads ``BUCKET_BYTES`` as now set."""
        return jax.jit(
            jax.shard_map(
                lambda tree: fsdp.gather(tree, specs, shards),
                mesh=mesh,
                in_specs=(specs,),
                out_specs={k: P() for k in specs},
                check_vma=False,
            )
        )

    step = gather_step()
    for k, w in step(full).items():
        np.testing.assert_array_equal(
            np.asarray(w), np.asarray(full[k]), err_msg=f"{k}, seed {seed}"
        )
    report = dew.collectives(step, full)
    # Leaves in key order (large, small_a, small_b, small_c), whole 2048, 128, 128, 256 bytes:
    # [large] alone, then [small_a, small_b, small_c]; each device sends its quarter of each.
    assert report.count("all_gather", axis="fsdp") == 2 and report.count() == 2, str(report)
    (row,) = report.rows
    assert row.operand_bytes == (2048 + 128 + 128 + 256) // 4, str(report)

    monkeypatch.setattr(fsdp, "BUCKET_BYTES", 4096)  # everything fits one bucket
    report = dew.collectives(gather_step(), full)
    assert report.count("all_gather", axis="fsdp") == 1, str(report)
