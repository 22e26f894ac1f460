"""A Responses request as the chat completion request that runs it, and back.

The Responses endpoint has no machinery of its own for prompts, tools or structured output: its
input items become chat messages (so the chat template renders them exactly as it would render
a chat client's equivalent messages), its flat function tools become chat tools, `text.format`
becomes `response_format`, and the chat endpoint's checks, tool parsing and guided decoding do
the rest. Errors those raise name chat fields; `renamed` turns them back into the Responses
names the client sent (`messages` -> `input`, `response_format` -> `text`, ...).

The mapping of items to messages:

- `instructions` -> a leading system message (not carried over by `previous_response_id`, as
  in OpenAI's API: each request states its own);
- message items -> messages of their role (`developer` is `system`: chat templates know only
  that), their text parts joined by newlines;
- `function_call` items -> `tool_calls` of an assistant message: consecutive calls, and calls
  right after an assistant message, join that message, as a chat client would send them;
- `function_call_output` items -> `tool` messages with the call's `tool_call_id`;
- `reasoning` items right before function calls -> the `reasoning_content` of the assistant
  message that makes the calls (gpt-oss's template shows the model the reasoning behind a call
  it is continuing from); other reasoning items are left out, as chat templates drop earlier
  turns' reasoning too.

`truncation: "auto"` drops the oldest messages (never the instructions, never the last
message) until the prompt fits the model's context, as OpenAI drops the oldest items.

A forced tool call (`tool_choice` naming a function, or "required") replies with a call, not a
message, so `text.format` (which shapes messages) is not applied to that reply; the chat
endpoint would otherwise refuse the two grammars together.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from tokenwise.entrypoints.openai.errors import OpenAIError
from tokenwise.entrypoints.openai.protocol import AssistantMessage, ChatCompletionRequest
from tokenwise.entrypoints.openai.protocol_responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionToolChoice,
    MessageItem,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputText,
    ReasoningItem,
    ReasoningText,
    RefusalContent,
    ResponsesAllowedToolsChoice,
    ResponsesRequest,
    TextFormatJsonObject,
    TextFormatJsonSchema,
)

# Chat field -> the Responses field a client sent instead (and how its messages name it).
_RENAMED = {
    "messages": ("input", "input"),
    "max_completion_tokens": ("max_output_tokens", "max_output_tokens"),
    "response_format": ("text", "text.format"),
}
_SAMPLING = ("temperature", "top_p", "seed", "stop", "top_k", "min_p", "repetition_penalty")


def renamed(exc: OpenAIError) -> OpenAIError:
    """A chat endpoint's error with the Responses names of the field it is about."""
    if exc.param not in _RENAMED:
        return exc
    param, shown = _RENAMED[exc.param]
    message = exc.message
    if message.startswith(exc.param):
        message = shown + message[len(exc.param) :]
    return OpenAIError(exc.status_code, message, param=param, code=exc.code, type_=exc.type)


def _text(content: str | list[Any]) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(p.refusal if isinstance(p, RefusalContent) else p.text for p in content)


def input_messages(items: str | list[Any]) -> list[dict[str, Any]]:
    """The chat messages of a request's `input` (without its instructions)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    reasoning = ""  # a reasoning item's text, until the next item
    for item in items:
        if isinstance(item, ReasoningItem):
            reasoning = _reasoning_text(item)
            continue
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
            if reasoning and "reasoning_content" not in last:
                last["reasoning_content"] = reasoning
        else:
            assert isinstance(item, FunctionCallOutputItem)
            output = item.output if isinstance(item.output, str) else _text(item.output)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        reasoning = ""
    return messages


def _reasoning_text(item: ReasoningItem) -> str:
    """A reasoning item's text: its content's (this server's), else its summary's."""
    parts = item.content or item.summary
    return "\n".join(
        p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)
    )


def output_items(message: AssistantMessage) -> list[OutputItem]:
    """A chat reply's assistant message as Responses output items: its reasoning (with
    `--reasoning-parser`), its text, then its calls."""
    items: list[OutputItem] = []
    if message.reasoning_content:
        items.append(OutputReasoning(content=[ReasoningText(text=message.reasoning_content)]))
    if message.content:
        items.append(OutputMessage(content=[OutputText(text=message.content)]))
    for call in message.tool_calls or []:
        items.append(
            OutputFunctionCall(
                call_id=call.id, name=call.function.name, arguments=call.function.arguments
            )
        )
    return items


def output_messages(items: list[OutputItem]) -> list[dict[str, Any]]:
    """A response's output as chat messages, for the conversation `previous_response_id`
    continues (its reasoning as in `input_messages`: kept only for the calls it led to)."""
    converted: list[Any] = []
    for item in items:
        if isinstance(item, OutputReasoning):
            content = [part.model_dump() for part in item.content]
            converted.append(ReasoningItem(type="reasoning", content=content))
        elif isinstance(item, OutputMessage):
            text = "".join(part.text for part in item.content)
            converted.append(MessageItem(role="assistant", content=text))
        elif isinstance(item, OutputFunctionCall):
            converted.append(
                FunctionCallItem(
                    type="function_call",
                    call_id=item.call_id,
                    name=item.name,
                    arguments=item.arguments,
                )
            )
    return input_messages(converted)


def forces_call(body: ResponsesRequest) -> bool:
    choice = body.tool_choice
    if isinstance(choice, ResponsesAllowedToolsChoice):
        return choice.mode == "required"
    return choice == "required" or isinstance(choice, FunctionToolChoice)


def _response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or forces_call(body):
        return None
    if isinstance(fmt, TextFormatJsonSchema):
        schema = {"name": fmt.name, "schema": fmt.json_schema, "strict": fmt.strict}
        return {"type": "json_schema", "json_schema": schema}
    if isinstance(fmt, TextFormatJsonObject):
        return {"type": "json_object"}
    return {"type": "text"}


def without_oldest(conversation: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """`truncation: "auto"`: the conversation less its oldest message, and less the tool
    results that would then answer no call; None when only the last message is left."""
    rest = conversation[1:]
    while rest and rest[0]["role"] == "tool":
        rest = rest[1:]
    return rest or None


def chat_request(
    body: ResponsesRequest, conversation: list[dict[str, Any]]
) -> ChatCompletionRequest:
    """The chat request that runs `body` on `conversation` (the earlier turns and this input,
    as chat messages, without instructions)."""
    messages = list(conversation)
    if body.instructions is not None:
        messages.insert(0, {"role": "system", "content": body.instructions})
    if not messages:
        raise OpenAIError(400, "input has no items and there are no instructions", param="input")
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "stream": body.stream,
        "max_completion_tokens": body.max_output_tokens,
        "parallel_tool_calls": body.parallel_tool_calls,
        "ignore_eos": body.ignore_eos,
        "response_format": _response_format(body),
        "reasoning_effort": body.reasoning.effort if body.reasoning is not None else None,
        **{name: getattr(body, name) for name in _SAMPLING},
    }
    if body.tools:
        fields["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
            for t in body.tools
        ]
    choice = body.tool_choice
    if isinstance(choice, FunctionToolChoice):
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif isinstance(choice, ResponsesAllowedToolsChoice):
        tools = [{"type": "function", "function": {"name": t.name}} for t in choice.tools]
        allowed = {"mode": choice.mode, "tools": tools}
        fields["tool_choice"] = {"type": "allowed_tools", "allowed_tools": allowed}
    else:
        fields["tool_choice"] = choice
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:  # every field was checked already; a guard, not a path
        raise OpenAIError(400, f"the request cannot run as a chat: {exc}", param="input") from exc
