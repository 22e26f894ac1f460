"""KV capacity at start-up, and liveness of the whole engine on random small pools.

An engine whose pool cannot hold one `max_model_len` sequence must refuse to start (naming
both numbers and the settings that change them) rather than accept requests it can never
finish. An engine that did start must end every request: the property test below runs the
real model on random pools, prompts and limits, with aborts, and checks the step bound and
that every block is free afterwards.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.engine._fixtures import assert_pool_clean, checkpoint, hf_greedy
from tokenwise import LLM, SamplingParams
from tokenwise.batchsize_stats import ENV_INTERVAL
from tokenwise.entrypoints.cli import main as cli_main
from tokenwise.runner import kv_cache_sizing

SETTINGS = ("num_gpu_blocks", "kv_cache_memory", "gpu_memory_utilization", "max_model_len")


@pytest.fixture(scope="module")
def path() -> str:
    return checkpoint()  # max_position_embeddings=512, so max_model_len defaults to 512


def test_pool_smaller_than_one_sequence_is_refused(path: str) -> None:
    """The issue's reproduction: 24 blocks of 4 = 96 tokens against max_model_len 512."""
    with pytest.raises(ValueError) as info:
        LLM(path, dtype="float32", num_gpu_blocks=24, block_size=4)
    message = str(info.value)
    assert "96 tokens" in message and "max_model_len=512" in message
    assert "at least 128 blocks" in message
    assert all(setting in message for setting in SETTINGS)


def test_memory_budget_smaller_than_one_sequence_is_refused(path: str) -> None:
    llm = LLM(path, dtype="float32", max_model_len=64, num_gpu_blocks=4)
    block_bytes = llm.llm_engine.runner.kv_sizer.kv_cache_bytes_per_block()
    with pytest.raises(ValueError, match="max_model_len=512"):
        LLM(path, dtype="float32", kv_cache_memory=10 * block_bytes)  # 160 of 512 tokens


def test_exactly_one_sequence_is_enough_and_max_model_len_is_kept(path: str) -> None:
    """The same pool with max_model_len=96 starts, keeps 96, and the 90-token prompt ends
    with "length" once the sequence reaches 96 tokens, equal to transformers."""
    llm = LLM(path, dtype="float32", num_gpu_blocks=24, block_size=4, max_model_len=96)
    engine = llm.llm_engine
    assert engine.model_config.max_model_len == 96
    prompt = torch.randint(3, 250, (90,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    [out] = llm.generate([prompt], params, use_tqdm=False)
    assert out.outputs[0].finish_reason == "length"
    assert out.outputs[0].token_ids == hf_greedy(path, prompt, 6)
    assert_pool_clean(engine)


def test_default_cpu_pool_holds_one_sequence(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default budget is capped (1 GiB), but never below one max_model_len sequence:
    otherwise the default settings themselves would fail the start-up check."""
    monkeypatch.setattr(kv_cache_sizing, "DEFAULT_CPU_KV_CACHE_MEMORY", 1)
    engine = LLM(path, dtype="float32", max_model_len=80, block_size=16).llm_engine
    assert engine.block_manager.num_blocks * 16 >= 80
    assert engine.block_manager.num_blocks == 5


def test_serve_refuses_to_start(
    path: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_INTERVAL, "-1")  # stats stay off; serve would turn them on
    argv = ["serve", "--model", path, "--dtype", "float32", "--num-gpu-blocks", "2"]
    assert cli_main(argv + ["--port", "1"]) == 2  # fails before binding any port
    err = capsys.readouterr().err
    assert "32 tokens" in err and "max_model_len=512" in err and "num_gpu_blocks" in err


@st.composite
def engine_workloads(draw: st.DrawFn) -> dict:
    block_size = draw(st.sampled_from([4, 16]))
    max_model_len = draw(st.integers(24, 96))
    min_blocks = -(-max_model_len // block_size)
    return {
        "block_size": block_size,
        "max_model_len": max_model_len,
        "num_gpu_blocks": draw(st.integers(min_blocks, 2 * min_blocks)),
        "max_num_seqs": draw(st.integers(1, 6)),
        "max_num_batched_tokens": draw(st.integers(8, 64)),
        "enable_prefix_caching": draw(st.booleans()),
        "requests": draw(
            st.lists(
                st.tuples(
                    st.integers(1, max_model_len - 1),  # prompt length
                    st.integers(1, 40),  # max_tokens
                    st.integers(1, 3),  # n
                    st.booleans(),  # sampled (seeded) or greedy
                ),
                min_size=1,
                max_size=6,
            )
        ),
        "abort_at": draw(st.one_of(st.none(), st.integers(0, 10))),
    }


@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(engine_workloads())
def test_engine_ends_every_request_on_any_legal_pool(path: str, w: dict) -> None:
    requests = w.pop("requests")
    abort_at = w.pop("abort_at")
    llm = LLM(path, dtype="float32", **w)
    engine = llm.llm_engine
    gen = torch.Generator().manual_seed(0)
    expected = {}
    for i, (prompt_len, max_tokens, n, sampled) in enumerate(requests):
        prompt = torch.randint(3, 250, (prompt_len,), generator=gen).tolist()
        params = SamplingParams(
            n=n,
            temperature=0.9 if sampled else 0.0,
            seed=i,
            max_tokens=max_tokens,
            ignore_eos=True,
        )
        engine.add_request(f"r{i}", prompt, params)
        expected[f"r{i}"] = n
    total_seqs = sum(expected.values())
    bound = total_seqs * (w["max_model_len"] + 1) + 1
    finished: dict[str, list[str | None]] = {}
    for step in itertools.count():
        if not engine.has_unfinished_requests():
            break
        assert step < bound, "the engine stopped making progress"
        if step == abort_at:
            engine.abort_request("r0")
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = [c.finish_reason for c in out.outputs]
    assert set(finished) == set(expected)
    for rid, reasons in finished.items():
        allowed = {"length", "abort"} if rid == "r0" else {"length"}
        assert set(reasons) <= allowed and len(reasons) >= 1, (rid, reasons)
    assert_pool_clean(engine)
