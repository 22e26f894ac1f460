"""Graph dispatch (forward-context.md §2), on CPU: the graph kind and key of a batch of `n` tokens.

Capture sizes are [1, 2, 4, 8, 16] throughout; `padded(n)` is the smallest of them >= n,
computed by brute force here. Rules from the spec: FULL when a captured FULL key matches (exact
first, then relaxed), else PIECEWISE under the relaxed key, else NONE with the unpadded size.
Uniform-decode keys carry num_reqs = padded // query_len and uniform=True.
"""

from __future__ import annotations

import pytest

from tokenwise.compilation.cuda_graph_dispatcher import CUDAGraphDispatcher
from tokenwise.config import CompilationConfig, CUDAGraphMode
from tokenwise.forward_context import BatchDescriptor

M = CUDAGraphMode
SIZES = [1, 2, 4, 8, 16]
MAX_NUM_SEQS = 16
TOKENS = range(1, 21)  # covers every padding bucket and sizes above the largest graph


def padded(n: int) -> int:
    return min(s for s in SIZES if s >= n)


def make(mode: CUDAGraphMode, query_len: int = 1, has_lora: bool = False) -> CUDAGraphDispatcher:
    d = CUDAGraphDispatcher(CompilationConfig(cudagraph_capture_sizes=SIZES), MAX_NUM_SEQS)
    d.initialize_cudagraph_keys(mode, uniform_decode_query_len=query_len, has_lora=has_lora)
    return d


def eager(n: int) -> tuple[CUDAGraphMode, BatchDescriptor]:
    return M.NONE, BatchDescriptor(n)


@pytest.mark.parametrize("uniform", [False, True])
def test_none_mode_always_runs_eagerly_unpadded(uniform: bool) -> None:
    d = make(M.NONE)
    for n in TOKENS:
        assert d.dispatch(n, uniform_decode=uniform) == eager(n)


@pytest.mark.parametrize("uniform", [False, True])
def test_piecewise_pads_under_the_relaxed_key(uniform: bool) -> None:
    d = make(M.PIECEWISE)
    for n in TOKENS:
        expected = (M.PIECEWISE, BatchDescriptor(padded(n))) if n <= 16 else eager(n)
        assert d.dispatch(n, uniform_decode=uniform) == expected
        assert d.dispatch(n, uniform_decode=uniform, disable_full=True) == expected


def test_piecewise_spot_values() -> None:
    d = make(M.PIECEWISE)
    assert d.dispatch(3) == (M.PIECEWISE, BatchDescriptor(4))
    assert d.dispatch(9) == (M.PIECEWISE, BatchDescriptor(16))
    assert d.dispatch(17) == (M.NONE, BatchDescriptor(17))


def test_full_decode_only() -> None:
    d = make(M.FULL_DECODE_ONLY)
    for n in TOKENS:
        if n <= 16:
            p = padded(n)
            assert d.dispatch(n, uniform_decode=True) == (M.FULL, BatchDescriptor(p, p, True))
        else:
            assert d.dispatch(n, uniform_decode=True) == eager(n)
        assert d.dispatch(n, uniform_decode=False) == eager(n)  # mixed: no graph at all
    assert d.dispatch(5, uniform_decode=True) == (M.FULL, BatchDescriptor(8, 8, True, False))


def test_full_and_piecewise() -> None:
    d = make(M.FULL_AND_PIECEWISE)
    for n in TOKENS:
        if n <= 16:
            p = padded(n)
            assert d.dispatch(n, uniform_decode=True) == (M.FULL, BatchDescriptor(p, p, True))
            assert d.dispatch(n, uniform_decode=False) == (M.PIECEWISE, BatchDescriptor(p))
        else:
            assert d.dispatch(n, uniform_decode=True) == eager(n)
            assert d.dispatch(n, uniform_decode=False) == eager(n)


def test_full_single_routine_uses_the_relaxed_key_for_every_batch() -> None:
    d = make(M.FULL)
    for n in TOKENS:
        for uniform in (False, True):
            expected = (M.FULL, BatchDescriptor(padded(n))) if n <= 16 else eager(n)
            assert d.dispatch(n, uniform_decode=uniform) == expected


@pytest.mark.parametrize("mode", list(M))
def test_disable_full_never_returns_full(mode: CUDAGraphMode) -> None:
    d = make(mode)
    for n in TOKENS:
        for uniform in (False, True):
            runtime_mode, desc = d.dispatch(n, uniform_decode=uniform, disable_full=True)
            assert runtime_mode is not M.FULL
            if runtime_mode is M.NONE:
                assert desc == BatchDescriptor(n)


def test_disable_full_falls_back_to_piecewise_when_captured() -> None:
    d = make(M.FULL_AND_PIECEWISE)
    assert d.dispatch(3, uniform_decode=True, disable_full=True) == (
        M.PIECEWISE,
        BatchDescriptor(4),
    )
    # FULL alone has no piecewise graphs to fall back to.
    assert make(M.FULL).dispatch(3, disable_full=True) == eager(3)
    assert make(M.FULL_DECODE_ONLY).dispatch(3, uniform_decode=True, disable_full=True) == eager(3)


