"""The ZeroMQ endpoints of an `EngineCoreClient`, and stopping the cores behind them.

One PULL socket receives every core's outputs (local cores over IPC; with ranks on other hosts
it is also bound on TCP, `remote_ranks`), one PUSH socket per core carries its requests, a
REQ socket asks core 0 questions (`CheckLoRA`), and an in-process PAIR lets any thread end a
`step()` that is waiting. Kept apart from the client so that its finalizer can stop the cores
and close all of this without holding the client itself.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Any

import zmq

from tokenwise.config import EngineConfig
from tokenwise.engine import core_messages as msg
from tokenwise.engine.remote_ranks import RemoteRanks

STOP_TIMEOUT_S = 10.0


class CoreSockets:
    def __init__(self, config: EngineConfig, owner: int) -> None:
        parallel = config.parallel
        num_local = parallel.local_dp_size
        self.dir = tempfile.mkdtemp(prefix="tokenwise-core-")
        self.context = zmq.Context()
        self.out_address = f"ipc://{self.dir}/out"
        self.outbox = self.context.socket(zmq.PULL)
        self.outbox.setsockopt(zmq.LINGER, 0)
        self.outbox.bind(self.out_address)
        # `wakeup()` may come from any thread; a ZeroMQ socket is not thread-safe, so its end
        # is used under the client's lock, and the end that step() polls only by step().
        self.wake_tx = self.context.socket(zmq.PAIR)
        self.wake_rx = self.context.socket(zmq.PAIR)
        self.wake_rx.bind(f"inproc://wake-{owner}")
        self.wake_tx.connect(f"inproc://wake-{owner}")
        self.poller = zmq.Poller()
        self.poller.register(self.outbox, zmq.POLLIN)
        self.poller.register(self.wake_rx, zmq.POLLIN)
        # Core 0's request-reply socket, for questions the caller needs answered now.
        self.control = self.context.socket(zmq.REQ)
        self.control.setsockopt(zmq.LINGER, 0)
        self.control.bind(f"ipc://{self.dir}/control")
        self.inboxes: list[zmq.Socket] = []
        self._sockets = [self.outbox, self.wake_tx, self.wake_rx, self.control]
        for rank in range(num_local):
            sock = self.context.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)  # never block or drop a request: queue it
            sock.bind(self.input_address(rank))
            self.inboxes.append(sock)
            self._sockets.append(sock)
        # Ranks on other hosts connect over TCP and are routed to like the local ones.
        self.remote: RemoteRanks | None = None
        if parallel.spans_hosts:
            try:
                self.remote = RemoteRanks(
                    self.context, config, self.outbox, parallel.data_parallel_master_port
                )
            except BaseException:
                self.close()
                raise
            self._sockets += self.remote.sockets
            size = parallel.data_parallel_size
            self.inboxes += [self.remote.inboxes[r] for r in range(num_local, size)]

    def input_address(self, rank: int) -> str:
        return f"ipc://{self.dir}/in{rank}"

    def control_address(self, rank: int) -> str:
        """Only core 0 answers questions (every core holds the same model); the others'
        sockets are never asked."""
        return f"ipc://{self.dir}/control" if rank == 0 else f"inproc://none-{rank}"

    def close(self) -> None:
        if self.remote is not None:
            self.remote.close()  # first: its authenticator holds a socket of this context
        for sock in self._sockets:
            sock.close(linger=0)
        self.context.term()
        if os.path.isdir(self.dir):
            shutil.rmtree(self.dir, ignore_errors=True)


def stop_cores(procs: list[Any], io: CoreSockets) -> None:
    """Ask every core to stop, then make sure: a core stuck in a collective is terminated."""
    for inbox in io.inboxes:
        try:
            inbox.send(msg.encode(msg.StopCore()), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=STOP_TIMEOUT_S)
    release = getattr(procs, "release", None)  # Ray's cores: their actors and placement group
    if release is not None:
        release()
    io.close()
