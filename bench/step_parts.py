"""Where a training step's time goes, one device: the whole step beside its parts, each timed alone.

    python bench/step_parts.py [--model gpt2-small] [--batch 16] [--seq-len 1024]
                               [--attention auto] [--remat dots attention] [--calls 10]

For each ``--remat`` policy, a table of median wall times (``--calls`` calls after a warm-up, each
to ``block_until_ready``), every part compiled on its own with the step's shapes and dtypes:

- ``step``: the Trainer's whole step (forward, backward and the AdamW update), the one-device
  GSPMD engine: the figure the parts explain;
- ``embedding, head and loss``: the token lookup, the final norm, the logits through the tied table
  and the cross-entropy, forward and backward (gradients of the table and of the blocks' output);
- ``layers``: the ``num_layers`` decoder layers under ``lax.scan`` and the remat policy, forward and
  backward (gradients of their weights and input), with what is inside them split as
- ``attention kernels``: the attention call alone (``[batch, seq, heads, head_dim]`` q, k, v),
  forward and backward, times the layers; and under a policy that recomputes attention in the
  backward (``full``, ``dots``), its forward once more;
- ``MLP``: the MLP half of a layer (norm, SwiGLU, residual) under the remat policy, forward and
  backward, times the layers;
- ``rest of the layers``: ``layers`` minus those two (attention's norm, projections, rotary and
  residual, the scan);
- ``optimizer update``: ``optax.adamw`` on the float32 weights and a gradient, the weights donated;
- ``unexplained``: ``step`` minus the parts (what XLA overlaps or fuses across them shows here, as
  a negative figure when the parts alone cost more).

Shares are of ``step``. MFU by both counts ``dew`` logs (``dew.training.flops``): PaLM's, and
causal attention halved (MaxText's).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dew import MeshSpec, Trainer
from dew.models.causal_transformer import remat_layer
from dew.models.presets import preset
from dew.nn import attention as attention_layer
from dew.nn import mlp, norm
from dew.objectives.lm import LMObjective
from dew.training.flops import model_flops_per_token, peak_flops

RECOMPUTES_ATTENTION = {"full", "dots"}  # the policies that save neither out nor lse


def median_ms(fn, args, calls: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(calls):
        began = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - began)
    return 1e3 * statistics.median(times)


def grad_of(fn, argnums):
    """``fn``'s forward and backward: the value and the gradients of ``argnums``, all returned so
    that nothing is left out of the program."""
    return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32)), argnums))


def parts(model, batch: int, seq_len: int, calls: int, seed: int, step_only: bool = False):
    """Median milliseconds of each part (see the module's docstring), or of the step alone."""
    objective = LMObjective(model, seq_len)
    trainer = Trainer(
        objective,
        optax.adamw(1e-3),
        key=jax.random.key(seed),
        mesh=MeshSpec(),
        engine="gspmd",
        devices=jax.devices()[:1],
    )
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, model.vocab_size, (batch, seq_len + 1)).astype(np.int32)
    state = trainer.init_state()
    step = trainer.compiled_step(batch)
    data = trainer.device_batch(rows, batch)
    ms = {}

    def run_step(state):
        state, metrics = step(state, data)
        return state, metrics

    # The step donates its state: time it by threading the state through.
    holder = [state]

    def one_step():
        holder[0], metrics = run_step(holder[0])
        return metrics

    ms["step"] = median_ms(one_step, (), calls)
    if step_only:
        return ms
    params = jax.tree_util.tree_map(lambda x: x, holder[0].params)
    del holder

    dtype = jnp.dtype(model.dtype)
    key = jax.random.key(seed)
    tokens = jnp.asarray(rows[:, :-1])
    targets = jnp.asarray(rows[:, 1:])
    x = jax.random.normal(key, (batch, seq_len, model.emb_features), dtype)

    def embed_head_loss(params, x):
        embedded = model.embed(params, tokens)
        return model.head_loss_sum(params, x + embedded, targets)

    ms["embedding, head and loss"] = median_ms(grad_of(embed_head_loss, (0, 1)), (params, x), calls)

    positions = jnp.arange(seq_len)
    ms["layers"] = median_ms(
        grad_of(lambda p, x: model.blocks(p, x, positions)[0], (0, 1)), (params, x), calls
    )

    attend = attention_layer.IMPLEMENTATIONS[model.attention_for(jax.default_backend())]
    heads, kv_heads, head_dim = model.num_heads, model.kv_heads, model.head_dim
    kq, kk, kv = jax.random.split(key, 3)
    # The model's attention layout, [batch, heads, seq, head_dim] (dew.nn.attention.LAYOUT).
    q = jax.random.normal(kq, (batch, heads, seq_len, head_dim), dtype)
    k = jax.random.normal(kk, (batch, kv_heads, seq_len, head_dim), dtype)
    v = jax.random.normal(kv, (batch, kv_heads, seq_len, head_dim), dtype)

    def kernel(q, k, v):
        return attend(q, k, v, causal=True)[0]

    one = median_ms(grad_of(kernel, (0, 1, 2)), (q, k, v), calls)
    forward = median_ms(jax.jit(kernel), (q, k, v), calls)
    again = forward if model.remat in RECOMPUTES_ATTENTION else 0.0
    ms["attention kernels"] = model.num_layers * (one + again)

    layer_weights = jax.tree_util.tree_map(lambda w: w[0], params["params"]["layers"])

    def mlp_half(w, x):
        h = norm.rms_norm(w["mlp_norm"], x, model.rms_norm_eps)
        return x + mlp.swiglu(w["mlp"], h)

    mlp_half = remat_layer(mlp_half, model.remat)
    ms["MLP"] = model.num_layers * median_ms(grad_of(mlp_half, (0, 1)), (layer_weights, x), calls)
    ms["rest of the layers"] = ms["layers"] - ms["attention kernels"] - ms["MLP"]

    optimizer = optax.adamw(1e-3)
    opt_state = optimizer.init(params)
    grads = jax.tree_util.tree_map(lambda w: jnp.full_like(w, 1e-3), params)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def update(params, opt_state, grads):
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    holder = [params, opt_state]

    def one_update():
        holder[0], holder[1] = update(holder[0], holder[1], grads)
        return holder[0]

    ms["optimizer update"] = median_ms(one_update, (), calls)
    ms["unexplained"] = ms["step"] - sum(
        ms[p] for p in ("embedding, head and loss", "layers", "optimizer update")
    )
    return ms


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-small")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--remat", nargs="+", default=["dots"])
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step-only", action="store_true", help="time the whole step only")
    parser.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="NAME=VALUE",
        help="more model settings (e.g. num_layers=2 for a CPU check)",
    )
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    kind = getattr(device, "device_kind", device.platform)
    peak = peak_flops(kind)
    print(
        f"device: {kind}, jax {jax.__version__}; {args.model}, batch {args.batch} x "
        f"{args.seq_len}, attention {args.attention}; median of {args.calls} calls"
    )
    extra = {}
    for item in args.set:
        name, _, value = item.partition("=")
        extra[name] = int(value) if value.isdigit() else value
    from dew import models

    for remat in args.remat:
        config = {**preset(args.model), **extra, "attention_impl": args.attention, "remat": remat}
        model = models.build("causal_transformer", **config)
        ms = parts(model, args.batch, args.seq_len, args.calls, args.seed, args.step_only)
        tokens = args.batch * args.seq_len
        flops = model_flops_per_token(model, args.seq_len) * tokens
        halved = model_flops_per_token(model, args.seq_len, causal_halved=True) * tokens
        seconds = ms["step"] / 1e3
        mfu = (
            f", MFU {100 * flops / seconds / peak:.1f}% PaLM, "
            f"{100 * halved / seconds / peak:.1f}% causal-halved"
            if peak
            else ""
        )
        print(
            f"\nremat {remat}: step {ms['step']:.1f} ms, "
            f"{tokens / (ms['step'] / 1e3):,.0f} tokens/s{mfu}"
        )
        print(f"  {'part':<28}{'ms':>10}{'share':>9}")
        for part, value in ms.items():
            share = "" if part == "step" else f"{100 * value / ms['step']:>8.1f}%"
            print(f"  {part:<28}{value:>10.1f}{share}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
