"""``dew.parallel.tensor_ring``: under ``tensor_scheme="ring"`` the Megatron regions' entry and exit
run as collective matmuls, rings of ``ppermute`` s over ``tensor``.

Three ways, as every axis (the layouts' equivalence with one device is in
tests/test_equivalence.py's table, beside the plain pairs' rows):

- each ring alone, forward and backward, against the plain collective and einsum written out in
  numpy (``all_gather`` then ``einsum``, ``einsum`` then ``psum_scatter`` or ``psum``, and their
  transposes), device by device in float64, on tensor 2, 4 and 8, and with weights still split over
  fsdp (``RingSplit``), each weight gathered once for the ring;
- the step's collectives against the formula: ``n - 1`` ``ppermute`` s of ``A / n`` a ring, 11 rings
  a layer with sequence-parallel activations, 5 rings and 5 all-gathers without, the same wire bytes
  as the plain pairs; beside the fsdp rings, the fsdp ``ppermute`` s of the fsdp ring alone;
- the step's memory against the plain pairs'; and the step with both rings against one device.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from test_tensor_collectives import BATCH, DATA, outside_layers, sizes_of

import dew
from dew.collectives import collectives
from dew.nn.param import spec_labels
from dew.parallel import fsdp, tensor_ring
from dew.parallel.fsdp_matmul import RingSplit
from dew.parallel.options import StepOptions
from dew.parallel.shards import Shards
from tests.equivalence import assert_matches, cached_reference, layout_case, sharded_run
from tests.helpers import (
    fresh_batch,
    relative_error,
    seeded_key,
    smooth_optimizer,
    tiny_objective,
)

T = "tensor"

# --------------------------------------------------------------------------------------------
# Each ring alone, against the formula


def _split(a, dim, n):
    return np.split(a, n, axis=dim)


# Sizes of the einsums' labels; the blocked one (``s`` or ``t``) is per block, ``n`` blocks long.
SIZES = dict(b=2, s=3, t=3, e=16, h=2, d=3, f=8)


@dataclasses.dataclass(frozen=True)
class Case:
    """One ring: ``columns`` (weights of ``heads`` heads each: q, k and v of different counts; or
    gate and up, ``None``) or ``row``, with sequence-parallel activations or whole ones, on a
    tensor group of ``n``; with ``nf`` above 1 the weights reach the ring split over fsdp (a
    ``RingSplit``) along dimension ``fsdp_dim``, and each fsdp index has inputs of its own."""

    kind: str
    spec: str
    sequence_parallel: bool
    n: int
    heads: tuple = (2,)
    nf: int = 1
    fsdp_dim: int = 0

    @property
    def name(self):
        sp = "sequence_parallel" if self.sequence_parallel else "whole"
        fsdp_ = f"-fsdp{self.nf}" if self.nf > 1 else ""
        return f"{self.kind}-{self.spec}-{sp}-tensor{self.n}{fsdp_}"

    def dims(self):
        """The blocked dimension of the input and of the output."""
        x_labels, _, out_labels = spec_labels(self.spec)
        label = "s" if "s" in x_labels else "t"
        return x_labels.index(label), out_labels.index(label)

    def shape(self, labels, heads, blocks):
        sizes = dict(SIZES, s=SIZES["s"] * blocks, t=SIZES["t"] * blocks)
        if heads is not None:
            sizes["h"] = heads
        return [sizes[c] for c in labels]


CASES = [
    Case("columns", "bse,ehd->bshd", True, 4, heads=(2, 1, 1)),
    Case("row", "bshd,hde->bse", True, 4),
    Case("columns", "te,ef->tf", False, 8, heads=(None, None)),
    Case("row", "tf,fe->te", False, 8, heads=(None,)),
    Case("columns", "te,ef->tf", True, 2, heads=(None, None)),
    Case("row", "bshd,hde->bse", False, 2),
    # Beside the fsdp rings: the weights split over fsdp on the model width, contracted (q, k, v)
    # or in the output (o).
    Case("columns", "bse,ehd->bshd", True, 4, heads=(2, 1, 1), nf=2, fsdp_dim=0),
    Case("row", "bshd,hde->bse", False, 4, nf=2, fsdp_dim=2),
]


def draw(case, rng):
    """What each device ``(f, i)`` of the ``(fsdp, tensor)`` mesh holds, stacked ``[nf, n, ...]``
    (weights ``[n, ...]``: device ``i``'s slice of the width, whole over fsdp):

    - ``x``: columns, sequence parallel: block ``i`` of fsdp index ``f``'s positions; columns,
      whole: fsdp index ``f``'s input, the same on its tensor group; row: this device's slice of
      the width over all positions.
    - ``d_outs``: the gradient of each output this device returns (row, sequence parallel: of its
      block of positions).
    """
    x_labels, w_labels, out_labels = spec_labels(case.spec)
    n, nf = case.n, case.nf
    blocks_in = 1 if case.kind == "columns" and case.sequence_parallel else n
    blocks_out = 1 if case.kind == "row" and case.sequence_parallel else n
    x = rng.standard_normal([nf, n, *case.shape(x_labels, case.heads[0], blocks_in)])
    if case.kind == "columns" and not case.sequence_parallel:
        x[:] = x[:, :1]  # the same input on every device of a tensor group
    weights = [rng.standard_normal([n, *case.shape(w_labels, h, n)]) for h in case.heads]
    d_outs = [
        rng.standard_normal([nf, n, *case.shape(out_labels, h, blocks_out)]) for h in case.heads
    ]
    return x, weights, d_outs


def formula(case, x, weights, d_outs):
    """``(outs, dx, dws)`` as the plain collectives and einsums give them, in float64: ``outs``
    and ``dx`` per device ``[nf][n]``, ``dws`` per weight ``[n, ...]``, summed over fsdp."""
    x_labels, w_labels, out_labels = spec_labels(case.spec)
    back = f"{out_labels},{w_labels}->{x_labels}"
    grad = f"{x_labels},{out_labels}->{w_labels}"
    dim, out_dim = case.dims()
    n, nf, sp = case.n, case.nf, case.sequence_parallel
    outs, dxs, dws = [], [], [np.zeros_like(w) for w in weights]
    for f in range(nf):
        if case.kind == "columns":
            # All positions: the all-gather's result (sequence parallel), or the whole input.
            whole = np.concatenate(list(x[f]), dim) if sp else x[f, 0]
            outs.append([[np.einsum(case.spec, whole, w[i]) for w in weights] for i in range(n)])
            partial = sum(
                np.einsum(back, d[f, i], w[i]) for d, w in zip(d_outs, weights) for i in range(n)
            )
            # The input's gradient summed over the group: reduce-scattered, or all-reduced.
            dxs.append(np.split(partial, n, dim) if sp else [partial] * n)
            for j, (d, w) in enumerate(zip(d_outs, weights)):
                for i in range(n):
                    dws[j][i] += np.einsum(grad, whole, d[f, i])
        else:
            ((w,), (d,)) = weights, d_outs
            summed = sum(np.einsum(case.spec, x[f, i], w[i]) for i in range(n))
            # The partial outputs summed: reduce-scattered, or all-reduced.
            outs.append([[o] for o in (np.split(summed, n, out_dim) if sp else [summed] * n)])
            dx = []
            for i in range(n):
                # The output's gradient: gathered over positions, or this device's own.
                g = np.concatenate(list(d[f]), out_dim) if sp else d[f, i]
                dx.append(np.einsum(back, g, w[i]))
                dws[0][i] += np.einsum(grad, x[f, i], g)
            dxs.append(dx)
    return outs, dxs, dws


def run_ring(case, x, weights, d_outs):
    """The ring and its vjp under ``shard_map`` on an ``(fsdp, tensor)`` mesh: ``(outs, dx, dws)``
    laid out as ``formula``'s, and the collectives of the whole."""
    n, nf = case.n, case.nf
    mesh = Mesh(np.array(jax.devices()[: nf * n]).reshape(nf, n), ("fsdp", T))
    shards = Shards(
        axis_sizes={"fsdp": nf, T: n},
        options=StepOptions(sequence_parallel=case.sequence_parallel),
        tensor_ring=True,
    )

    def local(x, ws, ds):
        ws = [w[0] for w in ws]
        if nf > 1:
            ws = [RingSplit(w, case.fsdp_dim, nf) for w in ws]

        def ring(x, ws):
            if case.kind == "columns":
                return tensor_ring.columns(case.spec, x, ws, shards)
            return (tensor_ring.row(case.spec, x, ws[0], shards),)

        outs, pullback = jax.vjp(ring, x[0, 0], ws)
        dx, dws = pullback(tuple(d[0, 0] for d in ds))
        dws = [w.shard if nf > 1 else w for w in dws]
        return [o[None, None] for o in outs], dx[None, None], [w[None] for w in dws]

    per_device = P("fsdp", T)
    w_spec = P(T, *([None] * case.fsdp_dim), "fsdp") if nf > 1 else P(T)
    run = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(per_device, [w_spec] * len(weights), [per_device] * len(d_outs)),
        out_specs=([per_device] * len(d_outs), per_device, [w_spec] * len(weights)),
        check_vma=False,
    )
    args = (
        x.astype(np.float32),
        [w.astype(np.float32) for w in weights],
        [d.astype(np.float32) for d in d_outs],
    )
    outs, dx, dws = jax.jit(run)(*args)
    return (outs, dx, dws), collectives(run, *args)


