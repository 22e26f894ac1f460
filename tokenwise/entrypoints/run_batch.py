"""`tokenwise run-batch -i requests.jsonl -o results.jsonl`: a file of requests in OpenAI's batch
format, answered by the server's own handlers, in this process, without a server.

Each input line is one request:

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

with `url` one of `/v1/completions`, `/v1/chat/completions`, `/v1/embeddings` (and
`/v1/messages`, Anthropic's). Each output line, in input order, is the answer to one input line:

    {"id": "batch_req_...", "custom_id": "r1",
     "response": {"status_code": 200, "request_id": "...", "body": {...}}, "error": null}

The requests go to the same FastAPI app `tokenwise serve` runs, called in-process through an
ASGI transport (no socket, no port), so a batch line is validated, refused and answered exactly
as the same request over HTTP would be. A line that fails keeps the run going: a request the
handler refuses has its status and error body in `response` and `error` set to `{"code",
"message"}`; a line that is not a request at all (bad JSON, an unknown url, a missing field, a
streamed request, a repeated custom_id) has `response: null` and the `error`. The run exits 0
whatever the lines held; it fails (non-zero) only when it cannot run (no input file, a model
that does not load).

All lines are submitted at once (up to `--max-concurrency` in flight), so the engine batches
them as it would concurrent clients; a progress bar on stderr counts finished lines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid
from typing import Any

URLS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/messages")
# A generous bound on one request, so a wedged engine cannot hang the run.
REQUEST_TIMEOUT_S = 3600.0


def add_run_batch_parser(subparsers: argparse._SubParsersAction) -> None:
    from tokenwise.entrypoints.engine_args import add_engine_args

    parser = subparsers.add_parser(
        "run-batch",
        help="answer a JSONL file of OpenAI batch requests",
        description="Answer each request of an OpenAI batch file (JSONL) with the server's "
        "handlers, in-process, and write one result line per request.",
    )
    parser.add_argument(
        "-i", "--input-file", required=True, help="the batch file: one JSON request per line"
    )
    parser.add_argument(
        "-o", "--output-file", required=True, help="where to write one JSON result per line"
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the name request bodies' 'model' must carry (default: --model, or 'default')",
    )
    parser.add_argument(
        "--max-concurrency",
        type=int,
        default=256,
        help="requests in flight at once (default: 256)",
    )
    parser.add_argument(
        "--max-tokens-cap", type=int, default=None, help="the most tokens a request may ask for"
    )
    parser.add_argument(
        "--reasoning-parser", default=None, help="split chat replies' reasoning (as serve does)"
    )
    add_engine_args(parser)
    parser.set_defaults(func=run_batch_command)


def _line_error(custom_id: Any, code: str, message: str) -> dict[str, Any]:
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id if isinstance(custom_id, str) else None,
        "response": None,
        "error": {"code": code, "message": message},
    }


def parse_line(text: str, line_number: int, seen: set[str]) -> dict[str, Any]:
    """The request of one input line, or (with "error") the result that refuses it."""
    where = f"line {line_number}"
    try:
        request = json.loads(text)
    except ValueError as exc:
        return _line_error(None, "invalid_json", f"{where}: not valid JSON: {exc}")
    if not isinstance(request, dict):
        return _line_error(None, "invalid_request", f"{where}: a request must be a JSON object")
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return _line_error(
            None, "invalid_request", f"{where}: custom_id must be a non-empty string"
        )
    if custom_id in seen:
        return _line_error(
            custom_id,
            "duplicate_custom_id",
            f"{where}: custom_id {custom_id!r} repeats an earlier line's",
        )
    seen.add(custom_id)
    if request.get("method") != "POST":
        return _line_error(
            custom_id,
            "invalid_request",
            f'{where}: method must be "POST", got {request.get("method")!r}',
        )
    if request.get("url") not in URLS:
        return _line_error(
            custom_id,
            "invalid_url",
            f"{where}: url must be one of {list(URLS)}, got {request.get('url')!r}",
        )
    body = request.get("body")
    if not isinstance(body, dict):
        return _line_error(custom_id, "invalid_request", f"{where}: body must be a JSON object")
    if body.get("stream"):
        return _line_error(
            custom_id,
            "invalid_request",
            f"{where}: body.stream: a batch request cannot stream; leave it out or set it to false",
        )
    return {"custom_id": custom_id, "url": request["url"], "body": body}


def _error_summary(body: Any, status: int) -> dict[str, Any]:
    """`{"code", "message"}` from an OpenAI or Anthropic error body."""
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        code = error.get("code") or error.get("type") or str(status)
        return {"code": str(code), "message": str(error.get("message", ""))}
    return {"code": str(status), "message": str(body)}


async def answer(client: Any, request: dict[str, Any]) -> dict[str, Any]:
    """One parsed line's result, from the app's answer to its request."""
    try:
        response = await client.post(
            request["url"], json=request["body"], timeout=REQUEST_TIMEOUT_S
        )
        body = response.json()
    except Exception as exc:  # the app answers every request; this is a guard, not a path
        return _line_error(request["custom_id"], "internal_error", f"{type(exc).__name__}: {exc}")
    request_id = body.get("id") if isinstance(body, dict) else None
    result = {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": request["custom_id"],
        "response": {
            "status_code": response.status_code,
            "request_id": request_id or f"req_{uuid.uuid4().hex}",
            "body": body,
        },
        "error": None,
    }
    if response.status_code != 200:
        result["error"] = _error_summary(body, response.status_code)
    return result


async def run_lines(
    app: Any, lines: list[str], max_concurrency: int, progress: Any = None
) -> list[dict[str, Any]]:
    """The result of every input line, in order (blank lines skipped, their numbers kept)."""
    import httpx

    seen: set[str] = set()
    parsed = [
        (number, parse_line(text, number, seen))
        for number, text in enumerate(lines, start=1)
        if text.strip()
    ]
    if progress is not None:
        progress.reset(total=len(parsed))
    limit = asyncio.Semaphore(max_concurrency)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://batch") as client:

        async def one(request: dict[str, Any]) -> dict[str, Any]:
            if "error" in request:
                result = request
            else:
                async with limit:
                    result = await answer(client, request)
            if progress is not None:
                progress.update(1)
            return result

        return list(await asyncio.gather(*(one(request) for _, request in parsed)))


def run_batch_command(args: argparse.Namespace) -> int:
    """Load the model, answer the file, write the results; 0 unless it could not run."""
    from tqdm import tqdm

    from tokenwise.engine.client import create_engine
    from tokenwise.entrypoints.engine_args import EngineArgs
    from tokenwise.entrypoints.openai.api_server import build_app
    from tokenwise.entrypoints.openai.async_engine import AsyncEngine
    from tokenwise.entrypoints.openai.chat_images import image_settings
    from tokenwise.entrypoints.openai.metrics import ServerMetrics
    from tokenwise.entrypoints.openai.server_config import ServerConfig, with_family_parsers

    if args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    with open(args.input_file, encoding="utf-8") as f:  # before the model loads: fail fast
        lines = f.read().splitlines()
    with open(args.output_file, "w", encoding="utf-8"):
        pass  # writable, before the model loads
    engine_config = EngineArgs.from_cli_args(args).create_engine_config()
    engine = create_engine(engine_config)
    image_token, image_limit = image_settings(engine)
    config = ServerConfig(
        served_model_name=args.served_model_name or args.model or "default",
        max_model_len=engine.model_config.max_model_len,
        task=engine.model_config.task,
        image_token=image_token,
        limit_images_per_prompt=image_limit,
        max_tokens_cap=args.max_tokens_cap,
        **with_family_parsers(
            {"reasoning_parser": args.reasoning_parser}, engine.model_config.architectures
        ),
        access_log=False,
        ui=False,
    )
    metrics = ServerMetrics(config.served_model_name)
    async_engine = AsyncEngine(engine)
    app = build_app(async_engine, config, metrics)
    async_engine.start()  # the app's lifespan does this under uvicorn
    try:
        with tqdm(total=len(lines), desc="run-batch", unit="req", file=sys.stderr) as progress:
            results = asyncio.run(run_lines(app, lines, args.max_concurrency, progress))
    finally:
        async_engine.shutdown()
        if hasattr(engine, "shutdown"):
            engine.shutdown()
    with open(args.output_file, "w", encoding="utf-8") as f:
        for result in results:
            f.write(json.dumps(result, ensure_ascii=False) + "\n")
    failed = sum(result["error"] is not None for result in results)
    print(
        f"tokenwise: run-batch: {len(results)} requests, {len(results) - failed} succeeded, "
        f"{failed} failed; results in {args.output_file}",
        file=sys.stderr,
    )
    return 0
