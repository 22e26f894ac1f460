"""`dtype="auto"` on CPU: bf16 only where the CPU computes it natively.

AVX-512 CPUs without bf16 instructions emulate bf16 matmuls (oneDNN reports them as supported),
and the engine was measured slower there in bf16 than in fp32; so "auto" decides by the
native-bf16 CPU flags and says why in the log when it picks fp32.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tokenwise import model_config
from tokenwise.model_config import resolve_dtype


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ({"avx2", "fma"}, torch.float32),
        ({"avx2", "avx512f", "avx512bw", "avx512_vnni"}, torch.float32),  # emulated bf16
        ({"avx512f", "avx512_bf16"}, torch.bfloat16),
        ({"avx512f", "amx_bf16", "amx_tile"}, torch.bfloat16),
    ],
)
def test_auto_picks_bf16_only_with_native_support(
    flags: set[str],
    expected: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(model_config, "_cpu_flags", lambda: flags)
    with caplog.at_level(logging.INFO, logger="tokenwise.model_config"):
        assert resolve_dtype("auto", None, "cpu") == expected
    said_why = any("no native bf16" in r.getMessage() for r in caplog.records)
    assert said_why == (expected == torch.float32)


def test_explicit_bf16_is_kept_on_any_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_config, "_cpu_flags", lambda: {"avx2"})
    assert resolve_dtype("bfloat16", None, "cpu") == torch.bfloat16
