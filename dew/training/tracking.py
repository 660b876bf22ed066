"""Where ``fit``'s metrics go: trackers, the speed its log lines print (``LogWindow``), and what
it evaluates beside the validation loss (``Evaluation``: ``fit(evaluations=[...])``).

A tracker is anything with two methods:

    log(step: int, metrics: dict) -> None   # one call per step, after the step
    close() -> None                         # when fit returns or raises

``metrics`` maps names to floats (``loss``, ``step_time_s``, ``tokens_per_s``, ...; see
docs/metrics.md; on a step that ran evaluations, their scores, ``eval/TASK/METRIC`` for lm-eval's
tasks), and, on a step that evaluated, ``val_weights``: the string ``"params"`` or ``"ema"``.
``fit`` calls trackers on process 0 only, so a tracker writes once per run whatever the process
count. Two come with Dew: ``JsonLines`` (one JSON line per step, ``fit(metrics=FILE)``) and
``TensorBoard`` (event files, with the optional extra ``tensorboard``). Both open their file at
the first ``log`` and reopen after ``close``, so one tracker serves several ``fit`` calls.
"""

from __future__ import annotations

import json
import numbers
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import jax

from dew.checks import positive_int
from dew.targets import MissingExtra
from dew.training.flops import throughput


@runtime_checkable
class Tracker(Protocol):
    """What ``fit(trackers=[...])`` calls: ``log`` after every step, ``close`` at the end."""

    def log(self, step: int, metrics: dict) -> None: ...

    def close(self) -> None: ...


class JsonLines:
    """A tracker that appends one JSON line per step to a file.

    Each line is ``{"step": N, **metrics}``, flushed as the step ends, so a run that dies keeps
    every step it finished. ``fit(metrics=path)`` adds one; the folder is created at the first
    line.

    Args:
      path: the file to append to (``str`` or ``os.PathLike``).

    Raises:
      ValueError: ``path`` is a folder (here, before anything compiles).

    Examples:
        >>> import json
        >>> from dew.training.tracking import JsonLines
        >>> state = trainer.fit(data, steps=20, trackers=[JsonLines("runs/steps.jsonl")])
        >>> json.loads(open("runs/steps.jsonl").readline())["step"]
        1
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if self.path.is_dir():
            raise ValueError(f"metrics={str(path)!r} is a folder; give a file name")
        self._file = None

    def log(self, step: int, metrics: dict) -> None:
        """Appends ``{"step": step, **metrics}`` as one line and flushes it."""
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Closes the file; the next ``log`` opens it again, to append."""
        if self._file is not None:
            self._file.close()
            self._file = None


