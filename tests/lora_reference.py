"""The LoRA runs whose exports tests/test_lora_export.py holds against transformers and PEFT.

``write_run``: adapters of rank 4 (alpha 6, so alpha / R = 1.5) on all seven projections of the
Hugging Face reference model ``tests/data/hf/llama3_untied`` (2 layers, width 64, its own output
head, Llama 3 rope scaling), drawn from a fixed numpy seed (A and B both non-zero), saved by a
``Trainer`` as a LoRA run's checkpoint.

``write_windowed_run``: a run trained with an attention window of 5 on a base that is a Dew
checkpoint of no window (the weights of ``tests/data/hf/mistral_window``, 2 layers of width 32),
adapters of rank 2 (alpha 3) on q, v and down drawn the same way, for rows of 24 tokens.

``scripts/make_lora_reference.py`` wrote the committed exports from them."""

from pathlib import Path

import jax
import numpy as np

HF_BASE = Path(__file__).resolve().parent / "data" / "hf" / "llama3_untied"
OUT = Path(__file__).resolve().parent / "data" / "lora"
RANK, ALPHA = 4, 6.0


def write_run(run_dir, base=HF_BASE) -> None:
    """A LoRA run's checkpoint (step 0) in ``run_dir/checkpoints``, base ``HF_BASE`` (``None``:
    the model's initial weights, drawn from the run's key)."""
    import dew
    from dew.models import hf, lora
    from dew.objectives.lm import LMObjective

    config = hf.read_config(HF_BASE)
    model = hf.model_from_config(config, str(HF_BASE), lora=lora.Lora(rank=RANK, alpha=ALPHA))
    trainer = dew.Trainer(
        LMObjective(model, 40),
        dew.training.optimizer.default_optimizer(),
        jax.random.key(0),
        checkpoints=dew.Checkpoints(Path(run_dir) / "checkpoints"),
        base=base,
    )
    state = trainer.init_state()
    rng = np.random.default_rng(54)
    drawn = jax.tree_util.tree_map(
        lambda x: (0.2 * rng.standard_normal(x.shape)).astype(np.float32), state.params
    )
    trainer.save(state.replace(params=jax.device_put(drawn, trainer.state_shardings.params)))
    trainer.checkpoints.wait()


WINDOW_BASE = Path(__file__).resolve().parent / "data" / "hf" / "mistral_window"
WINDOW_OUT = OUT / "window"
WINDOW = 5


def write_windowed_run(run_dir) -> None:
    """A LoRA run's checkpoint (step 0) in ``run_dir/checkpoints`` trained with an attention
    window of ``WINDOW``, its base the Dew checkpoint ``run_dir/base`` (no window)."""
    import dataclasses

    import dew
    from dew.models import hf, lora
    from dew.objectives.lm import LMObjective

    model, params = hf.load(WINDOW_BASE)
    plain = dataclasses.replace(model, attention_window=None)
    base = dew.Checkpoints(Path(run_dir) / "base")
    base.save(0, params, metadata={"contents": "params", "model": hf.describe(plain)})
    base.wait()
    adapted = lora.Lora(rank=2, alpha=3.0, targets=("q_proj", "v_proj", "down_proj"))
    trained = dataclasses.replace(plain, attention_window=WINDOW, lora=adapted)
    trainer = dew.Trainer(
        LMObjective(trained, 24),
        dew.training.optimizer.default_optimizer(),
        jax.random.key(0),
        checkpoints=dew.Checkpoints(Path(run_dir) / "checkpoints"),
        base=base.directory,
    )
    state = trainer.init_state()
    rng = np.random.default_rng(55)
    drawn = jax.tree_util.tree_map(
        lambda x: (0.3 * rng.standard_normal(x.shape)).astype(np.float32), state.params
    )
    trainer.save(state.replace(params=jax.device_put(drawn, trainer.state_shardings.params)))
    trainer.checkpoints.wait()
