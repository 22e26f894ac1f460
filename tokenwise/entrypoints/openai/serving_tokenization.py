"""`POST /tokenize` and `POST /detokenize`, as vLLM serves them (outside `/v1`).

Clients count tokens before sending (to fit a context window, to budget a load test) and want
the count the server itself would run: a prompt is tokenized as `/v1/completions` does
(special tokens added unless `add_special_tokens: false`), messages are rendered and tokenized
by the same code as `/v1/chat/completions` (`chat_rendering`: template, `tools`,
`chat_template_kwargs`). The body holds either `prompt` or `messages`; which one picks the
request model, so each shape keeps its own defaults and its 400s name its fields.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from tokenwise.engine.prompts import check_text
from tokenwise.entrypoints.openai.access_log import request_id
from tokenwise.entrypoints.openai.async_engine import AsyncEngine
from tokenwise.entrypoints.openai.chat_rendering import render_chat
from tokenwise.entrypoints.openai.errors import OpenAIError
from tokenwise.entrypoints.openai.protocol_tokenization import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from tokenwise.entrypoints.openai.request_fields import accept_fields
from tokenwise.entrypoints.openai.server_config import ServerConfig
from tokenwise.entrypoints.openai.serving_models import ServingModels


class TokenizationServing:
    def __init__(self, engine: AsyncEngine, config: ServerConfig, models: ServingModels) -> None:
        self.engine = engine
        self.config = config
        self.models = models

    @property
    def _tokenizer(self) -> Any:
        return self.engine.engine.tokenizer

    def tokenize(self, payload: dict[str, Any], raw: Request) -> TokenizeResponse:
        cls = TokenizeChatRequest if "messages" in payload else TokenizeCompletionRequest
        try:
            body = cls.model_validate(payload)
        except ValidationError as exc:  # the app's handler makes it a 400 naming the field
            raise RequestValidationError(exc.errors()) from None
        accept_fields(body, self.config.strict_request_fields, request_id(raw), raw.url.path)
        self.models.resolve(body.model)
        tokenizer = self._tokenizer
        if isinstance(body, TokenizeChatRequest):
            ids = render_chat(tokenizer, body)["prompt_token_ids"]
        else:
            try:
                check_text(body.prompt, "prompt")
            except ValueError as exc:
                raise OpenAIError(400, str(exc), param="prompt") from exc
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return TokenizeResponse(
            count=len(ids),
            max_model_len=self.config.max_model_len,
            tokens=ids,
            token_strs=tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None,
        )

    def detokenize(self, body: DetokenizeRequest, raw: Request) -> DetokenizeResponse:
        accept_fields(body, self.config.strict_request_fields, request_id(raw), raw.url.path)
        self.models.resolve(body.model)
        vocab = self.engine.engine.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(
                400, f"tokens {bad[:5]} are out of the vocabulary [0, {vocab})", param="tokens"
            )
        return DetokenizeResponse(prompt=self._tokenizer.decode(body.tokens))
