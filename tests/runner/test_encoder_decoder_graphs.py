"""Encoder-decoder models (BART, Whisper) under CUDA-graph dispatch, on CPU, capture faked.

As in test_graph_runner.py, `EagerReplayCapturer` replays by calling the captured function
again on the same persistent buffers, so what is observed is what a replayed graph computes: a
FULL decode graph's cross-attention reads each row's encoder length and cross block table from
`CommonAttentionState`'s encoder-decoder buffers, and rows left stale there (another request's
encoder, a finished request's table) would give other tokens than eager. Requests of different
encoder lengths finish at different steps, so the decode batch shrinks and is padded up to the
capture sizes. Steps that run an encoder must never reach the dispatcher: they run eagerly.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.engine._fixtures import assert_pool_clean, checkpoint
from tests.models.test_whisper_vs_hf import CLIPS, RATE
from tests.runner.test_graph_runner import Recorder, assert_same_outputs, fake_graphs  # noqa: F401
from tokenwise import LLM, SamplingParams
from tokenwise.attention.graph_state import CommonAttentionState
from tokenwise.config import CUDAGraphMode
from tokenwise.entrypoints.llm import build_engine_config

M = CUDAGraphMode
SIZES = [2, 4, 8, 16, 32, 48]
# (encoder ids, decoder prompt): encoders of 3 to 37 tokens, all run in the first step; the
# last decoder prompt (41 tokens) is split by the 128-token budget, so its second chunk and the
# others' first decodes make a mixed step without an encoder (35 tokens, padded to 48).
BART_PROMPTS = [
    {"encoder_prompt": list(range(5 + i, 5 + i + n)), "decoder_prompt": [0] + dec}
    for i, (n, dec) in enumerate(
        [(9, []), (37, [44, 45]), (3, []), (14, [7]), (26, []), (20, list(range(60, 100)))]
    )
]
# The decode batch shrinks 6, 5, 4, 3, 2, 1 as requests finish.
BART_PARAMS = [
    SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True, logprobs=1)
    for i in range(len(BART_PROMPTS))
]


class StepLog:
    """Per forward pass: whether an encoder ran, and which graph mode (None: eager)."""

    def __init__(self, llm: LLM) -> None:
        self.steps: list[tuple[bool, CUDAGraphMode | None]] = []
        runner = llm.llm_engine.runner
        run_eager, execute = runner._run_eager, runner.graph_runner.execute

        def eager(step: Any, md: Any, kwargs: Any = None) -> Any:
            self.steps.append((bool(kwargs), None))
            return run_eager(step, md, kwargs)

        def graph(mode: CUDAGraphMode, *args: Any) -> Any:
            self.steps.append((False, mode))
            return execute(mode, *args)

        runner._run_eager, runner.graph_runner.execute = eager, graph


def run(
    arch: str,
    prompts: list[Any],
    params: list[SamplingParams] | SamplingParams,
    mode: CUDAGraphMode | None,
    recorder: Recorder | None = None,
    **engine: Any,
) -> tuple[LLM, list[Any], StepLog | None]:
    config = build_engine_config(checkpoint(arch), dtype="float32", enforce_eager=True, **engine)
    if mode is not None:
        config.compilation.cudagraph_mode = mode
        config.compilation.cudagraph_capture_sizes = SIZES
        if mode.requires_piecewise_compilation():
            config.compilation.use_compile = True
            config.compilation.piece_backend = "eager"  # Inductor is tested elsewhere
    llm = LLM.from_engine_config(config)
    log = None
    if recorder is not None:
        recorder.spy(llm)
        log = StepLog(llm)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert_pool_clean(llm.llm_engine)
    return llm, outputs, log


def run_bart(mode: CUDAGraphMode | None, recorder: Recorder | None = None) -> Any:
    arch = "BartForConditionalGeneration"
    return run(
        arch,
        BART_PROMPTS,
        BART_PARAMS,
        mode,
        recorder,
        num_gpu_blocks=64,
        max_num_batched_tokens=128,
    )


@pytest.mark.parametrize("mode", [M.FULL_AND_PIECEWISE, M.FULL_DECODE_ONLY])
def test_bart_decode_graphs_replay_fresh_cross_rows(
    fake_graphs: Recorder,  # noqa: F811
    mode: CUDAGraphMode,
) -> None:
    _, eager, _ = run_bart(None)
    llm, outs, log = run_bart(mode, fake_graphs)
    assert_same_outputs(outs, eager)
    assert log is not None
    # Every encoder ran in an eager step, and only those never reached the dispatcher.
    encoder_steps = [s for s in log.steps if s[0]]
    assert encoder_steps and llm.llm_engine.runner.kind_part.num_encoder_runs == len(BART_PROMPTS)
    assert len(fake_graphs.steps) == len(log.steps) - len(encoder_steps)
    # Decode batches of 6 down to 1 replay FULL graphs padded to 8, 8, 4, 4, 2, 1 -> 2.
    decodes = [(n, m, d) for n, uniform, m, d in fake_graphs.steps if uniform]
    assert {n for n, *_ in decodes} == {1, 2, 3, 4, 5, 6}
    for n, m, desc in decodes:
        assert m == M.FULL and desc.num_tokens == min(s for s in SIZES if s >= n)
    full = sum(1 for _, m in log.steps if m == M.FULL)
    assert full == len(decodes) and fake_graphs.replays >= full
    mixed = [m for n, uniform, m, _ in fake_graphs.steps if not uniform]
    assert mixed  # the long decoder prompt's second chunk, which runs no encoder
    expected = M.PIECEWISE if mode == M.FULL_AND_PIECEWISE else M.NONE
    assert set(mixed) == {expected}
    # The last replay (1 sequence padded to 2) left a harmless padding row behind.
    state = llm.llm_engine.runner.graph_runner.attn_state
    assert state._graph_encoder_seq_lens[1] == 1
    assert state._graph_cross_block_tables[1].abs().sum() == 0


def test_stale_cross_rows_would_change_the_tokens(
    fake_graphs: Recorder,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The check above can fail: cross rows written for the first decode step only and then
    left in place (stale as the batch shrinks and reorders) give other tokens than eager."""
    _, eager, _ = run_bart(None)
    write = CommonAttentionState.prepare_graph_input_buffers
    calls: list[int] = []

    def first_only(self: CommonAttentionState, *args: Any) -> None:
        calls.append(1)
        if len(calls) == 1:
            write(self, *args)

    monkeypatch.setattr(CommonAttentionState, "prepare_graph_input_buffers", first_only)
    _, outs, _ = run_bart(M.FULL_DECODE_ONLY, fake_graphs)
    assert len(calls) > 1
    got = [o.outputs[0].token_ids for o in outs]
    assert got != [o.outputs[0].token_ids for o in eager]


