"""The engine of an embedding model (`task="embed"`): prompts in, one embedding each out.

It is `LLMEngine` with three parts swapped (`runner_cls`, `scheduler_cls`, the block manager):
the same request bookkeeping, abort handling, failure isolation (a failed forward pass fails
only its own requests) and statistics, but a step encodes whole prompts and each request ends in
that step with its embedding (`EmbeddingRequestOutput`), or with its error.

There is no KV cache: `NoKVCache` stands where the block manager is, with zero blocks, so the
statistics and `/metrics` report an empty pool and nothing can ever be left allocated.
"""

from __future__ import annotations

import time

from tokenwise.config import EngineConfig
from tokenwise.engine.block_manager import BlockManager
from tokenwise.engine.kinds.pooling_runner import PoolingModelRunner
from tokenwise.engine.kinds.pooling_scheduler import PoolingScheduler
from tokenwise.engine.llm_engine import LLMEngine
from tokenwise.engine.prompts import PromptInput, to_token_ids
from tokenwise.engine.request import Request
from tokenwise.engine.step_outputs import ModelRunnerOutput
from tokenwise.outputs import EmbeddingOutput, EmbeddingRequestOutput
from tokenwise.pooling.params import PoolingParams
from tokenwise.sampling.params import SamplingParams

# A Request carries SamplingParams; an embedding request's are a placeholder nothing reads.
_NO_SAMPLING = SamplingParams(max_tokens=1)


class NoKVCache:
    """The block manager of a model without a KV cache: zero blocks, nothing to free."""

    num_blocks = 0
    usage = 0.0
    prefix_cache_queries = 0
    prefix_cache_hits = 0

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def get_num_free_blocks(self) -> int:
        return 0

    def free(self, request_id: str, discard_cached: bool = False) -> None:
        """Nothing was allocated."""


class PoolingLLMEngine(LLMEngine):
    runner_cls = PoolingModelRunner
    scheduler_cls = PoolingScheduler

    def __init__(self, config: EngineConfig, device: str = "cpu") -> None:
        super().__init__(config, device)
        # Each encoded request's embedding, held from its step's result to its output.
        self._embeddings: dict[str, list[float]] = {}

    def _check_kv_capacity(self, num_blocks: int) -> None:
        """No cache to check: an encoder step holds whole prompts and keeps nothing."""

    def _make_block_manager(self, num_blocks: int) -> BlockManager:
        return NoKVCache(self.config.cache.block_size)  # type: ignore[return-value]

    def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: PoolingParams | SamplingParams | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Queue one prompt for embedding; bad input raises here, before anything is queued."""
        params = PoolingParams() if params is None else params
        if isinstance(params, SamplingParams):
            raise ValueError(
                f"model {self.model_config.model!r} is an embedding model (task='embed'): it "
                "cannot generate text; use LLM.embed or the /v1/embeddings endpoint"
            )
        if not isinstance(params, PoolingParams):
            raise TypeError(f"params must be a PoolingParams, got {type(params).__name__}")
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        params.verify(self.model_config.model)
        text, token_ids = to_token_ids(prompt, self.tokenizer, self.model_config.vocab_size)
        req = Request(request_id, token_ids, _NO_SAMPLING, pooling_params=params, prompt=text)
        self.scheduler.add_request(req)  # refuses prompts that cannot run in one step
        self._track(request_id, [req])

    def _route_samples(
        self,
        sampled: list[Request],
        result: ModelRunnerOutput,
        touched: dict[str, list[Request]],
    ) -> None:
        """Keep each encoded request's embedding until its output is made (this step)."""
        if result.pooler_output is None:
            return
        rows = result.pooler_output.cpu().tolist()
        for item, row in zip(result.pooled_requests, rows, strict=True):
            req = item.request
            self._embeddings[req.request_id] = row
            touched[req.group_id] = self.groups[req.group_id]

    def _make_output(self, request_id: str, samples: list[Request]) -> EmbeddingRequestOutput:  # type: ignore[override]
        """The request's one output: its embedding, or its error, or an abort (empty)."""
        req = samples[0]
        req.reported_finish = True
        embedding = self._embeddings.pop(request_id, [])
        self._forget(request_id, samples)
        return EmbeddingRequestOutput(
            request_id=request_id,
            outputs=EmbeddingOutput(embedding),
            prompt_token_ids=req.prompt_token_ids,
            finished=True,
            error=req.error,
            metrics={"e2e_latency": time.monotonic() - req.arrival_time},
        )
