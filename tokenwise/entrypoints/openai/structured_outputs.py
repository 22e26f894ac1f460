"""A request's structured-output fields as one `GuidedDecodingParams`, or a 400 naming the field.

Sources, at most one per request: OpenAI's `response_format` (`json_object`, or `json_schema`
with its `schema`), vLLM's `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`
or their newer form `structured_outputs` (`{"json": ...}`, ...), and a chat request's
`tool_choice` when it forces a call:

- a named function (`{"type": "function", "function": {"name": ...}}`): the reply *is* the
  call's arguments, a JSON value of that tool's `parameters` schema;
- `"required"`: the reply is a JSON array of one or more `{"name", "arguments"}` objects, each
  naming a given tool with arguments of its schema (exactly one with
  `parallel_tool_calls: false`).

`"auto"` is not enforced: the model writes calls in its own format, read back by the
server's tool-call parser (`tool_parsers`). OpenAI's `allowed_tools` choice narrows the tools
(for the template and the grammar alike) to the allowed ones, then acts as its `mode`.
`structured_outputs.disable_any_whitespace` (vLLM's) fixes the layout of whichever JSON spec
the request has, a forced call's included. The spec is parsed here, before the request reaches the engine, so an invalid
schema, regex or grammar is a 400 that names the request field it came from.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from tokenwise.entrypoints.openai.errors import OpenAIError
from tokenwise.entrypoints.openai.protocol import (
    AllowedToolsChoice,
    ChatCompletionRequest,
    ChatCompletionTool,
    GenerationRequest,
    NamedToolChoice,
)
from tokenwise.sampling.guided.grammar import build_grammar
from tokenwise.sampling.guided.params import GuidedDecodingParams

_GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
_ANY_OBJECT: dict[str, Any] = {"type": "object"}
# `structured_outputs` keys -> GuidedDecodingParams fields
_STRUCTURED_KINDS = {
    "json_schema": "json",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
}


@dataclass(frozen=True)
class ToolMode:
    """How a chat reply is read: as text ("none"), text with calls in the model's own format
    in it ("auto", read by the tool-call parser), the arguments of one forced function
    ("named", `name`), or an array of calls ("required")."""

    kind: Literal["none", "auto", "named", "required"]
    name: str | None = None


def narrow_allowed_tools(body: ChatCompletionRequest) -> ChatCompletionRequest:
    """With `tool_choice: {"type": "allowed_tools", ...}`: the request as if it had only the
    allowed tools (in their order in `tools`) and `tool_choice` its `mode`; else unchanged."""
    choice = body.tool_choice
    if not isinstance(choice, AllowedToolsChoice):
        return body
    names = [t.function.name for t in body.tools or []]
    allowed = set()
    for i, ref in enumerate(choice.allowed_tools.tools):
        if ref.function.name not in names:
            raise OpenAIError(
                400,
                f"tool_choice.allowed_tools.tools[{i}] names the function "
                f"{ref.function.name!r}, which is not in tools ({names})",
                param="tool_choice",
            )
        allowed.add(ref.function.name)
    tools = [t for t in body.tools or [] if t.function.name in allowed]
    return body.model_copy(update={"tools": tools, "tool_choice": choice.allowed_tools.mode})


def resolve_tool_mode(body: ChatCompletionRequest) -> ToolMode:
    body = narrow_allowed_tools(body)
    choice = body.tool_choice
    tools = body.tools or []
    if choice is None:
        return ToolMode("auto" if tools else "none")
    if isinstance(choice, NamedToolChoice):
        if not any(t.function.name == choice.function.name for t in tools):
            names = [t.function.name for t in tools]
            raise OpenAIError(
                400,
                f"tool_choice names the function {choice.function.name!r}, which is not in "
                f"tools ({names})",
                param="tool_choice",
            )
        return ToolMode("named", choice.function.name)
    assert isinstance(choice, str)
    if choice != "none" and not tools:
        raise OpenAIError(400, f'tool_choice "{choice}" needs tools', param="tool_choice")
    return ToolMode(choice)  # type: ignore[arg-type]


def is_guided(body: GenerationRequest, tool_mode: ToolMode | None = None) -> bool:
    """Whether the request's output is constrained (what `guided_decoding_for` would return a
    spec for), without parsing the spec again."""
    fmt = body.response_format
    if fmt is not None and fmt.type != "text":
        return True
    if any(getattr(body, name) is not None for name in _GUIDED_FIELDS):
        return True
    so = body.structured_outputs
    if so is not None and any(getattr(so, k) not in (None, False) for k in _STRUCTURED_KINDS):
        return True
    return tool_mode is not None and tool_mode.kind in ("named", "required")


def guided_decoding_for(
    body: GenerationRequest, tool_mode: ToolMode | None = None
) -> GuidedDecodingParams | None:
    """The request's one structured-output spec (None if it has none), already parsed."""
    sources: list[tuple[str, dict[str, Any]]] = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        sources.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise OpenAIError(
                400,
                'response_format of type "json_schema" needs json_schema.schema',
                param="response_format",
            )
        sources.append(("response_format", {"json": fmt.json_schema.json_schema}))
    for name in _GUIDED_FIELDS:
        value = getattr(body, name)
        if value is not None:
            sources.append((name, {name.removeprefix("guided_"): value}))
    so = body.structured_outputs
    if so is not None:
        for key, kind in _STRUCTURED_KINDS.items():
            if getattr(so, key) not in (None, False):
                sources.append(("structured_outputs", {kind: getattr(so, key)}))
    if tool_mode is not None and tool_mode.kind in ("named", "required"):
        assert isinstance(body, ChatCompletionRequest) and body.tools
        sources.append(
            ("tool_choice", {"json": _tool_schema(narrow_allowed_tools(body), tool_mode)})
        )
    if not sources:
        return None
    if len(sources) > 1 and sources[1][0] == "structured_outputs" == sources[0][0]:
        kinds = [next(iter(kwargs)) for _, kwargs in sources]
        raise OpenAIError(
            400, f"structured_outputs takes one of its kinds, got {kinds}",
            param="structured_outputs",
        )  # fmt: skip
    if len(sources) > 1:
        names = [name for name, _ in sources]
        raise OpenAIError(
            400, f"at most one structured-output option per request, got {names}", param=names[1]
        )
    field, kwargs = sources[0]
    if so is not None and so.disable_any_whitespace:
        kwargs = {**kwargs, "disable_any_whitespace": True}
    try:
        spec = GuidedDecodingParams(**kwargs)
        build_grammar(spec)
    except ValueError as exc:
        # The engine's message names `guided_decoding.<kind>`; name the request's field.
        message = re.sub(r"^guided_decoding\.\w+", field, str(exc))
        raise OpenAIError(400, message, param=field) from exc
    return spec


def _tool_schema(body: ChatCompletionRequest, mode: ToolMode) -> dict[str, Any]:
    tools = body.tools or []
    if mode.kind == "named":
        tool = next(t for t in tools if t.function.name == mode.name)
        return tool.function.parameters or _ANY_OBJECT
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"anyOf": [_call_schema(t) for t in tools]},
    }
    if not body.parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


def _call_schema(tool: ChatCompletionTool) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string", "enum": [tool.function.name]},
            "arguments": tool.function.parameters or _ANY_OBJECT,
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
