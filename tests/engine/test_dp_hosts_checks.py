"""Data parallelism across hosts without engines: the flags' checks and the front end's side
of the handshake, with this test playing the remote core over real sockets.

A layout that cannot work must be refused before anything starts, naming the flag; a core that
does not match the front end (another DP size, a rank it does not wait for, another model, a
rank already taken) must be refused with the reason, which start-up's timeout error repeats;
and a welcomed core whose connection breaks must be reported as lost, with its host and pid.
"""

from __future__ import annotations

import re
import time

import pytest
import zmq

from tests.engine._fixtures import LLAMA, checkpoint
from tokenwise import LLM
from tokenwise.config import ParallelConfig
from tokenwise.distributed.tp_state import free_port
from tokenwise.engine import core_messages as msg
from tokenwise.engine.remote_ranks import (
    RemoteRanks,
    engine_ready_timeout_s,
    model_signature,
    rank_identity,
)
from tokenwise.entrypoints import cli
from tokenwise.entrypoints.llm import build_engine_config


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"data_parallel_start_rank": 1, "data_parallel_size_local": 2},
            r"data_parallel_start_rank \(1\) \+ data_parallel_size_local \(2\) must be <= "
            r"data_parallel_size \(2\)",
        ),
        ({"data_parallel_start_rank": 2}, r"data_parallel_start_rank \(2\)"),
        ({"data_parallel_size_local": 0}, "data_parallel_size_local must be an integer >= 1"),
        ({"data_parallel_start_rank": -1}, "data_parallel_start_rank must be an integer >= 0"),
        ({"data_parallel_rpc_port": 70000}, r"data_parallel_rpc_port must be in \[1, 65535\]"),
    ],
)
def test_impossible_layouts_are_refused_naming_the_setting(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ParallelConfig(data_parallel_size=2, **kwargs)


def test_default_layout_is_every_rank_on_this_host() -> None:
    assert not ParallelConfig(data_parallel_size=4).spans_hosts
    headless = ParallelConfig(data_parallel_size=4, data_parallel_start_rank=2)
    assert headless.local_dp_size == 2 and headless.spans_hosts


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (["--data-parallel-start-rank", "1"], "--headless needs --data-parallel-address"),
        (
            ["--data-parallel-address", "127.0.0.1"],
            r"--headless needs --data-parallel-start-rank >= 1 .*got 0",
        ),
        (
            ["--data-parallel-address", "127.0.0.1", "--data-parallel-start-rank", "1"]
            + ["--data-parallel-size-local", "2"],
            r"data_parallel_start_rank \(1\) \+ data_parallel_size_local \(2\) must be <=",
        ),
        (
            ["--data-parallel-address", "127.0.0.1", "--data-parallel-start-rank", "1"]
            + ["--tensor-parallel-size", "2"],
            "tensor_parallel_size must be 1 when data-parallel ranks span hosts",
        ),
    ],
    ids=["no-address", "start-rank-0", "too-many-ranks", "tp"],
)
def test_headless_flags_are_checked_before_anything_starts(
    flags: list[str], match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["serve", checkpoint(LLAMA), "--headless", "--data-parallel-size", "2", *flags]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert re.search(match, err), err


def test_front_end_must_run_rank_0() -> None:
    with pytest.raises(ValueError, match="data_parallel_start_rank must be 0 where the front end"):
        LLM(
            checkpoint(LLAMA),
            data_parallel_size=2,
            data_parallel_start_rank=1,
            data_parallel_size_local=1,
        )


def test_ready_timeout_must_be_positive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENWISE_ENGINE_READY_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="TOKENWISE_ENGINE_READY_TIMEOUT_S must be"):
        engine_ready_timeout_s()
    monkeypatch.setenv("TOKENWISE_ENGINE_READY_TIMEOUT_S", "2.5")
    assert engine_ready_timeout_s() == 2.5


def test_handshake_refuses_mismatches_welcomes_a_match_and_notices_it_lost() -> None:
    port = free_port()
    config = build_engine_config(
        checkpoint(LLAMA),
        dtype="float32",
        data_parallel_size=2,
        data_parallel_size_local=1,
        data_parallel_rpc_port=port,
    )
    ctx = zmq.Context()
    outbox = ctx.socket(zmq.PULL)
    remote = RemoteRanks(ctx, config, outbox, master_port=12345)
    dealers: list[zmq.Socket] = []
    signature = model_signature(config)

    def hello(rank: int, size: int = 2, model: str = signature) -> msg.Welcome:
        dealer = ctx.socket(zmq.DEALER)
        dealers.append(dealer)
        dealer.setsockopt(zmq.ROUTING_ID, rank_identity(rank))
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send(msg.encode(msg.CoreHello(rank, size, "host-b", 4242, model)))
        deadline = time.monotonic() + 10
        while not dealer.poll(20):
            remote.poll()
            assert time.monotonic() < deadline
        return msg.decode_welcome(dealer.recv())

    try:
        refused = hello(1, size=3).error
        assert "data_parallel_size is 3 on host host-b but 2 on the front end" in refused
        assert f"front end at 127.0.0.1:{port} refused" in refused
        assert "rank 0 is not one the front end waits for" in hello(0).error
        assert "the model differs" in hello(1, model="OtherModel").error
        missing = remote.describe_missing(set(), 5)
        assert f"rank(s) [1] never connected to the front end at 127.0.0.1:{port}" in missing
        assert "the model differs" in missing  # the last refusal is repeated
        welcome = hello(1)
        assert welcome.error is None and welcome.master_port == 12345
        assert welcome.output_address.startswith("tcp://127.0.0.1:")
        assert "already connected from host host-b" in hello(1).error
        assert remote.poll() is None
        # The core's request connection is the one watched: open it, then break it.
        inbox = ctx.socket(zmq.PULL)
        inbox.connect(welcome.input_address)
        remote.inboxes[1].send(msg.encode(msg.StopCore()))
        assert inbox.poll(5000)  # connected and routed
        inbox.close(linger=0)
        deadline = time.monotonic() + 5
        while remote.poll() is None:
            assert time.monotonic() < deadline, "a broken connection was not noticed"
            time.sleep(0.02)
        assert remote.poll() == 1
        assert remote.describe(1) == (
            f"data-parallel rank 1 on host host-b (pid 4242) lost its connection to the front "
            f"end at 127.0.0.1:{port}"
        )
    finally:
        for sock in dealers:
            sock.close(linger=0)
        remote.close()
        outbox.close(linger=0)
        ctx.term()
