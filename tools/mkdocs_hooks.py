"""MkDocs hooks: the site is the README plus `docs/`, with links written for the repository.

Every Markdown file in the repository links to the others by its path in the repository
(`docs/serving.md` from the README, `../benchmarks/RESULTS.md` from a docs page), so the links
work where people read them first: on the forge and in an editor. The site has a different
shape (the README is its home page, `docs/` its root), so this hook

- adds the README as the site's `index.md` and the benchmark documents it links to
  (`benchmarks/README.md`, `benchmarks/RESULTS.md`) as pages of their own, and
- rewrites each relative link from its repository path to the page it became on the site.

A link to a file that does not exist stays as written, so `mkdocs build --strict` reports it
as a dead link instead of the site silently pointing nowhere.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

REPO = Path(__file__).resolve().parent.parent

# Repository path -> page on the site (its `src_uri`), for files outside `docs/`.
EXTRA_PAGES = {
    "README.md": "index.md",
    "benchmarks/README.md": "benchmarks/README.md",
    "benchmarks/RESULTS.md": "benchmarks/RESULTS.md",
}

# `[text](target)` and `![alt](target)`; the target stops at whitespace, `)` or `#`.
_LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s#]+)([^)\s]*)\)")


def _repo_path_of(src_uri: str) -> str:
    """The repository path of a site page."""
    for repo_path, uri in EXTRA_PAGES.items():
        if uri == src_uri:
            return repo_path
    return f"docs/{src_uri}"


def _site_path_of(repo_path: str) -> str | None:
    """The site path of a repository file, or None when it is not on the site."""
    if repo_path in EXTRA_PAGES:
        return EXTRA_PAGES[repo_path]
    if repo_path.startswith("docs/"):
        return repo_path[len("docs/") :]
    return None


def rewrite_links(markdown: str, src_uri: str) -> str:
    """Each relative link of the page at `src_uri`, from repository path to site path.

    A link to a repository file that is not on the site (a source file, a model card) becomes
    its text: the site has no copy to point at. A link to a file that does not exist stays, so
    the strict build fails on it.
    """
    page_dir = posixpath.dirname(_repo_path_of(src_uri))
    site_dir = posixpath.dirname(src_uri)

    def replace(match: re.Match[str]) -> str:
        bang, text, target, rest = match.groups()
        if "://" in target or target.startswith(("mailto:", "/")):
            return match.group(0)
        repo_path = posixpath.normpath(posixpath.join(page_dir, target))
        site_path = _site_path_of(repo_path)
        if site_path is None:
            return text if not bang and (REPO / repo_path).exists() else match.group(0)
        return f"{bang}[{text}]({posixpath.relpath(site_path, site_dir or '.')}{rest})"

    return _LINK.sub(replace, markdown)


def on_files(files, config):
    for repo_path, src_uri in EXTRA_PAGES.items():
        text = (REPO / repo_path).read_text(encoding="utf-8")
        files.append(File.generated(config, src_uri, content=text))
    return files


def on_page_markdown(markdown, page, config, files):
    return rewrite_links(markdown, page.file.src_uri)
