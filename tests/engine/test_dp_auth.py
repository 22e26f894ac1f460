"""Closed ports for data parallelism across hosts, without engines: this test plays the peers.

Beyond loopback the front end's sockets exist only with `TOKENWISE_CLUSTER_SECRET` set (start-up
refuses otherwise, naming the variable); with it, a peer lacking the secret can neither join as
a rank (and so be handed prompts), nor push outputs, nor pull a rank's requests, while a peer
holding it is welcomed and served. The DP rendezvous store listens on its address only, not
on every interface as torch's own store does.
"""

from __future__ import annotations

import logging
import re
import subprocess
import time
from datetime import timedelta

import pytest
import zmq

from tests.engine._fixtures import LLAMA, checkpoint
from tokenwise.distributed.curve_auth import secure_client
from tokenwise.distributed.rendezvous import open_store
from tokenwise.distributed.tp_state import free_port
from tokenwise.engine import core_messages as msg
from tokenwise.engine.remote_ranks import (
    CURVE_DOMAIN,
    SECRET_ENV,
    RemoteRanks,
    model_signature,
    rank_identity,
)
from tokenwise.entrypoints import cli
from tokenwise.entrypoints.llm import build_engine_config

SECRET = "correct horse battery staple"
FAR_ADDRESS = "192.0.2.7"  # TEST-NET-1: beyond loopback, never reached (refused before binding)


def _config(port: int, address: str = "127.0.0.1"):
    return build_engine_config(
        checkpoint(LLAMA),
        dtype="float32",
        data_parallel_size=2,
        data_parallel_size_local=1,
        data_parallel_rpc_port=port,
        data_parallel_address=address,
    )


def test_front_end_beyond_loopback_without_the_secret_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    ctx = zmq.Context()
    outbox = ctx.socket(zmq.PULL)
    try:
        with pytest.raises(
            ValueError, match=f"data_parallel_address '{FAR_ADDRESS}'.*{SECRET_ENV}"
        ):
            RemoteRanks(ctx, _config(free_port(), FAR_ADDRESS), outbox, master_port=1)
    finally:
        outbox.close(linger=0)
        ctx.term()


def test_headless_host_beyond_loopback_without_the_secret_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    argv = ["serve", checkpoint(LLAMA), "--headless", "--data-parallel-size", "2"]
    argv += ["--data-parallel-start-rank", "1", "--data-parallel-address", FAR_ADDRESS]
    assert cli.main(argv) == 2
    assert re.search(
        f"--data-parallel-address '{FAR_ADDRESS}'.*set {SECRET_ENV}", capsys.readouterr().err
    )


class _Peer:
    """Sockets a remote core (or a stranger) opens, with the secret it believes in."""

    def __init__(self, ctx: zmq.Context, secret: str | None) -> None:
        self.ctx, self.secret = ctx, secret
        self.sockets: list[zmq.Socket] = []

    def socket(self, kind: int) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.linger = 0
        if self.secret is not None:
            secure_client(sock, self.secret, CURVE_DOMAIN)
        self.sockets.append(sock)
        return sock

    def hello(
        self, remote: RemoteRanks, port: int, model: str, wait_s: float
    ) -> msg.Welcome | None:
        dealer = self.socket(zmq.DEALER)
        dealer.setsockopt(zmq.ROUTING_ID, rank_identity(1))
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send(msg.encode(msg.CoreHello(1, 2, "host-x", 7, model)), zmq.NOBLOCK)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            remote.poll()
            if dealer.poll(20):
                return msg.decode_welcome(dealer.recv())
        return None


def test_with_the_secret_only_peers_holding_it_join_push_or_pull(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(SECRET_ENV, SECRET)
    caplog.set_level(logging.WARNING)
    port = free_port()
    config = _config(port)
    ctx = zmq.Context()
    outbox = ctx.socket(zmq.PULL)
    outbox.bind(f"ipc:///tmp/tokenwise-auth-{port}")  # a local core's plain endpoint, as in use
    remote = RemoteRanks(ctx, config, outbox, master_port=12345)
    model = model_signature(config)
    strangers = [_Peer(ctx, None), _Peer(ctx, "a guess")]
    core = _Peer(ctx, SECRET)
    try:
        for stranger in strangers:  # cannot pose as rank 1: no welcome, ever
            assert stranger.hello(remote, port, model, wait_s=1.0) is None
        assert "data parallel: refused a rank" in caplog.text
        welcome = core.hello(remote, port, model, wait_s=10.0)
        assert welcome is not None and welcome.error is None
        # Outputs: the forged "rank 1 is dead" of a stranger never arrives; the core's does.
        for peer in (*strangers, core):
            push = peer.socket(zmq.PUSH)
            push.connect(welcome.output_address)
            push.send(msg.encode(msg.CoreDead(1, f"from {peer.secret}", "X")), zmq.NOBLOCK)
        assert outbox.poll(5000)
        assert msg.decode_from_core(outbox.recv()).message == f"from {SECRET}"
        assert not outbox.poll(500)
        # A local core on the IPC endpoint needs no secret.
        local = ctx.socket(zmq.PUSH)
        core.sockets.append(local)
        local.connect(f"ipc:///tmp/tokenwise-auth-{port}")
        local.send(msg.encode(msg.CoreDead(0, "local", "X")))
        assert outbox.poll(5000) and msg.decode_from_core(outbox.recv()).message == "local"
        # Requests for rank 1 go to the core only, not to strangers pulling on its port.
        pulls = []
        for peer in (*strangers, core):
            pull = peer.socket(zmq.PULL)
            pull.connect(welcome.input_address)
            pulls.append(pull)
        time.sleep(0.5)  # let the handshakes finish (or fail) before sending
        for _ in range(4):
            remote.inboxes[1].send(msg.encode(msg.StopCore()))
        got = 0
        deadline = time.monotonic() + 5
        while got < 4 and time.monotonic() < deadline:
            if pulls[-1].poll(50):
                pulls[-1].recv()
                got += 1
        assert got == 4
        assert not any(pull.poll(0) for pull in pulls[:-1])
    finally:
        for peer in (*strangers, core):
            for sock in peer.sockets:
                sock.close(linger=0)
        remote.close()
        outbox.close(linger=0)
        ctx.term()


def _listening(port: int) -> list[str]:
    out = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True)
    return [line.split()[3] for line in out.stdout.splitlines()]


def test_the_rendezvous_store_listens_on_its_address_only() -> None:
    port = free_port()
    store = open_store("127.0.0.1", port, 2, True, timedelta(seconds=5))
    client = open_store("127.0.0.1", port, 2, False, timedelta(seconds=5))
    client.set("k", "v")
    assert store.get("k") == b"v"
    assert _listening(port) == [f"127.0.0.1:{port}"]  # torch's own: "*:port"
