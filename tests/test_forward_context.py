"""The forward context (forward-context.md §1): batch keys, DP metadata, install/restore, threads.

Expected values are taken from the examples of docs/forward-context.md or derived by hand in
each test. The DP collective is never run here: `coordinate_batch_across_dp` is monkeypatched,
either to fail the test if it is reached or to record how it was called.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import tokenwise.distributed.dp_coordination as dp_coordination
import tokenwise.forward_context as fc_module
from tokenwise.batchsize_stats import (
    batchsize_forward_stats,
    get_batchsize_forward_time_samples,
)
from tokenwise.config import CUDAGraphMode, EngineConfig, ParallelConfig
from tokenwise.forward_context import (
    BatchDescriptor,
    DPMetadata,
    ForwardContext,
    create_forward_context,
    get_forward_context,
    is_forward_context_available,
    override_forward_context,
    reset_batchsize_forward_time_stats,
    set_forward_context,
)


@dataclass
class FakeMetadata:
    """Stands in for attention metadata: only the two counts the context reads."""

    num_prefill_tokens: int
    num_decode_tokens: int


def _ctx(tag: Any = None, config: EngineConfig | None = None) -> ForwardContext:
    return create_forward_context(tag, config or EngineConfig())


def _dp_config(size: int = 2, rank: int = 0, is_moe: bool | None = True) -> EngineConfig:
    return EngineConfig(
        parallel=ParallelConfig(
            data_parallel_size=size, data_parallel_rank=rank, is_moe_model=is_moe
        )
    )


@pytest.fixture(autouse=True)
def _no_context_leaks() -> Any:
    """Every test starts and must end with no context installed."""
    assert not is_forward_context_available()
    yield
    assert not is_forward_context_available()


@pytest.fixture
def forbid_collective(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("coordinate_batch_across_dp must not be called here")

    monkeypatch.setattr(dp_coordination, "coordinate_batch_across_dp", boom)


@pytest.fixture
def stats_env(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Leaves the global batch-size statistics as it found them (interval and samples)."""
    original = batchsize_forward_stats.interval_s
    yield monkeypatch
    monkeypatch.undo()
    reset_batchsize_forward_time_stats(interval_s=original)


# --- BatchDescriptor ---------------------------------------------------------------------------


def test_batch_descriptor_field_order_and_defaults() -> None:
    assert BatchDescriptor._fields == ("num_tokens", "num_reqs", "uniform", "has_lora")
    d = BatchDescriptor(8)
    assert (d.num_tokens, d.num_reqs, d.uniform, d.has_lora) == (8, None, False, False)
    positional = BatchDescriptor(8, 4, True, True)
    assert (positional.num_reqs, positional.uniform, positional.has_lora) == (4, True, True)


def test_batch_descriptor_equality_and_hash_cover_every_field() -> None:
    base = BatchDescriptor(8, 4, True, False)
    variants = [
        BatchDescriptor(16, 4, True, False),
        BatchDescriptor(8, 2, True, False),
        BatchDescriptor(8, None, True, False),
        BatchDescriptor(8, 4, False, False),
        BatchDescriptor(8, 4, True, True),
    ]
    for v in variants:
        assert v != base
    table = {base: "base"} | {v: i for i, v in enumerate(variants)}
    assert len(table) == 6
    # An equal descriptor built separately finds the same entry.
    assert table[BatchDescriptor(num_tokens=8, num_reqs=4, uniform=True)] == "base"
    assert hash(BatchDescriptor(8, 4, True, False)) == hash(base)


def test_relax_for_mixed_batch_cudagraphs_keeps_tokens_and_lora() -> None:
    d = BatchDescriptor(16, num_reqs=8, uniform=True, has_lora=True)
    relaxed = d.relax_for_mixed_batch_cudagraphs()
    assert relaxed == BatchDescriptor(16, None, False, True)
    assert d == BatchDescriptor(16, 8, True, True)  # a copy: the original is unchanged
    assert BatchDescriptor(4).relax_for_mixed_batch_cudagraphs() == BatchDescriptor(4)


