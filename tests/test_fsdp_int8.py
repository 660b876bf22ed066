"""The fsdp gathers of int8 projections' weights moved as int8 (``dew.parallel.fsdp_int8``,
``StepOptions(quantize="int8")``).

The reference is the quantization of the whole weight on one device, written in numpy
(``tests/test_quantized.ref_quantize``), and one device's int8 step; every rounding is to nearest
(``quantize_stochastic`` without its key) so that the step's bound is tight."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import dew
from dew.collectives import hlo_text
from dew.mesh import build_mesh
from dew.nn import quantized
from dew.parallel import Shards, fsdp, fsdp_int8
from tests.equivalence import host_state, recording
from tests.helpers import fresh_batch, relative_error, seeded_key, tiny_objective
from tests.test_quantized import ROWS, draw, ref_quantize

# name: (whole shape, spec, the dimensions its einsum sums over). Split along the summed
# dimension (each device's peaks are partial: the pmax), along the output channels (the peaks
# travel), and o's layout, [heads, head_dim, embed] summed over two dimensions.
LEAVES = {
    "rows": ((48, 24), P("fsdp"), (0,)),
    "columns": ((48, 24), P(None, "fsdp"), (0,)),
    "heads": ((4, 6, 16), P(None, None, "fsdp"), (0, 1)),
}


def weights(seed, dtype):
    """``LEAVES``' weights: channels whose magnitudes differ by 30x (``draw``), a channel of
    zeros, and an outlier that only one device's block of ``rows`` holds (its other devices' own
    peaks are far below the channel's)."""
    rng = np.random.default_rng(seed)
    rows, columns = draw(seed, features=48, out=24)[1], draw(seed + 1, features=48, out=24)[1]
    rows[:, 0] = columns[:, 0] = 0.0
    rows[2, 3] = 50 * np.abs(rows[:, 3]).max()
    heads = rng.standard_normal((4, 6, 16)) * np.exp(rng.uniform(-1.7, 1.7, (1, 1, 16)))
    out = {"rows": rows, "columns": columns, "heads": heads}
    return {k: jnp.asarray(v, dtype) for k, v in out.items()}


@jax.jit(static_argnums=1)
def quantize_on_one_device(w, summed):
    return quantized.quantize_stochastic(w, summed, None)


