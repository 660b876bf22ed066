"""Benchmarks on a Dew model through EleutherAI's lm-evaluation-harness: ``DewLM``, its model
interface (``loglikelihood``, ``loglikelihood_rolling``, ``generate_until``), ``evaluate``, and
``Tasks``, the same tasks during training (an evaluation of ``Trainer.fit``).

    import dew
    from dew.evaluation import Tasks, evaluate

    model, params = dew.load_checkpoint("runs/dew-train")
    results = evaluate(model, params, ["tasks/my_task.yaml"], tokenizer="tokenizer.json")

    tasks = Tasks(["tasks/my_task.yaml"], "tokenizer.json", limit=100)
    state = trainer.fit(data, steps=1000, eval_every=200, evaluations=[tasks])

lm-eval is an optional extra (``pip install -e '.[eval]'``), never a dependency of the library:
``Scorer`` (the log-likelihoods of token rows, one ``shard_map`` over the mesh) needs only Dew,
and ``DewLM`` imports lm-eval when it is built (``MissingExtra`` saying how to install it).

How each request runs:

- ``loglikelihood``: lm-eval's ``TemplateLM`` encodes context and continuation as its Hugging
  Face backend does (the whole string encoded, the context's tokens cut off; an empty context
  conditioned on ``prefix_token_id``); ``Scorer`` runs the model's full forward on the rows
  (right-padded to a power of two, the last ``max_seq_len`` tokens kept) and sums the
  continuation's log-probabilities, with whether each of its tokens is the argmax.
- ``loglikelihood_rolling``: lm-eval's rolling windows of ``max_seq_len`` tokens, each scored so.
- ``generate_until``: ``dew.generation.Generator`` (greedy, or the request's temperature), the
  text cut at the first of the request's ``until`` strings.

It is one module, at 450 lines, because ``evaluate`` (``dew eval``) and ``Tasks`` (during
training) are two callers of the one ``DewLM`` and ``Scorer``, and lm-eval is imported here alone.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from dew.generation import Generator, bucket, drawable, to_host, tokenizer_of
from dew.parallel import tensor
from dew.targets import MissingExtra

INSTALL = "pip install -e '.[eval]' (lm-eval)"


class Scorer:
    """The log-probability of each next token of rows of ids, on the mesh of a ``Generator``
    (its weights, layout and collectives: the rows split over ``data`` and ``fsdp``, the model
    over ``fsdp`` and ``tensor``, the logits gathered over ``tensor``)."""

    def __init__(self, generator: Generator):
        self.generator = generator
        self._programs: dict = {}

    def _program(self, rows: int, length: int):
        key = (rows, length)
        if key not in self._programs:
            self._programs[key] = self._build()
        return self._programs[key]

    def _build(self):
        g = self.generator
        model, shards = g.model, g.shards

        def local(weights, tokens, targets):
            logits = model.apply(g._params(weights), tokens, shards)
            if logits.shape[-1] != model.vocab_size:
                logits = lax.all_gather(logits, tensor.AXIS, axis=2, tiled=True)
            logp = jax.nn.log_softmax(logits, axis=-1)
            picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
            return picked, jnp.argmax(logits, axis=-1) == targets

        rows_spec = P(g.row_axes) if g.row_axes else P()
        mapped = jax.shard_map(
            local,
            mesh=g.mesh,
            in_specs=(g.specs, rows_spec, rows_spec),
            out_specs=(rows_spec, rows_spec),
            check_vma=False,
        )
        return jax.jit(mapped)

    def __call__(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """``(sum of log p(continuation | context), every continuation token the argmax)`` of each
        ``(context ids, continuation ids)`` (both non-empty together: at least two ids); a row
        longer than ``max_seq_len + 1`` ids keeps its last ``max_seq_len + 1``."""
        g = self.generator
        limit = g.model.max_seq_len
        rows = []
        for context, continuation in pairs:
            whole = (list(context) + list(continuation))[-(limit + 1) :]
            if len(whole) < 2 or not continuation:
                raise ValueError("a scored pair needs a context and a continuation of 1+ tokens")
            rows.append((whole, len(continuation)))
        length = bucket(max(len(w) - 1 for w, _ in rows))
        count = math.ceil(len(rows) / g.row_devices) * g.row_devices
        tokens = np.zeros((count, length), np.int32)
        targets = np.zeros((count, length), np.int32)
        for i, (whole, _) in enumerate(rows):
            tokens[i, : len(whole) - 1] = whole[:-1]
            targets[i, : len(whole) - 1] = whole[1:]
        logp, greedy = self._program(count, length)(g.weights, tokens, targets)
        # Whole on every process (the rows split over processes: a gather, on each of them).
        logp, greedy = to_host(logp).astype(np.float64), to_host(greedy)
        out = []
        for i, (whole, n) in enumerate(rows):
            end = len(whole) - 1
            out.append((float(logp[i, end - n : end].sum()), bool(greedy[i, end - n : end].all())))
        return out


def lm_eval_module(who: str = "dew eval"):
    """``lm_eval``, or ``MissingExtra`` saying that ``who`` needs it and how to install it."""
    try:
        import lm_eval
    except ImportError:
        raise MissingExtra(f"{who} needs EleutherAI's lm-eval: {INSTALL}") from None
    return lm_eval


def dew_lm(generator: Generator, tokenizer, batch_size: int = 8, eot_id: int | None = None):
    """The lm-eval model (a ``lm_eval.api.model.TemplateLM``) over ``generator``'s model and
    ``tokenizer``: ``batch_size`` rows a forward; ``eot_id`` the end-of-text id (default the
    tokenizer's), the prefix of an empty context and the default stop of ``generate_until``.
    Its ``generator`` and ``scorer`` attributes are what it runs on."""
    lm_eval_module()
    from lm_eval import utils
    from lm_eval.api.model import TemplateLM

    scorer = Scorer(generator)
    drawn = drawable(generator.model, tokenizer)  # what generate_until may draw
    eot = tokenizer.eos_id if eot_id is None else eot_id
    if eot is None:
        raise ValueError(
            "lm-eval needs an end-of-text token (the prefix of an empty context): the tokenizer "
            "has none; name one (eot_id=..., dew eval --eot ID)"
        )

    class DewLM(TemplateLM):
        """lm-eval's model interface over a Dew model (the module's docstring)."""

        @property
        def eot_token_id(self) -> int:
            return eot

        @property
        def max_length(self) -> int:
            return generator.model.max_seq_len

        def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
            return list(tokenizer.encode(string))

        def tok_decode(self, ids) -> str:
            return tokenizer.decode(ids)

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
            pairs = [(context, continuation) for _, context, continuation in requests]
            out = []
            # Longest first, so a batch's rows share a length bucket.
            order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0] + pairs[i][1]))
            scores = {}
            for start in range(0, len(order), batch_size):
                chunk = order[start : start + batch_size]
                for i, score in zip(chunk, scorer([pairs[i] for i in chunk])):
                    scores[i] = score
            for i, (key, _, _) in enumerate(requests):
                out.append(scores[i])
                self.cache_hook.add_partial("loglikelihood", key, scores[i])
            return out

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
            out = []
            for request in requests:
                (text,) = request.args
                windows = [
                    utils.make_disjoint_window(w)
                    for w in utils.get_rolling_token_windows(
                        token_list=self.tok_encode(text),
                        prefix_token=self.prefix_token_id,
                        max_seq_len=self.max_length,
                        context_len=1,
                    )
                ]
                scored = self._loglikelihood_tokens([(None, c, t) for c, t in windows])
                total = sum(logp for logp, _ in scored)
                out.append(total)
                self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            return out

        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            out = []
            for request in requests:
                context, kwargs = request.args
                kwargs = dict(kwargs or {})
                until = kwargs.get("until") or []
                until = [until] if isinstance(until, str) else list(until)
                ids = self.tok_encode(context)
                new = kwargs.get("max_gen_toks", 256)
                ids = ids[-max(self.max_length - new, 1) :]
                new = min(new, self.max_length - len(ids))
                temperature = float(kwargs.get("temperature", 0.0) or 0.0)
                if not kwargs.get("do_sample", temperature > 0):
                    temperature = 0.0
                (completion,) = generator([ids], max_new_tokens=new, temperature=temperature,
                                          stop_ids=[eot], vocab=drawn)  # fmt: skip
                if completion and completion[-1] == eot:
                    completion = completion[:-1]
                text = self.tok_decode(completion)
                for stop in until:
                    if stop and stop in text:
                        text = text[: text.index(stop)]
                out.append(text)
                self.cache_hook.add_partial("generate_until", (context, kwargs), text)
            return out

    lm = DewLM()
    # What it runs on, for a caller to inspect: the programs each compiled (one per bucket).
    lm.generator, lm.scorer = generator, scorer
    return lm


def task_manager(tasks: Sequence[str]):
    """``(task names, lm_eval.tasks.TaskManager)`` for ``tasks``: a path to a task YAML file
    (read with its folder as an ``include_path``: its ``task:`` name) or an lm-eval task name.
    With only task files, lm-eval's own tasks are not indexed and the datasets library is told to
    stay offline (``HF_DATASETS_OFFLINE``) before lm-eval imports it."""
    import yaml

    lm_eval_module()

    names, include = [], []
    local = all(Path(task).suffix in (".yaml", ".yml") for task in tasks)
    if local:
        # Local tasks only: the datasets library never reaches the network (read at its import).
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for task in tasks:
        path = Path(task)
        if path.suffix in (".yaml", ".yml"):
            if not path.is_file():
                raise FileNotFoundError(f"task file {task} does not exist")
            config = yaml.safe_load(path.read_text()) or {}
            if "task" not in config:
                raise ValueError(f"task file {task} names no task (its 'task:' field)")
            names.append(config["task"])
            include.append(str(path.resolve().parent))
        else:
            names.append(task)
    from lm_eval.tasks import TaskManager

    # lm-eval's own tasks (thousands of files, seconds to index) only where one is named.
    return names, TaskManager(include_path=sorted(set(include)) or None, include_defaults=not local)


def evaluate(
    model,
    params,
    tasks: Sequence[str],
    *,
    tokenizer,
    adapters=None,
    mesh=None,
    layout=None,
    batch_size: int = 8,
    limit: int | None = None,
    num_fewshot: int | None = None,
    eot_id: int | None = None,
    log_samples: bool = False,
) -> dict:
    """lm-eval's ``simple_evaluate`` of ``tasks`` (task YAML files or lm-eval task names) on
    ``model`` with ``params`` (``adapters`` for a LoRA model), on ``mesh``: its results dict
    (``results[task][metric]``; with ``log_samples``, ``samples[task]`` too). Local tasks read
    their data from local files; with only those, nothing is downloaded (``task_manager``).
    ``MissingExtra`` without lm-eval."""
    lm_eval = lm_eval_module()
    if not hasattr(tokenizer, "encode") or isinstance(tokenizer, str):
        tokenizer = tokenizer_of(tokenizer)
    names, manager = task_manager(tasks)
    generator = Generator(model, params, adapters, mesh=mesh, layout=layout)
    return lm_eval.simple_evaluate(
        model=dew_lm(generator, tokenizer, batch_size, eot_id),
        tasks=names,
        task_manager=manager,
        limit=limit,
        num_fewshot=num_fewshot,
        log_samples=log_samples,
        bootstrap_iters=0,
    )


class Tasks:
    """lm-eval tasks run during training: an evaluation of ``Trainer.fit`` (``fit(...,
    eval_every=N, evaluations=[Tasks(...)])``, ``dew train --eval-tasks``), scored as
    ``evaluate`` scores them, on the weights validation uses, at every evaluation step.

        tasks = Tasks(["tasks/my_task.yaml"], "tokenizer.json", limit=100)
        state = trainer.fit(data, steps=1000, eval_every=200, evaluations=[tasks])
        # each evaluation step's metrics line gains eval/my_task/acc, ...

    Args:
      tasks: task YAML files (their folders searched for what they include; with only these,
        nothing is downloaded) or lm-eval task names (``task_manager``).
      tokenizer: the run's tokenizer: a ``dew.data`` tokenizer, ``"bytes"`` or a tokenizer.json
        (``dew.generation.tokenizer_of``); its ids must lie in the model's vocabulary.
      limit: at most this many documents a task (default: all).
      num_fewshot: few-shot examples a prompt (default: the task's).
      batch_size: rows a forward when scoring (default 8; padded to the devices the rows split
        over).
      eot_id: the end-of-text id, lm-eval's prefix of an empty context and the default stop of a
        generation (default: the tokenizer's ``eos_id``).

    Each call runs ``lm_eval.simple_evaluate`` on every process of the run (the forwards are
    collectives; each process gets the whole results) and returns ``metrics_of`` its results:
    ``{"eval/TASK/METRIC": value}``. It runs the model on the trainer's own mesh and layout: the
    ``dew.generation.Generator`` it builds at the first call holds the compiled programs (one per
    row count and length bucket, reused at every later call: the weights are their argument)
    and, from each call on, the arrays it was given, the trainer's state itself, not a copy
    (``Generator.set_weights`` keeps an array already laid out as it is; the next training step
    takes those buffers back). What evaluation adds on the devices is its activations: a
    forward's logits, ``batch_size`` rows by the length bucket by the vocabulary, in float32,
    and a generation's KV cache.

    lm-eval seeds Python's, numpy's and torch's global generators at each call (its defaults, so
    few-shot examples are drawn as ``dew eval`` draws them); Dew's training draws from none.

    Raises:
      dew.targets.MissingExtra: lm-eval is not installed.
      FileNotFoundError: a task file, or the data a task names, does not exist (the tasks are
        loaded here once, their data read or downloaded, so that one that cannot load fails
        before training).
      ValueError: no tasks, a count out of range, a task name lm-eval does not know, or no
        end-of-text id (naming ``eot_id``).
    """

    def __init__(
        self,
        tasks: Sequence[str],
        tokenizer,
        *,
        limit: int | None = None,
        num_fewshot: int | None = None,
        batch_size: int = 8,
        eot_id: int | None = None,
    ):
        self.lm_eval = lm_eval_module("lm-eval tasks during training")
        tasks = [str(t) for t in tasks]
        if not tasks:
            raise ValueError("Tasks needs at least one task (a task YAML file or an lm-eval name)")
        for name, value, least in (
            ("limit", limit, 1),
            ("num_fewshot", num_fewshot, 0),
            ("batch_size", batch_size, 1),
        ):
            if value is not None and not (isinstance(value, int) and value >= least):
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        if isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = tokenizer_of(tokenizer)
        eot = tokenizer.eos_id if eot_id is None else eot_id
        if eot is None:
            raise ValueError(
                "lm-eval tasks need an end-of-text id (the prefix of an empty context, the stop "
                "of a generation): the tokenizer has none; give eot_id=ID"
            )
        self.tasks, self.tokenizer, self.eot_id = tasks, tokenizer, int(eot)
        self.limit, self.num_fewshot, self.batch_size = limit, num_fewshot, batch_size
        # The task names and their index, built once: lm-eval's own tasks take seconds to index.
        self.names, self.manager = task_manager(tasks)
        # Loaded once now (their data read, or downloaded into the datasets cache), so that a
        # task that cannot load fails before training starts, not at the first evaluation step.
        try:
            self.manager.load(self.names)
        except KeyError as error:  # lm-eval's word for a name it does not know
            raise ValueError(f"lm-eval tasks {tasks}: {error.args[0]}") from None
        self._generator: Generator | None = None
        self._lm = None
        self._built_for = None

    def check(self, model, mesh, layout) -> None:
        """``ValueError`` for a run these tasks cannot evaluate, before anything compiles (fit
        calls it): a mixture of experts (no cached forward for generation), a mesh axis other
        than ``data``, ``fsdp`` and ``tensor`` above 1, or a tokenizer whose ids (or the
        end-of-text id) pass the model's vocabulary."""
        from dew.generation import AXES_RUN
        from dew.models import decode

        decode.check_model(model)
        others = {a: n for a, n in dict(mesh.shape).items() if n > 1 and a not in AXES_RUN}
        if others:
            raise ValueError(
                "lm-eval tasks run on the data, fsdp and tensor axes; the mesh has "
                + ", ".join(f"{a} {n}" for a, n in others.items())
            )
        vocab = model.vocab_size
        if self.tokenizer.vocab_size > vocab or not 0 <= self.eot_id < vocab:
            raise ValueError(
                f"the tokenizer's {self.tokenizer.vocab_size} ids (end-of-text {self.eot_id}) "
                f"pass the model's vocabulary of {vocab}: evaluate with the run's own tokenizer"
            )

    def __call__(self, model, params, adapters, mesh, layout, step: int) -> dict[str, float]:
        """``{"eval/TASK/METRIC": value}`` of the tasks on ``model`` with ``params`` (a LoRA
        model's frozen base, with its ``adapters``; else ``adapters`` is ``None``), laid out by
        ``layout`` on ``mesh`` (a built ``jax.sharding.Mesh``), after training step ``step``."""
        built_for = (model, mesh, layout)
        if self._built_for != built_for:  # a first call, or another trainer's
            self._generator = Generator(model, params, adapters, mesh=mesh, layout=layout)
            self._lm = dew_lm(self._generator, self.tokenizer, self.batch_size, self.eot_id)
            self._built_for = built_for
        else:
            self._generator.set_weights(params, adapters)
        results = self.lm_eval.simple_evaluate(
            model=self._lm,
            tasks=self.names,
            task_manager=self.manager,
            limit=self.limit,
            num_fewshot=self.num_fewshot,
            bootstrap_iters=0,
        )
        return metrics_of(results)

    def describe(self) -> dict:
        """What a run records of these tasks: ``{"tasks", "names", "limit", "num_fewshot",
        "eot_id"}``, a task file by its absolute path."""
        return {
            "tasks": [
                str(Path(t).resolve()) if Path(t).suffix in (".yaml", ".yml") else t
                for t in self.tasks
            ],
            "names": self.names,
            "limit": self.limit,
            "num_fewshot": self.num_fewshot,
            "eot_id": self.eot_id,
        }


def metrics_of(results: dict) -> dict:
    """``{"eval/TASK/METRIC": value}`` of the numeric results (lm-eval's ``"acc,none"`` keys read
    as ``acc``; a filter other than ``none`` kept after a ``/``)."""
    out = {}
    for task, values in results.get("results", {}).items():
        for key, value in values.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or "," not in key:
                continue
            metric, _, filtered = key.partition(",")
            name = metric if filtered in ("none", "") else f"{metric}/{filtered}"
            out[f"eval/{task}/{name}"] = float(value)
    return out