# --- DPMetadata --------------------------------------------------------------------------------


def _dp(counts: list[int], rank: int = 0) -> DPMetadata:
    cfg = ParallelConfig(data_parallel_size=len(counts), data_parallel_rank=rank)
    return DPMetadata.make(cfg, counts[rank], torch.tensor(counts))


def test_make_computes_the_max_as_a_0d_tensor() -> None:
    md = _dp([5, 11, 3], rank=1)
    assert md.max_tokens_across_dp_cpu.dim() == 0
    assert int(md.max_tokens_across_dp_cpu) == 11
    assert md.num_tokens_across_dp_cpu.tolist() == [5, 11, 3]
    assert md.local_sizes is None


def test_make_requires_dp_size_above_one() -> None:
    with pytest.raises(ValueError, match="data_parallel_size"):
        DPMetadata.make(ParallelConfig(), 4, torch.tensor([4]))


def test_make_requires_the_vector() -> None:
    with pytest.raises(ValueError, match="num_tokens_across_dp"):
        DPMetadata.make(ParallelConfig(data_parallel_size=2), 4, None)


def test_make_rejects_a_mismatch_at_this_rank_naming_both_values() -> None:
    cfg = ParallelConfig(data_parallel_size=2, data_parallel_rank=1)
    with pytest.raises(ValueError) as err:
        DPMetadata.make(cfg, 7, torch.tensor([7, 9]))  # entry at rank 1 is 9, not 7
    assert "9" in str(err.value) and "7" in str(err.value)
    # The entry at *this* rank is what counts: rank 1 with 9 is fine.
    assert int(DPMetadata.make(cfg, 9, torch.tensor([7, 9])).max_tokens_across_dp_cpu) == 9


def test_sp_local_sizes_spec_example_and_reset_on_exit() -> None:
    md = _dp([5, 3])
    with md.sp_local_sizes(2) as sizes:
        assert sizes == [3, 3, 2, 2]  # ceil(5/2)=3 twice, ceil(3/2)=2 twice
        assert md.local_sizes == [3, 3, 2, 2]
        assert md.get_chunk_sizes_across_dp_rank() == [3, 3, 2, 2]
    assert md.local_sizes is None
    with pytest.raises(RuntimeError, match="local_sizes is only set inside"):
        md.get_chunk_sizes_across_dp_rank()


def test_sp_local_sizes_reset_on_exception() -> None:
    md = _dp([5, 3])
    with pytest.raises(KeyError, match="boom"), md.sp_local_sizes(1):
        raise KeyError("boom")
    assert md.local_sizes is None


def test_get_chunk_sizes_errors_outside_the_contexts() -> None:
    with pytest.raises(RuntimeError, match="local_sizes"):
        _dp([5, 3]).get_chunk_sizes_across_dp_rank()


@pytest.mark.parametrize(
    ("chunk_idx", "expected"),
    [(0, [64, 64, 64, 64]), (1, [56, 16, 64, 36]), (2, [1, 1, 12, 1])],
)
def test_chunked_sizes_spec_example(chunk_idx: int, expected: list[int]) -> None:
    md = _dp([120, 80, 140, 100])
    with md.chunked_sizes(1, 64, chunk_idx) as sizes:
        assert sizes == expected
        assert md.get_chunk_sizes_across_dp_rank() == expected
    assert md.local_sizes is None


def test_chunked_sizes_a_finished_rank_still_gets_one_token() -> None:
    md = _dp([10, 300])
    # chunk 3 of 64: rank 0 finished long ago (10 - 192 < 0), rank 1 has 300 - 192 = 108 left.
    with md.chunked_sizes(1, 64, 3) as sizes:
        assert sizes == [1, 64]
    # chunk 4: rank 1 has 300 - 256 = 44 left.
    with md.chunked_sizes(1, 64, 4) as sizes:
        assert sizes == [1, 44]


