"""Build, load and call the C paged-decode kernel of the CPU backend.

The kernel (`paged_decode.c`) is compiled on first use for this very CPU and cached, by
`tokenwise.native.build` (shared with every native kernel, which says how). It needs no PyTorch
headers (plain C through ctypes), so the build takes about a second.

Where no compiler is found, the build fails, or `TOKENWISE_CPU_KERNELS=0` is set, `load()`
returns None and the backend keeps its pure-PyTorch decode; the engine works either way.

Threads: when torch's OpenMP runtime is GNU libgomp (the PyPI wheels ship one), the kernel is
built with `-fopenmp` and binds to that very runtime (the library of that soname is already
loaded, so the loader reuses it): attention then runs on the threads torch's matmuls just
used. A separate thread pool was measured competing with those threads while they spin-wait
for their next parallel region: decode attention took 1.5x longer inside the engine than
alone. With another runtime (Intel's libiomp), the kernel is built without OpenMP and the
sequences are split over a small Python thread pool instead (ctypes releases the GIL).
"""

from __future__ import annotations

import ctypes
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from itertools import pairwise
from pathlib import Path

import torch

from tokenwise.native import build, trace

KERNEL = build.Kernel(
    "paged_decode.c", what="the decode-attention kernel", fallback="attention runs its torch code"
)
CFLAGS = ["-O3", "-march=native", *build.FAST_MATH, "-fopenmp-simd", "-shared", "-fPIC"]
_torch_uses_libgomp = build.torch_uses_libgomp
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# The kernel's cache dtype codes (CACHE_* in `paged_decode.c`).
_KERNEL_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}
CACHE_DTYPES = tuple(_KERNEL_CODES)
IO_DTYPES = (torch.float32, torch.bfloat16)  # queries, new K/V rows and outputs of a step
# Below this many keys in a batch, one thread is cheaper than handing work to the pool.
MIN_KEYS_PER_THREAD = 4096
# With fewer sequences than threads (one stream), the kernel splits KV heads over torch's
# OpenMP threads (already awake from the matmuls) from this many keys on. One sequence, bf16
# cache, 2 threads (Xeon with avx512_bf16/AMX): 12 heads of 64 at 16 / 64 / 384 / 4096 keys
# took 1.01x / 1.17x / 1.35x / 1.54x less time split; 16 query and 8 KV heads of 128
# (Qwen3-0.6B) 1.09x / 1.25x / 1.54x / 1.62x.
MIN_KEYS_FOR_HEAD_SPLIT = 64

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


def _flags() -> list[str]:
    return build.with_torch_openmp(CFLAGS)


def kernel_code(dtype: torch.dtype) -> int:
    """The kernel's code for a cache dtype (KeyError: a dtype the kernel cannot read)."""
    return _KERNEL_CODES[dtype]


def _build(compiler: str) -> Path:
    return build.build(compiler, KERNEL.source, "paged_decode", _flags())


@cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel library, or None when it cannot be used on this machine."""
    return KERNEL.load(_flags(), open_library, switchable=True)


def open_library(path: Path) -> ctypes.CDLL:
    """The built kernel at `path`, its functions typed."""
    lib = ctypes.CDLL(str(path))
    fn = lib.paged_decode
    fn.restype = ctypes.c_int
    fn.argtypes = [_PTR, _PTR, _PTR, ctypes.c_int, _PTR, _I64, _PTR, _PTR, _I64, _I64]
    fn.argtypes += [_I64, _I64, _I64, _I64, _I64, ctypes.c_float, ctypes.c_float]
    fn.argtypes += [ctypes.c_float, ctypes.c_float, _PTR, _PTR]
    step = lib.paged_decode_step
    step.restype = ctypes.c_int
    step.argtypes = [_PTR, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR, ctypes.c_int, ctypes.c_int]
    step.argtypes += [_PTR, _I64, _PTR]
    step.argtypes += [_PTR, _I64, _I64, _I64, _I64, _I64, _I64, _I64, ctypes.c_float]
    step.argtypes += [ctypes.c_float, ctypes.c_float, ctypes.c_float, _PTR, _PTR]
    lib.paged_decode_step_packed.restype = ctypes.c_int
    lib.paged_decode_step_packed.argtypes = [_PTR]  # what a replayed CPU graph calls
    return lib


@cache
def _pool(num_threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(num_threads, thread_name_prefix="tokenwise-attn")


def _split(seq_lens: torch.Tensor, parts: int) -> list[tuple[int, int]]:
    """Contiguous sequence ranges with about equal numbers of keys each."""
    cum = seq_lens.to(torch.int64).cumsum(0)
    total = int(cum[-1])
    cuts = torch.searchsorted(cum, torch.arange(1, parts) * (total / parts)).tolist()
    bounds = [0, *[min(c + 1, len(seq_lens)) for c in cuts], len(seq_lens)]
    return [(a, b) for a, b in pairwise(bounds) if b > a]


def _num_threads(num_seqs: int, num_kv_heads: int, total_keys: int) -> int:
    """Threads for one kernel call: one below `MIN_KEYS_PER_THREAD` keys per thread; with
    fewer sequences than threads (one stream) all of them from `MIN_KEYS_FOR_HEAD_SPLIT` keys
    on, as the kernel then splits KV heads (over torch's OpenMP threads only)."""
    torch_threads = torch.get_num_threads()
    threads = min(torch_threads, num_seqs)
    if threads > 1 and total_keys < MIN_KEYS_PER_THREAD * 2:
        threads = 1
    if (
        num_seqs < torch_threads
        and num_kv_heads > 1
        and _torch_uses_libgomp()
        and total_keys >= MIN_KEYS_FOR_HEAD_SPLIT
    ):
        threads = torch_threads
    return threads


def step_usable(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor
) -> bool:
    """Whether `decode_step` can take a decode-only step's layer: its queries and new keys
    of one kernel dtype, the cache of that dtype or fp8, rows contiguous, on torch's OpenMP
    threads (libgomp; the Python-pool fallback keeps `paged_decode`)."""
    return (
        kv_cache.dtype in CACHE_DTYPES
        and kv_cache.is_contiguous()
        and query.dtype in IO_DTYPES
        and (query.dtype == kv_cache.dtype or kv_cache.dtype in FP8_DTYPES)
        and key.dtype == query.dtype
        and value.dtype == query.dtype
        and key.stride(-1) == 1
        and value.stride(-1) == 1
        and _torch_uses_libgomp()
    )


def decode_step(
    lib: ctypes.CDLL,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    first_block: torch.Tensor,
    total_keys: int | None,
    num_heads: int,
    sliding_window: int | None,
    scale: float,
    softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One layer of a decode-only step in one kernel call: write each sequence's new K/V row
    (`key`, `value`: [n, kv_heads * head], rows may be strided) into `kv_cache` ([2, blocks,
    block, kv_heads, head]) at its slot, and return the attention output `[n, heads * head]`
    in the query's dtype. `query` is [n, heads * head]; the caller checks `step_usable`. An
    fp8 cache gets the rows as `kv_quant.quantize` writes them (divided by `k_scale` /
    `v_scale`). `total_keys` (the sum of `seq_lens`, known on the host) picks the threads
    without reading a tensor; None (a CPU graph, whose lengths change at every replay) takes
    all of torch's. `sinks` (gpt-oss): contiguous float32 `[heads]` sink logits that join each
    head's softmax denominator (`sinks_f32`); it must outlive a CPU graph that records the call.
    """
    n = query.shape[0]
    _, _, block_size, num_kv_heads, head_size = kv_cache.shape
    if not query.is_contiguous():
        query = query.contiguous()
    out = torch.empty(query.shape, dtype=query.dtype)
    key_cache = kv_cache.data_ptr()  # K then V, contiguous (`step_usable`)
    threads = (
        torch.get_num_threads() if total_keys is None else _num_threads(n, num_kv_heads, total_keys)
    )
    status = trace.call(
        lib,
        "paged_decode_step",
        query.data_ptr(),
        key.data_ptr(),
        value.data_ptr(),
        key.stride(0),
        value.stride(0),
        slot_mapping.data_ptr(),
        key_cache,
        key_cache + kv_cache.stride(0) * kv_cache.element_size(),
        kernel_code(kv_cache.dtype),
        int(query.dtype == torch.bfloat16),
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        first_block.data_ptr(),
        n,
        threads,
        num_heads,
        num_kv_heads,
        head_size,
        block_size,
        sliding_window or 0,
        scale,
        softcap or 0.0,
        k_scale,
        v_scale,
        out.data_ptr(),
        None if sinks is None else sinks.data_ptr(),
    )
    if status != 0:
        raise MemoryError("paged decode kernel could not allocate its score buffer")
    return out


def paged_decode(
    lib: ctypes.CDLL,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    first_block: torch.Tensor,
    sliding_window: int | None,
    scale: float,
    out: torch.Tensor,
    softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sinks: torch.Tensor | None = None,
) -> None:
    """Decode attention of `query` [n, heads, head] over the paged cache, into `out`.

    `query` and `out` are contiguous float32, the caches contiguous float32, bfloat16 or fp8
    (read as stored * `k_scale` / `v_scale`), the
    index tensors contiguous int32, all on the CPU (the caller checks); block-table rows may be
    longer than needed. `softcap` caps each score as `cap * tanh(score / cap)` (Gemma 2);
    `sinks` (contiguous float32 `[heads]`, gpt-oss) join each head's softmax denominator.
    """
    n, num_heads, head_size = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    window = sliding_window or 0
    threads = _num_threads(n, num_kv_heads, int(seq_lens.sum()))

    def run(begin: int, end: int, num_threads: int) -> None:
        """Sequences [begin, end) through the kernel (pointers offset to `begin`)."""
        status = lib.paged_decode(
            query[begin].data_ptr(),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            kernel_code(key_cache.dtype),
            block_tables[begin].data_ptr(),
            block_tables.stride(0),
            seq_lens[begin].data_ptr(),
            first_block[begin].data_ptr(),
            end - begin,
            num_threads,
            num_heads,
            num_kv_heads,
            head_size,
            block_size,
            window,
            scale,
            softcap or 0.0,
            k_scale,
            v_scale,
            out[begin].data_ptr(),
            None if sinks is None else sinks.data_ptr(),
        )
        if status != 0:
            raise MemoryError("paged decode kernel could not allocate its score buffer")

    if threads <= 1 or _torch_uses_libgomp():
        run(0, n, threads)  # the kernel splits the sequences over OpenMP threads itself
        return
    first, *rest = _split(seq_lens, threads)
    # The calling thread takes the first range itself: one handoff fewer per layer.
    futures = [_pool(threads - 1).submit(run, a, b, 1) for a, b in rest]
    run(*first, 1)
    for future in futures:
        future.result()
