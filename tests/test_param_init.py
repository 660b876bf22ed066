"""Initial weights follow their documented rule: each ``Param`` is drawn from ``fold_in(key,
crc32(its path))``, so a weight's values depend on the key and its path alone."""

import zlib

import jax
import numpy as np

from dew.nn.param import Param, init_params, normal
from tests.helpers import seeded_key


def declared(extra: bool):
    tree = {
        "embed": {"embedding": Param((6, 4), ("vocab", "embed"), normal(1.0))},
        "layers": {"kernel": Param((3, 4, 5), ("layers", "embed", "mlp"), normal(0.02))},
    }
    if extra:
        tree["head"] = {"kernel": Param((4, 6), ("embed", "vocab"), normal(0.5))}
    return tree


def test_each_weight_is_drawn_from_the_key_folded_with_the_crc_of_its_path(seed):
    key = seeded_key(seed)
    got = init_params(declared(extra=True), key, np.float32)
    for path, p in [
        ("embed/embedding", declared(True)["embed"]["embedding"]),
        ("layers/kernel", declared(True)["layers"]["kernel"]),
        ("head/kernel", declared(True)["head"]["kernel"]),
    ]:
        want = p.init(
            jax.random.fold_in(key, zlib.crc32(path.encode()) & 0x7FFFFFFF), p.shape, np.float32
        )
        first, second = path.split("/")
        np.testing.assert_array_equal(got[first][second], want, err_msg=f"{path}, seed {seed}")


def test_adding_a_weight_leaves_the_others_unchanged(seed):
    key = seeded_key(seed)
    without = init_params(declared(extra=False), key, np.float32)
    with_head = init_params(declared(extra=True), key, np.float32)
    for name in ("embed", "layers"):
        for leaf in without[name]:
            np.testing.assert_array_equal(
                with_head[name][leaf], without[name][leaf], err_msg=f"{name}, seed {seed}"
            )


def test_a_trainer_compiles_its_initialization_unoptimized_on_cpu_devices(monkeypatch, seed):
    # Initialization runs once: on CPU devices LLVM's optimizations only cost compile time (the
    # example's 5.3 s against 1.0 s). The weights stay those of the model's own init.
    import optax

    import dew
    from tests.helpers import tiny_objective

    options = []
    compile_ = jax.stages.Lowered.compile

    def recording(self, compiler_options=None):
        options.append(compiler_options)
        return compile_(self, compiler_options=compiler_options)

    monkeypatch.setattr(jax.stages.Lowered, "compile", recording)
    key = seeded_key(seed)
    trainer = dew.Trainer(tiny_objective(), optax.sgd(0.1), key, mesh=dew.MeshSpec(fsdp=8))
    params = trainer.init_state().params
    assert options == [{"xla_backend_optimization_level": 0}], options
    want = jax.jit(trainer.objective.model.init)(key)
    for got, ref in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-6, atol=1e-7)
