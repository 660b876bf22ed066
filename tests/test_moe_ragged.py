"""The ragged expert exchange (dew/parallel/ragged.py, docs/moe.md).

On CPU it runs through its emulation, which takes the accelerator path's offsets: the offsets
against a loop-written reference, the emulation against ``lax.ragged_all_to_all``'s documented
semantics, the MoE layer (rematerialized, as the step runs it) against the padded exchange and one
device (random routers and a skewed one, whose overflow past the receive buffer is counted against
an independent count). On a TPU slice compiled here (libtpu, no TPU): the expert=8 step's HLO
holds ``ragged-all-to-all`` and moves at most 1/4 of the padded exchange's bytes, in less
temporary memory. Random tests take the ``seed`` fixture (tests/conftest.py; replay with
``DEW_SEED``).
"""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import dew
from dew.cli.main import build_parser
from dew.cli.model_flags import model_config
from dew.parallel import ONE_DEVICE, Shards, expert, ragged
from tests.helpers import relative_error
from tests.test_moe_reference import POSITIONS, continuous_part, route_reference
from tests.test_moe_reference import random_layer as reference_layer

TOL = 1e-5

# ------------------------------------------------------------------------------------------------
# The offsets


def route_by_loops(counts, me, rows):
    """``ragged.route``'s documented rule written with loops: ``(fields, group_sizes, dropped)``,
    ``fields`` a dict of the six ``Route`` arrays for device ``me``. A receiver's buffer holds its
    experts in order, each expert's copies from source 0 up; a run keeps what fits under
    ``rows``; an empty run's offsets are 0."""
    n, num_experts = counts.shape
    local = num_experts // n
    start, kept = np.zeros_like(counts), np.zeros_like(counts)
    for d in range(n):
        filled = 0
        for e in range(d * local, (d + 1) * local):
            for s in range(n):
                start[s, e] = filled
                kept[s, e] = max(0, min(counts[s, e], rows - filled))
                filled += counts[s, e]
    at = np.array([[counts[s, :e].sum() for e in range(num_experts)] for s in range(n)])
    fields = {k: np.zeros(num_experts, np.int64) for k in ragged.Route._fields}
    for e in range(num_experts):
        size = kept[me, e]
        fields["send_sizes"][e] = size
        fields["input_offsets"][e] = at[me, e] if size else 0
        fields["output_offsets"][e] = start[me, e] if size else 0
    for s in range(n):
        for i in range(local):
            e, j = me * local + i, s * local + i
            size = kept[s, e]
            fields["recv_sizes"][j] = size
            fields["recv_offsets"][j] = start[s, e] if size else 0
            fields["source_offsets"][j] = at[s, e] if size else 0
    group_sizes = [kept[:, me * local + i].sum() for i in range(local)]
    return fields, np.array(group_sizes), counts[me].sum() - kept[me].sum()


def test_route_matches_a_loop_reference(seed):
    rng = np.random.default_rng(seed)
    # (n, E, rows): one expert per device, several, and buffers from roomy to overflowing.
    for n, num_experts, rows in [(8, 8, 40), (4, 8, 12), (2, 8, 30), (4, 16, 7)]:
        counts = rng.integers(0, 6, (n, num_experts)) * (rng.random((n, num_experts)) < 0.8)
        counts[0, 0] += 9  # one hot expert
        got = jax.jit(jax.vmap(ragged.route, in_axes=(None, 0, None)), static_argnums=2)(
            jnp.asarray(counts, jnp.int32), jnp.arange(n), rows
        )
        plan, group_sizes, dropped = jax.tree_util.tree_map(np.asarray, got)
        for me in range(n):
            fields, want_groups, want_dropped = route_by_loops(counts, me, rows)
            where = f"n {n}, E {num_experts}, rows {rows}, device {me}, seed {seed}"
            for name, want in fields.items():
                np.testing.assert_array_equal(getattr(plan, name)[me], want, err_msg=name + where)
            np.testing.assert_array_equal(group_sizes[me], want_groups, err_msg=where)
            assert dropped[me] == want_dropped, where
        # What every device sends is what its receivers expect (ragged_all_to_all's contract),
        # and the route back of the route back is the route.
        local = num_experts // n
        for s in range(n):
            for d in range(n):
                sent = plan.send_sizes[s, d * local : (d + 1) * local]
                np.testing.assert_array_equal(sent, plan.recv_sizes[d, s * local : (s + 1) * local])
        twice = plan.reverse().reverse()
        for name in ragged.Route._fields:
            np.testing.assert_array_equal(getattr(twice, name), getattr(plan, name))


