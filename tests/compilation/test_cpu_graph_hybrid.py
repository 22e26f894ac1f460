"""CPU graphs over Gated DeltaNet hybrids (Qwen3.5): the decode step replayed from recorded
kernels, its recurrent slots read from persistent buffers (`runner/recurrent_graph.py`).

What must hold: every decode size up to the capture limit is captured (no torch op is left in a
hybrid's decode forward); replayed steps give the eager engine's tokens and HF's, while
requests join and leave (each replay reads other slots), around chunked prefills, under
preemption and with prefix-cache hits (whose state copies run outside the replayed forward);
a padding row or a capture touches no state; and a capture that meets a torch op is refused
with the op's name, the engine then decoding eagerly.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from tests.compilation.test_cpu_graph import count_graph_steps
from tests.engine._fixtures import assert_pool_clean, checkpoint, hf_greedy
from tokenwise import LLM, SamplingParams
from tokenwise.compilation.cpu_graph import CPUGraphCapturer
from tokenwise.config import CUDAGraphMode
from tokenwise.native import gated_attn, gdn_decode
from tokenwise.native import graph as native_graph

pytestmark = pytest.mark.skipif(
    native_graph.load() is None or gdn_decode.load() is None or gated_attn.load() is None,
    reason="no C compiler",
)

ARCH = "Qwen3_5ForCausalLM"
SHARED = list(range(5, 45))
# Different lengths and budgets: requests finish at different steps, and the queued ones join
# the decode batch in the freed slots.
PROMPTS = [
    SHARED + list(range(200, 230)),
    [60, 61, 62, 63, 64, 65],
    SHARED + [7, 9, 11, 13, 15, 17, 19, 21, 23],
    [90, 3, 88, 4, 86, 5, 84],
    list(range(100, 125)),
]
MAX_TOKENS = [12, 5, 9, 14, 7]


def _params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = _params()[: len(prompts)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def path() -> str:
    return checkpoint(ARCH)


@pytest.fixture(scope="module")
def want(path: str) -> list[list[int]]:
    return [hf_greedy(path, p, m) for p, m in zip(PROMPTS, MAX_TOKENS, strict=True)]


def _make(path: str, **kwargs: Any) -> LLM:
    common: dict[str, Any] = dict(dtype="float32", block_size=16, num_gpu_blocks=64)
    return LLM(path, **(common | dict(max_num_seqs=3, max_model_len=128) | kwargs))


def test_replayed_hybrid_decode_equals_eager_and_hf_as_requests_join_and_leave(
    path: str, want: list[list[int]]
) -> None:
    graphs = _make(path)
    runner = graphs.llm_engine.runner
    assert runner.graph_runner is not None and not runner.graph_runner.rejected
    keys = runner.graph_runner.dispatcher.keys[CUDAGraphMode.FULL]
    assert sorted(k.num_tokens for k in keys) == [1, 2, 3]
    replayed = count_graph_steps(graphs)
    got = _generate(graphs, PROMPTS)
    assert got == want
    assert got == _generate(_make(path, enforce_eager=True), PROMPTS)
    assert {1, 2, 3} <= set(replayed)  # the batch grew and shrank through every size
    assert_pool_clean(graphs.llm_engine)


def test_replays_around_chunked_prefill_preemption_and_prefix_hits(
    path: str, want: list[list[int]]
) -> None:
    """A 16-token budget (prompts prefilled over several steps between replays), a pool too
    small for every request (preempted and recomputed), then the same prompts again with
    prefix caching: hits restore snapshots into live slots before a replay reads them."""
    llm = _make(path, num_gpu_blocks=7, max_num_batched_tokens=16, max_model_len=96)
    replayed = count_graph_steps(llm)
    assert _generate(llm, PROMPTS) == want
    assert _generate(llm, PROMPTS[:3]) == want[:3]
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits > 0
    assert replayed
    assert_pool_clean(llm.llm_engine)


def test_ngram_drafts_between_replays_are_lossless(path: str) -> None:
    """Verification steps (drafts: per-token states kept, rolled back) run eagerly; the decode
    steps between them replay on the slots the rollbacks left."""
    repetitive = [11, 12, 13, 14, 15, 16, 17, 18] * 5
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    llm = _make(path, speculative_config=spec)
    replayed = count_graph_steps(llm)
    outs = llm.generate([{"prompt_token_ids": repetitive}], params, use_tqdm=False)
    assert list(outs[0].outputs[0].token_ids) == hf_greedy(path, repetitive, 24)
    assert llm.llm_engine.get_stats().spec_decode_num_draft_tokens > 0 and replayed


def test_a_torch_op_left_in_the_hybrid_forward_is_named(
    path: str,
    want: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With the residual add's kernel declined, the decoder layer runs torch's add: every size
    is refused naming it, and the engine decodes eagerly, still with HF's tokens."""
    monkeypatch.setattr(gated_attn, "add", lambda a, b: None)
    with caplog.at_level(logging.INFO, logger="tokenwise.runner.graph_runner"):
        llm = _make(path, max_num_seqs=2)
    graph_runner = llm.llm_engine.runner.graph_runner
    assert not graph_runner.dispatcher.keys[CUDAGraphMode.FULL]
    assert sorted(k.num_tokens for k in graph_runner.rejected) == [1, 2]
    assert all("aten.add" in reason for reason in graph_runner.rejected.values())
    assert "aten.add" in caplog.text
    replayed = count_graph_steps(llm)
    assert _generate(llm, PROMPTS[:2]) == want[:2]
    assert not replayed


