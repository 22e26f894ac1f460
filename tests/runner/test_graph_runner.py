"""CUDA-graph dispatch inside the engine, on CPU, with capture and replay faked.

`EagerReplayCapturer` replays by calling the captured function again on the *same* persistent
buffers and writing into the *same* output tensors, so what these tests observe is what a
replayed CUDA graph would compute: stale metadata in the buffers gives wrong tokens, padding rows
with stale slots overwrite real KV entries. The `triton` backend is forced where whole steps are
captured: on CPU it runs its PyTorch decode, which reads device tensors only (graph-safe), like
its kernel on a GPU. Reference runs are eager with the same backend.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests._states import states_of
from tests.engine._fixtures import checkpoint
from tokenwise import LLM, SamplingParams
from tokenwise.attention.backends import selector
from tokenwise.attention.utils import PAD_SLOT_ID
from tokenwise.compilation.cuda_graph import EagerReplayCapturer
from tokenwise.config import CUDAGraphMode
from tokenwise.entrypoints.llm import build_engine_config
from tokenwise.forward_context import BatchDescriptor
from tokenwise.runner import graph_setup

M = CUDAGraphMode
PROMPTS = [
    "The quick brown fox",
    "Hello",
    "def fibonacci(n):\n    return",
    "import os\nimport",
    "Once upon a time",
    "The cat sat on the mat",
]
# Lengths 2..12: the decode batch shrinks 6, 5, 4, 3, 2, 1 as requests finish.
PARAMS = [
    SamplingParams(temperature=0, max_tokens=2 + 2 * i, ignore_eos=True, logprobs=1)
    for i in range(len(PROMPTS))
]


class Recorder:
    """Fake capturers, plus the dispatcher's decision for every step."""

    def __init__(self) -> None:
        self.capturers: list[EagerReplayCapturer] = []
        self.steps: list[tuple[int, bool, CUDAGraphMode, BatchDescriptor]] = []

    def factory(self, device: torch.device) -> Any:
        def make() -> EagerReplayCapturer:
            self.capturers.append(EagerReplayCapturer())
            return self.capturers[-1]

        return make

    def spy(self, llm: LLM) -> None:
        dispatcher = llm.llm_engine.runner.graph_runner.dispatcher
        dispatch = dispatcher.dispatch

        def recording(num_tokens: int, uniform_decode: bool = False, **kw: Any) -> Any:
            mode, desc = dispatch(num_tokens, uniform_decode=uniform_decode, **kw)
            self.steps.append((num_tokens, uniform_decode, mode, desc))
            return mode, desc

        dispatcher.dispatch = recording

    @property
    def replays(self) -> int:
        return sum(c.num_replays for c in self.capturers)


