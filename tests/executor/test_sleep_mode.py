"""Sleep mode and weight updates of an offline engine (`executor/sleep_mode.py`,
`engine/sleep_control.py`, `distributed/weight_transfer.py`).

Expected tokens come from a fresh engine or from Hugging Face on the same weights, never from
the engine under test; memory released is read from the process's own RSS.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests.engine._fixtures import LLAMA, checkpoint, hf_greedy
from tokenwise import LLM, SamplingParams
from tokenwise.engine.sleep_control import EngineAsleepError

PROMPTS = ["the quick brown fox", "one two three four five"]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
# Large enough a KV cache that its release shows in the RSS well above the noise.
NUM_BLOCKS = 2048


def _tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


@pytest.fixture(scope="module")
def other_weights() -> str:
    """The same architecture with other values (another seed)."""
    return checkpoint(LLAMA, seed=1)


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    engine = LLM(checkpoint(), dtype="float32", num_gpu_blocks=NUM_BLOCKS, enable_sleep_mode=True)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def fresh_other(other_weights: str) -> list[list[int]]:
    engine = LLM(other_weights, dtype="float32", num_gpu_blocks=64)
    try:
        return _tokens(engine)
    finally:
        engine.shutdown()


def test_level_1_releases_memory_and_wakes_to_the_same_tokens(llm: LLM) -> None:
    before = _tokens(llm)
    runner = llm.llm_engine.runner
    kv_bytes = sum(t.untyped_storage().nbytes() for t in set(runner.kv_caches.values()))
    rss = _rss_bytes()
    llm.sleep(level=1)
    dropped = rss - _rss_bytes()
    assert llm.is_sleeping()
    assert dropped > 0.8 * kv_bytes, (dropped, kv_bytes)
    with pytest.raises(EngineAsleepError, match=r"asleep \(sleep level 1"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.wake_up(tags=["weights"])  # the KV cache still asleep: still refused
    assert llm.is_sleeping()
    with pytest.raises(EngineAsleepError, match="still asleep: kv_cache"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping()
    assert _tokens(llm) == before


def test_bad_sleep_and_wake_arguments_are_named(llm: LLM) -> None:
    with pytest.raises(ValueError, match="sleep level must be 1 or 2, got 3"):
        llm.sleep(level=3)
    with pytest.raises(ValueError, match=r"tags must be among .*got \['weight'\]"):
        llm.wake_up(tags=["weight"])
    assert not llm.is_sleeping()


def test_sleep_mode_must_be_enabled() -> None:
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        LLM(checkpoint(), dtype="float32", num_gpu_blocks=64, device="cuda", enable_sleep_mode=True)


def test_reload_and_level_2_reproduce_a_fresh_engine_on_those_weights(
    llm: LLM, other_weights: str, fresh_other: list[list[int]]
) -> None:
    own = _tokens(llm)  # these prompts' blocks are now in the prefix cache
    assert own != fresh_other  # the other weights are really other
    version = llm.weight_version
    llm.reload_weights(other_weights)  # awake: the prefix cache must not serve old blocks
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == fresh_other
    assert {o.weight_version for o in outs} == {version + 1}
    llm.sleep(level=2)
    llm.wake_up()
    assert not llm.is_sleeping()
    with pytest.raises(EngineAsleepError, match=r"discarded by sleep\(level=2\)"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.reload_weights()  # the engine's own checkpoint again
    assert _tokens(llm) == own
    assert llm.weight_version == version + 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(300, method="thread")
def test_a_trainer_pushes_new_weights_into_a_tp2_engine(other_weights: str) -> None:
    llm = LLM(checkpoint(), dtype="float32", num_gpu_blocks=64, tensor_parallel_size=2)
    try:
        tok = llm.get_tokenizer()
        prompt = tok.encode(PROMPTS[0])
        llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)  # cached prefix
        port = _free_port()
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        trainer = subprocess.Popen(
            [sys.executable, "-m", "tests.executor._trainer", "127.0.0.1", str(port), "3"]
            + [other_weights],
            cwd=root,
            env={**os.environ, "PYTHONPATH": root},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            llm.init_weight_update_group("127.0.0.1", port, 3, timeout_s=60)
            received = llm.receive_weights()
            out, _ = trainer.communicate(timeout=60)
        finally:
            if trainer.poll() is None:
                trainer.kill()
        assert trainer.returncode == 0, out
        assert received == len(_names(other_weights))
        (result,) = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)
        assert list(result.outputs[0].token_ids) == hf_greedy(other_weights, prompt, 8)
        assert result.weight_version == 1
    finally:
        llm.shutdown()


def test_joining_a_trainer_that_never_comes_fails_in_bounded_time(llm: LLM) -> None:
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"could not join the weight-transfer group .* 2 s"):
        llm.init_weight_update_group("127.0.0.1", _free_port(), 2, timeout_s=2)
    assert time.monotonic() - started < 30
    with pytest.raises(RuntimeError, match="init_weight_update_group first"):
        llm.receive_weights()


def _names(path: str) -> set[str]:
    from tokenwise.loader import safetensors_files, safetensors_names

    return safetensors_names(safetensors_files(path))


def test_weight_updates_into_quantized_layers_are_refused_by_name() -> None:
    llm = LLM(checkpoint(), dtype="float32", num_gpu_blocks=64, quantization="int8")
    try:
        with pytest.raises(ValueError, match=r"quantized layers .*model\.layers\.0\."):
            llm.reload_weights()
        assert llm.weight_version == 0
    finally:
        llm.shutdown()
