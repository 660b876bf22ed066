"""What the equivalence tests share: the plain one-device reference, a sharded run through the
``Trainer``, and the comparison of the two.

The reference is the model's plain loss on one device, ``jax.grad`` and the optax update, with no
mesh, no shard_map and no Trainer. A sharded run reads each step's gradients off its optimizer
state (``recording``), so it compiles one program, the step, and still checks every gradient of
every step, as the optimizer received it.
"""

import contextlib
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax

import dew
from dew.nn import moe
from tests.helpers import fresh_batch, relative_error, seeded_key, smooth_optimizer

ROWS = 32  # 4 rows per device: room for 4 microbatches
STEPS = 3
TOL = 1e-5
# A router's choice is a step function of its logits. Where a token's k-th and (k+1)-th logits
# are nearly equal, rounding that differs between two correct programs (one device, a layout)
# picks other experts and moves the loss by about 1e-5 (DEW_SEED=1830568567 at 4369278: a margin
# of 8.9e-8, losses 1.2e-5 apart on moe_every2_data2_expert2_sequence2). Such draws test
# nothing about the layout: a one-device run that routes a token closer than this to a tie is run
# again on batches drawn afresh from the same seed (so a failure still replays).
ROUTING_MARGIN = 1e-5


def recording(optimizer: optax.GradientTransformation) -> optax.GradientTransformation:
    """``optimizer``, whose state also keeps the gradients of its last update (``state[0]``,
    laid out like the parameters), so a test reads each step's gradients off the state."""

    def init(params):
        return jax.tree_util.tree_map(jnp.zeros_like, params), optimizer.init(params)

    def update(grads, state, params=None):
        updates, inner = optimizer.update(grads, state[1], params)
        return updates, (grads, inner)

    return optax.GradientTransformation(init, update)


