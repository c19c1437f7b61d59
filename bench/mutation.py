"""Mutation run over the modules that decide a message's fate (issue #39).

``python -m bench.mutation [--max N] [--max-for MODULE=N ...] [--jobs J]
[--only MODULE ...] [--function NAME ...] [--json FILE] [--survivors-of FILE]
[--exclude-test PATH ...]``

Not part of CI: a review tool. For each target module it parses the source with
:mod:`ast`, lists mutation sites (the fate-deciding functions first, then a seeded sample
of the rest of the module, at most ``--max`` per module) and, for each mutant, writes the
mutated module into a *copy* of the repository (one per job, in a temporary folder; the
real tree is never written), runs the module's fast test selection there (``pytest -x``,
a timeout per mutant) and counts the mutant killed when the tests fail or time out.

Mutations: comparisons flipped (``==``/``!=``, ``<``/``>=``, ``is``/``is not``,
``in``/``not in``) and their boundaries moved (``<``/``<=``); ``and``/``or`` swapped or
reduced to one operand; ``if``/``while`` conditions negated, ``not`` dropped; ``True`` /
``False`` flipped; ``a + b`` reduced to one operand (``processed + duplicates``); one
fate list or outcome named for another (``report.unsettled`` -> ``report.duplicates``,
``PublishOutcome.PUBLISHED`` -> ``PublishOutcome.REJECTED``); a call statement, ``continue`` or
``break`` dropped; a key dropped from a dict literal (a producer setting).

Prints mutants / killed / survived per module and every survivor (file:line, the
function, the changed code), and writes them as JSON (``--json``). ``--survivors-of``
re-runs only the survivors recorded in an earlier JSON file (tests are only added
between the runs, so a killed mutant stays killed): the "after" run. ``--exclude-test``
leaves a test file out of every selection (``tests/unit/test_rare_branches.py``: the
"before" run, on the tests of ``main``).
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RARE = "tests/unit/test_rare_branches.py"


@dataclass(frozen=True)
class Target:
    """A module under mutation, its fate-deciding functions and its test selection."""

    name: str
    path: str
    functions: tuple[str, ...]
    tests: tuple[str, ...]
    #: ``pytest -k`` expression narrowing the selection ("" for all).
    keyword: str = ""


TARGETS = (
    Target(
        "processor",
        "mqdedup/consumers/processor.py",
        (
            "Processor._settle_committed",
            "Processor._careful_one",
            "Processor._retry",
            "Processor._careful",
            "Processor._skip_processed",
            "Processor._first",
            "Processor.process",
            "Processor._committed",
            "Processor._exhausted_record",
        ),
        (
            RARE,
            "tests/unit/test_processor.py",
            "tests/unit/test_careful_mode.py",
        ),
    ),
    Target(
        "dead_lettering",
        "mqdedup/consumers/dead_lettering.py",
        ("DeadLettering._park", "DeadLettering.send", "DeadLettering.record"),
        (
            RARE,
            "tests/unit/test_dead_letter_table.py",
            "tests/unit/test_careful_mode.py",
            "tests/unit/test_processor.py",
        ),
    ),
    Target(
        "relay",
        "mqdedup/outbox/relay.py",
        ("Relay._burst", "Relay._settle", "Relay.run_once", "Relay.drain", "_unfinished"),
        (RARE, "tests/unit/test_outbox_relay.py", "tests/unit/test_outbox_claimed_rows.py"),
    ),
    Target(
        "relay_publishing",
        "mqdedup/outbox/relay_publishing.py",
        ("publish_records", "CycleReport.complete", "BrokerPauses.record"),
        (RARE, "tests/unit/test_outbox_relay.py", "tests/unit/test_outbox_publishers.py"),
    ),
    Target(
        "kafka_publisher",
        "mqdedup/kafka/publisher.py",
        ("KafkaPublisher.__init__", "KafkaPublisher.publish_batch"),
        (
            RARE,
            "tests/unit/test_outbox_publishers.py",
            "tests/unit/test_kafka_producer_internals.py",
        ),
    ),
    Target(
        "rabbitmq_publisher",
        "mqdedup/rabbitmq/publisher.py",
        (
            "RabbitMQPublisher.publish_batch",
            "RabbitMQPublisher._publish_round",
            "RabbitMQPublisher._after_channel_closed",
            "RabbitMQPublisher._on_confirm",
            "RabbitMQPublisher._on_return",
        ),
        (
            RARE,
            "tests/contract/test_publisher.py",
            "tests/unit/test_rabbitmq_pika_internals.py",
            "tests/unit/test_rabbitmq_publish_frames.py",
            "tests/integration/outbox/test_outbox_rabbitmq_refusals.py",
        ),
        # The contract suite's RabbitMQ rows and the refusals (a missing exchange, a
        # full queue...) on the shared RabbitMQ; not the 2,000-row throughput run.
        "rabbitmq and not 2000_rows",
    ),
)

# -- mutation sites ----------------------------------------------------------------------

_FLIP: dict[type[ast.cmpop], tuple[type[ast.cmpop], ...]] = {
    ast.Eq: (ast.NotEq,),
    ast.NotEq: (ast.Eq,),
    ast.Lt: (ast.GtE, ast.LtE),
    ast.LtE: (ast.Gt, ast.Lt),
    ast.Gt: (ast.LtE, ast.GtE),
    ast.GtE: (ast.Lt, ast.Gt),
    ast.Is: (ast.IsNot,),
    ast.IsNot: (ast.Is,),
    ast.In: (ast.NotIn,),
    ast.NotIn: (ast.In,),
}
#: Names of fates; one may be mutated into another of its group.
_FATES = (
    ("processed", "duplicates", "unsettled", "dead_lettered", "settled"),
    ("published", "rejected", "unavailable", "failed"),
    ("PUBLISHED", "REJECTED", "UNAVAILABLE", "REFUSED", "NO_METADATA"),
)


@dataclass
class Mutant:
    """One mutation: where (``index`` of the node in ``ast.walk`` order) and which."""

    module: str
    path: str
    index: int
    kind: str
    choice: int
    line: int
    function: str
    description: str = ""
    status: str = "pending"
    seconds: float = 0.0
    diff: list[str] = field(default_factory=list)

    @property
    def key(self) -> str:
        return f"{self.path}:{self.index}:{self.kind}:{self.choice}"


def _qualnames(tree: ast.Module) -> dict[int, str]:
    """id(node) -> the qualified name of the function holding it ("" at module level)."""
    names: dict[int, str] = {}

    def visit(node: ast.AST, scope: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            inner = scope
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = [*scope, child.name]
            names[id(child)] = ".".join(inner) if inner else ""
            visit(child, inner)

    visit(tree, [])
    return names


def _choices(node: ast.AST) -> Iterator[tuple[str, int]]:
    """The mutations possible at ``node``: (kind, choice)."""
    if isinstance(node, ast.Compare) and len(node.ops) == 1:
        for n, _ in enumerate(_FLIP.get(type(node.ops[0]), ())):
            yield "compare", n
    elif isinstance(node, ast.BoolOp):
        yield "boolop-swap", 0
        for n in range(len(node.values)):
            yield "boolop-drop", n
    elif isinstance(node, (ast.If, ast.While, ast.IfExp)):
        yield "negate", 0
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        yield "drop-not", 0
    elif isinstance(node, ast.Constant) and isinstance(node.value, bool):
        yield "flip-bool", 0
    elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        yield "add-left", 0
        yield "add-right", 0
    elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
        for group in _FATES:
            if node.attr in group:
                for n, _ in enumerate(a for a in group if a != node.attr):
                    yield "fate", n
    elif isinstance(node, ast.Expr) and isinstance(node.value, (ast.Call, ast.Await)):
        yield "drop-call", 0
    elif isinstance(node, (ast.Continue, ast.Break)):
        yield "drop-jump", 0
    elif isinstance(node, ast.Dict):
        for n, key in enumerate(node.keys):
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                yield "drop-key", n


def _docstring_ids(tree: ast.Module) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
        ):
            ids.add(id(body[0]))
    return ids


def sites(target: Target, root: Path) -> list[Mutant]:
    """Every mutation site of ``target``, in ``ast.walk`` order."""
    source = (root / target.path).read_text()
    tree = ast.parse(source)
    scopes = _qualnames(tree)
    docstrings = _docstring_ids(tree)
    found = []
    for index, node in enumerate(ast.walk(tree)):
        if id(node) in docstrings or not hasattr(node, "lineno"):
            continue
        function = scopes.get(id(node), "")
        if function.split(".")[-1:] == ["__all__"] or not function:
            continue  # module-level constants and imports
        for kind, choice in _choices(node):
            found.append(
                Mutant(target.name, target.path, index, kind, choice, node.lineno, function)
            )
    return found


def _in(function: str, names: Sequence[str]) -> bool:
    return any(function == n or function.startswith(n + ".") for n in names)


def select(target: Target, found: list[Mutant], limit: int, seed: int) -> list[Mutant]:
    """The fate-deciding functions' mutants first (all of them, up to ``limit``), then a
    seeded sample of the others."""
    first = [m for m in found if _in(m.function, target.functions)]
    first.sort(  # in the order the target lists its functions, each in source order
        key=lambda m: (
            next(n for n, f in enumerate(target.functions) if _in(m.function, (f,))),
            m.line,
        )
    )
    rest = [m for m in found if not _in(m.function, target.functions)]
    random.Random(f"{seed}:{target.name}").shuffle(rest)
    chosen = (first + rest)[:limit]
    return sorted(chosen, key=lambda m: (m.line, m.index, m.kind, m.choice))


class _Apply(ast.NodeTransformer):
    def __init__(self, mutant: Mutant, nodes: list[ast.AST]) -> None:
        self.mutant = mutant
        self.target = nodes[mutant.index]
        self.before = ""
        self.after = ""

    def visit(self, node: ast.AST) -> ast.AST | None:
        if node is not self.target:
            return self.generic_visit(node)
        if isinstance(node, (ast.If, ast.While, ast.IfExp)):  # show the condition only
            self.before = ast.unparse(node.test)
            new = self._mutate(node)
            self.after = ast.unparse(node.test)
            return new
        if isinstance(node, ast.Dict):  # show the key only
            self.before = ast.unparse(node.keys[self.mutant.choice] or node)
            self.after = "(key dropped)"
            return self._mutate(node)
        self.before = ast.unparse(node)
        new = self._mutate(node)
        self.after = ast.unparse(new) if new is not None else "(removed)"
        return new

    def _mutate(self, node: ast.AST) -> ast.AST | None:
        kind, choice = self.mutant.kind, self.mutant.choice
        if kind == "compare":
            assert isinstance(node, ast.Compare)
            node.ops = [_FLIP[type(node.ops[0])][choice]()]
        elif kind == "boolop-swap":
            assert isinstance(node, ast.BoolOp)
            node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        elif kind == "boolop-drop":
            assert isinstance(node, ast.BoolOp)
            values = [v for n, v in enumerate(node.values) if n != choice]
            if len(values) == 1:
                return values[0]
            node.values = values
        elif kind == "negate":
            assert isinstance(node, (ast.If, ast.While, ast.IfExp))
            node.test = ast.UnaryOp(op=ast.Not(), operand=node.test)
        elif kind == "drop-not":
            assert isinstance(node, ast.UnaryOp)
            return node.operand
        elif kind == "flip-bool":
            assert isinstance(node, ast.Constant)
            node.value = not node.value
        elif kind in ("add-left", "add-right"):
            assert isinstance(node, ast.BinOp)
            return node.left if kind == "add-left" else node.right
        elif kind == "fate":
            assert isinstance(node, ast.Attribute)
            group = next(g for g in _FATES if node.attr in g)
            node.attr = [a for a in group if a != node.attr][choice]
        elif kind in ("drop-call", "drop-jump"):
            return ast.Pass()
        elif kind == "drop-key":
            assert isinstance(node, ast.Dict)
            del node.keys[choice]
            del node.values[choice]
        return node


def mutate(source: str, mutant: Mutant) -> str | None:
    """The mutated module's source (None when the mutation changes nothing)."""
    tree = ast.parse(source)
    nodes = list(ast.walk(tree))
    applier = _Apply(mutant, nodes)
    mutated = applier.visit(tree)
    assert mutated is not None  # the module node itself is never mutated
    text = ast.unparse(ast.fix_missing_locations(mutated))
    mutant.description = f"{applier.before}  ->  {applier.after}"
    if text == ast.unparse(ast.parse(source)):
        return None
    return text


