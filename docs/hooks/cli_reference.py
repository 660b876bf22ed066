"""The CLI reference, written from ``dew``'s own argparse parsers when the site is built.

``docs/reference/cli.md`` holds a marker line; ``on_page_markdown`` (an MkDocs hook, mkdocs.yml)
puts every command's usage and flags, by argparse group, in its place. The page therefore says what
``dew COMMAND --help`` says on the commit it is built from, and cannot go stale.
"""

from __future__ import annotations

import argparse

MARKER = "<!-- dew-cli-reference -->"


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _help_lines(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each subcommand's one-line help, as ``dew --help`` lists it."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {choice.dest: choice.help or "" for choice in action._choices_actions}
    return {}


def _flag_row(action: argparse.Action) -> str:
    names = ", ".join(f"`{name}`" for name in action.option_strings) or f"`{action.dest}`"
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        value = " \\| ".join(f"`{choice}`" for choice in action.choices)
    elif action.nargs == 0:
        value = ""
    else:
        value = f"`{action.metavar or action.dest.upper()}`"
    if action.nargs in ("+", "*"):
        value += " ..."
    text = (action.help or "").replace("|", "\\|").replace("\n", " ")
    text = text.replace("%(default)s", str(action.default)).replace("%%", "%")
    return f"| {names} | {value} | {text} |"


def command_markdown(name: str, parser: argparse.ArgumentParser, summary: str) -> str:
    """One command's section (``name``: ``dew train``): its summary, usage and a table of flags
    for each group."""
    lines = [f"## `{name}`", ""]
    if summary:
        lines += [summary[0].upper() + summary[1:] + ".", ""]
    if parser.description and parser.description != summary:
        lines += [parser.description, ""]
    usage = parser.format_usage().removeprefix("usage: ").strip()
    lines += ["```", usage, "```", ""]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.help is not argparse.SUPPRESS]
        actions = [a for a in actions if a.option_strings != ["-h", "--help"]]
        if not actions:
            continue
        lines += [f"### {group.title[0].upper() + group.title[1:]}", ""]
        if group.description:
            lines += [group.description, ""]
        lines += ["| flag | value | what it does |", "| --- | --- | --- |"]
        lines += [_flag_row(action) for action in actions]
        lines.append("")
    return "\n".join(lines)


def cli_markdown() -> str:
    """Every ``dew`` subcommand's section, in the order ``dew --help`` lists them, then every
    ``dew-tpu`` subcommand's."""
    from dew.cli.main import build_parser
    from dew.cli.tpu.cli import build_parser as build_tpu_parser

    sections = []
    for program, parser in (("dew", build_parser()), ("dew-tpu", build_tpu_parser())):
        summaries = _help_lines(parser)
        sections += [
            command_markdown(f"{program} {name}", sub, summaries.get(name, ""))
            for name, sub in _subcommands(parser).items()
        ]
    return "\n".join(sections)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, cli_markdown())
