"""The documentation: README and docs/ links resolve, and the site builds with `--strict`.

The strict MkDocs build (mkdocs.yml) fails on a dead link or anchor between pages, a page left
out of the nav, and a link to a repository file that does not exist; the link check below
covers the same files as plain Markdown on disk, the way the forge shows them, including the
README's links to files outside docs/. The two together take about two seconds.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests._optional import require

REPO = Path(__file__).resolve().parent.parent
# `[text](target)` / `![alt](target)`, with the target's `#anchor` apart.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s#]*)(#[^)\s]*)?\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def markdown_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))] + sorted(
        (REPO / "benchmarks").glob("*.md")
    )


def links(path: Path) -> list[tuple[str, str]]:
    """(target, anchor) of every link outside code blocks."""
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return [(m.group(1), m.group(2) or "") for m in LINK.finditer(text)]


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def test_relative_links_resolve_on_disk() -> None:
    dead = []
    for path in markdown_files():
        for target, _anchor in links(path):
            if not target or "://" in target or target.startswith("mailto:"):
                continue
            if not (path.parent / target).exists():
                dead.append(f"{path.relative_to(REPO)}: {target}")
    assert not dead, "links to files that do not exist:\n" + "\n".join(dead)


def test_readme_anchors_name_its_headings() -> None:
    text = FENCE.sub("", (REPO / "README.md").read_text(encoding="utf-8"))
    slugs = {github_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}
    missing = [a for t, a in links(REPO / "README.md") if not t and a[1:] not in slugs]
    assert not missing, f"README anchors with no heading: {missing}"


def test_readme_stays_a_guide() -> None:
    """Reference material belongs in docs/: the README is the entry point (issue 47)."""
    lines = (REPO / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 400, f"README.md has {lines} lines; move reference material to docs/"


def test_code_cites_documents_in_the_repository() -> None:
    """Comments cite docs/forward-context.md and docs/performance.md, which exist here."""
    stale = []
    for path in (REPO / "tokenwise").rglob("*"):
        if path.suffix in (".py", ".c", ".h") and path.is_file():
            text = path.read_text(encoding="utf-8", errors="replace")
            if re.search(r"\bSPEC §|SPEC\.md|PERF_NOTES", text):
                stale.append(str(path.relative_to(REPO)))
    assert not stale, f"cite docs/ pages instead of SPEC / PERF_NOTES: {stale}"


def load_hooks():
    require("mkdocs", "the documentation site")
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", REPO / "tools/mkdocs_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("page", "link", "expected"),
    [
        # The README is the site's home page: its docs/ links lose the folder.
        ("index.md", "[a](docs/serving.md#limits)", "[a](serving.md#limits)"),
        ("index.md", "[r](benchmarks/RESULTS.md)", "[r](benchmarks/RESULTS.md)"),
        # A docs page reaches the benchmark pages, which the site holds under benchmarks/.
        ("performance.md", "[r](../benchmarks/RESULTS.md)", "[r](benchmarks/RESULTS.md)"),
        ("serving.md", "![c](ui-chat.png)", "![c](ui-chat.png)"),
        # From a benchmark page back to the docs and the README.
        ("benchmarks/RESULTS.md", "[k](../docs/kv-cache.md)", "[k](../kv-cache.md)"),
        ("benchmarks/RESULTS.md", "[h](../README.md)", "[h](../index.md)"),
        # A source file exists but is not on the site: its text stays, the link goes.
        ("index.md", "[card](tokenwise/models_data/default/README.md)", "card"),
        # A missing file keeps its link, so the strict build reports it.
        ("index.md", "[x](docs/missing.md)", "[x](missing.md)"),
        ("index.md", "[y](no/such/file.py)", "[y](no/such/file.py)"),
        ("lora.md", "[w](https://example.com/a.md)", "[w](https://example.com/a.md)"),
    ],
)
def test_site_links_map_repository_paths_to_pages(page: str, link: str, expected: str) -> None:
    assert load_hooks().rewrite_links(link, page) == expected


def test_site_builds_strictly(tmp_path: Path) -> None:
    require("mkdocs", "the documentation site")
    require("material", "the site's theme (mkdocs-material)")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=REPO,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr[-4000:]}"
    home = (tmp_path / "index.html").read_text(encoding="utf-8")
    assert 'href="serving/"' in home  # the README's docs/ links point at the pages
    assert (tmp_path / "benchmarks" / "RESULTS" / "index.html").exists()