@pytest.mark.parametrize(
    "n, packing, dtype",
    [(4, "bucket", "float32"), (4, "alone", "float32"), (8, "bucket", "bfloat16")]
    + [(8, "alone", "float32")],
)
def test_the_gathered_integers_and_scales_are_the_whole_weight_s(
    n, packing, dtype, monkeypatch, seed
):
    """On fsdp ``n``, each weight's int8 integers and peaks as gathered, and the dequantized
    weight the gather returns as ``int8_einsum`` quantizes it again, are bit for bit the numpy
    quantization of the whole weight, split along the summed dimension or the output channels,
    in one bucket or each alone; its gradient is the plain gather's, bit for bit."""
    print(f"seed {seed}")
    mesh = build_mesh(dew.MeshSpec(fsdp=n), devices=jax.devices()[:n])
    specs = {k: spec for k, (_, spec, _) in LEAVES.items()}
    summed = {(k,): s for k, (_, _, s) in LEAVES.items()}
    shards = Shards(axis_sizes=dict(mesh.shape), param_specs=specs)
    if packing == "alone":
        monkeypatch.setattr(fsdp, "BUCKET_BYTES", 0)
    full = weights(seed, dtype)
    rng = np.random.default_rng(seed + 2)
    # Each device's own gradient of the whole weight, [n, *shape], which the backward sums.
    cotangent = {k: jnp.asarray(rng.standard_normal((n, *w.shape)), dtype) for k, w in full.items()}

    def on_device(tree, cotangent):
        gathered, vjp = jax.vjp(lambda t: fsdp.gather(t, specs, shards, int8=summed), tree)
        plain_vjp = jax.vjp(lambda t: fsdp.gather(t, specs, shards), tree)[1]
        keys = sorted(tree)
        members = [
            fsdp_int8.member(
                tree[k].shape, fsdp.split_dim(specs[k]), LEAVES[k][2], specs[k], dict(mesh.shape)
            )
            for k in keys
        ]
        qs, peaks = fsdp_int8.quantize([tree[k] for k in keys], members)
        q_blocks, peak_blocks = fsdp_int8.gather_int8(qs, peaks, members, n, ring=False)
        wire = {k: (q, p) for k, q, p in zip(keys, q_blocks, peak_blocks)}
        own = {k: c[0] for k, c in cotangent.items()}
        return gathered, vjp(own)[0], plain_vjp(own)[0], wire

    run = jax.jit(
        jax.shard_map(
            on_device,
            mesh=mesh,
            in_specs=(specs, {k: P("fsdp") for k in specs}),
            out_specs=({k: P() for k in specs}, specs, specs, {k: P() for k in specs}),
            check_vma=False,
        )
    )
    gathered, grads, plain_grads, wire = run(full, cotangent)
    for k, (shape, spec, dims) in LEAVES.items():
        whole = np.asarray(full[k].astype(jnp.float32))
        # The target: the whole weight quantized on one device, as int8_einsum does. It is the
        # numpy formula's but on an exact half step: XLA divides as x * (1 / scale), which
        # rounds some of those the other way than numpy's true division (bfloat16 weights hit
        # them: half a channel's peak is one).
        one = jax.device_put(full[k], jax.devices()[0])
        ref_q, ref_scale = (np.asarray(a) for a in quantize_on_one_device(one, dims))
        formula_q, formula_scale = ref_quantize(whole, dims)
        np.testing.assert_array_equal(ref_scale, np.squeeze(formula_scale, dims))
        steps = whole / formula_scale
        off_ties = np.abs(np.abs(steps - np.floor(steps)) - 0.5) > 1e-4
        np.testing.assert_array_equal(ref_q[off_ties], formula_q[off_ties])
        split = fsdp.split_dim(spec)
        # On the wire: int8, each device's block at its row, the whole weight's peaks.
        q_blocks, peak_blocks = wire[k]
        assert q_blocks.dtype == jnp.int8, q_blocks.dtype
        q_wire = np.asarray(fsdp_int8.whole(q_blocks, split))
        np.testing.assert_array_equal(q_wire, ref_q, err_msg=f"{k} integers, seed {seed}")
        peak = np.asarray(peak_blocks)
        if peak.ndim > len(shape) - len(dims):  # [n, local channels]: gathered, in order
            kept = [d for d in range(len(shape)) if d not in dims]
            peak = np.asarray(fsdp_int8.whole(peak_blocks, kept.index(split)))
        ref_peak = np.max(np.abs(whole), axis=dims)
        np.testing.assert_array_equal(peak, ref_peak, err_msg=f"{k} peaks, seed {seed}")
        # What the einsum multiplies: the returned weight quantized as int8_einsum does.
        q, scale = quantized.quantize_stochastic(gathered[k], dims, None)
        np.testing.assert_array_equal(np.asarray(q), ref_q, err_msg=f"{k} requantized, {seed}")
        np.testing.assert_array_equal(np.asarray(scale), ref_scale, err_msg=f"{k} scales, {seed}")
        assert gathered[k].dtype == full[k].dtype
        # The backward: the float gradient sum as the plain gather's (the straight-through
        # estimator).
        np.testing.assert_array_equal(np.asarray(grads[k]), np.asarray(plain_grads[k]))
    assert np.abs(np.asarray(wire["rows"][0])).max() == 127


# --- A step at fsdp=8 against one device -----------------------------------------------------


@contextlib.contextmanager
def rounding_to_nearest():
    """Every int8 rounding to nearest while inside: the stochastic gradients' draws differ by
    layout (each device's shapes), rounding to nearest does not. JAX caches a traced
    ``custom_vjp`` rule by its function, and ``dew.nn.quantized``'s rules read
    ``quantize_stochastic`` when traced: the caches are cleared on entering and on leaving, so no
    trace made before is reused under the patch, and none made under it outlives it (the tests
    sharing this worker, tests/test_quantized.py's among them, failed by the other's rounding)."""
    stochastic = quantized.quantize_stochastic

    def to_nearest(v, summed, key, axis=None):
        return stochastic(v, summed, None, axis)

    jax.clear_caches()
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(quantized, "quantize_stochastic", to_nearest)
            yield
    finally:
        jax.clear_caches()


