"""OpenAI-shaped errors: one exception type, one body shape, handlers for every failure path.

Clients built for OpenAI (the official SDKs included) read `{"error": {"message", "type",
"param", "code"}}` and raise typed exceptions from the status code, so every failure the server
can produce (validation, limits, auth, unknown routes, a dead engine) goes through here rather
than FastAPI's default `{"detail": ...}` bodies.

Anthropic's Messages API (`/v1/messages...`) has its own body shape, `{"type": "error",
"error": {"type", "message"}}`, which its SDK reads the same way; the handlers write that shape
for those paths (`is_anthropic_path`), so the same errors reach either client as it expects.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import fields
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenwise.engine.sleep_control import EngineAsleepError
from tokenwise.sampling.params import SamplingParams

logger = logging.getLogger("tokenwise.server")

# ... and the request's scheduling priority, which the engine checks beside them.
_SAMPLING_FIELDS = {f.name for f in fields(SamplingParams)} | {"priority"}
_LEADING_NAME = re.compile(r"^(\w+)[ =]")

# The `type` OpenAI reports for each status; anything else 4xx is an invalid request.
_TYPES = {
    401: "authentication_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


# Anthropic's error `type` for each status (its SDK maps statuses to exception classes itself).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "api_error",
}
ANTHROPIC_PREFIX = "/v1/messages"


def is_anthropic_path(path: str) -> bool:
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


class OpenAIError(Exception):
    """An error the client should see as-is: status code plus the fields of OpenAI's body."""

    def __init__(
        self,
        status_code: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type_: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or _TYPES.get(status_code, "invalid_request_error")

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def anthropic_body(self) -> dict:
        """Anthropic's shape of the same error (an overloaded server is its overloaded_error)."""
        kind = _ANTHROPIC_TYPES.get(self.status_code, "invalid_request_error")
        if self.code == "server_overloaded":
            kind = "overloaded_error"
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def response(self, headers: Mapping[str, str] | None = None, path: str = "") -> JSONResponse:
        """The error response; in Anthropic's shape for an Anthropic API `path`."""
        body = self.anthropic_body() if is_anthropic_path(path) else self.body()
        return JSONResponse(body, status_code=self.status_code, headers=headers)


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served until a restart."""


class ServerOverloadedError(RuntimeError):
    """More requests wait for the engine than `--max-waiting-requests` allows: try later."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def engine_dead(exc: EngineDeadError) -> OpenAIError:
    """The 503 for a dead engine (this server cannot serve; a supervisor restarts it, a client
    retries elsewhere), the same whether it is a response or a stream event."""
    return OpenAIError(503, f"the engine has stopped: {exc}", code="engine_dead")


def generation_failed(error: object, code: str | None = "generation_error") -> OpenAIError:
    """The 500 for a request the engine failed (a stream's event for a failed delta has
    always been sent with `code=None`)."""
    return OpenAIError(500, f"generation failed: {error}", code=code)


def invalid_request(exc: Exception, default_param: str | None = None) -> OpenAIError:
    """A ValueError from SamplingParams or the engine as a 400. `param` is the sampling
    parameter the message starts with (as in "temperature must be >= 0, got -1.0" or
    "logprobs=30 exceeds ..."), else `default_param` (the prompt, for "prompt has 900 tokens")."""
    message = str(exc)
    match = _LEADING_NAME.match(message)
    param = match.group(1) if match and match.group(1) in _SAMPLING_FIELDS else default_param
    return OpenAIError(400, message, param=param)


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    """Pydantic's first error as a 400; `param` is the top-level field it concerns."""
    errors = exc.errors()
    if not errors:
        return OpenAIError(400, "invalid request body")
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "malformed JSON")
        return OpenAIError(400, f"request body is not valid JSON: {detail}", code="json_invalid")
    where = ".".join(loc) if loc else "body"
    param = loc[0] if loc and not loc[0].isdigit() else None
    return OpenAIError(400, f"{where}: {first.get('msg', 'invalid value')}", param=param)


def install_error_handlers(app: FastAPI) -> None:
    """Route every error to OpenAI's body shape; unexpected ones become a logged 500."""

    @app.exception_handler(OpenAIError)
    async def _openai(request: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response(path=request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response(path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Routing (404/405) and the body-size limit (413) raise these.
        message = str(exc.detail) if exc.detail else HTTPStatus(exc.status_code).phrase
        code = "request_too_large" if exc.status_code == 413 else None
        error = OpenAIError(exc.status_code, message, code=code)
        return error.response(exc.headers, path=request.url.path)

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return engine_dead(exc).response(path=request.url.path)

    @app.exception_handler(EngineAsleepError)
    async def _asleep(request: Request, exc: EngineAsleepError) -> JSONResponse:
        return OpenAIError(503, str(exc), code="engine_asleep").response(path=request.url.path)

    @app.exception_handler(ServerOverloadedError)
    async def _overloaded(request: Request, exc: ServerOverloadedError) -> JSONResponse:
        error = OpenAIError(503, str(exc), code="server_overloaded")
        return error.response({"Retry-After": str(exc.retry_after_s)}, path=request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error while serving a request")
        message = f"internal server error ({type(exc).__name__})"
        error = OpenAIError(500, message, code="internal_error")
        return error.response(path=request.url.path)
