"""``dew plot``: the curves of one or more metrics files (``fit(metrics=...)``, ``dew train
--metrics``), several runs overlaid, in one PNG.

    dew plot runs/a/metrics.jsonl runs/b/metrics.jsonl -o curves.png [--name a --name b]

Three panels against the step: the loss (and the validation loss, ``val_loss``, dashed with
markers, where the file has it), tokens per second, and model FLOPs utilisation (``mfu``, PaLM's
count, solid; ``mfu_causal``, causal attention halved as MaxText counts it, dotted). The MFU
panel stays, saying so, when no file has ``mfu`` (a CPU run, or a device whose peak is unknown): the
figure has the same panels whatever the files hold. A file with ``eval/TASK/METRIC`` scores
(on the training lines of ``dew train --eval-tasks``, or lines of ``dew eval --metrics``) has
them beside the loss, dotted with crosses at the steps that have them, on an axis of their own.
Each run is named by its file's stem (its folder and stem when two stems collide) or by
``--name``, once per file.

A resumed run appends to its file, so a step can appear twice; the later line wins. The tokens/s
curve leaves out the first step of the file and of each resumed segment (a line whose step is not
above the line before it): that step includes compiling.

matplotlib is an optional extra (``pip install -e '.[plot]'``); the figure is drawn with the Agg
backend, without pyplot, so no display is needed.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from dew.targets import MissingExtra

PANELS = ("loss", "tokens / s", "MFU")
NO_MFU = "no mfu in these metrics\n(absent on CPU, or when the device's peak FLOP/s is unknown)"


def add_parser(commands) -> argparse.ArgumentParser:
    """Adds ``plot`` to the ``dew`` command's subparsers."""
    parser = commands.add_parser(
        "plot",
        help="draw loss, val loss, tokens/s and MFU of metrics files into a PNG",
        description="Draws the loss and validation loss, tokens/s and MFU against the step of "
        "one or more metrics files (one JSON object a line, as fit(metrics=...) writes them), "
        "each run a line named by its file's stem or --name.",
    )
    parser.add_argument("files", nargs="+", metavar="METRICS.jsonl", help="metrics files")
    parser.add_argument(
        "-o", "--output", default="curves.png", help="the PNG to write (default curves.png)"
    )
    parser.add_argument(
        "--name",
        action="append",
        default=None,
        metavar="NAME",
        help="a run's name in the legend, once per file in order (default: the file's stem)",
    )
    parser.set_defaults(run=plot_command, setup=lambda: None)
    return parser


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics file, one per step, in step order: the lines of a step merged, a
    later value replacing an earlier one (a resumed run's), a training line (with ``loss``)
    marked ``"first_of_segment"`` when it opened the file or a resumed segment (its step not
    above the training line before). A line may hold ``val_loss`` without ``loss``, or only
    ``eval/TASK/METRIC`` values (``dew eval --metrics``).

    Raises ``FileNotFoundError`` for a missing file, ``ValueError`` for an empty one or a line that
    is not a JSON object with a numeric ``step`` and a numeric ``loss`` or ``val_loss`` (naming
    the file and the line).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such metrics file")
    by_step: dict[int, dict] = {}
    previous = None
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}, line {number}: not JSON ({error.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}, line {number}: not a JSON object: {line.strip():.80}")
            if not _number(record.get("step")):
                raise ValueError(
                    f"{path}, line {number}: no numeric 'step' (every line of a metrics file "
                    f"of dew train --metrics has one): {line.strip():.80}"
                )
            if not (
                _number(record.get("loss"))
                or _number(record.get("val_loss"))
                or eval_keys([record])  # a line of dew eval --metrics
            ):
                raise ValueError(
                    f"{path}, line {number}: neither 'loss' nor 'val_loss' nor an 'eval/' "
                    f"metric is a number: {line.strip():.80}"
                )
            step = int(record["step"])
            if _number(record.get("loss")):  # a training step's line (val_loss may be alone)
                record["first_of_segment"] = previous is None or step <= previous
                previous = step
            by_step.setdefault(step, {}).update(record)
    if not by_step:
        raise ValueError(f"{path} is empty: no metrics to plot")
    return [by_step[s] for s in sorted(by_step)]


def run_names(paths: list[str | Path], names: list[str] | None = None) -> list[str]:
    """The legend name of each file: ``names`` if given (one per file), else each file's stem, or
    its folder and stem where stems collide."""
    if names is not None:
        if len(names) != len(paths):
            raise ValueError(f"{len(names)} --name for {len(paths)} files; give one per file")
        return list(names)
    stems = [Path(p).stem for p in paths]
    return [
        f"{Path(p).parent.name}/{stem}" if stems.count(stem) > 1 else stem
        for p, stem in zip(paths, stems)
    ]


def eval_keys(records: list[dict]) -> list[str]:
    """The ``eval/TASK/METRIC`` keys with a number in ``records`` (``dew eval --metrics``),
    sorted."""
    return sorted(
        {k for r in records for k, v in r.items() if k.startswith("eval/") and _number(v)}
    )


def _series(records: list[dict], key: str, skip_first_of_segment: bool = False):
    points = [
        (r["step"], r[key])
        for r in records
        if isinstance(r.get(key), (int, float))
        and math.isfinite(r[key])
        and not (skip_first_of_segment and r.get("first_of_segment", True))
    ]
    return [s for s, _ in points], [v for _, v in points]


def build_figure(runs: list[tuple[str, list[dict]]]):
    """The figure of ``runs`` (``(name, read_metrics(...))`` pairs): three axes, ``PANELS``, and
    a fourth, the loss panel's twin, when a run has ``eval/`` metrics (``dew train --eval-tasks``,
    ``dew eval --metrics``).

    Lines, per run: its loss and, when it has ``val_loss``, its validation loss (loss panel); its
    tokens/s (when a step is left after the compile steps); its MFU when it has ``mfu``. An MFU
    panel with no line says why (``NO_MFU``)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise MissingExtra(
            "dew plot draws with matplotlib: pip install -e '.[plot]' (or matplotlib)"
        ) from None
    figure = Figure(figsize=(15, 4.2), layout="constrained")
    FigureCanvasAgg(figure)
    loss_ax, speed_ax, mfu_ax = figure.subplots(1, 3)
    for index, (name, records) in enumerate(runs):
        color = f"C{index % 10}"
        loss_ax.plot(*_series(records, "loss"), color=color, label=name)
        steps, values = _series(records, "val_loss")
        if steps:
            loss_ax.plot(
                steps, values, color=color, linestyle="--", marker="o", label=f"{name} val"
            )
        steps, values = _series(records, "tokens_per_s", skip_first_of_segment=True)
        if steps:
            speed_ax.plot(steps, values, color=color, label=name)
        # Both counts (dew.training.flops), each named: PaLM's solid, causal attention halved
        # (MaxText's) dotted.
        for key, style, label in (
            ("mfu", "-", f"{name} PaLM"),
            ("mfu_causal", ":", f"{name} causal-halved"),
        ):
            steps, values = _series(records, key)
            if steps:
                mfu_ax.plot(
                    steps, [100.0 * v for v in values], color=color, linestyle=style, label=label
                )
    loss_ax.set(xlabel="step", ylabel="loss (nats per token)", title="loss")
    loss_ax.legend(fontsize="small")
    if any(eval_keys(records) for _, records in runs):
        # lm-eval's scores (dew train --eval-tasks, dew eval) beside the loss, on an axis of
        # their own (accuracies, not nats).
        eval_ax = loss_ax.twinx()
        for index, (name, records) in enumerate(runs):
            for key in eval_keys(records):
                eval_ax.plot(
                    *_series(records, key),
                    color=f"C{index % 10}",
                    linestyle=":",
                    marker="x",
                    label=f"{name} {key[len('eval/') :]}",
                )
        eval_ax.set(ylabel="eval (lm-eval tasks)")
        eval_ax.legend(fontsize="small", loc="upper center")
    speed_ax.set(xlabel="step", ylabel="tokens / s", title="tokens / s (compile steps left out)")
    mfu_ax.set(
        xlabel="step", ylabel="MFU (%)", title="model FLOPs utilisation (PaLM; causal-halved)"
    )
    if mfu_ax.get_lines():
        mfu_ax.legend(fontsize="small")
    else:
        mfu_ax.text(0.5, 0.5, NO_MFU, ha="center", va="center", transform=mfu_ax.transAxes)
        mfu_ax.set(xticks=[], yticks=[])
    return figure


def plot_command(args) -> int:
    names = run_names(args.files, args.name)
    runs = [(name, read_metrics(path)) for name, path in zip(names, args.files)]
    figure = build_figure(runs)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=100)
    steps = sum(len(records) for _, records in runs)
    print(f"Wrote {output.resolve()}: {len(runs)} run(s), {steps} steps")
    return 0
