"""The replay loop of a CPU graph (`graph.c`), loaded through ctypes.

`tokenwise.compilation.cpu_graph` records a decode step's kernel calls (`trace`) and hands the
list here: `replay` calls every recorded kernel, in order, through its `_packed` entry, from C,
so none of the Python between the kernels runs again.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import numpy as np

from tokenwise.native import build

KERNEL = build.Kernel(
    "graph.c", what="the CPU graph replay loop", fallback="decode steps run eagerly"
)


@cache
def load() -> ctypes.CDLL | None:
    """The replay loop, or None where no compiler is found or the build fails."""
    return KERNEL.load(build.BASE_FLAGS, open_library)


def open_library(path: Path) -> ctypes.CDLL:
    """The built loop at `path`, its function typed."""
    lib = ctypes.CDLL(str(path))
    fn = lib.tw_graph_replay
    fn.restype = ctypes.c_int64
    fn.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.argtypes += [ctypes.POINTER(ctypes.c_int)]
    return lib


def replay(
    lib: ctypes.CDLL,
    entries: np.ndarray,
    offsets: np.ndarray,
    args: np.ndarray,
    status: ctypes.c_int,
) -> int:
    """Call kernel `entries[i]` with the int64 arguments from `args[offsets[i]]`, for every i
    in order (contiguous int64 arrays). Returns 0, or i + 1 for the first call whose kernel
    failed (its status in `status`); the calls after it are not made."""
    return lib.tw_graph_replay(
        len(entries),
        entries.ctypes.data,
        offsets.ctypes.data,
        args.ctypes.data,
        ctypes.byref(status),
    )
