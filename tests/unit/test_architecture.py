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
