"""The docs site's reference pages cover what Dew exports and every flag of every command.

The CLI reference is written from the parsers when the site is built (docs/hooks/cli_reference.py);
the Python reference lists its objects by hand (``::: module.Name`` in docs/reference/*.md), so a
name exported without a page entry fails here, as does a flag the generated page leaves out."""

import argparse
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "docs" / "reference"


def _hook():
    spec = importlib.util.spec_from_file_location(
        "cli_reference", ROOT / "docs" / "hooks" / "cli_reference.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _documented() -> set[str]:
    """The last part of every ``::: a.b.Name`` directive of the reference pages."""
    names = set()
    for page in REFERENCE.glob("*.md"):
        names |= set(re.findall(r"^::: [\w.]*?(\w+)$", page.read_text(), flags=re.M))
    return names


def _public_names() -> dict[str, list[str]]:
    import dew
    import dew.checkpoints
    import dew.data

    kernels = ROOT / "kernels" / "__init__.py"
    kernel_names = re.search(r"__all__ = \[(.*?)\]", kernels.read_text(), flags=re.S).group(1)
    return {
        "dew": dew.__all__,
        "dew.data": dew.data.__all__,
        "dew.checkpoints": [n for n in dew.checkpoints.__all__ if n not in ("FORMAT", "VERSION")],
        "dew.kernels": re.findall(r'"(\w+)"', kernel_names),
    }


@pytest.mark.parametrize("package", ["dew", "dew.data", "dew.checkpoints", "dew.kernels"])
def test_every_exported_name_has_a_reference_entry(package):
    documented = _documented()
    # The package `dew.models` is documented by its `build`; `dew.collectives` by its function.
    aliases = {"models": "build"}
    missing = [
        name for name in _public_names()[package] if aliases.get(name, name) not in documented
    ]
    assert not missing, f"{package} exports {missing} with no ::: entry in docs/reference/"


@pytest.mark.parametrize("program", ["dew", "dew-tpu"])
def test_the_cli_reference_holds_every_command_and_flag(program):
    from dew.cli.main import build_parser
    from dew.cli.tpu.cli import build_parser as build_tpu_parser

    text = _hook().cli_markdown()
    parser = {"dew": build_parser, "dew-tpu": build_tpu_parser}[program]()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert len(commands.choices) >= 4
    for name, sub in commands.choices.items():
        section = text.split(f"## `{program} {name}`\n", 1)
        assert len(section) == 2, f"no section for {program} {name}"
        body = section[1].split("\n## `", 1)[0]
        for action in sub._actions:
            for flag in action.option_strings:
                if flag in ("-h", "--help"):
                    continue
                assert f"`{flag}`" in body, f"{program} {name} {flag} is not in its section"
