"""Request and response bodies of the OpenAI API, as pydantic models.

Requests are *strict* (no "10" -> 10 or true -> 1 coercion): a wrong type fails with a 400
naming the field instead of being silently reinterpreted. Other fields are accepted and judged
by `request_fields` (ignored with a warning, or refused when they would change the reply;
`--strict-request-fields` refuses unknown ones). Messages take extra keys by design: chat
templates may read them (`name`, `tool_calls`), and the template runs in a sandbox.
Field names and defaults follow OpenAI's API; vLLM's sampling extensions (`top_k`, `min_p`,
`ignore_eos`, `repetition_penalty`, `min_tokens`, `stop_token_ids`, `allowed_token_ids`,
`bad_words`, `truncate_prompt_tokens`, `prompt_logprobs`) are accepted too, and so
are structured outputs: OpenAI's `response_format` and vLLM's `guided_json`, `guided_regex`,
`guided_choice` and `guided_grammar` (and `structured_outputs`, their newer form); chat requests also take `tools` and `tool_choice`, and
vLLM's `chat_template_kwargs`, `continue_final_message` and `include_reasoning`.

Here: the completion and chat bodies, which share `GenerationRequest` and the response
envelope. The other endpoints' bodies have a module each, beside their `serving_*` module:
`protocol_embeddings`, `protocol_tokenization`, `protocol_models`, `protocol_responses`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from tokenwise.entrypoints.openai.request_fields import RequestModel


class StreamOptions(RequestModel):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far (not only the last).
    continuous_usage_stats: bool = False


class JsonSchemaFormat(RequestModel):
    """`response_format.json_schema`. `schema` is a field name pydantic's BaseModel reserves,
    hence the alias. The output always follows the schema exactly: `strict` changes nothing."""

    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)

    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(RequestModel):
    """vLLM's `structured_outputs` request field (its `StructuredOutputsParams`): one spec, as
    the `guided_*` fields give it, and `disable_any_whitespace`, which fixes guided JSON's
    layout (no free whitespace) whatever field the JSON spec came from."""

    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)

    json_schema: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class GenerationRequest(RequestModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None
    response_format: ResponseFormat | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsField | None = None
    # OpenAI's token id (a JSON key: a string) -> bias in [-100, 100]; vLLM's processors and
    # prompt fields. All go to SamplingParams, which names a bad value.
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    # Not with `stream` (as in vLLM); completions' `echo` streams them in `logprobs`.
    prompt_logprobs: int | None = None
    best_of: int | None = None  # None or n: there is no best-of-n (as in vLLM V1)
    # vLLM's: lower is served first under --scheduling-policy priority (a 400 otherwise).
    priority: int = 0
    # Accepted, not implemented: `request_fields.IGNORED` (warned about) and `REFUSED` (a 400
    # unless the value is a no-op). Typed, so a malformed value is still a 400 naming it.
    # `echo` is implemented for completions only (`implemented_fields`).
    echo: bool = False
    # vLLM's beam search (completions: `serving_beam_search`), with Hugging Face's
    # `early_stopping` (false, true or "never"); without it they are ignored.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    request_id: str | None = None
    cache_salt: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None


class CompletionRequest(GenerationRequest):
    # `REFUSED` fields this endpoint implements: echo returns the prompt before the text (with
    # its tokens' logprobs in `logprobs` when asked for; max_tokens 0: the prompt alone),
    # use_beam_search (`serving_beam_search`) and suffix (`fim`).
    implemented_fields: ClassVar[frozenset[str]] = frozenset({"echo", "use_beam_search", "suffix"})
    # A string, a batch of strings, token ids, or a batch of token-id lists.
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    # Fill-in-the-middle (`fim`): the text after the gap; a 400 without FIM tokens.
    suffix: str | None = None
    add_special_tokens: bool = True  # the tokenizer's BOS (and the like) before the prompt


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class ImageURL(RequestModel):
    url: str  # a data: URL (base64) or, under --allowed-local-media-path, file:// or a path
    detail: str | None = None  # OpenAI's resolution hint; the model's processor decides


class ImagePart(RequestModel):
    type: Literal["image_url"]
    image_url: ImageURL


class VideoPart(RequestModel):
    """vLLM's `video_url` part: parsed only to be refused by name (`chat_images.py`)."""

    type: Literal["video_url"]
    video_url: ImageURL


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    role: str
    content: str | list[TextPart | ImagePart | VideoPart] | None = None


class FunctionDefinition(RequestModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionTool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: FunctionName


class AllowedTool(RequestModel):
    type: Literal["function"]
    function: FunctionName


class AllowedTools(RequestModel):
    mode: Literal["auto", "required"]
    tools: list[AllowedTool] = Field(min_length=1)


class AllowedToolsChoice(RequestModel):
    """OpenAI's `{"type": "allowed_tools", "allowed_tools": {"mode", "tools"}}`: only these of
    the request's tools may be called ("auto": or none; "required": at least one). Agent
    frameworks send it to keep the full tool list (and the prompt cache) stable per turn."""

    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


# OpenAI's reasoning efforts (chat's `reasoning_effort`, the Responses API's `reasoning.effort`).
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


class ChatTemplateFields(RequestModel):
    """What the chat template renders: chat completions and `/tokenize` with messages."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ChatCompletionTool] | None = None
    add_generation_prompt: bool = True
    # Leave the last (assistant) message open for the model to continue, instead of starting a
    # new one; excludes add_generation_prompt.
    continue_final_message: bool = False
    # Extra variables for the template, e.g. {"enable_thinking": false} for Qwen3.
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False  # templates write their own BOS
    chat_template: str | None = None  # refused: the tokenizer's template only
    # OpenAI's values; a template variable, as in vLLM (gpt-oss writes "Reasoning: low").
    reasoning_effort: ReasoningEffort | None = None


class ChatCompletionRequest(GenerationRequest, ChatTemplateFields):
    # Default: "auto" when tools are given, else "none" (as OpenAI).
    tool_choice: (
        Literal["none", "auto", "required"] | NamedToolChoice | AllowedToolsChoice | None
    ) = None
    parallel_tool_calls: bool = True
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    include_reasoning: bool = True  # false: the reasoning part is dropped from the reply


# ---- responses -----------------------------------------------------------------------------


def created_now() -> int:
    """The `created` field of every response: Unix seconds (shared by the per-endpoint
    protocol modules)."""
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class OpenAIResponse(BaseModel):
    """The envelope of every completion response and stream chunk. Subclasses narrow `object`
    and `choices`; pydantic keeps an overridden field where the base declared it, so the JSON
    key order stays id, object, created, model, choices, usage."""

    id: str
    object: str
    created: int = Field(default_factory=created_now)
    model: str
    choices: list
    usage: UsageInfo | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's shape of one token's entry in `prompt_logprobs`."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt token (the first is null): token id -> its logprob, for the token and the top-N.
PromptLogprobsField = list[dict[int, PromptLogprob] | None] | None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobsField = None  # vLLM's extension, per choice


class CompletionResponse(OpenAIResponse):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str = Field(default_factory=new_tool_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # with --reasoning-parser
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIResponse):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    prompt_logprobs: PromptLogprobsField = None  # vLLM's extension, for the whole request


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A piece of tool call `index`: the first carries its id, type and name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(OpenAIResponse):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice]
