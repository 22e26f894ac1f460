"""`tokenwise.tools.llamacpp_source`: the cached llama.cpp tree is found, a cached sdist is
unpacked without a download, and a failed fetch fails the command only when `--required`
(the Makefile passes it under CI=true). No network: the sdist here is a tiny stand-in."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

from tokenwise.tools import llamacpp_source as src


def _fake_sdist(cache: Path) -> None:
    tree = cache / "build" / "llama_cpp_python-9.9.9" / "vendor" / "llama.cpp"
    tree.mkdir(parents=True)
    (tree / "convert_hf_to_gguf.py").write_text("# converter\n")
    with tarfile.open(cache / "llama_cpp_python-9.9.9.tar.gz", "w:gz") as tar:
        tar.add(tree.parent.parent, arcname="llama_cpp_python-9.9.9")


def test_a_cached_sdist_is_unpacked_without_a_download(tmp_path: Path, monkeypatch) -> None:
    _fake_sdist(tmp_path)
    assert src.find_source(tmp_path) is None  # only the tarball so far

    def no_pip(cmd, timeout, what):
        assert cmd[0] == "tar", f"unexpected command {cmd}"
        return real_run(cmd, timeout, what)

    real_run = src._run
    monkeypatch.setattr(src, "_run", no_pip)
    found = src.llama_cpp_source(tmp_path)
    assert found == tmp_path / "llama_cpp_python-9.9.9" / "vendor" / "llama.cpp"
    assert (found / "convert_hf_to_gguf.py").read_text() == "# converter\n"
    monkeypatch.setattr(src, "_run", lambda *a: pytest.fail("a found tree runs nothing"))
    assert src.llama_cpp_source(tmp_path) == found


def test_a_tree_without_the_converter_is_not_taken(tmp_path: Path) -> None:
    (tmp_path / "llama_cpp_python-1.0" / "vendor" / "llama.cpp").mkdir(parents=True)
    assert src.find_source(tmp_path) is None


def test_a_failed_fetch_fails_only_when_required(tmp_path: Path, monkeypatch, capsys) -> None:
    def offline(cache: Path) -> Path:
        raise src.SourceUnavailable("pip download of llama-cpp-python failed (exit 1)")

    monkeypatch.setattr(src, "llama_cpp_source", offline)
    assert src.main(["--cache-dir", str(tmp_path)]) == 0
    assert "will be skipped" in capsys.readouterr().out
    assert src.main(["--cache-dir", str(tmp_path), "--required"]) == 1
    assert "pip download of llama-cpp-python failed" in capsys.readouterr().err
