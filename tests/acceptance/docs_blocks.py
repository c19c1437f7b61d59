"""Shell blocks of the Markdown docs and their ``docs-test`` annotations.

Every fenced block whose info string is ``bash``, ``sh``, ``shell`` or ``console`` is a
command a reader may type. One or more HTML comments on the lines right before the
fence change how ``tests/acceptance/test_docs_commands.py`` runs it:

``<!-- docs-test: skip: <reason> -->``
    not run (only what cannot run here, e.g. ``docker compose up``); listed with its
    reason, and the test keeps an explicit allow-list of skipped blocks.
``<!-- docs-test: background -->``
    a daemon (one command): started, awaited until healthy and idle when the command
    has ``--health-port`` (``/healthz/ready``; then on ``/metrics`` a worker has worked
    and caught up: Kafka lag 0, every fetched delivery finished; a relay's outbox
    backlog is 0; no counter moving), else until it survived 5 s; then SIGTERM, exit 0.
    A worker's page must give it messages to work on.
``<!-- docs-test: exit N -->``
    the block must exit with status N (documenting an error).
``<!-- docs-test: equivalent: <command> -->``
    run this shorter documented equivalent instead; it must appear in the page's text
    near the block.
``<!-- docs-test: fresh-checkout -->``
    run in a copy of the checkout with its own ``.venv`` (install commands such as
    ``pip install -e .``, which must never touch the project's shared venv).

In ``console`` blocks, lines starting with ``$ `` are commands and the other lines
their expected output: each expected line must appear in the command's output
(whitespace-insensitive; ``...`` matches anything).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

SHELL_LANGUAGES = frozenset({"bash", "sh", "shell", "console"})
ANNOTATION = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<body>.*?)\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent>\s{0,3})(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*)$")
#: A block that installs into a virtualenv must run in the fresh checkout.
INSTALLS = re.compile(r"\bpip\d*(\.\d+)?\s+install\b|-m\s+venv\b|\bpip\s+uninstall\b")


def doc_files(repo: Path) -> list[Path]:
    """README.md, CONTRIBUTING.md, docs/**/*.md (the site's pages), examples/README.md,
    examples/*/README.md and the services script's page, in that order."""
    files = [repo / "README.md", repo / "CONTRIBUTING.md", *sorted((repo / "docs").rglob("*.md"))]
    files += [repo / "examples" / "README.md", *sorted((repo / "examples").glob("*/README.md"))]
    files.append(repo / "scripts" / "README-services.md")
    return [path for path in files if path.is_file()]


@dataclass(frozen=True)
class Directive:
    """One parsed ``docs-test`` annotation."""

    kind: str  # skip | background | exit | equivalent | fresh-checkout
    argument: str = ""


@dataclass
class Block:
    """One executable fenced block of a Markdown file."""

    path: Path
    relative: str
    line: int  # 1-based line of the opening fence
    language: str
    text: str
    directives: list[Directive] = field(default_factory=list)

    @property
    def ident(self) -> str:
        """``README.md:L28``: names the exact block in test ids and failures."""
        return f"{self.relative}:L{self.line}"

    def directive(self, kind: str) -> Directive | None:
        return next((d for d in self.directives if d.kind == kind), None)

    @property
    def first_line(self) -> str:
        """The first non-blank line (the allow-list key of a skipped block)."""
        return next((line.strip() for line in self.text.splitlines() if line.strip()), "")

    def console_steps(self) -> list[tuple[str, list[str]]]:
        """``console`` blocks: (command, expected output lines) in order."""
        steps: list[tuple[str, list[str]]] = []
        continuing = False
        for raw in self.text.splitlines():
            if continuing and steps:
                command, expected = steps[-1]
                steps[-1] = (command + "\n" + raw, expected)
                continuing = raw.endswith("\\")
            elif raw.startswith("$ "):
                steps.append((raw[2:], []))
                continuing = raw.endswith("\\")
            elif raw.strip() and steps:
                steps[-1][1].append(raw)
        return steps

    def script(self) -> str:
        """The shell text to run: the block, or its ``equivalent``."""
        equivalent = self.directive("equivalent")
        if equivalent:
            return equivalent.argument + "\n"
        if self.language == "console":
            return "\n".join(command for command, _ in self.console_steps()) + "\n"
        return self.text


def python_blocks(path: Path, repo: Path) -> list[tuple[str, str]]:
    """``(ident, code)`` of each fenced ``python`` block of ``path`` (``page.md:L12``)."""
    relative = path.relative_to(repo).as_posix()
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[tuple[str, str]] = []
    index = 0
    while index < len(lines):
        match = FENCE.match(lines[index])
        if not match:
            index += 1
            continue
        end = index + 1
        while end < len(lines) and not lines[end].strip().startswith(match["fence"]):
            end += 1
        if match["info"].strip().split()[:1] == ["python"]:
            indent = len(match["indent"])
            code = "\n".join(line[indent:] for line in lines[index + 1 : end])
            found.append((f"{relative}:L{index + 1}", code))
        index = end + 1
    return found


def parse_directive(body: str) -> Directive:
    """``skip: why`` / ``background`` / ``exit 3`` / ``equivalent: cmd`` / ``fresh-checkout``.

    Raises ``ValueError`` naming the problem for anything else.
    """
    name, colon, rest = body.partition(":")
    name, rest = name.strip(), rest.strip()
    if name == "skip":
        if not colon or len(rest) < 10:
            raise ValueError(f"'skip' needs a reason of at least 10 characters: {body!r}")
        return Directive("skip", rest)
    if name == "equivalent":
        if not colon or not rest:
            raise ValueError(f"'equivalent' needs a command: {body!r}")
        return Directive("equivalent", rest)
    if colon:
        raise ValueError(f"unknown docs-test directive {body!r}")
    if body in ("background", "fresh-checkout"):
        return Directive(body)
    match = re.fullmatch(r"exit\s+(\d{1,3})", body)
    if match:
        return Directive("exit", match.group(1))
    raise ValueError(
        f"unknown docs-test directive {body!r} (known: skip: <reason>, background, "
        "exit N, equivalent: <command>, fresh-checkout)"
    )


def parse(path: Path, repo: Path) -> tuple[list[Block], list[str]]:
    """The executable blocks of ``path`` and the annotation errors found in it."""
    relative = path.relative_to(repo).as_posix()
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    errors: list[str] = []
    pending: list[tuple[int, Directive]] = []
    index = 0
    while index < len(lines):
        line = lines[index]
        if "docs-test" in line and "<!--" in line:
            match = ANNOTATION.match(line)
            if not match:
                errors.append(f"{relative}:L{index + 1}: malformed docs-test comment {line!r}")
            else:
                try:
                    pending.append((index + 1, parse_directive(match.group("body"))))
                except ValueError as error:
                    errors.append(f"{relative}:L{index + 1}: {error}")
            index += 1
            continue
        fence = FENCE.match(line)
        if not fence:
            if pending and line.strip():
                errors.append(
                    f"{relative}:L{pending[0][0]}: docs-test comment not right before a fence"
                )
                pending = []
            index += 1
            continue
        marker = fence.group("fence")
        language = fence.group("info").strip().split(" ")[0].lower() if fence.group("info") else ""
        start = index
        body: list[str] = []
        index += 1
        while index < len(lines) and not re.match(
            rf"^\s{{0,3}}{re.escape(marker[0])}{{{len(marker)},}}\s*$", lines[index]
        ):
            body.append(lines[index])
            index += 1
        index += 1  # the closing fence
        directives = [directive for _, directive in pending]
        if language in SHELL_LANGUAGES:
            blocks.append(
                Block(path, relative, start + 1, language, "\n".join(body) + "\n", directives)
            )
        elif pending:
            errors.append(
                f"{relative}:L{pending[0][0]}: docs-test comment before a {language or 'plain'} "
                "block, which is not executed"
            )
        pending = []
    if pending:
        errors.append(f"{relative}:L{pending[0][0]}: docs-test comment at the end of the file")
    for block in blocks:
        errors += check_block(block, lines)
    return blocks, errors


def check_block(block: Block, lines: list[str]) -> list[str]:
    """Annotation rules that concern a whole block."""
    errors: list[str] = []
    kinds = [d.kind for d in block.directives]
    duplicated = sorted({k for k in kinds if kinds.count(k) > 1})
    if duplicated:
        errors.append(f"{block.ident}: repeated directive(s) {', '.join(duplicated)}")
    if "skip" in kinds and len(kinds) > 1:
        errors.append(f"{block.ident}: 'skip' cannot be combined with other directives")
    if "background" in kinds:
        commands = [
            line
            for line in block.script().splitlines()
            if line.strip() and not line.startswith("#")
        ]
        if len(commands) != 1 or block.language == "console":
            errors.append(f"{block.ident}: a background block must hold exactly one command")
        if "exit" in kinds:
            errors.append(f"{block.ident}: 'background' expects exit 0 after SIGTERM, not 'exit'")
    equivalent = block.directive("equivalent")
    if equivalent:
        near = "\n".join(
            line
            for line in lines[max(0, block.line - 25) : block.line + 25]
            if "docs-test" not in line
        )
        if equivalent.argument not in near:
            errors.append(
                f"{block.ident}: the equivalent {equivalent.argument!r} is not mentioned in "
                "the text near the block"
            )
    if "skip" not in kinds and "fresh-checkout" not in kinds and INSTALLS.search(block.script()):
        errors.append(
            f"{block.ident}: installs packages; mark it '<!-- docs-test: fresh-checkout -->' so "
            "it runs in a throw-away checkout, never in the shared .venv"
        )
    script_lines = [
        line.strip()
        for line in block.script().splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]
    if any(re.match(r"(export\s+)?MQDEDUP_DATABASE_URL=", line) for line in script_lines) and any(
        not line.startswith("export ") for line in script_lines
    ):
        errors.append(
            f"{block.ident}: sets MQDEDUP_DATABASE_URL and runs commands in the same block; "
            "put the exports in a block of their own (the test supplies an isolated database)"
        )
    if block.language == "console" and not block.console_steps():
        errors.append(f"{block.ident}: a console block without '$ ' command lines")
    return errors
