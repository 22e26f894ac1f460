"""The FastAPI app of `tokenwise serve`, and the function that runs it on uvicorn.

`build_app` only wires parts together (so tests can build an app around any engine); the
work is in `AsyncEngine` (the engine thread), the `serving_*` modules (request -> engine ->
response), `errors` (OpenAI error bodies) and `metrics` (Prometheus).

Open routes: `/health`, `/ping` (vLLM's name for the same probe), `/version` and `/metrics`,
so probes and scrapers need no secret; and the web page's static files (`/`, `/ui/*.js|css`),
which hold no data and must load to ask for the key (its data routes, `/ui/api`, need it). Everything under `/v1`, and `/tokenize` and
`/detokenize` (vLLM's paths, outside `/v1`), require `Authorization: Bearer <key>` when a key
is configured, or `x-api-key: <key>` (how Anthropic's clients send it, for `/v1/messages`).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import signal
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Body, Depends, FastAPI, Header, Request
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST

from tokenwise import envs
from tokenwise.entrypoints.openai.access_log import AccessLogMiddleware, request_id
from tokenwise.entrypoints.openai.async_core_engine import AsyncCoreEngine
from tokenwise.entrypoints.openai.async_engine import AsyncEngine
from tokenwise.entrypoints.openai.body_limit import BodySizeLimitMiddleware
from tokenwise.entrypoints.openai.chat_images import image_settings
from tokenwise.entrypoints.openai.errors import OpenAIError, install_error_handlers
from tokenwise.entrypoints.openai.image_fetch import fetch_limits
from tokenwise.entrypoints.openai.metrics import ServerMetrics
from tokenwise.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from tokenwise.entrypoints.openai.protocol_anthropic import CountTokensRequest, MessagesRequest
from tokenwise.entrypoints.openai.protocol_embeddings import EmbeddingRequest
from tokenwise.entrypoints.openai.protocol_models import (
    LoadLoRAAdapterRequest,
    ModelList,
    UnloadLoRAAdapterRequest,
)
from tokenwise.entrypoints.openai.protocol_responses import ResponsesRequest
from tokenwise.entrypoints.openai.protocol_scoring import (
    ClassificationRequest,
    RerankRequest,
    ScoreRequest,
)
from tokenwise.entrypoints.openai.protocol_tokenization import DetokenizeRequest
from tokenwise.entrypoints.openai.request_fields import accept_fields
from tokenwise.entrypoints.openai.responses_store import ResponseStore
from tokenwise.entrypoints.openai.server_config import ServerConfig, with_family_parsers
from tokenwise.entrypoints.openai.server_priority import yield_to_engine_cores
from tokenwise.entrypoints.openai.serving_chat import ChatServing
from tokenwise.entrypoints.openai.serving_common import json_response
from tokenwise.entrypoints.openai.serving_completions import CompletionServing
from tokenwise.entrypoints.openai.serving_dev import add_dev_routes
from tokenwise.entrypoints.openai.serving_embeddings import EmbeddingServing
from tokenwise.entrypoints.openai.serving_messages import MessagesServing
from tokenwise.entrypoints.openai.serving_models import ServingModels
from tokenwise.entrypoints.openai.serving_responses import ResponsesServing
from tokenwise.entrypoints.openai.serving_scoring import ScoringServing
from tokenwise.entrypoints.openai.serving_tokenization import TokenizationServing
from tokenwise.entrypoints.openai.serving_transcriptions import TranscriptionServing
from tokenwise.entrypoints.openai.serving_ui import add_ui_routes
from tokenwise.models.registry import is_speech_architecture

logger = logging.getLogger("tokenwise.server")


# A pooling task's model, and the endpoints that serve it (named when generation is asked of it).
_POOLING_ENDPOINTS = {
    "embed": ("an embedding model", "/v1/embeddings"),
    "score": ("a scoring model", "/v1/score or /v1/rerank"),
    "classify": ("a classification model", "/v1/classify"),
}


def tokenwise_version() -> str:
    try:
        return importlib.metadata.version("tokenwise")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "unknown"


def build_app(
    engine: AsyncEngine,
    config: ServerConfig,
    metrics: ServerMetrics,
    models: ServingModels | None = None,
    allow_runtime_lora_updating: bool = False,
) -> FastAPI:
    """The app; `models` lists the LoRA adapters next to the base model (none by default), and
    `allow_runtime_lora_updating` opens `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="tokenwise", lifespan=lifespan)
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=config.max_request_body_bytes)
    # Added last, so it wraps the body limit: refused bodies get their access line too.
    app.add_middleware(AccessLogMiddleware, enabled=config.access_log)
    install_error_handlers(app)
    models = models or ServingModels(config.served_model_name, config.max_model_len)
    completions = CompletionServing(engine, config, models)
    chat = ChatServing(engine, config, models)
    store = ResponseStore(config.responses_store_size)
    responses = ResponsesServing(engine, config, models, chat, store)
    messages = MessagesServing(engine, config, models, chat)
    embeddings = EmbeddingServing(engine, config, models)
    scoring = ScoringServing(engine, config, models)
    transcriptions = TranscriptionServing(engine, config, models)
    tokenization = TokenizationServing(engine, config, models)
    bearer = HTTPBearer(auto_error=False)

    async def require_api_key(
        credentials: HTTPAuthorizationCredentials | None = Depends(bearer),
        x_api_key: str | None = Header(default=None, include_in_schema=False),
    ) -> None:
        if config.key_matches(credentials.credentials if credentials else None):
            return
        if x_api_key is None or not config.key_matches(x_api_key):
            raise OpenAIError(
                401,
                "invalid or missing API key; send it as 'Authorization: Bearer <key>' or "
                "'x-api-key: <key>'",
                code="invalid_api_key",
            )

    def check_fields(body: Any, raw: Request) -> None:
        accept_fields(body, config.strict_request_fields, request_id(raw), raw.url.path)

    api = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])

    @api.get("/models")
    async def list_models() -> Response:
        return json_response(ModelList(data=models.cards()))

    if allow_runtime_lora_updating:

        @api.post("/load_lora_adapter")
        async def load_lora_adapter(body: LoadLoRAAdapterRequest, raw: Request) -> Response:
            check_fields(body, raw)
            models.load(body.lora_name, body.lora_path)
            return Response(f"adapter {body.lora_name!r} loaded", media_type="text/plain")

        @api.post("/unload_lora_adapter")
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, raw: Request) -> Response:
            check_fields(body, raw)
            models.unload(body.lora_name)
            return Response(f"adapter {body.lora_name!r} unloaded", media_type="text/plain")

    def require_generative_model() -> None:
        if config.task != "generate":
            kind, use = _POOLING_ENDPOINTS.get(config.task, ("a pooling model", "another API"))
            raise OpenAIError(
                400,
                f"the model {config.served_model_name!r} is {kind} (--task {config.task}) and "
                f"cannot generate text; use {use}",
                param="model",
                code="model_not_supported",
            )

    @api.post("/completions")
    async def create_completion(body: CompletionRequest, raw: Request) -> Response:
        require_generative_model()
        return await completions.create(body, raw)

    @api.post("/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Response:
        require_generative_model()
        return await chat.create(body, raw)

    @api.post("/responses")
    async def create_response(body: ResponsesRequest, raw: Request) -> Response:
        require_generative_model()
        return await responses.create(body, raw)

    @api.post("/messages")
    async def create_message(body: MessagesRequest, raw: Request) -> Response:
        require_generative_model()
        return await messages.create(body, raw)

    @api.post("/messages/count_tokens")
    async def count_message_tokens(body: CountTokensRequest, raw: Request) -> Response:
        require_generative_model()
        return await messages.count_tokens(body, raw)

    @api.get("/responses/{response_id}")
    async def retrieve_response(response_id: str) -> Response:
        return responses.retrieve(response_id)

    @api.delete("/responses/{response_id}")
    async def delete_response(response_id: str) -> Response:
        return responses.delete(response_id)

    @api.post("/embeddings")
    async def create_embedding(body: EmbeddingRequest, raw: Request) -> Response:
        return await embeddings.create(body, raw)

    @api.post("/score")
    async def create_score(body: ScoreRequest, raw: Request) -> Response:
        return await scoring.score(body, raw)

    @api.post("/rerank")
    async def create_rerank(body: RerankRequest, raw: Request) -> Response:
        return await scoring.rerank(body, raw)

    @api.post("/classify")
    async def create_classification(body: ClassificationRequest, raw: Request) -> Response:
        return await scoring.classify(body, raw)

    @api.post("/audio/transcriptions")
    async def create_transcription(raw: Request) -> Response:
        return await transcriptions.create(raw)

    app.include_router(api)
    tokens = APIRouter(dependencies=[Depends(require_api_key)])

    @tokens.post("/tokenize")
    async def tokenize(raw: Request, payload: dict[str, Any] = Body(...)) -> Response:
        return json_response(tokenization.tokenize(payload, raw))

    @tokens.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, raw: Request) -> Response:
        return json_response(tokenization.detokenize(body, raw))

    # Rerank outside /v1 too: Jina's and vLLM's `/rerank`, and Cohere v2's `/v2/rerank`.
    @tokens.post("/rerank")
    async def create_rerank_unversioned(body: RerankRequest, raw: Request) -> Response:
        return await scoring.rerank(body, raw)

    @tokens.post("/v2/rerank")
    async def create_rerank_v2(body: RerankRequest, raw: Request) -> Response:
        return await scoring.rerank(body, raw, api_version="2")

    app.include_router(tokens)
    if config.ui:
        add_ui_routes(app, engine, config, require_api_key)
    if envs.get("TOKENWISE_SERVER_DEV_MODE").strip().lower() in ("1", "true"):
        add_dev_routes(app, engine, require_api_key)  # sleep, pause, weight updates

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.is_healthy else 503)

    @app.get("/ping")
    @app.post("/ping")
    async def ping() -> Response:
        return await health()

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": tokenwise_version()})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def build_server(
    args: argparse.Namespace, on_dead: Callable[[BaseException], None] | None = None
) -> tuple[Any, AsyncEngine, FastAPI, ServerConfig]:
    """Everything `tokenwise serve` runs short of the HTTP server: the engine (its core
    processes started), its async front (`on_dead` is told when the engine dies), the app and
    its config. Shared with Ray Serve's replicas (`tokenwise.ray_serve`), which serve the app
    themselves, so both serve the same routes from the same flags."""
    from tokenwise.batchsize_stats import ENV_INTERVAL, reset_batchsize_forward_time_stats
    from tokenwise.engine.client import create_engine
    from tokenwise.entrypoints.engine_args import EngineArgs
    from tokenwise.entrypoints.openai.cli_args import lora_modules_dict, server_config_kwargs
    from tokenwise.entrypoints.openai.tool_parsers import check_tool_call_parser

    # Flags that contradict each other fail before minutes of model loading.
    check_tool_call_parser(args.tool_call_parser, args.enable_auto_tool_choice)

    # /metrics reports forward time per batch size, so collect it (the table is also logged,
    # at INFO, once a minute while busy).
    envs.set_default(ENV_INTERVAL, "60")
    reset_batchsize_forward_time_stats()
    engine_config = EngineArgs.from_cli_args(args).create_engine_config()
    if engine_config.model.skip_tokenizer_init:
        raise ValueError("the server needs a tokenizer")
    import torch

    torch.manual_seed(engine_config.model.seed)
    # The engine core runs in its own process (one per DP rank): this process keeps HTTP,
    # tokenization and streaming, and never takes the interpreter lock from the engine loop.
    fetch_limits()  # a bad TOKENWISE_IMAGE_FETCH_* value fails here, not in a request
    engine = create_engine(engine_config, core_process=True)
    image_token, image_limit = image_settings(engine)
    config = ServerConfig(
        served_model_name=args.served_model_name or args.model or "default",
        max_model_len=engine.model_config.max_model_len,
        task=engine.model_config.task,
        supports_audio=is_speech_architecture(engine.model_config.architectures),
        image_token=image_token,
        limit_images_per_prompt=image_limit,
        **with_family_parsers(server_config_kwargs(args), engine.model_config.architectures),
    )
    lora = engine_config.lora
    lora_modules = lora_modules_dict(args.lora_modules)
    if lora_modules and lora is None:
        raise ValueError("--lora-modules needs --enable-lora")
    models = ServingModels(
        config.served_model_name,
        config.max_model_len,
        lora_modules,
        lora.max_lora_rank if lora is not None else None,
        engine.check_lora,  # adapters are checked against the model when loaded
        ["text", "image"] if image_token is not None else ["text"],
    )
    metrics = ServerMetrics(config.served_model_name)
    # Engine-core processes: the event loop reads their outputs itself (no relay thread).
    front = AsyncCoreEngine if hasattr(engine, "output_fd") else AsyncEngine
    if front is AsyncCoreEngine:
        yield_to_engine_cores()  # the cores run at the priority we started with
    async_engine = front(
        engine,
        observer=metrics.observe,
        on_dead=on_dead,
        max_waiting_requests=args.max_waiting_requests,
    )
    metrics.attach_engine(
        lambda: async_engine.stats,
        engine.forward_time_table,
        engine_config.cache,
        lora.max_loras if lora is not None else None,
    )
    app = build_app(async_engine, config, metrics, models, args.allow_runtime_lora_updating)
    return engine, async_engine, app, config


def run_server(args: argparse.Namespace) -> int:
    """`tokenwise serve`: load the model, start the engine thread, serve until interrupted."""
    import uvicorn

    server: uvicorn.Server | None = None

    def exit_when_dead(exc: BaseException) -> None:
        # In-flight requests already got their errors; stop accepting and let the process end
        # non-zero, so a supervisor restarts it instead of routing traffic to a dead engine.
        if server is not None:
            server.should_exit = True

    engine, async_engine, app, config = build_server(args, exit_when_dead)
    auth = "API key required" if config.api_key else "no API key"
    page = f"; web page on http://{args.host}:{args.port}/" if config.ui else ""
    print(
        f"tokenwise: serving {config.served_model_name!r} on http://{args.host}:{args.port}/v1 "
        f"({auth}){page}",
        file=sys.stderr,
        flush=True,
    )
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level.lower(),
            # SIGTERM: uvicorn stops listening, waits this long for in-flight requests, then
            # cancels them (their engine requests are aborted) and the lifespan stops the engine.
            timeout_graceful_shutdown=args.shutdown_timeout,
            access_log=False,  # `access_log` writes one line per request that says more
        )
    )
    # uvicorn handles SIGTERM itself (stop listening, drain, stop the engine), then restores the
    # handler it found and raises the signal again: that handler only notes it, so a drained
    # server exits 0 rather than dying of the signal it already obeyed.
    terminated: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: terminated.append(signum))
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
        engine.shutdown()  # stops the engine-core processes (a no-op for a dead client)
    if terminated:
        print("tokenwise: SIGTERM: drained and stopped", file=sys.stderr, flush=True)
    if async_engine.died_of is not None:
        exc = async_engine.died_of
        print(
            f"tokenwise: error: the engine loop died ({type(exc).__name__}: {exc}); exiting",
            file=sys.stderr,
            flush=True,
        )
        return 1
    return 0
