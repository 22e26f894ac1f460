"""The server's web page (`GET /`) and the engine data it draws, under `/ui/`.

The page is four static files shipped in the package (`ui/index.html`, `app.js` for the key,
chat and completions, `engine.js` for the engine view, `style.css`: our own HTML, JavaScript
and SVG, nothing fetched from elsewhere), so it works on a machine with no internet. It talks to the server like any client: the chat and completions
tabs call `/v1`, and the engine view reads:

- `GET /ui/api/steps?since=N`: the engine's per-step records (`engine.step_records`) added
  after cursor N, the next cursor, and how many the bounded ring dropped before the reader
  asked (a page that polls slower than the ring turns over learns it missed steps);
- `GET /ui/api/steps/stream?since=N`: the same as server-sent events, one event per batch of
  new records, polled every `STREAM_INTERVAL_S` (the engine loop is never woken for a viewer);
- `GET /ui/api/engine`: a snapshot for the slower panels: queue and cache figures per rank,
  each KV block's state, and the forward-time-per-batch-size table.

The static files are open (they hold no data, and the page must load to ask for a key); the
`/ui/api` routes take the same `Authorization: Bearer` key as `/v1`. The page sends it with
`fetch` (an `EventSource` cannot send headers), so the stream is read with `fetch` too.
"""

from __future__ import annotations

import asyncio
import importlib.resources
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict
from typing import Any

import msgspec
from fastapi import APIRouter, Depends, FastAPI, Query
from fastapi.responses import Response, StreamingResponse

from tokenwise.engine.step_records import StepRecords
from tokenwise.entrypoints.openai.async_engine import AsyncEngine
from tokenwise.entrypoints.openai.errors import OpenAIError
from tokenwise.entrypoints.openai.server_config import ServerConfig

STREAM_INTERVAL_S = 0.25  # how often the SSE stream looks for new records
STREAM_KEEPALIVE_S = 15.0  # a comment line this often, so idle proxies keep the stream open
MAX_RECORDS_PER_REPLY = 512  # a page far behind catches up over several replies
_STATIC = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "engine.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
_json = msgspec.json.Encoder()


def _static_file(name: str) -> bytes:
    """A file of the page, read from the installed package (so wheels and source trees agree)."""
    return (
        importlib.resources.files("tokenwise.entrypoints.openai").joinpath("ui", name).read_bytes()
    )


def steps_reply(records: StepRecords, since: int) -> dict[str, Any]:
    """The `/ui/api/steps` body: records at or after cursor `since`, at most
    `MAX_RECORDS_PER_REPLY` of them (the oldest first), and the cursor to ask with next."""
    if since < 0:
        raise OpenAIError(400, f"since must be >= 0, got {since}", param="since")
    items, end, missed = records.since(since)
    if len(items) > MAX_RECORDS_PER_REPLY:
        end -= len(items) - MAX_RECORDS_PER_REPLY
        items = items[:MAX_RECORDS_PER_REPLY]
    return {"records": items, "next": end, "missed": missed, "capacity": records.capacity}


def engine_snapshot(engine: AsyncEngine, config: ServerConfig) -> dict[str, Any]:
    """The `/ui/api/engine` body: the slow-moving state of every rank."""
    inner = engine.engine
    rank_stats = inner.get_rank_stats() if hasattr(inner, "get_rank_stats") else [engine.stats]
    kv = inner.kv_block_states() if hasattr(inner, "kv_block_states") else []
    ranks = []
    for rank, stats in enumerate(rank_stats):
        row = asdict(stats)
        row["rank"] = rank
        # One character per block ("2" in use, "1" cached, "0" free): compact and easy to draw.
        row["kv_blocks"] = kv[rank].translate(_DIGITS).decode() if rank < len(kv) else ""
        ranks.append(row)
    table = inner.forward_time_table() if hasattr(inner, "forward_time_table") else {}
    stats = engine.stats
    return {
        "model": config.served_model_name,
        "max_model_len": config.max_model_len,
        "num_running": stats.num_running,
        "num_waiting": stats.num_waiting,
        "kv_cache_usage": stats.kv_cache_usage,
        "ranks": ranks,
        # batch size (tokens) -> [forward passes, median ms]
        "forward_times": [[size, n, ms] for size, (n, ms) in sorted(table.items())],
    }


_DIGITS = bytes.maketrans(b"\x00\x01\x02", b"012")


async def _sse(
    records: StepRecords, since: int, is_alive: Callable[[], bool]
) -> AsyncIterator[str]:
    """New records as `data:` events until the client goes (Starlette cancels this then)."""
    cursor = since
    quiet = 0.0
    yield ": tokenwise step records\n\n"  # the response starts at once
    while is_alive():
        if records.total > cursor:
            reply = steps_reply(records, cursor)
            cursor = reply["next"]
            yield "data: " + _json.encode(reply).decode() + "\n\n"
            quiet = 0.0
            continue
        await asyncio.sleep(STREAM_INTERVAL_S)
        quiet += STREAM_INTERVAL_S
        if quiet >= STREAM_KEEPALIVE_S:
            quiet = 0.0
            yield ": keep-alive\n\n"


def add_ui_routes(
    app: FastAPI, engine: AsyncEngine, config: ServerConfig, require_api_key: Callable[..., Any]
) -> None:
    """`GET /` and `/ui/*` on `app`; the data routes depend on `require_api_key`."""

    def static(name: str) -> Response:
        return Response(
            _static_file(name),
            media_type=_STATIC[name],
            headers={"Cache-Control": "no-cache"},  # a new server version is seen at once
        )

    @app.get("/", include_in_schema=False)
    async def index() -> Response:
        return static("index.html")

    @app.get("/ui/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        if name not in _STATIC:
            raise OpenAIError(404, f"no page file {name!r}", code="not_found")
        return static(name)

    data = APIRouter(prefix="/ui/api", dependencies=[Depends(require_api_key)])
    records: StepRecords | None = getattr(engine.engine, "step_records", None)

    def need_records() -> StepRecords:
        if records is None:
            raise OpenAIError(404, "this engine keeps no step records", code="not_found")
        return records

    @data.get("/steps")
    async def steps(since: int = Query(0)) -> Response:
        body = _json.encode(steps_reply(need_records(), since))
        return Response(body, media_type="application/json")

    # Out of the OpenAPI schema: an endless event stream (the page reads it until it leaves),
    # which schema-driven clients and fuzzers would wait on forever.
    @data.get("/steps/stream", include_in_schema=False)
    async def steps_stream(since: int = Query(0)) -> StreamingResponse:
        ring = need_records()
        if since < 0:
            raise OpenAIError(400, f"since must be >= 0, got {since}", param="since")
        return StreamingResponse(
            _sse(ring, since, lambda: engine.is_healthy),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    @data.get("/engine")
    async def engine_state() -> Response:
        body = _json.encode(engine_snapshot(engine, config))
        return Response(body, media_type="application/json")

    app.include_router(data)