class TensorBoard:
    """A tracker that writes each step's metrics as TensorBoard scalars.

    Each number of ``metrics`` becomes a scalar (its name the tag, ``step`` the step) in event
    files in ``logdir``, through ``tensorboardX``'s ``SummaryWriter`` (no TensorFlow):
    ``pip install -e '.[tensorboard]'``. Strings (``val_weights``) are left out. Flushed after
    every step. View with ``tensorboard --logdir DIR``.

    Args:
      logdir: the folder for the event files, created at the first ``log``.

    Raises:
      dew.targets.MissingExtra: ``tensorboardX`` is not installed.
      ValueError: ``logdir`` is a file.

    Examples:
        >>> from dew.training.tracking import TensorBoard
        >>> state = trainer.fit(data, steps=20, trackers=[TensorBoard("runs/tb")])
    """

    def __init__(self, logdir: str | os.PathLike):
        try:
            import tensorboardX  # noqa: F401
        except ImportError:
            raise MissingExtra(
                "TensorBoard files need tensorboardX: pip install -e '.[tensorboard]'"
            ) from None
        self.logdir = Path(logdir)
        if self.logdir.exists() and not self.logdir.is_dir():
            raise ValueError(f"tensorboard={str(logdir)!r} is a file; give a folder")
        self._writer = None

    def log(self, step: int, metrics: dict) -> None:
        """Writes every number of ``metrics`` as a scalar at ``step``, then flushes."""
        if self._writer is None:
            from tensorboardX import SummaryWriter

            self._writer = SummaryWriter(logdir=str(self.logdir))
        for name, value in metrics.items():
            if isinstance(value, numbers.Real):
                self._writer.add_scalar(name, float(value), global_step=step)
        self._writer.flush()

    def close(self) -> None:
        """Closes the writer; the next ``log`` opens a new one in ``logdir``."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def check_trackers(trackers) -> list:
    """``trackers`` as a list, each checked to have ``log`` and ``close`` (``TypeError`` naming the
    one that does not)."""
    trackers = list(trackers)
    for tracker in trackers:
        if not isinstance(tracker, Tracker):
            raise TypeError(
                f"a tracker needs log(step, metrics) and close() methods; {tracker!r} does not "
                "have both"
            )
    return trackers


def close_all(trackers) -> None:
    """Closes every tracker, even when one raises (the first error is raised after)."""
    error = None
    for tracker in trackers:
        try:
            tracker.close()
        except Exception as e:  # the others are closed first
            error = error or e
    if error is not None:
        raise error


@runtime_checkable
class Evaluation(Protocol):
    """What ``fit(evaluations=[...])`` calls at each evaluation step (every ``eval_every`` steps
    and at the last), on every process, with the weights validation uses (the EMA where the
    objective keeps one), laid out as the step lays them out:

        evaluation(model, params, adapters, mesh, layout, step) -> {name: float}

    ``model`` the objective's model; ``params`` its weights (``{"params": ...}``), or for a LoRA
    model its frozen base, with ``adapters`` its adapters (``{"lora": ...}``; ``None``
    otherwise); ``mesh`` the trainer's ``jax.sharding.Mesh``; ``layout`` its ``Layout``;
    ``step`` the step just trained. The names returned join that step's metrics (the trackers,
    the metrics file) and its printed ``step N: name value, ...`` line; name them apart from
    ``fit``'s own (``eval/TASK/METRIC``, as ``dew.evaluation.Tasks`` does). It may read the
    arrays, never keep them past the call for later use: the next step reuses their buffers.

    An evaluation may also have ``check(model, mesh, layout)``, which ``fit`` calls before
    anything compiles, raising ``ValueError`` for a run it cannot evaluate. The trainer imports
    nothing of what an evaluation runs (``dew.evaluation.Tasks``: lm-eval's tasks)."""

    def __call__(self, model, params, adapters, mesh, layout, step: int) -> dict: ...


def check_evaluation(
    data, eval_every: int | None, eval_batches: int | None, evaluations: Sequence = ()
) -> list:
    """``fit``'s evaluation settings against ``data``: ``ValueError`` for a cadence below 1, batches
    or evaluations without a cadence, a cadence with neither validation batches nor evaluations,
    or more batches than the data has; ``TypeError`` for an evaluation that is not callable.
    Returns ``evaluations`` as a list."""
    evaluations = list(evaluations)
    for evaluation in evaluations:
        if not callable(evaluation):
            raise TypeError(
                f"an evaluation is called as evaluation(model, params, adapters, mesh, layout, "
                f"step); {evaluation!r} is not callable"
            )
    if eval_every is None:
        if eval_batches is not None:
            raise ValueError(
                f"eval_batches={eval_batches} without eval_every: give eval_every=N to evaluate "
                "every N steps"
            )
        if evaluations:
            raise ValueError(
                f"evaluations ({len(evaluations)}) without eval_every: give eval_every=N to run "
                "them every N steps and at the last step"
            )
        return evaluations
    positive_int("eval_every", eval_every)
    if not data.val_batches and not evaluations:
        raise ValueError(
            f"eval_every={eval_every} needs validation batches; the data has none: load it with "
            "val_batches >= 1 (TokenWindows(..., val_batches=K)), or give evaluations"
        )
    if eval_batches is not None and not data.val_batches:
        raise ValueError(
            f"eval_batches={eval_batches} needs validation batches; the data has none: load it "
            "with val_batches >= 1 (TokenWindows(..., val_batches=K))"
        )
    if eval_batches is not None:
        positive_int("eval_batches", eval_batches)
        if eval_batches > data.val_batches:
            raise ValueError(
                f"eval_batches={eval_batches} is more than the data's {data.val_batches} "
                "validation batches (TokenWindows(..., val_batches=K))"
            )
    return evaluations


def evaluation_scores(scores, evaluation) -> dict[str, float]:
    """An evaluation's answer as ``{name: float}``: ``TypeError`` naming ``evaluation`` for an
    answer that is not a dict of string names to numbers."""
    if not isinstance(scores, dict) or not all(
        isinstance(k, str) and isinstance(v, numbers.Real) and not isinstance(v, bool)
        for k, v in scores.items()
    ):
        raise TypeError(
            f"the evaluation {evaluation!r} returned {scores!r:.200}; an evaluation returns a "
            "dict of metric names to numbers"
        )
    return {k: float(v) for k, v in scores.items()}


def scores_line(step: int, scores: dict, seconds: float) -> str:
    """``"step 4: eval/t/acc 0.4375, eval/t/acc_norm 0.5 (2.1 s)"``: an evaluation step's
    scores, in the order given, and the seconds they took."""
    values = ", ".join(f"{name} {value:.6g}" for name, value in scores.items())
    return f"step {step}: {values} ({seconds:.1f} s)"


# What a log line says of its speed when the window is the first step alone: the step compiled
# at its call, or compiled before fit began (``Trainer.compile_step``, as ``dew train`` does), when
# the first step's time is the executable's first run alone (its buffers allocated, its program
# loaded), still not a steady step's.
FIRST_STEP_NOTE = "(first step: includes compiling)"
COMPILED_AHEAD_NOTE = "(first step: compiled ahead, includes warm-up)"


# What an int8 step's MFU divides by (StepOptions(quantize="int8")): the bf16 peak, as MaxText
# counts it, so that it compares with the bf16 step's; it can pass what bf16 matmuls could reach.
INT8_PEAK_NOTE = "of the bf16 peak"


def speed_text(
    seconds: float, useful: float | None = None, peak_note: str | None = None, **speed
) -> str:
    """``"212.3 ms/step, 77,180 tokens/s, MFU 35.6% PaLM, 33.0% causal-halved"``: a step time of
    ``seconds`` and the throughput of ``speed`` at it (``dew.training.flops.throughput``'s
    ``tokens``, ``flops_per_token``, ``devices``, ``peak`` and ``causal_flops_per_token``); MFU
    only where the device's peak is known, by each count it is given, each named: PaLM's, and
    with causal attention halved (MaxText's; ``dew.training.flops``). ``useful``: the step's
    mean count of targets whose loss counts (a batch with a loss mask), or ``None``; given,
    ``"(24,310 useful)"`` follows the tokens/s: those per second. ``peak_note``: said after
    the MFU, which peak it divides by (``INT8_PEAK_NOTE`` for an int8 step)."""
    rates = throughput(seconds=seconds, **speed)
    text = f"{1e3 * seconds:,.1f} ms/step, {rates['tokens_per_s']:,.0f} tokens/s"
    if useful is not None:
        text += f" ({useful / seconds:,.0f} useful)"
    if "mfu" in rates:
        text += f", MFU {100 * rates['mfu']:.1f}% PaLM"
    if "mfu_causal" in rates:
        text += f", {100 * rates['mfu_causal']:.1f}% causal-halved"
    if "mfu" in rates and peak_note:
        text += f" {peak_note}"
    return text


class LogWindow:
    """The steps since ``fit``'s last log line, and the speed its next line prints.

    ``add`` takes each step's time (``step_time_s``, in order); ``line`` returns the window's
    ``speed_text`` and starts the next window. The speed is that of the window's mean step time,
    so its tokens/s is the window's tokens over its summed step time. The first step given (a
    ``fit``'s first, which includes compiling the step, or its first run where the step was
    compiled ahead) is left out of its window, unless it is the window's only step (a line at that
    step, e.g. with ``log_every=1``): that line gives the first step's time, with ``first_note``
    (``FIRST_STEP_NOTE``, or ``COMPILED_AHEAD_NOTE``).
    """

    def __init__(self, first_note: str = FIRST_STEP_NOTE, **speed):
        self.first_note = first_note
        self.speed = speed  # throughput's arguments but seconds
        self._first = None  # the first step's (seconds, useful), while its window lasts
        self._steps: list[tuple[float, float | None]] = []  # the window's other steps
        self._started = False

    def add(self, seconds: float, useful: float | None = None) -> None:
        """One more step, of ``seconds``, with ``useful`` targets whose loss counts (a step's
        ``useful_tokens`` metric) or ``None``."""
        if self._started:
            self._steps.append((seconds, useful))
        else:
            self._first, self._started = (seconds, useful), True

    def line(self) -> str:
        """The window's speed; the next window starts empty. ``ValueError`` when no step was
        added since the last call: a line's speed is of at least one step."""
        if self._steps:
            seconds = [s for s, _ in self._steps]
            counts = [u for _, u in self._steps]
            useful = None if None in counts else sum(counts) / len(counts)
            text = speed_text(sum(seconds) / len(seconds), useful, **self.speed)
        elif self._first is not None:
            text = f"{speed_text(*self._first, **self.speed)} {self.first_note}"
        else:
            raise ValueError("no step was added since the last line")
        self._first, self._steps = None, []
        return text


class FitLog:
    """What ``fit`` reports after each step, handed to its trackers on process 0 (``with`` closes
    them all at the end, on every process): ``loss``, ``step_time_s``, ``throughput`` (tokens/s,
    model TFLOP/s per device, MFU), for a batch with a loss mask ``useful_tokens`` (the targets
    whose loss counts) and ``useful_tokens_per_s``, an MoE model's router statistics, and on a
    step that evaluated the ``validation_metrics`` prefixed ``val_`` with ``val_weights``, and the
    evaluations' scores with ``eval_time_s``."""

    def __init__(self, trackers, **speed):
        self.trackers = trackers
        self.writes = jax.process_index() == 0
        self.speed = speed  # throughput's arguments but seconds

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        close_all(self.trackers)

    def step(
        self,
        step: int,
        metrics: dict,
        seconds: float,
        validation=None,
        weights=None,
        scores=None,
        scores_seconds=None,
    ):
        """Logs step ``step``: its ``metrics`` and ``seconds``, and on an evaluation step the
        ``validation`` metrics (``val_``), the ``weights`` evaluated (``val_weights``) and the
        evaluations' ``scores`` (as named) with the ``scores_seconds`` they took
        (``eval_time_s``)."""
        record = dict(loss=metrics["loss"], step_time_s=seconds)
        record.update(throughput(seconds=seconds, **self.speed))
        if "useful_tokens" in metrics:  # the targets whose loss counts, per second
            record["useful_tokens_per_s"] = metrics["useful_tokens"] / seconds
        record.update((k, v) for k, v in metrics.items() if k != "loss")
        if validation is not None:
            record.update((f"val_{k}", v) for k, v in validation.items())
            record["val_weights"] = weights
        if scores:
            taken = sorted(set(scores) & set(record))
            if taken:
                raise ValueError(
                    f"an evaluation's metrics {taken} take names fit logs itself; name them "
                    "apart (eval/TASK/METRIC)"
                )
            record.update(scores)
            record["eval_time_s"] = scores_seconds
            if validation is None:
                record["val_weights"] = weights
        if self.writes:
            for tracker in self.trackers:
                tracker.log(step, record)
