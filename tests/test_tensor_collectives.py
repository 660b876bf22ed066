"""The collectives of the tensor-parallel step against the formulas of docs/collectives.md.

As in tests/test_collective_costs.py, the expected report is computed here from the model's sizes,
the batch and the layout's specs (never from numbers read off a run) and compared with
``trainer.collectives(...)``: the same (op, axes) rows, the collectives over ``tensor`` alone
counted exactly (each binds one array), bytes exactly. Variant steps (a tensor collective added,
dropped, moved to another axis, or the logits gathered for the loss) show that the comparison
catches each. Everything is traced, nothing compiled or run.
"""

import fractions
import math
import types

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import SEQ, tiny_objective
from jax import lax
from test_collective_costs import LOSS_BYTES, cost_problems

import dew
from dew.collectives import CollectiveReport, CollectiveRow
from dew.layout import path_names
from dew.models.causal_transformer import CausalTransformer
from dew.parallel import tensor
from dew.parallel.gradients import spec_axes

BATCH = 16
DATA = types.SimpleNamespace(batch_size=BATCH, seq_len=SEQ)
# As in test_collective_costs: every matrix is split over fsdp (when there is one), the norm
# scales (32 and 64 elements) stay whole.
MIN_SHARD = 256
F32 = 4  # the loss's [rows, seq] values are float32 whatever the activations' dtype
T = tensor.AXIS

LAYOUTS = {
    # name: (mesh, tiny_objective overrides, sequence_parallel)
    "tensor=4": (dew.MeshSpec(tensor=4), {}, False),
    "data=2,tensor=4": (dew.MeshSpec(data=2, tensor=4), {}, False),
    "tensor=2,fsdp=4": (dew.MeshSpec(tensor=2, fsdp=4), {"num_heads": 8}, False),
    "tensor=4,sequence_parallel": (dew.MeshSpec(tensor=4), {}, True),
    "tensor=2,fsdp=4,sequence_parallel": (dew.MeshSpec(tensor=2, fsdp=4), {"num_heads": 8}, True),
    # 2 kv heads on 4 devices: k and v stay whole, their gradients partial over tensor.
    "tensor=4,shared_kv": (dew.MeshSpec(tensor=4), {"num_kv_heads": 2}, False),
    # The activations' collectives in 2-byte elements; the loss's stay float32.
    "tensor=4,bfloat16": (dew.MeshSpec(tensor=4), {"dtype": "bfloat16"}, False),
}


def make_trainer(name, accumulation=1, **overrides):
    mesh, model_overrides, sequence_parallel = LAYOUTS[name]
    return dew.Trainer(
        tiny_objective(**{**model_overrides, **overrides}),
        optax.adamw(1e-3),
        key=jax.random.key(0),
        mesh=mesh,
        layout=dew.Layout(min_shard=MIN_SHARD),
        accumulation=accumulation,
        options=dew.StepOptions(sequence_parallel=sequence_parallel),
    )


_reports = {}


def honest_report(name):
    """The unpatched step's report for ``LAYOUTS[name]``, traced once per module."""
    if name not in _reports:
        trainer = make_trainer(name)
        _reports[name] = (trainer, trainer.collectives(DATA))
    return _reports[name]


# ------------------------------------------------------------------------------------------------
# The formula of docs/collectives.md ("Tensor parallelism"), from sizes and specs


def sizes_of(trainer):
    """``(mesh sizes, rows, seq, A, n_t)``: ``rows`` per device and microbatch, ``A`` the bytes of
    one device's activations ``[rows, seq, embed]`` in the activations' dtype."""
    sizes = dict(trainer.mesh.shape)
    model = trainer.objective.model
    rows = BATCH // (sizes["data"] * sizes["fsdp"] * trainer.accumulation)
    seq = trainer.objective.seq_len
    activations = rows * seq * model.emb_features * jnp.dtype(model.dtype).itemsize
    return sizes, rows, seq, activations, sizes[T]