def test_the_emulation_does_what_ragged_all_to_all_documents(seed):
    # JAX's docstring of lax.ragged_all_to_all, in numpy: slice i of a device's operand goes to
    # device i // (K / n) at the offset the sender gives; the receiver's recv_sizes say how much.
    # Slices here have gaps between them and land out of order, several per destination.
    rng = np.random.default_rng(seed)
    n, per, rows_in, rows_out, width = 4, 3, 48, 48, 2
    slices = n * per
    sizes = rng.integers(0, 4, (n, slices))
    inputs = np.zeros((n, slices), np.int64)
    outputs = np.zeros((n, slices), np.int64)
    recv = np.zeros((n, slices), np.int64)
    for s in range(n):
        gaps = rng.integers(0, 2, slices)
        inputs[s] = np.cumsum(sizes[s] + gaps) - sizes[s]
    for d in range(n):  # each receiver places its incoming slices in a random order
        pieces = [(s, i) for s in range(n) for i in range(per)]
        filled = 0
        for s, i in (pieces[p] for p in rng.permutation(len(pieces))):
            outputs[s, d * per + i] = filled
            recv[d, s * per + i] = sizes[s, d * per + i]
            filled += sizes[s, d * per + i] + 1
    operand = rng.normal(size=(n, rows_in, width)).astype(np.float32)
    want = np.zeros((n, rows_out, width), np.float32)
    for s in range(n):
        for i in range(slices):
            size, at = sizes[s, i], outputs[s, i]
            want[i // per, at : at + size] = operand[s, inputs[s, i] : inputs[s, i] + size]

    def body(x, input_offsets, send_sizes, output_offsets, recv_sizes):
        out = ragged.emulated_ragged_all_to_all(
            x[0],
            jnp.zeros((rows_out, width), x.dtype),
            input_offsets[0],
            send_sizes[0],
            output_offsets[0],
            recv_sizes[0],
            axis_name="x",
            chunk=per * 3,
        )
        return out[None]

    mesh = Mesh(np.array(jax.devices()[:n]), ("x",))
    run = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False)
    )
    args = [a.astype(np.int32) for a in (inputs, sizes, outputs, recv)]
    got = run(operand, *args)
    np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"seed {seed}")


# ------------------------------------------------------------------------------------------------
# The layer: data 2 x expert 4 on the 8 CPU devices, 8 experts (2 per device), rows split over
# both axes as the step splits them.

EXPERTS, GROUPS, N = 8, 2, 4
TOKENS = ("data", "expert")
LAYER_ROWS = 16  # POSITIONS, the width and the hidden size are test_moe_reference's
SHARDS = Shards(axis_sizes={"data": GROUPS, "expert": N})
EXPERT_SPECS = {name: P("expert") for name in ("gate", "up", "down")}
LAYER_SPECS = {"router": {"kernel": P()}, "experts": EXPERT_SPECS}


def random_layer(seed, router_scale=1.0):
    """Float32 ``(layer, x, cotangent)``, ``x`` ``[LAYER_ROWS, POSITIONS, EMBED]``: the reference
    tests' random layer (drawn again while a token's best logits nearly tie) and a cotangent."""
    layer, x = reference_layer(seed, EXPERTS, 2, router_scale, rows=LAYER_ROWS)
    cotangent = np.random.default_rng((seed, 1)).normal(0.0, 1.0, x.shape)
    return layer, x, jnp.asarray(cotangent, jnp.float32)


def objective(shards, k, exchange, buffer_factor):
    """``(layer, x, cotangent) -> (sum(y * cotangent) + the router losses, (y, stats))`` of Dew's
    layer on ``shards``."""

    def run(layer, x, cotangent):
        y, stats = expert.moe_mlp(
            layer,
            x,
            shards,
            num_experts=EXPERTS,
            k=k,
            capacity_factor=None,
            exchange=exchange,
            buffer_factor=buffer_factor,
        )
        return jnp.sum(y * cotangent) + stats.load_balance + stats.z_loss, (y, stats)

    return run


