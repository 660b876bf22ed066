"""AdamW as fine-tuning recipes set it: a warmup and decay schedule, gradient clipping, weight
decay that spares norms and embeddings, and state that fits a small chip.

    optimizer = adamw(3e-4, steps=1000, warmup_steps=100, lr_schedule="cosine", lr_min=3e-5)
    trainer = Trainer(objective, optimizer, key=jax.random.key(0), mesh=MeshSpec(fsdp=8))

``adamw`` returns an ``optax.GradientTransformation`` (an ``AdamW``, which also carries its
``schedule``), so ``Trainer`` takes it as it takes any optax optimizer. The step applies it to the
gradients laid out like the weights, on the global arrays (``dew.training.step``): the global
norm that clipping reads is the norm of the whole gradient, whatever the layout.

The update of one weight ``w`` with gradient ``g`` at update ``t = count + 1`` (all in float32):

    n      = sqrt(sum over every weight of sum(g**2))         (the global norm, before clipping)
    g      = g * clip_norm / n   where n >= clip_norm         (optax.clip_by_global_norm)
    mu     = b1 mu + (1 - b1) g
    nu     = b2 nu + (1 - b2) g**2
    u      = (mu / (1 - b1**t)) / (sqrt(nu / (1 - b2**t)) + eps)
    w     <- w - lr(count) (u + weight_decay w)               (the decay only where ``decays``)

which is ``optax.chain(optax.clip_by_global_norm(c), optax.adamw(lr, b1, b2, eps, wd, mask))``
to float32 rounding (a test holds it to that). Three choices make the state smaller:

* ``moments_dtype="bfloat16"``: ``mu`` and ``nu`` stored in bfloat16 (4 bytes a weight instead of
  8); each step computes in float32 and rounds once when it stores them. ``nu``'s average then
  moves by ``1 - b2`` of itself a step, which bfloat16 (8 significant bits, a relative step of
  2**-8) keeps at ``b2 = 0.95`` but not at ``0.999``: use the default ``b2`` with it.
* weights in bfloat16 (the model's ``param_dtype="bfloat16"``): the matrices take each update
  rounded to bfloat16, and the vectors (norm scales, biases: ``is_vector``) keep a float32
  master copy in the optimizer state, from which their bfloat16 weight is rounded each step. A
  norm's scale sits near 1.0, where bfloat16's spacing is 2**-7: an update below 0.004 would
  round away, every step. A matrix's entries sit near its initial scale (0.02 at GPT-2 small's
  width), where the spacing is ~1e-4 and an update of lr ~ 1e-4 or more survives; smaller
  updates (a decayed learning rate, larger entries) would round away, every step, which costs
  loss (docs/training.md measures it). So a bfloat16 matrix without a master is rounded
  stochastically (``rounding="stochastic"``, the default): ``w + u``, in float32, becomes the
  bfloat16 value above or below it with probability proportional to its nearness
  (``stochastic_round``), unbiased, so that small updates add up on average instead of vanishing.
  The random bits are a function of ``rounding_seed``, the update's count, the weight's position
  in the tree and each entry's position in the global array: the same in every layout and after
  a resume, and no state. ``rounding="nearest"`` rounds to nearest instead. A master copy for
  every weight (``master_weights="all"``) is the classic mixed precision; it costs 4 bytes a
  weight more than float32 weights alone, so it is a choice, not the default.
* ``offload=True``: the moments and master copies live in host memory (JAX's ``pinned_host``
  memory kind; ``Trainer`` lays them out there), and the update moves them to the device one
  weight at a time (a "bucket": a stacked weight holds every layer's), updates it and moves it
  back, each weight's transfer ordered after the one before so that the device holds one
  weight's state at a time.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dew.training.schedule import schedule

MOMENTS_DTYPES = ("float32", "bfloat16")
MASTER_WEIGHTS = ("vectors", "all")
ROUNDINGS = ("stochastic", "nearest")

# Defaults a MaxText or torchtitan user expects: both default to b1 0.9, b2 0.95, eps 1e-8, weight
# decay 0.1 and clipping at a global norm of 1.0 (MaxText's adam_b2 / adam_weight_decay /
# gradient_clipping_threshold, torchtitan's betas / weight_decay / max_norm). Optax's own adamw
# defaults (b2 0.999, decay 1e-4 on every weight) are not what a fine-tuning recipe assumes.
B1, B2, EPS = 0.9, 0.95, 1e-8
WEIGHT_DECAY = 0.1
CLIP_NORM = 1.0


def global_norm(tree) -> jax.Array:
    """``sqrt(sum of every element's square)`` over a tree of arrays, in float32."""
    leaves = jax.tree_util.tree_leaves(tree)
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves))


