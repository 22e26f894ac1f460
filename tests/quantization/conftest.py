"""Fixtures of the quantization tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tokenwise.native import build as native_build
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


@pytest.fixture(scope="session")
def haswell_qgemv(tmp_path_factory) -> tuple[Path, Path]:
    """The quantized kernel built with TOKENWISE_CPU_MARCH=haswell into a fresh kernel cache:
    (the library, that cache). One build for every test of the AVX2+FMA code (a few minutes
    of compiler time on a loaded 2-core machine)."""
    cache = tmp_path_factory.mktemp("haswell-kernels")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TOKENWISE_CPU_MARCH", "haswell")
        mp.setenv("TOKENWISE_KERNEL_CACHE", str(cache))
        path = native_build.build(
            native_build.find_compiler(), cpu_qgemv.KERNEL.source, "qgemv", cpu_qgemv.flags()
        )
    return path, cache
