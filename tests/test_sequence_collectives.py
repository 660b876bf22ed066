"""The collectives of the sequence-parallel step against the formulas of docs/collectives.md.

As in tests/test_collective_costs.py and tests/test_tensor_collectives.py, the expected report is
computed here from the model's sizes, the batch and the layout's specs (never from numbers read off
a run) and compared with ``trainer.collectives(...)``: the same (op, axes) rows, the ring's
``ppermute`` and the ``all_to_all`` counted exactly, bytes exactly. Variant steps (a hop added,
the dK/dV return trip dropped or moved to another axis, K/V gathered instead of passed round the
ring, the gradients not summed over ``sequence``) show that the comparison catches each.
Everything is traced, nothing compiled or run.
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
from test_collective_costs import LOSS_BYTES
from test_tensor_collectives import outside_layers, parameters, per_layer, problems

import dew
from dew.collectives import CollectiveReport, CollectiveRow
from dew.mesh import AXES
from dew.parallel import data as data_parallel
from dew.parallel import sequence

BATCH = 16  # test_tensor_collectives' per_layer reads its own BATCH, also 16
DATA = types.SimpleNamespace(batch_size=BATCH, seq_len=SEQ)
# As in the other collective tests: every matrix is split over fsdp (when there is one), the norm
# scales (32 and 64 elements) stay whole.
MIN_SHARD = 256
S = sequence.AXIS
# The dK/dV accumulators travel in float32 whatever the activations' dtype.
ACCUMULATOR_BYTES = 4

LAYOUTS = {
    # name: (mesh, sequence_scheme, tiny_objective overrides, tensor's sequence_parallel)
    "sequence=4": (dew.MeshSpec(sequence=4), "ring", {}, False),  # data 2
    "sequence=8": (dew.MeshSpec(sequence=8), "ring", {}, False),
    "sequence=2,fsdp=4": (dew.MeshSpec(sequence=2, fsdp=4), "ring", {}, False),
    "sequence=2,tensor=2": (dew.MeshSpec(sequence=2, tensor=2), "ring", {}, False),  # data 2
    "sequence=2,tensor=2,sequence_parallel": (
        dew.MeshSpec(sequence=2, tensor=2),
        "ring",
        {},
        True,
    ),
    # Two kv heads for four query heads: only the kv heads travel.
    "sequence=4,kv_heads=2": (dew.MeshSpec(sequence=4), "ring", {"num_kv_heads": 2}, False),
    # K/V blocks travel in 2-byte elements, their dK/dV accumulators in float32.
    "sequence=2,bfloat16": (dew.MeshSpec(sequence=2), "ring", {"dtype": "bfloat16"}, False),
    "all_to_all,sequence=4": (dew.MeshSpec(sequence=4), "all_to_all", {}, False),  # data 2
}
RING = [name for name in LAYOUTS if LAYOUTS[name][1] == "ring"]


def make_trainer(name, accumulation=1, **overrides):
    mesh, scheme, model_overrides, sequence_parallel = LAYOUTS[name]
    return dew.Trainer(
        tiny_objective(**{**model_overrides, **overrides}),
        optax.adamw(1e-3),
        key=jax.random.key(0),
        mesh=mesh,
        layout=dew.Layout(min_shard=MIN_SHARD),
        accumulation=accumulation,
        options=dew.StepOptions(sequence_parallel=sequence_parallel, sequence_scheme=scheme),
    )


_reports = {}


def honest_report(name):
    """The unpatched step's report for ``LAYOUTS[name]``, traced once per module."""
    if name not in _reports:
        trainer = make_trainer(name)
        _reports[name] = (trainer, trainer.collectives(DATA))
    return _reports[name]


# ------------------------------------------------------------------------------------------------
# The formula of docs/collectives.md ("Sequence parallelism"), from sizes and specs


