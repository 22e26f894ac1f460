"""Request and response bodies of OpenAI's Responses API (`POST /v1/responses`), as pydantic
models.

Requests are strict like every other request body here (`request_fields.RequestModel`): a bad
value of any field is a 400 naming it. Input items are told apart by their `type`; a message
may leave it out (the SDKs' "easy" message `{"role": "user", "content": "..."}`), so the
discriminator defaults to "message". Only function tools exist on this server: a hosted tool
(web search, file search, ...) fails validation on `tools`, rather than being accepted and never
called.

vLLM's sampling extensions that make sense without choices or logprobs (`seed`, `stop`, `top_k`,
`min_p`, `repetition_penalty`, `ignore_eos`) are accepted too; a client reaches them through the
SDK's `extra_body` (openai-agents: `ModelSettings(extra_body=...)`).

The response side mirrors what the official SDK parses: `Response` with `output` items
(message, function_call, reasoning) and `usage` in input/output tokens.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationError,
    field_validator,
)
from pydantic_core import PydanticCustomError

from tokenwise.entrypoints.openai.protocol import ReasoningEffort
from tokenwise.entrypoints.openai.request_fields import RequestModel


def new_item_id(prefix: str) -> str:
    """OpenAI's id shape: a type prefix (`resp`, `msg`, `fc`, `rs`) and a random suffix."""
    return f"{prefix}_{uuid.uuid4().hex}"


def _item_type(value: Any) -> str:
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", "message")


# ---- request -------------------------------------------------------------------------------


class TextContent(RequestModel):
    """Text in a message: the user's (`input_text`) or an earlier reply's (`output_text`, which
    carries annotations and logprobs when a client sends a previous output back verbatim)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class RefusalContent(RequestModel):
    type: Literal["refusal"]
    refusal: str


MessageContent = Annotated[TextContent | RefusalContent, Field(discriminator="type")]


class MessageItem(RequestModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[MessageContent]
    id: str | None = None
    status: str | None = None
    phase: str | None = None


class FunctionCallItem(RequestModel):
    """A call the model made earlier; `call_id` pairs it with its `function_call_output`."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: str | None = None


class InputTextPart(RequestModel):
    type: Literal["input_text"]
    text: str


class FunctionCallOutputItem(RequestModel):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[InputTextPart]
    id: str | None = None
    status: str | None = None


class ReasoningItem(RequestModel):
    """Reasoning an earlier reply carried: accepted (clients send their outputs back whole) and
    left out of the prompt, as chat templates drop earlier turns' reasoning."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: str | None = None


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(
        _item_type,
        custom_error_type="input_item_type",
        custom_error_message="unsupported item type; this server takes message, function_call, "
        "function_call_output and reasoning items",
    ),
]


_INPUT_ITEMS: TypeAdapter[list[Any]] = TypeAdapter(list[InputItem])
# Parts of pydantic's error locations that name a union's branch, not a field.
_BRANCHES = {"str", "message", "function_call", "function_call_output", "reasoning"}


def _where(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if str(p) not in _BRANCHES and "[" not in str(p)]
    return f"item {parts[0]}" + "".join(f", {p}" for p in parts[1:])


def validate_input_items(value: Any) -> list[Any]:
    """The items of a list `input`, or an error that names the item and field at fault.

    Pydantic reports a union's failure once per branch ("should be a valid string" for the
    string form, then the list's), first the least useful; this reports the deepest one."""
    try:
        return _INPUT_ITEMS.validate_python(value, strict=True)
    except ValidationError as exc:
        worst = max(exc.errors(), key=lambda e: len(e["loc"]))
        message = f"{_where(worst['loc'])}: {worst['msg']}"
        raise PydanticCustomError("input_item", message) from None


class FunctionTool(RequestModel):
    """A function tool, flat as the Responses API has it (chat nests it under `function`)."""

    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(RequestModel):
    type: Literal["function"]
    name: str


class AllowedFunction(RequestModel):
    type: Literal["function"]
    name: str


class ResponsesAllowedToolsChoice(RequestModel):
    """The Responses API's `allowed_tools` choice (flat, unlike chat's): only these tools may
    be called, under `mode`; run as chat's form (`responses_input`)."""

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[AllowedFunction] = Field(min_length=1)


class TextFormatText(RequestModel):
    type: Literal["text"]


class TextFormatJsonObject(RequestModel):
    type: Literal["json_object"]


class TextFormatJsonSchema(RequestModel):
    """`schema` is a name pydantic's BaseModel reserves, hence the alias."""

    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)

    type: Literal["json_schema"]
    name: str = Field(min_length=1)
    json_schema: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


TextFormat = Annotated[
    TextFormatText | TextFormatJsonObject | TextFormatJsonSchema, Field(discriminator="type")
]


class TextConfig(RequestModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted, changes nothing


class ReasoningConfig(RequestModel):
    """Echoed; `effort` reaches the chat template as `reasoning_effort` (gpt-oss reads it), the
    summary settings are accepted only: the reasoning a model writes is its own (split off as
    reasoning items with `--reasoning-parser`)."""

    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


Includable = Literal[
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
    "file_search_call.results",
    "message.input_image.image_url",
    "message.output_text.logprobs",
    "reasoning.encrypted_content",
    "web_search_call.action.sources",
    "web_search_call.results",
]


class ResponsesRequest(RequestModel):
    # Implemented here, though the chat endpoints only accept them (`request_fields.IGNORED`):
    # `store` keeps the response for `previous_response_id`, `metadata` is echoed and stored;
    # `reasoning`'s effort is the chat template's `reasoning_effort`.
    implemented_fields: ClassVar[frozenset[str]] = frozenset({"store", "metadata", "reasoning"})

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: (
        Literal["none", "auto", "required"]
        | FunctionToolChoice
        | ResponsesAllowedToolsChoice
        | None
    ) = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(
        default=None, max_length=16
    )
    reasoning: ReasoningConfig | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    user: str | None = None
    # What to add to the output: logprobs are refused (not implemented here yet); the others
    # concern hosted tools and encrypted reasoning, which this server has none of.
    include: list[Includable] | None = None
    # Ignored (`request_fields.IGNORED`), typed so that a malformed value is still a 400.
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM's sampling extensions.
    seed: int | None = None
    stop: str | list[str] | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False

    @field_validator("input", mode="wrap")
    @classmethod
    def _check_input(cls, value: Any, handler: Any) -> Any:
        if isinstance(value, list):
            return validate_input_items(value)
        if not isinstance(value, str):
            raise PydanticCustomError("input", "must be a string or a list of input items")
        return handler(value)


# ---- response ------------------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str = Field(default_factory=lambda: new_item_id("msg"))
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str = Field(default_factory=lambda: new_item_id("fc"))
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str = Field(default_factory=lambda: new_item_id("rs"))
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = OutputMessage | OutputFunctionCall | OutputReasoning


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int = 0


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    """The response: `status` "completed", or "incomplete" when `max_output_tokens` (or the
    model's context) ran out first, as OpenAI reports it."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete", "failed"] = "in_progress"
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] = Field(default_factory=dict)
    store: bool = True
    temperature: float = 1.0
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_p: float = 1.0
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