def test_whisper_full_decode_graphs_give_eager_transcriptions(
    fake_graphs: Recorder,  # noqa: F811
) -> None:
    """Audio encoders (one step each, eager), then transcriptions that stop at EOS at different
    steps, decoded by FULL graphs: the same tokens as eager."""
    prompts = [{"prompt": "", "multi_modal_data": {"audio": (clip, RATE)}} for clip in CLIPS]
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1)
    engine = {"num_gpu_blocks": 64, "block_size": 8}
    arch = "WhisperForConditionalGeneration"
    _, eager, _ = run(arch, prompts, params, None, **engine)
    llm, outs, log = run(arch, prompts, params, M.FULL_DECODE_ONLY, fake_graphs, **engine)
    assert_same_outputs(outs, eager)
    assert log is not None
    assert log.steps[0] == (True, None) and llm.llm_engine.runner.kind_part.num_encoder_runs == len(
        CLIPS
    )
    assert any(m == M.FULL for _, m in log.steps) and fake_graphs.replays > 0
    # The cross buffers are as wide as the longest encoder's table.
    runner = llm.llm_engine.runner
    tables = runner.graph_runner.attn_state._graph_cross_block_tables
    assert tables.shape[1] == -(-runner.kind_part.max_encoder_len() // 8)


def test_graph_modes_are_accepted_and_the_default_stays_eager() -> None:
    """Asked for, a graph mode is kept (and compiles the model); unasked, or NONE, an
    encoder-decoder model still runs eagerly, on a GPU too; more than one rank is refused."""
    path = checkpoint("BartForConditionalGeneration")
    for mode in ("piecewise", "full_decode_only", "full_and_piecewise"):
        config = build_engine_config(path, device="cuda", cudagraph_mode=mode)
        assert config.compilation.cudagraph_mode == M.parse(mode)
        assert config.compilation.use_compile
    for mode in (None, "none"):
        config = build_engine_config(path, device="cuda", cudagraph_mode=mode)
        assert config.compilation.cudagraph_mode == M.NONE
        assert not config.compilation.use_compile
    with pytest.raises(ValueError, match="tensor_parallel_size must be 1"):
        build_engine_config(path, device="cuda", tensor_parallel_size=2)
