"""What completions and chat completions share: checks, sampling parameters, submission,
usage accounting, server-sent events and cancellation on disconnect."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable
from typing import TYPE_CHECKING, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from tokenwise.entrypoints.openai.async_engine import AsyncEngine, RequestStream
from tokenwise.entrypoints.openai.errors import EngineDeadError, OpenAIError, invalid_request
from tokenwise.entrypoints.openai.protocol import GenerationRequest, UsageInfo
from tokenwise.entrypoints.openai.server_config import ServerConfig
from tokenwise.outputs import RequestOutput
from tokenwise.sampling.params import SamplingParams

if TYPE_CHECKING:
    from tokenwise.engine.prompts import PromptInput

T = TypeVar("T")
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


def check_model(requested: str | None, config: ServerConfig) -> None:
    if requested is not None and requested != config.served_model_name:
        raise OpenAIError(
            404,
            f"the model {requested!r} does not exist; this server serves "
            f"{config.served_model_name!r}",
            param="model",
            code="model_not_found",
        )


def check_cap(name: str, value: int | None, cap: int, flag: str) -> None:
    """A 400 for a value above a server cap (the type and lower bound are checked elsewhere)."""
    if value is not None and value > cap:
        raise OpenAIError(
            400, f"{name} must be <= {cap} (this server's {flag}), got {value}", param=name
        )


def build_sampling_params(
    body: GenerationRequest, config: ServerConfig, max_tokens: int | None, logprobs: int | None
) -> SamplingParams:
    """SamplingParams from the request; OpenAI's defaults where the request says nothing."""
    check_cap("n", body.n, config.max_n, "--max-n")
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
            **optional,
        )
    except ValueError as exc:
        raise invalid_request(exc) from exc


async def submit(
    engine: AsyncEngine,
    request_id: str,
    prompts: list[PromptInput],
    params: SamplingParams,
    prompt_param: str,
) -> RequestStream:
    """Queue the prompts; the engine's complaints (prompt too long or empty, bad token ids,
    parameters this model cannot honour) become 400s, about `prompt_param` unless the message
    names a sampling parameter."""
    try:
        return await engine.submit(request_id, prompts, params)
    except (ValueError, TypeError) as exc:
        raise invalid_request(exc, prompt_param) from exc


class UsageCounter:
    """Prompt tokens count once per prompt (not per choice); completion tokens per choice."""

    def __init__(self) -> None:
        self.prompt_tokens: dict[int, int] = {}
        self.completion_tokens = 0

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


def stream_error(exc: BaseException) -> str:
    """An error after the 200 was sent can only travel as an event; OpenAI clients raise it."""
    if isinstance(exc, OpenAIError):
        error = exc
    elif isinstance(exc, EngineDeadError):
        error = OpenAIError(500, f"the engine has stopped: {exc}", code="engine_dead")
    else:
        error = OpenAIError(500, f"generation failed: {exc}", code="generation_error")
    return sse(error.body())


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


async def merge_by_prompt(stream: RequestStream) -> dict[int, RequestOutput]:
    """Fold every delta of the stream into one cumulative output per prompt index; a failed
    generation is a 500."""
    merged: dict[int, RequestOutput] = {}
    async for index, delta in stream:
        if index in merged:
            merged[index].merge(delta)
        else:
            merged[index] = delta
    for out in merged.values():
        if out.error is not None:
            raise OpenAIError(500, f"generation failed: {out.error}", code="generation_error")
    return merged