# ----------------------------------------------------------------------------- which weights


def _names(path) -> list[str]:
    return [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]


def is_vector(path, leaf) -> bool:
    """A norm's scale or a bias: its last key is ``scale`` or ``bias``, or a key on its path ends
    in ``norm``, or it has fewer than 2 dimensions. (A stacked norm scale ``[layers, embed]`` has
    two: its names say what it is.)"""
    names = _names(path)
    if len(jnp.shape(leaf)) < 2:
        return True
    return bool(names) and (
        names[-1] in ("scale", "bias") or any(n.endswith("norm") for n in names)
    )


def is_embedding(path, leaf) -> bool:
    """The token embedding table (``embed_tokens``; with tied embeddings also the head)."""
    del leaf
    return any(n in ("embed_tokens", "embedding") for n in _names(path))


def decays(path, leaf) -> bool:
    """Whether weight decay applies to a weight: every matrix except the token embedding (the
    attention and MLP kernels, experts, the router, an untied ``lm_head``); never norms' scales,
    biases, or the embedding table, as nanoGPT, Hugging Face's Trainer and MaxText's recipes
    exclude them (a decay pulls a norm's scale towards 0, not towards its 1.0)."""
    return not is_vector(path, leaf) and not is_embedding(path, leaf)


def decay_mask(params) -> Any:
    """A tree like ``params`` of bools: ``decays`` of each weight."""
    return jax.tree_util.tree_map_with_path(decays, params)


# ----------------------------------------------------------------------------- stochastic rounding


def stochastic_round(x: jax.Array, bits: jax.Array) -> jax.Array:
    """``x`` (float32, any shape) rounded to bfloat16 up or down in magnitude, away from zero
    with probability ``(|x| - lo) / (hi - lo)`` where ``lo <= |x| <= hi`` are the neighbouring
    bfloat16 magnitudes: ``E[result] = x``, and an ``x`` that bfloat16 holds comes back as itself.

    ``bits``: uint32 like ``x``, uniform random; their low 16 bits are used. A bfloat16 is a
    float32's high 16 bits, and a finite float32's bit pattern below the sign is its magnitude as
    an integer, so adding a uniform 16-bit number to the low half carries into the high half (one
    bfloat16 step up in magnitude, whatever the sign) with probability ``low half / 2**16``; the
    low half is then dropped. A finite ``x`` above bfloat16's largest may round to infinity, as
    rounding to nearest would from half a step above it; infinities and NaN stay what they are
    (a NaN's carry could otherwise reach its sign bit)."""
    pattern = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    carried = (pattern + (bits & jnp.uint32(0xFFFF))) & jnp.uint32(0xFFFF0000)
    rounded = jax.lax.bitcast_convert_type(carried, jnp.float32)
    return jnp.where(jnp.isfinite(x), rounded, x).astype(jnp.bfloat16)


