"""Compile a native kernel at first use, for this very CPU, cache it, and load it.

Every kernel of `tokenwise/native/` is plain C called through ctypes (no PyTorch headers), so
a build takes about a second. Libraries are built with `-march=native` (or
`-march=$TOKENWISE_CPU_MARCH`, e.g. `haswell` to run the AVX2 path on an AVX-512 machine) and cached under one
directory, `~/.cache/tokenwise/kernels` (or `$TOKENWISE_KERNEL_CACHE`), keyed by the source,
the headers beside it, the flags and the CPU's feature flags, so a shared home directory never
hands one machine another machine's binary.

`load` is the one way a kernel's wrapper gets its library: where no compiler is found or the
build fails it logs why (once per process for a missing compiler, naming what to install) and
returns None, and the wrapper's callers keep their PyTorch code: the engine works either way.

Threads: when torch's OpenMP runtime is GNU libgomp (the PyPI wheels ship one), kernels are
built with `-fopenmp` and bind to that very runtime (the library of that soname is already
loaded, so the loader reuses it): they then run on the threads torch's matmuls just used. A
separate thread pool was measured competing with those threads while they spin-wait for their
next parallel region (decode attention took 1.5x longer inside the engine than alone).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from tokenwise import envs

logger = logging.getLogger(__name__)

NATIVE_DIR = Path(__file__).parent
# -ffast-math's parts, but not the flag itself: given it, GCC links crtfastmath.o into the .so,
# whose constructor turns on flush-to-zero for the loading thread, changing every later float
# operation of that thread (torch's included) on subnormal values.
FAST_MATH = [
    "-fno-math-errno",
    "-fno-trapping-math",
    "-ffinite-math-only",
    "-fno-signed-zeros",
    "-fassociative-math",
    "-freciprocal-math",
]
BASE_FLAGS = ["-O3", "-march=native", "-shared", "-fPIC"]
OPENMP_FLAGS = [*BASE_FLAGS, "-fopenmp"]


def kernels_switched_off() -> bool:
    """Whether `TOKENWISE_CPU_KERNELS=0` switches the decode kernels (attention, the gated
    delta rule) off, their callers then running their torch code."""
    return envs.get("TOKENWISE_CPU_KERNELS") == "0"


def source(name: str) -> Path:
    """The path of `name` (e.g. "gemv.c") in this folder."""
    return NATIVE_DIR / name


def cpu_flags() -> str:
    """The `flags` line of /proc/cpuinfo ("" where unreadable): part of every cache key."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def cache_dir() -> Path:
    root = envs.get("TOKENWISE_KERNEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "tokenwise" / "kernels"


@cache
def torch_uses_libgomp() -> bool:
    """Whether the OpenMP runtime loaded with torch is GNU libgomp (checked in this process's
    memory map, so it names the library torch really loaded)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return False
    return "libgomp" in maps and "libiomp" not in maps


def with_torch_openmp(flags: list[str]) -> list[str]:
    """`flags` plus `-fopenmp` where torch's OpenMP runtime is libgomp (the kernel then shares
    its threads; see the module docstring), else `flags` alone (the kernel runs serially)."""
    return [*flags, "-fopenmp"] if torch_uses_libgomp() else flags


# One compiler run's bound. qgemv.c at -O3 -march=haswell took over 120 s (the former bound) on
# a shared 2-core machine at load ~20; a build cut short leaves its layers on torch ops (slower
# decode) for the whole process, so the bound is generous: it is paid once per cache key.
BUILD_TIMEOUT_S = 900


def find_compiler() -> str | None:
    """`$CC` (default `cc`), else `gcc`, as a path; None when neither is installed."""
    return shutil.which(envs.external("CC") or "cc") or shutil.which("gcc")


def build(compiler: str, source: Path, stem: str, flags: list[str]) -> Path:
    """The library built from `source` with `flags`, from the cache when already built.

    Raises `subprocess.CalledProcessError` (its `stderr` holds the compiler's message),
    `subprocess.TimeoutExpired` or `OSError` when the build fails.
    """
    # One switch for every kernel's target: `-march=native` becomes `$TOKENWISE_CPU_MARCH`.
    march = envs.get("TOKENWISE_CPU_MARCH") or "native"
    flags = [f"-march={march}" if flag == "-march=native" else flag for flag in flags]
    # Headers beside the source (`#include "..."`) are part of the key: a changed header rebuilds.
    headers = b"".join(path.read_bytes() for path in sorted(source.parent.glob("*.h")))
    key = hashlib.sha256(
        source.read_bytes() + headers + " ".join(flags).encode() + cpu_flags().encode()
    ).hexdigest()[:16]
    target = cache_dir() / f"{stem}_{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent builders never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *flags, "-o", tmp, str(source), "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
        )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@cache
def _warn_no_compiler() -> None:
    """Said once per process: every kernel would otherwise repeat it."""
    logger.warning(
        "no C compiler found (looked for %r and 'gcc' on PATH): tokenwise's native CPU kernels "
        "are not built and their callers run PyTorch code instead (same results, slower). "
        "Install gcc, or set CC to a C compiler, to use them.",
        (envs.external("CC") or "cc"),
    )


@dataclass(frozen=True)
class Kernel:
    """One C file of this folder, and what to tell the user when it cannot be built: `what`
    names it, `fallback` says what its callers do without it."""

    file: str
    what: str
    fallback: str
    # Used only where torch's OpenMP runtime is libgomp, whose threads it then shares.
    needs_libgomp: bool = False

    @property
    def source(self) -> Path:
        return NATIVE_DIR / self.file

    def load(
        self,
        flags: list[str],
        opener: Callable[[Path], ctypes.CDLL],
        *,
        switchable: bool = False,
    ) -> ctypes.CDLL | None:
        """`load` of this kernel, cached as `<file stem>_<key>.so`; a `switchable` kernel (the
        decode kernels) is None while `TOKENWISE_CPU_KERNELS=0` switches those off."""
        if switchable and kernels_switched_off():
            return None
        if self.needs_libgomp and not torch_uses_libgomp():
            logger.info("%s not used: torch's OpenMP runtime is not libgomp", self.what)
            return None
        return load(
            self.source,
            self.source.stem,
            flags,
            what=self.what,
            fallback=self.fallback,
            opener=opener,
        )


def load(
    source: Path,
    stem: str,
    flags: list[str],
    *,
    what: str,
    fallback: str,
    opener: Callable[[Path], ctypes.CDLL] | None = None,
) -> ctypes.CDLL | None:
    """The library of `source` built with `flags` (cached as `stem_<key>.so`) and opened by
    `opener` (which types its functions; plain `ctypes.CDLL` by default), or None, logged,
    where no compiler is found or the build or the loading fails. `what` names the kernel
    and `fallback` what its callers do without it, for that message."""
    compiler = find_compiler()
    if compiler is None:
        _warn_no_compiler()
        logger.info("%s not built (no C compiler): %s", what, fallback)
        return None
    try:
        path = build(compiler, source, stem, flags)
        return opener(path) if opener is not None else ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("%s failed to build or load, %s: %s", what, fallback, detail)
        return None
