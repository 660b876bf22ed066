"""``fit`` never saves a state whose step's loss it has not read and found finite, also when the
NaN falls on the very step that saves (tests/test_fit_dispatch.py puts it on the step before one,
which is read before the save's step is: a save made before its own step's loss is read passes
that test, and would write the NaN's weights over the user's last good state)."""

import pytest

from dew.data import TokenWindows
from tests.helpers import SEQ, random_token_folder
from tests.test_fit_dispatch import ROWS, make_trainer, recording


def test_a_nan_loss_on_a_step_that_saves_is_not_saved(tmp_path, seed):
    print(f"seed {seed}")
    folder = random_token_folder(tmp_path / "tokens", seed, 3000, 300)
    events = []
    trainer = make_trainer(tmp_path / "run")
    recording(trainer, events, nan_at=4)
    data = TokenWindows(folder, seq_len=SEQ).load(batch=ROWS)
    with pytest.raises(
        FloatingPointError, match="step 4: the loss is nan; stopping without saving"
    ):
        trainer.fit(data, steps=6, checkpoint_every=2)
    trainer.checkpoints.wait()
    assert trainer.checkpoints.steps == [2]
    # Step 4's loss is read (and refused) before anything of step 4 could be written.
    assert ("read", 4) in events