class Microbatched:
    """The one-device loss of a batch cut as the step cuts it, for an MoE model, whose
    load-balancing loss is a statistic of each microbatch (docs/moe.md): the batch's ``splits``
    shards (one per device of the batch axes) each give their ``k``-th run of rows to microbatch
    ``k`` of ``count``, and the loss is the sum of the microbatches' loss sums over the batch's
    token count. With ``count = 1`` it is ``objective.loss``."""

    def __init__(self, objective, splits: int, count: int):
        self.objective, self.model = objective, objective.model
        self.splits, self.count = splits, count

    def loss(self, params, batch):
        rows, width = batch.shape
        per = rows // (self.splits * self.count)
        micro = batch.reshape(self.splits, self.count, per, width).swapaxes(0, 1)
        micro = micro.reshape(self.count, rows // self.count, width)
        sums = jax.lax.map(lambda rows_k: self.objective.loss_sum(params, rows_k)[0], micro)
        return jnp.sum(sums) / (rows * self.objective.seq_len)


def reference_run(objective, optimizer, key, batches):
    """One device: plain init, loss, grad and optax update. ``objective``: anything with
    ``model.init`` and ``loss(params, batch)``."""
    one = jax.devices()[0]
    params = jax.jit(objective.model.init)(jax.device_put(key, one))
    opt_state = optimizer.init(params)

    # The gradient and the update in one program: run op by op, the update compiled a program
    # for each operation and shape (95 in tests/test_equivalence.py).
    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(objective.loss)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return loss, grads, optax.apply_updates(params, updates), opt_state

    run = {"initial": params, "losses": [], "grads": []}
    for batch in batches:
        loss, grads, params, opt_state = step(params, opt_state, jax.device_put(batch, one))
        run["losses"].append(float(loss))
        run["grads"].append(grads)
    run.update(params=params, opt_state=opt_state)
    return run


def host_state(trainer, params, opt_state=None) -> dew.TrainState:
    """``trainer``'s state at step 0 from ``params`` (the weights another run started from), laid
    out by ``trainer``: no initialisation program of its own to compile, for a test that checks
    the trainer's initial weights elsewhere (``test_initial_weights_do_not_depend_on_the_layout``).
    ``opt_state``: the optimizer's state on the host; by default ``trainer.optimizer.init``'s."""
    params = jax.tree_util.tree_map(np.asarray, params)
    if opt_state is None:
        opt_state = jax.device_get(trainer.optimizer.init(params))
    state = dew.TrainState(
        step=np.zeros((), np.int32),
        # On the host: device_put lays host arrays out directly, where one device's arrays would
        # each be cut by a program of their own (jax's _multi_slice, compiled per shape and
        # layout: 126 compiles in tests/test_equivalence.py).
        params=params,
        opt_state=opt_state,
        ema=None,
        # A copy: the step donates the state, and the trainer's key is the caller's.
        key=jax.random.wrap_key_data(
            np.asarray(jax.random.key_data(trainer.key)), impl=jax.random.key_impl(trainer.key)
        ),
    )
    return jax.device_put(state, trainer.state_shardings)


def sharded_run(objective, optimizer, key, batches, mesh, initial=None, **trainer_args):
    """The same through a ``Trainer`` on ``mesh`` (``Layout(min_shard=1)`` unless given): its
    initial weights, each step's loss, metrics and gradients, and the final weights and optimizer
    state.

    ``initial``: weights to start from (the reference's), laid out by the trainer and given a
    fresh optimizer state, instead of ``trainer.init_state()``: one compile fewer for a test that
    checks the initial weights elsewhere (``test_initial_weights_do_not_depend_on_the_layout``).
    """
    trainer_args.setdefault("layout", dew.Layout(min_shard=1))
    trainer = dew.Trainer(objective, recording(optimizer), key, mesh=mesh, **trainer_args)
    state = trainer.init_state() if initial is None else host_state(trainer, initial)
    run = {"initial": jax.tree_util.tree_map(np.asarray, state.params), "losses": [], "grads": []}
    run["metrics"] = []
    step = trainer.train_step(ROWS)
    for batch in batches:
        state, metrics = step(state, trainer.device_batch(batch, ROWS))
        run["losses"].append(float(metrics["loss"]))
        run["metrics"].append({name: float(value) for name, value in metrics.items()})
        run["grads"].append(jax.tree_util.tree_map(np.asarray, state.opt_state[0]))
    run.update(params=state.params, opt_state=state.opt_state[1], step=int(state.step))
    return run


def layout_case(seed):
    """``(key, batches, cache)`` of a test module: its key and ``STEPS`` batches drawn from
    ``seed``, and an empty cache of one-device runs for ``cached_reference`` (`References`)."""
    key = seeded_key(seed)
    return key, [fresh_batch(ROWS, (seed, i)) for i in range(STEPS)], References(seed)


class References(dict):
    """A test module's one-device runs by name, and the ``seed`` its batches are drawn from."""

    def __init__(self, seed):
        super().__init__()
        self.seed = seed


@contextlib.contextmanager
def routing_margins():
    """Collects into the list it yields, for each routing of the MoE programs traced and run
    inside, the smallest gap over its tokens between the k-th and (k+1)-th router logits."""
    route, margins = moe.route, []

    def measured(kernel, x, k):
        logits = jnp.dot(x.astype(jnp.float32), kernel.astype(jnp.float32))
        if k < logits.shape[-1]:
            top = jax.lax.top_k(logits, k + 1)[0]
            gap = jnp.min(top[:, k - 1] - top[:, k])
            jax.debug.callback(lambda gap: margins.append(float(gap)), gap)
        return route(kernel, x, k)

    moe.route = measured
    try:
        yield margins
    finally:
        moe.route = route


def away_from_ties(run, draw, what: str, routes: bool = True):
    """``(drawn, run(drawn))`` for ``drawn = draw(0)``, or, where that one-device run routed a
    token within ``ROUTING_MARGIN`` of a tie (which rounding may break one way on one device and
    the other on a layout, or in another program of the same model), for ``draw(1)``,
    ``draw(2)``... ``run`` must trace its MoE program afresh (its router is measured while it
    traces); ``routes``: whether it must route at all (False for a dense model)."""
    for attempt in itertools.count():
        drawn = draw(attempt)
        with routing_margins() as margins:
            result = run(drawn)
            jax.effects_barrier()
        # An MoE run that routed nothing through the patched router would leave its draws
        # unguarded (say, the router called by another name, or a trace cached before the
        # patch): fail rather than pass blind.
        assert margins or not routes, f"{what}: no routing was measured"
        if min(margins, default=ROUTING_MARGIN) >= ROUTING_MARGIN:
            return drawn, result
        assert attempt < 4, f"{what}: every draw routes a token within {ROUTING_MARGIN}"
        print(
            f"{what}: a token routed {min(margins):.2g} from a tie on one device; "
            f"drawn again (draw {attempt + 1})"
        )


def reference_away_from_ties(objective, key, draw, what: str):
    """The one-device run of ``objective`` from ``key`` on the batches ``draw(0)`` gives, or on
    ``draw(1)``, ``draw(2)``... (`away_from_ties`). Its ``"batches"`` are those it used."""

    def run(batches):
        return reference_run(objective, smooth_optimizer(), key, batches)

    batches, result = away_from_ties(run, draw, what, routes=bool(objective.model.num_experts))
    result["batches"] = batches
    return result


def tie_draws(seed, rows, **batch):
    """``draw(attempt)`` for `batch_away_from_ties`: ``fresh_batch(rows, seed)`` first (so a seed
    that routes clear of ties replays as before), then batches drawn from ``(seed, attempt)``."""
    return lambda attempt: fresh_batch(rows, (seed, attempt) if attempt else seed, **batch)


def batch_away_from_ties(objective, params, draw, what: str):
    """``draw(0)``, or ``draw(1)``, ``draw(2)``... where ``objective``'s one-device loss from
    ``params`` on the draw before routed a token within ``ROUTING_MARGIN`` of a tie
    (`away_from_ties`): the batch of a test that compares an MoE model's runs across layouts or
    programs."""

    def loss(batch):  # a new function each call: traced afresh, under the measured router
        return jax.jit(lambda params, batch: objective.loss(params, batch))(params, batch)

    return away_from_ties(loss, draw, what)[0]


def cached_reference(case, objective, name):
    """The one-device run of ``objective`` on ``case``'s key and batches, run once per ``name``
    (a hashable description of the model and of how its batch is cut). Its ``"batches"`` are
    those the run used: the case's, unless it routed a token within ``ROUTING_MARGIN`` of a tie,
    then batches drawn again from the case's seed (`reference_away_from_ties`)."""
    key, batches, cache = case

    def draw(attempt):
        if not attempt:
            return batches
        return [fresh_batch(ROWS, (cache.seed, i, attempt)) for i in range(STEPS)]

    if name not in cache:
        cache[name] = reference_away_from_ties(objective, key, draw, f"{name}, seed {cache.seed}")
    return cache[name]


def assert_matches(run, reference, seed, what=""):
    """Losses, every step's gradients, and the final weights and optimizer state within ``TOL``
    (relative, per leaf)."""
    where = f"{what}, seed {seed}" if what else f"seed {seed}"
    np.testing.assert_allclose(
        run["losses"], reference["losses"], rtol=TOL, err_msg=f"losses, {where}"
    )
    for step, (grads, expected) in enumerate(zip(run["grads"], reference["grads"], strict=True)):
        error = relative_error(grads, expected)
        assert error < TOL, f"gradients of step {step} differ by {error:.3g}, {where}"
    for part in ("params", "opt_state"):
        error = relative_error(run[part], reference[part])
        assert error < TOL, (
            f"{part} after {len(run['losses'])} steps differ by {error:.3g}, {where}"
        )


def layout_logits(trainer, params, tokens) -> np.ndarray:
    """float32 logits ``[rows, seq, vocab]`` of ``tokens`` ``[rows, seq]`` computed on
    ``trainer``'s mesh and layout, as its step computes them (``params`` laid out by it): inside
    ``shard_map``, rows over the batch axes, positions over ``sequence`` in zigzag order, the
    vocabulary of the output over ``tensor``; gathered and put back in order on the host."""
    from jax.sharding import PartitionSpec as P

    from dew.mesh import BATCH_AXES
    from dew.parallel import sequence
    from dew.training.step import POSITION_SPEC, TOKEN_SPEC

    model, shards = trainer.objective.model, trainer.shards
    seq = tokens.shape[1]
    n = trainer.mesh.shape["sequence"]
    order = np.arange(seq) if n == 1 else sequence.zigzag_positions(seq, n)

    def local(params, tokens, positions):
        params, local_shards = model.share_embedding(params, shards, tokens.size)
        x = model.embed(params, tokens, local_shards)
        x, _ = model.blocks(params, x, positions, local_shards)
        return model.head(params, x, local_shards)

    forward = jax.jit(
        jax.shard_map(
            local,
            mesh=trainer.mesh,
            in_specs=(trainer.param_specs, TOKEN_SPEC, POSITION_SPEC),
            out_specs=P(BATCH_AXES, "sequence", "tensor"),
            check_vma=False,
        )
    )
    shuffled = np.asarray(forward(params, tokens[:, order], jnp.asarray(order, jnp.int32)))
    logits = np.empty_like(shuffled)
    logits[:, order] = shuffled
    return logits
