"""Bookkeeping that lets the kernels run inside `jax.shard_map` with `check_vma=True`.

Inside a shard_map every value carries the set of mesh axes it varies over. A `pallas_call`
cannot infer that set for its outputs, so each output declares it (the `ShapeDtypeStruct` built
by `out_struct`). Before the kernels run, q, k and v are cast to one common set
(`match_varying`): autodiff of that cast outside the custom_vjp then sums a gradient over any axis
its input did not vary over, which is what the transpose of "replicated -> varying" means.

Where that set lives in a value's type changed between JAX releases; `dew._jax_compat` reads
it. Outside shard_map the set is empty and nothing is cast.
"""

from __future__ import annotations

import jax

from dew._jax_compat import shape_dtype_struct_varying_like, varying_axes


def match_varying(*xs):
    """Cast each array to vary over the union of the axes any of them varies over."""
    union = frozenset().union(*(varying_axes(x) for x in xs))
    out = []
    for x in xs:
        missing = tuple(sorted(union - varying_axes(x)))
        out.append(jax.lax.pcast(x, missing, to="varying") if missing else x)
    return tuple(out)


def out_struct(shape, dtype, like) -> jax.ShapeDtypeStruct:
    """A `pallas_call` output spec that varies over the same mesh axes as `like`."""
    return shape_dtype_struct_varying_like(shape, dtype, like)
