"""`/v1/score`, `/v1/rerank` (and `/rerank`, `/v2/rerank`) and `/v1/classify` over a classifier.

Score and rerank need a model served with `--task score` (a cross-encoder, or a single-label
classifier such as a reward model) or `--task embed` (cosine similarity of embeddings, as in
vLLM); classify one served with `--task classify`. Each text pair (each distinct text, for an
embedding model) or input becomes one engine request, batched with whatever else waits;
pairing, tokenization and the numbers are `entrypoints/scoring.py`'s, as for `LLM.score` /
`LLM.classify`.

Rerank is scoring with a different envelope: the query is paired with every document, and the
results come back sorted by relevance, best first, each with the document's `index` in the
request, cut to `top_n`, with the document's text when `return_documents` asks (by default on
`/v1/rerank` and `/rerank`, as Jina and vLLM answer; off on `/v2/rerank`, as Cohere v2).

Every input problem is a 400 naming its field; an endpoint the model's task does not serve is
a 400 naming that task and the one it needs (`param: model`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from tokenwise.entrypoints.openai.access_log import record_usage, set_request_id
from tokenwise.entrypoints.openai.async_engine import AsyncEngine, RequestStream
from tokenwise.entrypoints.openai.errors import OpenAIError, generation_failed, invalid_request
from tokenwise.entrypoints.openai.protocol_scoring import (
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    PoolingUsage,
    RerankApiVersion,
    RerankDocument,
    RerankMeta,
    RerankRequest,
    RerankResponse,
    RerankResult,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from tokenwise.entrypoints.openai.request_fields import accept_fields
from tokenwise.entrypoints.openai.server_config import ServerConfig
from tokenwise.entrypoints.openai.serving_common import UsageCounter, respond
from tokenwise.entrypoints.openai.serving_embeddings import embedding_inputs
from tokenwise.entrypoints.openai.serving_models import ServingModels
from tokenwise.entrypoints.scoring import (
    ScoringInputError,
    cosine_score,
    distinct_texts,
    pair_prompt,
    score_pairs,
)
from tokenwise.outputs import EmbeddingRequestOutput
from tokenwise.pooling.params import PoolingParams

# What each task is for, in the 400 that refuses an endpoint.
_TASK_USE = {
    "generate": "generates text (/v1/completions, /v1/chat/completions)",
    "embed": "embeds text (/v1/embeddings)",
    "score": "scores text pairs (/v1/score, /v1/rerank)",
    "classify": "classifies text (/v1/classify)",
}


# Score and rerank: a cross-encoder, or an embedding model (cosine similarity, as vLLM).
_SCORING_TASKS = ("score", "embed")


def require_task(config: ServerConfig, tasks: tuple[str, ...], route: str) -> None:
    """400 (param `model`) unless the served model runs one of `tasks`, naming the task it
    runs."""
    if config.task not in tasks:
        wanted = " or ".join(f"--task {t}" for t in tasks)
        raise OpenAIError(
            400,
            f"{route} needs a model served with {wanted}; the model "
            f"{config.served_model_name!r} runs task {config.task!r}: it "
            f"{_TASK_USE.get(config.task, config.task)}",
            param="model",
            code="model_not_supported",
        )


def rerank_documents(body: RerankRequest) -> list[str]:
    """The documents' texts: strings, or objects with a `text` string (Cohere, Jina)."""
    if body.rank_fields is not None and body.rank_fields != ["text"]:
        raise OpenAIError(
            400,
            f"rank_fields={body.rank_fields}: only ['text'] is supported (each document's "
            "text is what is scored)",
            param="rank_fields",
        )
    for name in ("max_chunks_per_doc", "max_tokens_per_doc"):
        if getattr(body, name) is not None:
            raise OpenAIError(
                400,
                f"{name} is not supported: documents are scored whole, and a query with a "
                "document longer than the model's max_model_len is refused",
                param=name,
            )
    if body.top_n is not None and body.top_n < 1:
        raise OpenAIError(400, f"top_n must be >= 1, got {body.top_n}", param="top_n")
    if not body.documents:
        raise OpenAIError(400, "documents must not be empty", param="documents")
    texts = []
    for i, doc in enumerate(body.documents):
        text = doc.get("text") if isinstance(doc, dict) else doc
        if not isinstance(text, str):
            raise OpenAIError(
                400,
                f"documents[{i}] must be a string or an object with a 'text' string",
                param="documents",
            )
        texts.append(text)
    return texts


