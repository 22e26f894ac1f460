"""`POST /v1/chat/completions`: messages rendered with the tokenizer's chat template.

The rendered text is tokenized here without special tokens, because chat templates write
their own BOS; letting the tokenizer add another would give the model a doubled BOS it never
saw in training. A tokenizer without a template, a template that fails on the messages, or
messages that are not valid Unicode (a lone surrogate, which JSON can escape) are the client's
problem to fix (400), not a server error.

With `tools`, the template receives them (`tools=`, as Hugging Face templates expect), the
reply is read for tool calls according to `tool_choice` (`tool_calls`), and a forced call is
enforced with guided decoding (`structured_outputs`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jinja2

from tokenwise.engine.prompts import check_text
from tokenwise.entrypoints.openai.errors import OpenAIError
from tokenwise.entrypoints.openai.logprobs import chat_logprobs
from tokenwise.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    DeltaMessage,
)
from tokenwise.entrypoints.openai.serving_common import (
    OpenAIServing,
    build_sampling_params,
    check_cap,
)
from tokenwise.entrypoints.openai.structured_outputs import (
    ToolMode,
    guided_decoding_for,
    resolve_tool_mode,
)
from tokenwise.entrypoints.openai.tool_calls import ToolCallReader
from tokenwise.outputs import CompletionOutput
from tokenwise.sampling.params import SamplingParams

if TYPE_CHECKING:
    from tokenwise.engine.prompts import PromptInput


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
    extra: dict[str, Any] = {}
    if body.tools:
        extra["tools"] = [tool.model_dump(exclude_none=True) for tool in body.tools]
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=body.add_generation_prompt, **extra
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


class ChatServing(OpenAIServing[ChatCompletionRequest, ChatLogprobs]):
    """One rendered prompt; a stream opens with the assistant role and then sends deltas."""

    request_id_prefix = "chatcmpl"
    prompt_param = "messages"
    response_cls = ChatCompletionResponse
    chunk_cls = ChatCompletionChunk

    def _prepare(self, body: ChatCompletionRequest) -> tuple[list[PromptInput], SamplingParams]:
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
        guided = guided_decoding_for(body, resolve_tool_mode(body))
        params = build_sampling_params(body, self.config, max_tokens, logprobs, guided)
        return [render_chat(self.engine.engine.tokenizer, body)], params

    def _logprobs(
        self, body: ChatCompletionRequest, output: CompletionOutput, offset: int
    ) -> tuple[ChatLogprobs | None, int]:
        if not body.logprobs:
            return None, offset
        top_n = body.top_logprobs or 0
        return chat_logprobs(output.token_ids, output.logprobs or [], top_n), offset

    def _choice(
        self,
        body: ChatCompletionRequest,
        index: int,
        output: CompletionOutput,
        logprobs: ChatLogprobs | None,
    ) -> ChatChoice:
        reader = ToolCallReader(_tool_mode(body))
        message, finish_reason = reader.message(output.text, output.finish_reason)
        return ChatChoice(
            index=index,
            message=message,
            logprobs=logprobs,
            finish_reason=finish_reason,
            stop_reason=output.stop_reason,
        )

    def _stream_choice(
        self,
        body: ChatCompletionRequest,
        index: int,
        output: CompletionOutput,
        logprobs: ChatLogprobs | None,
        state: dict[int, Any],
    ) -> ChatStreamChoice | None:
        reader = state.get(index)
        if reader is None:
            reader = state[index] = ToolCallReader(_tool_mode(body))
        delta, finish_reason = reader.delta(output.text, output.finish_reason)
        has_logprobs = logprobs is not None and bool(output.token_ids)
        if delta is None and not has_logprobs:
            return None  # text held back (a possible tool-call tag, a forced call's array)
        # A delta without tokens (the final one, say) carries no logprobs, not an empty list.
        return ChatStreamChoice(
            index=index,
            delta=delta or DeltaMessage(),
            logprobs=logprobs if has_logprobs else None,
            finish_reason=finish_reason,
        )

    def _stream_opening(self, body: ChatCompletionRequest) -> list[ChatStreamChoice]:
        # OpenAI opens every choice with the assistant role and empty content.
        role = DeltaMessage(role="assistant", content="")
        return [ChatStreamChoice(index=i, delta=role) for i in range(body.n)]


def _tool_mode(body: ChatCompletionRequest) -> ToolMode:
    """How to read the reply (checked in `_prepare`, so it cannot fail here)."""
    return resolve_tool_mode(body)
