"""The collectives of the expert-parallel step against the formulas of docs/collectives.md.

The expected rows are computed here from the model's sizes, the batch and the layout (never read
off a run) and compared with ``trainer.collectives(...)`` exactly: the ``all_to_all`` s over
``expert`` (count, padded operand bytes, ring wire bytes) and the ``psum`` s over ``expert`` (the
gradients of every weight but the experts', the router's expert counts, the loss and router
statistics). Variants (a padded buffer one slot larger, expert gradients summed over ``expert``)
show that the comparison catches each. Everything is traced, nothing compiled or run.
"""

import math
import types

import jax
import jax.numpy as jnp
import optax
import pytest

import dew
from dew.layout import path_names
from dew.nn import moe
from dew.parallel import data as data_parallel
from dew.parallel import expert
from tests.helpers import SEQ, tiny_objective

BATCH = 16
DATA = types.SimpleNamespace(batch_size=BATCH, seq_len=SEQ)
E = expert.AXIS

# name: (mesh, model overrides, accumulation)
LAYOUTS = {
    "expert=8": (dew.MeshSpec(expert=8), {}, 1),
    "expert=4,fsdp=2,accumulation=2": (dew.MeshSpec(expert=4, fsdp=2), {}, 2),
    "expert=2,tensor=2,capacity": (dew.MeshSpec(expert=2, tensor=2), {"capacity_factor": 1.0}, 1),
    "expert=4,moe_every=2": (dew.MeshSpec(expert=4), {"moe_every": 2}, 1),
}


def make_trainer(name):
    mesh, overrides, accumulation = LAYOUTS[name]
    return dew.Trainer(
        tiny_objective(num_experts=8, experts_per_token=2, **overrides),
        optax.sgd(0.1),
        key=jax.random.key(0),
        mesh=mesh,
        layout=dew.Layout(min_shard=1),
        accumulation=accumulation,
    )


def expected_all_to_alls(trainer):
    """``(count, operand bytes)`` of the step's all_to_alls over ``expert``.

    Per MoE layer and microbatch, on ``n`` devices, ``T = rows x seq`` tokens routed to ``k``
    experts each, ``B`` slots per destination (``T k`` dropless; ``min(T k, rows x capacity x E /
    n)`` with a capacity): the dispatch and combine of ``[n, B, embed]`` activations, again in the
    backward's recompute (each layer is rematerialized), and their two transposes: 6 calls of ``n
    B embed`` elements; the int32 ``[n, B]`` of each slot's expert, forward and recompute: 2 calls.
    """
    sizes = dict(trainer.mesh.shape)
    model = trainer.objective.model
    n = sizes[E]
    rows = BATCH // (sizes["data"] * sizes[E] * sizes["fsdp"] * trainer.accumulation)
    limit = None
    if model.capacity_factor is not None:
        limit = moe.capacity(SEQ, model.experts_per_token, model.num_experts, model.capacity_factor)
    slots = expert.exchange_slots(rows, SEQ, model.experts_per_token, model.num_experts, n, limit)
    calls = trainer.accumulation * model.num_moe_layers
    itemsize = jnp.dtype(model.dtype).itemsize
    activations = 6 * calls * n * slots * model.emb_features * itemsize
    expert_ids = 2 * calls * n * slots * 4
    return 8 * calls, activations + expert_ids


def expected_psums_over_expert(trainer):
    """``(count, operand bytes)`` of the psums whose axes include ``expert``.

    The gradient of every weight not split over ``expert`` (a weight split over fsdp sends its
    local shard), one psum per array; the expert counts ``[E]`` float32 of each MoE layer (forward
    and recompute) per microbatch; the loss and the four router sums (float32 scalars). The experts'
    own gradients never cross ``expert``.
    """
    state, _ = trainer.step_arguments(BATCH)
    specs = trainer.param_specs
    count = grad_bytes = 0
    for (path, leaf), spec in zip(
        jax.tree_util.tree_flatten_with_path(state.params)[0],
        jax.tree_util.tree_leaves(
            specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)
        ),
    ):
        if "experts" in path_names(path):
            continue
        split = math.prod(
            trainer.mesh.shape[a]
            for entry in spec
            for a in (entry if isinstance(entry, tuple) else (entry,))
            if a is not None
        )
        count += 1
        grad_bytes += leaf.size * leaf.dtype.itemsize // split
    model = trainer.objective.model
    counts = 2 * trainer.accumulation * model.num_moe_layers
    return count + counts + 5, grad_bytes + counts * model.num_experts * 4 + 5 * 4


def rows_over_expert(report, op):
    rows = [row for row in report.rows if row.op == op and E in row.axes]
    return sum(r.count for r in rows), sum(r.operand_bytes for r in rows), rows


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_expert_collectives_match_the_formula(name):
    trainer = make_trainer(name)
    report = trainer.collectives(DATA)
    n = trainer.mesh.shape[E]

    count, operand, rows = rows_over_expert(report, "all_to_all")
    assert (count, operand) == expected_all_to_alls(trainer), (name, rows)
    assert all(row.axes == (E,) for row in rows), rows
    assert sum(r.wire_bytes for r in rows) == operand * (n - 1) // n, rows

    assert (rows_over_expert(report, "psum")[:2]) == expected_psums_over_expert(trainer), (
        name,
        report,
    )
    # Nothing else crosses the expert axis: no weight is gathered over it.
    others = [row for row in report.rows if E in row.axes and row.op not in ("psum", "all_to_all")]
    assert not others, others


def test_a_larger_buffer_shows(monkeypatch):
    trainer = make_trainer("expert=8")
    honest = rows_over_expert(trainer.collectives(DATA), "all_to_all")[:2]
    assert honest == expected_all_to_alls(trainer)
    slots = expert.exchange_slots
    monkeypatch.setattr(expert, "exchange_slots", lambda *args: slots(*args) + 1)
    padded = rows_over_expert(make_trainer("expert=8").collectives(DATA), "all_to_all")[:2]
    assert padded != honest, (padded, honest)


def test_expert_gradients_summed_over_expert_show(monkeypatch):
    trainer = make_trainer("expert=8")
    sum_axes = data_parallel.sum_axes

    def also_experts(spec, shards, **kwargs):
        axes = sum_axes(spec, shards, **kwargs)
        named = {
            a
            for entry in tuple(spec or ())
            for a in (entry if isinstance(entry, tuple) else (entry,))
        }
        return axes + (E,) if E in named else axes

    monkeypatch.setattr(data_parallel, "sum_axes", also_experts)
    report = make_trainer("expert=8").collectives(DATA)
    assert rows_over_expert(report, "psum")[:2] != expected_psums_over_expert(trainer)
