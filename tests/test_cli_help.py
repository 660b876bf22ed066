"""``dew --help`` and every ``dew COMMAND --help`` answer without importing JAX, and the JAX-free
copies their parsers offer (``dew.cli.choices``) equal the lists they copy."""

import json
import subprocess
import sys

from dew.cli import choices
from dew.cli.main import build_parser
from tests.helpers import child_env

# In a fresh interpreter: every command's help (and the top level's), then which JAX modules got
# imported. One process for all commands, to keep it fast.
HELP_SCRIPT = """
import contextlib, io, json, sys
from dew.cli.main import build_parser, main

commands = [None, *build_parser()._subparsers._group_actions[0].choices]
helps = {}
for command in commands:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main(([command] if command else []) + ["--help"])
        except SystemExit as exit:
            assert exit.code == 0, (command, exit.code)
        else:
            raise AssertionError(f"{command} --help did not exit")
    helps[command or "dew"] = out.getvalue()
jax_modules = sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib"))
print(json.dumps({"helps": helps, "jax_modules": jax_modules}))
"""


def subcommands() -> dict:
    """``{name: parser}`` of the ``dew`` command's subcommands."""
    return dict(build_parser()._subparsers._group_actions[0].choices)


def test_every_commands_help_imports_no_jax():
    run = subprocess.run(
        [sys.executable, "-c", HELP_SCRIPT],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    answer = json.loads(run.stdout.splitlines()[-1])
    helps = answer["helps"]
    assert set(helps) == {"dew", *subcommands()}
    # The commands the issue names, so that a parser not added to build_parser fails here.
    assert {"train", "plan", "bench", "tokenize", "convert", "plot"} <= set(helps)
    for command, text in helps.items():
        prog = "dew" if command == "dew" else f"dew {command}"
        assert text.startswith(f"usage: {prog} "), (command, text[:80])
        assert "--help" in text, command
    assert answer["jax_modules"] == [], answer["jax_modules"]


def real_choices() -> dict:
    """``{argparse dest: the choices its one definition allows}`` (importing JAX is fine here)."""
    from dew.models.causal_transformer import DTYPES, REMAT_AUTO, REMAT_CHOICES
    from dew.models.lora import BASE_DTYPES
    from dew.models.presets import PRESETS
    from dew.nn.attention import CHOICES
    from dew.parallel.options import FSDP_SCHEMES, GRADIENT_SUM_DTYPES, TENSOR_SCHEMES
    from dew.parallel.pipeline import SCHEDULES
    from dew.parallel.sequence import SCHEMES
    from dew.training.step import ENGINES

    return {
        "attention": tuple(CHOICES),
        "model": tuple(PRESETS),
        "remat": (*REMAT_CHOICES, REMAT_AUTO),
        "dtype": tuple(DTYPES),
        "param_dtype": tuple(DTYPES),
        "engines": tuple(ENGINES),
        "sequence_scheme": tuple(SCHEMES),
        "pipeline_schedule": tuple(SCHEDULES),
        "fsdp_scheme": tuple(FSDP_SCHEMES),
        "gradient_sum_dtype": tuple(GRADIENT_SUM_DTYPES),
        "base_dtype": tuple(BASE_DTYPES),
        "tensor_scheme": tuple(TENSOR_SCHEMES),
    }


def test_the_parsers_choices_are_the_real_ones():
    expected = real_choices()
    seen = set()
    for name, parser in subcommands().items():
        for action in parser._actions:
            if action.dest in expected:
                assert tuple(action.choices) == expected[action.dest], (name, action.dest)
                seen.add(action.dest)
    assert seen == set(expected)


def test_the_parsers_defaults_are_the_real_ones():
    from dew.benchmark import ModelSize
    from dew.cli.choices import LORA_TARGETS
    from dew.layout import DEFAULT_MIN_SHARD
    from dew.models.lora import DEFAULT_TARGETS

    assert LORA_TARGETS == DEFAULT_TARGETS
    parsers = subcommands()
    for name in ("train", "collectives", "bench", "plan"):
        assert parsers[name].get_default("min_shard") == DEFAULT_MIN_SHARD, name
    size = ModelSize()
    bench = parsers["bench"]
    assert (bench.get_default("batch"), bench.get_default("seq_len")) == (
        size.batch,
        size.seq_len,
    )
    assert bench.get_default("example_model") == dict(
        vocab_size=size.vocab,
        num_layers=size.layers,
        emb_features=size.width,
        num_heads=size.heads,
    )


def test_every_copy_equals_its_original():
    """``dew.cli.choices`` constant by constant, including those no parser test above reads."""
    from dew.benchmark import ModelSize
    from dew.layout import DEFAULT_MIN_SHARD
    from dew.models.causal_transformer import LAYER_LOOPS, REMAT_AUTO, REMAT_CHOICES

    expected = real_choices()
    size = ModelSize()
    assert choices.ENGINES == expected["engines"]
    assert choices.SEQUENCE_SCHEMES == expected["sequence_scheme"]
    assert choices.PIPELINE_SCHEDULES == expected["pipeline_schedule"]
    assert choices.FSDP_SCHEMES == expected["fsdp_scheme"]
    assert choices.GRADIENT_SUM_DTYPES == expected["gradient_sum_dtype"]
    assert choices.TENSOR_SCHEMES == expected["tensor_scheme"]
    from dew.parallel.options import QUANTIZE

    assert choices.QUANTIZE == QUANTIZE
    assert choices.DEFAULT_MIN_SHARD == DEFAULT_MIN_SHARD
    assert choices.DTYPES == expected["dtype"]
    assert (choices.REMAT_CHOICES, choices.REMAT_AUTO) == (REMAT_CHOICES, REMAT_AUTO)
    assert choices.LAYER_LOOPS == LAYER_LOOPS
    assert choices.ATTENTION_CHOICES == expected["attention"]
    assert choices.PRESET_NAMES == expected["model"]
    assert choices.BENCH_SIZES == {name: getattr(size, name) for name in choices.BENCH_SIZES}
    assert set(choices.BENCH_SIZES) == {"batch", "seq_len", "layers", "width", "heads"}


def help_sections(text: str) -> dict[str, str]:
    """``{heading: the text under it}`` of an argparse help text (a heading is an unindented line
    ending with a colon: "options:", "LoRA:")."""
    sections, heading = {}, None
    for line in text.splitlines():
        if line and not line[0].isspace() and line.endswith(":"):
            heading = line[:-1]
            sections[heading] = ""
        elif heading is not None:
            sections[heading] += line + "\n"
    return sections


def flags_under(section: str) -> set[str]:
    """The flags an argparse help section lists (the first word of each entry)."""
    return {line.split()[0].rstrip(",") for line in section.splitlines() if line[2:3] == "-"}


def test_train_help_is_by_topic():
    sections = help_sections(subcommands()["train"].format_help())
    assert list(sections)[1:] == [  # after "options:" (with -h alone)
        "devices and mesh",
        "model and --init-from",
        "LoRA",
        "data",
        "precision and memory",
        "optimizer and schedule",
        "checkpoints and resume",
        "logging and evaluation",
    ], list(sections)
    assert flags_under(sections["options"]) == {"-h"}
    lora = {"--lora-rank", "--lora-alpha", "--lora-targets", "--lora-dropout", "--base-dtype"}
    assert flags_under(sections["LoRA"]) == lora
    model = flags_under(sections["model and --init-from"])
    assert {"--init-from", "--extend-context", "--model", "--layers", "--seed"} <= model
    assert {"--mesh", "--cpu-devices"} <= flags_under(sections["devices and mesh"])
    assert {"--data", "--batch", "--seq-len"} <= flags_under(sections["data"])
    assert {"--lr", "--steps"} <= flags_under(sections["optimizer and schedule"])
    assert {"--run-dir", "--checkpoint-every"} <= flags_under(sections["checkpoints and resume"])
    assert {"--eval-every", "--metrics"} <= flags_under(sections["logging and evaluation"])


def test_every_flag_has_a_topic():
    """In ``train``, ``collectives``, ``bench``, ``plan`` and ``convert``, no flag is left under
    argparse's "options:" heading but ``-h``."""
    for name in ("train", "collectives", "bench", "plan", "convert"):
        parser = subcommands()[name]
        flags = {s for a in parser._actions for s in a.option_strings} - {"-h", "--help"}
        sections = help_sections(parser.format_help())
        assert flags_under(sections["options"]) == {"-h"}, name
        shown = set().union(*(flags_under(text) for text in sections.values()))
        assert flags <= shown, (name, flags - shown)


def test_dew_help_says_what_each_command_does():
    text = " ".join(build_parser().format_help().split())
    # dew train trains what its flags say, not "the example model" alone (issue 67).
    assert "train a --model preset, an --init-from model" in text, text
    assert "the example model" not in text, text


def test_param_dtype_help_says_where_the_moments_are_kept():
    """``--param-dtype``'s help once said the optimizer's moments follow it; they are kept in
    ``--moments-dtype`` (float32 by default) whatever the weights' dtype."""
    import jax.numpy as jnp

    from dew.training.optimizer import adamw

    train = subcommands()["train"]
    (action,) = [a for a in train._actions if a.dest == "param_dtype"]
    assert "--moments-dtype" in action.help and "follow" not in action.help, action.help
    moments = train.get_default("moments_dtype")
    state = adamw(1e-3, moments_dtype=moments).init({"w": jnp.zeros((3, 5), jnp.bfloat16)})
    assert state.mu["w"].dtype == jnp.float32, (moments, state.mu["w"].dtype)
