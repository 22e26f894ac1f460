"""The C paged-decode kernel against an independent reference, and its build/fallback rules."""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tokenwise.native import build as native_build
from tokenwise.native import paged_decode as cpu_paged_decode

pytestmark = pytest.mark.skipif(
    cpu_paged_decode.load() is None, reason="no C compiler: the kernel cannot be built here"
)


def _paged_case(
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    window: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> dict:
    """Random K/V per sequence, scattered over shuffled blocks of a token-major paged cache."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    # The reference reads the values the cache really holds (rounded when the cache is bf16).
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    tables, firsts, refs = [], [], []
    query = torch.randn(len(seq_lens), num_heads, head_size, generator=gen)
    for i, n in enumerate(seq_lens):
        blocks = order[: blocks_per_seq[i]]
        order = order[blocks_per_seq[i] :]
        keys = key_cache[blocks].flatten(0, 1)[:n].float()
        values = value_cache[blocks].flatten(0, 1)[:n].float()
        start = 0 if window is None else max(0, n - window)
        # Reference: plain softmax attention of the last token over its visible keys.
        group = num_heads // num_kv_heads
        k = keys[start:].repeat_interleave(group, dim=1).transpose(0, 1)
        v = values[start:].repeat_interleave(group, dim=1).transpose(0, 1)
        scores = (query[i][:, None, :] @ k.transpose(1, 2)).squeeze(1) / math.sqrt(head_size)
        refs.append((F.softmax(scores, -1)[:, None, :] @ v).squeeze(1))
        # Like the metadata builder: a windowed table may skip blocks no key is visible in.
        first = start // block_size if window is not None else 0
        tables.append(blocks[first:])
        firsts.append(first)
    width = max(len(t) for t in tables) + 2  # rows wider than needed, as in a mixed batch
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    return {
        "query": query,
        "key_cache": key_cache,
        "value_cache": value_cache,
        "block_tables": table,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "first_block": torch.tensor(firsts, dtype=torch.int32),
        "sliding_window": window,
        "scale": 1 / math.sqrt(head_size),
        "expected": torch.stack(refs),
    }


def _run(case: dict) -> torch.Tensor:
    out = torch.full_like(case["query"], float("nan"))
    args = {k: v for k, v in case.items() if k != "expected"}
    cpu_paged_decode.paged_decode(cpu_paged_decode.load(), out=out, **args)
    return out


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_size", "block_size"),
    # Head sizes off the vector width (20, 80) run the scalar tails.
    [(4, 4, 16, 16), (8, 2, 32, 16), (6, 3, 8, 5), (2, 1, 64, 1), (4, 2, 20, 16), (2, 2, 80, 3)],
)
def test_kernel_matches_reference_attention(
    heads: int, kv_heads: int, head_size: int, block_size: int
) -> None:
    case = _paged_case([1, 2, 17, 40, 129, 5], heads, kv_heads, head_size, block_size)
    torch.testing.assert_close(_run(case), case["expected"], atol=1e-5, rtol=1e-4)


def test_bf16_cache_is_widened_exactly() -> None:
    """A bf16 cache gives the fp32 result of its own (rounded) values: widening loses nothing."""
    case = _paged_case([1, 9, 33, 120], 8, 2, 32, 16, seed=5, dtype=torch.bfloat16)
    assert case["key_cache"].dtype == torch.bfloat16
    torch.testing.assert_close(_run(case), case["expected"], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("window", [1, 7, 16, 33, 500])
def test_kernel_sliding_window_with_trimmed_tables(window: int) -> None:
    case = _paged_case([3, 16, 50, 97, 200], 4, 2, 16, 8, window=window, seed=window)
    assert case["first_block"].max() > 0 or window >= 200  # trimmed rows are exercised
    torch.testing.assert_close(_run(case), case["expected"], atol=1e-5, rtol=1e-4)


def test_peaked_softmax_stays_exact() -> None:
    """Large scores: most exponentials underflow, the kernel's own exp must still agree."""
    case = _paged_case([5, 64, 130], 4, 2, 32, 16, seed=9)
    case["scale"] *= 40.0
    q, k, v = case["query"], case["key_cache"], case["value_cache"]
    expected = []
    for i, n in enumerate([5, 64, 130]):
        blocks = case["block_tables"][i, : math.ceil(n / 16)].long()
        keys = k[blocks].flatten(0, 1)[:n].repeat_interleave(2, dim=1).transpose(0, 1)
        values = v[blocks].flatten(0, 1)[:n].repeat_interleave(2, dim=1).transpose(0, 1)
        scores = (q[i][:, None, :] @ keys.transpose(1, 2)).squeeze(1) * case["scale"]
        expected.append((F.softmax(scores, -1)[:, None, :] @ values).squeeze(1))
    torch.testing.assert_close(_run(case), torch.stack(expected), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("openmp", [True, False], ids=["openmp-threads", "python-pool"])
def test_thread_split_gives_the_same_result(monkeypatch: pytest.MonkeyPatch, openmp: bool) -> None:
    case = _paged_case([300, 2, 150, 77, 1, 64, 260], 4, 2, 16, 16, seed=3)
    single = _run(case)
    monkeypatch.setattr(cpu_paged_decode, "MIN_KEYS_PER_THREAD", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    monkeypatch.setattr(cpu_paged_decode, "_torch_uses_libgomp", lambda: openmp)
    torch.testing.assert_close(_run(case), single, atol=0, rtol=0)
    torch.testing.assert_close(single, case["expected"], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("threads", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 20])
def test_fewer_sequences_than_threads_split_kv_heads(
    monkeypatch: pytest.MonkeyPatch, threads: int, dtype: torch.dtype, window: int | None
) -> None:
    """One stream (or a few): the kernel splits KV heads over the threads, same attention.

    3 KV heads over 2 or 4 threads leaves uneven shares and a thread capped away.
    """
    lens = [200] if threads == 2 else [200, 37]  # fewer sequences than threads
    case = _paged_case(lens, 6, 3, 32, 16, window=window, seed=threads, dtype=dtype)
    single = _run(case)
    lib = cpu_paged_decode.load()
    seen: list[int] = []
    kernel = lib.paged_decode

    def recording(*args: object) -> int:
        seen.append(int(args[9]))  # num_threads
        return kernel(*args)

    monkeypatch.setattr(lib, "paged_decode", recording)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    monkeypatch.setattr(cpu_paged_decode, "_torch_uses_libgomp", lambda: True)
    split = _run(case)
    assert seen == [threads]  # the kernel was handed every thread, not one per sequence
    torch.testing.assert_close(split, single, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(split, case["expected"], atol=1e-5, rtol=1e-4)


def test_kernel_shares_torchs_openmp_runtime() -> None:
    """Built with OpenMP, the kernel must bind to the libgomp torch loaded, not a second one
    whose threads would compete with torch's."""
    if not cpu_paged_decode._torch_uses_libgomp():
        pytest.skip("torch's OpenMP runtime is not libgomp here: the kernel uses a thread pool")
    # In a fresh process: other libraries a test session imported (sentencepiece ships its own
    # libgomp) must not decide the outcome. Loading the kernel may add no OpenMP runtime.
    script = (
        "import torch\n"
        "def gomps():\n"
        "    with open('/proc/self/maps') as maps:\n"
        "        return {line.split()[-1] for line in maps if 'libgomp' in line}\n"
        "before = gomps()\n"
        "from tokenwise.native import paged_decode as cpu_paged_decode\n"
        "assert cpu_paged_decode.load() is not None\n"
        "print(len(before), len(gomps() - before))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "0"], done.stdout  # torch's one libgomp, none added


@pytest.mark.parametrize("parts", [1, 2, 3, 8])
def test_split_covers_every_sequence_once_with_balanced_keys(parts: int) -> None:
    lens = torch.tensor([500, 3, 3, 3, 250, 250, 1, 700, 20], dtype=torch.int32)
    ranges = cpu_paged_decode._split(lens, parts)
    flat = [i for a, b in ranges for i in range(a, b)]
    assert flat == list(range(len(lens)))
    assert len(ranges) <= parts
    if parts == 2:
        loads = [int(lens[a:b].sum()) for a, b in ranges]
        assert max(loads) <= 0.5 * int(lens.sum()) + 700  # off by at most one sequence


def test_disabled_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENWISE_CPU_KERNELS", "0")
    cpu_paged_decode.load.cache_clear()
    try:
        assert cpu_paged_decode.load() is None
    finally:
        monkeypatch.delenv("TOKENWISE_CPU_KERNELS")
        cpu_paged_decode.load.cache_clear()
    assert cpu_paged_decode.load() is not None


def test_no_compiler_falls_back_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(native_build, "find_compiler", lambda: None)
    cpu_paged_decode.load.cache_clear()
    native_build._warn_no_compiler.cache_clear()  # said once per process
    try:
        with caplog.at_level(logging.WARNING):
            assert cpu_paged_decode.load() is None
        assert "no C compiler" in caplog.text
    finally:
        monkeypatch.undo()
        cpu_paged_decode.load.cache_clear()


def test_build_is_cached_per_source(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENWISE_KERNEL_CACHE", str(tmp_path))
    compiler = native_build.find_compiler()
    first = cpu_paged_decode._build(compiler)
    stamp = first.stat().st_mtime_ns
    assert cpu_paged_decode._build(compiler) == first
    assert first.stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temp files left behind


def test_loading_the_kernel_keeps_subnormal_floats(tmp_path) -> None:
    """Loading the .so must not switch its thread to flush-to-zero (what -ffast-math's
    crtfastmath.o does): a fresh process loads it, then multiplies a subnormal."""

    code = (
        "from tokenwise.native import paged_decode as cpu_paged_decode\n"
        "assert cpu_paged_decode.load() is not None, 'kernel did not build'\n"
        "import torch\n"
        "tiny = torch.tensor([1e-40], dtype=torch.float32)\n"
        "print(float((tiny * 1.0)[0]) != 0.0 and 5e-324 * 1.0 != 0.0)\n"
    )
    env = {**os.environ, "TOKENWISE_KERNEL_CACHE": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_step_writes_kv_then_matches_paged_decode(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, threads: int
) -> None:
    """`decode_step` = the cache write + `paged_decode` on the widened query, rounded to the
    model's dtype: bit for bit, new K/V read from strided views of a fused qkv row, and a
    padding row (slot -1) writes nothing."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    lens = [1, 9, 33, 70]
    case = _paged_case(lens, 4, 2, 32, 16, seed=11, dtype=dtype)
    gen = torch.Generator().manual_seed(12)
    n, width, kv_width = len(lens), 4 * 32, 2 * 32
    qkv = torch.randn(n, width + 2 * kv_width, generator=gen).to(dtype)
    query, key, value = qkv.split([width, kv_width, kv_width], dim=-1)
    # Each sequence's last token goes to its slot; the last row is padding.
    slots = [
        int(case["block_tables"][i, (m - 1) // 16]) * 16 + (m - 1) % 16 for i, m in enumerate(lens)
    ]
    slots[-1] = -1
    kv_cache = torch.stack([case["key_cache"], case["value_cache"]]).contiguous()
    before = kv_cache.clone()
    expected_cache = kv_cache.clone()
    for i, slot in enumerate(slots[:-1]):
        expected_cache[0].view(-1, 2, 32)[slot] = key[i].view(2, 32)
        expected_cache[1].view(-1, 2, 32)[slot] = value[i].view(2, 32)
    expected = torch.empty(n, 4, 32)
    cpu_paged_decode.paged_decode(
        cpu_paged_decode.load(),
        query.float().reshape(n, 4, 32).contiguous(),
        expected_cache[0],
        expected_cache[1],
        case["block_tables"],
        case["seq_lens"],
        case["first_block"],
        None,
        case["scale"],
        expected,
    )
    assert cpu_paged_decode.step_usable(query, key, value, kv_cache)
    out = cpu_paged_decode.decode_step(
        cpu_paged_decode.load(),
        query.contiguous(),
        key,
        value,
        kv_cache,
        torch.tensor(slots, dtype=torch.int64),
        case["block_tables"],
        case["seq_lens"],
        case["first_block"],
        sum(lens),
        4,
        None,
        case["scale"],
    )
    assert out.dtype == dtype and out.shape == (n, width)
    assert torch.equal(out, expected.reshape(n, width).to(dtype))
    assert torch.equal(kv_cache, expected_cache)
    assert not torch.equal(kv_cache, before)  # the writes really happened


def _with_sinks_reference(case: dict, sinks: torch.Tensor) -> torch.Tensor:
    """Each sequence's last token over its visible keys, with one more softmax column per head
    (its sink logit, no value), written out independently of every backend."""
    block_size, kv_heads = case["key_cache"].shape[1], case["key_cache"].shape[2]
    heads = case["query"].shape[1]
    out = []
    for i, n in enumerate(case["seq_lens"].tolist()):
        first = int(case["first_block"][i])
        blocks = case["block_tables"][i, : -(-n // block_size) - first].long()
        keys = case["key_cache"][blocks].flatten(0, 1).float()[: n - first * block_size]
        values = case["value_cache"][blocks].flatten(0, 1).float()[: n - first * block_size]
        if case["sliding_window"] is not None:
            keep = min(case["sliding_window"], n)
            keys, values = keys[-keep:], values[-keep:]
        k = keys.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        v = values.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        scores = (case["query"][i][:, None, :] @ k.transpose(1, 2)).squeeze(1) * case["scale"]
        probs = F.softmax(torch.cat([scores, sinks[:, None]], dim=-1), -1)[:, :-1]
        out.append((probs[:, None, :] @ v).squeeze(1))
    return torch.stack(out)


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_with_sinks_matches_reference(
    monkeypatch: pytest.MonkeyPatch, window: int | None, threads: int
) -> None:
    """gpt-oss's attention sinks join each head's denominator: sequences of 1..129 keys, GQA,
    KV heads split over threads for one sequence, a windowed table; a very negative sink is
    no sink at all."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    for lens in ([1, 2, 17, 40, 129], [300]):
        case = _paged_case(lens, 8, 2, 32, 16, window=window, seed=len(lens))
        sinks = torch.randn(8, generator=torch.Generator().manual_seed(3)) * 2 + 1
        out = torch.empty_like(case["query"])
        args = {k: v for k, v in case.items() if k != "expected"}
        cpu_paged_decode.paged_decode(cpu_paged_decode.load(), out=out, sinks=sinks, **args)
        expected = _with_sinks_reference(case, sinks)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
        assert (expected - case["expected"]).abs().max() > 1e-3  # the sinks matter here
        none = torch.full((8,), -1e30)
        cpu_paged_decode.paged_decode(cpu_paged_decode.load(), out=out, sinks=none, **args)
        torch.testing.assert_close(out, case["expected"], atol=1e-5, rtol=1e-4)