def one_device(k):
    """The layer on one device: ``(y, stats, layer gradient, x gradient)``."""
    grad = jax.value_and_grad(objective(ONE_DEVICE, k, "auto", None), (0, 1), has_aux=True)

    @jax.jit
    def run(layer, x, cotangent):
        (_, (y, stats)), (d_layer, d_x) = grad(layer, x, cotangent)
        return y, stats, d_layer, d_x

    return run


def sharded(k, exchange, buffer_factor):
    """The same over the mesh, as the step runs it: the layer rematerialized in the backward
    (``jax.checkpoint`` saving nothing: the exchanges run again before their transposes), the
    gradients taken inside the shard_map, the experts' summed over ``data`` (the exchange's
    transpose brought each device every copy routed to its experts), the router's over the token
    axes; stats summed over the devices."""
    layer_fn = jax.checkpoint(
        objective(SHARDS, k, exchange, buffer_factor),
        policy=jax.checkpoint_policies.nothing_saveable,
        prevent_cse=False,
    )
    grad = jax.value_and_grad(layer_fn, (0, 1), has_aux=True)

    def body(layer, x, cotangent):
        (_, (y, stats)), (d_layer, d_x) = grad(layer, x, cotangent)
        d_layer = {
            "router": lax.psum(d_layer["router"], TOKENS),
            "experts": lax.psum(d_layer["experts"], "data"),
        }
        return y, lax.psum(stats, TOKENS), d_layer, d_x

    mesh = Mesh(np.array(jax.devices()).reshape(GROUPS, N), TOKENS)
    rows = P(TOKENS)
    return jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(LAYER_SPECS, rows, rows),
            out_specs=(rows, P(), LAYER_SPECS, rows),
            check_vma=False,
        )
    )


def overflow_keep(ids, rows):
    """Which copies the ragged exchange keeps, by its documented rule, with no code of Dew's:
    ``ids`` ``[LAYER_ROWS, POSITIONS, k]``; device ``(g, s)`` of the mesh routes row block ``g N
    + s``; receiver ``d`` of each data group fills its ``rows``-row buffer with its experts in
    order, each expert's copies from source 0 up, a source's in token then choice order."""
    keep = np.zeros(ids.shape, bool)
    block = LAYER_ROWS // (GROUPS * N)
    local = EXPERTS // N
    for g in range(GROUPS):
        for d in range(N):
            filled = 0
            for e in range(d * local, (d + 1) * local):
                for s in range(N):
                    first = (g * N + s) * block
                    for index in zip(*np.nonzero(ids[first : first + block] == e)):
                        row, position, choice = index
                        keep[first + row, position, choice] = filled < rows
                        filled += 1
    return keep


def assert_close(got, want, what, seed):
    error = relative_error(got, want)
    assert error < TOL, f"{what} differs by {error:.3g}, seed {seed}"


def test_the_ragged_layer_equals_the_padded_one_and_one_device(seed):
    # A random router, the default receive buffer: 2 x the 64 copies a device routes, which a
    # random router's copies fit (checked below against the rule, not assumed).
    layer, x, cotangent = random_layer(seed)
    ids, _ = route_reference(layer["router"]["kernel"], x, 2)
    rows = ragged.buffer_rows(64, 64, N, ragged.DEFAULT_BUFFER_FACTOR)
    assert rows == 128 and overflow_keep(ids, rows).all(), seed

    want = one_device(2)(layer, x, cotangent)
    for exchange in ("padded", "ragged"):
        y, stats, d_layer, d_x = sharded(2, exchange, ragged.DEFAULT_BUFFER_FACTOR)(
            layer, x, cotangent
        )
        assert_close(y, want[0], f"{exchange}: the output", seed)
        assert_close(d_layer["router"], want[2]["router"], f"{exchange}: the router's grad", seed)
        assert_close(d_layer["experts"], want[2]["experts"], f"{exchange}: experts' grads", seed)
        assert_close(d_x, want[3], f"{exchange}: the input's gradient", seed)
        for name in ("load_balance", "z_loss", "routed"):
            np.testing.assert_allclose(
                getattr(stats, name), getattr(want[1], name), rtol=TOL, err_msg=f"{name} {seed}"
            )
        assert float(stats.dropped) == 0, (exchange, seed)