def test_speculative_decoding_query_len_two_changes_num_reqs() -> None:
    d = make(M.FULL_AND_PIECEWISE, query_len=2)
    # Two tokens per request: padded // 2 requests.
    assert d.dispatch(4, uniform_decode=True) == (M.FULL, BatchDescriptor(4, 2, True))
    assert d.dispatch(6, uniform_decode=True) == (M.FULL, BatchDescriptor(8, 4, True))
    assert d.dispatch(16, uniform_decode=True) == (M.FULL, BatchDescriptor(16, 8, True))
    assert d.dispatch(2, uniform_decode=True) == (M.FULL, BatchDescriptor(2, 1, True))
    # Mixed batches are unaffected.
    assert d.dispatch(6) == (M.PIECEWISE, BatchDescriptor(8))
    # With query_len 1 the same batch would be keyed by 8 requests.
    assert make(M.FULL_AND_PIECEWISE).dispatch(6, uniform_decode=True)[1].num_reqs == 8


def test_uniform_decode_keys_are_captured_with_num_reqs() -> None:
    d = make(M.FULL_DECODE_ONLY, query_len=2)
    # Sizes smaller than one request's query cannot hold a uniform decode batch.
    assert d.keys[M.FULL] == {BatchDescriptor(s, s // 2, True) for s in (2, 4, 8, 16)}
    assert d.keys[M.PIECEWISE] == set()


@pytest.mark.parametrize("mode", [M.FULL_AND_PIECEWISE, M.FULL_DECODE_ONLY])
def test_verify_keys_sit_beside_the_decode_keys(mode: CUDAGraphMode) -> None:
    d = CUDAGraphDispatcher(CompilationConfig(cudagraph_capture_sizes=SIZES), MAX_NUM_SEQS)
    d.initialize_cudagraph_keys(mode, verify_query_len=4)  # 3 drafts per request
    decode = {BatchDescriptor(s, s, True) for s in SIZES}
    verify = {BatchDescriptor(s, s // 4, True) for s in (4, 8, 16)}  # sizes >= one request
    assert d.keys[M.FULL] - decode == verify and decode <= d.keys[M.FULL]
    for n in range(4, 17):  # every request verifies 3 drafts: n tokens, padded(n) // 4 requests
        want = (M.FULL, BatchDescriptor(padded(n), padded(n) // 4, True))
        assert d.dispatch(n, uniform_decode=True, uniform_query_len=4) == want
        # Decode batches keep their own keys.
        want = (M.FULL, BatchDescriptor(padded(n), padded(n), True))
        assert d.dispatch(n, uniform_decode=True) == want
    assert d.dispatch(17, uniform_decode=True, uniform_query_len=4) == eager(17)


def test_verify_keys_need_full_decode_graphs_and_drafts() -> None:
    d = CUDAGraphDispatcher(CompilationConfig(cudagraph_capture_sizes=SIZES), MAX_NUM_SEQS)
    d.initialize_cudagraph_keys(M.PIECEWISE, verify_query_len=4)
    assert d.keys[M.FULL] == set()
    assert d.dispatch(8, uniform_decode=True, uniform_query_len=4) == (
        M.PIECEWISE,
        BatchDescriptor(8),
    )
    with pytest.raises(ValueError, match="verify_query_len must be >= 2"):
        d.initialize_cudagraph_keys(M.FULL_AND_PIECEWISE, verify_query_len=1)


def test_lora_keys() -> None:
    d = make(M.FULL_AND_PIECEWISE, has_lora=True)
    assert d.dispatch(3, uniform_decode=True, has_lora=True) == (
        M.FULL,
        BatchDescriptor(4, 4, True, True),
    )
    assert d.dispatch(3, has_lora=True) == (M.PIECEWISE, BatchDescriptor(4, has_lora=True))


def test_keys_not_initialised_run_eagerly() -> None:
    config = CompilationConfig(cudagraph_mode=M.FULL_AND_PIECEWISE, cudagraph_capture_sizes=SIZES)
    d = CUDAGraphDispatcher(config, MAX_NUM_SEQS)
    for n in (1, 3, 16):
        assert d.dispatch(n, uniform_decode=True) == eager(n)
        assert d.dispatch(n) == eager(n)


def test_no_capture_sizes_runs_eagerly() -> None:
    d = CUDAGraphDispatcher(CompilationConfig(), MAX_NUM_SEQS)
    d.initialize_cudagraph_keys(M.FULL_AND_PIECEWISE)
    assert d.dispatch(1, uniform_decode=True) == eager(1)


def test_keys_exist_for_piecewise_and_full_only() -> None:
    d = make(M.PIECEWISE)
    with pytest.raises(
        ValueError, match="graph keys exist for PIECEWISE and FULL only, got .*NONE"
    ):
        d.add_key(M.NONE, BatchDescriptor(4))
    with pytest.raises(
        ValueError, match="graph keys exist for PIECEWISE and FULL only, got .*FULL_AND_PIECEWISE"
    ):
        d.add_key(M.FULL_AND_PIECEWISE, BatchDescriptor(4))


def test_reinitialising_replaces_the_keys() -> None:
    d = make(M.FULL_AND_PIECEWISE)
    d.initialize_cudagraph_keys(M.PIECEWISE)
    assert d.keys[M.FULL] == set()
    assert d.dispatch(3, uniform_decode=True) == (M.PIECEWISE, BatchDescriptor(4))