def int8_step(objective, params, key, batch, scheme="gather", **trainer_args):
    """``(loss, gradients, trainer, HLO)`` of one int8 step from ``params`` (one device unless
    ``mesh``): the step compiled once, for its numbers and its HLO text."""
    if "mesh" not in trainer_args:
        trainer_args.update(mesh=dew.MeshSpec(), devices=jax.devices()[:1])
    trainer = dew.Trainer(
        objective,
        recording(optax.sgd(0.1)),
        key,
        layout=dew.Layout(min_shard=1),
        options=dew.StepOptions(quantize="int8", fsdp_scheme=scheme),
        **trainer_args,
    )
    compiled = trainer.compiled_step(ROWS)
    state, metrics = compiled(host_state(trainer, params), trainer.device_batch(batch, ROWS))
    grads = jax.tree_util.tree_map(np.asarray, state.opt_state[0])
    return float(metrics["loss"]), grads, trainer, compiled.as_text()


@pytest.fixture(scope="module")
def reference(module_seed):
    """One device's int8 step (every rounding to nearest) and float32's loss and gradients."""
    key, batch = seeded_key(module_seed), fresh_batch(ROWS, module_seed)
    objective = tiny_objective()
    params = jax.jit(objective.model.init)(key)
    with rounding_to_nearest():
        int8 = int8_step(objective, params, key, batch)[:2]
    float_loss, float_grads = jax.jit(jax.value_and_grad(objective.loss))(params, batch)
    return dict(
        objective=objective,
        params=params,
        key=key,
        batch=batch,
        int8=int8,
        float=(float(float_loss), jax.tree_util.tree_map(np.asarray, float_grads)),
        fsdp8={},
    )


def fsdp8(reference, scheme):
    """The fsdp=8 int8 step of ``reference``'s weights and batch under ``scheme`` (every rounding
    to nearest), run once for the tests below: ``int8_step``'s."""
    runs = reference["fsdp8"]
    if scheme not in runs:
        with rounding_to_nearest():
            args = (reference[k] for k in ("objective", "params", "key", "batch"))
            runs[scheme] = int8_step(*args, scheme, mesh=dew.MeshSpec(fsdp=8))
    return runs[scheme]


@pytest.mark.parametrize("scheme", ["gather", "ring"])
def test_an_fsdp8_int8_step_is_one_device_s(scheme, reference, module_seed):
    """fsdp=8 (gathers, or rings of ppermutes) under ``quantize="int8"`` with every rounding to
    nearest against one device's. The forward quantizes the same integers with the same scales
    (the weights' by the gather, the activations' per token), so the loss is one device's up to
    float32's order of sums. The weight gradients' scales are each device's own over its tokens
    (they are summed after), so those differ by int8's rounding."""
    print(f"seed {module_seed}")
    ref = reference
    loss, grads, _, _ = fsdp8(reference, scheme)
    one_loss, one_grads = ref["int8"]
    float_loss, float_grads = ref["float"]
    int8_error = max(abs(one_loss - float_loss), 1e-4 * abs(one_loss))
    print(f"{scheme}: loss {abs(loss - one_loss) / int8_error:.3g} of int8's error from one's")
    int8_grad_error = relative_error(one_grads, float_grads)
    error = relative_error(grads, one_grads)
    print(f"{scheme}: gradients {error / int8_grad_error:.3g} of int8's error from one's")
    # Measured: the loss 0 to 0.05 of int8's error (a float32 sum's order moving an activation
    # across an int8 rounding boundary); the gradients 0.27 to 0.37. With each device's own
    # peaks (no pmax), 15 to 165 and 26 to 34.
    assert abs(loss - one_loss) <= 0.1 * int8_error, (loss, one_loss, float_loss)
    assert error < 0.5 * int8_grad_error, (error, int8_grad_error)


# --- What the compiled step's collectives carry ----------------------------------------------

