"""The LoRA run whose exports tests/test_lora_export.py holds against transformers and PEFT:
adapters of rank 4 (alpha 6, so alpha / R = 1.5) on all seven projections of the Hugging Face
reference model ``tests/data/hf/llama3_untied`` (2 layers, width 64, its own output head, Llama 3
rope scaling), drawn from a fixed numpy seed (A and B both non-zero), saved by a ``Trainer`` as a
LoRA run's checkpoint. ``scripts/make_lora_reference.py`` wrote the committed exports from it."""

from pathlib import Path

import jax
import numpy as np

HF_BASE = Path(__file__).resolve().parent / "data" / "hf" / "llama3_untied"
OUT = Path(__file__).resolve().parent / "data" / "lora"
RANK, ALPHA = 4, 6.0


def write_run(run_dir) -> None:
    """A LoRA run's checkpoint (step 0) in ``run_dir/checkpoints``, base ``HF_BASE``."""
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
        base=HF_BASE,
    )
    state = trainer.init_state()
    rng = np.random.default_rng(54)
    drawn = jax.tree_util.tree_map(
        lambda x: (0.2 * rng.standard_normal(x.shape)).astype(np.float32), state.params
    )
    trainer.save(state.replace(params=jax.device_put(drawn, trainer.state_shardings.params)))
    trainer.checkpoints.wait()