@pytest.mark.parametrize(
    "buffer_factor, rows",
    # The buffer's rows by hand: N x 32 (the worst case), 1.5 x 32 = 48, and 1.41 x 32 = 45.12,
    # whose 45 rows would drop a copy that ceil keeps.
    [(None, 128), (1.5, 48), (1.41, 46)],
    ids=["worst_case", "overflow", "fractional_overflow"],
)
def test_a_skewed_router_fills_the_buffer_and_counts_what_overflows(seed, buffer_factor, rows):
    # Every token's one copy goes to expert 0 (a zero router: all logits tie, top_k takes the
    # lowest), on device 0 of each data group: N x 32 copies for a buffer of ``rows``. Overflow
    # drops what lies past it in the rule's order (for 48 rows: source 1's last 16 and all of
    # sources 2 and 3), 128 - rows of each group's 128, counted with no code of Dew's.
    layer, x, cotangent = random_layer(seed)
    layer = {**layer, "router": {"kernel": jnp.zeros_like(layer["router"]["kernel"])}}
    ids = np.zeros((LAYER_ROWS, POSITIONS, 1), np.int64)
    copies = LAYER_ROWS * POSITIONS // (GROUPS * N)
    assert copies == 32 and ragged.buffer_rows(copies, copies, N, buffer_factor) == rows
    keep = overflow_keep(ids, rows)

    y, stats, d_layer, _ = sharded(1, "ragged", buffer_factor)(layer, x, cotangent)
    assert float(stats.dropped) == np.sum(~keep), (float(stats.dropped), np.sum(~keep), seed)
    assert float(stats.routed) == ids.size, seed
    if buffer_factor is None:
        assert keep.all()
        want = one_device(1)(layer, x, cotangent)
        assert_close(y, want[0], "the output", seed)
        assert_close(d_layer["experts"], want[2]["experts"], "the experts' gradients", seed)
    else:
        assert np.sum(~keep) == GROUPS * (128 - rows)
        # The dropped copies contribute nothing: the float64 reference with the rule's keep.
        layer64 = jax.tree_util.tree_map(lambda w: np.asarray(w, np.float64), layer)
        want, _, _ = continuous_part(np, layer64, np.asarray(x, np.float64), ids, keep)
        assert_close(y, want, "the output", seed)


@pytest.mark.parametrize(
    "copies, slots, expert_size, factor, rows",
    [
        (32, 32, 4, 2.0, 64),  # the default: 2 x a device's share
        (10, 10, 4, 1.25, 13),  # 12.5 rounds up: a 13th copy still fits
        (10, 10, 4, 0.35, 4),  # 3.5 -> 4
        (3, 3, 8, 0.1, 1),  # 0.3 -> 1, never an empty buffer
        (7, 7, 2, 1.01, 8),  # 7.07 -> 8: any fraction past a whole row takes a row
        (10, 3, 4, 2.0, 12),  # 20 copies' room, but 4 devices can send only 3 each
        (10, 10, 4, None, 40),  # the worst case
    ],
)
def test_the_receive_buffer_rounds_up_and_stops_at_the_worst_case(
    copies, slots, expert_size, factor, rows
):
    # Each value by hand: min(expert_size x slots, ceil(factor x copies)), at least 1.
    assert ragged.buffer_rows(copies, slots, expert_size, factor) == rows


def test_the_receive_buffer_holds_factor_times_the_share_whatever_the_fraction():
    # Over a grid of fractional factors: the buffer holds at least factor x copies (or the worst
    # case) and less than one row more; a row count found by counting up, not by rounding.
    for copies in (1, 3, 7, 32, 100):
        for tenths in range(1, 41):
            factor = tenths / 10 + 0.03
            worst = 4 * copies
            need = 0
            while need < factor * copies and need < worst:
                need += 1
            got = ragged.buffer_rows(copies, copies, 4, factor)
            assert got == max(1, need), (copies, factor, got, need)


# ------------------------------------------------------------------------------------------------
# The setting


def test_auto_picks_ragged_on_accelerators_and_padded_on_cpu():
    assert ragged.resolve("auto", "tpu") == "ragged" and ragged.resolve("auto", "gpu") == "ragged"
    assert ragged.resolve("auto", "cpu") == "padded"
    assert (
        ragged.resolve("ragged", "cpu") == "ragged" and ragged.resolve("padded", "tpu") == "padded"
    )