def rounding_bits(seed: int, count: jax.Array, index: int, shape) -> jax.Array:
    """The uint32 random bits with which update ``count`` (0 for the first) rounds the weight at
    ``index`` in the flattened weights' tree: threefry bits of the key ``seed`` folded with
    ``count`` then ``index``, drawn at the weight's global ``shape``, so each entry's bits depend
    on its position in the global array alone (``jax_threefry_partitionable``, JAX's default,
    also draws them where the entries live), the same in every layout and after a resume."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), count), index)
    return jax.random.bits(key, shape, jnp.uint32)


# ----------------------------------------------------------------------------- the transformation


class AdamWState(NamedTuple):
    """``count``: updates taken (int32, on the device); ``mu``, ``nu``: the moments, like the
    weights, in ``moments_dtype``; ``master``: float32 copies of the weights that keep one
    (``None`` for the others). With ``offload``, ``mu``, ``nu`` and ``master`` live in host
    memory."""

    count: jax.Array
    mu: Any
    nu: Any
    master: Any


class AdamW(optax.GradientTransformation):
    """An ``optax.GradientTransformation`` (``init``, ``update``) that also says its ``schedule``
    (``count -> lr``) and whether its state lives in host memory (``offload``); built by
    ``adamw``."""

    schedule: Callable
    offload: bool


def _needs_master(master_weights: str):
    def needs(path, leaf) -> bool:
        if jnp.dtype(leaf.dtype) == jnp.float32:
            return False  # a float32 weight is its own master
        return master_weights == "all" or is_vector(path, leaf)

    return needs


def _to(space, tree):
    return jax.tree_util.tree_map(lambda x: jax.device_put(x, space), tree)


def adamw(
    learning_rate: float = 1e-3,
    *,
    steps: int | None = None,
    warmup_steps: int = 0,
    lr_schedule: str = "constant",
    lr_min: float = 0.0,
    clip_norm: float | None = CLIP_NORM,
    weight_decay: float = WEIGHT_DECAY,
    b1: float = B1,
    b2: float = B2,
    eps: float = EPS,
    moments_dtype: str = "float32",
    master_weights: str = "vectors",
    rounding: str = "stochastic",
    rounding_seed: int = 0,
    offload: bool = False,
    mask: Callable[[Any, Any], bool] = decays,
) -> AdamW:
    """AdamW with a schedule, clipping and masked weight decay (the module's docstring gives the
    update).

    Args:
      learning_rate: the peak learning rate.
      steps, warmup_steps, lr_schedule, lr_min: the schedule (``schedule``).
      clip_norm: clip the gradient to this global norm (default 1.0, as MaxText and torchtitan);
        ``None``: no clipping.
      weight_decay: decoupled decay (``w -= lr * weight_decay * w``) of the weights ``mask``
        picks (default ``decays``: every matrix but the embedding).
      b1, b2, eps: Adam's (default 0.9, 0.95, 1e-8, as MaxText and torchtitan).
      moments_dtype: ``"float32"`` or ``"bfloat16"``: how ``mu`` and ``nu`` are stored.
      master_weights: for weights not in float32, which keep a float32 master copy: ``"vectors"``
        (norms' scales and biases, ``is_vector``) or ``"all"``.
      rounding: how a bfloat16 weight without a master takes its update: ``"stochastic"``
        (``stochastic_round`` of ``w + u``, unbiased) or ``"nearest"``.
      rounding_seed: the seed of the stochastic rounding's bits (``rounding_bits``).
      offload: keep ``mu``, ``nu`` and the master copies in host memory (``pinned_host``),
        moved to the device one weight at a time for the update.
      mask: ``(path, leaf) -> bool``: which weights decay.
    """
    lr_at = schedule(
        learning_rate,
        steps=steps,
        warmup_steps=warmup_steps,
        lr_schedule=lr_schedule,
        lr_min=lr_min,
    )
    if clip_norm is not None and (
        isinstance(clip_norm, bool) or not isinstance(clip_norm, (int, float)) or not clip_norm > 0
    ):
        raise ValueError(
            f"clip_norm must be a number above 0 (or None: no clipping), got {clip_norm!r}"
        )
    if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)):
        raise ValueError(f"weight_decay must be a number >= 0, got {weight_decay!r}")
    if not weight_decay >= 0:
        raise ValueError(f"weight_decay must be a number >= 0, got {weight_decay!r}")
    for name, beta in (("b1", b1), ("b2", b2)):
        if not 0 <= beta < 1:
            raise ValueError(f"{name} must be in [0, 1), got {beta!r}")
    if not eps > 0:
        raise ValueError(f"eps must be above 0, got {eps!r}")
    if moments_dtype not in MOMENTS_DTYPES:
        raise ValueError(
            f"unknown moments_dtype {moments_dtype!r}; expected one of {', '.join(MOMENTS_DTYPES)}"
        )
    if master_weights not in MASTER_WEIGHTS:
        raise ValueError(
            f"unknown master_weights {master_weights!r}; expected one of "
            f"{', '.join(MASTER_WEIGHTS)}"
        )
    if rounding not in ROUNDINGS:
        raise ValueError(f"unknown rounding {rounding!r}; expected one of {', '.join(ROUNDINGS)}")
    if isinstance(rounding_seed, bool) or not isinstance(rounding_seed, int):
        raise ValueError(f"rounding_seed must be an integer, got {rounding_seed!r}")
    if not 0 <= rounding_seed < 2**32:
        raise ValueError(f"rounding_seed must be in [0, 2**32), got {rounding_seed}")
    stored = jnp.dtype(moments_dtype)
    needs_master = _needs_master(master_weights)

    def init(params):
        def zeros(p):
            return jnp.zeros(jnp.shape(p), stored)

        master = jax.tree_util.tree_map_with_path(
            lambda path, p: p.astype(jnp.float32) if needs_master(path, p) else None, params
        )
        return AdamWState(
            count=jnp.zeros((), jnp.int32),
            mu=jax.tree_util.tree_map(zeros, params),
            nu=jax.tree_util.tree_map(zeros, params),
            master=master,
        )

    def update(grads, state, params=None):
        if params is None:
            raise ValueError("adamw's update needs the weights (its decay and master copies)")
        count = state.count
        lr = lr_at(count)
        t = (count + 1).astype(jnp.float32)
        correct1, correct2 = 1.0 - b1**t, 1.0 - b2**t
        paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
        g32 = [g.astype(jnp.float32) for g in treedef.flatten_up_to(grads)]
        if clip_norm is None:
            scale = jnp.float32(1.0)
        else:
            # Over the global arrays: XLA sums each split weight's squares with one all-reduce
            # of a scalar (optax.clip_by_global_norm's rule, in float32).
            norm = global_norm(g32)
            scale = jnp.where(norm < clip_norm, 1.0, clip_norm / norm)

        def one(index, path, g, p, mu, nu, master):
            g = g * scale
            mu = b1 * mu.astype(jnp.float32) + (1.0 - b1) * g
            nu = b2 * nu.astype(jnp.float32) + (1.0 - b2) * g * g
            u = (mu / correct1) / (jnp.sqrt(nu / correct2) + eps)
            w = p.astype(jnp.float32) if master is None else master
            if weight_decay and mask(path, p):
                u = u + weight_decay * w
            step = -lr * u
            if master is None:
                if rounding == "stochastic" and jnp.dtype(p.dtype) == jnp.bfloat16:
                    # optax.apply_updates adds this to the weight in float32 and casts: the sum
                    # lands exactly on the rounded value unless the update cancels the weight to
                    # below 2**-16 of itself (then within 2**-24 of the weight: float32 cannot
                    # hold the difference of the two bfloat16 values).
                    bits = rounding_bits(rounding_seed, count, index, jnp.shape(p))
                    step = stochastic_round(w + step, bits).astype(jnp.float32) - w
                return step, mu.astype(stored), nu.astype(stored), None
            master = w + step
            # The weight becomes its master rounded: p + (master - p) in float32 is master.
            return master - p.astype(jnp.float32), mu.astype(stored), nu.astype(stored), master

        moments = [treedef.flatten_up_to(t) for t in (state.mu, state.nu, state.master)]
        out, previous = [], None
        for index, ((path, p), g, mu, nu, master) in enumerate(
            zip(paths_leaves, g32, *moments, strict=True)
        ):
            if offload:
                if previous is not None:
                    # This weight's state moves to the device once the weight before is done,
                    # so the device holds one weight's state at a time.
                    (mu, nu, master), _ = jax.lax.optimization_barrier(((mu, nu, master), previous))
                # Host to device: the weight's mu and nu (and master), its bytes in
                # moments_dtype (float32) each.
                mu, nu, master = _to(jax.memory.Space.Device, (mu, nu, master))
            result = one(index, path, g, p, mu, nu, master)
            if offload:
                previous = result[0]
                # And back: the new mu, nu (and master) to host memory.
                result = (result[0], *_to(jax.memory.Space.Host, result[1:]))
            out.append(result)
        updates, mu, nu, master = (treedef.unflatten([r[k] for r in out]) for k in range(4))
        return updates, AdamWState(count=count + 1, mu=mu, nu=nu, master=master)

    transformation = AdamW(init, update)
    transformation.schedule = lr_at
    transformation.offload = bool(offload)
    return transformation


def learning_rate(optimizer, opt_state) -> jax.Array | None:
    """The learning rate ``optimizer``'s next update uses from ``opt_state``: its ``schedule``
    at the state's count, for an ``AdamW``; ``None`` for an optimizer that does not say."""
    lr_at = getattr(optimizer, "schedule", None)
    if lr_at is None or not isinstance(opt_state, AdamWState):
        return None
    return lr_at(opt_state.count)


def host_state_shardings(optimizer, opt_shardings) -> Any:
    """``opt_shardings`` (a tree of ``NamedSharding`` like the optimizer's state) with the
    moments and master copies in host memory (``pinned_host``) when ``optimizer`` offloads its
    state; unchanged otherwise. The count stays on the device."""
    if not getattr(optimizer, "offload", False) or not isinstance(opt_shardings, AdamWState):
        return opt_shardings

    def host(tree):
        return jax.tree_util.tree_map(lambda s: s.with_memory_kind("pinned_host"), tree)

    return opt_shardings._replace(
        mu=host(opt_shardings.mu), nu=host(opt_shardings.nu), master=host(opt_shardings.master)
    )


def state_bytes(opt_state) -> dict:
    """``{"moments": B, "master": B, "count": B}``: the bytes of an ``AdamWState`` (arrays or
    ``ShapeDtypeStruct`` s), summed over the global arrays."""

    def total(tree):
        return sum(
            math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
            for x in jax.tree_util.tree_leaves(tree)
        )

    return {
        "moments": total((opt_state.mu, opt_state.nu)),
        "master": total(opt_state.master),
        "count": total(opt_state.count),
    }


def default_optimizer(learning_rate: float = 1e-3) -> AdamW:
    """The optimizer ``dew train`` builds without optimizer flags (``adamw``'s defaults): for
    other builders of a step that must match it (``dew plan``, ``dew bench``)."""
    return adamw(learning_rate)
