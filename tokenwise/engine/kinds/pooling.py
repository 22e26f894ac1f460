"""The pooling kind (`task="embed"`, "score", "classify"): prompts in, one vector each out.

The same engine loop as for generation (request bookkeeping, abort handling, failure isolation:
a failed forward pass fails only its own requests, statistics), with this kind's parts: a step
encodes whole prompts (`PoolingScheduler`) and pools them (`PoolingRunnerPart`), and each
request ends in that step with its embedding (`EmbeddingRequestOutput`), or with its error. A
classifier's vector is its label probabilities, which the offline API and the server present as
scores or classifications (`entrypoints/scoring.py`); a pair's token types ride in its ids.

No KV-cache group: the block manager has zero blocks and zero groups, so the statistics and
`/metrics` report an empty pool and nothing can ever be left allocated.
"""

from __future__ import annotations

import time
from typing import Any

from tokenwise.engine.kinds.base import ModelKind, NewRequest
from tokenwise.engine.kinds.pooling_runner import PoolingRunnerPart
from tokenwise.engine.kinds.pooling_scheduler import PoolingScheduler
from tokenwise.engine.kinds.requests import EmbeddingRequest
from tokenwise.engine.output_processor import SampleOutput
from tokenwise.engine.prompts import PromptInput, to_token_ids
from tokenwise.engine.request import Request
from tokenwise.engine.step_outputs import ModelRunnerOutput
from tokenwise.models.token_types import pack_token_types, unpack_token_ids
from tokenwise.outputs import EmbeddingOutput, EmbeddingRequestOutput
from tokenwise.pooling.params import PoolingParams
from tokenwise.sampling.params import SamplingParams

# Each pooling task's model, and what serves it (for the errors that send a caller there).
_TASK_USE = {
    "embed": ("an embedding model", "LLM.embed or the /v1/embeddings endpoint"),
    "score": ("a scoring model", "LLM.score or the /v1/score and /v1/rerank endpoints"),
    "classify": ("a classification model", "LLM.classify or the /v1/classify endpoint"),
}

# A Request carries SamplingParams; an embedding request's are a placeholder nothing reads.
_NO_SAMPLING = SamplingParams(max_tokens=1)


class EmbedKind(ModelKind):
    name = "embed"
    runner_part = PoolingRunnerPart
    scheduler_cls = PoolingScheduler

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        # Each encoded request's embedding, held from its step's result to its output.
        self._embeddings: dict[str, list[float]] = {}

    def check_kv_capacity(self, num_blocks: int) -> None:
        """No cache to check: an encoder step holds whole prompts and keeps nothing."""

    def make_requests(self, new: NewRequest) -> list[tuple[Request, SampleOutput]]:
        """One prompt to embed; bad input raises here, before anything is queued."""
        model = self.engine.model_config
        params = PoolingParams() if new.params is None else new.params
        if isinstance(params, SamplingParams):
            kind, use = _TASK_USE[model.task]
            raise ValueError(
                f"model {model.model!r} is {kind} (task={model.task!r}): it cannot "
                f"generate text; use {use}"
            )
        if not isinstance(params, PoolingParams):
            raise TypeError(f"params must be a PoolingParams, got {type(params).__name__}")
        if new.lora_request is not None:
            raise ValueError(
                f"model {model.model!r} is {_TASK_USE[model.task][0]}: it takes no LoRA adapter "
                f"(got {new.lora_request.lora_name!r})"
            )
        params.verify(model.model)
        if model.task != "embed" and params.normalize is not None:
            raise ValueError(
                f"normalize applies to embeddings; model {model.model!r} (task={model.task!r}) "
                "returns a classifier's probabilities"
            )
        text, token_ids = to_token_ids(new.prompt, self.engine.tokenizer, model.vocab_size)
        types = _token_type_ids(new.prompt, len(token_ids), model.hf_config)
        token_ids = pack_token_types(token_ids, types)
        req = EmbeddingRequest(new.request_id, token_ids, _NO_SAMPLING, pooling_params=params)
        return [(req, SampleOutput(prompt=text))]

    def record_pooled(self, result: ModelRunnerOutput) -> list[Request]:
        """Keep each encoded request's embedding until its output is made (this step)."""
        if result.pooler_output is None:
            return []
        rows = result.pooler_output.cpu().tolist()
        pooled = [item.request for item in result.pooled_requests]
        for req, row in zip(pooled, rows, strict=True):
            self._embeddings[req.request_id] = row
        return pooled

    def make_output(
        self, request_id: str, samples: list[Request], outs: list[SampleOutput]
    ) -> EmbeddingRequestOutput:
        """The request's one output: its embedding, or its error, or an abort (empty)."""
        req = samples[0]
        outs[0].reported_finish = True
        return EmbeddingRequestOutput(
            request_id=request_id,
            outputs=EmbeddingOutput(self._embeddings.pop(request_id, [])),
            prompt_token_ids=unpack_token_ids(req.prompt_token_ids),
            finished=True,
            error=req.error,
            metrics={"e2e_latency": time.monotonic() - req.arrival_time},
        )


def _token_type_ids(prompt: PromptInput, num_tokens: int, hf_config: Any) -> list[int]:
    """A prompt's token types (vLLM's `token_type_ids` key of a tokens prompt; all 0 without
    it), checked against the prompt's length and the model's `type_vocab_size`."""
    if not isinstance(prompt, dict) or prompt.get("token_type_ids") is None:
        return [0] * num_tokens
    types = prompt["token_type_ids"]
    if not isinstance(types, (list, tuple)) or len(types) != num_tokens:
        got = len(types) if isinstance(types, (list, tuple)) else type(types).__name__
        raise ValueError(
            f"token_type_ids must be a list of one integer per prompt token ({num_tokens}), "
            f"got {got}"
        )
    limit = int(getattr(hf_config, "type_vocab_size", 1) or 1)
    for t in types:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < limit:
            raise ValueError(
                f"token_type_ids must hold integers in [0, {limit}) (the model's "
                f"type_vocab_size), got {t!r}"
            )
    return list(types)
