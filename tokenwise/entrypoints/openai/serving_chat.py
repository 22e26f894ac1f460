"""`POST /v1/chat/completions`: messages rendered with the tokenizer's chat template.

The rendered text is tokenized here without special tokens, because chat templates write
their own BOS; letting the tokenizer add another would give the model a doubled BOS it never
saw in training. A tokenizer without a template, a template that fails on the messages, or
messages that are not valid Unicode (a lone surrogate, which JSON can escape) are the client's
problem to fix (400), not a server error.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import jinja2
from fastapi import Request
from fastapi.responses import Response

from tokenwise.engine.prompts import check_text
from tokenwise.entrypoints.openai.async_engine import AsyncEngine, RequestStream
from tokenwise.entrypoints.openai.errors import OpenAIError
from tokenwise.entrypoints.openai.logprobs import chat_logprobs
from tokenwise.entrypoints.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatStreamChoice,
    DeltaMessage,
)
from tokenwise.entrypoints.openai.server_config import ServerConfig
from tokenwise.entrypoints.openai.serving_common import (
    SSE_DONE,
    UsageCounter,
    build_sampling_params,
    check_cap,
    check_model,
    event_stream,
    merge_by_prompt,
    respond,
    sse,
    stream_error,
    submit,
)


def render_chat(tokenizer: Any, body: ChatCompletionRequest) -> dict[str, Any]:
    """The engine prompt ({"prompt", "prompt_token_ids"}) for the request's messages."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise OpenAIError(
            400,
            "this model's tokenizer has no chat template; use /v1/completions instead",
            param="messages",
            code="no_chat_template",
        )
    messages = []
    for m in body.messages:
        message = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            message["content"] = "\n".join(part.text for part in m.content)
        messages.append(message)
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=body.add_generation_prompt
        )
    except (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError) as exc:
        raise OpenAIError(
            400, f"the chat template failed on these messages: {exc}", param="messages"
        ) from exc
    try:
        check_text(text, "messages")
    except ValueError as exc:  # else the tokenizer's TypeError would be a 500
        raise OpenAIError(400, str(exc), param="messages") from exc
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}


class ChatServing:
    def __init__(self, engine: AsyncEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config

    async def create(self, body: ChatCompletionRequest, raw: Request) -> Response:
        check_model(body.model, self.config)
        cap = self.config.effective_max_tokens_cap
        check_cap("max_tokens", body.max_tokens, cap, "--max-tokens-cap")
        check_cap("max_completion_tokens", body.max_completion_tokens, cap, "--max-tokens-cap")
        if body.top_logprobs is not None and not body.logprobs:
            raise OpenAIError(400, "top_logprobs requires logprobs: true", param="top_logprobs")
        check_cap("top_logprobs", body.top_logprobs, self.config.max_logprobs, "--max-logprobs")
        max_tokens = body.max_completion_tokens
        if max_tokens is None:
            max_tokens = body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = build_sampling_params(body, self.config, max_tokens, logprobs)
        prompt = render_chat(self.engine.engine.tokenizer, body)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream = await submit(self.engine, request_id, [prompt], params, "messages")
        if body.stream:
            return event_stream(self._stream(body, request_id, stream))
        return await respond(raw, stream, self._collect(body, request_id, stream))

    async def _collect(
        self, body: ChatCompletionRequest, request_id: str, stream: RequestStream
    ) -> ChatCompletionResponse:
        merged = (await merge_by_prompt(stream))[0]
        usage = UsageCounter()
        choices = []
        for c in merged.outputs:
            usage.add(0, len(merged.prompt_token_ids), len(c.token_ids))
            logprobs = None
            if body.logprobs:
                logprobs = chat_logprobs(c.token_ids, c.logprobs or [], body.top_logprobs or 0)
            choices.append(
                ChatChoice(
                    index=c.index,
                    message=AssistantMessage(content=c.text),
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
        return ChatCompletionResponse(
            id=request_id,
            model=self.config.served_model_name,
            choices=choices,
            usage=usage.usage(),
        )

    async def _stream(
        self, body: ChatCompletionRequest, request_id: str, stream: RequestStream
    ) -> AsyncIterator[str]:
        def chunk(choices: list[ChatStreamChoice]) -> str:
            model = self.config.served_model_name
            return sse(ChatCompletionChunk(id=request_id, model=model, choices=choices))

        usage = UsageCounter()
        try:
            # OpenAI opens every choice with the assistant role and empty content.
            role = DeltaMessage(role="assistant", content="")
            yield chunk([ChatStreamChoice(index=i, delta=role) for i in range(body.n)])
            async for _, delta in stream:
                if delta.error is not None:
                    yield stream_error(OpenAIError(500, f"generation failed: {delta.error}"))
                    break
                for c in delta.outputs:
                    usage.add(0, len(delta.prompt_token_ids), len(c.token_ids))
                    logprobs = None
                    if body.logprobs and c.token_ids:
                        top_n = body.top_logprobs or 0
                        logprobs = chat_logprobs(c.token_ids, c.logprobs or [], top_n)
                    if not c.text and c.finish_reason is None and logprobs is None:
                        continue  # nothing to say yet (e.g. text waiting for more UTF-8 bytes)
                    content = DeltaMessage(content=c.text or None)
                    yield chunk(
                        [
                            ChatStreamChoice(
                                index=c.index,
                                delta=content,
                                logprobs=logprobs,
                                finish_reason=c.finish_reason,
                            )
                        ]
                    )
            else:
                if body.stream_options is not None and body.stream_options.include_usage:
                    yield sse(
                        ChatCompletionChunk(
                            id=request_id,
                            model=self.config.served_model_name,
                            choices=[],
                            usage=usage.usage(),
                        )
                    )
        except Exception as exc:
            yield stream_error(exc)
        finally:
            stream.close()
        yield SSE_DONE
