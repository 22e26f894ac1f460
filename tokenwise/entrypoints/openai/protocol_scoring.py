"""Request and response bodies of `/v1/score`, the rerank endpoints and `/v1/classify`.

`/v1/score` and `/v1/classify` are vLLM's shapes. Rerank takes what the Jina and Cohere
clients send (`query`, `documents` as strings or `{"text": ...}` objects, `top_n`,
`return_documents`, and Cohere's `rank_fields` / `max_chunks_per_doc` / `max_tokens_per_doc`,
refused unless they ask for what is done anyway), and answers with the fields both read:
`results` sorted by `relevance_score` with each document's `index`, `usage` (Jina, vLLM) and
`meta` (Cohere's api version and billed search units).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from tokenwise.entrypoints.openai.protocol import created_now
from tokenwise.entrypoints.openai.request_fields import RequestModel


class ScoreRequest(RequestModel):
    """vLLM's `/v1/score`: `text_1` against `text_2` (1:1, 1:N or N:N)."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    user: str | None = None


class PoolingUsage(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=created_now)
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankRequest(RequestModel):
    """Jina's and Cohere's rerank body (v1 and v2: v2 sends strings only)."""

    model: str | None = None
    query: str
    documents: list[str | dict[str, Any]]
    top_n: int | None = None
    return_documents: bool | None = None
    rank_fields: list[str] | None = None
    max_chunks_per_doc: int | None = None
    max_tokens_per_doc: int | None = None
    user: str | None = None


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankApiVersion(BaseModel):
    version: str


class RerankBilledUnits(BaseModel):
    search_units: int = 1


class RerankMeta(BaseModel):
    api_version: RerankApiVersion
    billed_units: RerankBilledUnits = Field(default_factory=RerankBilledUnits)


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankResult]
    usage: PoolingUsage
    meta: RerankMeta


class ClassificationRequest(RequestModel):
    """vLLM's `/v1/classify`: `input` is a string, strings, token ids or lists of them."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    user: str | None = None


class ClassificationData(BaseModel):
    index: int
    object: Literal["classification"] = "classification"
    label: str
    probs: list[float]
    num_classes: int


class ClassificationResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=created_now)
    model: str
    data: list[ClassificationData]
    usage: PoolingUsage
