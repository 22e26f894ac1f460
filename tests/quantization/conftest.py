"""Fixtures of the quantization tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tokenwise.native import qgemv as cpu_qgemv


@pytest.fixture
def exact_fp32_activations(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """float32 activations on the exact float path for every layer. A GGUF file's layers take
    int8 activations by default (llama.cpp's arithmetic, `cpu_qgemv.default_x_bits`); tests that
    hold such a file's output to transformers' at 1e-4 ask for exactness here (the engine-core
    process inherits the variable)."""
    monkeypatch.setenv(cpu_qgemv.FP32_ACTIVATIONS_ENV, "float")
    cpu_qgemv.fp32_activation_bits.cache_clear()
    yield
    cpu_qgemv.fp32_activation_bits.cache_clear()
