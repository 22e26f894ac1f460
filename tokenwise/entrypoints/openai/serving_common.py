"""What completions and chat completions share: checks, sampling parameters, submission,
usage accounting, server-sent events, cancellation on disconnect, and `OpenAIServing`, the
request -> engine -> response flow of both endpoints. The endpoints differ only in how a
request becomes prompts and how an engine output becomes a choice, so everything else lives
here once and the two cannot drift apart (framing, usage, error events, aborts)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from tokenwise.entrypoints.openai.access_log import record_usage, set_request_id
from tokenwise.entrypoints.openai.async_engine import AsyncEngine, RequestStream
from tokenwise.entrypoints.openai.errors import (
    EngineDeadError,
    OpenAIError,
    engine_dead,
    generation_failed,
    invalid_request,
)
from tokenwise.entrypoints.openai.protocol import GenerationRequest, OpenAIResponse, UsageInfo
from tokenwise.entrypoints.openai.request_fields import accept_fields
from tokenwise.entrypoints.openai.server_config import ServerConfig
from tokenwise.entrypoints.openai.serving_models import ServingModels
from tokenwise.outputs import CompletionOutput, RequestOutput
from tokenwise.sampling.guided.params import GuidedDecodingParams
from tokenwise.sampling.guided.state import GRAMMAR_ERROR_PREFIX
from tokenwise.sampling.params import SamplingParams

if TYPE_CHECKING:
    from tokenwise.engine.prompts import PromptInput

T = TypeVar("T")
RequestT = TypeVar("RequestT", bound=GenerationRequest)
LogprobsT = TypeVar("LogprobsT", bound=BaseModel)
SSE_DONE = "data: [DONE]\n\n"
_OPTIONAL_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


def check_cap(name: str, value: int | None, cap: int, flag: str) -> None:
    """A 400 for a value above a server cap (the type and lower bound are checked elsewhere)."""
    if value is not None and value > cap:
        raise OpenAIError(
            400, f"{name} must be <= {cap} (this server's {flag}), got {value}", param=name
        )


def build_sampling_params(
    body: GenerationRequest,
    config: ServerConfig,
    max_tokens: int | None,
    logprobs: int | None,
    guided_decoding: GuidedDecodingParams | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """SamplingParams from the request; OpenAI's defaults where the request says nothing.

    `prompt_logprobs` is what the engine scores (completions' echo asks for them itself);
    the request's own field cannot stream, as in vLLM (the response carries them whole).
    """
    check_cap("n", body.n, config.max_n, "--max-n")
    check_cap("prompt_logprobs", prompt_logprobs, config.max_logprobs, "--max-logprobs")
    if body.stream and body.prompt_logprobs is not None:
        raise OpenAIError(
            400,
            "prompt_logprobs are not available when stream is true (completions' echo with "
            "logprobs streams the prompt's)",
            param="prompt_logprobs",
        )
    optional = {k: getattr(body, k) for k in _OPTIONAL_SAMPLING if getattr(body, k) is not None}
    try:
        return SamplingParams(
            n=body.n,
            max_tokens=config.effective_max_tokens_cap if max_tokens is None else max_tokens,
            min_tokens=body.min_tokens,
            seed=body.seed,
            stop=body.stop,
            stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=body.skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
            guided_decoding=guided_decoding,
            prompt_logprobs=prompt_logprobs,
            logit_bias=body.logit_bias,
            allowed_token_ids=body.allowed_token_ids,
            bad_words=body.bad_words,
            truncate_prompt_tokens=body.truncate_prompt_tokens,
            best_of=body.best_of,
            **optional,
        )
    except ValueError as exc:
        raise invalid_request(exc) from exc


class UsageCounter:
    """Prompt tokens count once per prompt (not per choice); completion tokens per choice.

    Prompts whose tokens the server already knows (a rendered chat, token ids) are counted
    from the start, so a stream's first chunk can report them."""

    def __init__(self, prompts: list[PromptInput] | None = None) -> None:
        self.prompt_tokens: dict[int, int] = {}
        self.completion_tokens = 0
        for index, prompt in enumerate(prompts or []):
            if isinstance(prompt, dict) and isinstance(prompt.get("prompt_token_ids"), list):
                self.prompt_tokens[index] = len(prompt["prompt_token_ids"])
            elif isinstance(prompt, list):
                self.prompt_tokens[index] = len(prompt)

    def add(self, prompt_index: int, prompt_len: int, new_tokens: int) -> None:
        self.prompt_tokens[prompt_index] = prompt_len
        self.completion_tokens += new_tokens

    def usage(self) -> UsageInfo:
        prompt = sum(self.prompt_tokens.values())
        return UsageInfo(
            prompt_tokens=prompt,
            completion_tokens=self.completion_tokens,
            total_tokens=prompt + self.completion_tokens,
        )


def sse(payload: BaseModel | dict) -> str:
    if isinstance(payload, BaseModel):
        return f"data: {payload.model_dump_json()}\n\n"
    return f"data: {json.dumps(payload)}\n\n"


def json_response(payload: BaseModel) -> Response:
    # pydantic writes non-finite floats (a -inf logprob) as null; json.dumps would refuse them.
    return Response(payload.model_dump_json(), media_type="application/json")


def api_error(exc: BaseException) -> OpenAIError:
    """What a failure during generation tells the client: the error itself when it is one of
    the API's, the engine's death, or a failed generation."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return engine_dead(exc)
    return generation_failed(exc)


def stream_error(exc: BaseException) -> str:
    """An error after the 200 was sent can only travel as an event; OpenAI clients raise it."""
    return sse(api_error(exc).body())


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    # Starlette cancels `events` when the client disconnects; its finally aborts the requests.
    return StreamingResponse(
        events,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Await `work`, cancelling it (None) if the client goes away first. A non-streaming client
    that disconnects would otherwise keep its request generating until max_tokens."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


async def collect_outputs(stream: RequestStream) -> dict[int, RequestOutput]:
    """The deltas folded into one cumulative output per prompt (by prompt index); a failed
    generation is a 500, a grammar the engine refused a 400."""
    merged: dict[int, RequestOutput] = {}
    async for index, delta in stream:
        if index in merged:
            merged[index].merge(delta)
        else:
            merged[index] = delta
    for out in merged.values():
        if out.error is not None and out.error.startswith(GRAMMAR_ERROR_PREFIX):
            # The request's grammar was refused (too slow to compile): the client's to fix.
            raise OpenAIError(400, out.error, code="grammar_refused")
        if out.error is not None:
            raise generation_failed(out.error)
    return merged


async def respond(
    request: Request, stream: RequestStream, collect: Awaitable[BaseModel]
) -> Response:
    """Send the collected (non-streaming) response. A client that leaves first gets its
    requests aborted and a 499 that nobody reads."""
    try:
        response = await unless_disconnected(request, collect)
    finally:
        stream.close()
    if response is None:
        return Response(status_code=499)
    return json_response(response)


class OpenAIServing(ABC, Generic[RequestT, LogprobsT]):
    """One endpoint's flow: validate, submit, then collect one response or stream chunks.

    Subclasses supply the endpoint's checks, prompts and sampling parameters (`_prepare`, in
    the order their errors should be reported) and the shapes of its logprobs and choices.
    Choice `i * n + j` is sample `j` of prompt `i` (chat has one prompt, so it is just `j`).
    """

    request_id_prefix: ClassVar[str]
    prompt_param: ClassVar[str]  # the field a 400 about the prompt names
    response_cls: ClassVar[type[OpenAIResponse]]
    chunk_cls: ClassVar[type[OpenAIResponse]]

    def __init__(
        self, engine: AsyncEngine, config: ServerConfig, models: ServingModels | None = None
    ) -> None:
        self.engine = engine
        self.config = config
        self.models = models or ServingModels(config.served_model_name, config.max_model_len)

    async def create(self, body: RequestT, raw: Request) -> Response:
        request_id = set_request_id(raw, self.request_id_prefix)
        accept_fields(body, self.config.strict_request_fields, request_id, raw.url.path)
        lora_request = self.models.resolve(body.model)
        prompts, params = self._prepare(body)
        try:
            stream = await self.engine.submit(
                request_id, prompts, params, lora_request, body.priority
            )
        except (ValueError, TypeError) as exc:
            # The engine's complaints (prompt too long or empty, bad token ids, parameters this
            # model cannot honour) are 400s about the prompt unless they name a parameter.
            raise invalid_request(exc, self.prompt_param) from exc
        usage = UsageCounter(prompts)
        record_usage(raw, usage)
        if body.stream:
            return event_stream(self._stream(body, request_id, stream, usage))
        return await respond(raw, stream, self._collect(body, request_id, stream, usage))

    @abstractmethod
    def _prepare(self, body: RequestT) -> tuple[list[PromptInput], SamplingParams]:
        """Check the request (raising OpenAIError) and turn it into engine prompts."""

    @abstractmethod
    def _logprobs(
        self, body: RequestT, output: CompletionOutput, offset: int
    ) -> tuple[LogprobsT | None, int]:
        """The logprobs of `output`'s tokens (None when not requested), whose text starts at
        character `offset` of the choice, and the offset after them."""

    @abstractmethod
    def _choice(
        self, body: RequestT, index: int, output: CompletionOutput, logprobs: LogprobsT | None
    ) -> BaseModel:
        """The choice of a collected (non-streaming) response."""

    def _present(
        self, body: RequestT, out: RequestOutput, output: CompletionOutput, first: bool
    ) -> tuple[CompletionOutput, int]:
        """A choice's output (a delta of it, when streaming) as the client sees it, and the
        completion tokens it counts. `first`: the choice's first piece, where completions'
        echo puts the prompt (`out` is its request's output, `prompt_logprobs` included)."""
        return output, len(output.token_ids)

    def _extras(
        self, body: RequestT, merged: dict[int, RequestOutput], choices: list
    ) -> dict[str, Any]:
        """Fields of a collected response beyond its choices and usage, from the merged
        outputs (by prompt index); may also fill fields of the `choices` made."""
        return {}

    def _stream_choice(
        self,
        body: RequestT,
        index: int,
        output: CompletionOutput,
        logprobs: LogprobsT | None,
        state: dict[int, Any],
    ) -> BaseModel | None:
        """The choice of a stream chunk (None: nothing to send for this delta); the collected
        shape unless the endpoint streams deltas of another shape. `state` lives as long as
        the stream, for endpoints that read a choice's text across deltas (keyed by choice)."""
        return self._choice(body, index, output, logprobs)

    def _stream_opening(self, body: RequestT) -> list[BaseModel]:
        """Choices of a chunk sent before any token (none unless the endpoint wants one)."""
        return []

    async def _collect(
        self, body: RequestT, request_id: str, stream: RequestStream, usage: UsageCounter
    ) -> OpenAIResponse:
        merged = await collect_outputs(stream)
        choices = []
        for index in sorted(merged):
            out = merged[index]
            for c in out.outputs:
                shown, counted = self._present(body, out, c, True)
                usage.add(index, len(out.prompt_token_ids), counted)
                logprobs, _ = self._logprobs(body, shown, 0)
                choices.append(self._choice(body, index * body.n + c.index, shown, logprobs))
        return self.response_cls(
            id=request_id,
            model=self.config.served_model_name,
            choices=choices,
            usage=usage.usage(),
            **self._extras(body, merged, choices),
        )

    async def _stream(
        self, body: RequestT, request_id: str, stream: RequestStream, usage: UsageCounter
    ) -> AsyncIterator[str]:
        options = body.stream_options
        include_usage = options is not None and options.include_usage
        # vLLM's continuous_usage_stats: every chunk carries the usage so far.
        continuous = include_usage and options is not None and options.continuous_usage_stats

        def chunk(choices: list[BaseModel], final_usage: UsageInfo | None = None) -> str:
            model = self.config.served_model_name
            counts = final_usage or (usage.usage() if continuous else None)
            return sse(self.chunk_cls(id=request_id, model=model, choices=choices, usage=counts))

        offsets: dict[int, int] = {}  # choice -> text offset of its next token
        state: dict[int, Any] = {}
        # Prompt index -> its prompt logprobs: they come once, maybe before a choice's first piece.
        prompt_logprobs: dict[int, Any] = {}
        try:
            opening = self._stream_opening(body)
            if opening:
                yield chunk(opening)
            async for index, delta in stream:
                if delta.error is not None:
                    yield stream_error(generation_failed(delta.error, code=None))
                    break
                if delta.prompt_logprobs is not None:
                    prompt_logprobs[index] = delta.prompt_logprobs
                delta.prompt_logprobs = prompt_logprobs.get(index)
                for c in delta.outputs:
                    choice = index * body.n + c.index
                    c, counted = self._present(body, delta, c, choice not in offsets)
                    usage.add(index, len(delta.prompt_token_ids), counted)
                    logprobs, offsets[choice] = self._logprobs(body, c, offsets.get(choice, 0))
                    if not c.text and c.finish_reason is None:
                        if logprobs is None or not c.token_ids:
                            continue  # nothing to say yet (e.g. text awaiting more UTF-8 bytes)
                    piece = self._stream_choice(body, choice, c, logprobs, state)
                    if piece is not None:
                        yield chunk([piece])
            else:
                if include_usage:
                    yield chunk([], usage.usage())
        except Exception as exc:
            yield stream_error(exc)
        finally:
            stream.close()
        yield SSE_DONE
