"""The model's recompute policies (``CausalTransformer.remat``): what each saves for the backward,
counted from the residuals of the layers' linearization and held to numbers computed from the
layer shapes, and that every policy trains exactly as keeping everything does (one device, and
fsdp=8 against one device)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dew
from dew.models.causal_transformer import REMAT_CHOICES
from dew.objectives.lm import LMObjective
from tests.equivalence import batch_away_from_ties, tie_draws
from tests.helpers import SEQ, VOCAB, fresh_batch, relative_error, seeded_key

# Sizes of the residual count: rows, seq, embed, heads, kv heads, head_dim, MLP width, layers.
B, S, E, H, KV, F, L = 3, 16, 32, 4, 2, 40, 2
D = E // H
ROWS = 8  # equivalence batches: one row per device under fsdp=8
TOL = 1e-5


def build(remat, **overrides):
    config = dict(
        vocab_size=VOCAB,
        emb_features=E,
        num_layers=L,
        num_heads=H,
        num_kv_heads=KV,
        mlp_features=F,
        max_seq_len=SEQ,
        remat=remat,
    )
    return dew.models.build("causal_transformer", **{**config, **overrides})


def saved_floats(model, capsys) -> int:
    """Float32 values the layers keep for their backward: the residuals
    ``jax.ad_checkpoint.print_saved_residuals`` lists for ``blocks``, less its arguments."""
    params = model.init(jax.random.key(0))
    x = jnp.ones((B, S, E), jnp.float32)
    capsys.readouterr()
    jax.ad_checkpoint.print_saved_residuals(
        lambda p, x: model.blocks(p, x, jnp.arange(S))[0].sum(), params, x
    )
    total = 0
    for line in capsys.readouterr().out.splitlines():
        found = re.match(r"f32\[([\d,]*)\] (.*)", line)
        if found and "from the argument" not in found.group(2):
            total += int(np.prod([int(n) for n in found.group(1).split(",") if n]))
    return total


# Per layer, from the shapes: the layer's input; the weight matmuls' outputs (q, k, v, attention's
# output projection, the MLP's gate and up; the down projection's output is the layer's output, the
# next layer's input, which its backward does not read); attention's output [B, S, H, D]; the
# MLP's normalized input [B, S, E]; the gate projection's output alone [B * S, F].
LAYER_INPUT = B * S * E
WEIGHT_DOTS = B * S * H * D + 2 * B * S * KV * D + B * S * E + 2 * B * S * F
ATTENTION_OUT = B * S * H * D
MLP_INPUT = B * S * E
GATE = B * S * F
EXPECTED = {
    "full": L * LAYER_INPUT,
    "attention_gate": L * (LAYER_INPUT + ATTENTION_OUT + GATE),
    "dots": L * (LAYER_INPUT + WEIGHT_DOTS),
    "attention": L * (LAYER_INPUT + WEIGHT_DOTS + ATTENTION_OUT + MLP_INPUT),
}


def test_each_policy_saves_what_it_names(capsys):
    saved = {policy: saved_floats(build(policy), capsys) for policy in REMAT_CHOICES}
    for policy, expected in EXPECTED.items():
        assert saved[policy] == expected, (policy, saved, EXPECTED)
    # "none" keeps every intermediate, the [B, KV, H / KV, S, S] probabilities among them.
    assert saved["none"] >= EXPECTED["attention"] + L * B * H * S * S, saved
    order = [saved[p] for p in ("none", "attention", "dots", "attention_gate", "full")]
    assert all(more > less for more, less in zip(order, order[1:])), saved


def test_attention_policy_keeps_the_kernels_residuals(capsys):
    # The Pallas kernel's backward reads its forward's out and lse: "attention" and
    # "attention_gate" keep both (the kernel names them), so the backward does not run the
    # forward kernel again; "dots" keeps neither.
    lse = B * H * S
    assert saved_floats(build("dots", attention_impl="pallas"), capsys) == EXPECTED["dots"]
    for policy in ("attention", "attention_gate"):
        model = build(policy, attention_impl="pallas")
        assert saved_floats(model, capsys) == EXPECTED[policy] + L * lse, policy


def test_attention_policy_keeps_q_and_k_rotated(capsys):
    # The attention call's q and k as it takes them, rotated, where "dots" keeps the projections'
    # outputs and the backward rotates them again: the same bytes (the count above is the same).
    from dew.models.causal_transformer import REMAT_POLICIES
    from dew.nn.attention import self_attention

    keys = jax.random.split(jax.random.key(0), 4)
    p = {
        name: jax.random.normal(key, shape)
        for name, key, shape in zip(
            "qkvo", keys, [(E, H, D), (E, KV, D), (E, KV, D), (H, D, E)], strict=True
        )
    }
    x = jnp.ones((B, S, E), jnp.float32)

    def saved(policy):
        layer = jax.checkpoint(
            lambda p, x: self_attention(p, x, jnp.arange(S)), policy=REMAT_POLICIES[policy]
        )
        capsys.readouterr()
        jax.ad_checkpoint.print_saved_residuals(lambda p, x: layer(p, x).sum(), p, x)
        lines = capsys.readouterr().out.splitlines()
        return sorted(
            (line.split()[0], "rotated" if "'attention_rotated'" in line else "projection")
            for line in lines
            if "'attention_rotated'" in line or "output of dot_general" in line
        )

    # v as its projection writes it, [kv heads, head_dim, rows, seq] before the layout's bitcast.
    q, k, v = f"f32[{B},{H},{S},{D}]", f"f32[{B},{KV},{S},{D}]", f"f32[{KV},{D},{B},{S}]"
    assert saved("attention") == sorted([(q, "rotated"), (k, "rotated"), (v, "projection")])
    dots = saved("dots")
    assert [kind for _, kind in dots] == ["projection"] * 3, dots


def test_the_gate_is_kept_by_name(capsys):
    # "attention_gate" keeps the MLP's gate projection by its name; the up projection, the same
    # shape, is recomputed.
    from dew.nn import mlp

    keys = jax.random.split(jax.random.key(1), 3)
    p = {
        name: jax.random.normal(key, shape)
        for name, key, shape in zip(
            ("gate", "up", "down"), keys, [(E, F), (E, F), (F, E)], strict=True
        )
    }
    layer = jax.checkpoint(
        mlp.swiglu, policy=jax.checkpoint_policies.save_only_these_names(mlp.GATE_NAME)
    )
    capsys.readouterr()
    jax.ad_checkpoint.print_saved_residuals(
        lambda p, x: layer(p, x).sum(), p, jnp.ones((B, S, E), jnp.float32)
    )
    kept = [
        line for line in capsys.readouterr().out.splitlines() if "from the argument" not in line
    ]
    assert len(kept) == 1 and kept[0].startswith(f"f32[{B * S},{F}] named 'mlp_gate'"), kept


def test_unknown_policy_is_refused_naming_the_choices():
    with pytest.raises(
        ValueError,
        match="unknown remat policy 'some'; expected one of "
        "full, attention_gate, dots, attention, none",
    ):
        build("some")


# --- Every policy trains as keeping everything does ----------------------------------------------


MOE = dict(num_experts=4, experts_per_token=2, moe_every=2)


def one_device(objective, params, batch):
    return jax.jit(jax.value_and_grad(objective.loss))(params, batch)


def test_every_policy_gives_the_loss_and_gradients_of_none_with_experts(seed):
    """On one device, an MoE model (a dense layer and an MoE layer). The dense model's policies
    are held to one device's "none" by the fsdp=8 test below, each policy's loss and gradients."""
    extra = MOE
    params = jax.jit(build("none", **extra).init)(seeded_key(seed))  # one program, not op by op
    reference = LMObjective(build("none", **extra), SEQ)
    batch = batch_away_from_ties(reference, params, tie_draws(seed, ROWS), f"seed {seed}")
    loss, grads = one_device(reference, params, batch)
    for policy in ("full", "attention_gate", "dots", "attention"):
        got_loss, got_grads = one_device(LMObjective(build(policy, **extra), SEQ), params, batch)
        np.testing.assert_allclose(got_loss, loss, rtol=TOL, err_msg=f"{policy}, seed {seed}")
        error = relative_error(got_grads, grads)
        assert error < TOL, f"{policy}: gradients differ by {error:.3g}, seed {seed}"


def test_every_policy_on_fsdp_gives_one_device_gradients(seed):
    batch = fresh_batch(ROWS, seed)
    reference = LMObjective(build("none"), SEQ)
    params = jax.jit(reference.model.init)(seeded_key(seed))  # one program, not op by op
    loss, grads = one_device(reference, params, batch)
    for policy in REMAT_CHOICES:
        trainer = dew.Trainer(
            LMObjective(build(policy), SEQ),
            optax.sgd(0.1),
            seeded_key(seed),
            mesh=dew.MeshSpec(fsdp=8),
            layout=dew.Layout(min_shard=1),
        )
        placed = jax.device_put(params, trainer.state_shardings.params)
        got_grads, got_loss = trainer.gradients(placed, trainer.device_batch(batch, ROWS))
        np.testing.assert_allclose(got_loss, loss, rtol=TOL, err_msg=f"{policy}, seed {seed}")
        error = relative_error(got_grads, grads)
        assert error < TOL, f"{policy} on fsdp=8: gradients differ by {error:.3g}, seed {seed}"


def test_presets_train_in_bfloat16_and_the_example_decoder_in_float32():
    from dew.models.presets import PRESETS

    for name, config in PRESETS.items():
        model = dew.models.build("causal_transformer", **config)
        got = (model.dtype, model.param_dtype, model.attention_impl, model.remat)
        # GPT-2 small keeps attention's output too: fastest on one v5e chip; GPT-2 medium
        # recomputes everything: "dots" does not fit one v5e chip at 16 x 1024 (presets.py).
        remat = {"gpt2-small": "attention", "llama-3.2-1b": "dots"}.get(name, "full")
        assert got == ("bfloat16", "float32", "auto", remat), name
        # GPT-2 small unrolls its layers: faster on one v5e chip (presets.py); the rest scan.
        assert model.layer_loop == ("unroll" if name == "gpt2-small" else "scan"), name
    plain = dew.models.build(
        "causal_transformer", vocab_size=8, emb_features=8, num_layers=1, num_heads=2, max_seq_len=4
    )
    assert (plain.dtype, plain.attention_impl, plain.remat) == ("float32", "xla", "full")
    assert plain.layer_loop == "scan"
