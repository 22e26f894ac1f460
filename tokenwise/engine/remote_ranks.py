"""The front end's side of data parallelism across hosts: the ranks that run elsewhere.

A front end started with `data_parallel_size_local < data_parallel_size` runs ranks
[0, size_local) itself (rank 0 hosts the DP rendezvous) and waits for the others, started on
other hosts by `tokenwise serve --headless`, to connect. Each remote core dials the front end's
RPC port (`data_parallel_master_ip:data_parallel_rpc_port`) with a ZeroMQ DEALER whose routing
id names its rank, says `CoreHello`, and is answered `Welcome`: where to connect for its
requests (one PUSH socket per remote rank, as the local cores have over IPC) and for its outputs
(the same PULL socket the local cores push to, also bound on TCP), and the DP rendezvous port.
From then on a remote rank is routed to like a local one.

Each remote rank's request socket has exactly one peer, that rank, so it is also how a lost
host is noticed: a monitor on it reports when the connection breaks (the host's process died
and its kernel closed the socket), and ZeroMQ's own heartbeats on it, answered by the I/O
threads (never held up by a long step), close a connection whose host stopped answering.
`poll()` turns either into the lost rank, which the client names with its host and address.

Anyone who reaches these ports could pose as a rank (and be handed prompts) or push forged
outputs, so beyond loopback they require the shared secret `TOKENWISE_CLUSTER_SECRET`: every
TCP socket of both ends speaks CurveZMQ with keys derived from it (`distributed.curve_auth`),
a peer without it is refused and logged, and a front end or headless host asked to use an
address beyond loopback without the secret refuses to start (`cluster_secret`).
"""

from __future__ import annotations

import socket

import zmq
from zmq.utils.monitor import recv_monitor_message

from tokenwise import envs
from tokenwise.config import EngineConfig, ParallelConfig
from tokenwise.distributed.curve_auth import HANDSHAKE_FAILED, CurveServer
from tokenwise.distributed.rendezvous import SECRET_ENV
from tokenwise.engine import core_messages as msg
from tokenwise.kv_cache.events_config import is_loopback

ENV_READY_TIMEOUT = "TOKENWISE_ENGINE_READY_TIMEOUT_S"  # vLLM's VLLM_ENGINE_READY_TIMEOUT_S
DEFAULT_READY_TIMEOUT_S = 600.0  # every core loads the model; big checkpoints take minutes
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 10_000  # a host that answers no ping for this long is lost
#: The key-derivation domain of the engine-core sockets: not the KV events' (a router that may
#: read events must not be able to pose as a rank).
CURVE_DOMAIN = "tokenwise-engine-core"


def engine_ready_timeout_s() -> float:
    """How long start-up waits for every rank (local ones loading, remote ones connecting and
    loading), and a headless core for the front end's answer."""
    text = envs.get(ENV_READY_TIMEOUT).strip()
    if not text:
        return DEFAULT_READY_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{ENV_READY_TIMEOUT} must be a number of seconds > 0, got {text!r}")
    return value


def rank_identity(rank: int) -> bytes:
    return f"dp-rank-{rank}".encode()


def model_signature(config: EngineConfig) -> str:
    """What both ends must agree on to serve one model (a headless host loads its own copy)."""
    model = config.model
    hf = model.hf_config
    return (
        f"{','.join(model.architectures)} dtype={model.dtype} vocab={hf.vocab_size} "
        f"layers={getattr(hf, 'num_hidden_layers', '?')} hidden={getattr(hf, 'hidden_size', '?')}"
        f" max_model_len={model.max_model_len} expert_parallel="
        f"{config.parallel.enable_expert_parallel}"
    )


def cluster_secret(address: str, what: str) -> str | None:
    """The shared secret of the engine's TCP sockets, None when unset; refuses an `address`
    beyond loopback without it (`what` names the setting that chose the address)."""
    secret = envs.get(SECRET_ENV) or None
    if secret is None:
        try:
            host = socket.gethostbyname(address)
        except OSError:
            host = address  # not resolvable: refused below, the caller names it later
        if not is_loopback(host):
            raise ValueError(
                f"{what} {address!r} is reachable beyond loopback, which needs a shared secret: "
                f"set {SECRET_ENV} to the same value on every host (the engine's sockets then "
                "admit only peers holding it, see docs/cluster.md), or use 127.0.0.1"
            )
    return secret


def rpc_endpoint(parallel: ParallelConfig) -> str:
    return f"{parallel.data_parallel_master_ip}:{parallel.data_parallel_rpc_port}"


