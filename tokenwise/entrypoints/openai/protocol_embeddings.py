"""Request and response bodies of `/v1/embeddings`, as pydantic models.

Apart from `protocol.py` because embeddings share nothing with the generation bodies there
(no sampling fields, no choices envelope): `serving_embeddings` is their only reader, and the
strict-request rules of `request_fields` apply to them as to every request body.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from tokenwise.entrypoints.openai.protocol import created_now
from tokenwise.entrypoints.openai.request_fields import RequestModel


class EmbeddingRequest(RequestModel):
    """`/v1/embeddings`: `input` is a string, a batch of strings, token ids, or a batch of
    token-id lists. `dimensions` is accepted by the schema and refused by the server (400)
    unless the model can shorten its embeddings."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


class EmbeddingData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    # The floats, or (encoding_format "base64") their little-endian float32 bytes in base64.
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=created_now)
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
