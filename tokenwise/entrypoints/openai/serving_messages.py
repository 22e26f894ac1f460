"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API, run as
chat.

A request becomes the chat completion request it means (`anthropic_input`): the chat endpoint
renders it with the chat template, checks and enforces its tools (a forced tool by guided
decoding), and its reader (`tool_calls`) reads the reply as reasoning, text and calls. This
module only wraps that reply in Anthropic's shapes: content blocks, `stop_reason` and `usage`
for a collected message, the event sequence of `anthropic_events` for a stream. One
implementation of prompts, tools and grammars serves all three APIs, so the same conversation
runs the same prompt whichever API a client speaks.

Errors come back in Anthropic's shape (`errors.is_anthropic_path`). `thinking` returns the
reasoning parser's part (`--reasoning-parser`) as a thinking block; without it the reasoning is
dropped, as a model that was not asked to think shows none. `budget_tokens` is not a separate
cap: `max_tokens` bounds thinking and text together, as in Anthropic's API.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import Response

from tokenwise.entrypoints.openai.access_log import record_usage, set_request_id
from tokenwise.entrypoints.openai.anthropic_events import MessageEvents
from tokenwise.entrypoints.openai.anthropic_input import (
    chat_request,
    content_blocks,
    renamed,
    stop_reason,
)
from tokenwise.entrypoints.openai.async_engine import AsyncEngine, RequestStream
from tokenwise.entrypoints.openai.chat_images import FETCHED_IMAGES, prefetch_chat_images
from tokenwise.entrypoints.openai.errors import (
    OpenAIError,
    generation_failed,
    invalid_request,
)
from tokenwise.entrypoints.openai.protocol import ChatCompletionRequest
from tokenwise.entrypoints.openai.protocol_anthropic import (
    CountTokensRequest,
    CountTokensResponse,
    MessageResponse,
    MessagesRequest,
    PromptFields,
    Usage,
)
from tokenwise.entrypoints.openai.request_fields import accept_fields
from tokenwise.entrypoints.openai.server_config import ServerConfig
from tokenwise.entrypoints.openai.serving_chat import ChatServing
from tokenwise.entrypoints.openai.serving_common import (
    UsageCounter,
    api_error,
    collect_outputs,
    event_stream,
    json_response,
    respond,
)
from tokenwise.entrypoints.openai.serving_models import ServingModels
from tokenwise.sampling.params import SamplingParams

if TYPE_CHECKING:
    from tokenwise.engine.prompts import PromptInput


class MessagesServing:
    """Validate, translate to chat, submit, then collect one message or stream its events."""

    def __init__(
        self, engine: AsyncEngine, config: ServerConfig, models: ServingModels, chat: ChatServing
    ) -> None:
        self.engine = engine
        self.config = config
        self.models = models
        self.chat = chat

    async def _prepare(
        self, body: PromptFields
    ) -> tuple[ChatCompletionRequest, list[PromptInput], SamplingParams]:
        """The chat request, its engine prompts and sampling parameters (images fetched first,
        as the chat endpoint does, so a slow image server holds only this request)."""
        chat = chat_request(body)
        config = self.config
        try:
            fetched = await prefetch_chat_images(
                chat.messages,
                config.image_token is not None,
                config.limit_images_per_prompt,
                config.allowed_media_domains,
            )
            token = FETCHED_IMAGES.set(fetched)
            try:
                prompts, params = self.chat.prepare(chat)
            finally:
                FETCHED_IMAGES.reset(token)
        except OpenAIError as exc:
            raise renamed(exc) from exc
        return chat, prompts, params

    async def create(self, body: MessagesRequest, raw: Request) -> Response:
        message_id = set_request_id(raw, "msg")
        accept_fields(body, self.config.strict_request_fields, message_id, raw.url.path)
        lora_request = self.models.resolve(body.model)
        chat, prompts, params = await self._prepare(body)
        try:
            stream = await self.engine.submit(message_id, prompts, params, lora_request)
        except (ValueError, TypeError) as exc:
            raise renamed(invalid_request(exc, "messages")) from exc
        usage = UsageCounter(prompts)
        record_usage(raw, usage)
        message = MessageResponse(id=message_id, model=self.config.served_model_name)
        message.usage = Usage(input_tokens=usage.usage().prompt_tokens)
        if body.stream:
            return event_stream(self._stream(chat, stream, usage, message))
        return await respond(raw, stream, self._collect(chat, stream, usage, message))

    async def count_tokens(self, body: CountTokensRequest, raw: Request) -> Response:
        """The prompt's length as the model would read it (an image counts as its
        placeholder's tokens: the model's processor expands it only when it runs)."""
        request_id = set_request_id(raw, "count")
        accept_fields(body, self.config.strict_request_fields, request_id, raw.url.path)
        self.models.resolve(body.model)
        _, prompts, _ = await self._prepare(body)
        prompt = prompts[0]
        assert isinstance(prompt, dict)
        ids = prompt.get("prompt_token_ids")
        if ids is None:  # images: the rendered text, placeholders unexpanded
            ids = self.engine.engine.tokenizer.encode(prompt["prompt"], add_special_tokens=False)
        return json_response(CountTokensResponse(input_tokens=len(ids)))

    async def _collect(
        self,
        chat: ChatCompletionRequest,
        stream: RequestStream,
        usage: UsageCounter,
        message: MessageResponse,
    ) -> MessageResponse:
        out = (await collect_outputs(stream))[0]
        output = out.outputs[0]
        usage.add(0, len(out.prompt_token_ids), len(output.token_ids))
        reply, finish_reason = self.chat.reader(chat).message(output.text, output.finish_reason)
        message.content = content_blocks(reply)
        message.stop_reason, message.stop_sequence = stop_reason(finish_reason, output.stop_reason)
        counts = usage.usage()
        message.usage = Usage(
            input_tokens=counts.prompt_tokens, output_tokens=counts.completion_tokens
        )
        return message

    async def _stream(
        self,
        chat: ChatCompletionRequest,
        stream: RequestStream,
        usage: UsageCounter,
        message: MessageResponse,
    ) -> AsyncIterator[str]:
        events = MessageEvents(message)
        reader = self.chat.reader(chat)
        reason: tuple[Any, str | None] = (None, None)
        try:
            for event in events.start():
                yield event
            async for _, delta in stream:
                if delta.error is not None:
                    for event in events.error(generation_failed(delta.error, code=None)):
                        yield event
                    return
                for output in delta.outputs:
                    usage.add(0, len(delta.prompt_token_ids), len(output.token_ids))
                    piece, finish_reason = reader.delta(output.text, output.finish_reason)
                    for event in events.feed(piece) if piece is not None else []:
                        yield event
                    if output.finish_reason is not None:
                        reason = stop_reason(finish_reason, output.stop_reason)
            for event in events.finish(*reason, usage.usage().completion_tokens):
                yield event
        except Exception as exc:
            for event in events.error(api_error(exc)):
                yield event
        finally:
            stream.close()