def test_chunked_sizes_with_sequence_parallelism() -> None:
    md = _dp([100, 30])
    # sp 2 expands to [50, 50, 15, 15]; chunk size 20.
    with md.chunked_sizes(2, 20, 0) as sizes:
        assert sizes == [20, 20, 15, 15]
    with md.chunked_sizes(2, 20, 1) as sizes:
        assert sizes == [20, 20, 1, 1]  # 15 - 20 < 0 -> 1
    with md.chunked_sizes(2, 20, 2) as sizes:
        assert sizes == [10, 10, 1, 1]


def test_chunked_sizes_reset_on_exception() -> None:
    md = _dp([120, 80])
    with pytest.raises(ValueError, match="boom"), md.chunked_sizes(1, 64, 0):
        raise ValueError("boom")
    assert md.local_sizes is None


def test_cu_tokens_across_sp_spec_example() -> None:
    md = _dp([5, 3])
    assert md.cu_tokens_across_sp(1).tolist() == [5, 8]
    assert md.cu_tokens_across_sp(2).tolist() == [3, 6, 8, 10]


# --- ForwardContext construction --------------------------------------------------------------


@pytest.mark.parametrize(
    "mode",
    [CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL_AND_PIECEWISE, 1, "FULL", None],
)
def test_invalid_runtime_graph_modes_are_rejected_at_construction(mode: Any) -> None:
    with pytest.raises(ValueError, match="cudagraph_runtime_mode"):
        ForwardContext(
            no_compile_layers={}, attn_metadata=None, virtual_engine=0, cudagraph_runtime_mode=mode
        )
    with pytest.raises(ValueError, match="cudagraph_runtime_mode"):
        create_forward_context(None, EngineConfig(), cudagraph_runtime_mode=mode)


@pytest.mark.parametrize("mode", [CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL])
def test_valid_runtime_graph_modes_are_accepted(mode: CUDAGraphMode) -> None:
    assert create_forward_context(None, EngineConfig(), cudagraph_runtime_mode=mode)


def test_set_forward_context_with_invalid_mode_installs_nothing() -> None:
    with (
        pytest.raises(ValueError, match="cudagraph_runtime_mode must be NONE, PIECEWISE or FULL"),
        set_forward_context(
            None, EngineConfig(), cudagraph_runtime_mode=CUDAGraphMode.FULL_AND_PIECEWISE
        ),
    ):
        pass
    assert not is_forward_context_available()


def test_forward_context_defaults() -> None:
    ctx = ForwardContext(no_compile_layers={}, attn_metadata=None, virtual_engine=0)
    assert ctx.dp_metadata is None
    assert ctx.cudagraph_runtime_mode is CUDAGraphMode.NONE
    assert ctx.batch_descriptor is None and ctx.ubatch_slices is None
    assert ctx.additional_kwargs == {}
    other = ForwardContext(no_compile_layers={}, attn_metadata=None, virtual_engine=0)
    assert other.additional_kwargs is not ctx.additional_kwargs


def test_create_forward_context_shares_the_registry_and_installs_nothing() -> None:
    config = EngineConfig()
    md = FakeMetadata(3, 2)
    ctx = create_forward_context(
        md,
        config,
        virtual_engine=1,
        cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE,
        batch_descriptor=BatchDescriptor(8),
        ubatch_slices=["a", "b"],
        additional_kwargs={"k": 1},
    )
    assert ctx.no_compile_layers is config.compilation.static_forward_context
    assert ctx.attn_metadata is md and ctx.virtual_engine == 1
    assert ctx.cudagraph_runtime_mode is CUDAGraphMode.PIECEWISE
    assert ctx.batch_descriptor == BatchDescriptor(8)
    assert ctx.ubatch_slices == ["a", "b"] and ctx.additional_kwargs == {"k": 1}
    assert not is_forward_context_available()


# --- accessors and override ---------------------------------------------------------------------


def test_get_forward_context_without_one_says_how_to_set_it() -> None:
    assert not is_forward_context_available()
    with pytest.raises(RuntimeError) as err:
        get_forward_context()
    message = str(err.value)
    assert "No forward context is set" in message
    assert "set_forward_context" in message


