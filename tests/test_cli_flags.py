"""The ``dew`` command's flags mean one thing everywhere: a repeated flag adds up where it takes
several values and is refused where it takes one, a repeated axis in one mesh is refused, one
``min_shard`` default from Python and every command, a preset keeps its own context, and every
command that builds a model says what it runs in its first line.

Parsing only (no compile), except the header checks, which run ``dew collectives`` on a tiny
model."""

import re

import pytest

import dew
from dew.cli.main import build_parser
from dew.cli.model_flags import model_config, model_variants, sizes_text
from dew.layout import DEFAULT_MIN_SHARD
from dew.mesh import MeshSpec

# Each command that builds a model, with what it needs besides the flags under test.
COMMANDS = {
    "train": [],
    "collectives": [],
    "bench": [],
    "plan": ["--target", "v5e-8"],
}


def parse(command, *flags):
    return build_parser().parse_args([command, *COMMANDS[command], *flags])


@pytest.mark.parametrize("command", ["train", "collectives"])
def test_a_second_mesh_where_one_layout_runs_exits_2_naming_both(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(command, "--mesh", "fsdp=8", "--mesh", "tensor=2")
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--mesh given twice (fsdp=8 and tensor=2); it takes one value" in err
    assert "fsdp=8,tensor=2" in err  # what to write instead


@pytest.mark.parametrize("command", ["bench", "plan"])
def test_a_second_mesh_where_layouts_are_compared_adds_up(command):
    args = parse(command, "--mesh", "fsdp=8", "--mesh", "tensor=2", "data=2,fsdp=4")
    assert args.mesh == ["fsdp=8", "tensor=2", "data=2,fsdp=4"]
    assert parse(command, "--mesh", "fsdp=8").mesh == ["fsdp=8"]  # one given: only it


def test_repeats_of_other_flags_add_up_or_are_refused(capsys):
    assert parse(
        "plan", "--mesh", "fsdp=8", "--engines", "shard_map", "--engines", "gspmd"
    ).engines == [
        "shard_map",
        "gspmd",
    ]
    assert parse("plan", "--mesh", "fsdp=8", "--remat", "full", "--remat", "dots").remat == [
        "full",
        "dots",
    ]
    for command in COMMANDS:
        with pytest.raises(SystemExit) as exit_:
            parse(command, "--batch", "8", "--batch", "16")
        assert exit_.value.code == 2, command
        assert "--batch given twice (8 and 16); it takes one value" in capsys.readouterr().err


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_repeated_axis_in_one_mesh_is_refused(command, tmp_path, dew_here):
    with pytest.raises(ValueError, match=r"mesh 'fsdp=4,fsdp=2' gives fsdp twice"):
        MeshSpec.parse("fsdp=4,fsdp=2")
    # Through the command (`main`, in this process): exit 2, the message on stderr.
    flags = [*COMMANDS[command], "--mesh", "fsdp=4,fsdp=2"]
    done = dew_here(
        command, *flags, *([] if command == "plan" else ["--cpu-devices", "8"]), cwd=tmp_path
    )
    assert done.returncode == 2, done.stderr
    assert "gives fsdp twice (fsdp=4 and fsdp=2)" in done.stderr


def test_one_min_shard_default_from_python_and_every_command():
    assert dew.Layout().min_shard == DEFAULT_MIN_SHARD == 4096
    for command in COMMANDS:
        assert parse(command).min_shard == dew.Layout().min_shard, command


def test_a_preset_keeps_its_context_and_refuses_rows_longer_than_it():
    for command in COMMANDS:
        config = model_config(parse(command, "--model", "llama-3.2-1b", "--seq-len", "64"))
        assert config["max_seq_len"] == 8192, command  # Llama 3's pretraining context
        config = model_config(parse(command, "--model", "gpt2-small"))
        assert config["max_seq_len"] == 1024, command
    with pytest.raises(ValueError, match="--seq-len 2048 is above gpt2-small's context of 1024"):
        model_config(parse("train", "--model", "gpt2-small", "--seq-len", "2048"))
    # The example decoder has no context of its own: it is the rows' length.
    assert model_config(parse("train", "--seq-len", "48"))["max_seq_len"] == 48


def test_precision_recompute_and_attention_reach_the_model_on_every_command():
    flags = ["--dtype", "bfloat16", "--param-dtype", "bfloat16", "--remat", "dots"]
    flags += ["--attention", "pallas", "--layer-loop", "unroll"]
    for command in COMMANDS:
        # bench's --dtype, --remat and --attention take several values (plan's --remat): each a
        # variant of the model, here one.
        config, (variant,) = model_variants(parse(command, *flags))
        model = dew.models.build("causal_transformer", **{**config, **variant})
        got = (model.dtype, model.param_dtype, model.remat, model.attention_impl)
        assert got == ("bfloat16", "bfloat16", "dots", "pallas"), command
        assert model.layer_loop == "unroll", command
        preset = model_config(parse(command, "--model", "gpt2-small", "--layer-loop", "scan"))
        assert preset["layer_loop"] == "scan", command
    # Not given: the model's own.
    example = dew.models.build("causal_transformer", **model_config(parse("train")))
    assert (example.dtype, example.attention_impl, example.layer_loop) == ("float32", "xla", "scan")
    assert model_config(parse("train", "--model", "gpt2-small"))["layer_loop"] == "unroll"


def test_the_header_names_every_size_and_choice():
    args = parse("train", "--model", "llama-3.2-1b", "--layers", "2", "--seq-len", "64")
    config = model_config(args)
    text = sizes_text(config, args)
    model = dew.models.build("causal_transformer", **config)
    # Read back part by part (whole parts, not substrings: "2" is inside "2048").
    name, sizes = text.split(": ", 1)
    assert name == "llama-3.2-1b"
    assert re.split(r"[;,] ", sizes) == [
        f"{model.num_layers} layers",
        f"width {model.emb_features}",
        f"{model.num_heads} heads ({model.num_kv_heads} kv)",
        f"vocab {model.vocab_size}",
        f"context {model.max_seq_len}",
        f"{model.dtype} activations",
        f"{model.param_dtype} weights",
        f"remat {model.remat}",
        f"attention {model.attention_impl}",
        "batch 16 x 64 tokens",
    ]
    assert (model.num_layers, model.num_kv_heads, model.max_seq_len) == (2, 8, 8192)


def test_help_shows_every_default_of_attention_and_accumulation(capsys):
    for command in COMMANDS:
        with pytest.raises(SystemExit):
            build_parser().parse_args([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        if command != "bench":  # bench times one step of the whole batch
            assert "--accumulation K microbatches per step" in text, command
            assert "before one update (default 1)" in text, command
        assert "--attention {" in text and "(default: the model's own" in text, command


def test_collectives_spells_engines_as_bench_and_plan_do():
    for command in COMMANDS:
        if command == "train":
            continue
        args = parse(command, "--engines", "shard_map", "gspmd")
        assert args.engines == ["shard_map", "gspmd"], command


def test_bench_takes_several_model_choices_and_builds_each():
    from dew.benchmark import ModelSize

    args = parse("bench", "--remat", "full", "dots", "--attention", "xla", "--dtype", "bfloat16")
    config, variants = model_variants(args)
    assert variants == [
        {"remat": "full", "attention_impl": "xla", "dtype": "bfloat16"},
        {"remat": "dots", "attention_impl": "xla", "dtype": "bfloat16"},
    ]
    assert "remat" not in config and "attention_impl" not in config  # left to each variant
    size = ModelSize.of(config, batch=args.batch, seq_len=args.seq_len)
    for variant in variants:
        model = size.objective(**variant).model
        assert (model.remat, model.attention_impl, model.dtype) == (
            variant["remat"],
            "xla",
            "bfloat16",
        )
    # Given once each, a choice is the model's, and there is one variant: the model.
    config, variants = model_variants(parse("bench", "--param-dtype", "bfloat16"))
    assert variants == [{}] and config["param_dtype"] == "bfloat16"


def test_several_policies_replace_a_preset_s_own():
    # llama-3.2-1b's own remat is "dots": plan --remat full dots plans both, each once.
    config, variants = model_variants(
        parse("plan", "--model", "llama-3.2-1b", "--remat", "full", "dots")
    )
    assert "remat" not in config and variants == [{"remat": "full"}, {"remat": "dots"}]
    models = [dew.models.build("causal_transformer", **config, **v) for v in variants]
    assert [m.remat for m in models] == ["full", "dots"]


def test_the_fsdp_scheme_reaches_the_step_options_of_train_collectives_and_plan():
    from dew.cli.flags import step_options

    for command in ("train", "collectives", "plan"):
        assert step_options(parse(command)).fsdp_scheme == "auto", command
        assert step_options(parse(command, "--fsdp-scheme", "ring")).fsdp_scheme == "ring"


def test_the_tensor_scheme_reaches_the_step_options_of_train_collectives_and_plan():
    from dew.cli.flags import step_options
    from dew.cli.plan import option_variants

    for command in ("train", "collectives", "plan"):
        assert step_options(parse(command)).tensor_scheme == "auto", command
        assert step_options(parse(command, "--tensor-scheme", "ring")).tensor_scheme == "ring"
    args = parse("plan", "--engines", "shard_map", "gspmd", "--tensor-scheme", "plain", "ring")
    chosen = [(o.tensor_scheme, engines) for o, engines in option_variants(args)]
    assert chosen == [("plain", ["shard_map", "gspmd"]), ("ring", ["shard_map"])]


def test_the_gradient_sum_dtype_reaches_the_step_options_of_train_collectives_and_plan():
    from dew.cli.flags import step_options

    for command in ("train", "collectives", "plan"):
        assert step_options(parse(command)).gradient_sum_dtype is None, command
        chosen = step_options(parse(command, "--gradient-sum-dtype", "bfloat16"))
        assert chosen.gradient_sum_dtype == "bfloat16", command


def test_plan_runs_each_fsdp_scheme_and_sum_dtype_given_and_gspmd_once():
    from dew.cli.plan import option_variants

    args = parse(
        "plan",
        *("--engines", "shard_map", "gspmd"),
        *("--fsdp-scheme", "gather", "ring"),
        *("--gradient-sum-dtype", "float32", "bfloat16"),
    )
    chosen = [
        (o.fsdp_scheme, o.gradient_sum_dtype, engines) for o, engines in option_variants(args)
    ]
    assert chosen == [
        ("gather", "float32", ["shard_map", "gspmd"]),
        ("gather", "bfloat16", ["shard_map"]),
        ("ring", "float32", ["shard_map"]),
        ("ring", "bfloat16", ["shard_map"]),
    ]
    # GSPMD alone: one row a layout, whatever the options.
    alone = parse("plan", "--engines", "gspmd", "--fsdp-scheme", "gather", "ring")
    assert [engines for _, engines in option_variants(alone)] == [["gspmd"]]
    # By default one step: the scheme chosen for the target ("auto"), each weight's dtype.
    ((options, engines),) = option_variants(parse("plan"))
    assert (options.fsdp_scheme, options.gradient_sum_dtype, engines) == (
        "auto",
        None,
        ["shard_map"],
    )
