"""`EngineClient`: what the offline API and the server drive, and `create_engine`, the one
place an engine is made.

Two engines satisfy the protocol: `LLMEngine` (one engine in this process, for every model
kind) and `EngineCoreClient` (a front end over engine-core processes: one, or one per
data-parallel rank). `LLM`, the server's async engine and the benchmarks see only this
protocol, so none of them knows which one serves them.

Which one `create_engine` makes: data parallelism always takes core processes. Otherwise `LLM`
keeps the engine in its own process (the caller's thread drives it and nothing else competes
for the interpreter lock, so a second process would only add a hop per step), while `tokenwise
serve` asks for a core process (`core_process=True`): there the HTTP handling, tokenization and
streaming would otherwise take the interpreter lock from the engine loop between and during its
steps. `TOKENWISE_ENABLE_MULTIPROCESSING=0` (vLLM's `VLLM_ENABLE_V1_MULTIPROCESSING`) keeps the
server's engine in-process. Vision-language models take a core process too (the client
processes their images, `kinds/multimodal_prompts.py`). Embedding and encoder-decoder models are
served in-process for now: their prompt processing (pooling checks, audio features) runs in the
engine, not yet in the client.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from tokenwise import envs
from tokenwise.config import EngineConfig
from tokenwise.engine.core_client import EngineCoreClient
from tokenwise.engine.kinds.generate import GenerateKind
from tokenwise.engine.kinds.multimodal import MultiModalKind
from tokenwise.engine.kinds.select import model_kind_for
from tokenwise.engine.llm_engine import LLMEngine
from tokenwise.engine.prompts import PromptInput
from tokenwise.engine.stats import EngineStats
from tokenwise.executor.worker_main import maybe_serve_torchrun_worker
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
        priority: int = 0,
    ) -> None:
        """Queue a request (SamplingParams, or PoolingParams for an embedding model); bad
        input raises here, naming the problem, before anything is queued. `priority`: lower
        is served first under `scheduling_policy="priority"` (must be 0 otherwise)."""

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

    def wakeup(self) -> None:
        """Make a `step()` that is waiting for outputs return now; callable from any thread
        (a server's handler hands over a request while the engine thread waits)."""

    def check_health(self) -> None:
        """Raise, with the reason, if the engine can no longer serve (a core process died);
        a server calls it while idle, so a dead engine is noticed without a request."""

    def forward_time_table(self) -> dict[int, tuple[int, float]]:
        """batch size (tokens in the pass) -> (forward passes, median ms), for `/metrics`."""

    def shutdown(self) -> None:
        """Stop worker processes and threads; the engine cannot step afterwards."""


ENV_MULTIPROCESSING = "TOKENWISE_ENABLE_MULTIPROCESSING"


def create_engine(config: EngineConfig, core_process: bool = False) -> EngineClient:
    """One engine in this process, or a front end over engine-core processes: one per
    data-parallel rank, or (`core_process`, a generative or vision-language model) one core.

    The model kind (generate, embed, encoder-decoder) is the engine's to choose from the
    configuration. Under torchrun, on a TP rank other than 0 this never returns: the rank
    serves rank 0's steps and its process exits with status 0 when rank 0 shuts down (see
    `tokenwise.executor.worker_main`).
    """
    maybe_serve_torchrun_worker(config)
    if config.parallel.data_parallel_size > 1:
        return EngineCoreClient(config)
    kind = model_kind_for(config)
    if core_process and _multiprocessing_enabled() and kind in (GenerateKind, MultiModalKind):
        return EngineCoreClient(config)
    return LLMEngine(config, config.device)


def _multiprocessing_enabled() -> bool:
    value = envs.get(ENV_MULTIPROCESSING).strip().lower()
    if value not in ("0", "1", "false", "true"):
        raise ValueError(f"{ENV_MULTIPROCESSING} must be 0 or 1, got {value!r}")
    return value in ("1", "true")
