"""Which attention a step runs (``attention_impl``: ``"auto"`` and ``"cudnn"``), by the devices it
is compiled for: the pure rule (``dew.nn.attention.resolve``) for CPU, TPU and GPU, the step traced
for a CPU mesh, a TPU slice (compile-only devices) and a GPU (an abstract GPU mesh: no GPU here),
and the refusals, raised while tracing, before anything is compiled."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

import dew
from dew.nn import attention
from dew.objectives.lm import LMObjective
from tests.helpers import SEQ, VOCAB, fresh_batch, relative_error, seeded_key

BF16, F32, F16 = jnp.bfloat16, jnp.float32, jnp.float16


@pytest.mark.parametrize(
    "platform, dtype, head_dim, ring, expected",
    [
        ("cpu", BF16, 64, False, "xla"),
        ("cpu", F32, 64, True, "xla"),
        ("tpu", BF16, 128, False, "pallas"),  # Mosaic
        ("tpu", F32, 64, True, "pallas"),
        ("tpu", F16, 64, False, "xla"),  # the kernels take float32 and bfloat16 only
        ("gpu", BF16, 64, False, "cudnn"),
        ("gpu", F16, 128, False, "cudnn"),
        ("gpu", F32, 64, False, "pallas"),  # cuDNN's flash attention is half precision only
        ("gpu", BF16, 256, False, "pallas"),  # past CUDNN_MAX_HEAD_DIM; Triton takes 256
        ("gpu", BF16, 64, True, "pallas"),  # a ring needs the lse: the Triton kernels give it
        ("gpu", F32, 96, False, "xla"),  # Triton needs a power-of-two head_dim
        ("gpu", F16, 64, True, "xla"),  # neither cuDNN (ring) nor Triton (float16)
    ],
)
def test_auto_picks_by_platform_dtype_and_head_dim(platform, dtype, head_dim, ring, expected):
    assert attention.resolve("auto", platform, dtype, head_dim, ring) == expected
    # What the model asks, for a sequence axis of 2 under the ring scheme.
    model = build(dtype=np.dtype(dtype).name, emb_features=4 * head_dim, attention_impl="auto")
    axes = {"sequence": 2} if ring else {}
    assert model.attention_for(platform, axes) == expected
    assert model.attention_for(platform, axes, sequence_scheme="all_to_all") == (
        attention.resolve("auto", platform, dtype, head_dim, False)
    )


def test_explicit_choices_are_kept():
    for impl in ("xla", "pallas", "pallas_tpu_interpret"):
        for platform in ("cpu", "gpu", "tpu"):
            assert attention.resolve(impl, platform, F32, 64, True) == impl
    assert attention.resolve("cudnn", "gpu", BF16, 64) == "cudnn"


@pytest.mark.parametrize(
    "platform, dtype, head_dim, ring, message",
    [
        (
            "cpu",
            BF16,
            64,
            False,
            "it runs on GPU only, and this step is compiled for 'cpu' devices",
        ),
        (
            "tpu",
            BF16,
            64,
            False,
            "it runs on GPU only, and this step is compiled for 'tpu' devices",
        ),
        ("gpu", F32, 64, False, "it takes bfloat16 or float16 activations, not float32"),
        ("gpu", BF16, 144, False, "it takes head_dim a multiple of 8 up to 128, not 144"),
        ("gpu", BF16, 64, True, "ring attention merges blocks by their log-sum-exp"),
    ],
)
def test_cudnn_is_refused_where_it_cannot_run(platform, dtype, head_dim, ring, message):
    with pytest.raises(ValueError, match="attention_impl 'cudnn' cannot run this step: " + message):
        attention.resolve("cudnn", platform, dtype, head_dim, ring)


def test_unknown_attention_is_refused_naming_the_choices():
    with pytest.raises(
        ValueError,
        match="unknown attention_impl 'flash'; expected one of xla, pallas, pallas_tpu_interpret, "
        "cudnn, auto",
    ):
        build(attention_impl="flash")


# --- The step, traced for the devices it is compiled for ------------------------------------------


def build(**overrides):
    config = dict(vocab_size=VOCAB, emb_features=32, num_layers=1, num_heads=4, max_seq_len=SEQ)
    return dew.models.build("causal_transformer", **{**config, **overrides})


def trainer_for(model, mesh, **kwargs):
    return dew.Trainer(
        LMObjective(model, SEQ), optax.sgd(0.1), jax.random.key(0), mesh=mesh, **kwargs
    )


def kernel_calls(jaxpr):
    """The module of each pallas_call's compiler parameters (None in an interpreter), nested
    calls included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            params = eqn.params.get("compiler_params")
            yield None if eqn.params["interpret"] else type(params).__module__
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from kernel_calls(inner)


def step_kernels(trainer, rows=8) -> set:
    traced = trainer.train_step(rows).trace(*trainer.step_arguments(rows))
    return set(kernel_calls(traced.jaxpr.jaxpr))


def test_auto_on_cpu_runs_xla_attention():
    mesh = dew.MeshSpec(fsdp=8)
    assert step_kernels(trainer_for(build(attention_impl="auto"), mesh)) == set()
    # The check sees kernels where there are some: "pallas" on CPU is the interpreter.
    assert step_kernels(trainer_for(build(attention_impl="pallas"), mesh)) == {None}


