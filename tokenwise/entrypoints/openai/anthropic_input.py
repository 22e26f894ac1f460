"""An Anthropic Messages request as the chat completion request that runs it, and back.

Like the Responses API (`responses_input`), the Messages API has no prompt, tool or grammar
machinery of its own: its messages become chat messages (rendered by the chat template exactly
as a chat client's equivalent messages would be), its tools chat tools, its `tool_choice` the
chat one, and the chat endpoint's checks, tool parsing and guided decoding do the rest. Errors
those raise name chat fields; `renamed` turns them back into the names the client sent.

The mapping of content to chat messages:

- `system` (a string or text blocks) -> a leading system message;
- text and image blocks -> the message's content parts (images as `data:` URLs, or the
  source's URL), in order; a message of text alone is one string, as templates expect;
- `tool_use` blocks of an assistant message -> its `tool_calls` (the `input` as JSON text);
- `tool_result` blocks of a user message -> `tool` messages with the call's `tool_call_id`,
  placed before the rest of that user message (chat templates expect the results right after
  the calls); an `is_error` result's text is prefixed with "Error: ";
- thinking blocks are left out: chat templates drop earlier turns' reasoning too.

`tool_choice` {"type": "any"} is chat's "required", {"type": "tool", "name"} a named function
(enforced by guided decoding), "none" chat's "none" (the tools stay in the prompt);
`disable_parallel_tool_use` is `parallel_tool_calls: false`. `output_config.format` (a JSON
schema) is `response_format`. `thinking` ("enabled" or "adaptive") sets the template variable
`enable_thinking` (Qwen3's switch) and whether the reasoning parser's part comes back as a
thinking block (not with `display: "omitted"`).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from tokenwise.entrypoints.openai.errors import OpenAIError
from tokenwise.entrypoints.openai.protocol import AssistantMessage, ChatCompletionRequest
from tokenwise.entrypoints.openai.protocol_anthropic import (
    Base64ImageSource,
    ContentBlock,
    ImageBlockParam,
    MessagesRequest,
    PromptFields,
    StopReason,
    TextBlock,
    TextBlockParam,
    ThinkingBlock,
    ThinkingEnabled,
    ToolChoiceAny,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlockParam,
    ToolUseBlock,
    ToolUseBlockParam,
)

# Chat field -> the Messages field a client sent instead.
_RENAMED = {
    "max_completion_tokens": "max_tokens",
    "stop": "stop_sequences",
    "parallel_tool_calls": "tool_choice",
    "response_format": "output_config",
}


def renamed(exc: OpenAIError) -> OpenAIError:
    """A chat endpoint's error with the Messages name of the field it is about."""
    if exc.param not in _RENAMED:
        return exc
    name = _RENAMED[exc.param]
    message = exc.message
    if message.startswith(exc.param):
        message = name + message[len(exc.param) :]
    return OpenAIError(exc.status_code, message, param=name, code=exc.code, type_=exc.type)


def _image_part(block: ImageBlockParam) -> dict[str, Any]:
    source = block.source
    if isinstance(source, Base64ImageSource):
        url = f"data:{source.media_type};base64,{source.data}"
    else:
        url = source.url
    return {"type": "image_url", "image_url": {"url": url}}


def _content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Text alone as one string (what every template reads); with images, the parts."""
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def _result_text(block: ToolResultBlockParam) -> str:
    content = block.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        if any(isinstance(part, ImageBlockParam) for part in content):
            raise OpenAIError(
                400,
                "messages: images inside a tool_result are not supported; send them as an "
                "image block of the user message",
                param="messages",
            )
        text = "\n".join(part.text for part in content if isinstance(part, TextBlockParam))
    return f"Error: {text}" if block.is_error else text


def chat_messages(body: PromptFields) -> list[dict[str, Any]]:
    """The chat messages of the request's system prompt and messages."""
    messages: list[dict[str, Any]] = []
    if body.system:
        system = body.system
        text = system if isinstance(system, str) else "\n".join(b.text for b in system)
        messages.append({"role": "system", "content": text})
    for message in body.messages:
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
            continue
        parts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        for block in message.content:
            if isinstance(block, TextBlockParam):
                parts.append({"type": "text", "text": block.text})
            elif isinstance(block, ImageBlockParam):
                parts.append(_image_part(block))
            elif isinstance(block, ToolUseBlockParam):
                arguments = json.dumps(block.input, ensure_ascii=False)
                function = {"name": block.name, "arguments": arguments}
                calls.append({"id": block.id, "type": "function", "function": function})
            elif isinstance(block, ToolResultBlockParam):
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": block.tool_use_id,
                        "content": _result_text(block),
                    }
                )
        if calls and message.role == "user":
            raise OpenAIError(
                400, "messages: tool_use blocks belong to assistant messages", param="messages"
            )
        if calls:
            content = _content(parts) if parts else None
            messages.append({"role": "assistant", "content": content, "tool_calls": calls})
        elif parts:
            messages.append({"role": message.role, "content": _content(parts)})
    return messages