class RemoteRanks:
    """The sockets and the bookkeeping of ranks [local_dp_size, data_parallel_size)."""

    def __init__(
        self,
        context: zmq.Context,
        config: EngineConfig,
        outbox: zmq.Socket,
        master_port: int,
    ) -> None:
        parallel = config.parallel
        self.first, self.size = parallel.local_dp_size, parallel.data_parallel_size
        self.endpoint = rpc_endpoint(parallel)
        self._signature = model_signature(config)
        self._master_port = master_port
        address = parallel.data_parallel_master_ip
        secret = cluster_secret(address, "data_parallel_address")
        try:
            host = socket.gethostbyname(address)
        except OSError as exc:
            raise ValueError(f"data_parallel_address {address!r} does not resolve: {exc}") from None
        self._router = context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        # A second core claiming a rank still in its handshake gets the answer (a refusal),
        # instead of ZeroMQ silently ignoring a duplicate routing id.
        self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.sockets: list[zmq.Socket] = [self._router]
        self.inboxes: dict[int, zmq.Socket] = {}
        self._monitors: dict[int, zmq.Socket] = {}
        self._input_address: dict[int, str] = {}
        self._curve: CurveServer | None = None
        try:
            if secret is not None:
                self._curve = CurveServer(context, secret, CURVE_DOMAIN, "data parallel", "rank")
                self._curve.secure(self._router)
                self._curve.secure(outbox)  # its IPC endpoint, bound already, stays plain
            self._bind(context, parallel, host, address, outbox)
        except BaseException:
            self.close()
            raise
        self.hosts: dict[int, tuple[str, int]] = {}  # rank -> (host, pid), once it said hello
        self.lost: list[int] = []  # ranks whose connection broke, in the order noticed
        self._refused: dict[int, str] = {}

    def _bind(
        self,
        context: zmq.Context,
        parallel: ParallelConfig,
        host: str,
        address: str,
        outbox: zmq.Socket,
    ) -> None:
        try:
            self._router.bind(f"tcp://{host}:{parallel.data_parallel_rpc_port}")
        except zmq.ZMQError as exc:
            raise ValueError(
                f"data_parallel_rpc_port {parallel.data_parallel_rpc_port}: cannot listen on "
                f"{host} ({exc}); pick a free port"
            ) from None
        self.output_address = f"tcp://{address}:{outbox.bind_to_random_port(f'tcp://{host}')}"
        for rank in range(self.first, self.size):
            sock = context.socket(zmq.PUSH)
            self.sockets.append(sock)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)  # never block or drop a request: queue it
            sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
            if self._curve is not None:
                self._curve.secure(sock, watch=False)  # one monitor per socket: the one below
            events = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED
            self._monitors[rank] = sock.get_monitor_socket(events)
            self.sockets.append(self._monitors[rank])
            port = sock.bind_to_random_port(f"tcp://{host}")
            self.inboxes[rank] = sock
            self._input_address[rank] = f"tcp://{address}:{port}"

    def poll(self) -> int | None:
        """Answer new cores and notice broken connections; the first lost rank, or None."""
        while True:
            try:
                identity, frame = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                hello = msg.decode_hello(frame)
            except Exception:  # noqa: BLE001 - a stranger on the port: not a core, ignored
                continue
            self._greet(identity, hello)
        for rank, monitor in self._monitors.items():
            while monitor.poll(0):
                message = recv_monitor_message(monitor)
                event = message["event"]
                welcomed = rank in self.hosts
                if event & HANDSHAKE_FAILED and self._curve is not None:
                    self._curve.refused(message)
                elif event == zmq.EVENT_DISCONNECTED and welcomed and rank not in self.lost:
                    self.lost.append(rank)
        if self._curve is not None:
            self._curve.log_refusals()
        return self.lost[0] if self.lost else None

    def _greet(self, identity: bytes, hello: msg.CoreHello) -> None:
        rank = hello.rank
        error = None
        if hello.data_parallel_size != self.size:
            error = (
                f"data_parallel_size is {hello.data_parallel_size} on host {hello.host} but "
                f"{self.size} on the front end"
            )
        elif not self.first <= rank < self.size:
            error = (
                f"rank {rank} is not one the front end waits for (it runs ranks "
                f"[0, {self.first}) and waits for [{self.first}, {self.size}))"
            )
        elif rank in self.hosts:
            error = f"rank {rank} is already connected from host {self.hosts[rank][0]}"
        elif hello.model != self._signature:
            error = f"the model differs: {hello.model!r} there, {self._signature!r} here"
        if error is not None:
            self._refused[rank] = error
            reply = msg.Welcome(error=f"the front end at {self.endpoint} refused: {error}")
        else:
            self.hosts[rank] = (hello.host, hello.pid)
            self._refused.pop(rank, None)
            reply = msg.Welcome(self._input_address[rank], self.output_address, self._master_port)
        self._router.send_multipart([identity, msg.encode(reply)])

    def describe(self, rank: int) -> str:
        """The rank with where it runs, and how it was lost if it was."""
        host, pid = self.hosts.get(rank, ("?", 0))
        text = f"data-parallel rank {rank} on host {host} (pid {pid})"
        if rank in self.lost:
            text += f" lost its connection to the front end at {self.endpoint}"
        return text

    def describe_missing(self, ready: set[int], timeout_s: float) -> str:
        """Why start-up gave up: the ranks that never connected, and those that did but were
        not ready (still loading, or failed) in time."""
        never = [r for r in range(self.first, self.size) if r not in self.hosts]
        slow = [r for r in self.hosts if r not in ready]
        parts = []
        if never:
            parts.append(
                f"data-parallel rank(s) {never} never connected to the front end at "
                f"{self.endpoint} within {timeout_s:g} s (start them on their host with "
                f"`tokenwise serve MODEL --headless --data-parallel-size {self.size} "
                f"--data-parallel-start-rank R --data-parallel-address ADDRESS "
                f"--data-parallel-rpc-port PORT`)"
            )
            refused = [f"rank {r}: {self._refused[r]}" for r in never if r in self._refused]
            if refused:
                parts.append("refused: " + "; ".join(refused))
        if slow:
            where = ", ".join(f"rank {r} on {self.hosts[r][0]}" for r in sorted(slow))
            parts.append(f"connected but not ready within {timeout_s:g} s: {where}")
        return "; ".join(parts)

    def close(self) -> None:
        if self._curve is not None:
            self._curve.close()
        for sock in self.sockets:
            sock.close(linger=0)
