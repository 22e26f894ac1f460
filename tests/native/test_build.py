"""`native.build`: one cache directory, and one clear warning when there is no C compiler."""

from __future__ import annotations

import logging

import pytest

from tokenwise.native import build, fused, graph


def test_no_compiler_is_said_once_naming_what_to_install(monkeypatch, caplog) -> None:
    monkeypatch.setattr(build, "find_compiler", lambda: None)
    build._warn_no_compiler.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="tokenwise.native.build"):
            assert fused.KERNEL.load(fused.FLAGS, fused.open_library) is None
            assert graph.KERNEL.load(build.BASE_FLAGS, graph.open_library) is None
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1
        assert "no C compiler" in warnings[0].message and "gcc" in warnings[0].message
        # Each kernel still says, at INFO, what its callers do instead.
        assert "layers keep their torch ops" in caplog.text
        assert "decode steps run eagerly" in caplog.text
    finally:
        build._warn_no_compiler.cache_clear()


@pytest.mark.skipif(build.find_compiler() is None, reason="no C compiler")
def test_every_kernel_is_cached_in_one_directory(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TOKENWISE_KERNEL_CACHE", str(tmp_path))
    lib = graph.KERNEL.load(build.BASE_FLAGS, graph.open_library)
    assert lib is not None
    built = [p.name for p in tmp_path.iterdir()]
    assert len(built) == 1 and built[0].startswith("graph_") and built[0].endswith(".so")
    again = graph.KERNEL.load(build.BASE_FLAGS, graph.open_library)  # from the cache: no rebuild
    assert again is not None and [p.name for p in tmp_path.iterdir()] == built