def test_override_installs_and_restores() -> None:
    ctx = _ctx("a")
    with override_forward_context(ctx):
        assert is_forward_context_available()
        assert get_forward_context() is ctx
    assert not is_forward_context_available()


def test_override_nests_like_a_stack() -> None:
    a, b, c = _ctx("a"), _ctx("b"), _ctx("c")
    with override_forward_context(a):
        with override_forward_context(b):
            with override_forward_context(c):
                assert get_forward_context() is c
            assert get_forward_context() is b
        assert get_forward_context() is a
    assert not is_forward_context_available()


def test_override_restores_after_an_exception() -> None:
    outer, inner = _ctx("outer"), _ctx("inner")
    with override_forward_context(outer):
        with (
            pytest.raises(ZeroDivisionError, match="division by zero"),
            override_forward_context(inner),
        ):
            assert get_forward_context() is inner
            1 / 0  # noqa: B018
        assert get_forward_context() is outer


def test_override_with_none_clears_then_restores() -> None:
    outer = _ctx("outer")
    with override_forward_context(outer):
        with override_forward_context(None):
            assert not is_forward_context_available()
            with pytest.raises(RuntimeError, match="No forward context is set"):
                get_forward_context()
        assert get_forward_context() is outer


# --- set_forward_context ------------------------------------------------------------------------


def test_set_forward_context_installs_and_yields_the_context() -> None:
    md = FakeMetadata(4, 0)
    config = EngineConfig()
    with set_forward_context(md, config, virtual_engine=2) as ctx:
        assert get_forward_context() is ctx
        assert ctx.attn_metadata is md
        assert ctx.virtual_engine == 2
        assert ctx.no_compile_layers is config.compilation.static_forward_context
        assert ctx.dp_metadata is None
    assert not is_forward_context_available()


def test_set_forward_context_restores_the_previous_context() -> None:
    outer = _ctx("outer")
    with override_forward_context(outer):
        with set_forward_context(FakeMetadata(1, 0), EngineConfig()) as ctx:
            assert get_forward_context() is ctx
        assert get_forward_context() is outer
        with (
            pytest.raises(KeyError, match="body failed"),
            set_forward_context(None, EngineConfig()),
        ):
            raise KeyError("body failed")
        assert get_forward_context() is outer


@pytest.mark.parametrize("mode", [CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL])
def test_graph_mode_with_num_tokens_gets_a_descriptor(mode: CUDAGraphMode) -> None:
    with set_forward_context(None, EngineConfig(), num_tokens=12, cudagraph_runtime_mode=mode) as c:
        assert c.batch_descriptor == BatchDescriptor(12)
        assert c.cudagraph_runtime_mode is mode


def test_graph_mode_descriptor_uses_tokens_derived_from_metadata() -> None:
    with set_forward_context(
        FakeMetadata(5, 3), EngineConfig(), cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE
    ) as ctx:
        assert ctx.batch_descriptor == BatchDescriptor(8)


def test_explicit_descriptor_is_kept() -> None:
    desc = BatchDescriptor(16, 16, uniform=True)
    with set_forward_context(
        None,
        EngineConfig(),
        num_tokens=12,
        cudagraph_runtime_mode=CUDAGraphMode.FULL,
        batch_descriptor=desc,
    ) as ctx:
        assert ctx.batch_descriptor is desc


def test_mode_none_leaves_descriptor_unset() -> None:
    with set_forward_context(FakeMetadata(3, 1), EngineConfig(), num_tokens=4) as ctx:
        assert ctx.batch_descriptor is None
        assert ctx.cudagraph_runtime_mode is CUDAGraphMode.NONE


def test_dense_model_with_dp_gets_no_metadata_and_no_collective(forbid_collective: None) -> None:
    with set_forward_context(FakeMetadata(4, 0), _dp_config(is_moe=False), num_tokens=4) as ctx:
        assert ctx.dp_metadata is None


