"""Request and response bodies of Anthropic's Messages API (`POST /v1/messages`,
`POST /v1/messages/count_tokens`), as pydantic models.

Field names, block types and defaults follow Anthropic's API, so its SDK works unchanged.
Requests are strict like the OpenAI bodies (`request_fields.RequestModel`): a wrong type is a
400 naming the field, an unknown field is ignored with a warning (a 400 under
`--strict-request-fields`). `cache_control` (prompt caching hints) is accepted wherever the
API allows it and changes nothing: the engine's prefix cache needs no hints.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tokenwise.entrypoints.openai.request_fields import RequestModel

# ---- request content blocks ----------------------------------------------------------------


class TextBlockParam(RequestModel):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None
    citations: list[Any] | None = None


class Base64ImageSource(RequestModel):
    type: Literal["base64"]
    media_type: str
    data: str


class URLImageSource(RequestModel):
    type: Literal["url"]
    url: str


class ImageBlockParam(RequestModel):
    type: Literal["image"]
    source: Annotated[Base64ImageSource | URLImageSource, Field(discriminator="type")]
    cache_control: dict[str, Any] | None = None


class ToolUseBlockParam(RequestModel):
    """A call the assistant made, replayed in the conversation."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlockParam(RequestModel):
    """The result of call `tool_use_id`, sent back in a user message."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlockParam | ImageBlockParam] | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None


class ThinkingBlockParam(RequestModel):
    """An earlier turn's thinking (left out of the prompt: chat templates drop it too)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlockParam(RequestModel):
    type: Literal["redacted_thinking"]
    data: str


ContentBlockParam = Annotated[
    TextBlockParam
    | ImageBlockParam
    | ToolUseBlockParam
    | ToolResultBlockParam
    | ThinkingBlockParam
    | RedactedThinkingBlockParam,
    Field(discriminator="type"),
]


class MessageParam(RequestModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlockParam]


# ---- tools, tool choice, thinking ----------------------------------------------------------


class ToolParam(RequestModel):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoiceAuto(RequestModel):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(RequestModel):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(RequestModel):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(RequestModel):
    type: Literal["none"]


ToolChoice = Annotated[
    ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")
]


class ThinkingEnabled(RequestModel):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1)
    display: Literal["summarized", "omitted"] | None = None  # omitted: no thinking text back


class ThinkingAdaptive(RequestModel):
    """The model decides whether to think: a reasoning model always may, so as "enabled"."""

    type: Literal["adaptive"]
    display: Literal["summarized", "omitted"] | None = None


class ThinkingDisabled(RequestModel):
    type: Literal["disabled"]


Thinking = Annotated[
    ThinkingEnabled | ThinkingAdaptive | ThinkingDisabled, Field(discriminator="type")
]


class JSONOutputFormat(RequestModel):
    """Structured output: the reply is JSON of `schema` (chat's `response_format`)."""

    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(RequestModel):
    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)

    format: JSONOutputFormat | None = None
    effort: str | None = None  # ignored: the model's own length of reasoning is what it is


# ---- requests ------------------------------------------------------------------------------


class PromptFields(RequestModel):
    """What becomes the prompt: shared by a message request and a token count."""

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlockParam] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(PromptFields):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    output_config: OutputConfig | None = None
    metadata: dict[str, Any] | None = None  # ignored (Anthropic's user id for abuse reports)
    service_tier: str | None = None  # ignored
    cache_control: dict[str, Any] | None = None  # ignored: prefix caching needs no hints


class CountTokensRequest(PromptFields):
    pass


# ---- responses -----------------------------------------------------------------------------


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def new_tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


class TextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingBlock(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # no signature: the reasoning is not sent anywhere to be verified


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str = Field(default_factory=new_tool_use_id)
    name: str
    input: dict[str, Any]


ContentBlock = TextBlock | ThinkingBlock | ToolUseBlock
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class Usage(BaseModel):
    input_tokens: int = 0
    output_tokens: int = 0
    cache_creation_input_tokens: int | None = None
    cache_read_input_tokens: int | None = None


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock] = Field(default_factory=list)
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: Usage = Field(default_factory=Usage)


class CountTokensResponse(BaseModel):
    input_tokens: int
