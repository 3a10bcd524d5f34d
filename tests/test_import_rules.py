"""Import rules, read from the source with `ast` (nothing is imported): the layering between
the packages, and no import cycles between the repository's modules.

A module is a file (a package's __init__.py is the package). Imports count at any depth
(inside functions and `if TYPE_CHECKING:` too); `import a.b` imports the module a.b, `from x
import y` imports x and also x.y when that is a module; relative imports are resolved. A
script also sees its own folder on its path (`import common` in scripts/bench/), as when run.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TREES = ("runner", "protocol", "cache", "drafting", "scripts")
# package -> the packages it must not import
FORBIDDEN = {
    "protocol": {"runner", "cache", "drafting"},
    "cache": {"runner", "protocol", "drafting"},
    "drafting": {"runner"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {
    module_name(p): p
    for tree in TREES
    for p in sorted((ROOT / tree).rglob("*.py"))
    if not any(part.startswith(".") for part in p.relative_to(ROOT).parts)  # .venv and such
}


def qualified(name: str, script_dir: str | None) -> str:
    """An absolute import's name as a repository module name: a script runs with its own folder
    first on sys.path, so `import common` in scripts/bench/ is scripts.bench.common."""
    if script_dir and name.split(".")[0] not in MODULES:
        return f"{script_dir}.{name}"
    return name


def loaded(name: str) -> list[str]:
    """The repository module importing `name` loads: its longest prefix that is one, if any."""
    parts = name.split(".")
    return [m for n in range(len(parts), 0, -1) if (m := ".".join(parts[:n])) in MODULES][:1]


def imported(node: ast.Import | ast.ImportFrom, package: str, in_scripts: bool) -> list[str]:
    """The repository modules one import statement names (their parent packages aside)."""
    script_dir = package if in_scripts else None
    if isinstance(node, ast.Import):
        return [m for alias in node.names for m in loaded(qualified(alias.name, script_dir))]
    if node.level:  # relative: from this module's package, up level - 1
        parts = package.split(".")[: len(package.split(".")) - node.level + 1]
        name = ".".join([*parts, node.module] if node.module else parts)
    else:
        name = qualified(node.module, script_dir)
    return loaded(name) + [f"{name}.{a.name}" for a in node.names if f"{name}.{a.name}" in MODULES]


@functools.cache
def import_graph() -> dict[str, dict[str, tuple[int, str]]]:
    """module -> {imported module: (first line importing it, that line's text)}."""
    graph: dict[str, dict[str, tuple[int, str]]] = {}
    for module, path in MODULES.items():
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges = graph[module] = {}
        for node in ast.walk(ast.parse(source, filename=str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for target in imported(node, package, module.startswith("scripts.")):
                    if target != module and target not in edges:
                        edges[target] = (node.lineno, lines[node.lineno - 1].strip())
    return graph


def where(module: str, target: str) -> str:
    line, text = import_graph()[module][target]
    return f"{MODULES[module].relative_to(ROOT)}:{line}: {text}"


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_layering(package):
    offences: dict[str, set[str]] = {}  # import line -> the forbidden packages it imports
    for module, edges in sorted(import_graph().items()):
        if module.split(".")[0] == package:
            for target in sorted(edges):
                if (top := target.split(".")[0]) in FORBIDDEN[package]:
                    offences.setdefault(where(module, target), set()).add(top)
    if offences:
        rule = f"{package}/ must not import {', '.join(sorted(FORBIDDEN[package]))}"
        pytest.fail(
            f"{rule}:\n"
            + "\n".join(
                f"  {at}  (imports {', '.join(sorted(tops))})"
                for at, tops in sorted(offences.items())
            ),
            pytrace=False,
        )


def shortest_cycle(start: str, group: set[str]) -> list[str]:
    """The shortest chain start -> ... -> start inside one strongly connected group."""
    graph, parents, frontier = import_graph(), {start: None}, [start]
    while frontier:
        following = []
        for module in frontier:
            for target in sorted(graph[module]):
                if target == start:
                    chain = [module]
                    while parents[chain[-1]] is not None:
                        chain.append(parents[chain[-1]])
                    return [*reversed(chain), start]
                if target in group and target not in parents:
                    parents[target] = module
                    following.append(target)
        frontier = following
    raise AssertionError(f"{start} is in no cycle")


def cycle_groups() -> list[set[str]]:
    """Strongly connected groups of more than one module (each contains a cycle)."""
    graph = import_graph()
    reaches = {m: set() for m in graph}  # transitive closure: a few dozen modules, plain DFS
    for module in graph:
        stack = list(graph[module])
        while stack:
            target = stack.pop()
            if target not in reaches[module]:
                reaches[module].add(target)
                stack.extend(graph[target])
    groups = {frozenset({m} | {t for t in reaches[m] if m in reaches[t]}) for m in graph}
    return sorted((set(g) for g in groups if len(g) > 1), key=sorted)


def test_no_import_cycles():
    reports = []
    for group in cycle_groups():
        chain = shortest_cycle(min(group), group)
        report = [f"import cycle: {' -> '.join(chain)}"]
        report += [f"  {where(a, b)}" for a, b in zip(chain, chain[1:], strict=False)]
        if len(group) > len(chain) - 1:
            report.append(f"  (and more cycles among: {', '.join(sorted(group))})")
        reports.append("\n".join(report))
    if reports:
        pytest.fail("\n".join(reports), pytrace=False)