# The layer's projections and the dimensions their einsums sum over (dew.nn.attention's
# "bse,ehd->bhsd" and "bhsd,hde->bse", dew.nn.mlp's "te,ef->tf" and "tf,fe->te").
SUMMED = {"q": (0,), "k": (0,), "v": (0,), "o": (0, 1), "gate": (0,), "up": (0,), "down": (0,)}


def operands(hlo: str, opcodes) -> list[tuple[str, int]]:
    """``(element type, bytes)`` of the operands of each instruction of ``opcodes`` in the
    compiled HLO text (every computation: each instruction once, a loop body's once); the bytes
    summed over its operands, the type its first's."""
    computations, _ = hlo_text.parse_module(hlo)
    found = []
    for comp in computations.values():
        for inst in comp.instructions:
            if inst.opcode in opcodes:
                shapes = [comp.shapes[name] for name in inst.operands]
                kind = shapes[0].split("[")[0].lstrip("(")
                found.append((kind, sum(hlo_text.shape_bytes(s) for s in shapes)))
    return found


@pytest.mark.parametrize("scheme", ["gather", "ring"])
def test_the_step_gathers_the_projections_as_int8_with_their_scales(scheme, reference):
    """The compiled fsdp=8 int8 step (2 layers): each layer's projections travel in one s8
    collective whose operand is each device's integers, plus 4 bytes a channel for the weights
    fsdp splits by output channel (o, down), so a layer's gather sends ``(n - 1) / n`` of the
    int8 weights plus those scales; the others' peaks (split along the summed width: q, k, v,
    gate, up) in one float32 pmax of a channel each. The float gathers carry only the norms and
    the embedding. Under the rings: ``n - 1`` s8 ppermutes of that operand a gather."""
    n = 8
    objective = reference["objective"]
    _, _, trainer, hlo = fsdp8(reference, scheme)
    shapes = jax.eval_shape(objective.model.init, jax.random.key(0))["params"]
    specs = trainer.param_specs["params"]
    payload = peaks = 0  # bytes per device and layer
    floats = set()  # the float gathers' operands: a layer's norms, the final norm, the table
    norms = 0
    for group, leaves in shapes["layers"].items():
        for name, leaf in leaves.items():
            shape, spec = leaf.shape[1:], tuple(specs["layers"][group][name])[1:]
            split = spec.index("fsdp")
            if name not in SUMMED:
                norms += 4 * np.prod(shape) // n
                continue
            channels = np.prod([s for d, s in enumerate(shape) if d not in SUMMED[name]])
            payload += np.prod(shape) // n
            if split in SUMMED[name]:
                peaks += 4 * channels
            else:
                payload += 4 * channels // n
    floats = {norms, 4 * shapes["final_norm"]["scale"].size // n}
    floats.add(4 * shapes["embed_tokens"]["embedding"].size // n)
    if scheme == "gather":
        sent = operands(hlo, ("all-gather", "all-gather-start"))
        int8 = [b for t, b in sent if t == "s8"]
        # Forward, and again in the backward (each layer runs under jax.checkpoint).
        assert int8 and set(int8) == {payload}, (sent, payload)
        assert {b for t, b in sent if t != "s8"} == floats, (sent, floats)
        assert all(t in ("s8", "f32") for t, _ in sent), sent
        wire = (n - 1) * payload  # an all-gather's wire bytes (dew.collectives.ring_wire_bytes)
    else:
        sent = operands(hlo, ("collective-permute", "collective-permute-start"))
        int8 = [b for t, b in sent if t == "s8"]
        assert int8 and set(int8) == {payload} and len(int8) % (n - 1) == 0, (sent, payload)
        wire = sum(int8) // (len(int8) // (n - 1))
    layer = shapes["layers"]["attn"]
    weights = sum(
        np.prod(w.shape[1:]) for g in shapes["layers"].values() for k, w in g.items() if k in SUMMED
    )
    scales = 4 * (layer["o"].shape[-1] + shapes["layers"]["mlp"]["down"].shape[-1])
    assert wire == (n - 1) * (weights + scales) // n, (wire, weights, scales)
    maxes = operands(hlo, ("all-reduce", "all-reduce-start"))
    assert ("f32", peaks) in maxes, (maxes, peaks)
