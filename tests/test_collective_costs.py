"""The collectives of Dew's training step against the cost formulas of docs/collectives.md.

The expected report is computed here from the parameters' shapes and the layout's specs (never from
numbers read off a run), then compared with ``trainer.collectives(...)``: the same (op, axes) rows,
the gathers and scatters counted exactly, bytes exactly (measured: no layout here is off by a
byte). Variant steps (a psum added, dropped,
moved to another axis; the backward's re-gather dropped) show that the comparison catches each.
The GSPMD baseline must give the shard_map engine's losses, its collectives read from the HLO.
"""

import fractions
import math
import re
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import SEQ, fresh_batch, tiny_objective
from jax import lax
from jax.sharding import PartitionSpec as P

import dew
from dew.collectives import OPS, CollectiveReport, CollectiveRow
from dew.layout import path_names
from dew.mesh import AXES, build_mesh
from dew.parallel import Shards, fsdp
from dew.parallel import data as data_parallel

BATCH = 16
DATA = types.SimpleNamespace(batch_size=BATCH, seq_len=SEQ)
# Splits every matrix and keeps the norm scales (64 and 32 elements) whole, so both of the
# gradient sums of dew.parallel.data run: the split weights' over data, the whole ones' over all.
MIN_SHARD = 256
LOSS_BYTES = 4  # the float32 loss, psummed over the batch axes

LAYOUTS = {
    "data=8": dew.MeshSpec(),
    "fsdp=8": dew.MeshSpec(fsdp=8),
    "data=2,fsdp=4": dew.MeshSpec(fsdp=4),
}


@pytest.fixture(scope="module")
def objective():
    return tiny_objective()


@pytest.fixture(scope="module")
def traced(objective):
    """``traced(name)``: the collectives of the shard_map step of ``LAYOUTS[name]``, as
    ``trainer.collectives`` reads them from its jaxpr, traced once for the module: the formula
    tests, the checks' honest reports and the GSPMD comparison read the same three steps (a
    trainer traces its step again for each report). Tests that patch the step trace their own."""
    reports = {}

    def report(name):
        if name not in reports:
            reports[name] = make_trainer(objective, LAYOUTS[name]).collectives(DATA)
        return reports[name]

    return report


def make_trainer(objective, mesh, engine="shard_map", accumulation=1):
    return dew.Trainer(
        objective,
        optax.adamw(1e-3),
        key=jax.random.key(0),
        mesh=mesh,
        layout=dew.Layout(min_shard=MIN_SHARD),
        engine=engine,
        accumulation=accumulation,
    )


# ------------------------------------------------------------------------------------------------
# The formula of docs/collectives.md, computed from the parameters and their specs


def weights(trainer):
    """``(path, bytes, layers or None, split over fsdp, dtype)`` for every parameter of
    ``trainer``."""
    params = jax.eval_shape(trainer.objective.model.init, jax.random.key(0))
    specs = jax.tree_util.tree_leaves(
        trainer.param_specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)
    )
    found = []
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    for (path, leaf), spec in zip(leaves, specs, strict=True):
        names = path_names(path)
        stacked = leaf.shape[0] if names[:2] == ("params", "layers") else None
        nbytes = math.prod(leaf.shape) * leaf.dtype.itemsize
        found.append((names, nbytes, stacked, fsdp.is_split(spec), leaf.dtype))
    return found


def buckets(trainer):
    """``{(gathered with, dtype): (bytes, layers or None)}`` of the weights split over fsdp.

    The model gathers each top-level parameter (``embed_tokens``, ``layers``, ``lm_head``) in a call
    of its own, and one call sends all its split weights of one dtype in one ``all_gather``.
    """
    found = {}
    for names, nbytes, layers, split, dtype in weights(trainer):
        if split:
            key = (names[1], dtype)
            found[key] = (found.get(key, (0, layers))[0] + nbytes, layers)
    return found


