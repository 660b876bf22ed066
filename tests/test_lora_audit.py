"""LoRA at the shapes and values where a wrong implementation and the right one part (issue 68):
evaluation of a model with dropout through ``Trainer.evaluate``, the dropout masks of column- and
row-parallel weights on a tensor axis, the PEFT export of a non-integer alpha, the base's
checksum under a permutation, and which adapters' gradients are partial over ``tensor``."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import dew
from dew.models import lora, peft
from dew.objectives.lm import LMObjective
from tests.equivalence import TOL
from tests.helpers import SEQ, VOCAB, fresh_batch, seeded_key, smooth_optimizer

RANK = 4
# Not an integer, and int(ALPHA) / RANK (1.5) is another scale than ALPHA / RANK (1.625).
ALPHA = 6.5
DROPOUT = 0.3


def lora_model(**lora_fields):
    return dew.models.build(
        "causal_transformer",
        vocab_size=VOCAB,
        emb_features=32,
        num_layers=2,
        num_heads=4,
        max_seq_len=SEQ,
        lora=lora.Lora(rank=RANK, alpha=ALPHA, **lora_fields),
    )


@jax.jit
def _drawn(b_key, adapters):
    leaves, treedef = jax.tree_util.tree_flatten_with_path(adapters)
    keys = jax.random.split(b_key, len(leaves))
    drawn = [
        0.2 * jax.random.normal(k, x.shape, x.dtype) if path[-1].key == "b" else x
        for k, (path, x) in zip(keys, leaves)
    ]
    return jax.tree_util.tree_unflatten(treedef, drawn)


def base_and_adapters(model, seed):
    """The model's initial weights and adapters as after some training (B drawn at 0.2: a fresh
    B is zero, and dropout would then change nothing), on the host."""
    base = jax.jit(model.init)(seeded_key(seed))
    adapters = jax.jit(lambda k: lora.init_adapters(model, k))(seeded_key(seed, 1))
    adapters = _drawn(seeded_key(seed, 2), adapters)
    return jax.device_get(base), jax.device_get(adapters)


def placed_state(trainer, base, adapters):
    state = dew.TrainState(
        step=np.zeros((), np.int32),
        params=adapters,
        opt_state=jax.device_get(trainer.optimizer.init(adapters)),
        ema=None,
        key=jax.random.wrap_key_data(np.asarray(jax.random.key_data(trainer.key))),
        frozen=base,
    )
    return jax.device_put(state, trainer.state_shardings)


def test_evaluation_of_a_model_with_dropout_drops_nothing(tmp_path, seed):
    """``Trainer.evaluate`` of a LoRA model with dropout 0.3, on data=2,tensor=4, is the loss of
    the same base and adapters without dropout on one device (1e-5), while dropping at that rate
    moves the loss 20 times that at least."""
    from dew.data import Loading, TokenWindows, write_token_folder

    print(f"seed {seed}")
    model = lora_model(dropout=DROPOUT)
    plain = dataclasses.replace(model, lora=dataclasses.replace(model.lora, dropout=0.0))
    base, adapters = base_and_adapters(model, seed)
    rng = np.random.default_rng(seed)
    write_token_folder(
        tmp_path / "t", rng.integers(0, VOCAB, 400), rng.integers(0, VOCAB, 300), vocab_size=VOCAB
    )
    data = TokenWindows(
        tmp_path / "t", seq_len=SEQ, val_batches=2, loading=Loading(threads=0)
    ).load(batch=8)
    trainer = dew.Trainer(
        LMObjective(model, SEQ),
        smooth_optimizer(),
        seeded_key(seed),
        mesh=dew.MeshSpec(data=2, tensor=4),
        layout=dew.Layout(min_shard=1),
    )
    got = trainer.evaluate(placed_state(trainer, base, adapters), data)

    loss = jax.jit(LMObjective(plain, SEQ).loss)
    want = np.mean([float(loss(lora.combine(plain, base, adapters), b)) for b in data.validation()])
    np.testing.assert_allclose(got, want, rtol=TOL, err_msg=f"seed {seed}")
    # The values tell: the same batches through dropout's masks give another loss.
    dropped_loss = jax.jit(
        lambda adapters, batch: LMObjective(model, SEQ).loss(
            lora.combine(
                model,
                base,
                adapters,
                lora.dropout_keys(model, seeded_key(seed, 3), adapters),
                jnp.float32(DROPOUT),
            ),
            batch,
        )
    )
    dropped = np.mean([float(dropped_loss(adapters, b)) for b in data.validation()])
    assert abs(dropped - want) > 20 * TOL * want, (dropped, want, seed)


def test_dropout_masks_are_shared_by_a_tensor_group_for_q_and_its_own_for_o(seed):
    """On fsdp=2,tensor=4 (``lora.dropout_keys`` with the step's shards): q is column-parallel,
    its input the same on the 4 devices of a tensor group, so they draw its mask from one key,
    the key one device holding those tokens draws; o is row-parallel, each device holding a part
    of its input (its heads), so each draws its own. Each fsdp group's tokens give other keys."""
    print(f"seed {seed}")
    model = lora_model(dropout=DROPOUT)
    trainer = dew.Trainer(
        LMObjective(model, SEQ),
        smooth_optimizer(),
        seeded_key(seed),
        mesh=dew.MeshSpec(fsdp=2, tensor=4),
        layout=dew.Layout(min_shard=1),
    )
    adapters = jax.eval_shape(lambda k: lora.init_adapters(model, k), jax.random.key(0))
    key = seeded_key(seed, 1)
    tokens = jnp.asarray(fresh_batch(4, seed)[:, :-1])  # 2 rows for each fsdp group

    def local(tokens):
        keys = lora.dropout_keys(model, key, adapters, trainer.shards, tokens)
        return jax.tree_util.tree_map(lambda k: jax.random.key_data(k)[None], keys)

    per_device = jax.jit(
        jax.shard_map(
            local,
            mesh=trainer.mesh,
            in_specs=P("fsdp"),
            out_specs=P(("fsdp", "tensor")),
            check_vma=False,
        )
    )(tokens)
    attn = jax.tree_util.tree_map(np.asarray, per_device["layers"]["attn"])
    assert attn["q"].shape == (8, 2, 2)  # devices (fsdp-major), layers, a key's data
    for f in range(2):
        one_device = lora.dropout_keys(model, key, adapters, None, tokens[2 * f : 2 * f + 2])
        want_q = np.asarray(jax.random.key_data(one_device["layers"]["attn"]["q"]))
        group = slice(4 * f, 4 * f + 4)
        for t, got in enumerate(attn["q"][group]):
            np.testing.assert_array_equal(got, want_q, err_msg=f"q, fsdp {f}, tensor {t}")
        o = attn["o"][group].reshape(4, -1)
        assert len({row.tobytes() for row in o}) == 4, f"o's keys repeat in a tensor group: {o}"
    assert not np.array_equal(attn["q"][0], attn["q"][4]), "two fsdp groups' tokens, one key"
    assert not np.array_equal(attn["o"][0], attn["o"][4]), "two fsdp groups' tokens, one key"


def test_a_non_integer_alpha_is_exported_as_it_was_trained(tmp_path, seed):
    """``lora_alpha`` 6.5 at rank 4: PEFT scales by ``lora_alpha / r``, 1.625 as Dew trained."""
    model = lora_model()
    _, adapters = base_and_adapters(model, seed)
    peft.save(model, adapters, tmp_path / "adapter", None)
    config = json.loads((tmp_path / "adapter" / peft.CONFIG).read_text())
    assert (config["r"], config["lora_alpha"]) == (RANK, ALPHA)
    assert config["lora_alpha"] / config["r"] == model.lora.scale == 1.625


def test_the_base_checksum_sees_a_permutation(seed):
    """``base_checksum`` of the base with its two layers swapped, or two entries of one matrix
    swapped (the same bits, in other places), is not the base's."""
    print(f"seed {seed}")
    model = lora_model()
    base, _ = base_and_adapters(model, seed)
    checksum = lora.base_checksum(model, base)
    assert lora.base_checksum(model, jax.tree_util.tree_map(np.copy, base)) == checksum
    swapped = jax.tree_util.tree_map(np.copy, base)
    swapped["params"]["layers"] = jax.tree_util.tree_map(
        lambda x: x[::-1], swapped["params"]["layers"]
    )
    assert not np.array_equal(
        swapped["params"]["layers"]["attn"]["q"], base["params"]["layers"]["attn"]["q"]
    )
    assert lora.base_checksum(model, swapped) != checksum, "two layers swapped"
    entries = jax.tree_util.tree_map(np.copy, base)
    q = entries["params"]["layers"]["attn"]["q"].reshape(-1)  # a view: swaps in place
    assert q[0] != q[-1]
    q[0], q[-1] = q[-1], q[0]
    assert lora.base_checksum(model, entries) != checksum, "two entries swapped"


def test_partial_adapters_are_those_whole_over_tensor():
    """On tensor=4 an adapter's gradient is partial over ``tensor`` (each device holds a part of
    it, to be summed) exactly when the adapter is whole there: A of q, k, v, gate, up (meeting
    each device's heads or columns of B) and B of o and down (meeting each device's part of
    ``x A``); the halves split over tensor are each device's own. Read from the layout's specs."""
    model = lora_model()
    trainer = dew.Trainer(
        LMObjective(model, SEQ),
        smooth_optimizer(),
        jax.random.key(0),
        mesh=dew.MeshSpec(data=2, tensor=4),
        layout=dew.Layout(min_shard=1),
    )
    adapters = jax.eval_shape(lambda k: lora.init_adapters(model, k), jax.random.key(0))
    partial = lora.partial_over_tensor(model, adapters, trainer.shards)
    specs = trainer.param_specs
    whole = jax.tree_util.tree_map(
        lambda spec: "tensor" not in jax.tree_util.tree_leaves(tuple(spec)),
        specs,
        is_leaf=lambda s: isinstance(s, P),
    )
    assert partial == whole
    attn, mlp = partial["lora"]["layers"]["attn"], partial["lora"]["layers"]["mlp"]
    assert [attn[w]["a"] for w in "qkvo"] == [True, True, True, False]
    assert [mlp[w]["b"] for w in ("gate", "up", "down")] == [False, False, True]
