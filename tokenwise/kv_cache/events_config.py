"""`--kv-events-config`: whether and where the engine publishes KV-cache events.

vLLM's option, spelled as vLLM spells it: a JSON object with `enable_kv_cache_events`,
`publisher` ("zmq" or "null"), `endpoint`, `replay_endpoint`, `topic`, `buffer_steps` and
`hwm`. One default differs, on purpose: the endpoint binds loopback (`tcp://127.0.0.1:5557`,
vLLM binds `tcp://*:5557`), because nothing tokenwise runs listens beyond loopback without a
shared secret. To publish on another interface, set the secret in the environment variable
named by :data:`SECRET_ENV` (the sockets then speak CurveZMQ with keys derived from it, see
`tokenwise.distributed.kv_events`); without it such an endpoint is refused here, at start-up.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass, fields
from typing import Any

from tokenwise import envs

#: The environment variable holding the shared secret of non-loopback KV-event sockets. An
#: environment variable rather than a field, so that the secret is not on the command line.
SECRET_ENV = "TOKENWISE_KV_EVENTS_SECRET"

PUBLISHERS = ("null", "zmq")


def endpoint_host(endpoint: str) -> str | None:
    """The host part of a `tcp://host:port` endpoint; None for ipc:// and inproc://."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return None
    if not endpoint.startswith("tcp://") or ":" not in endpoint[6:]:
        raise ValueError(
            f"kv_events_config endpoint {endpoint!r} must be tcp://HOST:PORT, ipc://PATH or "
            "inproc://NAME"
        )
    host, _, port = endpoint[6:].rpartition(":")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"kv_events_config endpoint {endpoint!r} has no valid port (1-65535)")
    return host.strip("[]")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*", an interface or host name: reachable from elsewhere
        return False


@dataclass
class KVEventsConfig:
    """Where KV-cache events go; see the module docstring for the fields' JSON spelling."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # None: "zmq" when events are enabled, else "null"
    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # ZeroMQ high-water mark of the PUB socket
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in PUBLISHERS:
            raise ValueError(
                f"kv_events_config publisher must be one of {', '.join(PUBLISHERS)}, "
                f"got {self.publisher!r}"
            )
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"kv_events_config {name} must be an integer >= 1, got {value!r}")
        if not self.active:
            return
        for name in ("endpoint", "replay_endpoint"):
            endpoint = getattr(self, name)
            if endpoint is None:
                continue
            host = endpoint_host(endpoint)
            if host is not None and not is_loopback(host) and not self.secret:
                raise ValueError(
                    f"kv_events_config {name} {endpoint!r} listens beyond loopback, which needs "
                    f"a shared secret: set {SECRET_ENV} (subscribers then use the same secret, "
                    "see docs/serving.md), or bind tcp://127.0.0.1:PORT"
                )

    @property
    def active(self) -> bool:
        """Whether events are collected and sent anywhere."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @property
    def secret(self) -> str | None:
        return envs.get(SECRET_ENV) or None

    @classmethod
    def from_cli(cls, value: str | dict[str, Any] | KVEventsConfig) -> KVEventsConfig:
        """From `--kv-events-config`'s JSON (or a dict / a config, for `LLM(...)`)."""
        if isinstance(value, KVEventsConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"kv_events_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"kv_events_config must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"kv_events_config has unknown field(s) {', '.join(unknown)}; known: "
                f"{', '.join(sorted(known))}"
            )
        return cls(**value)


__all__ = ["SECRET_ENV", "KVEventsConfig", "endpoint_host", "is_loopback"]