@pytest.mark.parametrize("is_moe", [True, None])
def test_moe_or_unknown_with_explicit_vector_builds_metadata_without_collective(
    forbid_collective: None, is_moe: bool | None
) -> None:
    config = _dp_config(size=3, rank=2, is_moe=is_moe)
    vector = torch.tensor([4, 9, 6])
    with set_forward_context(
        FakeMetadata(6, 0), config, num_tokens=6, num_tokens_across_dp=vector
    ) as ctx:
        assert ctx.dp_metadata is not None
        assert ctx.dp_metadata.num_tokens_across_dp_cpu.tolist() == [4, 9, 6]
        assert int(ctx.dp_metadata.max_tokens_across_dp_cpu) == 9


def test_moe_with_dp_and_no_vector_coordinates_exactly_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = dp_coordination.coordinate_batch_across_dp
    calls: list[dict[str, Any]] = []

    def fake(*args: Any, **kwargs: Any) -> tuple[bool, torch.Tensor, int]:
        bound = inspect.signature(real).bind(*args, **kwargs)
        bound.apply_defaults()
        calls.append(dict(bound.arguments))
        return False, torch.tensor([5, 7]), 0

    monkeypatch.setattr(dp_coordination, "coordinate_batch_across_dp", fake)
    config = _dp_config(size=2, rank=1, is_moe=True)
    with set_forward_context(FakeMetadata(7, 0), config, num_tokens=7) as ctx:
        assert ctx.dp_metadata is not None
        assert ctx.dp_metadata.num_tokens_across_dp_cpu.tolist() == [5, 7]
        assert int(ctx.dp_metadata.max_tokens_across_dp_cpu) == 7
    assert len(calls) == 1
    call = calls[0]
    assert call["num_tokens_unpadded"] == 7
    assert call["allow_microbatching"] is False
    assert call["allow_dp_padding"] is False
    assert call["parallel_config"] is config.parallel


def test_moe_with_dp_and_no_tokens_at_all_runs_no_collective(forbid_collective: None) -> None:
    with set_forward_context(None, _dp_config()) as ctx:
        assert ctx.dp_metadata is None


def test_num_tokens_derived_from_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []

    def fake(num_tokens_unpadded: int, *args: Any, **kwargs: Any) -> Any:
        seen.append(num_tokens_unpadded)
        return False, torch.tensor([num_tokens_unpadded, 1]), 0

    monkeypatch.setattr(dp_coordination, "coordinate_batch_across_dp", fake)
    # 6 prefill + 2 decode tokens = 8, also through a per-layer dict of metadata.
    for md in (FakeMetadata(6, 2), {"l0": FakeMetadata(6, 2), "l1": FakeMetadata(6, 2)}):
        with set_forward_context(md, _dp_config()) as ctx:
            assert ctx.dp_metadata is not None
            assert int(ctx.dp_metadata.num_tokens_across_dp_cpu[0]) == 8
    assert seen == [8, 8]


# --- isolation between threads and tasks --------------------------------------------------------


def test_two_threads_each_see_only_their_own_context() -> None:
    barrier = threading.Barrier(2, timeout=5)
    seen: dict[str, list[Any]] = {"set": [], "override": []}
    errors: list[BaseException] = []

    def with_set() -> None:
        try:
            with set_forward_context(FakeMetadata(1, 0), EngineConfig(), virtual_engine=1) as ctx:
                barrier.wait()  # both threads now hold a context
                seen["set"].append(get_forward_context() is ctx)
                seen["set"].append(get_forward_context().virtual_engine)
                barrier.wait()  # neither leaves before the other has looked
            seen["set"].append(is_forward_context_available())
        except BaseException as exc:  # noqa: BLE001 - reported to the main thread
            errors.append(exc)

    def with_override() -> None:
        try:
            ctx = create_forward_context("mine", EngineConfig(), virtual_engine=2)
            with override_forward_context(ctx):
                barrier.wait()
                seen["override"].append(get_forward_context() is ctx)
                seen["override"].append(get_forward_context().virtual_engine)
                barrier.wait()
            seen["override"].append(is_forward_context_available())
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=with_set), threading.Thread(target=with_override)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert not errors
    assert seen == {"set": [True, 1, False], "override": [True, 2, False]}