def per_layer(trainer):
    """``{op: (calls, operand bytes a call)}`` over ``tensor``, per decoder layer and microbatch.

    Plain: ``leave`` (psum) of attention and the MLP in the forward, the psums of both ``enter``'s
    backward, and attention's ``leave`` again in the rematerialized backward (the MLP's is dead
    there). Sequence parallel: each ``enter`` an all_gather of ``A / n`` (forward, and both again in
    the recompute), each ``leave`` a psum_scatter of ``A`` (forward, attention's again), and their
    backwards the other op: all_gather ``2 + 2 + 2``, psum_scatter ``2 + 1 + 2``.
    """
    _, _, _, a, n = sizes_of(trainer)
    if trainer.options.sequence_parallel:
        return {"all_gather": (6, a // n), "psum_scatter": (5, a)}
    return {"psum": (5, a)}


def outside_layers(trainer):
    """``[(op, calls, operand bytes a call)]`` over ``tensor`` per microbatch, outside the scan:
    the embedding's ``leave`` (forward), the head's ``enter`` (backward), and the loss: one pmax of
    ``[rows, seq]`` float32 and one psum of ``[rows, seq, 2]`` float32."""
    _, rows, seq, a, n = sizes_of(trainer)
    if trainer.options.sequence_parallel:
        # Embedding: psum_scatter forward, all_gather backward; head: the reverse.
        pairs = [("psum_scatter", 2, a), ("all_gather", 2, a // n)]
    else:
        pairs = [("psum", 2, a)]
    return pairs + [("psum", 1, 2 * rows * seq * F32), ("pmax", 1, rows * seq * F32)]


def parameters(trainer):
    """``(names, local bytes, layers or None, fsdp-split, partial over tensor, dtype)`` per weight.

    ``local bytes``: the weight's bytes on one device of a tensor group before fsdp, ``W / n_t`` for
    a weight split over tensor. ``partial``: replicated over tensor with different activations on
    each device: the norm scales under sequence parallelism, k and v with fewer kv heads than
    devices.
    """
    model = trainer.objective.model
    n_t = dict(trainer.mesh.shape)[T]
    params = jax.eval_shape(model.init, jax.random.key(0))
    specs = jax.tree_util.tree_leaves(
        trainer.param_specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)
    )
    found = []
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    for (path, leaf), spec in zip(leaves, specs, strict=True):
        names = path_names(path)
        axes = spec_axes(spec)
        nbytes = math.prod(leaf.shape) * leaf.dtype.itemsize // (n_t if T in axes else 1)
        stacked = leaf.shape[0] if names[:2] == ("params", "layers") else None
        partial = n_t > 1 and (
            (names[-1] == "scale" and trainer.options.sequence_parallel)
            or (names[-2:] in (("attn", "k"), ("attn", "v")) and model.kv_heads < n_t)
        )
        found.append((names, nbytes, stacked, "fsdp" in axes, partial, leaf.dtype))
    return found


def expected_collectives(trainer) -> CollectiveReport:
    """The report docs/collectives.md predicts for ``trainer``'s tensor-parallel step.

    Per device, ``k`` microbatches, ``L`` layers, ``n_d, n_f, n_t`` the axis sizes:

    - over tensor: ``k L`` times ``per_layer``, ``k`` times ``outside_layers``;
    - fsdp (test_collective_costs' formula on the tensor-local bytes): a bucket of the scan,
      ``2 L k`` gathers of ``B / (L n_f)`` and ``L k`` scatters of ``B / L``; outside the scan
      ``k`` of each, of ``B / n_f`` and ``B``;
    - each gradient, one psum over the batch axes (less fsdp for a weight split over fsdp, which
      arrives summed and sends ``1 / n_f``), plus tensor for a partial one; the loss (4 bytes)
      over the batch axes.
    """
    sizes = dict(trainer.mesh.shape)
    n_f, k = sizes["fsdp"], trainer.accumulation
    layers = trainer.objective.model.num_layers
    tallies = {}

    def add(op, axes, calls, operand_a_call):
        axes = tuple(a for a in ("data", "fsdp", T) if a in axes and sizes[a] > 1)
        if not axes or not calls:
            return
        n = math.prod(sizes[a] for a in axes)
        ring = {
            "all_gather": fractions.Fraction(n - 1),
            "psum_scatter": fractions.Fraction(n - 1, n),
            "psum": fractions.Fraction(2 * (n - 1), n),
            "pmax": fractions.Fraction(2 * (n - 1), n),
        }[op]
        count, operand, wire = tallies.get((op, axes), (0, 0, fractions.Fraction(0)))
        total = calls * operand_a_call
        tallies[(op, axes)] = (count + calls, operand + total, wire + ring * total)

    for op, (calls, nbytes) in per_layer(trainer).items():
        add(op, (T,), k * layers * calls, nbytes)
    for op, calls, nbytes in outside_layers(trainer):
        add(op, (T,), k * calls, nbytes)

    buckets = {}
    for names, nbytes, stacked, fsdp_split, _, dtype in parameters(trainer):
        if fsdp_split:
            key = (names[1], dtype)
            buckets[key] = (buckets.get(key, (0, stacked))[0] + nbytes, stacked)
    for nbytes, stacked in buckets.values():
        per_call = nbytes // (stacked or 1)  # one layer's slice, or the whole bucket
        calls = (stacked or 1) * k
        add("all_gather", ("fsdp",), 2 * calls if stacked else calls, per_call // n_f)
        add("psum_scatter", ("fsdp",), calls, per_call)

    for _, nbytes, _, fsdp_split, partial, _ in parameters(trainer):
        axes = {"data"} if fsdp_split else {"data", "fsdp"}
        add("psum", axes | ({T} if partial else set()), 1, nbytes // (n_f if fsdp_split else 1))
    add("psum", {"data", "fsdp"}, 1, LOSS_BYTES)

    rows = [
        CollectiveRow(op, axes, count, operand, int(round(wire)))
        for (op, axes), (count, operand, wire) in tallies.items()
    ]
    return CollectiveReport(tuple(rows), tuple(sizes), tuple(sizes.values()))


def problems(report: CollectiveReport, expected: CollectiveReport) -> list[str]:
    """``cost_problems``, with the psums over tensor alone counted exactly too (it allows 1 to
    ``count`` psum calls, for gradients bound in groups): each binds one array, an activation or
    the loss's partial sums."""
    found = cost_problems(report, expected)
    mine = {(row.op, row.axes): row for row in report.rows}
    for want in expected.rows:
        got = mine.get((want.op, want.axes))
        if want.op == "psum" and want.axes == (T,) and got and 1 <= got.count < want.count:
            found.append(f"{want.op} over {T}: {got.count} calls, expected exactly {want.count}")
    return found


def tensor_rows(report):
    return [row for row in report.rows if row.axes == (T,)]


# ------------------------------------------------------------------------------------------------
# The step against the formula


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_step_collectives_match_the_formula(name):
    trainer, report = honest_report(name)
    expected = expected_collectives(trainer)
    assert tensor_rows(expected), "the formula predicts no collective over tensor"
    assert problems(report, expected) == [], f"{name}:\n{report}\nexpected:\n{expected}"
    assert report.wire_bytes() == expected.wire_bytes()


@pytest.mark.parametrize("name", ["tensor=4", "tensor=4,sequence_parallel"])
def test_one_more_layer_adds_the_per_layer_collectives(name):
    """Three layers against two: the difference over tensor is one layer's count and bytes, so
    the formula's per-layer and outside-the-scan terms are each right, not just their sum."""
    trainer, two = honest_report(name)
    three = make_trainer(name, num_layers=3).collectives(DATA)
    before = {r.op: (r.count, r.operand_bytes) for r in tensor_rows(two)}
    added = {
        r.op: (r.count - before[r.op][0], r.operand_bytes - before[r.op][1])
        for r in tensor_rows(three)
    }
    want = {op: (calls, calls * nbytes) for op, (calls, nbytes) in per_layer(trainer).items()}
    assert {op: d for op, d in added.items() if d != (0, 0)} == want, f"{two}\n{three}"


@pytest.mark.parametrize("name", ["tensor=4", "tensor=2,fsdp=4"])
def test_tensor_split_gradients_are_never_summed_over_tensor(name):
    """Through the conjugate pairs a tensor-split weight's gradient comes out whole: with plain
    activations and a kv head per device, nothing but [rows, ...] values (and the loss's
    [rows x seq, ...] sums) crosses tensor."""
    trainer, report = honest_report(name)
    assert not any(p[4] for p in parameters(trainer)), "this layout has partial weights"
    assert all(row.axes == (T,) or T not in row.axes for row in report.rows), str(report)
    _, rows, seq, _, _ = sizes_of(trainer)
    shapes = set().union(*shapes_over_tensor(report).values())
    leading = {s.split("[")[1].split("]")[0].split(",")[0] for s in shapes}
    assert shapes and leading == {str(rows), str(rows * seq)}, shapes


@pytest.mark.parametrize("name", ["tensor=4,sequence_parallel", "tensor=4,shared_kv"])
def test_partial_gradients_are_summed_over_data_and_tensor(name):
    """The norm scales under sequence parallelism (each device normalized its own positions), k
    and v shared by several devices: summed over tensor too, in the same psum as over data; every
    other gradient over data alone."""
    trainer, report = honest_report(name)
    partial = sum(p[1] for p in parameters(trainer) if p[4])
    whole = sum(p[1] for p in parameters(trainer) if not p[4])
    assert partial > 0
    rows = {row.axes: row.operand_bytes for row in report.rows if row.op == "psum"}
    assert rows[("data", T)] == partial, str(report)
    assert rows[("data",)] == whole + LOSS_BYTES, str(report)


# ------------------------------------------------------------------------------------------------
# The loss never moves the logits

# A vocabulary large enough that one device's slice of the logits, [rows, seq, vocab / n] float32,
# outweighs everything else over tensor: gathering it could not hide in the bytes.
BIG_VOCAB = 1024


def logits_slice_bytes(trainer):
    _, rows, seq, _, n = sizes_of(trainer)
    return rows * seq * trainer.objective.model.vocab_size // n * F32


def outside_scan_tensor_bytes(trainer, report):
    """Operand bytes over tensor alone, less the formula's per-layer part: what the embedding, the
    head and the loss moved."""
    k, layers = trainer.accumulation, trainer.objective.model.num_layers
    in_layers = k * layers * sum(c * b for c, b in per_layer(trainer).values())
    return sum(row.operand_bytes for row in tensor_rows(report)) - in_layers


def shapes_over_tensor(report):
    return {row.op: set(row.shapes) for row in tensor_rows(report)}


def gathered_head_loss_sum(x, table_local, targets, shards, weights=None, **_):
    """The loss the vocabulary split avoids: all the logits gathered, then the plain
    cross-entropy."""
    logits_local = tensor.vocab_logits(x, table_local, shards)
    logits = lax.all_gather(logits_local, T, axis=-1, tiled=True)
    picked = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return jnp.sum(jax.nn.logsumexp(logits, axis=-1) - picked)


@pytest.mark.parametrize("name", ["tensor=4", "tensor=4,sequence_parallel"])
def test_the_loss_moves_rows_times_seq_values_never_the_logits(name):
    trainer = make_trainer(name, vocab_size=BIG_VOCAB)
    report = trainer.collectives(DATA)
    assert problems(report, expected_collectives(trainer)) == [], str(report)
    _, rows, seq, a, n = sizes_of(trainer)
    e = trainer.objective.model.emb_features
    # Outside the layers: the embedding's and the head's activations, and 3 float32 per token.
    outside = outside_scan_tensor_bytes(trainer, report)
    if trainer.options.sequence_parallel:
        assert outside == 2 * a + 2 * a // n + 3 * rows * seq * F32, str(report)
    else:
        assert outside == 2 * a + 3 * rows * seq * F32, str(report)
    assert outside < logits_slice_bytes(trainer), "the logits would not stand out here"
    # Every operand over tensor is an activation or one of the loss's values, a few floats for
    # each of the rows x seq tokens (one chunk of them at these sizes).
    act = f"f32[{rows},{seq},{e}]"
    tokens = rows * seq
    want = {"psum": {act, f"f32[{tokens},2]"}, "pmax": {f"f32[{tokens}]"}}
    if trainer.options.sequence_parallel:
        want = {
            "all_gather": {f"f32[{rows},{seq // n},{e}]"},
            "psum_scatter": {act},
            "psum": {f"f32[{tokens},2]"},
            "pmax": {f"f32[{tokens}]"},
        }
    assert shapes_over_tensor(report) == want, str(report)


def test_check_fails_when_the_loss_gathers_the_logits(monkeypatch):
    trainer = make_trainer("tensor=4", vocab_size=BIG_VOCAB)
    expected = expected_collectives(trainer)
    honest = trainer.collectives(DATA)
    monkeypatch.setattr(tensor, "head_loss_sum", gathered_head_loss_sum)
    variant = make_trainer("tensor=4", vocab_size=BIG_VOCAB)
    report = variant.collectives(DATA)
    found = problems(report, expected)
    assert any(p.startswith("+ all_gather over tensor") for p in found), found
    assert any(p.startswith("- pmax over tensor") for p in found), found
    assert outside_scan_tensor_bytes(variant, report) > logits_slice_bytes(variant), str(report)
    assert shapes_over_tensor(report) != shapes_over_tensor(honest)


# ------------------------------------------------------------------------------------------------
# The check fails when a tensor collective is added, dropped or moved


def _identity(x):
    return x


def _pass_gradient(_, g):
    return (g,)


def copy_without_sum():
    """``copy_to_region``'s custom_vjp with a backward that forgets to sum over tensor."""
    copy = jax.custom_vjp(_identity)
    copy.defvjp(lambda x: (x, None), _pass_gradient)
    return copy


def reduce_over(axis):
    """``reduce_from_region``'s custom_vjp with its psum over ``axis``."""
    reduce = jax.custom_vjp(lambda x: lax.psum(x, axis))
    reduce.defvjp(lambda x: (lax.psum(x, axis), None), _pass_gradient)
    return reduce


def leave_twice(x, shards):
    """``leave`` that sums its partials, then sums the (already whole) result again."""
    return tensor.reduce_from_region(tensor.reduce_from_region(x, shards), shards)


def scatter_by_psum(n):
    """``scatter_to_sequence``'s scatter (on a tensor group of ``n``) as an all-reduce and then
    this device's positions: the values of a reduce-scatter, for twice its bytes."""

    def scatter(x, dim):
        block = x.shape[dim] // n
        return lax.dynamic_slice_in_dim(lax.psum(x, T), lax.axis_index(T) * block, block, dim)

    def backward(dim, _, g):
        return (lax.all_gather(g, T, axis=dim, tiled=True),)

    scatter = jax.custom_vjp(scatter, nondiff_argnums=(1,))
    scatter.defvjp(lambda x, dim: (scatter(x, dim), None), backward)
    return scatter


VARIANTS = {
    # name: (layout, attribute of dew.parallel.tensor, replacement (a factory), a line to print)
    "as the engine": ("tensor=4", "leave", lambda: tensor.leave, None),
    "a psum added": ("tensor=4", "leave", lambda: leave_twice, "psum over tensor: "),
    "a psum dropped": ("tensor=4", "_copy", copy_without_sum, "psum over tensor: "),
    "a psum moved to data": ("tensor=4", "_reduce", lambda: reduce_over("data"), "psum over data:"),
    "a psum_scatter as psum": (
        "tensor=4,sequence_parallel",
        "_scatter",
        lambda: scatter_by_psum(4),
        "psum_scatter over tensor: ",
    ),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_check_fails_when_a_tensor_collective_is_added_dropped_or_moved(monkeypatch, variant):
    name, attribute, replacement, line = VARIANTS[variant]
    trainer, honest = honest_report(name)
    expected = expected_collectives(trainer)
    monkeypatch.setattr(tensor, attribute, replacement())
    report = make_trainer(name).collectives(DATA)
    found = problems(report, expected)
    if line is None:
        assert report == honest and found == [], "\n".join(honest.diff(report))
        return
    assert report != honest
    # The count alone catches each: these lines name calls, not bytes.
    assert any(p.startswith(line) and " calls, expected " in p for p in found), found
    if variant == "a psum moved to data":
        # The psums left over tensor are the enters' backward ones.
        assert any(p.startswith("psum over tensor: ") for p in found), found


def test_check_fails_when_the_layer_is_not_rematerialized(monkeypatch):
    """Without the layer's ``jax.checkpoint`` the backward does not run attention's ``leave`` again:
    one psum a layer fewer than the formula's five."""
    trainer, _ = honest_report("tensor=4")
    expected = expected_collectives(trainer)
    monkeypatch.setattr(jax, "checkpoint", lambda fn, **_: fn)
    report = make_trainer("tensor=4").collectives(DATA)
    calls = {r.op: r.count for r in tensor_rows(report)}
    want = {r.op: r.count for r in tensor_rows(expected)}
    assert calls["psum"] == want["psum"] - trainer.objective.model.num_layers, str(report)
    found = problems(report, expected)
    assert any(p.startswith("psum over tensor: ") for p in found), found


def test_check_fails_when_partial_gradients_are_not_summed_over_tensor(monkeypatch):
    """The norm scales of the sequence-parallel step summed over data alone: each device's
    gradient would hold its positions' part only."""
    trainer, _ = honest_report("tensor=4,sequence_parallel")
    expected = expected_collectives(trainer)
    partial_over_tensor = CausalTransformer.partial_over_tensor

    def none_partial(self, shards):
        return jax.tree_util.tree_map(lambda _: False, partial_over_tensor(self, shards))

    monkeypatch.setattr(CausalTransformer, "partial_over_tensor", none_partial)
    report = make_trainer("tensor=4,sequence_parallel").collectives(DATA)
    found = problems(report, expected)
    assert any(p.startswith("- psum over data,tensor") for p in found), found


def test_check_fails_against_the_other_pairs_formula():
    """The sequence-parallel step is not the plain one with other names: each report fails the
    other's formula."""
    plain, plain_report = honest_report("tensor=4")
    sequence_parallel, sp_report = honest_report("tensor=4,sequence_parallel")
    assert any(
        p.startswith("+ all_gather over tensor")
        for p in problems(sp_report, expected_collectives(plain))
    )
    assert any(
        p.startswith("- all_gather over tensor")
        for p in problems(plain_report, expected_collectives(sequence_parallel))
    )


# ------------------------------------------------------------------------------------------------
# Accumulation


@pytest.mark.parametrize("name", ["tensor=4", "tensor=4,sequence_parallel"])
def test_accumulation_doubles_the_tensor_collectives_not_the_gradient_sums(name):
    _, single = honest_report(name)
    trainer = make_trainer(name, accumulation=2)
    report = trainer.collectives(DATA)
    assert problems(report, expected_collectives(trainer)) == [], str(report)
    for row in tensor_rows(single):
        (twice,) = [r for r in tensor_rows(report) if r.op == row.op]
        # Twice the calls, each on half the rows: the same bytes a step.
        assert (twice.count, twice.operand_bytes) == (2 * row.count, row.operand_bytes), row.op
    gradient_rows = [row for row in single.rows if row.axes != (T,)]
    assert gradient_rows and gradient_rows == [r for r in report.rows if r.axes != (T,)]
