"""An engine core on a host without the front end (`tokenwise serve --headless`).

It is the same core as a local one (`core_process.serve_engine_core`); only how it finds its
client differs. Instead of inheriting IPC addresses from a parent, it dials the front end's RPC
port, introduces itself (`CoreHello`: rank, host, pid, the model it loaded) and waits, for at
most the ready timeout, for `Welcome`: its request and output addresses over TCP and the DP
rendezvous port (chosen by the front end, so a headless host needs no `--data-parallel-port`).

Its parent is the headless launcher, not the front end, so the front end's death is noticed on
its request connection: ZeroMQ heartbeats run on it both ways, and when it breaks (the front
end exited, its host died) the core stops instead of waiting for requests forever. The
handshake connection is closed once answered. With `TOKENWISE_CLUSTER_SECRET` set, each of its
connections speaks CurveZMQ with the keys derived from it (`remote_ranks`); without it, only a
front end on loopback is reached.
"""

from __future__ import annotations

import logging
import os
import socket

import zmq

from tokenwise.config import EngineConfig
from tokenwise.distributed.curve_auth import secure_client
from tokenwise.engine import core_messages as msg
from tokenwise.engine.core_process import serve_engine_core
from tokenwise.engine.remote_ranks import (
    CURVE_DOMAIN,
    HEARTBEAT_IVL_MS,
    HEARTBEAT_TIMEOUT_MS,
    cluster_secret,
    model_signature,
    rank_identity,
    rpc_endpoint,
)

logger = logging.getLogger("tokenwise.engine")


def run_remote_engine_core(config: EngineConfig, rank: int, ready_timeout_s: float) -> None:
    """Process entry point of one rank of a headless host."""
    parallel = config.parallel
    prefix = f"[DP rank {rank}]"
    logging.basicConfig(level=logging.INFO, format=f"{prefix} %(levelname)s %(message)s")
    endpoint = rpc_endpoint(parallel)
    secret = cluster_secret(parallel.data_parallel_master_ip, "--data-parallel-address")
    context = zmq.Context()

    def secure(sock: zmq.Socket) -> zmq.Socket:
        if secret is not None:
            secure_client(sock, secret, CURVE_DOMAIN)
        return sock

    link = secure(context.socket(zmq.DEALER))
    link.setsockopt(zmq.LINGER, 0)
    link.setsockopt(zmq.ROUTING_ID, rank_identity(rank))
    sockets = [link]
    try:
        link.connect(f"tcp://{endpoint}")
        hello = msg.CoreHello(
            rank,
            parallel.data_parallel_size,
            socket.gethostname(),
            os.getpid(),
            model_signature(config),
        )
        link.send(msg.encode(hello))
        # The front end may start after this host: the connection is retried until then.
        if not link.poll(int(ready_timeout_s * 1000)):
            raise SystemExit(
                f"{prefix} the front end at {endpoint} did not answer within "
                f"{ready_timeout_s:g} s (is `tokenwise serve` running there with "
                f"--data-parallel-rpc-port {parallel.data_parallel_rpc_port}, and the same "
                "TOKENWISE_CLUSTER_SECRET as this host?)"
            )
        welcome = msg.decode_welcome(link.recv())
        if welcome.error is not None:
            raise SystemExit(f"{prefix} {welcome.error}")
        parallel.data_parallel_master_port = welcome.master_port
        logger.info("connected to the front end at %s", endpoint)
        link.close(linger=0)  # the request socket below is the lasting connection
        outbox = secure(context.socket(zmq.PUSH))
        outbox.setsockopt(zmq.LINGER, 2000)  # the last words (outputs, "dead") must get out
        outbox.connect(welcome.output_address)
        inbox = secure(context.socket(zmq.PULL))
        inbox.setsockopt(zmq.LINGER, 0)
        inbox.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        inbox.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        monitor = inbox.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sockets.append(monitor)
        inbox.connect(welcome.input_address)
        control = context.socket(zmq.REP)  # only rank 0, beside the front end, is asked
        control.setsockopt(zmq.LINGER, 0)
        control.bind(f"inproc://none-{rank}")

        lost: list[bool] = []

        def front_end_lost() -> bool:
            if monitor.poll(0):  # the one event it watches: a broken connection
                lost.append(True)
            return bool(lost)

        serve_engine_core(config, rank, inbox, outbox, control, front_end_lost)
        if lost:  # not stopped by the front end: a supervisor should know
            raise SystemExit(f"{prefix} lost the front end at {endpoint}; stopped")
    finally:
        for sock in sockets:
            sock.close(linger=0)
        context.term()
