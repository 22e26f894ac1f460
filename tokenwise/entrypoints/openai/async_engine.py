"""An asyncio front end over the synchronous `LLMEngine`.

The engine is not thread-safe and its `step()` blocks for a whole forward pass, so it lives in
one dedicated thread that owns it exclusively. HTTP handlers never touch it: they post commands
(add, abort) to a queue that the thread applies between steps, and receive each request's
outputs through an `asyncio.Queue` fed with `loop.call_soon_threadsafe`. Every step serves all
running requests at once (continuous batching); when nothing is queued or running the thread
sleeps on a condition variable instead of spinning.

With `max_waiting_requests` set, a request that would make more engine requests wait than that
is refused at once with `ServerOverloadedError` (a 503 with `Retry-After`), instead of queueing
without bound: a client learns to back off while the server still has memory and latency to
serve what it accepted. Waiting means not yet scheduled: the engine's waiting count as of its
last step, plus the requests handed over since (queued here or applied in the step running
now), so a burst between two steps cannot slip past the bound.

If the thread dies (a bug, or the engine-core process died: model errors fail only their
step's requests inside the engine, which then serves on), every waiting request receives `EngineDeadError`, new requests
are refused with it, `is_healthy` turns false so `/health` reports 503, and `on_dead` is called
so the server can exit non-zero instead of lingering unusable. While idle the thread asks the
engine's `check_health()` every second, so a core killed between requests is noticed too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenwise.engine.stats import EngineStats
from tokenwise.entrypoints.openai.errors import EngineDeadError, ServerOverloadedError
from tokenwise.lora.request import LoRARequest
from tokenwise.outputs import EmbeddingRequestOutput, RequestOutput
from tokenwise.pooling.params import PoolingParams
from tokenwise.sampling.params import SamplingParams

if TYPE_CHECKING:  # the engine (and torch) load only where an engine is built
    from tokenwise.engine.llm_engine import LLMEngine
    from tokenwise.engine.prompts import PromptInput

logger = logging.getLogger("tokenwise.server")

# While idle, the engine thread asks the engine this often whether it can still serve (an
# engine-core process may have been killed), so a dead engine ends the server within seconds.
HEALTH_CHECK_INTERVAL_S = 1.0

OutputObserver = Callable[[RequestOutput | EmbeddingRequestOutput], None]
DeathCallback = Callable[[BaseException], None]


class RequestStream:
    """The outputs of one HTTP request's engine requests, as (prompt index, delta) pairs.

    Iterate it on the event loop that created it; `close()` aborts whatever has not finished
    (call it in a `finally`: a consumer that stops early must not leave requests generating).
    """

    def __init__(self, engine: AsyncEngine, loop: asyncio.AbstractEventLoop) -> None:
        self._engine = engine
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.pending: set[str] = set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if not self.pending:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.pending.clear()
            raise item
        index, output = item
        if output.finished:
            self.pending.discard(output.request_id)
        return index, output

    def close(self) -> None:
        if self.pending:
            self._engine.abort(sorted(self.pending))
            self.pending.clear()


@dataclass
class _Sink:
    """Where one engine request's outputs go (used on the engine thread)."""

    stream: RequestStream
    index: int

    def put(self, item: object) -> None:
        try:
            self.stream.loop.call_soon_threadsafe(self.stream.queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop has closed; nobody is listening
            pass


@dataclass
class _Add:
    request_id: str
    prompt: PromptInput
    params: SamplingParams | PoolingParams
    sink: _Sink
    accepted: concurrent.futures.Future
    lora_request: LoRARequest | None = None
    priority: int = 0


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Call:
    """A function of the engine run on the engine thread, between two steps (a control
    route's sleep, wake-up or weight update must not overlap a step)."""

    fn: Callable[[Any], Any]
    done: concurrent.futures.Future


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        observer: OutputObserver | None = None,
        on_dead: DeathCallback | None = None,
        max_waiting_requests: int | None = None,
    ) -> None:
        if max_waiting_requests is not None and max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {max_waiting_requests}")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        # Engine requests handed over since the engine last counted its waiting queue (under
        # `_wakeup`): posted and not yet applied, or applied in the step now running.
        self._unseen_adds = 0
        self._observer = observer
        self._on_dead = on_dead
        self.died_of: BaseException | None = None  # set only when the loop crashed
        self._commands: deque[_Add | _Abort | _Call] = deque()
        self._wakeup = threading.Condition()
        self._sinks: dict[str, _Sink] = {}  # engine thread only
        self._stopping = False
        self._error: BaseException | None = None
        self._stats = copy.deepcopy(engine.get_stats())
        self._thread = threading.Thread(target=self._run, name="tokenwise-engine", daemon=True)

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        if not self._thread.is_alive() and self._error is None and not self._stopping:
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        self.engine.wakeup()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def is_healthy(self) -> bool:
        return self._thread.is_alive() and self._error is None and not self._stopping

    @property
    def stats(self) -> EngineStats:
        """The statistics as of the end of the last loop iteration (a private copy)."""
        return self._stats

    # ---- the API handlers use -----------------------------------------------------------------

    async def submit(
        self,
        request_id: str,
        prompts: Sequence[PromptInput],
        params: SamplingParams | PoolingParams,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> RequestStream:
        """Queue one engine request per prompt; return the stream of their outputs (each
        with the scheduling `priority`, which the engine refuses unless it schedules by it).

        Returns only once the engine has accepted every prompt, so invalid input raises here
        (ValueError/TypeError from `LLMEngine.add_request`), before a response has started.
        """
        self._admit(len(prompts))
        stream = RequestStream(self, asyncio.get_running_loop())
        accepted: list[concurrent.futures.Future] = []
        try:
            # Post every prompt before waiting, so a batch enters the engine in one iteration.
            for index, prompt in enumerate(prompts):
                rid = f"{request_id}-{index}"
                accepted.append(concurrent.futures.Future())
                stream.pending.add(rid)
                sink = _Sink(stream, index)
                add = _Add(rid, prompt, params, sink, accepted[-1], lora_request, priority)
                self._post(add)
            for future in accepted:
                await asyncio.wrap_future(future)
        except BaseException:
            stream.close()  # aborts whatever was accepted; unknown ids are ignored
            raise
        return stream

    def _admit(self, count: int) -> None:
        """Count `count` new engine requests as waiting, or refuse them over the bound."""
        with self._wakeup:
            limit = self.max_waiting_requests
            waiting = self._stats.num_waiting + self._unseen_adds
            if limit is not None and waiting + count > limit:
                raise ServerOverloadedError(
                    f"the server is at capacity: {waiting} requests wait for the engine "
                    f"(--max-waiting-requests={limit}); retry later"
                )
            self._unseen_adds += count

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """`fn(engine)` on the engine thread, between two steps; its result or its error."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._post(_Call(fn, done))
        return await asyncio.wrap_future(done)

    def abort(self, request_ids: list[str]) -> None:
        if request_ids:
            self._post(_Abort(list(request_ids)), check_alive=False)

    def _post(self, command: _Add | _Abort | _Call, check_alive: bool = True) -> None:
        with self._wakeup:
            if check_alive and not self.is_healthy:
                raise EngineDeadError(self._death_reason())
            self._commands.append(command)
            self._wakeup.notify()
        self.engine.wakeup()  # the engine thread may be waiting for outputs in step()

    def _death_reason(self) -> str:
        if self._error is not None:
            return f"{type(self._error).__name__}: {self._error}"
        return "the engine loop is not running"

    # ---- the engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        batch: deque[_Add | _Abort | _Call] = deque()  # taken from the queue, not yet applied
        try:
            while True:
                with self._wakeup:
                    while not (
                        self._commands or self._stopping or self.engine.has_unfinished_requests()
                    ):
                        if not self._wakeup.wait(HEALTH_CHECK_INTERVAL_S):
                            # Idle: an engine core that died now is noticed without a request.
                            self.engine.check_health()
                    if self._stopping:
                        break
                    batch.extend(self._commands)
                    self._commands.clear()
                # A dead engine core must end the loop, not fail each new request as if its
                # input were bad (requests arriving faster than the idle check would hide it).
                self.engine.check_health()
                adds = sum(isinstance(command, _Add) for command in batch)
                while batch:
                    self._apply(batch.popleft())
                if self.engine.has_unfinished_requests():
                    self._publish(self.engine.step())
                stats = copy.deepcopy(self.engine.get_stats())
                with self._wakeup:  # the step counted those adds among its waiting ones
                    self._stats = stats
                    self._unseen_adds = max(0, self._unseen_adds - adds)
        except BaseException as exc:
            logger.exception("the engine loop died")
            self.died_of = exc
            self._fail_everything(exc, list(batch))
            if self._on_dead is not None:
                self._on_dead(exc)
            return
        # Shutting down: whoever still waits gets an error instead of waiting forever.
        self._fail_everything(EngineDeadError("the server is shutting down"), list(batch))

    def _apply(self, command: _Add | _Abort | _Call) -> None:
        if isinstance(command, _Abort):
            self.engine.abort_request(command.request_ids)
            return
        if isinstance(command, _Call):
            if command.done.set_running_or_notify_cancel():
                try:
                    command.done.set_result(command.fn(self.engine))
                except Exception as exc:  # the route answers it; the engine serves on
                    command.done.set_exception(exc)
            return
        if not command.accepted.set_running_or_notify_cancel():
            return  # the handler was cancelled while waiting: don't start the request
        try:
            # Only generation takes an adapter (the embedding engine has no such argument).
            extra: dict[str, Any] = {}
            if command.lora_request:
                extra["lora_request"] = command.lora_request
            if command.priority:
                extra["priority"] = command.priority
            self.engine.add_request(command.request_id, command.prompt, command.params, **extra)
        except Exception as exc:  # invalid input: the handler turns it into a 400
            command.accepted.set_exception(exc)
            return
        self._sinks[command.request_id] = command.sink
        command.accepted.set_result(None)

    def _publish(self, outputs: list[RequestOutput | EmbeddingRequestOutput]) -> None:
        for output in outputs:
            if self._observer is not None:
                try:
                    self._observer(output)
                except Exception:  # metrics must never take the engine down
                    logger.exception("output observer failed")
            sink = self._sinks.get(output.request_id)
            if output.finished:
                self._sinks.pop(output.request_id, None)
            if sink is not None:
                self._deliver(sink, (sink.index, output))

    def _deliver(
        self, sink: _Sink, item: tuple[int, RequestOutput | EmbeddingRequestOutput]
    ) -> None:
        """Hand one output to its request's stream (from the engine thread: through the loop)."""
        sink.put(item)

    def _fail_everything(self, exc: BaseException, unapplied: list[_Add | _Abort | _Call]) -> None:
        with self._wakeup:
            self._error = exc
            commands = unapplied + list(self._commands)
            self._commands.clear()
        dead = EngineDeadError(self._death_reason())
        for command in commands:
            if isinstance(command, _Add) and command.accepted.set_running_or_notify_cancel():
                command.accepted.set_exception(dead)
            elif isinstance(command, _Call) and command.done.set_running_or_notify_cancel():
                command.done.set_exception(dead)
        for sink in self._sinks.values():
            sink.put(dead)
        self._sinks.clear()
