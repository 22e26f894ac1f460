"""`tokenwise.envs`: every `TOKENWISE_*` variable the package names is declared; nothing else
reads `os.environ`; an undeclared variable warns; the docs page is what the declarations say."""

from __future__ import annotations

import logging
import re
from dataclasses import fields
from pathlib import Path

import pytest

from tokenwise import envs
from tokenwise.entrypoints.config_docs import render
from tokenwise.entrypoints.engine_args import EngineArgs

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tokenwise"


def _sources() -> list[tuple[Path, str]]:
    return [(p, p.read_text(encoding="utf-8")) for p in sorted(PACKAGE.rglob("*.py"))]


def test_every_named_variable_is_declared() -> None:
    named = set()
    for _, text in _sources():
        named |= set(re.findall(r"\bTOKENWISE_[A-Z0-9_]*[A-Z0-9]\b", text))
    named -= {"TOKENWISE_IMAGE_FETCH"}  # prose: "TOKENWISE_IMAGE_FETCH_* values"
    assert named - set(envs.ENV_VARS) == set()


def test_only_envs_reads_the_environment() -> None:
    readers = [p.relative_to(ROOT) for p, text in _sources() if "os.environ" in text]
    assert readers == [Path("tokenwise/envs.py")]


def test_get_reads_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOKENWISE_STEP_RECORDS", raising=False)
    assert envs.get("TOKENWISE_STEP_RECORDS") == "2048"
    monkeypatch.setenv("TOKENWISE_STEP_RECORDS", "7")
    assert envs.get("TOKENWISE_STEP_RECORDS") == "7"
    with pytest.raises(KeyError, match="TOKENWISE_NOPE is not declared"):
        envs.get("TOKENWISE_NOPE")


def test_undeclared_variable_warns_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TOKENWISE_CPU_GEMM", "0")  # a typo of TOKENWISE_CPU_GEMV
    monkeypatch.setattr(envs, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="tokenwise"):
        assert envs.warn_undeclared() == ["TOKENWISE_CPU_GEMM"]
        assert envs.warn_undeclared() == []
    assert "TOKENWISE_CPU_GEMM is not a tokenwise setting" in caplog.text


def test_docs_page_is_generated_from_the_declarations() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert page == render(), (
        "run: python -m tokenwise.entrypoints.config_docs > docs/configuration.md"
    )
    for name in envs.ENV_VARS:
        assert f"`{name}`" in page
    for f in fields(EngineArgs):
        assert f"| `{f.name}` |" in page
