"""`POST /v1/responses` and `GET|DELETE /v1/responses/{id}`: OpenAI's Responses API, run as
chat.

A request becomes the chat completion request it means (`responses_input`): the chat endpoint
renders it with the chat template, checks and enforces its tools and structured output, and its
reader (`tool_calls`) reads the reply as reasoning, content and calls. This module only wraps
that reply in the Responses shapes: output items and `usage` for a collected response, the
event sequence of `responses_events` for a stream. One implementation of prompts, tools and
grammars serves both APIs, so they cannot drift apart (a Responses request and the equivalent
chat request run the same prompt and yield the same text).

`previous_response_id` continues a stored conversation (`responses_store`); `store: false`
leaves a response out of the store, so nothing can continue or fetch it later. With
`--reasoning-parser`, the reply's `<think>` part comes back as a `reasoning` item before the
message.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from tokenwise.entrypoints.openai.access_log import record_usage, set_request_id
from tokenwise.entrypoints.openai.async_engine import AsyncEngine, RequestStream
from tokenwise.entrypoints.openai.errors import (
    OpenAIError,
    generation_failed,
    invalid_request,
)
from tokenwise.entrypoints.openai.protocol import ChatCompletionRequest
from tokenwise.entrypoints.openai.protocol_responses import (
    IncompleteDetails,
    InputTokensDetails,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from tokenwise.entrypoints.openai.request_fields import accept_fields
from tokenwise.entrypoints.openai.responses_events import ResponseEvents
from tokenwise.entrypoints.openai.responses_input import (
    chat_request,
    input_messages,
    output_items,
    output_messages,
    renamed,
    without_oldest,
)
from tokenwise.entrypoints.openai.responses_store import ResponseStore
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


def _status(finish_reason: str | None) -> str:
    """A reply cut off by its token limit is "incomplete", as OpenAI reports it."""
    return "incomplete" if finish_reason == "length" else "completed"


class ResponsesServing:
    """Validate, render as chat, submit, then collect one response or stream its events."""

    def __init__(
        self,
        engine: AsyncEngine,
        config: ServerConfig,
        models: ServingModels,
        chat: ChatServing,
        store: ResponseStore,
    ) -> None:
        self.engine = engine
        self.config = config
        self.models = models
        self.chat = chat
        self.store = store

    async def create(self, body: ResponsesRequest, raw: Request) -> Response:
        response_id = set_request_id(raw, "resp")
        accept_fields(body, self.config.strict_request_fields, response_id, raw.url.path)
        if "message.output_text.logprobs" in (body.include or []):
            raise OpenAIError(
                400,
                "include: message.output_text.logprobs is not supported yet by this server",
                param="include",
                code="unsupported_parameter",
            )
        lora_request = self.models.resolve(body.model)
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            history = self.store.previous(body.previous_response_id).conversation
        conversation = history + input_messages(body.input)
        chat, prompts, params = self._prepare(body, conversation)
        try:
            stream = await self.engine.submit(response_id, prompts, params, lora_request)
        except (ValueError, TypeError) as exc:
            raise renamed(invalid_request(exc, "messages")) from exc
        usage = UsageCounter(prompts)
        record_usage(raw, usage)
        response = self._envelope(body, response_id)
        if body.stream:
            events = self._stream(body, chat, stream, usage, response, conversation)
            return event_stream(events)
        collect = self._collect(body, chat, stream, usage, response, conversation)
        return await respond(raw, stream, collect)

    def _prepare(
        self, body: ResponsesRequest, conversation: list[dict[str, Any]]
    ) -> tuple[ChatCompletionRequest, list[PromptInput], SamplingParams]:
        """The chat request and what it runs; with `truncation: "auto"`, on as much of the
        conversation as leaves the model room to reply (the oldest messages dropped first)."""
        while True:
            chat = chat_request(body, conversation)
            try:
                prompts, params = self.chat.prepare(chat)
            except OpenAIError as exc:
                raise renamed(exc) from exc
            if body.truncation != "auto":
                return chat, prompts, params
            prompt = prompts[0]
            assert isinstance(prompt, dict)
            if len(prompt["prompt_token_ids"]) < self.config.max_model_len:
                return chat, prompts, params
            shorter = without_oldest(conversation)
            if shorter is None:
                return chat, prompts, params  # the engine refuses it, naming the length
            conversation = shorter

    def retrieve(self, response_id: str) -> Response:
        return json_response(self.store.retrieve(response_id))

    def delete(self, response_id: str) -> Response:
        self.store.delete(response_id)
        body = {"id": response_id, "object": "response.deleted", "deleted": True}
        return JSONResponse(body)

    def _envelope(self, body: ResponsesRequest, response_id: str) -> ResponseObject:
        """The response before any output: the request's settings, echoed as OpenAI does."""
        text = body.text.model_dump(by_alias=True, exclude_none=True) if body.text else {}
        text.setdefault("format", {"type": "text"})
        choice = body.tool_choice
        return ResponseObject(
            id=response_id,
            model=self.config.served_model_name if body.model is None else body.model,
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            parallel_tool_calls=body.parallel_tool_calls,
            previous_response_id=body.previous_response_id,
            reasoning=body.reasoning.model_dump(exclude_none=True) if body.reasoning else {},
            store=body.store,
            temperature=1.0 if body.temperature is None else body.temperature,
            text=text,
            tool_choice=choice.model_dump() if isinstance(choice, BaseModel) else choice or "auto",
            tools=[t.model_dump(exclude_none=True) for t in body.tools or []],
            top_p=1.0 if body.top_p is None else body.top_p,
            truncation=body.truncation or "disabled",
            user=body.user,
            metadata=body.metadata or {},
        )

    def _complete(
        self,
        response: ResponseObject,
        usage: UsageCounter,
        cached_tokens: int,
        finish_reason: str | None,
    ) -> None:
        """The response's status and usage, once the reply has ended."""
        response.status = _status(finish_reason)  # type: ignore[assignment]
        if response.status == "incomplete":
            response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        counts = usage.usage()
        response.usage = ResponseUsage(
            input_tokens=counts.prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens),
            output_tokens=counts.completion_tokens,
            total_tokens=counts.total_tokens,
        )

    def _keep(
        self, body: ResponsesRequest, response: ResponseObject, conversation: list[dict[str, Any]]
    ) -> None:
        """Store a finished response (before the client hears of it, so that it can continue
        at once) with the conversation so far, unless `store` is false."""
        if body.store:
            self.store.put(response, conversation + output_messages(response.output))

    async def _collect(
        self,
        body: ResponsesRequest,
        chat: ChatCompletionRequest,
        stream: RequestStream,
        usage: UsageCounter,
        response: ResponseObject,
        conversation: list[dict[str, Any]],
    ) -> ResponseObject:
        out = (await collect_outputs(stream))[0]
        output = out.outputs[0]
        usage.add(0, len(out.prompt_token_ids), len(output.token_ids))
        message, _ = self.chat.reader(chat).message(output.text, output.finish_reason)
        response.output = output_items(message)
        self._complete(response, usage, out.num_cached_tokens, output.finish_reason)
        if response.status == "incomplete" and response.output:
            response.output[-1].status = "incomplete"
        self._keep(body, response, conversation)
        return response

    async def _stream(
        self,
        body: ResponsesRequest,
        chat: ChatCompletionRequest,
        stream: RequestStream,
        usage: UsageCounter,
        response: ResponseObject,
        conversation: list[dict[str, Any]],
    ) -> AsyncIterator[str]:
        events = ResponseEvents(response)
        reader = self.chat.reader(chat)
        cached, finish_reason = 0, None
        try:
            for event in events.start():
                yield event
            async for _, delta in stream:
                if delta.error is not None:
                    for event in events.error(generation_failed(delta.error, code=None)):
                        yield event
                    return
                cached = delta.num_cached_tokens or cached
                for output in delta.outputs:
                    usage.add(0, len(delta.prompt_token_ids), len(output.token_ids))
                    piece, _ = reader.delta(output.text, output.finish_reason)
                    finish_reason = output.finish_reason or finish_reason
                    for event in events.feed(piece) if piece is not None else []:
                        yield event
            self._complete(response, usage, cached, finish_reason)
            final = events.finish(response.status)
            self._keep(body, response, conversation)
            for event in final:
                yield event
        except Exception as exc:
            for event in events.error(api_error(exc)):
                yield event
        finally:
            stream.close()
