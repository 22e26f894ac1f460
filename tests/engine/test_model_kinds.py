"""Model kinds as strategies: one engine loop, the kind supplying what differs.

Each kind's engine gets the KV-cache groups, scheduler, runner and request type of its kind,
and bad parameters for a kind fail with a message naming the kind. Both engines callers drive
(`LLMEngine`, `EngineCoreClient`) offer the whole `EngineClient` protocol with the same
signatures, so `LLM` and the server can drive either.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from tests.engine._fixtures import assert_pool_clean, checkpoint
from tests.tiny_checkpoints import build_tiny_checkpoint
from tokenwise import LLM, SamplingParams
from tokenwise.engine.client import EngineClient
from tokenwise.engine.core_client import EngineCoreClient
from tokenwise.engine.kinds.encoder_decoder import EncoderDecoderKind
from tokenwise.engine.kinds.encoder_decoder_runner import EncoderDecoderRunnerPart
from tokenwise.engine.kinds.encoder_decoder_scheduler import EncoderDecoderScheduler
from tokenwise.engine.kinds.generate import GenerateKind
from tokenwise.engine.kinds.pooling import EmbedKind
from tokenwise.engine.kinds.pooling_runner import PoolingRunnerPart
from tokenwise.engine.kinds.pooling_scheduler import PoolingScheduler
from tokenwise.engine.kinds.requests import EmbeddingRequest, EncoderDecoderRequest
from tokenwise.engine.llm_engine import LLMEngine
from tokenwise.engine.request import Request
from tokenwise.engine.scheduler import Scheduler
from tokenwise.lora.request import LoRARequest
from tokenwise.pooling.params import PoolingParams
from tokenwise.runner.kind_part import RunnerKindPart
from tokenwise.runner.model_runner import ModelRunner


@pytest.fixture(scope="module")
def embed_llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path = build_tiny_checkpoint(tmp_path_factory.mktemp("bert"), "BertModel")
    return LLM(path, task="embed", dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def bart_llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path = build_tiny_checkpoint(tmp_path_factory.mktemp("bart"), "BartForConditionalGeneration")
    return LLM(path, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def llama_llm() -> LLM:
    return LLM(checkpoint(), dtype="float32", device="cpu")


def test_each_kind_gets_its_groups_scheduler_runner_part_and_requests(
    llama_llm: LLM, embed_llm: LLM, bart_llm: LLM
) -> None:
    expected = [
        (llama_llm, GenerateKind, 1, Scheduler, RunnerKindPart, Request),
        (embed_llm, EmbedKind, 0, PoolingScheduler, PoolingRunnerPart, EmbeddingRequest),
        (
            bart_llm,
            EncoderDecoderKind,
            2,
            EncoderDecoderScheduler,
            EncoderDecoderRunnerPart,
            EncoderDecoderRequest,
        ),
    ]
    for llm, kind, groups, scheduler, part, request in expected:
        engine = llm.llm_engine
        assert type(engine) is LLMEngine  # one loop for every kind
        assert type(engine.kind) is kind
        assert engine.block_manager.num_kv_cache_groups == groups
        assert type(engine.scheduler) is scheduler
        # One runner for every kind; what a kind adds is a part it holds.
        assert type(engine.runner) is ModelRunner and type(engine.runner.kind_part) is part
        params = PoolingParams() if kind is EmbedKind else SamplingParams(max_tokens=2)
        engine.add_request("probe", [5, 6, 7], params)
        assert [type(r) for r in engine.groups["probe"]] == [request]
        while engine.has_request("probe"):
            engine.step()
        assert_pool_clean(engine)


def test_the_embedding_kind_has_no_kv_cache_and_says_what_it_refuses(embed_llm: LLM) -> None:
    engine = embed_llm.llm_engine
    assert engine.block_manager.num_blocks == 0 and engine.get_stats().kv_cache_usage == 0.0
    with pytest.raises(ValueError, match="is an embedding model .*cannot generate text"):
        engine.add_request("a", "hello", SamplingParams())
    with pytest.raises(ValueError, match="embedding model: it takes no LoRA adapter"):
        engine.add_request("b", "hello", PoolingParams(), lora_request=LoRARequest("x", 1, "/"))
    assert not engine.has_unfinished_requests()


def test_a_generative_kind_refuses_pooling_params(llama_llm: LLM) -> None:
    with pytest.raises(TypeError, match="generative model takes SamplingParams, got PoolingParams"):
        llama_llm.llm_engine.add_request("a", "hello", PoolingParams())
    assert not llama_llm.llm_engine.has_unfinished_requests()


def test_base_request_carries_no_kind_fields() -> None:
    base = {f.name for f in dataclasses.fields(Request)}
    assert not base & {"pooling_params", "encoder_inputs", "block_table", "cross_block_table"}
    # Scheduling state only: the runner keeps its own copy (the generator is the runner's),
    # and what is reported lives in the output processor.
    assert not base & {"generator", "detokenizer", "new_token_ids", "prompt_logprobs", "index"}
    assert "pooling_params" in {f.name for f in dataclasses.fields(EmbeddingRequest)}
    assert "encoder_inputs" in {f.name for f in dataclasses.fields(EncoderDecoderRequest)}


@pytest.mark.parametrize("engine_cls", [LLMEngine, EngineCoreClient])
def test_both_engines_offer_the_engine_client_protocol(engine_cls: type) -> None:
    """Every protocol method exists with the protocol's parameter names, in order."""
    names = [n for n, v in vars(EngineClient).items() if callable(v) and not n.startswith("_")]
    assert {"add_request", "step", "abort_request", "has_request", "shutdown"} <= set(names)
    for name in names:
        want = list(inspect.signature(getattr(EngineClient, name)).parameters)
        got = list(inspect.signature(getattr(engine_cls, name)).parameters)
        assert got == want, f"{engine_cls.__name__}.{name}{got} != protocol's {want}"


def test_a_running_engine_is_an_engine_client(llama_llm: LLM) -> None:
    assert isinstance(llama_llm.llm_engine, EngineClient)
