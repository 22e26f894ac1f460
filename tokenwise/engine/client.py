"""`EngineClient`: what the offline API and the server drive, and `create_engine`, the one
place an engine is made.

Two engines satisfy the protocol today: `LLMEngine` (one engine in this process, for every model
kind) and `DPEngineClient` (a front end over one engine process per data-parallel rank). The
engine-core process client of a later step will be a third. `LLM`, the server's async engine
and the benchmarks see only this protocol, so none of them knows which one serves them.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from tokenwise.config import EngineConfig
from tokenwise.distributed.dp_engine_client import DPEngineClient
from tokenwise.distributed.tp_worker import maybe_serve_torchrun_worker
from tokenwise.engine.llm_engine import LLMEngine
from tokenwise.engine.prompts import PromptInput
from tokenwise.engine.stats import EngineStats
from tokenwise.lora.request import LoRARequest
from tokenwise.outputs import EmbeddingRequestOutput, RequestOutput


@runtime_checkable
class EngineClient(Protocol):
    """Requests in, incremental outputs out: the interface every engine offers its callers."""

    def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: Any = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request (SamplingParams, or PoolingParams for an embedding model); bad
        input raises here, naming the problem, before anything is queued."""

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Abort requests (unknown ids are ignored); a later `step` reports them."""

    def step(self) -> list[RequestOutput | EmbeddingRequestOutput]:
        """Run (or wait a bounded time for) one step; the outputs of requests that changed."""

    def has_request(self, request_id: str) -> bool:
        """Whether `request_id` was accepted and its finished output not yet returned."""

    def has_unfinished_requests(self) -> bool: ...

    def get_num_unfinished_requests(self) -> int: ...

    def get_stats(self) -> EngineStats: ...

    def get_tokenizer(self) -> Any: ...

    def shutdown(self) -> None:
        """Stop worker processes and threads; the engine cannot step afterwards."""


def create_engine(config: EngineConfig) -> EngineClient:
    """One engine in this process, or a front end over `data_parallel_size` rank processes.

    The model kind (generate, embed, encoder-decoder) is the engine's to choose from the
    configuration. Under torchrun, on a TP rank other than 0 this never returns: the rank
    serves rank 0's steps and its process exits with status 0 when rank 0 shuts down (see
    `tokenwise.distributed.tp_worker`).
    """
    maybe_serve_torchrun_worker(config)
    if config.parallel.data_parallel_size > 1:
        return DPEngineClient(config)
    return LLMEngine(config, config.device)
