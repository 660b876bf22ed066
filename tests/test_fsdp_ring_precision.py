"""The fsdp ring's weight-gradient blocks come from float32 matmuls (``preferred_element_type``)
of bfloat16 activations, so the sum round the ring starts from each device's unrounded gradient
(``dew.parallel.fsdp_matmul``). On CPU a bfloat16 matmul is computed in float32 anyway (excess
precision), so the numbers cannot show a lost ``preferred_element_type``: the jaxpr's dtypes do."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from dew.parallel.fsdp_matmul import RingSplit

N = 8


def dot_generals(jaxpr):
    """Every ``dot_general`` equation of ``jaxpr`` and the jaxprs inside it (shard_map, custom
    vjp, pjit), in order."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from dot_generals(inner)


@pytest.mark.parametrize("spec, dim", [("te,ef->tf", 0), ("tf,fe->te", 1)])
def test_each_weight_gradient_block_is_a_float32_matmul(spec, dim):
    mesh = Mesh(np.array(jax.devices()[:N]), ("fsdp",))
    x_labels, w_labels, out_labels = spec.replace("->", ",").split(",")
    sizes = dict(t=4, e=16, f=32)

    def local(shard, x, d_out):
        _, pullback = jax.vjp(lambda x, s: RingSplit(s, dim, N).einsum(spec, x), x, shard)
        return pullback(d_out)[1]

    w_spec = P(*([None] * dim), "fsdp")
    step = jax.shard_map(
        local, mesh=mesh, in_specs=(w_spec, P(), P()), out_specs=w_spec, check_vma=False
    )
    w = jax.ShapeDtypeStruct([sizes[c] for c in w_labels], jnp.float32)
    x = jax.ShapeDtypeStruct([sizes[c] for c in x_labels], jnp.bfloat16)
    d_out = jax.ShapeDtypeStruct([sizes[c] for c in out_labels], jnp.bfloat16)
    jaxpr = jax.make_jaxpr(step)(w, x, d_out).jaxpr
    # The backward's matmuls: dx (bfloat16, as x) and one block of dW per ring step, which
    # produce their [e, f] / [f, e] block (a 1 / N slice of the weight) in float32.
    block = tuple(sizes[c] // (N if i == dim else 1) for i, c in enumerate(w_labels))
    blocks = [eqn for eqn in dot_generals(jaxpr) if eqn.outvars[0].aval.shape == block]
    assert len(blocks) == N, [str(e) for e in dot_generals(jaxpr)]
    for eqn in blocks:
        assert eqn.params["preferred_element_type"] == jnp.float32, eqn
        assert eqn.outvars[0].aval.dtype == jnp.float32, eqn
        assert all(v.aval.dtype == jnp.bfloat16 for v in eqn.invars), eqn
