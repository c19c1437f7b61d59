"""Every command and sub-command of ``mqdedup`` says what it does and shows an example in
its ``--help``, and every example parses."""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Iterator

import pytest

from mqdedup.cli.parser import build_parser


def _commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*path, name))


COMMANDS = list(_commands(build_parser()))


def test_the_walk_finds_the_commands_the_issue_named() -> None:
    paths = {path for path, _ in COMMANDS}
    assert {("worker",), ("relay",), ("status",), ("replay",), ("dedup", "purge")} <= paths
    assert len(paths) >= 20


@pytest.mark.parametrize(
    ("path", "parser"), COMMANDS, ids=[" ".join(p) or "mqdedup" for p, _ in COMMANDS]
)
def test_every_command_has_a_description_and_an_example(
    path: tuple[str, ...], parser: argparse.ArgumentParser
) -> None:
    text = parser.format_help()
    assert parser.description and len(parser.description) > 40, f"{path}: no description"
    assert parser.description.split()[0] in text
    assert "Example" in (parser.epilog or ""), f"{path}: no example"
    examples = [
        line.strip()
        for line in (parser.epilog or "").splitlines()
        if line.strip().startswith(("mqdedup ", "MQDEDUP_"))
    ]
    assert examples, f"{path}: the example shows no mqdedup command"
    assert all(line in text for line in examples)  # kept as written, not re-wrapped
    for example in examples:
        words = shlex.split(example)
        while "=" in words[0]:  # an environment variable before the command
            words.pop(0)
        assert words[0] == "mqdedup"
        if "--help" in words:
            continue
        args = build_parser().parse_args(words[1:])  # a usage error exits 2: the test fails
        assert args.run is not None
        assert tuple(w for w in words[1:] if not w.startswith("-"))[: len(path)] == path
