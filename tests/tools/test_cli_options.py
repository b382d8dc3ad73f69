"""The options several commands share are declared once (tools/commands/options.py,
tools/engines.py): each shared flag exists in every command that takes it with the same default,
type and choices; every command's --help keeps its examples; the libraries under tools/ never
import the command line (tools/commands/)."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest

from arborspec.tools.commands.cli import COMMANDS, build_parser

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def parsers() -> dict[str, argparse.ArgumentParser]:
    p = build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _flag(parser: argparse.ArgumentParser, flag: str) -> argparse.Action:
    found = [a for a in parser._actions if flag in a.option_strings]
    assert found, f"{parser.prog} has no {flag}"
    return found[0]


def _same(parsers, commands: list[str], flags: list[str], help_too: bool = True) -> None:
    """Each flag is in every command, with one dest, default, type, choices (and help)."""
    for flag in flags:
        seen = {
            name: repr((a.dest, a.default, a.type, a.choices, a.required, a.help if help_too else None))
            for name in commands
            for a in [_flag(parsers[name], flag)]
        }
        assert len(set(seen.values())) == 1, (flag, seen)


# (commands, flags, whether the help text is the same too): the groups declared once
SHARED = [
    # add_model_args (tools/engines.py)
    (
        ["generate", "chat", "bench", "tune"],
        ["--model", "--export-dir", "--engine-dir", "--backend", "--device", "--cuda-graphs", "--dtype", "--verify"],
        True,
    ),
    # add_sampling_args (generate, chat; --seed's help says what it seeds)
    (
        ["generate", "chat"],
        ["--temperature", "--top-k", "--top-p", "--min-p", "--repetition-penalty", "--presence-penalty"]
        + ["--frequency-penalty", "--logit-bias", "--min-tokens", "--ignore-eos"],
        True,
    ),
    (["generate", "chat"], ["--seed"], False),
    # add_format_args: structured output
    (["generate", "chat", "bench"], ["--json-object", "--json-schema", "--grammar"], True),
    # greedy unless told: every command that decodes or sends a temperature
    (["generate", "chat", "bench", "tune", "loadtest"], ["--temperature"], False),
    (["generate", "chat", "bench", "tune"], ["--top-k", "--top-p"], False),
    (["chat", "serve"], ["--prefix-cache"], False),
    (["build", "compare", "serve"], ["--export-dir"], False),
    (["bench", "compare"], ["--quiet", "--no-progress"], True),
    (["bench", "loadtest"], ["--json-out"], True),
    (["bench", "loadtest"], ["--json"], False),
]


@pytest.mark.parametrize("commands,flags,help_too", SHARED, ids=[f"{'+'.join(c)}:{f[0]}" for c, f, _ in SHARED])
def test_shared_flags_have_one_default_in_every_command(parsers, commands, flags, help_too):
    _same(parsers, commands, flags, help_too)


def test_the_shared_values_are_what_the_runtime_is_given(parsers):
    """The defaults a user gets: greedy, no top-k/top-p cut, prefix cache where exact, export dir required."""
    assert _flag(parsers["generate"], "--temperature").default == 0.0
    assert _flag(parsers["chat"], "--top-p").default == 1.0
    assert _flag(parsers["bench"], "--top-k").default == 0
    pc = _flag(parsers["serve"], "--prefix-cache")
    assert pc.default == "auto" and pc.choices == ["auto", "on", "off"]
    assert _flag(parsers["compare"], "--export-dir").required and _flag(parsers["build"], "--export-dir").type is Path
    quiet = _flag(parsers["bench"], "--quiet")
    assert quiet.dest == "no_progress" and _flag(parsers["bench"], "--no-progress").help == argparse.SUPPRESS
    assert parsers["loadtest"].parse_args(["--url", "u", "--json-out", "x.json"]).json_out == Path("x.json")


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_help_has_its_examples_and_description(parsers, name):
    p = parsers[name]
    assert p.formatter_class is argparse.RawDescriptionHelpFormatter
    assert p.epilog and p.epilog.startswith(("examples:", "example:")) and f"arborspec {name} --" in p.epilog
    assert p.description and "\n" not in p.description  # the docstring's first paragraph, as one line


def test_the_libraries_under_tools_do_not_import_the_command_line():
    """tools/engines.py, tools/serve/, tools/bench/ ...: no import of arborspec.tools.commands."""
    bad = []
    for path in sorted((ROOT / "tools").rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[1] == "commands":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            bad += [f"{rel}:{node.lineno} {n}" for n in names if n.startswith("arborspec.tools.commands")]
    assert not bad, bad
