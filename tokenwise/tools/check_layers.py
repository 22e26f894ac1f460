"""Prove that tokenwise's imports form layers: no upward import and no import circle.

    python -m tokenwise.tools.check_layers      # exit 0 when clean, 1 listing every offender

Why a check: an import circle hidden behind a function-level or `TYPE_CHECKING` import works
until someone hoists the import, and it already means that neither module can be read, tested
or replaced without the other. Writing the order down (`LAYERS`, `layers.py`) and checking it on every test
run keeps circles from growing back.

The rules:

- Every module of the package belongs to one layer of `LAYERS`, by its most specific pattern.
  A module that matches no pattern is an error, so a new module gets a place on purpose.
- A module imports modules of its own layer or of lower layers only. Module-level,
  function-level and `if TYPE_CHECKING:` imports all count: a lazy import is still a
  dependency, and a type-only import still ties the two designs together.
- The imports among the modules of one layer form no cycle.
- Importing `a.b.c` also runs the `__init__` of `a` and `a.b`; those implicit imports are not
  counted (every module would otherwise depend on `tokenwise/__init__.py`, the top-level
  facade). Each package's `__init__` is checked as a module of its own instead.

The graph comes from `import_graph`, which parses source with `ast` and imports nothing of the
package, so the check also runs (and names the culprit) when the package no longer imports.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tokenwise.tools.import_graph import (
    ImportEdge,
    collect_imports,
    discover_modules,
    strongly_connected,
)
from tokenwise.tools.layers import LAYERS, Layer

PACKAGE_DIR = Path(__file__).resolve().parents[1]
THIS_MODULE = "tokenwise.tools.check_layers"  # not __name__, which is "__main__" under -m


# Import circles that are being removed right now, exempt until then. Every import between the
# two modules of a pair (either way) is skipped. Delete the entry when the circle is gone; the
# check says so once it is.
KNOWN_CYCLES_BEING_REMOVED: dict[frozenset[str], str] = {}


@dataclass
class Report:
    """What `check` found: the modules, their layers, their imports and the problems."""

    layers: Sequence[Layer]
    layer_of: dict[str, int] = field(default_factory=dict)
    edges: list[ImportEdge] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def describe(self, layer: int) -> str:
        return f"layer '{self.layers[layer].name}' (#{layer})"


def _specificity(pattern: str, module: str) -> tuple[int, int] | None:
    """How closely `pattern` names `module` (more specific is larger), None if it does not."""
    if pattern.endswith(".*"):
        base = pattern[:-2]
        if module == base or module.startswith(base + "."):
            return (len(base), 0)
        return None
    return (len(pattern), 1) if module == pattern else None


def layer_index(module: str, layers: Sequence[Layer]) -> int | None:
    """The layer whose most specific pattern matches `module`."""
    best: tuple[tuple[int, int], int] | None = None
    for index, layer in enumerate(layers):
        for pattern in layer.patterns:
            score = _specificity(pattern, module)
            if score is not None and (best is None or score > best[0]):
                best = (score, index)
    return None if best is None else best[1]


def check(
    package_dir: Path = PACKAGE_DIR,
    layers: Sequence[Layer] = LAYERS,
    known_cycles: dict[frozenset[str], str] | None = None,
) -> Report:
    """Check the package at `package_dir` against `layers`; see the module docstring."""
    if known_cycles is None:
        known_cycles = KNOWN_CYCLES_BEING_REMOVED
    report = Report(layers=layers)
    patterns = [p for layer in layers for p in layer.patterns]
    for pattern in sorted({p for p in patterns if patterns.count(p) > 1}):
        report.problems.append(f"pattern {pattern!r} is listed in more than one layer")
    modules = discover_modules(package_dir)
    display_root = package_dir.resolve().parent
    for module, path in modules.items():
        layer = layer_index(module, layers)
        if layer is None:
            shown = path.relative_to(display_root).as_posix()
            report.problems.append(
                f"{shown}: module {module} is in no layer; add it to LAYERS in {THIS_MODULE}"
            )
        else:
            report.layer_of[module] = layer
    report.edges = collect_imports(modules, display_root)

    same_layer: dict[str, set[str]] = {}
    everything: dict[str, set[str]] = {}
    for edge in report.edges:
        if edge.target not in modules:
            report.problems.append(
                f"{edge.where()}: imports {edge.target}, which is no module of the package "
                f"({edge.kind})"
            )
            continue
        everything.setdefault(edge.source, set()).add(edge.target)
        if frozenset({edge.source, edge.target}) in known_cycles:
            continue
        src, dst = report.layer_of.get(edge.source), report.layer_of.get(edge.target)
        if src is None or dst is None:
            continue  # already reported as in no layer
        if dst > src:
            report.problems.append(
                f"{edge.where()}: upward import ({edge.kind}): {edge.source} in "
                f"{report.describe(src)} imports {edge.target} in {report.describe(dst)}"
            )
        elif dst == src:
            same_layer.setdefault(edge.source, set()).add(edge.target)

    for component in strongly_connected(modules, same_layer):
        members = set(component)
        layer = report.layer_of[component[0]]
        lines = [
            f"    {e.where()}: {e.source} imports {e.target} ({e.kind})"
            for e in report.edges
            if e.source in members
            and e.target in members
            and frozenset({e.source, e.target}) not in known_cycles
        ]
        report.problems.append(
            f"import cycle in {report.describe(layer)} among {', '.join(component)}:\n"
            + "\n".join(lines)
        )

    still_cyclic = [set(c) for c in strongly_connected(modules, everything)]
    for pair, why in known_cycles.items():
        if not any(pair <= component for component in still_cyclic):
            names = " <-> ".join(sorted(pair))
            report.notes.append(
                f"known cycle {names} ({why}) is gone: delete its KNOWN_CYCLES_BEING_REMOVED entry"
            )
    return report


def format_report(report: Report) -> str:
    """A human-readable verdict: the problems (or a one-line OK), then any notes."""
    lines: list[str] = []
    if report.ok:
        lines.append(
            f"OK: {len(report.layer_of)} modules in {len(report.layers)} layers, "
            f"{len(report.edges)} imports, no upward import, no import cycle."
        )
    else:
        lines.append(f"{len(report.problems)} layering problem(s):")
        lines += [f"  {problem}" for problem in sorted(report.problems)]
        lines.append("")
        lines.append("Layers, lowest first (a module may import its own layer and lower ones):")
        for i, layer in enumerate(report.layers):
            lines.append(f"  #{i} {layer.name}: {', '.join(layer.patterns)}")
    lines += [f"note: {note}" for note in report.notes]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tokenwise.tools.check_layers",
        description="Check that the package's imports respect its layer order (LAYERS).",
    )
    parser.add_argument(
        "--package-dir",
        type=Path,
        default=PACKAGE_DIR,
        help=f"the package to check (default: {PACKAGE_DIR})",
    )
    parser.add_argument(
        "--list", action="store_true", help="also print every module with its layer"
    )
    args = parser.parse_args(argv)
    if not (args.package_dir / "__init__.py").is_file():
        parser.error(f"{args.package_dir} is not a package (no __init__.py)")
    report = check(args.package_dir)
    if args.list:
        for module, layer in sorted(report.layer_of.items(), key=lambda item: (item[1], item[0])):
            print(f"#{layer:<2} {report.layers[layer].name:<20} {module}")
    print(format_report(report), file=sys.stdout if report.ok else sys.stderr)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
