"""The embedding kind (`task="embed"`): prompts in, one embedding each out.

The same engine loop as for generation (request bookkeeping, abort handling, failure isolation:
a failed forward pass fails only its own requests, statistics), with this kind's parts: a step
encodes whole prompts (`PoolingScheduler`) and pools them (`PoolingModelRunner`), and each
request ends in that step with its embedding (`EmbeddingRequestOutput`), or with its error.

No KV-cache group: the block manager has zero blocks and zero groups, so the statistics and
`/metrics` report an empty pool and nothing can ever be left allocated.
"""

from __future__ import annotations

import time
from typing import Any

from tokenwise.engine.kinds.base import ModelKind, NewRequest
from tokenwise.engine.kinds.pooling_runner import PoolingModelRunner
from tokenwise.engine.kinds.pooling_scheduler import PoolingScheduler
from tokenwise.engine.kinds.requests import EmbeddingRequest
from tokenwise.engine.prompts import to_token_ids
from tokenwise.engine.request import Request
from tokenwise.engine.step_outputs import ModelRunnerOutput
from tokenwise.outputs import EmbeddingOutput, EmbeddingRequestOutput
from tokenwise.pooling.params import PoolingParams
from tokenwise.sampling.params import SamplingParams

# A Request carries SamplingParams; an embedding request's are a placeholder nothing reads.
_NO_SAMPLING = SamplingParams(max_tokens=1)


class EmbedKind(ModelKind):
    name = "embed"
    runner_cls = PoolingModelRunner
    scheduler_cls = PoolingScheduler

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        # Each encoded request's embedding, held from its step's result to its output.
        self._embeddings: dict[str, list[float]] = {}

    def check_kv_capacity(self, num_blocks: int) -> None:
        """No cache to check: an encoder step holds whole prompts and keeps nothing."""

    def make_requests(self, new: NewRequest) -> list[Request]:
        """One prompt to embed; bad input raises here, before anything is queued."""
        model = self.engine.model_config
        params = PoolingParams() if new.params is None else new.params
        if isinstance(params, SamplingParams):
            raise ValueError(
                f"model {model.model!r} is an embedding model (task='embed'): it cannot "
                "generate text; use LLM.embed or the /v1/embeddings endpoint"
            )
        if not isinstance(params, PoolingParams):
            raise TypeError(f"params must be a PoolingParams, got {type(params).__name__}")
        if new.lora_request is not None:
            raise ValueError(
                f"model {model.model!r} is an embedding model: it takes no LoRA adapter "
                f"(got {new.lora_request.lora_name!r})"
            )
        params.verify(model.model)
        text, token_ids = to_token_ids(new.prompt, self.engine.tokenizer, model.vocab_size)
        return [
            EmbeddingRequest(
                new.request_id, token_ids, _NO_SAMPLING, prompt=text, pooling_params=params
            )
        ]

    def record_pooled(self, result: ModelRunnerOutput) -> list[Request]:
        """Keep each encoded request's embedding until its output is made (this step)."""
        if result.pooler_output is None:
            return []
        rows = result.pooler_output.cpu().tolist()
        pooled = [item.request for item in result.pooled_requests]
        for req, row in zip(pooled, rows, strict=True):
            self._embeddings[req.request_id] = row
        return pooled

    def make_output(self, request_id: str, samples: list[Request]) -> EmbeddingRequestOutput:
        """The request's one output: its embedding, or its error, or an abort (empty)."""
        req = samples[0]
        req.reported_finish = True
        return EmbeddingRequestOutput(
            request_id=request_id,
            outputs=EmbeddingOutput(self._embeddings.pop(request_id, [])),
            prompt_token_ids=req.prompt_token_ids,
            finished=True,
            error=req.error,
            metrics={"e2e_latency": time.monotonic() - req.arrival_time},
        )
