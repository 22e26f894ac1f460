"""Refuse request bodies above a size limit (413) before they are read into memory.

Starlette's `RequestBodyLimitMiddleware` (FastAPI's `max_body_size`) enforces the same rule
but replaces any response to an oversized request with a plain-text body, and OpenAI clients
expect the JSON error body. So this small ASGI middleware checks the declared
`Content-Length` up front, and counts the bytes actually received (chunked uploads declare
none, and a client can lie), raising an HTTPException that the app's handler renders as JSON.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenwise.entrypoints.openai.errors import OpenAIError


def _message(limit: int) -> str:
    return f"request body exceeds this server's limit of {limit} bytes"


class BodySizeLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            error = OpenAIError(413, _message(limit), code="request_too_large")
            await error.response(path=scope.get("path", ""))(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # Raised inside the route's body read; FastAPI passes HTTPExceptions on
                    # (anything else would become a generic 400) to the app's handler.
                    raise HTTPException(413, _message(limit))
            return message

        await self.app(scope, limited_receive, send)
