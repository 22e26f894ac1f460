"""The import graph of a Python package, read from its source with `ast`.

Every import statement counts, wherever it sits: at module level, inside a function, or under
`if TYPE_CHECKING:`. Each becomes an edge from the importing module to the package module it
needs, with the file and line it is written on, so a checker can name it. Nothing of the
package is imported: this works on a package that no longer imports.

Importing `a.b.c` also runs the `__init__` of `a` and `a.b`; those implicit imports are not
edges (every module would otherwise depend on the package's top-level `__init__`). Imports by
string (`importlib.import_module`) are not seen.
"""

from __future__ import annotations

import ast
from collections.abc import Container, Iterable
from dataclasses import dataclass
from pathlib import Path

MODULE_LEVEL = "module-level"
FUNCTION_LEVEL = "function-level"
TYPE_CHECKING_ONLY = "TYPE_CHECKING"


@dataclass(frozen=True)
class ImportEdge:
    """One import statement's dependency of `source` on `target`, where it is written."""

    source: str
    target: str
    path: str
    line: int
    kind: str

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def discover_modules(package_dir: Path) -> dict[str, Path]:
    """Every `.py` file under `package_dir`, by dotted module name (packages by their name)."""
    package_dir = package_dir.resolve()
    modules: dict[str, Path] = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        if "__pycache__" in parts:
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


class _ImportCollector(ast.NodeVisitor):
    """Every import statement of a module, with the scope it sits in."""

    def __init__(self) -> None:
        self.found: list[tuple[ast.Import | ast.ImportFrom, str]] = []
        self._in_function = 0
        self._in_type_checking = 0

    def _kind(self) -> str:
        if self._in_type_checking:
            return TYPE_CHECKING_ONLY
        return FUNCTION_LEVEL if self._in_function else MODULE_LEVEL

    def visit_Import(self, node: ast.Import) -> None:
        self.found.append((node, self._kind()))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self.found.append((node, self._kind()))

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self._in_function += 1
        self.generic_visit(node)
        self._in_function -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        self._in_type_checking += 1
        for statement in node.body:
            self.visit(statement)
        self._in_type_checking -= 1
        for statement in node.orelse:  # the `else:` of TYPE_CHECKING runs at run time
            self.visit(statement)


def _resolve(
    node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: Container[str]
) -> list[str]:
    """The package modules an import statement depends on (names outside it are dropped).

    `from a import b` depends on module `a.b` when that exists, else on `a` (where `b` is
    defined). A name of the package that is no module is returned as is, to be reported.
    """
    root = module.split(".")[0]
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
        return [name for name in names if name.split(".")[0] == root]
    base = node.module or ""
    if node.level:
        package = module if is_package else module.rpartition(".")[0]
        parts = package.split(".")
        parts = parts[: len(parts) - node.level + 1]
        base = ".".join(parts + ([node.module] if node.module else []))
    if base.split(".")[0] != root:
        return []
    targets = []
    for alias in node.names:
        submodule = f"{base}.{alias.name}"
        targets.append(submodule if submodule in known else base)
    return list(dict.fromkeys(targets))


def collect_imports(modules: dict[str, Path], display_root: Path) -> list[ImportEdge]:
    """Every dependency between modules of the package, one edge per statement and target."""
    edges: list[ImportEdge] = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        collector = _ImportCollector()
        collector.visit(tree)
        shown = path.relative_to(display_root).as_posix()
        is_package = path.name == "__init__.py"
        for node, kind in collector.found:
            for target in _resolve(node, module, is_package, modules):
                if target != module:
                    edges.append(ImportEdge(module, target, shown, node.lineno, kind))
    return edges


def strongly_connected(nodes: Iterable[str], edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components; only those of two or more modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(edges.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(nodes):
        if node not in index:
            visit(node)
    return components
