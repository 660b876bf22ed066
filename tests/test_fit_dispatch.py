"""``fit`` dispatches step N+1 before it reads step N's metrics (the device never waits for the host
between steps), waits where it must (a save, an evaluation, the last step), and never saves a
state whose step's loss it has not checked finite.

The order is recorded by a stand-in for the compiled step: it calls the real step, records
``dispatch N``, and hands back metrics that record ``read N`` when ``fit`` turns them into Python
numbers (what waits for the device). No timing is involved."""

import jax
import optax
import pytest

import dew
from dew.data import TokenWindows
from tests.helpers import SEQ, random_token_folder, tiny_objective

ROWS = 8


@pytest.fixture(scope="module")
def folder(tmp_path_factory, module_seed):
    return random_token_folder(tmp_path_factory.mktemp("tokens") / "tokens", module_seed, 3000, 300)


class Recorded:
    """A metric of step ``step``: ``float()`` records the read, then waits for the value."""

    def __init__(self, value, step, events, poison):
        self.value, self.step, self.events, self.poison = value, step, events, poison

    def __float__(self):
        self.events.append(("read", self.step))
        return float("nan") if self.poison else float(self.value)


def recording(trainer, events, nan_at=None):
    """Makes ``trainer.fit`` run its real step through a recorder; the loss of step ``nan_at``
    reads as NaN."""
    real = trainer.train_step

    def train_step(rows):
        step_fn = real(rows)

        def recorded(state, batch):
            step = len([e for e in events if e[0] == "dispatch"]) + start[0] + 1
            events.append(("dispatch", step))
            state, metrics = step_fn(state, batch)
            return state, {
                name: Recorded(v, step, events, poison=name == "loss" and step == nan_at)
                for name, v in metrics.items()
            }

        return recorded

    start = [0]
    trainer.train_step = train_step
    return start


def make_trainer(tmp_path=None):
    return dew.Trainer(
        tiny_objective(num_layers=1),
        optax.sgd(0.1),
        jax.random.key(0),
        mesh=dew.MeshSpec(fsdp=8),
        layout=dew.Layout(min_shard=1),
        checkpoints=dew.Checkpoints(tmp_path) if tmp_path else None,
    )


def test_the_next_step_is_dispatched_before_this_steps_loss_is_read(folder, capsys):
    events = []
    trainer = make_trainer()
    recording(trainer, events)
    data = TokenWindows(folder, seq_len=SEQ).load(batch=ROWS)
    trainer.fit(data, steps=5, log_every=2)
    d, r = "dispatch", "read"
    loss_reads = [e for e in events if e[0] == d or e == (r, e[1])]
    order = []
    for event in loss_reads:
        if not order or order[-1] != event:  # one entry per metric read: keep the first
            order.append(event)
    # Steps 1 to 4: each read after the next dispatch. Step 5, the last: read at once.
    assert order == [
        (d, 1), (d, 2), (r, 1), (d, 3), (r, 2), (d, 4), (r, 3), (d, 5), (r, 4), (r, 5)
    ], order  # fmt: skip
    printed = capsys.readouterr().out
    # What fit prints is unchanged: the log steps' losses, in order.
    assert [line.split(":")[0] for line in printed.splitlines() if line.startswith("step ")] == [
        "step 2",
        "step 4",
        "step 5",
    ]


def test_a_save_waits_for_its_step_and_a_nan_loss_is_never_saved(folder, tmp_path):
    events = []
    trainer = make_trainer(tmp_path / "run")
    recording(trainer, events, nan_at=3)
    data = TokenWindows(folder, seq_len=SEQ).load(batch=ROWS)
    # Step 3's loss reads NaN; step 4 is a checkpoint step, dispatched before step 3's loss is
    # read. The state after step 4 must not be saved, nor the one after step 3.
    with pytest.raises(
        FloatingPointError, match="step 3: the loss is nan; stopping without saving"
    ):
        trainer.fit(data, steps=6, checkpoint_every=2)
    trainer.checkpoints.wait()  # step 2's save may still be writing
    assert trainer.checkpoints.steps == [2]
    d, r = "dispatch", "read"
    first = [events.index(e) for e in ((d, 2), (r, 2), (d, 3), (d, 4), (r, 3))]
    # Step 2 saves: its loss is read before step 3 is dispatched. Step 3's is read after step 4's
    # dispatch, and stops the run before step 4 can be saved.
    assert first == sorted(first), events
    assert (r, 4) not in events
