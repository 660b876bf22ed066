"""Every layout computes what one device computes: same initial weights, loss, gradients, updates.

The reference is the model's plain loss on one device, `jax.grad` and the optax update, with no mesh,
no shard_map and no Trainer.
"""

import jax
import numpy as np
import optax
import pytest

import dew
from tests.helpers import fresh_batch, relative_error, tiny_objective

LAYOUTS = {
    "data8": dew.MeshSpec(),
    "fsdp8": dew.MeshSpec(fsdp=8),
    "data2_fsdp4": dew.MeshSpec(fsdp=4),
    "data4_fsdp2": dew.MeshSpec(fsdp=2),
}
ROWS = 16
STEPS = 3
TOL = 1e-5


def smooth_optimizer():
  """Momentum SGD with weight decay: an update that is a smooth function of the gradient. (Adam's
  first steps are close to sign(g), which turns float32 rounding of a near-zero gradient element
  into a full-size difference of the update, in any two correct implementations alike.)"""
  return optax.chain(optax.add_decayed_weights(1e-2), optax.sgd(0.1, momentum=0.9))


def reference_run(objective, optimizer, key, batches):
  """One device: plain init, loss, grad and optax update."""
  one = jax.devices()[0]
  params = jax.jit(objective.model.init, device=one)(key)
  opt_state = optimizer.init(params)
  losses, grads_seen = [], []
  for batch in batches:
    loss, grads = jax.value_and_grad(objective.loss)(params, jax.device_put(batch, one))
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    losses.append(float(loss))
    grads_seen.append(grads)
  return losses, grads_seen, params, opt_state


def sharded_run(objective, optimizer, key, batches, mesh, **trainer_args):
  trainer = dew.Trainer(objective, optimizer, key, mesh=mesh, layout=dew.Layout(min_shard=1),
                        **trainer_args)
  state = trainer.init_state()
  initial = jax.tree_util.tree_map(np.asarray, state.params)
  step = trainer.train_step(ROWS)
  losses, grads_seen = [], []
  for batch in batches:
    placed = trainer.device_batch(batch, ROWS)
    grads, _ = trainer.gradients(state.params, placed)
    grads_seen.append(grads)
    state, loss = step(state, placed)
    losses.append(float(loss))
  return initial, losses, grads_seen, state


@pytest.fixture(scope="module")
def objective():
  return tiny_objective()


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_one_device(objective, name):
  key = jax.random.key(int(np.random.default_rng().integers(1 << 30)))
  batches = [fresh_batch(ROWS) for _ in range(STEPS)]
  optimizer = smooth_optimizer()
  ref_losses, ref_grads, ref_params, ref_opt_state = reference_run(objective, optimizer, key, batches)
  initial, losses, grads, state = sharded_run(objective, optimizer, key, batches, LAYOUTS[name])

  for got, want in zip(jax.tree_util.tree_leaves(initial), jax.tree_util.tree_leaves(
      jax.jit(objective.model.init, device=jax.devices()[0])(key))):
    np.testing.assert_array_equal(got, want, err_msg="initial weights depend on the layout")
  np.testing.assert_allclose(losses, ref_losses, rtol=TOL)
  for step, (g, rg) in enumerate(zip(grads, ref_grads)):
    assert relative_error(g, rg) < TOL, f"gradients of step {step} differ"
  assert relative_error(state.opt_state, ref_opt_state) < TOL
  assert relative_error(state.params, ref_params) < TOL
  assert int(state.step) == STEPS


@pytest.mark.parametrize("name", ["fsdp8", "data2_fsdp4"])
def test_accumulation_matches_whole_batch(objective, name):
  key = jax.random.key(int(np.random.default_rng().integers(1 << 30)))
  batches = [fresh_batch(ROWS) for _ in range(2)]
  optimizer = smooth_optimizer()
  ref_losses, ref_grads, ref_params, ref_opt_state = reference_run(objective, optimizer, key, batches)
  _, losses, grads, state = sharded_run(objective, optimizer, key, batches, LAYOUTS[name],
                                        accumulation=2 if name == "fsdp8" else 4)
  np.testing.assert_allclose(losses, ref_losses, rtol=TOL)
  assert relative_error(grads[-1], ref_grads[-1]) < TOL
  assert relative_error(state.params, ref_params) < TOL


def test_clip_by_global_norm_matches_one_device(objective):
  key = jax.random.key(int(np.random.default_rng().integers(1 << 30)))
  batches = [fresh_batch(ROWS) for _ in range(2)]
  # A threshold far below the gradient norm, so the clip is active and depends on the global norm.
  optimizer = optax.chain(optax.clip_by_global_norm(1e-3), optax.sgd(1.0))
  _, _, ref_params, _ = reference_run(objective, optimizer, key, batches)
  _, _, _, state = sharded_run(objective, optimizer, key, batches, LAYOUTS["fsdp8"])
  assert relative_error(state.params, ref_params) < TOL
  # A norm summed over one device's shards only would move the weights by a different amount.
  initial = objective.model.init(key)
  moved = jax.tree_util.tree_map(lambda a, b: np.asarray(a) - np.asarray(b), state.params, initial)
  ref_moved = jax.tree_util.tree_map(lambda a, b: np.asarray(a) - np.asarray(b), ref_params, initial)
  assert relative_error(moved, ref_moved) < 1e-4


def test_ema_follows_params(objective):
  key = jax.random.key(1)
  ema_objective = tiny_objective(ema_decay=0.5)
  trainer = dew.Trainer(ema_objective, optax.sgd(0.1), key, mesh=dew.MeshSpec(fsdp=8),
                        layout=dew.Layout(min_shard=1))
  state = trainer.init_state()
  before = jax.tree_util.tree_map(np.asarray, state.params)
  state, _ = trainer.train_step(ROWS)(state, trainer.device_batch(fresh_batch(ROWS), ROWS))
  expected = jax.tree_util.tree_map(lambda b, p: 0.5 * b + 0.5 * np.asarray(p), before, state.params)
  assert relative_error(state.ema, expected) < 1e-6
  assert state.ema["params"]["embed_tokens"]["embedding"].sharding.spec == \
      state.params["params"]["embed_tokens"]["embedding"].sharding.spec
