"""The package's shape: no import cycle between the modules of one package, counting the
imports made for type annotations only (``if TYPE_CHECKING:``) and inside functions.

import-linter's ``no-cycles`` contract (pyproject.toml) leaves type-checking imports out,
as its other contracts must; this test holds the stricter rule of docs/architecture.md:
cycles are broken by the layering, never by hiding an import from the run time.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from tests.services import require_module

#: import-linter's own dependency (the dev extra); the minimum-versions run has no linters
#: (the one module allowed to be missing in CI: ``tests.services.CI_OPTIONAL_MODULES``)
grimp = require_module("grimp")

ROOT = Path(__file__).resolve().parents[2]


def _sibling_graphs() -> dict[str, dict[str, set[str]]]:
    """Per package: which of its direct children import which (submodules folded in)."""
    graph = grimp.build_graph("mqdedup", exclude_type_checking_imports=False, cache_dir=None)
    packages: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for importer in graph.modules:
        for imported in graph.find_modules_directly_imported_by(importer):
            if not imported.startswith("mqdedup."):
                continue
            a, b = importer.split("."), imported.split(".")
            common = 0
            while common < min(len(a), len(b)) - 1 and a[common] == b[common]:
                common += 1
            if common == 0 or a[:common] != b[:common] or common >= len(a) or common >= len(b):
                continue
            parent = ".".join(a[:common])
            child_a, child_b = a[common], b[common]
            if child_a != child_b:
                packages[parent][child_a].add(child_b)
    return packages


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_between_the_modules_of_a_package() -> None:
    cycles = {
        parent: components
        for parent, edges in _sibling_graphs().items()
        if (components := _cycles(edges))
    }
    assert cycles == {}, f"import cycles (type-checking imports included): {cycles}"


# -- the relay asks its coordination object (issue 41) -------------------------------------

#: Words that name a coordination mode or the objects that used to stand for one.
_MODE_WORDS = ("coordinat", "_control", "_turns", "shard_locks", "yielding", "notifies")
_MODE_NAMES = {"session", "transaction", "advisory", "named"}


def _mentions_the_mode(node: ast.AST) -> str | None:
    """What in ``node`` names the coordination mode (an identifier or a mode's name)."""
    for child in ast.walk(node):
        name = None
        if isinstance(child, ast.Name):
            name = child.id
        elif isinstance(child, ast.Attribute):
            name = child.attr
        elif isinstance(child, ast.Constant) and child.value in _MODE_NAMES:
            return repr(child.value)
        if name is not None and any(word in name.lower() for word in _MODE_WORDS):
            return name
        if name in {"SharedShards", "TakingTurns", "SingleRelay", "ShardCoordinator"}:
            return name
    return None


def _mode_tests(source: str) -> list[str]:
    """Each decision in ``source`` (if / while / ternary / comparison / match /
    isinstance) that looks at the coordination mode, as ``line: what``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        tested: ast.AST | None = None
        if isinstance(node, (ast.If, ast.While, ast.IfExp, ast.Assert)):
            tested = node.test
        elif isinstance(node, (ast.Compare, ast.BoolOp)):
            tested = node
        elif isinstance(node, ast.Match):
            parts = [node.subject, *(case.pattern for case in node.cases)]
            tested = ast.Module(body=[ast.Expr(value=part) for part in parts], type_ignores=[])  # type: ignore[misc]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in {
            "isinstance",
            "getattr",
            "hasattr",
        }:
            tested = node
        elif isinstance(node, ast.comprehension):
            tested = ast.Module(body=[ast.Expr(value=test) for test in node.ifs], type_ignores=[])
        if tested is not None and (what := _mentions_the_mode(tested)) is not None:
            found.append(f"{node.lineno if hasattr(node, 'lineno') else '?'}: {what}")
    return found


def test_the_relay_never_tests_its_coordination_mode() -> None:
    source = (ROOT / "mqdedup" / "outbox" / "relay.py").read_text()
    assert _mode_tests(source) == [], (
        "outbox/relay.py decides by the coordination mode; ask its RelayCoordination "
        "(mqdedup/outbox/relay_coordination.py) instead"
    )
    imported = {
        alias.name
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom) and node.module == "mqdedup.outbox.coordination"
        for alias in node.names
    }
    assert imported == set(), f"relay.py reaches past its RelayCoordination: {imported}"


def test_the_mode_check_finds_a_branch_on_the_mode() -> None:
    """The check above is not vacuous: each way the relay used to branch is found."""
    samples = [
        "if self._turns is not None:\n    pass",
        "x = a if self._control is not None else b",
        "if self.config.coordination == 'transaction':\n    pass",
        "match mode:\n    case 'session':\n        pass",
        "assert isinstance(self.coordination, SharedShards)",
        "if control is not None and control.notifies:\n    pass",
    ]
    for sample in samples:
        assert _mode_tests(sample), sample
    assert _mode_tests("self.coordination.claim(run, brokers, in_flight)") == []


# -- one backoff (issue 41) -----------------------------------------------------------------


#: What a growing wait is called (``min(pause * 2, cap)``).
_WAIT_WORDS = ("pause", "backoff", "delay", "wait", "sleep")


def _hand_written_backoffs(source: str) -> list[str]:
    """Backoff formulas written out in ``source``: a power (``2 ** attempt``), a jitter
    draw (``random.uniform``), a doubling capped by ``min(x * 2, …)`` or one of tenacity's
    ``wait_*`` objects, as ``line: code``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
            found.append(node)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr == "uniform":
                found.append(node)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "min":
            grown = [
                arg
                for arg in node.args
                if isinstance(arg, ast.BinOp)
                and isinstance(arg.op, ast.Mult)
                and any(word in ast.unparse(arg) for word in _WAIT_WORDS)
            ]
            if grown:
                found.append(node)
        elif (
            isinstance(node, ast.ImportFrom)
            and (node.module or "").startswith("tenacity")
            and any(alias.name.startswith("wait") for alias in node.names)
        ):
            found.append(node)
    return [f"{node.lineno}: {ast.unparse(node)[:60]}" for node in found]  # type: ignore[attr-defined]


def test_every_wait_uses_the_one_backoff() -> None:
    package = ROOT / "mqdedup"
    formulas = {
        str(path.relative_to(ROOT)): found
        for path in sorted(package.rglob("*.py"))
        # The aio_* stacks are being removed (issue 41, part 1) and may not come back.
        if path != package / "backoff.py"
        and not path.name.startswith("aio_")
        and (found := _hand_written_backoffs(path.read_text()))
    }
    assert formulas == {}, "use mqdedup.backoff.Backoff instead of writing a backoff out"


def test_the_backoff_check_finds_each_old_formula() -> None:
    samples = [
        "pause = min(cap, 0.25 * 2 ** (failures - 1)) * random.uniform(0.8, 1.0)",
        "time.sleep(backoff * 2 ** (attempt - 1))",
        "self._pause = min(self._pause * 2, _BLOCKED_PAUSE_MAX)",
        "from tenacity import Retrying, wait_random_exponential",
    ]
    for sample in samples:
        assert _hand_written_backoffs(sample), sample
    assert _hand_written_backoffs("pause = BACKOFF.delay(failures)") == []


# -- third-party internals in the core (issue 41) ---------------------------------------------

#: The undocumented third-party pieces the core keeps, each listed with its reason, the
#: versions tested, its bound and its fallback in docs/architecture.md.
_DOCUMENTED_CORE_INTERNALS = {"mqdedup/bridge.py": {"sqlalchemy.util.concurrency"}}
_THIRD_PARTY = ("sqlalchemy", "psycopg", "greenlet", "pymysql", "redis")


def _private_reaches(source: str) -> set[str]:
    """Undocumented modules imported (``sqlalchemy.util``, ``x._private``) and private
    attributes read by name (``getattr(obj, "_name")``) in ``source``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        modules: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module:
            modules = [node.module]
        elif isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        for module in modules:
            parts = module.split(".")
            if parts[0] in _THIRD_PARTY and (
                module.startswith("sqlalchemy.util")
                or any(part.startswith("_") for part in parts[1:])
            ):
                found.add(module)
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) in {"getattr", "hasattr", "setattr"}
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and node.args[1].value.startswith("_")
            and not node.args[1].value.startswith("__")
        ):
            found.add(f"getattr {node.args[1].value}")
    return found


def test_the_core_reaches_no_third_party_internal_beyond_the_documented_ones() -> None:
    package = ROOT / "mqdedup"
    reaches = {
        relative: found
        for path in sorted(package.rglob("*.py"))
        if path.relative_to(package).parts[0] not in {"kafka", "rabbitmq"}
        and (found := _private_reaches(path.read_text()))
        and found != _DOCUMENTED_CORE_INTERNALS.get(relative := str(path.relative_to(ROOT)))
    }
    assert reaches == {}, "document it in docs/architecture.md (with a fallback) or drop it"
    architecture = (ROOT / "docs" / "architecture.md").read_text()
    for where, modules in _DOCUMENTED_CORE_INTERNALS.items():
        assert where.removeprefix("mqdedup/") in architecture
        assert all(module in architecture for module in modules)


def test_the_internals_check_finds_what_alembic_support_used_to_read() -> None:
    old = 'x = getattr(index, "_ddl_if", None)\ny = getattr(t, "_variant_mapping", {})'
    assert _private_reaches(old) == {"getattr _ddl_if", "getattr _variant_mapping"}
    assert _private_reaches("from sqlalchemy.util.concurrency import await_") == {
        "sqlalchemy.util.concurrency"
    }
    assert _private_reaches("from sqlalchemy.ext.asyncio import AsyncSession") == set()


# -- one transport per broker (issue 41) -------------------------------------------------------

#: The broker clients (import names) and the adapter packages that alone may import them.
#: aiokafka and aio-pika (with aiormq, its AMQP layer) have no adapter: no module may.
BROKER_CLIENTS: dict[str, tuple[str, ...]] = {
    "kafka": ("mqdedup.kafka",),
    "pika": ("mqdedup.rabbitmq",),
    "aiokafka": (),
    "aio_pika": (),
    "aiormq": (),
}


def test_no_aio_transport_module_comes_back() -> None:
    """Async consumers run on the one transport of their broker: a second stack
    (``aio_*.py`` modules redoing the transport for another client) is refused."""
    from pathlib import Path

    import mqdedup

    package = Path(mqdedup.__file__).parent
    found = sorted(str(path.relative_to(package)) for path in package.rglob("aio_*.py"))
    assert found == [], f"a second (asyncio) transport stack is back: {found}"


def test_only_the_broker_adapters_import_a_broker_client() -> None:
    """kafka-python only in mqdedup.kafka, pika only in mqdedup.rabbitmq, aiokafka /
    aio-pika / aiormq nowhere (type-checking imports and imports in functions included)."""
    graph = grimp.build_graph(
        "mqdedup",
        include_external_packages=True,
        exclude_type_checking_imports=False,
        cache_dir=None,
    )
    misplaced: dict[str, list[str]] = {}
    for client, owners in BROKER_CLIENTS.items():
        if client not in graph.modules:
            continue  # imported by no module of mqdedup
        importers = graph.find_modules_that_directly_import(client)
        outside = sorted(
            module
            for module in importers
            if not any(module == owner or module.startswith(f"{owner}.") for owner in owners)
        )
        if outside:
            misplaced[client] = outside
    assert misplaced == {}, f"broker clients imported outside their adapter: {misplaced}"