def thinking_enabled(body: PromptFields) -> bool:
    """Whether the model is asked to think ("enabled" or "adaptive")."""
    return body.thinking is not None and body.thinking.type != "disabled"


def thinking_shown(body: PromptFields) -> bool:
    """Whether the reasoning comes back as a thinking block (not with display "omitted")."""
    return thinking_enabled(body) and getattr(body.thinking, "display", None) != "omitted"


def chat_request(body: PromptFields) -> ChatCompletionRequest:
    """The chat request that runs `body` (a token count runs none: it only renders)."""
    fields: dict[str, Any] = {"model": body.model, "messages": chat_messages(body)}
    if isinstance(body, MessagesRequest):
        if isinstance(body.thinking, ThinkingEnabled):
            if body.thinking.budget_tokens >= body.max_tokens:
                raise OpenAIError(
                    400,
                    f"thinking.budget_tokens must be less than max_tokens ({body.max_tokens}), "
                    f"got {body.thinking.budget_tokens}",
                    param="thinking",
                )
        fields.update(
            stream=body.stream,
            max_completion_tokens=body.max_tokens,
            stop=body.stop_sequences,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
        )
        fmt = body.output_config.format if body.output_config is not None else None
        if fmt is not None:
            schema = {"name": "output", "schema": fmt.json_schema}
            fields["response_format"] = {"type": "json_schema", "json_schema": schema}
    if body.thinking is not None:
        fields["chat_template_kwargs"] = {"enable_thinking": thinking_enabled(body)}
    fields["include_reasoning"] = thinking_shown(body)
    choice = body.tool_choice
    if body.tools:  # in the prompt even with tool_choice none: the model knows, and may not call
        fields["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.input_schema,
                },
            }
            for t in body.tools
        ]
    if choice is None or choice.type == "auto":
        fields["tool_choice"] = "auto" if body.tools else None
    elif isinstance(choice, ToolChoiceNone):
        fields["tool_choice"] = "none"
    elif isinstance(choice, ToolChoiceAny):
        fields["tool_choice"] = "required"
    elif isinstance(choice, ToolChoiceTool):
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    if getattr(choice, "disable_parallel_tool_use", None):
        fields["parallel_tool_calls"] = False
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:  # every field was checked already; a guard, not a path
        raise OpenAIError(
            400, f"the request cannot run as a chat: {exc}", param="messages"
        ) from exc


def _tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as `input`; a call cut off by max_tokens has no complete JSON, and
    gets an empty input (its stop_reason says it was cut)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {"value": value}


def content_blocks(message: AssistantMessage) -> list[ContentBlock]:
    """A chat reply's assistant message as Anthropic content blocks: thinking, text, calls."""
    blocks: list[ContentBlock] = []
    if message.reasoning_content:
        blocks.append(ThinkingBlock(thinking=message.reasoning_content))
    if message.content:
        blocks.append(TextBlock(text=message.content))
    for call in message.tool_calls or []:
        blocks.append(
            ToolUseBlock(name=call.function.name, input=_tool_input(call.function.arguments))
        )
    return blocks


def stop_reason(
    finish_reason: str | None, stopped_by: int | str | None
) -> tuple[StopReason | None, str | None]:
    """(stop_reason, stop_sequence) for a chat finish reason and the output's stop reason."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "tool_calls":
        return "tool_use", None
    if isinstance(stopped_by, str):
        return "stop_sequence", stopped_by
    if finish_reason is None:
        return None, None
    return "end_turn", None