def run(
    mode: CUDAGraphMode | None,
    sizes: list[int] | None = None,
    recorder: Recorder | None = None,
    max_num_batched_tokens: int = 2048,
) -> tuple[LLM, list[Any]]:
    config = build_engine_config(
        checkpoint("Qwen3ForCausalLM"),
        dtype="float32",
        num_gpu_blocks=64,
        enforce_eager=True,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    llm = graph_llm(config, mode, sizes, recorder)
    return llm, llm.generate(PROMPTS, PARAMS, use_tqdm=False)


def graph_llm(
    config: Any, mode: CUDAGraphMode | None, sizes: list[int] | None, recorder: Recorder | None
) -> LLM:
    """An `LLM` over `config` in graph `mode` (None: eager), spied on by `recorder`."""
    if mode is not None:
        config.compilation.cudagraph_mode = mode
        config.compilation.cudagraph_capture_sizes = sizes
        if mode.requires_piecewise_compilation():
            config.compilation.use_compile = True
            config.compilation.piece_backend = "eager"  # Inductor is tested elsewhere
    llm = LLM.from_engine_config(config)
    if recorder is not None:
        recorder.spy(llm)
    return llm


def chosen_logprobs(output: Any) -> list[float]:
    sample = output.outputs[0]
    return [step[t].logprob for step, t in zip(sample.logprobs, sample.token_ids, strict=True)]


def assert_same_outputs(got: list[Any], want: list[Any]) -> None:
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(chosen_logprobs(g), chosen_logprobs(w), atol=1e-4, rtol=0)


@pytest.fixture
def fake_graphs(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    recorder = Recorder()
    monkeypatch.setattr(graph_setup, "new_capturer_factory", recorder.factory)
    monkeypatch.setenv(selector.ENV_VAR, "triton")
    torch._dynamo.reset()
    return recorder


def test_full_decode_graphs_replay_fresh_metadata_and_pad_into_the_trash(
    fake_graphs: Recorder,
) -> None:
    eager_llm, eager = run(None)
    llm, outs = run(M.FULL_DECODE_ONLY, [2, 4], fake_graphs)
    assert_same_outputs(outs, eager)

    # One graph per capture size, captured before the first step.
    assert len(fake_graphs.capturers) == 2
    full_steps = 0
    for n, uniform, mode, desc in fake_graphs.steps:
        if not uniform or n > 4:  # prefills, and decode batches above the largest graph
            assert (mode, desc) == (M.NONE, BatchDescriptor(n))
        else:
            padded = 2 if n <= 2 else 4
            assert (mode, desc) == (M.FULL, BatchDescriptor(padded, padded, True))
            full_steps += 1
    assert {n for n, u, *_ in fake_graphs.steps if u} == {1, 2, 3, 4, 5, 6}
    assert full_steps == 8  # two steps each at 4, 3, 2 and 1 sequences
    assert fake_graphs.replays == full_steps

    # Padding rows wrote only to the trash block: every real block holds what eager wrote.
    name = next(iter(llm.llm_engine.runner.kv_caches))
    cache = llm.llm_engine.runner.kv_caches[name]
    eager_cache = eager_llm.llm_engine.runner.kv_caches[name]
    torch.testing.assert_close(cache[:, :-1], eager_cache[:, :-1], atol=1e-5, rtol=0)
    assert cache[:, -1].abs().sum() > 0 and eager_cache[:, -1].abs().sum() == 0
    # The last step (1 sequence padded to 2) left a PAD slot and a length-1 row in the buffers.
    state = llm.llm_engine.runner.graph_runner.attn_state
    assert state._graph_slot_mapping[1] == PAD_SLOT_ID and state._graph_seq_lens[1] == 1


def test_plain_full_mode_runs_steps_with_prefills_eagerly(fake_graphs: Recorder) -> None:
    """Plain FULL keys graphs by token count alone, so a 4-token prompt chunk would match the
    4-token decode graph; its prefill would then replay decode-only attention. It must not."""
    _, eager = run(None, max_num_batched_tokens=4)
    _, outs = run(M.FULL, [2, 4], fake_graphs, max_num_batched_tokens=4)
    assert_same_outputs(outs, eager)
    small_mixed = [s for s in fake_graphs.steps if not s[1] and s[0] <= 4]
    assert small_mixed and all(s[2:] == (M.NONE, BatchDescriptor(s[0])) for s in small_mixed)
    decodes = [s for s in fake_graphs.steps if s[1]]
    assert decodes and all(s[2] == M.FULL and s[3].num_reqs is None for s in decodes)


def test_full_and_piecewise_graphs_for_mixed_and_decode_steps(fake_graphs: Recorder) -> None:
    _, eager = run(None, max_num_batched_tokens=8)
    llm, outs = run(M.FULL_AND_PIECEWISE, [4, 8], fake_graphs, max_num_batched_tokens=8)
    assert_same_outputs(outs, eager)
    num_layers = llm.llm_engine.model_config.num_layers
    # Every key the dispatcher can return was captured: two whole-model decode graphs, and one
    # graph per compiled piece (num_layers + 1 of them) per size for mixed batches.
    assert len(fake_graphs.capturers) == 2 + 2 * (num_layers + 1)
    modes = {mode for *_, mode, _ in fake_graphs.steps}
    assert modes == {M.FULL, M.PIECEWISE}  # 8-token chunks fit a graph, so nothing is eager
    for n, uniform, mode, desc in fake_graphs.steps:
        padded = 4 if n <= 4 else 8
        expected = BatchDescriptor(padded, padded, True) if uniform else BatchDescriptor(padded)
        assert (mode, desc) == ((M.FULL if uniform else M.PIECEWISE), expected)
    pieces = fake_graphs.capturers[2:]
    assert all(c.num_replays > 0 for c in pieces[: num_layers + 1])  # the 8-token graphs ran


def test_graphs_measured_on_a_placeholder_cache_are_recaptured_on_the_real_one(
    fake_graphs: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU start-up path: graphs captured once on a one-block cache to measure them.

    A real full graph holds the address of the cache it was captured on, so the placeholder's
    must not survive. The fake capturer re-runs Python on replay and cannot see a stale address,
    so the capture count is what shows the full graphs were captured again on the real cache
    (keeping the placeholder's runner fails it); piecewise graphs never read the cache and are
    captured once. The tokens must still equal eager's.
    """
    from tokenwise.runner.model_runner import ModelRunner

    determine = ModelRunner.determine_num_blocks

    def measuring(self: ModelRunner) -> int:
        assert self.kv_sizer._measure_graph_memory() == 0  # no device memory to read on CPU
        assert not self.kv_caches  # the placeholder is gone before the real cache exists
        return determine(self)

    _, eager = run(None)
    run(M.FULL_AND_PIECEWISE, [2, 4], fake_graphs)
    plain = len(fake_graphs.capturers)
    torch._dynamo.reset()
    monkeypatch.setattr(ModelRunner, "determine_num_blocks", measuring)
    _, outs = run(M.FULL_AND_PIECEWISE, [2, 4], fake_graphs)
    assert_same_outputs(outs, eager)
    # The full graphs twice (placeholder, then real cache: 2 sizes), the pieces once.
    assert len(fake_graphs.capturers) - plain == plain + 2


def test_one_graph_runner_per_engine_measures_then_captures(
    fake_graphs: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model runner builds its graph runner once; KV sizing measures with that same one.

    `measure()` captures every key and drops the full graphs (they hold the placeholder
    cache's address); `capture()` records them again on the real cache. A second runner (the
    old measuring path) would show here as a second construction.
    """
    from tokenwise.runner.graph_runner import CUDAGraphRunner
    from tokenwise.runner.model_runner import ModelRunner

    built: list[CUDAGraphRunner] = []
    init = CUDAGraphRunner.__init__

    def counting(self: CUDAGraphRunner, *args: Any, **kwargs: Any) -> None:
        built.append(self)
        init(self, *args, **kwargs)

    measured: list[int] = []
    determine = ModelRunner.determine_num_blocks

    def measuring(self: ModelRunner) -> int:
        assert self.graph_runner is not None and not self.graph_runner.captured
        measured.append(self.kv_sizer._measure_graph_memory())
        assert not self.graph_runner.full_model.entries  # dropped: the placeholder is gone
        return determine(self)

    monkeypatch.setattr(CUDAGraphRunner, "__init__", counting)
    monkeypatch.setattr(ModelRunner, "determine_num_blocks", measuring)
    llm, _ = run(M.FULL_AND_PIECEWISE, [2, 4], fake_graphs)
    runner = llm.llm_engine.runner
    assert built == [runner.graph_runner]
    assert measured == [0]  # no device memory to read on CPU
    assert runner.graph_runner.captured
    assert sorted(key.num_tokens for key in runner.graph_runner.full_model.entries) == [2, 4]


def test_a_graph_step_before_capture_is_an_error(fake_graphs: Recorder) -> None:
    llm, _ = run(M.FULL_DECODE_ONLY, [2], fake_graphs)
    graphs = llm.llm_engine.runner.graph_runner
    graphs.captured = False
    desc = BatchDescriptor(2, 2, True)
    with pytest.raises(RuntimeError, match=r"FULL graph was asked for before .*capture\(\)"):
        graphs.execute(M.FULL, desc, None, 2)


def test_piecewise_only_with_the_torch_backend(
    fake_graphs: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(selector.ENV_VAR, "torch")
    _, eager = run(None)
    llm, outs = run(M.PIECEWISE, [1, 2, 4], fake_graphs)
    assert_same_outputs(outs, eager)
    decodes = [(n, mode, desc) for n, u, mode, desc in fake_graphs.steps if u]
    assert (3, M.PIECEWISE, BatchDescriptor(4)) in decodes
    assert (6, M.NONE, BatchDescriptor(6)) in decodes
    # Captured (persistent buffers) and eager (fresh tensors) steps share one compilation.
    assert llm.llm_engine.runner.model.backend.num_compiles == 1


def test_default_capture_sizes() -> None:
    assert graph_setup.default_capture_sizes(1) == [1]
    assert graph_setup.default_capture_sizes(3) == [1, 2, 3]
    assert graph_setup.default_capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_setup.default_capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert graph_setup.default_capture_sizes(256, 12) == [1, 2, 4, 8, 12]
    with pytest.raises(ValueError, match="max_num_seqs"):
        graph_setup.default_capture_sizes(0)


def test_padding_rows_are_one_token_decodes_on_pad_slots() -> None:
    from tokenwise.attention.metadata import CommonMetadataBuilder
    from tokenwise.engine.request import Request
    from tokenwise.engine.step_outputs import ScheduledRequest
    from tokenwise.runner.input_batch import InputBatch

    prefill = Request("a", [5, 6, 7, 8, 9], SamplingParams())  # a prefill of 5 tokens
    decode = Request("b", list(range(7)), SamplingParams())  # a decode at position 6
    decode.num_computed_tokens = 6
    batch = InputBatch(8, 16, 32, 4, torch.device("cpu"))
    # Blocks [3, 7] and [2, 9], as the block manager would report them to a new row.
    step = batch.prepare(
        *_prep(
            [
                ScheduledRequest(prefill, 5, 0, ([3, 7],), (2,)),
                ScheduledRequest(decode, 1, 0, ([2, 9],), (2,)),
            ]
        )
    )
    padded = batch.pad(step, 8)
    assert batch.pad(step, step.num_tokens) is step
    builder = CommonMetadataBuilder(block_size=4)
    builder.prepare()
    md = builder.build(
        padded.context_lens_np + padded.query_lens_np,
        padded.query_lens_np,
        slot_mapping=padded.slot_mapping,
        seq_lens_tensor=padded.seq_lens,
        block_tables=padded.block_tables,
    )
    assert padded.input_ids.tolist() == [5, 6, 7, 8, 9, 6, 0, 0]
    assert md.slot_mapping.tolist() == [12, 13, 14, 15, 28, 38, PAD_SLOT_ID, PAD_SLOT_ID]
    assert (md.num_prefills, md.num_prefill_tokens, md.num_decode_tokens) == (1, 5, 3)
    assert md.seq_lens_tensor.tolist() == [5, 7, 1, 1]
    assert md.context_lens_tensor.tolist() == [0, 6, 0, 0]
    assert md.query_start_loc.tolist() == [0, 5, 6, 7, 8]
    assert md.seq_start_loc.tolist() == [0, 5, 12, 13, 14]
    assert md.block_tables.tolist() == [[3, 7], [2, 9], [0, 0], [0, 0]]
    assert md.query_lens == [5, 1, 1, 1] and md.context_lens == [0, 6, 0, 0]
    assert md.decode_metadata.num_decodes == 3
    with pytest.raises(ValueError, match="pad"):
        batch.pad(step, step.num_tokens - 1)


def _prep(items: list) -> tuple[list, list]:
    return items, states_of(items)
