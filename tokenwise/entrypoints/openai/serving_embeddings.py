"""`/v1/embeddings`: OpenAI's embeddings endpoint over an embedding engine (`task="embed"`).

Every input (a string, strings, token ids, or lists of token ids) becomes one engine request;
the engine batches them with whatever else is waiting, and each finishes after one step with
its embedding. The response lists them in input order (`data[i].index == i`), as floats or, with
`encoding_format="base64"`, as the base64 of their little-endian float32 bytes (what the
official client asks for by default and decodes itself). Usage counts prompt tokens only.

Input problems are 400s naming `input` (empty, too long, bad token ids), `dimensions` is a 400
naming it (no model here can shorten its embeddings), and a server whose model generates text
answers 400 naming `model`.
"""

from __future__ import annotations

import base64
import struct
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import Response

from tokenwise.entrypoints.openai.access_log import record_usage, set_request_id
from tokenwise.entrypoints.openai.async_engine import AsyncEngine, RequestStream
from tokenwise.entrypoints.openai.errors import OpenAIError, generation_failed, invalid_request
from tokenwise.entrypoints.openai.protocol_embeddings import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from tokenwise.entrypoints.openai.request_fields import accept_fields
from tokenwise.entrypoints.openai.server_config import ServerConfig
from tokenwise.entrypoints.openai.serving_common import UsageCounter, respond
from tokenwise.entrypoints.openai.serving_models import ServingModels
from tokenwise.outputs import EmbeddingRequestOutput
from tokenwise.pooling.params import PoolingParams

if TYPE_CHECKING:
    from tokenwise.engine.prompts import PromptInput


def encode_base64(embedding: list[float]) -> str:
    """Little-endian float32 bytes in base64: what OpenAI sends and its clients decode."""
    return base64.b64encode(struct.pack(f"<{len(embedding)}f", *embedding)).decode("ascii")


def embedding_inputs(value: str | list, max_prompts: int) -> list[PromptInput]:
    """The engine prompts of `input`, refusing what OpenAI refuses (empty input) by name."""
    if isinstance(value, str):
        value = [value]
    elif not value:
        raise OpenAIError(400, "input must not be an empty list", param="input")
    elif all(isinstance(v, int) for v in value):
        value = [value]  # one prompt given as token ids
    if len(value) > max_prompts:
        raise OpenAIError(
            400,
            f"input has {len(value)} items, more than this server's --max-prompts={max_prompts}",
            param="input",
        )
    for i, item in enumerate(value):
        if not item:
            what = "an empty string" if isinstance(item, str) else "an empty list of token ids"
            raise OpenAIError(400, f"input[{i}] is {what}; every input needs text", param="input")
    return list(value)


def check_embedding_model(config: ServerConfig) -> None:
    if config.task != "embed":
        raise OpenAIError(
            400,
            f"the model {config.served_model_name!r} runs task {config.task!r} and has no "
            "embeddings; serve an encoder-only model with --task embed for /v1/embeddings",
            param="model",
            code="model_not_supported",
        )


class EmbeddingServing:
    def __init__(
        self, engine: AsyncEngine, config: ServerConfig, models: ServingModels | None = None
    ) -> None:
        self.engine = engine
        self.config = config
        self.models = models or ServingModels(config.served_model_name, config.max_model_len)

    async def create(self, body: EmbeddingRequest, raw: Request) -> Response:
        request_id = set_request_id(raw, "embd")
        accept_fields(body, self.config.strict_request_fields, request_id, raw.url.path)
        if self.models.resolve(body.model) is not None:
            raise OpenAIError(400, "LoRA adapters are not served for embeddings", param="model")
        check_embedding_model(self.config)
        prompts = embedding_inputs(body.input, self.config.max_prompts)
        try:
            params = PoolingParams(dimensions=body.dimensions)
            params.verify(self.config.served_model_name)
        except ValueError as exc:
            raise OpenAIError(400, str(exc), param="dimensions") from exc
        try:
            stream = await self.engine.submit(request_id, prompts, params)
        except (ValueError, TypeError) as exc:
            raise invalid_request(exc, "input") from exc
        usage = UsageCounter(prompts)
        record_usage(raw, usage)
        return await respond(raw, stream, self._collect(body, request_id, stream, usage))

    async def _collect(
        self, body: EmbeddingRequest, request_id: str, stream: RequestStream, usage: UsageCounter
    ) -> EmbeddingResponse:
        outputs: dict[int, EmbeddingRequestOutput] = {}
        async for index, output in stream:
            outputs[index] = output  # type: ignore[assignment]
        data, prompt_tokens = [], 0
        for index in sorted(outputs):
            out = outputs[index]
            if out.error is not None or not out.outputs.embedding:
                raise generation_failed(out.error or "the request was aborted")
            vector = out.outputs.embedding
            encoded = encode_base64(vector) if body.encoding_format == "base64" else vector
            data.append(EmbeddingData(index=index, embedding=encoded))
            prompt_tokens += len(out.prompt_token_ids)
            usage.add(index, len(out.prompt_token_ids), 0)
        usage = EmbeddingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens)
        return EmbeddingResponse(
            id=request_id, model=self.config.served_model_name, data=data, usage=usage
        )
