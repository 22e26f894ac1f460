"""`POST /v1/chat/completions`: messages rendered with the tokenizer's chat template
(`chat_rendering`), the reply read back as an assistant message (`tool_calls`).

`image_url` content parts (a vision-language model) are decoded here (`chat_images`) and go to
the engine with the rendered text as `multi_modal_data`.

With `tools`, the template receives them (`tools=`, as Hugging Face templates expect; only the
allowed ones under an `allowed_tools` choice), the reply is read for tool calls according to
`tool_choice` (`tool_calls`) with the server's `--tool-call-parser` (`tool_parsers`), and a
forced call is enforced with guided decoding (`structured_outputs`). A parser whose markers
are special tokens (mistral, openai) has them kept in the decoded text of "auto" replies, as
vLLM does; so does a reasoning parser whose markers are (openai_gptoss: harmony's).

With `--reasoning-parser`, each choice's `<think>` part comes back as `reasoning_content`
(`reasoning`), and tool calls are read from what follows it. A guided reply (a response format,
a forced tool call) is read without the parser: its grammar leaves the model no room to reason,
and a parser that expects the reply to open with reasoning (deepseek_r1) would otherwise take
the whole of it for reasoning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenwise.entrypoints.openai.chat_images import (
    FETCHED_IMAGES,
    load_chat_images,
    prefetch_chat_images,
)
from tokenwise.entrypoints.openai.chat_rendering import render_chat
from tokenwise.entrypoints.openai.errors import OpenAIError
from tokenwise.entrypoints.openai.logprobs import chat_logprobs, prompt_logprobs_field
from tokenwise.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    DeltaMessage,
)
from tokenwise.entrypoints.openai.reasoning import REASONING_PARSERS
from tokenwise.entrypoints.openai.serving_common import (
    OpenAIServing,
    build_sampling_params,
    check_cap,
)
from tokenwise.entrypoints.openai.structured_outputs import (
    ToolMode,
    guided_decoding_for,
    is_guided,
    narrow_allowed_tools,
    resolve_tool_mode,
)
from tokenwise.entrypoints.openai.tool_calls import ToolCallReader
from tokenwise.entrypoints.openai.tool_parsers import DEFAULT_TOOL_PARSER, TOOL_PARSERS, ToolParser
from tokenwise.outputs import CompletionOutput, RequestOutput
from tokenwise.sampling.params import SamplingParams

if TYPE_CHECKING:
    from tokenwise.engine.prompts import PromptInput


class ChatServing(OpenAIServing[ChatCompletionRequest, ChatLogprobs]):
    """One rendered prompt; a stream opens with the assistant role and then sends deltas."""

    request_id_prefix = "chatcmpl"
    prompt_param = "messages"
    response_cls = ChatCompletionResponse
    chunk_cls = ChatCompletionChunk

    async def create(self, body: ChatCompletionRequest, raw: Any) -> Any:
        """The common flow, after fetching the request's http(s) images (on the event loop,
        so a slow image server holds only this request) for `_prepare` to decode."""
        config = self.config
        fetched = await prefetch_chat_images(
            body.messages,
            config.image_token is not None,
            config.limit_images_per_prompt,
            config.allowed_media_domains,
        )
        token = FETCHED_IMAGES.set(fetched)
        try:
            return await super().create(body, raw)
        finally:
            FETCHED_IMAGES.reset(token)

    def _prepare(self, body: ChatCompletionRequest) -> tuple[list[PromptInput], SamplingParams]:
        body = narrow_allowed_tools(body)
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
        mode = resolve_tool_mode(body)
        guided = guided_decoding_for(body, mode)
        if self._needs_special_tokens(body, mode):
            body = body.model_copy(update={"skip_special_tokens": False})
        params = build_sampling_params(
            body, self.config, max_tokens, logprobs, guided, body.prompt_logprobs
        )
        config = self.config
        images = load_chat_images(
            body.messages,
            config.image_token is not None,
            config.limit_images_per_prompt,
            config.allowed_local_media_path,
        )
        prompt = render_chat(self.engine.engine.tokenizer, body, config.image_token, len(images))
        if images:  # the engine's processor tokenizes it, expanding each image's placeholder
            return [{"prompt": prompt["prompt"], "multi_modal_data": {"image": images}}], params
        return [prompt], params

    def _logprobs(
        self, body: ChatCompletionRequest, output: CompletionOutput, offset: int
    ) -> tuple[ChatLogprobs | None, int]:
        if not body.logprobs:
            return None, offset
        top_n = body.top_logprobs or 0
        return chat_logprobs(output.token_ids, output.logprobs or [], top_n), offset

    def _extras(
        self, body: ChatCompletionRequest, merged: dict[int, RequestOutput], choices: list
    ) -> dict[str, Any]:
        # vLLM's `prompt_logprobs`: one prompt, so one list, on the response itself.
        if body.prompt_logprobs is None or 0 not in merged:
            return {}
        return {"prompt_logprobs": prompt_logprobs_field(merged[0].prompt_logprobs)}

    def prepare(self, body: ChatCompletionRequest) -> tuple[list[PromptInput], SamplingParams]:
        """`_prepare`, for the Responses endpoint, which runs its requests as chat requests
        (`serving_responses`)."""
        return self._prepare(body)

    def reader(self, body: ChatCompletionRequest) -> ToolCallReader:
        """A fresh reader of one choice's reply (the request was checked in `_prepare`)."""
        body = narrow_allowed_tools(body)
        mode = resolve_tool_mode(body)
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
        parser = self._tool_parser_cls()(tools)
        name = self.config.reasoning_parser
        if name is None or is_guided(body, mode):
            return ToolCallReader(mode, parser=parser)
        reasoning = REASONING_PARSERS[name]()
        return ToolCallReader(mode, reasoning, body.include_reasoning, parser)

    def _needs_special_tokens(self, body: ChatCompletionRequest, mode: ToolMode) -> bool:
        """Whether the reply's parsers read markers that are special tokens (harmony's)."""
        if mode.kind == "auto" and self._tool_parser_cls().needs_special_tokens:
            return True
        name = self.config.reasoning_parser
        if name is None or is_guided(body, mode):
            return False
        return REASONING_PARSERS[name].needs_special_tokens

    def _tool_parser_cls(self) -> type[ToolParser]:
        return TOOL_PARSERS[self.config.tool_call_parser or DEFAULT_TOOL_PARSER]

    def _choice(
        self,
        body: ChatCompletionRequest,
        index: int,
        output: CompletionOutput,
        logprobs: ChatLogprobs | None,
    ) -> ChatChoice:
        reader = self.reader(body)
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
            reader = state[index] = self.reader(body)
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
