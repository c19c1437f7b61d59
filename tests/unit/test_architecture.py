"""The package's shape: no import cycle between the modules of one package, counting the
imports made for type annotations only (``if TYPE_CHECKING:``) and inside functions.

import-linter's ``no-cycles`` contract (pyproject.toml) leaves type-checking imports out,
as its other contracts must; this test holds the stricter rule of docs/architecture.md:
cycles are broken by the layering, never by hiding an import from the run time.
"""

from __future__ import annotations

from collections import defaultdict

from tests.services import require_module

#: import-linter's own dependency (the dev extra); the minimum-versions run has no linters
#: (the one module allowed to be missing in CI: ``tests.services.CI_OPTIONAL_MODULES``)
grimp = require_module("grimp")


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
