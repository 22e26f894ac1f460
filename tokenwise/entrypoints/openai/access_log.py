"""One access log line per HTTP request, and the request id the rest of the server uses.

    INFO tokenwise.server.access: 127.0.0.1:50312 "POST /v1/chat/completions" 200
        id=chatcmpl-5d1c... prompt_tokens=12 output_tokens=32 time=0.532s

(one line in the log). It is logged at INFO on `tokenwise.server.access` (shown with
`tokenwise --log-level INFO serve`) when the response has been sent, or the client has gone,
for every route: errors, 404s, 413s and aborted streams included. `--disable-access-log`
(vLLM's `--disable-uvicorn-access-log` is accepted too) turns it off; uvicorn's own access
line, which says less, is always off.

It differs from the engine's line (`--disable-log-requests`, logger `tokenwise.engine`): that
one is written per *engine* request (one per prompt of a batched completion), when it finishes,
with its time to first token and finish reason, and knows nothing of HTTP. This one is per HTTP
request, with its route, status and the token counts of the response as a whole.

The middleware gives every HTTP request an id (`request_id`); an endpoint that names its
response (`cmpl-...`, `chatcmpl-...`) builds that name from it (`set_request_id`), so the access
line, a warning about the request and the engine's lines all carry the same id. Endpoints with
token counts leave their running count in the request's state (`record_usage`).
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Protocol

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

access_logger = logging.getLogger("tokenwise.server.access")


class _Usage(Protocol):
    prompt_tokens: int
    completion_tokens: int


class UsageSource(Protocol):
    def usage(self) -> _Usage: ...


def request_id(request: Request) -> str:
    """This HTTP request's id (the middleware's, or a fresh one where no middleware ran)."""
    state = request.scope.setdefault("state", {})
    if "request_id" not in state:
        state["request_id"] = uuid.uuid4().hex
    return state["request_id"]


def set_request_id(request: Request, prefix: str) -> str:
    """Name the response `{prefix}-{id}` and log it under that name."""
    full = f"{prefix}-{request_id(request)}"
    request.scope["state"]["request_id"] = full
    return full


def record_usage(request: Request, source: UsageSource) -> None:
    """Where the access line reads the token counts (read when the line is written, so a
    stream's counts are as of its end)."""
    request.scope.setdefault("state", {})["usage"] = source


def _line(scope: Scope, state: dict[str, Any], status: int | None, seconds: float) -> str:
    client = scope.get("client")
    where = f"{client[0]}:{client[1]}" if client else "-"
    parts = [
        f'{where} "{scope.get("method", "-")} {scope.get("path", "-")}"',
        str(status) if status is not None else "-",
        f"id={state.get('request_id', '-')}",
    ]
    source = state.get("usage")
    if source is not None:
        usage = source.usage()
        parts.append(f"prompt_tokens={usage.prompt_tokens}")
        parts.append(f"output_tokens={usage.completion_tokens}")
    parts.append(f"time={seconds:.3f}s")
    return " ".join(parts)


class AccessLogMiddleware:
    """Assigns the request id and, when `enabled`, logs the line once the app is done."""

    def __init__(self, app: ASGIApp, enabled: bool = True) -> None:
        self.app = app
        self.enabled = enabled

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state["request_id"] = uuid.uuid4().hex
        start = time.perf_counter()
        status: int | None = None

        async def send_and_note_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note_status)
        except BaseException:
            status = status or 500  # the outer error middleware answers 500
            raise
        finally:
            if self.enabled and access_logger.isEnabledFor(logging.INFO):
                seconds = time.perf_counter() - start
                access_logger.info("%s", _line(scope, state, status, seconds))