def expected_collectives(trainer) -> CollectiveReport:
    """The report docs/collectives.md predicts for ``trainer``'s step.

    Per device, with ``W`` a weight's bytes, ``n_d``/``n_f`` the data/fsdp sizes, ``N = n_d n_f``
    and ``k`` microbatches; a bucket is the split weights of one dtype that one gather call sends
    together (``buckets``), ``B`` their bytes:

    - a bucket of the layer scan (``L`` layers): ``2 L k`` gathers of ``B / (L n_f)`` (forward, and
      again in the rematerialized backward) and ``L k`` scatters of ``B / L``;
    - a bucket outside the scan: ``k`` gathers of ``B / n_f``, ``k`` scatters of ``B``;
    - split: ``W / n_f`` psummed over data: for a bucket of the scan, when each layer runs once a
      step (``k = 1``), by the transpose of its gather, ``L`` psums of ``B / (L n_f)`` inside the
      scan; otherwise one psum per weight after the backward;
    - whole: one psum of ``W`` over data and fsdp;
    - the loss: one psum of 4 bytes over data and fsdp.

    ``fewest_calls`` gives the least number of calls each psum row may show.
    """
    sizes = dict(trainer.mesh.shape)
    n_f, k = sizes["fsdp"], trainer.accumulation
    batch_axes = tuple(a for a in ("data", "fsdp") if sizes[a] > 1)
    tallies = {}

    def add(op, axes, count, operand, wire_per_byte):
        if not axes:
            return
        count_, operand_, wire_ = tallies.get((op, axes), (0, 0, fractions.Fraction(0)))
        tallies[(op, axes)] = (count_ + count, operand_ + operand, wire_ + wire_per_byte * operand)

    def ring(axes, factor):
        n = math.prod(sizes[a] for a in axes)
        return factor * fractions.Fraction(n - 1, n)

    in_loop = summed_in_loop(trainer)
    for nbytes, layers in buckets(trainer).values():
        calls = (layers or 1) * k
        gathers = 2 * calls if layers else calls
        shard = nbytes // ((layers or 1) * n_f)
        add("all_gather", ("fsdp",), gathers, gathers * shard, n_f - 1)
        scatter = nbytes // (layers or 1)
        add("psum_scatter", ("fsdp",), calls, calls * scatter, ring(("fsdp",), 1))
        if layers and in_loop:
            add("psum", ("data",), layers, layers * shard, ring(("data",), 2))
    for _, nbytes, layers, split, _ in weights(trainer):
        if not split:
            add("psum", batch_axes, 1, nbytes, ring(batch_axes, 2))
        elif sizes["data"] > 1 and not (layers and in_loop):
            add("psum", ("data",), 1, nbytes // n_f, ring(("data",), 2))
    add("psum", batch_axes, 1, LOSS_BYTES, ring(batch_axes, 2))
    rows = [
        CollectiveRow(op, axes, count, operand, int(round(wire)))
        for (op, axes), (count, operand, wire) in tallies.items()
    ]
    return CollectiveReport(tuple(rows), tuple(sizes), tuple(sizes.values()))


def summed_in_loop(trainer) -> bool:
    """Whether the layer scan's split gradients are summed over data inside the scan: data and
    fsdp above 1 and each layer run once a step (one microbatch, no pipeline)."""
    sizes = dict(trainer.mesh.shape)
    once = trainer.accumulation == 1 and sizes.get("stage", 1) == 1
    return sizes["data"] > 1 and sizes["fsdp"] > 1 and once


def fewest_calls(trainer) -> dict:
    """``{(op, axes): calls}``: the fewest calls a psum row of ``expected_collectives`` may show.

    A psum after the backward may bind all its arrays in one call; one inside the scan runs once a
    layer whatever it binds, so the scan's ``L`` calls per bucket are the least."""
    fewest = {}
    if summed_in_loop(trainer):
        tail = any(split and not layers for _, _, layers, split, _ in weights(trainer))
        loop = sum(layers for _, layers in buckets(trainer).values() if layers)
        fewest[("psum", ("data",))] = loop + int(tail)
    return fewest


def whole_bytes(trainer) -> int:
    return sum(nbytes for _, nbytes, _, split, _ in weights(trainer) if not split)


def cost_problems(
    report: CollectiveReport, expected: CollectiveReport, fewest: dict | None = None
) -> list[str]:
    """What separates ``report`` from the formula: empty when it matches.

    Rows are matched by (op, axes); a row only one side has is a problem (``expected.diff``'s ``+``
    and ``-`` lines). Gathers and scatters are counted exactly. A psum may bind its arrays as one
    call or one call each (JAX 0.10 binds one per array; XLA combines them when it compiles), so its
    count may be anything from ``fewest`` (``fewest_calls``: the scan's psums run once a layer; 1
    by default) to the number of arrays. Bytes must be exact.
    """
    fewest = fewest or {}
    problems = [line for line in expected.diff(report) if line[0] in "+-"]
    mine = {(row.op, row.axes): row for row in report.rows}
    for want in expected.rows:
        got = mine.get((want.op, want.axes))
        if got is None:
            continue
        where = f"{want.op} over {','.join(want.axes)}"
        if want.op == "psum":
            least = fewest.get((want.op, want.axes), 1)
            if not least <= got.count <= want.count:
                problems.append(f"{where}: {got.count} calls, expected {least} to {want.count}")
        elif got.count != want.count:
            problems.append(f"{where}: {got.count} calls, expected {want.count}")
        for field in ("operand_bytes", "wire_bytes"):
            g, w = getattr(got, field), getattr(want, field)
            if g != w:
                problems.append(f"{where}: {field} {g}, expected {w}")
    return problems


# ------------------------------------------------------------------------------------------------
# The shard_map step against the formula


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_step_collectives_match_the_formula(objective, traced, name):
    trainer = make_trainer(objective, LAYOUTS[name])
    report = traced(name)
    expected = expected_collectives(trainer)
    assert expected.rows, "the formula predicts no collective at all"
    problems = cost_problems(report, expected, fewest_calls(trainer))
    assert problems == [], f"{name}:\n{report}\nexpected:\n{expected}"
    assert report.wire_bytes() == expected.wire_bytes()


def test_data_parallel_step_only_sums_gradients_over_data(objective, traced):
    trainer = make_trainer(objective, LAYOUTS["data=8"])
    report = traced("data=8")
    assert report.count("all_gather") == 0 and report.count("psum_scatter") == 0, str(report)
    assert {row.op for row in report.rows} == {"psum"}
    assert {row.axes for row in report.rows} == {("data",)}
    param_bytes = sum(nbytes for _, nbytes, _, _, _ in weights(trainer))
    assert report.operand_bytes("psum", axis="data") == param_bytes + LOSS_BYTES


@pytest.mark.parametrize("name", ["fsdp=8", "data=2,fsdp=4"])
def test_fsdp_step_never_psums_split_gradients_over_fsdp(objective, traced, name):
    trainer = make_trainer(objective, LAYOUTS[name])
    report = traced(name)
    split = [nbytes for _, nbytes, _, is_split, _ in weights(trainer) if is_split]
    assert split and whole_bytes(trainer) > 0, (
        "the layout should split some weights, keep some whole"
    )
    # Over fsdp only the whole weights' gradients and the loss are all-reduced...
    assert report.operand_bytes("psum", axis="fsdp") == whole_bytes(trainer) + LOSS_BYTES, str(
        report
    )
    # ...the split ones come back reduce-scattered, one scatter per layer for all its weights.
    assert report.operand_bytes("psum_scatter", axis="fsdp") == sum(split)
    assert report.wire_bytes("all_gather", axis="data") == 0


def test_accumulation_multiplies_gathers_and_scatters_not_gradient_sums(objective):
    # 32 rows: 2 a device per microbatch, 32 tokens against the 16 table rows a device holds, so
    # both steps gather the table (with fewer tokens than table rows the embedding moves the
    # tokens instead: dew.parallel.vocabulary, tests/test_vocabulary.py).
    data = types.SimpleNamespace(batch_size=2 * BATCH, seq_len=SEQ)
    trainer = make_trainer(objective, dew.MeshSpec(fsdp=4), accumulation=2)
    report = trainer.collectives(data)
    assert cost_problems(report, expected_collectives(trainer)) == [], str(report)
    single = make_trainer(objective, dew.MeshSpec(fsdp=4)).collectives(data)
    assert report.count("all_gather") == 2 * single.count("all_gather")
    assert report.wire_bytes("psum") == single.wire_bytes("psum")


# ------------------------------------------------------------------------------------------------
# The check fails when a collective is added, dropped or moved


def sum_gradients_with(split_psums, whole_psums):
    """A stand-in for ``dew.parallel.data.sum_gradients``: the gradients of weights split over
    fsdp psummed over each axis tuple in ``split_psums`` in turn (but for those the layer loop
    summed, ``summed_in_loop``), those kept whole over ``whole_psums``."""

    def sum_gradients(grads, specs, shards, partial_over_tensor=None, summed_in_loop=None):
        leaves, treedef = jax.tree_util.tree_flatten(grads)
        in_loop = (
            [False] * len(leaves)
            if summed_in_loop is None
            else treedef.flatten_up_to(summed_in_loop)
        )
        out = []
        for g, spec, loop in zip(leaves, treedef.flatten_up_to(specs), in_loop):
            split = fsdp.is_split(spec)
            for axes in (() if loop else split_psums) if split else whole_psums:
                g = lax.psum(g, axes)
            out.append(g)
        return jax.tree_util.tree_unflatten(treedef, out)

    return sum_gradients


VARIANTS = {
    # name: (the axes the layer loop's gathers sum over besides fsdp (Shards.loop_sums), the
    # split gradients' psums after the backward, the whole ones', a line the check must print)
    "as the engine": (("data",), [("data",)], [("data", "fsdp")], None),
    "added": (("data",), [("data",), ("fsdp",)], [("data", "fsdp")], "+ psum over fsdp"),
    "dropped": ((), [], [("data", "fsdp")], "- psum over data:"),
    "moved": (("fsdp",), [("fsdp",)], [("data", "fsdp")], "- psum over data:"),
    # The layer loop's sum over another axis: the data row keeps the embedding's sum alone.
    "moved in the loop": (("fsdp",), [("data",)], [("data", "fsdp")], "+ psum over fsdp"),
    # The layer loop's sum after the backward, in one psum per weight (as before issue 33): the
    # same bytes, but no longer a psum per layer.
    "moved after the loop": ((), [("data",)], [("data", "fsdp")], "psum over data: "),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_check_fails_when_a_collective_is_added_dropped_or_moved(
    objective, traced, monkeypatch, variant
):
    loop_sums, split_psums, whole_psums, line = VARIANTS[variant]
    trainer = make_trainer(objective, LAYOUTS["data=2,fsdp=4"])
    expected, fewest = expected_collectives(trainer), fewest_calls(trainer)
    honest = traced("data=2,fsdp=4")  # traced before the patches below
    monkeypatch.setattr(fsdp, "loop_sum_axes", lambda shards, accumulation: loop_sums)
    monkeypatch.setattr(
        data_parallel, "sum_gradients", sum_gradients_with(split_psums, whole_psums)
    )
    report = make_trainer(objective, dew.MeshSpec(fsdp=4)).collectives(DATA)
    problems = cost_problems(report, expected, fewest)
    if line is None:
        assert report == honest and problems == [], "\n".join(honest.diff(report))
    else:
        assert report != honest
        assert any(p.startswith(line) for p in problems), problems
    if variant.startswith("moved"):
        assert any(p.startswith("+ psum over fsdp") for p in problems) == (
            variant != "moved after the loop"
        ), problems
    if variant == "moved in the loop":
        assert any(p.startswith("psum over data: operand_bytes") for p in problems), problems
    if variant == "moved after the loop":
        assert report.wire_bytes() == honest.wire_bytes(), "\n".join(honest.diff(report))
        assert any(p.startswith("psum over data: ") and "calls" in p for p in problems), problems


def gather_one_by_one(tree, specs, shards, also_sum=(), in_matmuls=(), int8=None):
    """A stand-in for ``dew.parallel.fsdp.gather``: one ``all_gather`` per split weight (a step
    without ``quantize="int8"``, so ``int8`` is ``None``)."""
    assert int8 is None, int8
    if specs is None or shards.size(fsdp.AXIS) == 1:
        return tree
    stages = tuple(shards.fsdp_scatter_stages)

    def whole(x, spec):
        dim = fsdp.split_dim(spec)
        if dim is None:
            return x
        # 0: no ring; None: summed in the weight's dtype.
        return fsdp._gather_summed(x, dim, True, stages, tuple(also_sum), dim, 0, None)

    return jax.tree_util.tree_map(whole, tree, specs)


def test_check_fails_when_weights_are_gathered_one_by_one(objective, monkeypatch):
    """The same bytes in one gather per weight instead of one per layer: the counts catch it."""
    trainer = make_trainer(objective, dew.MeshSpec(fsdp=8))
    expected = expected_collectives(trainer)
    monkeypatch.setattr(fsdp, "gather", gather_one_by_one)
    report = make_trainer(objective, dew.MeshSpec(fsdp=8)).collectives(DATA)
    assert report.wire_bytes() == expected.wire_bytes()
    problems = cost_problems(report, expected)
    assert any(p.startswith("all_gather over fsdp:") and "calls" in p for p in problems), problems
    assert any(p.startswith("psum_scatter over fsdp:") and "calls" in p for p in problems), problems


def test_check_fails_when_the_backward_keeps_gathered_weights(objective, monkeypatch):
    """Without the layer's ``jax.checkpoint`` autodiff saves the gathered weights: the backward's
    gathers disappear, and with them half the gathers' bytes the formula counts."""
    trainer = make_trainer(objective, dew.MeshSpec(fsdp=8))
    monkeypatch.setattr(jax, "checkpoint", lambda fn, **_: fn)
    report = make_trainer(objective, dew.MeshSpec(fsdp=8)).collectives(DATA)
    problems = cost_problems(report, expected_collectives(trainer))
    assert any(p.startswith("all_gather over fsdp:") and "calls" in p for p in problems), problems


def test_check_fails_against_another_layouts_formula(objective, traced):
    fsdp8 = traced("fsdp=8")
    other_formula = expected_collectives(make_trainer(objective, dew.MeshSpec(fsdp=4)))
    problems = cost_problems(fsdp8, other_formula)
    assert "- psum over data: " in "\n".join(problems)
    assert any(p.startswith("+ psum over fsdp") for p in problems), problems


# ------------------------------------------------------------------------------------------------
# dew.parallel.fsdp.gather on its own


def test_gather_sends_one_all_gather_per_dtype_and_rebuilds_every_weight():
    """Weights split on each of their dimensions, in two dtypes, and one kept whole, on data 2 x
    fsdp 4: one gather per dtype over fsdp rebuilds each weight exactly; the gradients come back in
    one reduce-scatter per dtype, summed over the fsdp group."""
    mesh = build_mesh(dew.MeshSpec(fsdp=4))
    rng = np.random.default_rng(0)
    layout = {  # name: (whole shape, spec, dtype)
        "a": ((8, 3, 5), P("fsdp"), jnp.float32),
        "b": ((3, 8, 5), P(None, "fsdp"), jnp.float32),
        "c": ((3, 5, 12), P(None, None, "fsdp"), jnp.float32),
        "d": ((6, 16), P(None, "fsdp"), jnp.bfloat16),
        "e": ((4, 8), P("fsdp"), jnp.bfloat16),
        "whole": ((7,), P(), jnp.float32),
    }
    full = {k: jnp.asarray(rng.standard_normal(s), t) for k, (s, _, t) in layout.items()}
    specs = {k: spec for k, (_, spec, _) in layout.items()}
    # Small integers: the 4-way sums of their gradients are exact in bfloat16 too.
    coeffs = {k: jnp.asarray(rng.integers(-8, 9, s), t) for k, (s, _, t) in layout.items()}
    shards = Shards(axis_sizes=dict(mesh.shape), param_specs=specs)

    def gathered(tree):
        return fsdp.gather(tree, specs, shards)

    def grads(tree):
        def loss(tree):
            return sum(
                jnp.sum(w * coeffs[k]).astype(jnp.float32) for k, w in gathered(tree).items()
            )

        return jax.grad(loss)(tree)

    def on_mesh(fn, out_specs):
        return jax.jit(
            jax.shard_map(fn, mesh=mesh, in_specs=(specs,), out_specs=out_specs, check_vma=False)
        )

    gather_step = on_mesh(gathered, {k: P() for k in specs})
    for k, w in gather_step(full).items():
        np.testing.assert_array_equal(np.asarray(w), np.asarray(full[k]), err_msg=k)
    report = dew.collectives(gather_step, full)
    assert report.count("all_gather", axis="fsdp") == 2 and report.count() == 2, str(report)
    split_bytes = sum(w.nbytes for k, w in full.items() if k != "whole")
    assert report.wire_bytes("all_gather") == 3 * split_bytes // 4

    grad_step = on_mesh(grads, specs)
    report = dew.collectives(grad_step, full)
    assert report.count("psum_scatter", axis="fsdp") == 2, str(report)
    assert report.count("all_gather") == 2 and report.count() == 4, str(report)
    for k, g in grad_step(full).items():
        # Each of the 4 devices of an fsdp group adds its own copy of the weight's gradient.
        want = np.asarray(coeffs[k], np.float32) * (1 if k == "whole" else 4)
        np.testing.assert_array_equal(np.asarray(g, np.float32), want, err_msg=k)


# ------------------------------------------------------------------------------------------------
# The GSPMD baseline


def changed_rows(changes: tuple[str, ...]) -> set[str]:
    """The rows a ``CollectiveReport.diff`` names, as ``"<sign> <op> over <axes>"``."""
    return {line.split(":", 1)[0] for line in changes}


# The rows the GSPMD step may add or drop against Dew's: XLA may sum the split weights' gradients
# over fsdp with an all-reduce where Dew reduce-scatters them (XLA on CPU forms no reduce-scatter).
# Anything else added (an all_to_all or pmax of activations, a gather over data) means the
# partitioner split the activations off the batch, which the pinned baseline must not do.
GRADIENT_REDUCTION_FORMS = {"- psum_scatter over fsdp", "+ psum over fsdp"}


def test_gspmd_losses_equal_shard_map_and_its_collectives_come_from_hlo(objective, traced, seed):
    batches = [fresh_batch(BATCH, seed=seed + i) for i in range(3)]
    # Initial weights depend on the key alone: build them once, and give each trainer its own copy,
    # laid out its way (the step donates it).
    initial = make_trainer(objective, dew.MeshSpec()).init_state()
    for name, mesh in LAYOUTS.items():
        losses, reports = {}, {}
        for engine in ("shard_map", "gspmd"):
            trainer = make_trainer(objective, mesh, engine)
            state = jax.device_put(initial, trainer.state_shardings, may_alias=False)
            step = trainer.train_step(BATCH)
            losses[engine] = []
            for rows in batches:
                state, metrics = step(state, trainer.device_batch(rows, BATCH))
                losses[engine].append(float(metrics["loss"]))
            # The GSPMD step's from its HLO; the shard_map step's jaxpr, traced once a layout.
            reports[engine] = trainer.collectives(DATA) if engine == "gspmd" else traced(name)
        np.testing.assert_allclose(
            losses["gspmd"],
            losses["shard_map"],
            rtol=1e-5,
            err_msg=f"{name}, batches of seed {seed}",
        )

        gspmd = reports["gspmd"]
        sizes = dict(trainer.mesh.shape)
        assert isinstance(gspmd, CollectiveReport)
        assert gspmd.axis_names == AXES and gspmd.axis_sizes == tuple(sizes[a] for a in AXES)
        assert gspmd.rows and all(row.op in OPS for row in gspmd.rows), str(gspmd)
        assert all(sizes[a] > 1 for row in gspmd.rows for a in row.axes), str(gspmd)
        assert all(row.count > 0 and row.operand_bytes > 0 for row in gspmd.rows)
        # The same form as the shard_map report, so they diff row by row: both engines run the same
        # kinds of collectives over the same axes; only their calls and bytes differ ("~").
        explicit = reports["shard_map"]
        changes = explicit.diff(gspmd)
        moved = {row for row in changed_rows(changes) if not row.startswith("~")}
        assert moved <= GRADIENT_REDUCTION_FORMS, f"{name}:\n" + "\n".join(changes)
        # Both gather the same shards of the same weights, in the forward and again in the
        # recomputed (jax.checkpoint) backward; XLA only splits them into more calls.
        assert gspmd.operand_bytes("all_gather") == explicit.operand_bytes("all_gather"), (
            f"{name}:\n" + "\n".join(changes)
        )
        # Dew sums every gradient once over each axis it must (the least any plan can); XLA may
        # sum more (e.g. whole gradients where Dew sums shards) but never less.
        for axis in AXES:
            reduced = {
                engine: sum(report.operand_bytes(op, axis) for op in ("psum", "psum_scatter"))
                for engine, report in reports.items()
            }
            assert reduced["gspmd"] >= reduced["shard_map"], f"{name}, {axis}: {reduced}"
        if name == "data=8":
            # XLA too only all-reduces over data, and at least every gradient once.
            assert {(row.op, row.axes) for row in gspmd.rows} == {("psum", ("data",))}, str(gspmd)
            assert gspmd.wire_bytes() >= expected_collectives(trainer).wire_bytes()
        else:
            assert gspmd.wire_bytes(axis="fsdp") > 0, str(gspmd)


# ------------------------------------------------------------------------------------------------
# docs/collectives.md


def test_docs_examples_run():
    text = (Path(__file__).parent.parent / "docs" / "collectives.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "docs/collectives.md has no python example"
    namespace = {}
    for block in blocks:
        exec(compile(block, "docs/collectives.md", "exec"), namespace)
