"""The model's layer loop (``CausalTransformer.layer_loop``): the layers unrolled train as the
scanned ones do (one device, fsdp=8 and data=2,tensor=4, against the scanned model's plain loss
on one device), and compiled for a v5e chip (on this CPU host with libtpu; nothing runs) the
unrolled step hands the attention kernels buffers of their own, where the scanned step copies
each of the backward kernel's saved operands out of the loop's stacks."""

import importlib.util
import re

import jax
import optax
import pytest

import dew
from dew.collectives.hlo_text import called_computations, parse_module
from dew.objectives.lm import LMObjective
from dew.targets import target
from tests.equivalence import batch_away_from_ties, tie_draws
from tests.helpers import SEQ, VOCAB, fresh_batch, relative_error, seeded_key

ROWS = 8  # one row per device under fsdp=8
TOL = 1e-5


def build(layer_loop, **overrides):
    config = dict(
        vocab_size=VOCAB,
        emb_features=32,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        mlp_features=40,
        max_seq_len=SEQ,
        remat="attention",
        layer_loop=layer_loop,
    )
    return dew.models.build("causal_transformer", **{**config, **overrides})


def test_unrolled_layers_train_as_the_scanned_on_one_device_and_on_layouts(seed):
    batch = fresh_batch(ROWS, seed)
    reference = LMObjective(build("scan", remat="none"), SEQ)
    params = jax.jit(reference.model.init)(seeded_key(seed))
    loss, grads = jax.jit(jax.value_and_grad(reference.loss))(params, batch)
    unrolled = LMObjective(build("unroll"), SEQ)
    got_loss, got_grads = jax.jit(jax.value_and_grad(unrolled.loss))(params, batch)
    assert abs(float(got_loss) / float(loss) - 1) < TOL, f"one device, seed {seed}"
    error = relative_error(got_grads, grads)
    assert error < TOL, f"one device: gradients differ by {error:.3g}, seed {seed}"
    for mesh in (dew.MeshSpec(fsdp=8), dew.MeshSpec(data=2, tensor=4)):
        trainer = dew.Trainer(
            unrolled, optax.sgd(0.1), seeded_key(seed), mesh=mesh, layout=dew.Layout(min_shard=1)
        )
        placed = jax.device_put(params, trainer.state_shardings.params)
        got_grads, got_loss = trainer.gradients(placed, trainer.device_batch(batch, ROWS))
        assert abs(float(got_loss) / float(loss) - 1) < TOL, f"{mesh}, seed {seed}"
        error = relative_error(got_grads, grads)
        assert error < TOL, f"{mesh}: gradients differ by {error:.3g}, seed {seed}"


def test_unrolled_moe_layers_train_as_the_scanned(seed):
    # A dense layer then an MoE layer, twice: the scan over groups and the dense scan inside each
    # group, both unrolled. One device.
    moe = dict(num_layers=4, num_experts=4, experts_per_token=2, moe_every=2)
    reference = LMObjective(build("scan", remat="none", **moe), SEQ)
    params = jax.jit(reference.model.init)(seeded_key(seed))
    batch = batch_away_from_ties(reference, params, tie_draws(seed, ROWS), f"seed {seed}")
    loss, grads = jax.jit(jax.value_and_grad(reference.loss))(params, batch)
    unrolled = LMObjective(build("unroll", **moe), SEQ)
    got_loss, got_grads = jax.jit(jax.value_and_grad(unrolled.loss))(params, batch)
    assert abs(float(got_loss) / float(loss) - 1) < TOL, f"seed {seed}"
    error = relative_error(got_grads, grads)
    assert error < TOL, f"gradients differ by {error:.3g}, seed {seed}"


def test_an_unknown_layer_loop_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="unknown layer_loop 'unrolled'; expected one of scan"):
        build("unrolled")


def kernel_operands_sliced_from_a_stack(hlo: str) -> dict[str, list[str]]:
    """``{attention kernel call: its operands made by a dynamic-slice}``: a ``dynamic-slice``, or
    a fusion whose computation holds one (a copy out of a loop's stack of residuals)."""
    computations, _ = parse_module(hlo)
    defined = {i.name: i for c in computations.values() for i in c.instructions}

    def sliced(name):
        made = defined[name]
        if made.opcode == "fusion":
            (body,) = called_computations(made.attrs, is_call=False)
            return any(i.opcode == "dynamic-slice" for i in computations[body].instructions)
        return made.opcode == "dynamic-slice"

    return {
        i.name: [o for o in i.operands if o in defined and sliced(o)]
        for i in defined.values()
        if i.opcode == "custom-call" and "dew_flash_attention" in i.name
    }


@pytest.mark.xdist_group("tpu")
@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="compiling for a TPU slice needs libtpu (pip install -e '.[tpu]')",
)
def test_unrolled_layers_hand_the_kernels_their_own_buffers_for_v5e():
    # Width 128 in 2 heads of 64 (head_dim as at width 256 in 4, which compiles twice as long):
    # what is read is where each kernel call's operands come from, not their size.
    hlo = {}
    for loop in ("scan", "unroll"):
        model = build(
            loop,
            vocab_size=128,
            emb_features=128,
            num_heads=2,
            num_layers=2,
            max_seq_len=128,
            num_kv_heads=None,
            mlp_features=None,
            dtype="bfloat16",
            attention_impl="pallas",
        )
        trainer = dew.Trainer(
            LMObjective(model, 128),
            optax.adamw(1e-3),
            jax.random.key(0),
            mesh=dew.MeshSpec(),
            devices=target("v5e-1").devices(),
        )
        hlo[loop] = trainer.compiled_step(2).as_text()
    scanned, unrolled = (kernel_operands_sliced_from_a_stack(hlo[k]) for k in ("scan", "unroll"))
    # Scanned: one forward and one backward kernel call, inside the two loops; the backward's
    # saved operands (q, k, v, the output) are each copied out of a stack.
    assert len(scanned) == 2 and sum(map(len, scanned.values())) == 4, scanned
    assert len(re.findall(r" while\(", hlo["scan"])) == 2
    # Unrolled: a forward and a backward call per layer, none fed by a slice, and no loop.
    assert len(unrolled) == 4 and not any(unrolled.values()), unrolled
    assert " while(" not in hlo["unroll"]