def expected_collectives(case, x, weights, d_outs) -> dict:
    """``{(op, axes): (calls, operand bytes)}`` of the ring forward and backward, float32.

    Over tensor, blocks of ``1 / n`` of the activations: sequence parallel, the forward's ring and
    the backward's, ``n - 1`` ``ppermute`` s each (columns: the input's blocks gathered, its
    gradient's reduce-scattered; row: the output's reduce-scattered, its gradient's gathered);
    whole activations, one ring and one ``all_gather`` of the summed block (columns: the input's
    gradient, in the backward; row: the output, in the forward). Over fsdp, each weight gathered
    once and its gradient summed once, ``nf - 1`` ``ppermute`` s of its ``1 / nf`` each, however
    many blocks the tensor ring cuts.
    """
    n, nf = case.n, case.nf
    activations = x[0, 0] if case.kind == "columns" else d_outs[0][0, 0]
    block = 4 * activations.size // (1 if case.sequence_parallel else n)
    if case.sequence_parallel:
        out = {("ppermute", (T,)): (2 * (n - 1), 2 * (n - 1) * block)}
    else:
        out = {("ppermute", (T,)): (n - 1, (n - 1) * block), ("all_gather", (T,)): (1, block)}
    if nf > 1:
        shard_bytes = [4 * w[0].size // nf for w in weights]
        out[("ppermute", ("fsdp",))] = (
            2 * (nf - 1) * len(weights),
            2 * (nf - 1) * sum(shard_bytes),
        )
    return out


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_each_ring_and_its_gradients_follow_the_formulas(case, seed):
    rng = np.random.default_rng(seed)
    x, weights, d_outs = draw(case, rng)
    (outs, dx, dws), report = run_ring(case, x, weights, d_outs)
    want_outs, want_dx, want_dws = formula(case, x, weights, d_outs)
    close = dict(rtol=1e-5, atol=1e-5)
    for f in range(case.nf):
        for i in range(case.n):
            where = f"device {(f, i)}, seed {seed}"
            for j, want in enumerate(want_outs[f][i]):
                np.testing.assert_allclose(
                    outs[j][f, i], want, **close, err_msg=f"out {j}, {where}"
                )
            np.testing.assert_allclose(dx[f, i], want_dx[f][i], **close, err_msg=f"dx, {where}")
    for j, want in enumerate(want_dws):
        np.testing.assert_allclose(dws[j], want, **close, err_msg=f"weight {j}, seed {seed}")
    found = {(r.op, r.axes): (r.count, r.operand_bytes) for r in report.rows}
    assert found == expected_collectives(case, x, weights, d_outs), str(report)


# --------------------------------------------------------------------------------------------
# The step's collectives against the formula


def step_trainer(mesh, tensor_scheme="ring", **options):
    """test_tensor_collectives' tiny decoder (2 layers, 4 heads, width 32) on 16 rows."""
    return dew.Trainer(
        tiny_objective(),
        optax.adamw(1e-3),
        key=jax.random.key(0),
        mesh=mesh,
        layout=dew.Layout(min_shard=256),
        options=StepOptions(tensor_scheme=tensor_scheme, **options),
    )


def rows_by_key(report):
    return {(r.op, r.axes): (r.count, r.operand_bytes) for r in report.rows}


@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sequence_parallel", "whole"])
def test_the_step_rings_each_region_as_the_formula_says(sequence_parallel):
    """Per layer, ``A`` one device's activations: sequence parallel, 11 rings of ``n - 1``
    ``ppermute`` s of ``A / n`` (the plain pair's 6 all-gathers and 5 reduce-scatters: both
    entries and exits forward, the entries and attention's exit recomputed, both of each
    backward); whole activations, 5 rings and 5 all-gathers of ``A / n`` (the plain pair's 5
    all-reduces: both exits forward, attention's recomputed, both entries backward). Outside
    the layers (the embedding, the head and the loss keep the plain pair) and on the other axes,
    the plain step's collectives; over tensor, the plain step's wire bytes."""
    mesh = dew.MeshSpec(tensor=4)  # data 2
    ring = step_trainer(mesh, sequence_parallel=sequence_parallel)
    plain = step_trainer(mesh, "plain", sequence_parallel=sequence_parallel)
    report, plain_report = ring.collectives(DATA), plain.collectives(DATA)
    _, _, _, a, n = sizes_of(ring)
    layers = ring.objective.model.num_layers
    rings, gathers = (11, 0) if sequence_parallel else (5, 5)
    expected = {("ppermute", (T,)): (layers * rings * (n - 1), layers * rings * (n - 1) * a // n)}
    for op, calls, nbytes in outside_layers(ring):
        count, total = expected.get((op, (T,)), (0, 0))
        expected[(op, (T,))] = (count + calls, total + calls * nbytes)
    if gathers:
        count, total = expected.get(("all_gather", (T,)), (0, 0))
        calls = layers * gathers
        expected[("all_gather", (T,))] = (count + calls, total + calls * a // n)
    found = rows_by_key(report)
    assert {k: v for k, v in found.items() if k[1] == (T,)} == expected, str(report)
    others = {k: v for k, v in rows_by_key(plain_report).items() if k[1] != (T,)}
    assert {k: v for k, v in found.items() if k[1] != (T,)} == others, str(report)
    assert report.wire_bytes() == plain_report.wire_bytes()


def test_beside_the_fsdp_rings_each_weight_is_gathered_once_for_its_tensor_ring(monkeypatch):
    """Every matrix reaches the tensor ring split over fsdp (``RingSplit``, no bucket): the fsdp
    ``ppermute`` s are those of the fsdp rings beside the plain pairs (each matrix gathered in
    the forward and again in the recompute, its gradient summed once: tests/test_fsdp_matmul.py),
    not once per block of positions."""
    monkeypatch.setattr(fsdp, "BUCKET_BYTES", 0)
    mesh = dew.MeshSpec(fsdp=2, tensor=4)
    both = step_trainer(mesh, sequence_parallel=True, fsdp_scheme="ring").collectives(DATA)
    fsdp_only = step_trainer(mesh, "plain", sequence_parallel=True, fsdp_scheme="ring")
    fsdp_rows = rows_by_key(fsdp_only.collectives(DATA))
    over_fsdp = {k: v for k, v in rows_by_key(both).items() if k[1] == ("fsdp",)}
    assert over_fsdp[("ppermute", ("fsdp",))][0] > 0, str(both)
    assert over_fsdp == {k: v for k, v in fsdp_rows.items() if k[1] == ("fsdp",)}, str(both)


# --------------------------------------------------------------------------------------------
# Memory


def memory_trainer(scheme, layers):
    return dew.Trainer(
        tiny_objective(emb_features=128, num_layers=layers),
        optax.sgd(0.1),
        jax.random.key(0),
        mesh=dew.MeshSpec(tensor=4),
        layout=dew.Layout(min_shard=1),
        options=StepOptions(sequence_parallel=True, tensor_scheme=scheme),
    )


def temp_bytes(scheme, layers, rows=16):
    return memory_trainer(scheme, layers).compiled_step(rows).memory_analysis().temp_size_in_bytes


def test_the_rings_keep_no_more_for_the_backward_than_the_pairs():
    """Each layer runs under full recompute, so what the backward keeps of a layer is its input
    (``A / n``, sequence parallel) and its slice of the weight gradients; the rings' residuals (the
    gathered input of each region, ``A``) live inside one layer's backward. A ring that kept them
    for the backward would add ``2 A`` a layer: over 4 layers (width 128, 8 rows of 16 tokens a
    device: ``A`` = 64 KiB) the step would need at least 1.3 times the plain pairs' temporaries;
    it needs at most 1.1 (measured 1.06 on XLA:CPU, whose buffer sharing is not the TPU compiler's:
    there the rings' heap was within 0.3% of the pairs' on Llama-3.2-1B, docs/results/slices.md)."""
    plain, ring = temp_bytes("plain", 4), temp_bytes("ring", 4)
    print(f"temporaries: plain {plain} B, ring {ring} B ({ring / plain:.3f}x)")
    assert ring <= 1.1 * plain, (ring, plain)


# --------------------------------------------------------------------------------------------
# The step with both rings against one device; what the options refuse


@pytest.fixture(scope="module")
def case(module_seed):
    return layout_case(module_seed)


def test_the_tensor_and_fsdp_rings_together_compute_what_one_device_computes(
    case, seed, monkeypatch
):
    """fsdp=2,tensor=4, sequence parallel: every matrix reaches its tensor ring split over fsdp
    (no bucket), gathered once round the fsdp ring, its gradient summed round it. Losses, every
    gradient of three steps, weights and optimizer state after them, within 1e-5 of one device.
    (The other layouts, each ring alone, are rows of tests/test_equivalence.py.)"""
    monkeypatch.setattr(fsdp, "BUCKET_BYTES", 0)
    key, batches, _ = case
    objective = tiny_objective(num_heads=8)
    reference = cached_reference(case, objective, "num_heads=8")
    run = sharded_run(
        objective,
        smooth_optimizer(),
        key,
        batches,
        dew.MeshSpec(fsdp=2, tensor=4),
        initial=reference["initial"],
        options=StepOptions(sequence_parallel=True, fsdp_scheme="ring", tensor_scheme="ring"),
    )
    assert_matches(run, reference, seed, "fsdp=2,tensor=4, both rings")


AXES = dict(data=1, expert=1, fsdp=1, tensor=4, sequence=1, stage=1)


@pytest.mark.parametrize(
    "axes, seq_len, message",
    [
        (dict(tensor=1), 16, r"tensor_scheme='ring' needs a tensor axis above 1.*tensor 1"),
        (dict(), 18, r"tensor_scheme='ring': seq_len 18 does not split into tensor 4 blocks"),
        (
            dict(sequence=2),
            20,
            r"tensor_scheme='ring': seq_len 20 over sequence 2 leaves 10 positions per device, "
            r"which does not split into tensor 4",
        ),
        (dict(stage=2), 16, r"tensor_scheme='ring' with stage 2.*tensor_scheme='plain'"),
    ],
    ids=["no tensor axis", "positions", "positions over sequence", "stage"],
)
def test_the_ring_is_refused_where_it_cannot_run(axes, seq_len, message):
    with pytest.raises(ValueError, match=message):
        StepOptions(tensor_scheme="ring").check({**AXES, **axes}, seq_len)
    StepOptions().check({**AXES, **axes, "stage": 1}, 16)  # the plain pairs run there


def test_an_unknown_scheme_is_refused_naming_the_choices():
    with pytest.raises(
        ValueError, match=r"unknown tensor_scheme 'rings'; expected one of auto, plain, ring"
    ):
        StepOptions(tensor_scheme="rings")


def test_a_search_asks_for_the_tensor_ring_only_where_it_can_run():
    from dew import planning

    asked = StepOptions(tensor_scheme="ring")
    assert planning._options_for(asked, AXES).tensor_scheme == "ring"
    for other in (dict(tensor=1), dict(stage=2)):
        assert planning._options_for(asked, {**AXES, **other}).tensor_scheme == "plain", other


def test_a_weight_with_an_einsum_of_its_own_keeps_the_plain_pair():
    """A weight the ring cannot cut its matmuls for (anything but an array or a ``RingSplit``
    with an ``einsum`` of its own) enters and leaves by the plain pair: the same values, an
    all-gather and a reduce-scatter instead of ppermutes."""

    @dataclasses.dataclass
    class Wrapped:
        w: jax.Array

        def einsum(self, spec, x):
            return jnp.einsum(spec, x, self.w.astype(x.dtype))

    n = 4
    mesh = Mesh(np.array(jax.devices()[:n]), (T,))
    shards = Shards(
        axis_sizes={T: n}, options=StepOptions(sequence_parallel=True), tensor_ring=True
    )

    def local(x, w_in, w_out, wrap):
        if wrap:
            w_in, w_out = Wrapped(w_in), Wrapped(w_out)
        (h,) = tensor_ring.columns("te,ef->tf", x, [w_in], shards)
        return tensor_ring.row("tf,fe->te", jnp.tanh(h), w_out, shards)

    rng = np.random.default_rng(0)
    args = (
        rng.standard_normal((4 * n, 8), np.float32),
        rng.standard_normal((8, 4 * n), np.float32),
        rng.standard_normal((4 * n, 8), np.float32),
    )
    specs = dict(mesh=mesh, in_specs=(P(T), P(None, T), P(T)), out_specs=P(T), check_vma=False)
    reports, values = {}, {}
    for wrap in (False, True):
        run = jax.shard_map(lambda *a, wrap=wrap: local(*a, wrap), **specs)
        reports[wrap] = {r.op for r in collectives(run, *args).rows}
        values[wrap] = np.asarray(jax.jit(run)(*args))
    assert reports == {False: {"ppermute"}, True: {"all_gather", "psum_scatter"}}
    np.testing.assert_allclose(values[True], values[False], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sequence_parallel", "whole"])
def test_lora_adapted_weights_keep_the_plain_pairs_under_the_ring(sequence_parallel):
    """A LoRA model's adapted weights (``dew.nn.lora.Adapted``, an ``einsum`` of their own) enter
    and leave by the plain pairs under ``tensor_scheme="ring"``: the step's collectives are the
    plain scheme's, no ``ppermute``."""
    from test_lora import lora_objective

    def report(scheme):
        trainer = dew.Trainer(
            lora_objective(),
            optax.sgd(0.1),
            jax.random.key(0),
            mesh=dew.MeshSpec(tensor=4),
            layout=dew.Layout(min_shard=1),
            options=StepOptions(sequence_parallel=sequence_parallel, tensor_scheme=scheme),
        )
        return rows_by_key(trainer.collectives(DATA))

    ring = report("ring")
    assert ring == report("plain") and ("ppermute", (T,)) not in ring, ring


@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sequence_parallel", "whole"])
def test_lora_on_q_and_v_rings_the_plain_weights_and_keeps_the_pair_where_one_is_adapted(
    sequence_parallel, seed
):
    """PEFT's usual targets, q_proj and v_proj: the attention's entry projects q, k and v in one
    ring, two adapted beside a plain k, so it keeps its plain pair (the ring runs only where
    every weight can: one adapted of three, or of one, is not all); o_proj and the MLP, plain,
    ring. Loss and gradients of the adapters equal the plain pairs' step (float32, 1e-5), and
    the step holds both kinds: ``ppermute`` s and the pair's all-gathers."""
    from test_lora import lora_objective, random_adapters

    objective = lora_objective(targets=("q_proj", "v_proj"))
    batch = fresh_batch(BATCH, seed)
    runs, reports = {}, {}
    for scheme in ("plain", "ring"):
        trainer = dew.Trainer(
            objective,
            optax.sgd(0.1),
            seeded_key(seed),
            mesh=dew.MeshSpec(tensor=4),
            layout=dew.Layout(min_shard=1),
            options=StepOptions(sequence_parallel=sequence_parallel, tensor_scheme=scheme),
        )
        state = trainer.init_state()
        # Adapters as after training (a fresh B is zero, and so then is A's gradient).
        adapters = jax.device_put(
            random_adapters(objective.model, seeded_key(seed, 1)), trainer.state_shardings.params
        )
        grads, loss = trainer.gradients(adapters, trainer.device_batch(batch, BATCH), state.frozen)
        runs[scheme] = (float(loss), jax.tree.map(np.asarray, grads))
        reports[scheme] = rows_by_key(trainer.collectives(DATA))
    (plain_loss, plain_grads), (ring_loss, ring_grads) = runs["plain"], runs["ring"]
    np.testing.assert_allclose(ring_loss, plain_loss, rtol=1e-5, err_msg=f"seed {seed}")
    error = relative_error(ring_grads, plain_grads)
    assert error < 1e-5, f"adapters' gradients differ by {error:.3g}, seed {seed}"
    gathers = ("all_gather", (T,)) if sequence_parallel else ("psum", (T,))
    assert ("ppermute", (T,)) in reports["ring"] and gathers in reports["ring"], reports["ring"]
    assert ("ppermute", (T,)) not in reports["plain"], reports["plain"]
