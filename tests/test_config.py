"""Engine configuration (forward-context.md §2): graph modes, validation, capture-size padding."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenwise.config import (
    CacheConfig,
    CompilationConfig,
    CUDAGraphMode,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
)

M = CUDAGraphMode


def test_mode_values() -> None:
    assert M.NONE.value == 0
    assert M.PIECEWISE.value == 1
    assert M.FULL.value == 2
    assert M.FULL_DECODE_ONLY.value == (2, 0)
    assert M.FULL_AND_PIECEWISE.value == (2, 1)
    assert len(M) == 5


# member: decode, mixed, has_full, requires_piecewise, valid_runtime, separate_routine
MODE_TABLE = {
    M.NONE: (M.NONE, M.NONE, False, False, True, False),
    M.PIECEWISE: (M.PIECEWISE, M.PIECEWISE, False, True, True, False),
    M.FULL: (M.FULL, M.FULL, True, False, True, False),
    M.FULL_DECODE_ONLY: (M.FULL, M.NONE, True, False, False, True),
    M.FULL_AND_PIECEWISE: (M.FULL, M.PIECEWISE, True, True, False, True),
}


@pytest.mark.parametrize("mode", list(M))
def test_mode_methods(mode: CUDAGraphMode) -> None:
    decode, mixed, has_full, piecewise, runtime, separate = MODE_TABLE[mode]
    assert mode.decode_mode() is decode
    assert mode.mixed_mode() is mixed
    assert mode.has_full_cudagraphs() is has_full
    assert mode.requires_piecewise_compilation() is piecewise
    assert mode.valid_runtime_modes() is runtime
    assert mode.separate_routine() is separate


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("piecewise", M.PIECEWISE),
        ("Full_And_Piecewise", M.FULL_AND_PIECEWISE),
        ("NONE", M.NONE),
        ("full", M.FULL),
        ("full_decode_only", M.FULL_DECODE_ONLY),
        (" Full ", M.FULL),
    ],
)
def test_parse_strings_case_insensitively(text: str, expected: CUDAGraphMode) -> None:
    assert M.parse(text) is expected
    assert CompilationConfig(cudagraph_mode=text).cudagraph_mode is expected  # type: ignore[arg-type]


def test_parse_members_and_ints() -> None:
    assert M.parse(M.FULL) is M.FULL
    assert M.parse(1) is M.PIECEWISE


@pytest.mark.parametrize("bad", ["turbo", "full-and-piecewise", "", True, None, 2.0])
def test_parse_unknown_is_a_clear_error(bad: object) -> None:
    with pytest.raises(ValueError, match="cudagraph_mode"):
        M.parse(bad)  # type: ignore[arg-type]


def test_parse_error_lists_the_valid_names() -> None:
    with pytest.raises(ValueError) as err:
        M.parse("turbo")
    for name in ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"):
        assert name in str(err.value)
    assert "turbo" in str(err.value)


def test_engine_config_defaults() -> None:
    cfg = EngineConfig()
    assert cfg.model is None
    p = cfg.parallel
    assert (p.data_parallel_size, p.data_parallel_rank, p.tensor_parallel_size) == (1, 0, 1)
    assert p.is_moe_model is None
    assert cfg.compilation.static_forward_context == {}
    assert cfg.compilation.cudagraph_mode is M.NONE


def test_engine_configs_do_not_share_a_registry() -> None:
    a, b = EngineConfig(), EngineConfig()
    a.compilation.static_forward_context["x"] = object()
    assert b.compilation.static_forward_context == {}


@pytest.mark.parametrize(
    ("factory", "field_name"),
    [
        (lambda: ParallelConfig(data_parallel_size=0), "data_parallel_size"),
        (lambda: ParallelConfig(data_parallel_size=True), "data_parallel_size"),
        (lambda: ParallelConfig(tensor_parallel_size=0), "tensor_parallel_size"),
        (lambda: ParallelConfig(data_parallel_rank=-1), "data_parallel_rank"),
        (lambda: ParallelConfig(data_parallel_size=2, data_parallel_rank=2), "data_parallel_rank"),
        (lambda: CacheConfig(block_size=0), "block_size"),
        (lambda: CacheConfig(block_size=1.5), "block_size"),
        (lambda: CacheConfig(kv_cache_memory=0), "kv_cache_memory"),
        (lambda: CacheConfig(num_gpu_blocks=0), "num_gpu_blocks"),
        (lambda: CacheConfig(gpu_memory_utilization=0.0), "gpu_memory_utilization"),
        (lambda: CacheConfig(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
        (lambda: SchedulerConfig(max_num_seqs=0), "max_num_seqs"),
        (lambda: SchedulerConfig(max_num_batched_tokens=-5), "max_num_batched_tokens"),
        (lambda: CompilationConfig(cudagraph_capture_sizes=[1, 0]), "cudagraph_capture_sizes"),
    ],
)
def test_invalid_values_raise_naming_the_field(factory: object, field_name: str) -> None:
    with pytest.raises(ValueError, match=field_name):
        factory()  # type: ignore[operator]


def test_valid_edge_values_are_accepted() -> None:
    assert ParallelConfig(data_parallel_size=2, data_parallel_rank=1).data_parallel_rank == 1
    assert CacheConfig(gpu_memory_utilization=1.0).gpu_memory_utilization == 1.0
    assert CacheConfig(block_size=1, num_gpu_blocks=1).num_gpu_blocks == 1


def test_capture_sizes_are_sorted_and_deduplicated() -> None:
    cfg = CompilationConfig(cudagraph_capture_sizes=[8, 1, 4, 8, 2, 1])
    assert cfg.cudagraph_capture_sizes == [1, 2, 4, 8]
    assert cfg.max_capture_size == 8
    assert CompilationConfig().max_capture_size == 0


def _brute_pad(sizes: list[int], b: int) -> int | None:
    fitting = [s for s in sizes if s >= b]
    return min(fitting) if fitting else None


def test_pad_for_cudagraph_small_example() -> None:
    cfg = CompilationConfig(cudagraph_capture_sizes=[1, 2, 4, 8, 16])
    assert [cfg.pad_for_cudagraph(b) for b in (1, 2, 3, 5, 8, 9, 16)] == [1, 2, 4, 8, 8, 16, 16]
    assert cfg.pad_for_cudagraph(17) is None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=96), min_size=1, max_size=12))
def test_pad_for_cudagraph_matches_brute_force(sizes: list[int]) -> None:
    cfg = CompilationConfig(cudagraph_capture_sizes=sizes)
    top = max(sizes)
    for b in range(1, top + 1):
        assert cfg.pad_for_cudagraph(b) == _brute_pad(sizes, b)
    for b in (top + 1, top + 100):
        assert cfg.pad_for_cudagraph(b) is None


def test_pad_without_capture_sizes_is_none() -> None:
    assert CompilationConfig().pad_for_cudagraph(1) is None


def test_pad_rejects_non_positive() -> None:
    with pytest.raises(ValueError, match="num_tokens"):
        CompilationConfig(cudagraph_capture_sizes=[4]).pad_for_cudagraph(0)


def test_pad_follows_capture_sizes_reassigned_after_use() -> None:
    """The engine may fill in capture sizes after construction; padding must follow them."""
    cfg = CompilationConfig(cudagraph_capture_sizes=[4, 8])
    assert cfg.pad_for_cudagraph(3) == 4
    cfg.cudagraph_capture_sizes = [2, 16]
    assert cfg.pad_for_cudagraph(3) == 16
    assert cfg.pad_for_cudagraph(12) == 16
    assert cfg.pad_for_cudagraph(2) == 2
