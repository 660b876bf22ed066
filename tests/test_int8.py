"""The int8 frozen base: the quantizer against its bound, the Hugging Face load that quantizes box
by box against quantizing the loaded weights, an int8 LoRA step on a tensor layout against one
device, and the int8 base's loss against the float base's."""

import jax
import jax.numpy as jnp
import numpy as np

import dew
from dew.models import hf, lora
from dew.nn.int8 import Quantized, dequantize, host_quantize, quantize
from dew.objectives.lm import LMObjective
from tests.equivalence import TOL, recording
from tests.helpers import fresh_batch, relative_error, seeded_key, smooth_optimizer
from tests.lora_reference import HF_BASE


def test_the_quantizer_round_trips_within_half_a_step(seed):
    """Every entry of ``dequantize(quantize(w))`` is within half its channel's scale of ``w``;
    a channel's largest entry is exact to float32 rounding; host and device agree bit for bit,
    the scale ``peak * float32(1 / 127)`` to the last bit."""
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((24, 3, 8)) * rng.uniform(0.01, 3.0, (1, 3, 8))).astype(np.float32)
    w[:, 0, 0] = 0.0  # a channel of zeros
    # A third of the channels peak where peak / 127 and peak * float32(1 / 127) differ in the last
    # bit (about 1 value in 25): a quantizer dividing on one side is caught at any seed, not only
    # where the draw happens to land on such a peak.
    reciprocal = np.float32(1.0 / 127)
    values = np.linspace(0.01, 3.0, 1000, dtype=np.float32)
    peaks = values[values / np.float32(127) != values * reciprocal][:8]
    channels = [(i // 8, i % 8) for i in range(1, 24, 3)]
    for (h, d), peak in zip(channels, peaks, strict=True):
        w[:, h, d] *= 0.99 * peak / np.abs(w[:, h, d]).max()
        w[rng.integers(24), h, d] = peak * rng.choice([-1, 1])
    q, scale = quantize(jnp.asarray(w), out_dims=(1, 2))
    assert q.dtype == jnp.int8 and scale.shape == (3, 8)
    back = np.asarray(dequantize(q, scale, out_dims=(1, 2)))
    step = np.asarray(scale)[None]
    assert np.all(np.abs(back - w) <= step / 2 * (1 + 1e-6))
    assert np.max(np.abs(back - w) / step) > 0.45, "a quantizer that rounds nothing"
    np.testing.assert_array_equal(back[:, 0, 0], 0.0)
    assert np.abs(np.asarray(q)).max() == 127
    host_q, host_scale = host_quantize(w, out_dims=(1, 2))
    np.testing.assert_array_equal(host_q, np.asarray(q))
    np.testing.assert_array_equal(host_scale, np.asarray(scale))
    for (h, d), peak in zip(channels, peaks):
        assert host_scale[h, d] == peak * reciprocal, (h, d, peak, seed)


def int8_objective(**fields):
    config = hf.read_config(HF_BASE)
    model = hf.model_from_config(
        config, str(HF_BASE), lora=lora.Lora(rank=4, base_dtype="int8"), **fields
    )
    return LMObjective(model, 40)


def test_the_hf_load_quantizes_each_box_as_quantizing_the_whole_weights():
    """On fsdp=8 the model width (each matrix's input dimension of q, k, v, gate and up) is split:
    each device's box is read with its input rows whole to find its scales. The result equals
    the float weights loaded whole and quantized on the device, bit for bit."""
    objective = int8_objective()
    trainer = dew.Trainer(
        objective,
        smooth_optimizer(),
        jax.random.key(0),
        mesh=dew.MeshSpec(fsdp=8),
        layout=dew.Layout(min_shard=1),
        base=HF_BASE,
    )
    split = trainer.state_shardings.frozen["params"]["layers"]["attn"]["q"].values.spec
    assert "fsdp" in tuple(split)[:2], split  # layers or the input dimension: a split box
    state = trainer.init_state()
    _, whole = hf.load(HF_BASE)
    expected = jax.jit(lambda p: lora.frozen_of(objective.model, p))(whole)
    q = state.frozen["params"]["layers"]["attn"]["q"]
    assert isinstance(q, Quantized) and q.values.dtype == jnp.int8
    for got, want in zip(
        jax.tree_util.tree_leaves(state.frozen), jax.tree_util.tree_leaves(expected), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_an_int8_lora_step_on_data_4_tensor_2_matches_one_device(seed):
    """The int8 matrices and their scales split over tensor (heads, MLP width): loss and the
    adapters' gradients of a step within 1e-5 of one device's."""
    objective = int8_objective()
    model = objective.model
    key = seeded_key(seed)

    @jax.jit  # one compiled program, not op by op
    def weights(key):
        frozen = lora.frozen_of(model, model.init(key))
        adapters = jax.tree_util.tree_map_with_path(
            lambda path, x: 0.05 * jax.random.normal(key, x.shape) if path[-1].key == "b" else x,
            lora.init_adapters(model, key),
        )
        return frozen, adapters

    frozen, adapters = weights(key)
    batch = fresh_batch(8, seed, vocab=model.vocab_size, seq=40)

    def loss(adapters):
        return objective.loss(lora.combine(model, frozen, adapters), jnp.asarray(batch))

    want_loss, want_grads = jax.jit(jax.value_and_grad(loss))(adapters)
    trainer = dew.Trainer(
        objective,
        recording(smooth_optimizer()),
        key,
        mesh=dew.MeshSpec(data=4, tensor=2),
        layout=dew.Layout(min_shard=1),
    )
    params = jax.tree_util.tree_map(np.asarray, adapters)
    state = dew.TrainState(
        step=np.zeros((), np.int32),
        params=params,
        # On the host, as the weights: placed from there, not cut by a program per shape.
        opt_state=jax.device_get(trainer.optimizer.init(params)),
        ema=None,
        key=jax.random.key_data(key),
        frozen=jax.tree_util.tree_map(np.asarray, frozen),
    )
    state = jax.device_put(
        state.replace(key=jax.random.wrap_key_data(np.asarray(state.key))), trainer.state_shardings
    )
    state, metrics = trainer.train_step(8)(state, trainer.device_batch(batch, 8))
    np.testing.assert_allclose(float(metrics["loss"]), float(want_loss), rtol=TOL)
    assert relative_error(state.opt_state[0], want_grads) < TOL, f"seed {seed}"


# Measured on the reference model's tokens (2 rows of 40): the int8 base's loss differed from the
# float32 base's by 9.2e-5 of it (6.055097 against 6.055653).
LOSS_BOUND = 3e-4


def test_the_int8_base_loss_is_within_its_bound_and_its_merge_is_the_adapted_model():
    """At fresh adapters (B = 0) the LoRA model is its base: the int8 base's loss on the
    reference tokens is within ``LOSS_BOUND`` (relative) of the float32 base's. ``lora.merge`` of
    an int8 base (dequantized, adapters folded in: what ``--to hf`` writes) computes the adapted
    model's logits within 1e-5."""
    objective = int8_objective()
    model = objective.model
    _, base = hf.load(HF_BASE)
    tokens = np.load(HF_BASE / "tokens.npy")
    batch = jnp.asarray(np.concatenate([tokens, tokens[:, :1]], axis=1))
    # Each one compiled program, not op by op.
    adapters = jax.jit(lambda key: lora.init_adapters(model, key))(jax.random.key(0))
    int8 = jax.jit(lambda p: lora.frozen_of(model, p))(base)
    loss = jax.jit(objective.loss)
    float_loss = float(loss(base, batch))
    int8_loss = float(loss(lora.combine(model, int8, adapters), batch))
    print(f"float32 {float_loss:.6f}, int8 {int8_loss:.6f}")
    assert abs(int8_loss - float_loss) / float_loss < LOSS_BOUND
    assert int8_loss != float_loss
    # The merged export of an int8 base: dequantized, then the adapters folded in.
    drawn = jax.tree_util.tree_map(lambda x: x + 0.05, adapters)
    joined = jax.jit(model.apply)(lora.combine(model, int8, drawn), batch[:, :-1])
    merged = jax.jit(model.apply)(lora.merge(model, int8, drawn), batch[:, :-1])
    assert relative_error(merged, joined) < TOL
