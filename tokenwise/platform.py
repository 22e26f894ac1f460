"""Process-level settings that make CPU inference fast and its timings stable."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import mmap
import os

import torch

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_configured = False


def configure_cpu_allocator(threshold_bytes: int = 1 << 30) -> bool:
    """Keep large freed blocks in the heap instead of returning them to the OS.

    glibc hands allocations >= 32 MB back to the kernel on free, so every large per-step
    temporary (gathered KV blocks, logits) is page-faulted in again on the next step: measured
    here, a 100 MB KV gather took 78 ms instead of 10 ms. Raising the mmap and trim thresholds
    once at start-up removes that cost (and most of the run-to-run noise). Returns whether the
    setting was applied (it is a no-op on non-glibc platforms).
    """
    global _configured
    if _configured:
        return True
    path = ctypes.util.find_library("c")
    if path is None:
        return False
    try:
        libc = ctypes.CDLL(path)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = bool(mallopt(_M_MMAP_THRESHOLD, threshold_bytes)) and bool(
        mallopt(_M_TRIM_THRESHOLD, threshold_bytes)
    )
    _configured = ok
    logger.debug("glibc mmap/trim thresholds raised to %d bytes: %s", threshold_bytes, ok)
    return ok


_MADV_HUGEPAGE = 14
HUGE_PAGE = 2 << 20


def huge_page_buffer(nbytes: int) -> torch.Tensor | None:
    """`nbytes` of fresh zeroed memory (uint8) that the kernel backs with 2 MB pages where it
    can (transparent huge pages asked for with madvise, before the memory is first touched);
    None where the platform refuses.

    Why: decode streams every weight once per step, and with 4 KB pages each page is a TLB
    miss and a restart of the hardware prefetcher. Measured (`benchmarks/quantized_linear.py`
    shapes, int4 weights cycled through memory, 2 threads, AVX-512 Xeon): 14.7 -> 21.7 GB/s.
    Linux's default THP mode is "madvise", so memory gets huge pages only when asked.
    """
    if nbytes <= 0 or not hasattr(mmap, "MAP_ANONYMOUS"):
        return None
    size = nbytes + HUGE_PAGE  # room to start on a 2 MB boundary
    try:
        buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, ValueError):
        return None
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    start = (base + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
    libc = _libc()
    if libc is None or libc.madvise(
        ctypes.c_void_p(start), ctypes.c_size_t(base + size - start), _MADV_HUGEPAGE
    ):
        return None
    # The tensor keeps the mmap alive (torch.frombuffer holds a reference to it).
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=start - base)


_MADV_DONTNEED = 4


def release_pages(address: int, nbytes: int) -> int:
    """Hand the whole pages inside [address, address + nbytes) back to the kernel; returns the
    bytes released. The range stays mapped: the next touch of a page maps a fresh zero page.
    Partial pages at the ends may hold other data and are kept (sleep mode, `executor`)."""
    page = mmap.PAGESIZE
    start = (address + page - 1) & ~(page - 1)
    end = (address + nbytes) & ~(page - 1)
    if end <= start:
        return 0
    libc = _libc()
    if libc is None or libc.madvise(
        ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED
    ):
        errno = ctypes.get_errno() if libc is not None else 0
        raise OSError(errno, f"madvise(MADV_DONTNEED) failed: {os.strerror(errno)}")
    return end - start


@functools.cache
def _libc() -> ctypes.CDLL | None:
    path = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(path, use_errno=True) if path else None
    except OSError:
        return None


def on_huge_pages(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of contiguous `tensor` in huge-page memory (`huge_page_buffer`), or `tensor`."""
    nbytes = tensor.numel() * tensor.element_size()
    buf = huge_page_buffer(nbytes)
    if buf is None:
        return tensor
    out = buf.view(tensor.dtype).view(tensor.shape)
    out.copy_(tensor)
    return out


def release_freed_memory() -> None:
    """Hand freed heap pages back to the system: glibc keeps freed memory for reuse (and
    `configure_cpu_allocator` raises its trim threshold), so after weights are replaced by
    quantized or moved copies the process would otherwise stay as large as before."""
    libc = _libc()
    try:
        if libc is not None:
            libc.malloc_trim(0)
    except AttributeError:
        pass  # not glibc: its allocator returns large blocks by itself
