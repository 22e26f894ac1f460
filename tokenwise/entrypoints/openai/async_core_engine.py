"""The server's front end over engine-core processes: the event loop reads their outputs.

`AsyncEngine` drives an in-process engine from a thread of its own, and every output crosses
from that thread to the event loop (`call_soon_threadsafe`, a self-pipe write and a wake-up).
With the engine in core processes (`EngineCoreClient`, what `tokenwise serve` runs) there is
no forward pass in this process to keep off the event loop, so that thread is only a relay.
Here the loop watches the client's output socket itself (`loop.add_reader` on its descriptor,
as vLLM's AsyncLLM awaits its socket) and hands each output straight to its request's queue;
requests and aborts go to the cores from the handler that made them. One stream measured
~0.6 ms of this process's CPU per token through the thread, on a two-core machine where every
such millisecond preempts one of the core's two OpenMP threads.

Everything else is `AsyncEngine`'s: the streams, the waiting bound, the death handling (a dead
core fails every waiting request, `is_healthy` turns false and `on_dead` runs), the idle health
check every `HEALTH_CHECK_INTERVAL_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from tokenwise.entrypoints.openai.async_engine import (
    HEALTH_CHECK_INTERVAL_S,
    AsyncEngine,
    _Abort,
    _Add,
    _Sink,
)
from tokenwise.entrypoints.openai.errors import EngineDeadError, ServerOverloadedError
from tokenwise.outputs import EmbeddingRequestOutput, RequestOutput

logger = logging.getLogger("tokenwise.server")


class AsyncCoreEngine(AsyncEngine):
    """`AsyncEngine` for an engine whose outputs arrive on a descriptor (`output_fd`)."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd: int | None = None
        self._watch: asyncio.Task | None = None
        # Requests handed to the cores that have produced nothing yet: the waiting bound's count
        # (a core's own waiting count arrives a step late).
        self._no_output: set[str] = set()

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        if self._loop is not None or self._error is not None or self._stopping:
            return
        self._loop = asyncio.get_running_loop()
        self._fd = self.engine.output_fd
        self._loop.add_reader(self._fd, self._on_readable)
        self._watch = self._loop.create_task(self._watch_health())
        self._on_readable()  # anything that arrived before the reader was registered

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._stopping:
            return
        self._stopping = True
        self._detach()
        self._fail_everything(EngineDeadError("the server is shutting down"), [])

    @property
    def is_healthy(self) -> bool:
        return self._loop is not None and self._error is None and not self._stopping

    # ---- commands: applied at once, on the loop -----------------------------------------------

    def _admit(self, count: int) -> None:
        limit = self.max_waiting_requests
        waiting = len(self._no_output)
        if limit is not None and waiting + count > limit:
            raise ServerOverloadedError(
                f"the server is at capacity: {waiting} requests wait for the engine "
                f"(--max-waiting-requests={limit}); retry later"
            )

    def _post(self, command: _Add | _Abort, check_alive: bool = True) -> None:
        if check_alive and not self.is_healthy:
            raise EngineDeadError(self._death_reason())
        if self._error is not None or self._stopping:
            return  # an abort after the end: nothing is running any more
        try:
            # A core that died since the last check must end the server, not fail this request
            # as if its input were bad (`_apply` hands the client's errors to the handler).
            self.engine.check_health()
            self._apply(command)
        except BaseException as exc:  # the client found a core dead while sending
            self._die(exc)
            raise EngineDeadError(self._death_reason()) from exc
        if isinstance(command, _Add) and command.request_id in self._sinks:
            self._no_output.add(command.request_id)

    # ---- outputs: read by the loop ------------------------------------------------------------

    def _on_readable(self) -> None:
        try:
            outputs = self.engine.drain()
        except BaseException as exc:
            self._die(exc)
            return
        if outputs:
            self._publish(outputs)
        self._stats = self.engine.get_stats()

    def _publish(self, outputs: list[RequestOutput | EmbeddingRequestOutput]) -> None:
        for output in outputs:
            self._no_output.discard(output.request_id)
        super()._publish(outputs)

    def _deliver(
        self, sink: _Sink, item: tuple[int, RequestOutput | EmbeddingRequestOutput]
    ) -> None:
        sink.stream.queue.put_nowait(item)  # already on the stream's loop

    async def _watch_health(self) -> None:
        """While nothing arrives, a core killed between requests is still noticed."""
        while not self._stopping and self._error is None:
            await asyncio.sleep(HEALTH_CHECK_INTERVAL_S)
            try:
                self.engine.check_health()
            except BaseException as exc:
                self._die(exc)
                return

    def _die(self, exc: BaseException) -> None:
        if self._error is not None:
            return
        logger.error("the engine core failed: %s", exc)
        self.died_of = exc
        self._detach()
        self._fail_everything(exc, [])
        self._no_output.clear()
        if self._on_dead is not None:
            self._on_dead(exc)

    def _detach(self) -> None:
        if self._loop is not None and self._fd is not None:
            with contextlib.suppress(Exception):  # the descriptor may be closed already
                self._loop.remove_reader(self._fd)
            self._fd = None
        if self._watch is not None and self._watch is not asyncio.current_task():
            self._watch.cancel()
