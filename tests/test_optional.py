"""`tests._optional`: a missing optional dependency skips locally and fails under CI=true."""

from __future__ import annotations

import pytest

from tests._optional import require

MISSING = "tokenwise_no_such_module"


def test_a_present_module_is_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    assert require("json").dumps([1]) == "[1]"


def test_a_missing_module_skips_outside_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match=f"needs {MISSING}"):
        require(MISSING)


@pytest.mark.parametrize("value", ["true", "TRUE"])
def test_a_missing_module_fails_under_ci(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("CI", value)
    with pytest.raises(pytest.fail.Exception, match=f"needs {MISSING}.*CI=true"):
        require(MISSING)
