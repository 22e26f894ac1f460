"""Optional test dependencies: skipped on a developer's machine, required under CI.

A test that needs a package (Triton, say) skips where it is missing so that a partial local
install still runs the rest; under CI (`CI=true`, as CI services set it) the same absence fails
the test, so a broken CI environment cannot turn tests into silent skips.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def skip_or_fail_in_ci(reason: str) -> None:
    """`pytest.skip(reason)`, or `pytest.fail(reason)` under CI."""
    if in_ci():
        pytest.fail(f"{reason} (CI=true: a missing dependency fails instead of skipping)")
    pytest.skip(reason, allow_module_level=True)


def require(module: str, why: str = "") -> ModuleType:
    """Import `module`; if it is missing, skip the test (module) or, under CI, fail it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        skip_or_fail_in_ci(f"needs {module}{': ' + why if why else ''} ({exc})")
        raise  # unreachable: skip and fail both raise
