"""The server's control routes for RL rollouts: sleep and wake-up, pause, weight updates.

Opened only with `TOKENWISE_SERVER_DEV_MODE=1` (vLLM gates the same routes behind
`VLLM_SERVER_DEV_MODE=1`): they let any caller free the model's memory or replace its weights,
so they belong on a trusted network, and they need the API key when one is set. vLLM's paths:

- `POST /sleep?level=1|2`, `POST /wake_up?tags=weights&tags=kv_cache`, `GET /is_sleeping`
  (sleeping needs `--enable-sleep-mode`);
- `POST /pause?wait_for_inflight_requests=false` (new requests get 503 until `POST /resume`;
  running ones are aborted, or with `true` awaited), `GET /is_paused`;
- `POST /init_weight_transfer_engine` `{"init_info": {"master_address", "master_port",
  "world_size"}}`: the engine joins a trainer's group (`distributed/weight_transfer.py`);
- `POST /update_weights` `{"path": "/ckpt"}` loads a checkpoint directory, `{"update_info":
  {}}` receives the trainer's next transfer (the trainer sends while this call waits).

Every response then carries `x-tokenwise-weight-version`: the version of the weights serving
(0 as loaded, one more per update; weights only change while generation is paused or idle).
Each call runs on the engine thread between two steps (`AsyncEngine.call`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Body, Depends, FastAPI, Query, Request
from fastapi.responses import JSONResponse

from tokenwise.entrypoints.openai.async_engine import AsyncEngine
from tokenwise.entrypoints.openai.errors import OpenAIError

WEIGHT_VERSION_HEADER = "x-tokenwise-weight-version"
# How long `/pause?wait_for_inflight_requests=true` waits for running requests.
PAUSE_WAIT_S = 600.0
_POLL_S = 0.05


def _control(engine: Any) -> Any:
    control = getattr(engine, "sleep_control", None)
    if control is None:
        raise NotImplementedError(
            "control routes reach a single engine; with data_parallel_size > 1 they are not "
            "available yet"
        )
    return control


def add_dev_routes(app: FastAPI, engine: AsyncEngine, require_api_key: Callable) -> None:
    """Register the control routes and the weight-version header on `app`."""
    router = APIRouter(dependencies=[Depends(require_api_key)])

    async def run(fn: Callable[[Any], Any]) -> Any:
        try:
            return await engine.call(lambda e: fn(_control(e)))
        except ValueError as exc:
            raise OpenAIError(400, str(exc), code="invalid_control_call") from exc
        except (RuntimeError, NotImplementedError) as exc:
            raise OpenAIError(409, str(exc), code="control_call_refused") from exc

    @router.post("/sleep")
    async def sleep(level: int = Query(1)) -> JSONResponse:
        released = await run(lambda c: c.sleep(level))
        return JSONResponse({"is_sleeping": True, "level": level, "released_bytes": released})

    @router.post("/wake_up")
    async def wake_up(tags: list[str] | None = Query(None)) -> JSONResponse:
        await run(lambda c: c.wake_up(tags))
        return JSONResponse({"is_sleeping": await run(lambda c: c.is_sleeping())})

    @router.get("/is_sleeping")
    async def is_sleeping() -> JSONResponse:
        return JSONResponse({"is_sleeping": await run(lambda c: c.is_sleeping())})

    @router.post("/pause")
    async def pause(wait_for_inflight_requests: bool = Query(False)) -> JSONResponse:
        await run(lambda c: c.pause_generation())
        if wait_for_inflight_requests:
            deadline = time.monotonic() + PAUSE_WAIT_S
            while await engine.call(lambda e: e.has_unfinished_requests()):
                if time.monotonic() > deadline:
                    raise OpenAIError(
                        504, f"requests still running after {PAUSE_WAIT_S:.0f} s", code="timeout"
                    )
                await asyncio.sleep(_POLL_S)
        else:
            await engine.call(lambda e: e.abort_request(list(getattr(e, "groups", {}))))
        return JSONResponse({"is_paused": True})

    @router.post("/resume")
    async def resume() -> JSONResponse:
        await run(lambda c: c.resume_generation())
        return JSONResponse({"is_paused": False})

    @router.get("/is_paused")
    async def is_paused() -> JSONResponse:
        return JSONResponse({"is_paused": await run(lambda c: c.paused)})

    @router.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(body: dict[str, Any] = Body(...)) -> JSONResponse:
        info = body.get("init_info")
        if not isinstance(info, dict):
            raise OpenAIError(400, "the body needs an init_info object", param="init_info")
        try:
            args = (
                str(info["master_address"]),
                int(info["master_port"]),
                int(info["world_size"]),
                float(info.get("timeout_s", 120.0)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise OpenAIError(
                400,
                "init_info needs master_address (str), master_port (int) and world_size (int)"
                f": {exc}",
                param="init_info",
            ) from exc
        await run(lambda c: c.collective_rpc("init_weight_update_group", args))
        return JSONResponse({"joined": True})

    @router.post("/update_weights")
    async def update_weights(body: dict[str, Any] = Body(...)) -> JSONResponse:
        if isinstance(body.get("path"), str):
            loaded = await run(lambda c: c.update_weights("reload_weights", (body["path"],)))
        elif "update_info" in body:
            loaded = await run(lambda c: c.update_weights("receive_weights"))
        else:
            raise OpenAIError(
                400,
                'the body needs "path" (a checkpoint directory) or "update_info" (receive '
                "the trainer's transfer)",
                param="path",
            )
        version = await run(lambda c: c.weight_version)
        return JSONResponse({"loaded": loaded, "weight_version": version})

    app.include_router(router)

    @app.middleware("http")
    async def weight_version_header(request: Request, call_next: Callable) -> Any:
        response = await call_next(request)
        control = getattr(engine.engine, "sleep_control", None)
        if control is not None:
            response.headers[WEIGHT_VERSION_HEADER] = str(control.weight_version)
        return response