@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="compile-only TPU devices need libtpu (pip install -e '.[tpu]')",
)
def test_auto_on_a_tpu_slice_runs_the_mosaic_kernels():
    from dew.targets import target

    trainer = trainer_for(
        build(attention_impl="auto", dtype="bfloat16"),
        dew.MeshSpec(fsdp=8),
        layout=dew.Layout(min_shard=4096),
        devices=target("v5e-8").devices(),
    )
    modules = step_kernels(trainer)
    assert modules and all("mosaic" in m for m in modules), modules


def gpu_mesh() -> AbstractMesh:
    device = AbstractDevice(device_kind="NVIDIA H200", num_cores=1, platform="gpu")
    return AbstractMesh((1,), ("x",), abstract_device=device)


def test_auto_on_a_gpu_runs_triton_for_float32_and_asks_cudnn_for_bfloat16():
    # No GPU here: the model is traced under an abstract mesh of GPU devices, what shard_map
    # gives a step compiled for GPUs. float32: cuDNN's flash attention does not take it, the
    # Triton kernels do. bfloat16: cuDNN, which JAX looks for while tracing (and finds none here).
    batch = jax.ShapeDtypeStruct((2, SEQ + 1), jnp.int32)
    for dtype in ("float32", "bfloat16"):
        objective = LMObjective(build(attention_impl="auto", dtype=dtype, emb_features=64), SEQ)
        params = jax.eval_shape(objective.model.init, jax.random.key(0))
        loss_grad = jax.grad(objective.loss)
        with jax.sharding.use_abstract_mesh(gpu_mesh()):
            if dtype == "float32":
                jaxpr = jax.make_jaxpr(loss_grad)(params, batch).jaxpr
                modules = set(kernel_calls(jaxpr))
                assert modules and all("triton" in m for m in modules), modules
            else:
                with pytest.raises(RuntimeError, match="cuDNN"):
                    jax.make_jaxpr(loss_grad)(params, batch)


# --- Refusals before compiling, and cuDNN's place in the model ------------------------------------


def test_cudnn_on_cpu_is_refused_by_the_trainer_and_by_the_trace():
    model = build(attention_impl="cudnn", dtype="bfloat16")
    refusal = "runs on GPU only, and this step is compiled for 'cpu'"
    # The Trainer refuses it as it is built, before any step is traced...
    with pytest.raises(ValueError, match=refusal):
        trainer_for(model, dew.MeshSpec(fsdp=8))
    # ...and the model itself while tracing, for a caller that builds no Trainer.
    objective = LMObjective(model, SEQ)
    params = jax.eval_shape(model.init, jax.random.key(0))
    batch = jax.ShapeDtypeStruct((2, SEQ + 1), jnp.int32)
    with pytest.raises(ValueError, match=refusal):
        jax.make_jaxpr(jax.grad(objective.loss))(params, batch)


def test_cudnn_on_a_ring_is_refused():
    model = build(attention_impl="cudnn", dtype="bfloat16")
    with pytest.raises(ValueError, match="ring attention merges blocks by their log-sum-exp"):
        model.attention_for("gpu", {"sequence": 2})
    assert model.attention_for("gpu", {"sequence": 2}, sequence_scheme="all_to_all") == "cudnn"
    assert model.attention_for("gpu", {"sequence": 1}) == "cudnn"


def stand_in_cudnn(q, k, v, *, causal=True):
    """cuDNN's contract (``(out, None)``, the model's ``[batch, heads, seq, head_dim]``), computed
    by XLA: no GPU here."""
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    out = jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")
    return jnp.swapaxes(out, 1, 2), None


def test_cudnn_runs_where_the_model_calls_it(seed, monkeypatch):
    # cuDNN's place in the model, with a stand-in computing its contract (out, no lse): on one
    # device and on an all-to-all sequence axis, whose lse exchange it skips, the loss and the
    # gradients are XLA attention's.
    monkeypatch.setitem(attention.IMPLEMENTATIONS, "cudnn", stand_in_cudnn)
    monkeypatch.setattr(attention, "cudnn_refusal", lambda *args: None)
    batch = fresh_batch(8, seed)
    reference = LMObjective(build(), SEQ)
    params = reference.model.init(seeded_key(seed))
    loss, grads = jax.jit(jax.value_and_grad(reference.loss))(params, batch)
    objective = LMObjective(build(attention_impl="cudnn"), SEQ)
    got = jax.jit(jax.value_and_grad(objective.loss))(params, batch)
    np.testing.assert_allclose(got[0], loss, rtol=1e-5, err_msg=f"seed {seed}")
    assert relative_error(got[1], grads) < 1e-5, f"seed {seed}"
    trainer = dew.Trainer(
        objective,
        optax.sgd(0.1),
        seeded_key(seed),
        mesh=dew.MeshSpec(fsdp=4, sequence=2),
        options=dew.StepOptions(sequence_scheme="all_to_all"),
        layout=dew.Layout(min_shard=1),
    )
    placed = jax.device_put(params, trainer.state_shardings.params)
    sharded_grads, sharded_loss = trainer.gradients(placed, trainer.device_batch(batch, 8))
    np.testing.assert_allclose(sharded_loss, loss, rtol=1e-5, err_msg=f"seed {seed}")
    assert relative_error(sharded_grads, grads) < 1e-5, f"seed {seed}"
