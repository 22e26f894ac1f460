"""CurveZMQ from one shared secret: how tokenwise's TCP sockets refuse strangers.

Every ZeroMQ socket tokenwise binds beyond loopback (the KV-event publisher, the front end's
data-parallel sockets) speaks CurveZMQ, and both key pairs come from a shared secret (an
environment variable, so it is not on a command line): the listening end's pair and the one
client pair it admits. A deployment then distributes one string instead of key files, and a
peer without it fails the handshake (it does not know the server's public key) or, knowing
that, is refused by the ZAP callback (it does not hold the admitted client key).

`domain` separates the uses: the KV-event subscribers (cluster routers, which only read) and
the engine-core peers (which run work) get different keys even from the same string, so a
router's secret never lets it pose as an engine rank.

Refusals are logged: a handshake that fails before ZAP is only visible on a socket monitor,
which :class:`CurveServer` opens per socket (or the caller folds :data:`HANDSHAKE_FAILED`
into a monitor it already has, a socket holding one monitor at most) and
:meth:`CurveServer.log_refusals` drains from whatever loop owns the sockets.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any

import zmq
import zmq.auth.thread
import zmq.utils.monitor
from zmq.utils import z85

logger = logging.getLogger(__name__)

#: A refused peer retries (ZeroMQ reconnects every 100 ms): one log line per listening endpoint
#: per this many seconds (`num_refused` counts them all).
LOG_EVERY_S = 30.0

#: The monitor events of a peer refused during the CurveZMQ handshake.
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


def curve_keys(secret: str, domain: str) -> dict[str, bytes]:
    """The Z85 keys both ends derive from `secret` for `domain`: the server's pair
    (`server_public`, `server_secret`) and the admitted client's (`client_public`,
    `client_secret`)."""
    if not secret:
        raise ValueError(f"{domain}: the shared secret is empty")
    keys = {}
    for role in ("server", "client"):
        raw = hashlib.sha256(f"{domain}/{role}\0{secret}".encode()).digest()
        secret_key = z85.encode(raw)
        keys[f"{role}_secret"] = secret_key
        keys[f"{role}_public"] = zmq.curve_public(secret_key)
    return keys


def secure_client(sock: zmq.Socket, secret: str, domain: str) -> None:
    """Set a socket that connects (before `connect`) to talk to a server holding `secret`."""
    keys = curve_keys(secret, domain)
    sock.curve_serverkey = keys["server_public"]
    sock.curve_publickey = keys["client_public"]
    sock.curve_secretkey = keys["client_secret"]


class _AdmitOne:
    """ZAP callback: admit only the client key derived from the secret; log the rest."""

    def __init__(self, client_public: bytes, what: str, peer: str) -> None:
        self.client_public = client_public
        self.what, self.peer = what, peer

    def callback(self, domain: str, key: bytes) -> bool:
        if key == self.client_public:
            return True
        logger.warning(
            "%s: refused a %s whose key is not the shared secret's", self.what, self.peer
        )
        return False


class CurveServer:
    """The listening side for every socket of one context: a ZAP authenticator (it serves a
    whole context, so a context holds one) and each secured socket's refusal monitor.

    Options are taken by libzmq when an endpoint is bound, so a socket bound on IPC before
    :meth:`secure` keeps that endpoint plain (local peers, guarded by the directory's
    permissions) while its later TCP endpoints require the secret; the authenticator lets
    such plain (NULL mechanism) peers through.
    """

    def __init__(
        self, context: zmq.Context, secret: str, domain: str, what: str, peer: str = "peer"
    ) -> None:
        """`what` (the sockets' purpose) and `peer` (what connects) word the log lines."""
        self.what, self.peer = what, peer
        self._keys = curve_keys(secret, domain)
        self._monitors: list[tuple[zmq.Socket, zmq.Socket]] = []
        self._last_logged: dict[str, float] = {}  # endpoint -> when its refusal was logged
        self.num_refused = 0
        self._auth: Any = zmq.auth.thread.ThreadAuthenticator(context)
        self._auth.start()
        self._auth.configure_curve_callback("*", _AdmitOne(self._keys["client_public"], what, peer))

    def secure(self, sock: zmq.Socket, watch: bool = True) -> None:
        """Make `sock`'s next binds CurveZMQ servers. `watch=False`: the caller already
        monitors the socket and passes its `HANDSHAKE_FAILED` events to :meth:`refused`."""
        sock.curve_server = True
        sock.curve_secretkey = self._keys["server_secret"]
        sock.curve_publickey = self._keys["server_public"]
        if watch:
            self._monitors.append((sock, sock.get_monitor_socket(HANDSHAKE_FAILED)))

    def refused(self, event: dict[str, Any]) -> None:
        """Count a refusal from a monitor `event`; log it unless its endpoint's was recent."""
        self.num_refused += 1
        endpoint = event["endpoint"].decode(errors="replace")
        now = time.monotonic()
        if now - self._last_logged.get(endpoint, -LOG_EVERY_S) < LOG_EVERY_S:
            return
        self._last_logged[endpoint] = now
        logger.warning(
            "%s: refused a %s at %s without the shared secret (CurveZMQ handshake failed, code %s)",
            self.what,
            self.peer,
            endpoint,
            event["value"],
        )

    def log_refusals(self) -> int:
        """Log every refusal the monitors saw since the last call; how many there were."""
        count = 0
        for _, monitor in self._monitors:
            while monitor.poll(0):
                self.refused(zmq.utils.monitor.recv_monitor_message(monitor))
                count += 1
        return count

    def close(self) -> None:
        """Stop the monitors and the authenticator (before the sockets' context ends)."""
        for sock, monitor in self._monitors:
            if not sock.closed:
                sock.disable_monitor()
            monitor.close(linger=0)
        self._monitors.clear()
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


__all__ = ["HANDSHAKE_FAILED", "CurveServer", "curve_keys", "secure_client"]
