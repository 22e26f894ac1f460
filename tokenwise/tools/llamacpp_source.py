"""llama.cpp's source as the `llama-cpp-python` sdist vendors it, fetched once into a cache.

    python -m tokenwise.tools.llamacpp_source [--cache-dir DIR] [--required]

(silent when the tree is already there; otherwise it prints what it fetches and where).

Two users want the same tree: `benchmarks/vs_llamacpp.py` builds `llama-server` from it and
converts its checkpoints with its `convert_hf_to_gguf.py`; the GGUF tests
(`tests/quantization/test_gguf_hybrids.py`) run that converter on tiny hybrids to check that our
own writer produces the same file. llama.cpp ships no wheel with the converter, but
llama-cpp-python's sdist carries the whole of llama.cpp under `vendor/llama.cpp`
(`convert_hf_to_gguf.py`, its `conversion/` package and `gguf-py/`), so a pinned version of it
is downloaded with pip (the ordinary client, `--no-binary :all:` so pip fetches the sdist and
builds nothing) and unpacked beside the tarball. A tree already there is reused without any
network access.

`make test` runs this first (the Makefile's `llamacpp-converter` step). Where the download
fails (no network) the tests that need the converter skip, except under CI: the Makefile
passes `--required` when `CI=true`, and this command then fails, so that CI never passes by
skipping them.
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import time
from pathlib import Path

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
DEFAULT_CACHE = Path("~/.cache/tokenwise/llamacpp").expanduser()
# Bounds on the two slow steps (measured: 10-24 s and 2 s on a shared 2-core VM).
DOWNLOAD_TIMEOUT_S = 900.0
UNPACK_TIMEOUT_S = 600.0


class SourceUnavailable(RuntimeError):
    """llama.cpp's source is not in the cache and could not be fetched (the message says why)."""


def find_source(cache: Path = DEFAULT_CACHE) -> Path | None:
    """The unpacked `vendor/llama.cpp` holding `convert_hf_to_gguf.py` in `cache`, or None."""
    found = sorted(glob.glob(str(cache / "llama_cpp_python-*" / "vendor" / "llama.cpp")))
    ok = [Path(p) for p in found if os.path.isfile(os.path.join(p, "convert_hf_to_gguf.py"))]
    return ok[-1] if ok else None


def _run(cmd: list[str], timeout: float, what: str) -> None:
    print(f"$ {' '.join(cmd)}", flush=True)
    try:
        subprocess.run(cmd, check=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SourceUnavailable(f"{what} took over {timeout:.0f} s") from None
    except subprocess.CalledProcessError as exc:
        raise SourceUnavailable(f"{what} failed (exit {exc.returncode})") from None


def llama_cpp_source(cache: Path = DEFAULT_CACHE) -> Path:
    """The vendored llama.cpp of the pinned llama-cpp-python sdist: found in `cache`, else
    downloaded (pip) and unpacked there. Raises `SourceUnavailable` when neither works."""
    if (found := find_source(cache)) is not None:
        return found
    cache.mkdir(parents=True, exist_ok=True)
    tarballs = sorted(glob.glob(str(cache / "llama_cpp_python-*.tar.gz")))
    if not tarballs:
        pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "download"]
        pip += ["--no-deps", "--no-binary", ":all:", LLAMA_CPP_PYTHON, "-d", str(cache)]
        _run(pip, DOWNLOAD_TIMEOUT_S, f"pip download of {LLAMA_CPP_PYTHON}")
        tarballs = sorted(glob.glob(str(cache / "llama_cpp_python-*.tar.gz")))
        if not tarballs:
            raise SourceUnavailable(f"no llama_cpp_python-*.tar.gz in {cache} after the download")
    _run(["tar", "xzf", tarballs[-1], "-C", str(cache)], UNPACK_TIMEOUT_S, "unpacking the sdist")
    if (found := find_source(cache)) is None:
        raise SourceUnavailable(f"{tarballs[-1]} holds no vendor/llama.cpp/convert_hf_to_gguf.py")
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    p.add_argument(
        "--required",
        action="store_true",
        help="exit 1 when the source cannot be had (CI), rather than noting that tests will skip",
    )
    args = p.parse_args(argv)
    if find_source(args.cache_dir) is not None:
        return 0
    start = time.monotonic()
    print(f"Fetching llama.cpp's converter ({LLAMA_CPP_PYTHON} sdist) into {args.cache_dir}...")
    try:
        found = llama_cpp_source(args.cache_dir)
    except SourceUnavailable as exc:
        if args.required:
            print(f"error: llama.cpp's converter is required: {exc}", file=sys.stderr)
            return 1
        print(f"note: {exc}; the tests that run llama.cpp's converter will be skipped")
        return 0
    print(f"{found} ({time.monotonic() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