def attention_sizes(trainer):
    """``(n, r, p, heads, kv_heads, d, itemsize)`` of one device's attention call: ``n`` the
    sequence size, ``r`` rows per microbatch, ``p = S / n`` positions (two zigzag chunks), the
    query and kv heads left after the tensor split (a shared kv head counts one), the head size and
    the activations' item size."""
    sizes = dict(trainer.mesh.shape)
    model = trainer.objective.model
    n, n_t = sizes[S], sizes["tensor"]
    rows = BATCH // (sizes["data"] * sizes["fsdp"] * trainer.accumulation)
    return (
        n,
        rows,
        trainer.objective.seq_len // n,
        model.num_heads // n_t,
        max(model.kv_heads // n_t, 1),
        model.head_dim,
        jnp.dtype(model.dtype).itemsize,
    )


def sequence_per_layer(trainer, scheme):
    """``[(op, calls, operand bytes a call)]`` over ``sequence``, per decoder layer and
    microbatch.

    Ring, with ``B = 2 r p kv d`` the elements of the stacked K/V block ``[2, r, kv, p, d]``:
    ``n - 1`` hops of the block (``B s`` bytes) in the forward; the layer is rematerialized
    (``jax.checkpoint``, nothing saved), so the backward runs the custom_vjp's forward again, its
    ``n - 1`` hops too; then the backward ring: ``n - 1`` hops of the block and ``n - 1`` of its
    float32 dK/dV accumulator (the last one bringing it home). ``3 (n - 1)`` calls of ``B s`` and
    ``n - 1`` of ``4 B``. The step's jaxpr shows exactly these ``4 (n - 1)`` a layer (at n = 2, 4
    and 8), with no difference to explain: the recompute's hops are all there (a jaxpr is not
    deduplicated) and none of the ring is dead code. This is what the code asks for; a compiled
    step's count is XLA's to change.

    All-to-all, with ``Q = r p h d s`` (q and out) and ``K = r p kv d s`` (k and v): q, k, v in
    and out back in the forward, the same four again in the recompute, and in the backward the
    transposes of out's (d_out) and of q's, k's and v's: ``6`` calls of ``Q`` and ``6`` of ``K``.
    The lse exchange the scheme also writes is not in the step's jaxpr: the model discards lse, so
    its all_to_all is dead code, dropped when autodiff partially evaluates the layer (forward and
    recompute alike), and it has no cotangent to transpose.
    """
    n, rows, p, heads, kv, d, itemsize = attention_sizes(trainer)
    if n == 1:
        return []
    if scheme == "ring":
        block = 2 * rows * p * kv * d
        return [
            ("ppermute", 3 * (n - 1), block * itemsize),
            ("ppermute", n - 1, block * ACCUMULATOR_BYTES),
        ]
    return [
        ("all_to_all", 6, rows * p * heads * d * itemsize),
        ("all_to_all", 6, rows * p * kv * d * itemsize),
    ]


def positions_view(trainer):
    """``trainer`` as test_tensor_collectives' formula reads it, with ``seq_len`` this device's
    positions ``S / n``: the tensor collectives act on ``[r, S / n, e]`` activations, otherwise
    exactly as without a sequence split."""
    n = dict(trainer.mesh.shape)[S]
    objective = types.SimpleNamespace(
        model=trainer.objective.model, seq_len=trainer.objective.seq_len // n
    )
    return types.SimpleNamespace(
        mesh=trainer.mesh,
        objective=objective,
        accumulation=trainer.accumulation,
        options=trainer.options,
    )


def expected_collectives(trainer, scheme) -> CollectiveReport:
    """The report docs/collectives.md predicts for ``trainer``'s step, its attention spanning the
    sequence axis by ``scheme``.

    Per device, ``k`` microbatches, ``L`` layers, ``n_d, n_f, n_t, n`` the axis sizes:

    - over sequence: ``k L`` times ``sequence_per_layer``; nothing else (no gather);
    - over tensor: test_tensor_collectives' ``per_layer`` (``k L`` times) and ``outside_layers``
      (``k`` times), on this device's ``S / n`` positions;
    - fsdp (test_collective_costs' formula, on the tensor-local bytes): a bucket of the scan,
      ``2 L k`` gathers of ``B / (L n_f)`` and ``L k`` scatters of ``B / L``; outside the scan
      ``k`` of each, of ``B / n_f`` and ``B``;
    - each gradient, one psum over the token axes (data, fsdp, sequence: ``sequence`` splits the
      tokens too), less fsdp for a weight split over fsdp (it arrives summed, and sends
      ``1 / n_f``), plus tensor for a partial one; the loss (4 bytes) over the token axes.
    """
    sizes = dict(trainer.mesh.shape)
    n_f, k = sizes["fsdp"], trainer.accumulation
    layers = trainer.objective.model.num_layers
    tallies = {}

    def add(op, axes, calls, operand_a_call):
        axes = tuple(a for a in AXES if a in axes and sizes[a] > 1)
        if not axes or not calls:
            return
        n = math.prod(sizes[a] for a in axes)
        ring = {
            "all_gather": fractions.Fraction(n - 1),
            "psum_scatter": fractions.Fraction(n - 1, n),
            "psum": fractions.Fraction(2 * (n - 1), n),
            "pmax": fractions.Fraction(2 * (n - 1), n),
            "all_to_all": fractions.Fraction(n - 1, n),
            "ppermute": fractions.Fraction(1),
        }[op]
        count, operand, wire = tallies.get((op, axes), (0, 0, fractions.Fraction(0)))
        total = calls * operand_a_call
        tallies[(op, axes)] = (count + calls, operand + total, wire + ring * total)

    for op, calls, nbytes in sequence_per_layer(trainer, scheme):
        add(op, (S,), k * layers * calls, nbytes)

    local = positions_view(trainer)
    if sizes["tensor"] > 1:
        for op, (calls, nbytes) in per_layer(local).items():
            add(op, ("tensor",), k * layers * calls, nbytes)
        for op, calls, nbytes in outside_layers(local):
            add(op, ("tensor",), k * calls, nbytes)

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

    token_axes = {"data", "fsdp", S}
    for _, nbytes, _, fsdp_split, partial, _ in parameters(trainer):
        axes = (token_axes - ({"fsdp"} if fsdp_split else set())) | (
            {"tensor"} if partial else set()
        )
        add("psum", axes, 1, nbytes // (n_f if fsdp_split else 1))
    add("psum", token_axes, 1, LOSS_BYTES)

    rows = [
        CollectiveRow(op, axes, count, operand, int(round(wire)))
        for (op, axes), (count, operand, wire) in tallies.items()
    ]
    return CollectiveReport(tuple(rows), tuple(sizes), tuple(sizes.values()))


def over_sequence(report, op):
    """The row of ``op`` over ``sequence`` alone, or None."""
    found = [row for row in report.rows if row.op == op and row.axes == (S,)]
    return found[0] if found else None


def scheme_of(name):
    return LAYOUTS[name][1]


# ------------------------------------------------------------------------------------------------
# The step against the formula


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_step_collectives_match_the_formula(name):
    trainer, report = honest_report(name)
    expected = expected_collectives(trainer, scheme_of(name))
    assert any(row.axes == (S,) for row in expected.rows), "the formula sends nothing over sequence"
    assert problems(report, expected) == [], f"{name}:\n{report}\nexpected:\n{expected}"
    assert report.wire_bytes() == expected.wire_bytes()


@pytest.mark.parametrize("name", ["sequence=4", "all_to_all,sequence=4"])
def test_one_more_layer_adds_one_layers_sequence_collectives(name):
    """Three layers against two: the difference over sequence is one layer's calls and bytes
    (per microbatch), so the per-layer term is right, not just its product with ``L``."""
    trainer, two = honest_report(name)
    three = make_trainer(name, num_layers=3).collectives(DATA)
    (op,) = {op for op, _, _ in sequence_per_layer(trainer, scheme_of(name))}
    before, after = over_sequence(two, op), over_sequence(three, op)
    want = sequence_per_layer(trainer, scheme_of(name))
    added = (after.count - before.count, after.operand_bytes - before.operand_bytes)
    assert added == (sum(c for _, c, _ in want), sum(c * b for _, c, b in want)), f"{two}\n{three}"


@pytest.mark.parametrize("name", RING)
def test_the_ring_passes_kv_blocks_and_gathers_nothing_over_sequence(name):
    """Only the stacked K/V block ``[2, r, kv, S/n, d]`` (kv heads, not query heads; the model's
    layout) and its dK/dV accumulator travel; nothing is gathered, scattered or exchanged over
    ``sequence``."""
    trainer, report = honest_report(name)
    _, rows, p, _, kv, d, itemsize = attention_sizes(trainer)
    over = [row for row in report.rows if S in row.axes]
    assert {row.op for row in over} == {"ppermute", "psum"}, str(report)
    assert report.count("all_gather", axis=S) == 0 and report.count("psum_scatter", axis=S) == 0
    dtypes = {"f32"} | ({"bf16"} if itemsize == 2 else set())
    block = f"{rows},{kv},{p},{d}"
    assert set(over_sequence(report, "ppermute").shapes) == {f"{t}[2,{block}]" for t in dtypes}


@pytest.mark.parametrize("name", ["sequence=4", "sequence=2,fsdp=4"])
def test_gradients_and_loss_are_summed_over_the_token_axes(name):
    """``sequence`` splits the tokens: every psum of the step includes it, and together they carry
    each weight's gradient (``1 / n_f`` of a weight split over fsdp) and the loss."""
    trainer, report = honest_report(name)
    psums = [row for row in report.rows if row.op == "psum"]
    assert psums and all(S in row.axes for row in psums), str(report)
    n_f = dict(trainer.mesh.shape)["fsdp"]
    local = sum(
        nbytes // (n_f if split else 1) for _, nbytes, _, split, _, _ in parameters(trainer)
    )
    assert sum(row.operand_bytes for row in psums) == local + LOSS_BYTES, str(report)


def test_all_to_all_trades_q_k_v_and_out_and_never_lse():
    """The all-to-all's operands are this device's positions of q, k, v ``[r, h, S/n, d]`` and the
    whole sequence of out for its heads ``[r, h/n, S, d]`` (and their cotangents; the model's
    layout); the lse exchange, ``[r, h/n, S]``, is dead code in the step."""
    trainer, report = honest_report("all_to_all,sequence=4")
    n, rows, p, heads, _, d, _ = attention_sizes(trainer)
    seq = trainer.objective.seq_len
    assert report.count("ppermute") == 0, str(report)
    shapes = set(over_sequence(report, "all_to_all").shapes)
    assert shapes == {f"f32[{rows},{heads},{p},{d}]", f"f32[{rows},{heads // n},{seq},{d}]"}
    assert f"f32[{rows},{heads // n},{seq}]" not in shapes


# ------------------------------------------------------------------------------------------------
# The check fails when a sequence collective is added, dropped or moved


def ring_hop(axis):
    """One hop to the next device of ``axis``'s ring, as ``sequence._pass`` does over sequence."""

    def hop(x, size):
        return lax.ppermute(x, axis, [(j, (j + 1) % size) for j in range(size)])

    return hop


def passing_accumulators(how):
    """A stand-in for ``sequence._pass`` on a bfloat16 model, where only the dK/dV accumulators
    are float32: ``"as is"`` sends everything as the engine does, ``"dropped"`` keeps each
    accumulator where it is, ``"to data"`` sends it round the data axis instead. On a sequence
    axis of 2 the accumulator's only hop is its return trip home."""
    over_sequence_hop = ring_hop(S)

    def hop(x, n):
        if x.dtype != jnp.float32 or how == "as is":
            return over_sequence_hop(x, n)
        if how == "dropped":
            return x
        return ring_hop("data")(x, lax.axis_size("data"))

    return hop


def one_hop_too_many():
    """``_ring_steps`` with its incoming block passed once more before the steps: an off-by-one
    ring, one extra hop in each forward and in the backward's K/V ring."""
    ring_steps = sequence._ring_steps

    def steps(n, first, state, incoming, visit):
        return ring_steps(n, first, state, sequence._pass(incoming, n), visit)

    return steps


def gathered_kv():
    """A stand-in for ``sequence._ring``: K and V all-gathered over sequence, then this device's
    queries attend to every key at or before their global position (autodiff writes the
    backward: a psum_scatter of dK/dV)."""

    def attend(q, k, v, ids, all_ids, n, impl, window):
        b, heads, p, d = q.shape  # the model's layout
        kv = lax.all_gather(jnp.stack([k, v]), S, axis=3, tiled=True)  # [2, b, kv, S, d]
        seq = p * n
        order = jnp.asarray(sequence.zigzag_positions(seq, n))
        mine = lax.dynamic_slice_in_dim(order, lax.axis_index(S) * p, p)
        keys, values = (jnp.repeat(x, heads // k.shape[1], axis=1) for x in kv)
        logits = jnp.einsum("bhqd,bhsd->bhqs", q, keys) / math.sqrt(d)
        logits = jnp.where(order[None, :] <= mine[:, None], logits, -jnp.inf)
        lse = jax.nn.logsumexp(logits, axis=-1)
        out = jnp.einsum("bhqs,bhsd->bhqd", jnp.exp(logits - lse[..., None]), values)
        return out.astype(q.dtype), lse

    return attend


def sum_axes_without_sequence():
    """``dew.parallel.gradients.sum_axes`` as ``dew.parallel.data`` calls it, less ``sequence``:
    each device's gradient would hold its own positions' part only."""
    sum_axes = data_parallel.sum_axes

    def without(*args, **kwargs):
        return tuple(a for a in sum_axes(*args, **kwargs) if a != S)

    return without


VARIANTS = {
    # name: (layout, module, attribute, replacement (a factory), lines the check must print)
    "as the engine": ("sequence=2,bfloat16", sequence, "_pass", lambda: ring_hop(S), ()),
    "accumulators passed as the engine does": (
        "sequence=2,bfloat16",
        sequence,
        "_pass",
        lambda: passing_accumulators("as is"),
        (),
    ),
    "an extra hop": (
        "sequence=4",
        sequence,
        "_ring_steps",
        one_hop_too_many,
        ("ppermute over sequence: 30 calls, expected 24",),
    ),
    "the dK/dV return trip dropped": (
        "sequence=2,bfloat16",
        sequence,
        "_pass",
        lambda: passing_accumulators("dropped"),
        ("ppermute over sequence: 6 calls, expected 8",),
    ),
    "the dK/dV return trip moved to data": (
        "sequence=2,bfloat16",
        sequence,
        "_pass",
        lambda: passing_accumulators("to data"),
        ("+ ppermute over data:", "ppermute over sequence: 6 calls, expected 8"),
    ),
    "K/V gathered instead of the ring": (
        "sequence=4",
        sequence,
        "_ring",
        gathered_kv,
        (
            "+ all_gather over sequence:",
            "+ psum_scatter over sequence:",
            "- ppermute over sequence:",
        ),
    ),
    "gradients not summed over sequence": (
        "sequence=4",
        data_parallel,
        "sum_axes",
        sum_axes_without_sequence,
        ("+ psum over data:", "psum over data,sequence: operand_bytes"),
    ),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_check_fails_when_a_sequence_collective_is_added_dropped_or_moved(monkeypatch, variant):
    name, module, attribute, replacement, lines = VARIANTS[variant]
    trainer, honest = honest_report(name)
    expected = expected_collectives(trainer, scheme_of(name))
    monkeypatch.setattr(module, attribute, replacement())
    report = make_trainer(name).collectives(DATA)
    found = problems(report, expected)
    if not lines:
        assert report == honest and found == [], "\n".join(honest.diff(report))
        return
    assert report != honest
    for line in lines:
        assert any(p.startswith(line) for p in found), (line, found)


def test_check_fails_against_the_other_schemes_formula():
    """The ring's step is not the all-to-all's with other names: each report fails the other's
    formula."""
    ring, ring_report = honest_report("sequence=4")
    ulysses, ulysses_report = honest_report("all_to_all,sequence=4")
    against_all_to_all = problems(ring_report, expected_collectives(ring, "all_to_all"))
    assert any(p.startswith("- all_to_all over sequence") for p in against_all_to_all)
    assert any(p.startswith("+ ppermute over sequence") for p in against_all_to_all)
    against_ring = problems(ulysses_report, expected_collectives(ulysses, "ring"))
    assert any(p.startswith("- ppermute over sequence") for p in against_ring)


# ------------------------------------------------------------------------------------------------
# Accumulation


@pytest.mark.parametrize("name", ["sequence=4", "all_to_all,sequence=4"])
def test_accumulation_doubles_the_sequence_collectives_not_the_gradient_sums(name):
    _, single = honest_report(name)
    trainer = make_trainer(name, accumulation=2)
    report = trainer.collectives(DATA)
    assert problems(report, expected_collectives(trainer, scheme_of(name))) == [], str(report)
    op = "ppermute" if scheme_of(name) == "ring" else "all_to_all"
    once, twice = over_sequence(single, op), over_sequence(report, op)
    # Twice the calls, each on half the rows: the same bytes a step.
    assert (twice.count, twice.operand_bytes) == (2 * once.count, once.operand_bytes), str(report)
    gradient_rows = [row for row in single.rows if row.op == "psum"]
    assert gradient_rows and gradient_rows == [r for r in report.rows if r.op == "psum"]