def test_a_fresh_thread_sees_no_context_while_main_has_one() -> None:
    seen: list[bool] = []
    with override_forward_context(_ctx("main")):
        t = threading.Thread(target=lambda: seen.append(is_forward_context_available()))
        t.start()
        t.join(timeout=10)
        assert is_forward_context_available()
    assert seen == [False]


def test_two_asyncio_tasks_each_see_only_their_own_context() -> None:
    async def main() -> list[tuple[bool, int, bool]]:
        both_inside = asyncio.Event()
        inside = 0

        async def task(ve: int) -> tuple[bool, int, bool]:
            nonlocal inside
            with set_forward_context(FakeMetadata(1, 0), EngineConfig(), virtual_engine=ve) as c:
                inside += 1
                if inside == 2:
                    both_inside.set()
                await both_inside.wait()  # the other task has installed its own by now
                before = get_forward_context() is c
                await asyncio.sleep(0)  # let the other task run while we hold our context
                return before, get_forward_context().virtual_engine, get_forward_context() is c

        results = await asyncio.gather(task(3), task(4))
        assert not is_forward_context_available()
        return results

    assert asyncio.run(main()) == [(True, 3, True), (True, 4, True)]


# --- batch-size timing through set_forward_context ----------------------------------------------


def test_stats_disabled_by_default_records_nothing(stats_env: pytest.MonkeyPatch) -> None:
    stats_env.delenv("TOKENWISE_LOG_BATCHSIZE_INTERVAL", raising=False)
    reset_batchsize_forward_time_stats()
    with set_forward_context(FakeMetadata(4, 0), EngineConfig(), num_tokens=4):
        pass
    assert get_batchsize_forward_time_samples() == {}


def test_stats_enabled_records_one_sample_per_pass(stats_env: pytest.MonkeyPatch) -> None:
    stats_env.setenv("TOKENWISE_LOG_BATCHSIZE_INTERVAL", "0")
    reset_batchsize_forward_time_stats()
    with set_forward_context(FakeMetadata(4, 0), EngineConfig(), num_tokens=4):
        pass
    samples = get_batchsize_forward_time_samples()
    assert list(samples) == [4] and len(samples[4]) == 1
    assert samples[4][0] >= 0.0
    # No metadata (a dummy run): not timed.
    with set_forward_context(None, EngineConfig(), num_tokens=4):
        pass
    # A failed pass: not timed either.
    with (
        pytest.raises(RuntimeError, match="forward failed"),
        set_forward_context(FakeMetadata(4, 0), EngineConfig(), num_tokens=4),
    ):
        raise RuntimeError("forward failed")
    assert {k: len(v) for k, v in get_batchsize_forward_time_samples().items()} == {4: 1}


def test_stats_time_the_body_not_the_dp_collective(
    stats_env: pytest.MonkeyPatch,
) -> None:
    """A fake clock: the collective takes 1 s, the body 5 ms; only the 5 ms is recorded."""
    clock = SimpleNamespace(t=100.0)
    stats_env.setattr(fc_module, "time", SimpleNamespace(perf_counter=lambda: clock.t))

    def slow_collective(*args: Any, **kwargs: Any) -> Any:
        clock.t += 1.0
        return False, torch.tensor([6, 6]), 0

    stats_env.setattr(dp_coordination, "coordinate_batch_across_dp", slow_collective)
    stats_env.setenv("TOKENWISE_LOG_BATCHSIZE_INTERVAL", "1000")
    reset_batchsize_forward_time_stats()
    with set_forward_context(FakeMetadata(6, 0), _dp_config()):
        clock.t += 0.005
    assert get_batchsize_forward_time_samples()[6] == pytest.approx([5.0])