# -- running -------------------------------------------------------------------------------


def _copy_repo(destination: Path) -> None:
    ignore = shutil.ignore_patterns(
        ".git", ".venv", "__pycache__", "*.pyc", ".mypy_cache", ".ruff_cache", "results"
    )
    for item in ROOT.iterdir():
        if item.name in (".git", ".venv", ".mypy_cache", ".ruff_cache", ".pytest_cache"):
            continue
        if item.is_dir():
            shutil.copytree(item, destination / item.name, ignore=ignore)
        else:
            shutil.copy2(item, destination / item.name)


def _pytest(workdir: Path, target: Target, excluded: Sequence[str], timeout: float) -> str:
    """``killed``, ``survived`` or ``timeout`` for the selection run in ``workdir``."""
    tests = [t for t in target.tests if t not in excluded]
    command = [
        sys.executable, "-m", "pytest", *tests, "-x", "-q", "-p", "no:cacheprovider",
        "-p", "no:randomly", "--durations=0", "--timeout", str(int(timeout)),
    ]  # fmt: skip
    if target.keyword:
        command += ["-k", target.keyword]
    # CI=true: a missing service fails the baseline instead of every mutant "surviving".
    env = {
        **os.environ,
        "PYTHONPATH": str(workdir),
        "PYTHONDONTWRITEBYTECODE": "1",
        "CI": "true",
    }
    try:
        result = subprocess.run(
            command,
            cwd=workdir,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return "timeout"
    if result.returncode == 0:
        return "survived"
    if result.returncode in (1, 3):  # tests failed / an internal error (an import broke)
        return "killed"
    return f"error (pytest exit {result.returncode}): {result.stdout[-300:]}"


def run(
    mutants: list[Mutant],
    targets: dict[str, Target],
    *,
    jobs: int,
    timeout: float,
    excluded: Sequence[str],
    progress: Path | None = None,
) -> None:
    """Run every mutant (``jobs`` copies of the repository side by side)."""
    with tempfile.TemporaryDirectory(prefix="mqdedup-mutation-") as scratch:
        pool: list[Path] = []
        for n in range(jobs):
            workdir = Path(scratch) / f"copy{n}"
            workdir.mkdir()
            _copy_repo(workdir)
            pool.append(workdir)
        # The unmutated selections must pass first (else every mutant looks killed).
        for target in {targets[m.module] for m in mutants}:
            status = _pytest(pool[0], target, excluded, timeout)
            if status != "survived":
                raise SystemExit(f"{target.name}: the tests fail without a mutation ({status})")
        free = list(pool)
        lock = threading.Lock()
        done = [0]

        def one(mutant: Mutant) -> None:
            with lock:
                workdir = free.pop()
            try:
                module = workdir / mutant.path
                original = (ROOT / mutant.path).read_text()
                text = mutate(original, mutant)
                if text is None:
                    mutant.status = "equivalent"
                    return
                module.write_text(text)
                started = time.monotonic()
                try:
                    mutant.status = _pytest(workdir, targets[mutant.module], excluded, timeout)
                finally:
                    module.write_text(original)
                mutant.seconds = round(time.monotonic() - started, 1)
            finally:
                with lock:
                    free.append(workdir)
                    done[0] += 1
                    if progress is not None:  # what ran so far survives an interrupted run
                        progress.write_text(json.dumps([asdict(m) for m in mutants], indent=1))
                    print(
                        f"[{done[0]}/{len(mutants)}] {mutant.status:9} {mutant.path}:"
                        f"{mutant.line} {mutant.function} {mutant.kind}: {mutant.description}",
                        flush=True,
                    )

        with ThreadPoolExecutor(jobs) as executor:
            list(executor.map(one, mutants))


def summary(mutants: list[Mutant]) -> str:
    """Counts per module and the survivors, as Markdown."""
    lines = [
        "| module | mutants | killed | survived | equivalent |",
        "| --- | --- | --- | --- | --- |",
    ]
    totals = [0, 0, 0, 0]
    for module in dict.fromkeys(m.module for m in mutants):
        mine = [m for m in mutants if m.module == module]
        killed = sum(m.status in ("killed", "timeout") for m in mine)
        survived = sum(m.status == "survived" for m in mine)
        equivalent = sum(m.status == "equivalent" for m in mine)
        counted = len(mine) - equivalent
        for i, value in enumerate((counted, killed, survived, equivalent)):
            totals[i] += value
        lines.append(f"| {module} | {counted} | {killed} | {survived} | {equivalent} |")
    lines.append(f"| **total** | {totals[0]} | {totals[1]} | {totals[2]} | {totals[3]} |")
    survivors = [m for m in mutants if m.status not in ("killed", "timeout", "equivalent")]
    if survivors:
        lines += ["", "Survivors:", ""]
        lines += [
            f"- `{m.path}:{m.line}` `{m.function}` {m.kind} ({m.status}): `{m.description[:160]}`"
            for m in survivors
        ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--max", type=int, default=40, help="mutants per module (default 40)")
    parser.add_argument(
        "--max-for", nargs="*", default=[], metavar="MODULE=N", help="per-module --max"
    )
    parser.add_argument("--jobs", type=int, default=2, help="mutants run side by side")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per mutant")
    parser.add_argument("--seed", type=int, default=39, help="sampling seed")
    parser.add_argument("--only", nargs="*", default=None, help="module names (see TARGETS)")
    parser.add_argument("--exclude-test", nargs="*", default=[], help="test files left out")
    parser.add_argument(
        "--function", nargs="*", default=None, help="only these functions (Class.method)"
    )
    parser.add_argument("--survivors-of", type=Path, help="re-run the survivors of this JSON")
    parser.add_argument("--json", type=Path, help="write every mutant's result here")
    parser.add_argument("--list", action="store_true", help="list the mutants, run nothing")
    args = parser.parse_args(argv)

    targets = {t.name: t for t in TARGETS if args.only is None or t.name in args.only}
    if args.only and set(args.only) - set(targets):
        parser.error(f"unknown module(s): {sorted(set(args.only) - set(targets))}")
    previous: list[Mutant] = []
    if args.survivors_of:
        previous = [Mutant(**row) for row in json.loads(args.survivors_of.read_text())]
        previous = [m for m in previous if m.module in targets]
        mutants = [copy.copy(m) for m in previous if m.status == "survived"]
    else:
        mutants = []
        limits = {k: int(v) for k, v in (item.split("=", 1) for item in args.max_for)}
        for target in targets.values():
            limit = limits.get(target.name, args.max)
            found = sites(target, ROOT)
            if args.function:
                found = [m for m in found if _in(m.function, args.function)]
            mutants += select(target, found, limit, args.seed)
    if args.list:
        for m in mutants:
            mutate((ROOT / m.path).read_text(), m)
            print(f"{m.path}:{m.line} {m.function} {m.kind}: {m.description}")
        return 0
    started = time.monotonic()
    run(
        mutants,
        targets,
        jobs=args.jobs,
        timeout=args.timeout,
        excluded=args.exclude_test,
        progress=args.json,
    )
    if previous:  # the earlier run's killed mutants stay killed (tests were only added)
        rerun = {m.key: m for m in mutants}
        mutants = [rerun.get(m.key, m) for m in previous]
    print(f"\n{summary(mutants)}\n\n({time.monotonic() - started:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps([asdict(m) for m in mutants], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
