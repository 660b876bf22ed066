"""One process of a two-process run that evaluates lm-eval tasks during training (started by
tests/test_fit_evaluation.py).

argv: port process_id token_folder checkpoint_dir metrics_file
"""

import sys

from dew.training.runtime import prepare_process

port, process_id, folder, checkpoint_dir, metrics = sys.argv[1:]
prepare_process(
    multi_host=True,
    cpu_devices=4,
    coordinator_address=f"127.0.0.1:{port}",
    num_processes=2,
    process_id=int(process_id),
)

import jax  # noqa: E402
import optax  # noqa: E402

import dew  # noqa: E402
from dew.data import TokenWindows  # noqa: E402
from dew.evaluation import Tasks  # noqa: E402
from dew.objectives.lm import LMObjective  # noqa: E402
from tests.test_fit_evaluation import EOT, MC, ROLLING, SEQ, TOKENIZER, model_of  # noqa: E402

assert jax.process_count() == 2 and jax.device_count() == 8
data = TokenWindows(folder, seq_len=SEQ).load(batch=8)
trainer = dew.Trainer(
    LMObjective(model_of(), SEQ),
    optax.adam(1e-2),
    jax.random.key(3),
    mesh=dew.MeshSpec(fsdp=8),
    layout=dew.Layout(min_shard=1),
    checkpoints=dew.Checkpoints(checkpoint_dir),
)
tasks = Tasks([MC, ROLLING], TOKENIZER, eot_id=EOT, limit=3)
trainer.fit(data, steps=2, eval_every=2, metrics=metrics, evaluations=[tasks])
