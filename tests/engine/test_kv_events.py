"""KV-cache events as a router sees them: a subscriber written against vLLM's published event
schema (the structs below are spelled as vLLM's `kv_events_subscriber` example spells them,
not imported from tokenwise) decodes what the engine sends over ZeroMQ."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
import zmq

from tests.engine._fixtures import LLAMA, checkpoint
from tests.entrypoints._server import free_port
from tokenwise.distributed.kv_events import ZmqEventPublisher, secure_subscriber
from tokenwise.engine.block_manager import BlockManager
from tokenwise.entrypoints.cli import build_parser
from tokenwise.entrypoints.engine_args import build_engine_config, engine_kwargs
from tokenwise.entrypoints.llm import LLM
from tokenwise.kv_cache.events import KVEventCollector
from tokenwise.kv_cache.events_config import SECRET_ENV, KVEventsConfig
from tokenwise.kv_cache.hashing import extend_chain
from tokenwise.sampling.params import SamplingParams


# ---- vLLM's schema, as a subscriber outside tokenwise writes it --------------------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
BS = 16
TOPIC = "kv-events"


def drain(sub: zmq.Socket, until: Any = None, timeout_s: float = 10.0) -> list[tuple[int, Any]]:
    """(seq, batch) received until `until(batches)` holds, or nothing more for 0.3 s."""
    got: list[tuple[int, Any]] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not sub.poll(300 if until is None else 100):
            if until is None or until(got):
                return got
            continue
        topic, seq, payload = sub.recv_multipart()
        assert topic == TOPIC.encode()
        got.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
        if until is not None and until(got):
            return got
    if until is not None:
        raise AssertionError(f"expected events did not arrive within {timeout_s} s: {got}")
    return got


def events_of(got: list[tuple[int, Any]], kind: type) -> list[Any]:
    return [e for _, b in got for e in b.events if isinstance(e, kind)]


# ---- the block manager reports what its pool does ---------------------------------------------


def test_block_manager_reports_stores_evictions_and_reset() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    events = KVEventCollector()
    bm.pool.events = events
    prompt = list(range(10, 20))  # two full blocks and a partial one
    assert bm.allocate_slots("a", prompt, 0, len(prompt)) is not None
    batch = events.take_batch()
    assert batch is not None and len(batch.events) == 1
    stored = batch.events[0]
    chain = extend_chain([], prompt, 2, 4)
    assert stored.block_hashes == chain and stored.parent_block_hash is None
    assert stored.token_ids == prompt[:8] and stored.block_size == 4
    assert events.take_batch() is None  # drained
    bm.free("a")
    # Four fresh blocks: the two uncached go first, then both cached ones are evicted.
    assert bm.allocate_slots("b", list(range(50, 66)), 0, 16) is not None
    batch = events.take_batch()
    removed = [e for e in batch.events if type(e).__name__ == "BlockRemoved"]
    assert [h for e in removed for h in e.block_hashes] == [chain[1], chain[0]]  # tail first
    bm.free("b")
    assert bm.reset_prefix_cache()
    assert [type(e).__name__ for e in events.take_batch().events] == ["AllBlocksCleared"]


def test_later_blocks_name_their_parent() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.pool.events = events = KVEventCollector()
    tokens = list(range(100, 112))
    bm.allocate_slots("r", tokens, 0, 5)  # one full block this step
    bm.allocate_slots("r", tokens, 5, 7)  # two more
    first, second = events.take_batch().events
    chain = extend_chain([], tokens, 3, 4)
    assert first.block_hashes == chain[:1] and second.block_hashes == chain[1:]
    assert second.parent_block_hash == chain[0] and second.token_ids == tokens[4:12]


# ---- configuration and its loopback rule ------------------------------------------------------


def test_config_refuses_non_loopback_without_secret(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    assert KVEventsConfig.from_cli('{"enable_kv_cache_events": true}').endpoint.startswith(
        "tcp://127.0.0.1:"
    )
    with pytest.raises(ValueError, match=f"endpoint 'tcp://\\*:5557'.*{SECRET_ENV}"):
        KVEventsConfig.from_cli('{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}')
    with pytest.raises(ValueError, match="replay_endpoint 'tcp://10.0.0.1:5558'"):
        KVEventsConfig(True, replay_endpoint="tcp://10.0.0.1:5558")
    with pytest.raises(ValueError, match="unknown field.*endpoitn"):
        KVEventsConfig.from_cli('{"endpoitn": "tcp://127.0.0.1:1"}')
    with pytest.raises(ValueError, match="publisher must be one of"):
        KVEventsConfig.from_cli({"enable_kv_cache_events": True, "publisher": "kafka"})
    with pytest.raises(ValueError, match="not valid JSON"):
        KVEventsConfig.from_cli("{enable")
    with pytest.raises(ValueError, match="prefix caching is off"):
        build_engine_config(
            checkpoint(LLAMA),
            enable_prefix_caching=False,
            kv_events_config={"enable_kv_cache_events": True},
        )
    # The CLI spells it as vLLM does; bad JSON is a usage error naming the flag.
    parser = build_parser()
    args = parser.parse_args(["serve", "--kv-events-config", '{"enable_kv_cache_events": true}'])
    assert engine_kwargs(args)["kv_events_config"].active
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--kv-events-config", '{"hwm": 0}'])
    assert "--kv-events-config" in capsys.readouterr().err
    # Disabled events listen nowhere, so any endpoint is accepted; a secret lifts the rule.
    KVEventsConfig(False, endpoint="tcp://*:5557")
    monkeypatch.setenv(SECRET_ENV, "s3cret")
    assert KVEventsConfig(True, endpoint="tcp://*:5557").secret == "s3cret"


def test_secret_admits_only_subscribers_that_hold_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(SECRET_ENV, "shared-secret")
    port = free_port()
    events = KVEventCollector()
    publisher = ZmqEventPublisher(
        KVEventsConfig(True, endpoint=f"tcp://127.0.0.1:{port}", topic=TOPIC), events
    )
    ctx = zmq.Context()
    try:
        subs = {}
        for name, secret in (("right", "shared-secret"), ("wrong", "guess"), ("none", None)):
            sub = ctx.socket(zmq.SUB)
            sub.linger = 0
            if secret is not None:
                secure_subscriber(sub, secret)
            sub.setsockopt_string(zmq.SUBSCRIBE, "")
            sub.connect(f"tcp://127.0.0.1:{port}")
            subs[name] = sub
        time.sleep(0.5)  # PUB drops messages to subscribers still joining
        for i in range(3):
            events.stored([bytes([i])], None, [i], 1)
            publisher.end_step()
        got = drain(subs["right"], until=lambda g: len(g) == 3)
        assert [seq for seq, _ in got] == [0, 1, 2]
        assert not subs["wrong"].poll(300) and not subs["none"].poll(10)
        assert "refused a subscriber" in caplog.text  # the wrong key reached the ZAP check
    finally:
        publisher.shutdown()
        ctx.destroy(linger=0)


# ---- end to end: an engine publishes, a subscriber follows the prefix cache -------------------


@pytest.fixture(scope="module")
def served() -> Any:
    port, replay_port = free_port(), free_port()
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
        "topic": TOPIC,
    }
    # Six blocks of 16 and 64-token sequences: a second and third prompt evict the first's.
    llm = LLM(
        checkpoint(LLAMA),
        dtype="float32",
        max_model_len=64,
        num_gpu_blocks=6,
        kv_events_config=config,
    )
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.linger = 0
    sub.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
    sub.connect(config["endpoint"])
    time.sleep(0.5)
    yield llm, sub, ctx, config
    llm.shutdown()
    ctx.destroy(linger=0)


def run(llm: LLM, prompt: list[int]) -> None:
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)


def test_engine_events_follow_the_prefix_cache(served: Any) -> None:
    llm, sub, ctx, config = served
    first = [(7 * i) % 250 + 3 for i in range(40)]  # 2 full blocks (+ 8 tokens)
    run(llm, first)
    got = drain(sub, until=lambda g: len(events_of(g, BlockStored)) >= 1)
    stored = events_of(got, BlockStored)
    hashes = [h for e in stored for h in e.block_hashes]
    assert len(hashes) == 2
    assert stored[0].parent_block_hash is None and stored[0].block_size == BS
    assert [t for e in stored for t in e.token_ids] == first[:32]
    pool = llm.llm_engine.block_manager.pool
    assert all(pool.lookup(h) is not None for h in hashes)  # the cache's own keys
    for e in stored[1:]:  # each later event continues the chain
        assert e.parent_block_hash == hashes[hashes.index(e.block_hashes[0]) - 1]
    # Two more long prompts need every block: the first prompt's cached blocks are evicted.
    run(llm, [(11 * i) % 250 + 3 for i in range(60)])
    run(llm, [(13 * i) % 250 + 5 for i in range(60)])
    got += drain(
        sub,
        until=lambda g: (
            set(hashes) <= {h for e in events_of(g, BlockRemoved) for h in e.block_hashes}
        ),
    )
    seqs = [seq for seq, _ in got]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    all_stored = {h for e in events_of(got, BlockStored) for h in e.block_hashes}
    assert {h for e in events_of(got, BlockRemoved) for h in e.block_hashes} <= all_stored
    assert all(pool.lookup(h) is None for h in hashes)
    assert all(b.data_parallel_rank == 0 for _, b in got)

    # A reset is announced at once; a replay client gets every batch from a sequence number.
    assert llm.reset_prefix_cache()
    cleared = drain(sub, until=lambda g: bool(events_of(g, AllBlocksCleared)))
    assert cleared[-1][0] > seqs[-1]
    # vLLM's replay protocol; a DEALER, since a REQ socket takes one reply per request.
    replay = ctx.socket(zmq.DEALER)
    replay.linger = 0
    replay.connect(config["replay_endpoint"])
    replay.send_multipart((b"", (1).to_bytes(8, "big")))
    replayed = []
    while True:
        assert replay.poll(5000), "replay did not answer"
        _, seq, payload = replay.recv_multipart()
        if not payload:
            assert int.from_bytes(seq, "big", signed=True) == -1
            break
        replayed.append(int.from_bytes(seq, "big"))
        DECODER.decode(payload)
    assert replayed == list(range(1, cleared[-1][0] + 1))