class ScoringServing:
    def __init__(
        self, engine: AsyncEngine, config: ServerConfig, models: ServingModels | None = None
    ) -> None:
        self.engine = engine
        self.config = config
        self.models = models or ServingModels(config.served_model_name, config.max_model_len)

    def _start(self, body: Any, raw: Request, prefix: str, tasks: tuple[str, ...]) -> str:
        request_id = set_request_id(raw, prefix)
        accept_fields(body, self.config.strict_request_fields, request_id, raw.url.path)
        if self.models.resolve(body.model) is not None:
            raise OpenAIError(400, f"LoRA adapters are not served for {prefix}", param="model")
        require_task(self.config, tasks, raw.url.path)
        return request_id

    async def _score_pairs(
        self, raw: Request, request_id: str, pairs: list[tuple[str, str]], param: str
    ) -> tuple[RequestStream, Callable[[], Awaitable[tuple[list[float], PoolingUsage]]]]:
        """Submit what scores `pairs`; returns the stream and what awaits each pair's score
        and the usage. A cross-encoder reads each pair as one prompt; an embedding model
        embeds each distinct text once (usage counts it once) and scores by cosine
        similarity."""
        if len(pairs) > self.config.max_prompts:
            raise OpenAIError(
                400,
                f"{len(pairs)} pairs to score, more than this server's "
                f"--max-prompts={self.config.max_prompts}",
                param=param,
            )
        engine = self.engine.engine
        index: list[tuple[int, int]] | None = None
        prompts: list[Any]
        if self.config.task == "embed":
            prompts, index = distinct_texts(pairs)
        else:
            tokenizer, hf = engine.tokenizer, engine.model_config.hf_config
            prompts = [pair_prompt(tokenizer, hf, a, b) for a, b in pairs]
        stream, usage = await self._submit(raw, request_id, prompts, param)

        async def scores() -> tuple[list[float], PoolingUsage]:
            outs = await _gather(stream, usage)
            if index is None:
                return [o.outputs.embedding[0] for o in outs], _usage(outs)
            scored = [cosine_score(request_id, outs[i], outs[j]) for i, j in index]
            return [s.outputs.score for s in scored], _usage(outs)

        return stream, scores

    async def _submit(
        self, raw: Request, request_id: str, prompts: list[Any], param: str
    ) -> tuple[RequestStream, UsageCounter]:
        try:
            stream = await self.engine.submit(request_id, prompts, PoolingParams())
        except (ValueError, TypeError) as exc:
            raise invalid_request(exc, param) from exc
        usage = UsageCounter(prompts)
        record_usage(raw, usage)
        return stream, usage

    async def score(self, body: ScoreRequest, raw: Request) -> Response:
        request_id = self._start(body, raw, "score", _SCORING_TASKS)
        try:
            pairs = score_pairs(body.text_1, body.text_2)
        except ScoringInputError as exc:
            raise OpenAIError(400, str(exc), param=exc.param) from exc
        stream, scores = await self._score_pairs(raw, request_id, pairs, "text_2")

        async def collect() -> ScoreResponse:
            scored, used = await scores()
            data = [ScoreData(index=i, score=score) for i, score in enumerate(scored)]
            return ScoreResponse(
                id=request_id, model=self.config.served_model_name, data=data, usage=used
            )

        return await respond(raw, stream, collect())

    async def rerank(self, body: RerankRequest, raw: Request, api_version: str = "1") -> Response:
        request_id = self._start(body, raw, "rerank", _SCORING_TASKS)
        documents = rerank_documents(body)
        try:
            pairs = score_pairs(body.query, documents, ("query", "documents"))
        except ScoringInputError as exc:
            raise OpenAIError(400, str(exc), param=exc.param) from exc
        stream, scores = await self._score_pairs(raw, request_id, pairs, "documents")
        return_documents = body.return_documents
        if return_documents is None:
            return_documents = api_version != "2"

        async def collect() -> RerankResponse:
            scored, used = await scores()
            results = [
                RerankResult(
                    index=i,
                    relevance_score=score,
                    document=RerankDocument(text=documents[i]) if return_documents else None,
                )
                for i, score in enumerate(scored)
            ]
            results.sort(key=lambda r: -r.relevance_score)  # stable: ties keep input order
            return RerankResponse(
                id=request_id,
                model=self.config.served_model_name,
                results=results[: body.top_n or len(results)],
                usage=used,
                meta=RerankMeta(api_version=RerankApiVersion(version=api_version)),
            )

        return await respond(raw, stream, collect())

    async def classify(self, body: ClassificationRequest, raw: Request) -> Response:
        request_id = self._start(body, raw, "classify", ("classify",))
        prompts = embedding_inputs(body.input, self.config.max_prompts)
        stream, usage = await self._submit(raw, request_id, prompts, "input")
        labels = getattr(self.engine.engine.model_config.hf_config, "id2label", None) or {}

        async def collect() -> ClassificationResponse:
            outs = await _gather(stream, usage)
            data = []
            for i, out in enumerate(outs):
                probs = out.outputs.embedding
                best = max(range(len(probs)), key=probs.__getitem__)
                label = str(labels.get(best, f"LABEL_{best}"))
                data.append(
                    ClassificationData(index=i, label=label, probs=probs, num_classes=len(probs))
                )
            return ClassificationResponse(
                id=request_id,
                model=self.config.served_model_name,
                data=data,
                usage=_usage(outs),
            )

        return await respond(raw, stream, collect())


async def _gather(stream: RequestStream, usage: UsageCounter) -> list[EmbeddingRequestOutput]:
    """Every request's output in input order; a failed or aborted one fails the response."""
    outputs: dict[int, EmbeddingRequestOutput] = {}
    async for index, output in stream:
        outputs[index] = output  # type: ignore[assignment]
    ordered = [outputs[i] for i in sorted(outputs)]
    for index, out in enumerate(ordered):
        if out.error is not None or not out.outputs.embedding:
            raise generation_failed(out.error or "the request was aborted")
        usage.add(index, len(out.prompt_token_ids), 0)
    return ordered


def _usage(outs: Sequence[EmbeddingRequestOutput]) -> PoolingUsage:
    tokens = sum(len(o.prompt_token_ids) for o in outs)
    return PoolingUsage(prompt_tokens=tokens, total_tokens=tokens)
