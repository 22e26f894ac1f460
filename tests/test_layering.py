"""The package's imports form layers (`tokenwise.tools.check_layers`), and the check bites.

The real package must pass. Small synthetic packages written to `tmp_path` show that the check
fails on what it promises to catch (an upward import at any scope, a cycle inside a layer, a
module in no layer) and names the offending file and line. Finally every module is imported,
lowest layer first, in a fresh interpreter: the layer order is one that actually imports.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests._optional import in_ci
from tokenwise.tools.check_layers import LAYERS, Layer, check, format_report

REPO = Path(__file__).resolve().parents[1]
# Third-party packages some modules need that a local install may lack: Triton (GPU kernels)
# comes with xgrammar on Linux x86_64 only. Under CI (`CI=true`) nothing is optional.
OPTIONAL_DEPENDENCIES = () if in_ci() else ("triton",)


def write_package(root: Path, files: dict[str, str]) -> Path:
    """Write `{relative path: source}` under `root`; returns the package directory."""
    for relative, source in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    return root / next(iter(files)).split("/")[0]


def run_checker(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "tokenwise.tools.check_layers", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)


# A toy package with three layers: `toy.low` < `toy.mid.*` < `toy.high` (and the root).
TOY_LAYERS = (
    Layer("low", ("toy.low",)),
    Layer("mid", ("toy.mid.*",)),
    Layer("high", ("toy.high", "toy")),
)


# ---- the real package ----------------------------------------------------------------------


def test_the_package_respects_its_layers() -> None:
    report = check()
    assert report.ok, format_report(report)
    # No stale KNOWN_CYCLES_BEING_REMOVED entry (one naming no real module is stale too): see
    # the planted cycle below for an exemption that holds and one that went stale.
    assert not report.notes, format_report(report)
    assert set(report.layer_of.values()) >= {0, len(LAYERS) - 1}


def test_the_command_passes_on_the_package() -> None:
    proc = run_checker()
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("OK: "), proc.stdout


def test_every_module_imports_in_layer_order() -> None:
    report = check()
    order = sorted(report.layer_of, key=lambda module: (report.layer_of[module], module))
    script = textwrap.dedent(
        """
        import importlib, sys
        optional = set(sys.argv[1].split(","))
        for name in sys.argv[2:]:
            try:
                importlib.import_module(name)
            except ModuleNotFoundError as e:
                if (e.name or "").split(".")[0] not in optional:
                    raise
                print("skipped", name, "(needs", e.name + ")")
        print("imported in order:", len(sys.argv) - 2)
        """
    )
    cmd = [sys.executable, "-c", script, ",".join(OPTIONAL_DEPENDENCIES), *order]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert f"imported in order: {len(order)}" in proc.stdout


# ---- the check fails on what it promises to catch ------------------------------------------


def test_a_planted_upward_import_fails_and_is_named(tmp_path: Path) -> None:
    """A fake `tokenwise` checked against the real LAYERS: config (lowest) imports the engine."""
    package = write_package(
        tmp_path,
        {
            "tokenwise/__init__.py": "",
            "tokenwise/config.py": """\
                import os


                def engine_class():
                    from tokenwise.engine.llm_engine import LLMEngine

                    return LLMEngine
                """,
            "tokenwise/engine/__init__.py": "",
            "tokenwise/engine/llm_engine.py": "from tokenwise.config import engine_class\n",
        },
    )
    proc = run_checker("--package-dir", str(package))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 layering problem(s):" in proc.stderr
    assert (
        "tokenwise/config.py:5: upward import (function-level): tokenwise.config in layer "
        "'foundation' (#0) imports tokenwise.engine.llm_engine in layer 'engine loop'"
    ) in proc.stderr
    assert "llm_engine.py" not in proc.stderr  # the downward import is fine


def test_type_checking_and_relative_imports_count(tmp_path: Path) -> None:
    package = write_package(
        tmp_path,
        {
            "toy/__init__.py": "",
            "toy/high.py": "X = 1\n",
            "toy/low.py": """\
                from typing import TYPE_CHECKING

                if TYPE_CHECKING:
                    from .mid import thing
                else:
                    from toy import high
                """,
            "toy/mid/__init__.py": "",
            "toy/mid/thing.py": "from ..low import TYPE_CHECKING\n",
        },
    )
    report = check(package, TOY_LAYERS, known_cycles={})
    assert sorted(report.problems) == [
        "toy/low.py:4: upward import (TYPE_CHECKING): toy.low in layer 'low' (#0) imports "
        "toy.mid.thing in layer 'mid' (#1)",
        "toy/low.py:6: upward import (module-level): toy.low in layer 'low' (#0) imports "
        "toy.high in layer 'high' (#2)",
    ]


def test_a_cycle_inside_a_layer_fails_and_its_imports_are_named(tmp_path: Path) -> None:
    files = {
        "toy/__init__.py": "",
        "toy/mid/__init__.py": "",
        "toy/mid/a.py": "from toy.mid.b import B\n\nA = 1\n",
        "toy/mid/b.py": "B = 2\n\n\ndef f():\n    from toy.mid import a\n\n    return a\n",
    }
    package = write_package(tmp_path, files)
    report = check(package, TOY_LAYERS, known_cycles={})
    assert report.problems == [
        "import cycle in layer 'mid' (#1) among toy.mid.a, toy.mid.b:\n"
        "    toy/mid/a.py:1: toy.mid.a imports toy.mid.b (module-level)\n"
        "    toy/mid/b.py:5: toy.mid.b imports toy.mid.a (function-level)"
    ]

    # Allow-listed while being removed: it passes, and says nothing more.
    known = {frozenset({"toy.mid.a", "toy.mid.b"}): "being split"}
    report = check(package, TOY_LAYERS, known_cycles=known)
    assert report.ok and not report.notes

    # An entry that names no real module exempts nothing and is reported as stale.
    typo = {frozenset({"toy.mid.a", "toy.mid.bb"}): "misspelt"}
    report = check(package, TOY_LAYERS, known_cycles=typo)
    assert len(report.problems) == 1 and report.problems[0].startswith("import cycle")
    assert report.notes == [
        "known cycle toy.mid.a <-> toy.mid.bb (misspelt) is gone: delete its "
        "KNOWN_CYCLES_BEING_REMOVED entry"
    ]

    # Once the circle is gone, the check asks for the entry to be deleted.
    (package / "mid" / "b.py").write_text("B = 2\n")
    report = check(package, TOY_LAYERS, known_cycles=known)
    assert report.ok
    assert report.notes == [
        "known cycle toy.mid.a <-> toy.mid.b (being split) is gone: delete its "
        "KNOWN_CYCLES_BEING_REMOVED entry"
    ]


def test_a_module_in_no_layer_or_a_missing_module_fails(tmp_path: Path) -> None:
    package = write_package(
        tmp_path,
        {
            "toy/__init__.py": "",
            "toy/low.py": "import toy.gone\n",
            "toy/stray.py": "",
        },
    )
    report = check(package, TOY_LAYERS, known_cycles={})
    assert sorted(report.problems) == [
        "toy/low.py:1: imports toy.gone, which is no module of the package (module-level)",
        "toy/stray.py: module toy.stray is in no layer; add it to LAYERS in "
        "tokenwise.tools.check_layers",
    ]
