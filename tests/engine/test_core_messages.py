"""The wire format between an engine core and its client: every message survives the trip.

The per-step outputs decode straight into the engine's own dataclasses (no pickle), so a field
added to `RequestOutput` without a type msgspec can carry, or a union it cannot tell apart,
fails here rather than in a running server.
"""

from __future__ import annotations

from tokenwise.engine import core_messages as msg
from tokenwise.engine.stats import EngineStats
from tokenwise.lora.request import LoRARequest
from tokenwise.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    RequestOutput,
)
from tokenwise.sampling.guided.params import GuidedDecodingParams
from tokenwise.sampling.params import SamplingParams


def _output(stop_reason: int | str | None) -> RequestOutput:
    logprobs = [{5: Logprob(-0.25, 1, "a"), 9: Logprob(-1.5, 2, None)}, {7: Logprob(-3.0)}]
    return RequestOutput(
        "r-1",
        "the prompt",
        [1, 2, 3],
        [
            CompletionOutput(0, "ab", [5, 7], -3.25, logprobs, "stop", stop_reason),
            CompletionOutput(1, "", [], None, None, None, None),
        ],
        finished=False,
        num_cached_tokens=16,
        error=None,
        metrics={"time_to_first_token": 0.5},
        prompt_logprobs=[None, {2: Logprob(-0.5, 3, "b"), 8: Logprob(-0.1, 1, "c")}, None],
    )


def test_step_outputs_round_trip_into_the_engine_dataclasses() -> None:
    stats = EngineStats(num_running=3, num_total_blocks=64, finished_reasons={"length": 2})
    embedding = EmbeddingRequestOutput("e", EmbeddingOutput([0.5, -1.0]), [4, 5], error="x")
    for stop_reason in ("END", 42, None):  # the union a stop reason can be
        sent = msg.CoreOutputs(2, [_output(stop_reason)], stats, {1: (3, 2.5)}, [embedding])
        got = msg.decode_from_core(msg.encode(sent))
        assert isinstance(got, msg.CoreOutputs)
        assert got == sent
        assert isinstance(got.outputs[0].outputs[0].logprobs[0][5], Logprob)
        assert isinstance(got.outputs[0].prompt_logprobs[1][2], Logprob)
        assert got.outputs[0].outputs[0].stop_reason == stop_reason
        assert got.stats.prefix_cache_hit_rate == 0.0  # an EngineStats, with its properties


def test_control_messages_round_trip() -> None:
    for message in (
        msg.CoreReady(1, 128),
        msg.CoreRejected(0, "r", "ValueError: no such adapter"),
        msg.CoreDead(0, "RuntimeError: boom\ntraceback", "RuntimeError"),
        msg.LoRAChecked("adapter targets qq_proj"),
        msg.LoRAChecked(None),
    ):
        assert msg.decode_from_core(msg.encode(message)) == message
    for message in (msg.AbortRequests(["a", "b"]), msg.StopCore(), msg.CheckLoRA(b"\x80")):
        assert msg.decode_to_core(msg.encode(message)) == message


def test_a_request_travels_with_its_parameters_whole() -> None:
    params = SamplingParams(
        temperature=0.5,
        n=2,
        seed=3,
        stop=["\n\n"],
        logprobs=2,
        guided_decoding=GuidedDecodingParams(json={"type": "object"}),
    )
    lora = LoRARequest("adapter", 1, "/tmp/adapter")
    prompt = {"prompt": "hi", "prompt_token_ids": [7, 8]}
    got = msg.decode_to_core(msg.encode(msg.add_request("r", prompt, params, "salt", lora)))
    assert isinstance(got, msg.AddRequest) and got.request_id == "r"
    g_prompt, g_params, g_salt, g_lora = msg.add_request_fields(got)
    assert (g_prompt, g_salt, g_lora) == (prompt, "salt", lora)
    assert g_params == params


def test_stripping_prompts_leaves_the_requests_own_lists_alone() -> None:
    ids = [1, 2, 3]
    out = RequestOutput("r", "text", ids, [])
    assert msg.strip_prompts([out]) == [out]
    assert out.prompt is None and out.prompt_token_ids == [] and ids == [1, 2, 3]