def test_the_exchange_flags_reach_the_model_and_bad_values_are_refused():
    parser = build_parser()

    def model(*flags):
        args = parser.parse_args(["train", "--experts", "8", *flags])
        return dew.models.build("causal_transformer", **model_config(args))

    default = model()
    assert (default.expert_exchange, default.expert_buffer_factor) == ("auto", 2.0)
    chosen = model("--expert-exchange", "ragged", "--expert-buffer-factor", "1.5")
    assert (chosen.expert_exchange, chosen.expert_buffer_factor) == ("ragged", 1.5)
    with pytest.raises(ValueError, match="unknown expert_exchange 'fast'; expected one of auto"):
        model("--expert-exchange", "fast")
    with pytest.raises(ValueError, match="--expert-buffer-factor must be above 0 .* got 0"):
        model("--expert-buffer-factor", "0")
    for flags in (["--expert-exchange", "padded"], ["--expert-buffer-factor", "3"]):
        args = parser.parse_args(["train", *flags])
        with pytest.raises(ValueError, match="configures mixture-of-experts layers"):
            model_config(args)


# ------------------------------------------------------------------------------------------------
# On a TPU slice (compiled here with libtpu: nothing runs)


@pytest.mark.xdist_group("tpu")
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu")
def test_the_expert8_step_for_v5p16_moves_ragged_copies_in_a_quarter_of_the_bytes():
    from dew.collectives import hlo_collectives
    from dew.objectives.lm import LMObjective
    from dew.targets import target

    # One MoE layer, bf16 activations of width 256 (a bf16 row narrower than 256 is padded to
    # 256 values in the TPU's ragged exchange), 16 rows of 16 positions: c = 2 x 16 x 2 = 64
    # copies per device, a receive buffer of R = 128 rows.
    devices = target("v5p-16").devices()
    batch, seq, width, itemsize = 16, 16, 256, 2
    copies = batch // 8 * seq * 2
    rows = ragged.buffer_rows(copies, copies, 8, ragged.DEFAULT_BUFFER_FACTOR)
    steps = {}
    for exchange in ("padded", "auto"):  # auto: ragged, as the mesh's devices are TPUs
        model = dew.models.build(
            "causal_transformer",
            **dict(vocab_size=256, emb_features=width, num_layers=1, num_heads=4),
            **dict(max_seq_len=seq, mlp_features=128, dtype="bfloat16", num_experts=8),
            expert_exchange=exchange,
        )
        trainer = dew.Trainer(
            LMObjective(model, seq),
            optax.sgd(0.1),
            jax.random.key(0),
            mesh=dew.MeshSpec(expert=8),
            layout=dew.Layout(min_shard=4096),
            devices=devices,
        )
        compiled = trainer.compiled_step(batch)
        steps[exchange] = (compiled, hlo_collectives(compiled, trainer.mesh))

    def rows_of(report, op):
        return [r for r in report.rows if r.op == op]

    (_, padded_report), (ragged_step, ragged_report) = steps["padded"], steps["auto"]
    assert "ragged-all-to-all" in ragged_step.as_text()
    assert not rows_of(ragged_report, "all_to_all")
    assert not rows_of(padded_report, "ragged_all_to_all")
    (exchange,) = rows_of(ragged_report, "ragged_all_to_all")
    # Each call sends the sorted copies [c, width] (a dispatch, or the transpose of a combine) or
    # the receive buffer [R, width] (a combine, or the transpose of a dispatch): as many of each.
    assert exchange.axes == ("expert",) and exchange.count % 2 == 0, exchange
    pair = (copies + rows) * width * itemsize
    assert exchange.operand_bytes == exchange.count // 2 * pair, exchange
    # The exchange's wire bytes: all the ragged step sends beyond what the padded step sends
    # besides its all_to_alls (the ragged calls, and the one exchange of counts, which the TPU
    # compiler runs as an all-reduce), against those all_to_alls.
    total = {name: sum(r.wire_bytes for r in report.rows) for name, (_, report) in steps.items()}
    padded_wire = sum(r.wire_bytes for r in rows_of(padded_report, "all_to_all"))
    ragged_wire = total["auto"] - (total["padded"] - padded_wire)
    counts = ragged_wire - exchange.wire_bytes
    temp = {name: c.memory_analysis().temp_size_in_bytes for name, (c, _) in steps.items()}
    print(
        f"expert=8 on v5p-16: exchange wire bytes per device {ragged_wire} ragged, {padded_wire} "
        f"padded ({ragged_wire / padded_wire:.3f}); temp {temp['auto']} against {temp['padded']}"
    )
    assert 0 <= counts < 4096 and ragged_wire <= padded_wire / 4
    assert temp["auto"] < temp["padded"] and total["auto"] < total["padded"]