def _step_inputs(dtype: torch.dtype) -> dict[str, Any]:
    """One GDN layer's decode step inputs: 2 key heads, 4 value heads of 16 x 20, K = 4."""
    gen = torch.Generator().manual_seed(7)
    nk, nv, dk, dv, taps = 2, 4, 16, 20, 4
    channels = 2 * nk * dk + nv * dv
    row = (taps - 1) * channels + nv * dk * dv

    def rnd(*shape: int, scale: float = 0.5) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    return dict(
        proj=rnd(3, channels + nv * dv + 2 * nv), states=rnd(5, row, scale=0.1),
        conv=rnd(channels, taps), a_log=rnd(nv), dt_bias=rnd(nv), norm=rnd(dv) + 1,
        heads=(nk, nv, dk, dv),
    )  # fmt: skip


def _step(x: dict[str, Any], rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x["proj"].shape[0], x["heads"][1] * x["heads"][3], dtype=x["proj"].dtype)
    assert gdn_decode.gated_delta_decode_step(
        x["proj"], rows, x["states"], slots, x["conv"], x["a_log"], x["dt_bias"], x["norm"],
        1e-6, out, x["heads"],
    )  # fmt: skip
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_recorded_step_reads_the_slots_written_before_each_replay(dtype: torch.dtype) -> None:
    """Captured on slot -1 (a zero state, never written: the capture's three runs agree and no
    slot changes), replayed after the slot buffer is refilled: each replay equals an eager call
    on those slots, state updates included."""
    x = _step_inputs(dtype)
    rows, slots = gdn_decode.index_tensor([0, 1, 2]), gdn_decode.index_tensor([-1, -1, -1])
    before = x["states"].clone()
    capturer = CPUGraphCapturer()
    out = capturer.capture(lambda: _step(x, rows, slots))
    assert torch.equal(x["states"], before)  # three runs on slot -1 wrote nothing
    zero = dict(x, states=torch.zeros_like(before))
    zero_slots = gdn_decode.index_tensor([0, 1, 2])
    assert torch.equal(out, _step(zero, rows, zero_slots))  # slot -1 reads a zero state
    for chosen in ([4, 0, 2], [1, 3, -1]):
        eager = dict(x, states=x["states"].clone())
        want = _step(eager, rows, gdn_decode.index_tensor(chosen))
        slots.copy_(gdn_decode.index_tensor(chosen))
        capturer.replay()
        assert torch.equal(out, want)
        assert torch.equal(x["states"], eager["states"])
