"""Publishing KV-cache events over ZeroMQ, in vLLM's protocol, without slowing the step.

Wire protocol (vLLM's, so its subscribers work unchanged): a PUB socket sends each step's
:class:`~tokenwise.kv_cache.events.KVEventBatch` as three frames, `(topic, sequence number as
8 big-endian bytes, msgpack payload)`; sequence numbers count up from 0 so a subscriber sees
a gap. An optional ROUTER socket (`replay_endpoint`) serves a REQ client that sends a start
sequence number (8 big-endian bytes): it answers `(seq, payload)` for every buffered batch from
there, then `(-1, b"")`.

The engine thread only drains the collector and puts the batch on a bounded queue
(`put_nowait`: a full queue drops the batch and logs, it never blocks the step); a daemon
thread encodes and sends. Sockets that listen beyond loopback use CurveZMQ: both key pairs
(the publisher's and the one subscriber key it admits) are derived from the shared secret
(:func:`curve_keys`), so a subscriber needs only the secret (:func:`secure_subscriber`).
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

import msgspec
import zmq

from tokenwise.distributed import curve_auth
from tokenwise.kv_cache.events import KVEventBatch, KVEventCollector
from tokenwise.kv_cache.events_config import KVEventsConfig

logger = logging.getLogger(__name__)

#: How long shutdown waits for queued batches to go out (seconds).
SHUTDOWN_TIMEOUT_S = 2.0
_END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: The key-derivation domain of the KV-event sockets (`curve_auth`), as first released: the
#: subscribers already deployed keep their keys.
CURVE_DOMAIN = "tokenwise-kv-events"


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """Rank `r` of a data-parallel deployment publishes on the endpoint's port + r (vLLM's
    convention; ipc/inproc names get a `_dp{r}` suffix)."""
    if not endpoint or not data_parallel_rank:
        return endpoint
    if not endpoint.startswith("tcp://"):
        return f"{endpoint}_dp{data_parallel_rank}"
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + data_parallel_rank}"


def curve_keys(secret: str) -> dict[str, bytes]:
    """The Z85 CurveZMQ keys both ends derive from the shared secret: the publisher's pair
    (`server_public`, `server_secret`) and the subscriber's (`client_public`,
    `client_secret`). Deriving both from one secret keeps the deployment to one value."""
    return curve_auth.curve_keys(secret, CURVE_DOMAIN)


def secure_subscriber(sock: zmq.Socket, secret: str) -> None:
    """Set a SUB or REQ socket (before `connect`) to talk to a publisher with `secret`."""
    curve_auth.secure_client(sock, secret, CURVE_DOMAIN)


class NullEventPublisher:
    """Events off: nothing is collected, nothing sent."""

    def end_step(self) -> None:
        return

    def shutdown(self) -> None:
        return


class ZmqEventPublisher:
    """Drains the pools' collector once per step and sends the batch from its own thread."""

    def __init__(
        self,
        config: KVEventsConfig,
        collector: KVEventCollector,
        data_parallel_rank: int = 0,
    ) -> None:
        self.config = config
        self.collector = collector
        self.data_parallel_rank = data_parallel_rank
        self.endpoint = offset_endpoint_port(config.endpoint, data_parallel_rank)
        self.replay_endpoint = offset_endpoint_port(config.replay_endpoint, data_parallel_rank)
        self.num_dropped = 0
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(config.max_queue_size)
        self._topic = config.topic.encode("utf-8")
        # A context of our own: a ZAP authenticator applies to every socket of its context.
        self._ctx = zmq.Context()
        self._curve: curve_auth.CurveServer | None = None
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = self._ctx.socket(zmq.ROUTER) if self.replay_endpoint else None
        try:
            secret = config.secret
            if secret:
                self._secure(secret)
            self._pub.sndhwm = config.hwm
            self._pub.linger = 0
            self._pub.bind(self.endpoint)
            if self._replay is not None:
                self._replay.linger = 0
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(
                f"kv_events_config: cannot bind {self.endpoint} / {self.replay_endpoint}: {exc}"
            ) from None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        logger.info("publishing KV-cache events on %s", self.endpoint)

    def _secure(self, secret: str) -> None:
        self._curve = curve_auth.CurveServer(
            self._ctx, secret, CURVE_DOMAIN, "KV events", "subscriber"
        )
        for sock in (self._pub, self._replay):
            if sock is not None:
                self._curve.secure(sock)

    def end_step(self) -> None:
        """Queue this step's events (if any) for sending; never blocks."""
        batch = self.collector.take_batch(self.data_parallel_rank)
        if batch is None:
            return
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                logger.warning(
                    "KV events: the send queue is full (%d batches); %d batches dropped",
                    self.config.max_queue_size,
                    self.num_dropped,
                )

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        buffer: list[tuple[int, bytes]] = []
        seq = 0
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay(buffer)
            if self._curve is not None:
                self._curve.log_refusals()
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            payload = encoder.encode(batch)
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError:
                logger.exception("KV events: sending batch %d failed", seq)
            buffer.append((seq, payload))
            if len(buffer) > self.config.buffer_steps:
                del buffer[: len(buffer) - self.config.buffer_steps]
            seq += 1

    def _serve_replay(self, buffer: list[tuple[int, bytes]]) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV events: ignored a malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in buffer:
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", _END_SEQ, b""))

    def shutdown(self) -> None:
        """Send what is queued (bounded by SHUTDOWN_TIMEOUT_S), then close the sockets."""
        if not self._thread.is_alive():
            return
        try:
            self._queue.put(None, timeout=SHUTDOWN_TIMEOUT_S)
        except queue.Full:
            logger.warning("KV events: queue still full at shutdown; pending batches dropped")
        self._thread.join(SHUTDOWN_TIMEOUT_S)
        self._close_sockets()

    def _close_sockets(self) -> None:
        if self._thread_alive():
            return  # the thread still uses them; the process exit closes them
        if self._curve is not None:
            self._curve.close()
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

    def _thread_alive(self) -> bool:
        thread = getattr(self, "_thread", None)
        return thread is not None and thread.is_alive()


def attach_kv_events(
    config: KVEventsConfig | None, pools: list[Any], data_parallel_rank: int = 0
) -> ZmqEventPublisher | NullEventPublisher:
    """The engine's publisher; when events are on, every KV pool reports into its collector.

    `pools`: each virtual engine's KV block pool (one collector serves them all: a step's
    events come from whichever pools it touched).
    """
    if config is None or not config.active:
        return NullEventPublisher()
    collector = KVEventCollector()
    for pool in pools:
        pool.events = collector
    return ZmqEventPublisher(config, collector, data_parallel_rank)


__all__ = [
    "NullEventPublisher",
    "ZmqEventPublisher",
    "attach_kv_events",
    "curve_keys",
    "offset_endpoint_port",
    "secure_subscriber",
]
