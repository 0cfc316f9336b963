"""KV events over ZMQ (docs/reference/mock.md#kv-event-messages: the frames, a failed publisher is not advertised) with a real SUB consumer on
127.0.0.1. Sockets are read with ``NOBLOCK`` and Trio fd waits, so no test thread ever blocks."""

from __future__ import annotations

import itertools
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgpack
import pytest
import trio
import zmq

from trio_sidecar.mock.engine_args import engine_args_from_mapping
from trio_sidecar.mock.kv_events import (
    REPLAY_BUFFER_MESSAGES,
    KvEventBindError,
    KvEventPublisher,
    bind_publishers,
    encode_event,
    wildcard_endpoint,
)
from trio_sidecar.mock.kvcache import BlockRemoved, BlockStored
from trio_sidecar.mock.scheduler import RankEngine, SimRequest


async def recv_multipart(sock: zmq.Socket) -> list[bytes]:
    # libzmq's FD is edge-triggered: try, re-check EVENTS, only then wait.
    while True:
        try:
            return sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            pass
        if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            continue
        await trio.lowlevel.wait_readable(sock.getsockopt(zmq.FD))


class Consumer:
    """A ZMQ SUB subscriber decoding ``[topic, seq, payload]`` messages."""

    def __init__(self, endpoint: str) -> None:
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)

    async def receive(self) -> tuple[bytes, int, list[Any]]:
        topic, seq, payload = await recv_multipart(self.sock)
        assert len(seq) == 8
        return topic, int.from_bytes(seq, "big"), msgpack.unpackb(payload, raw=False)

    async def sync(self, publisher: KvEventPublisher) -> int:
        """Publish empty probe messages until one arrives (PUB drops messages sent before the
        subscription reaches it); returns the last seq received."""
        while True:
            publisher.publish([])
            with trio.move_on_after(0.05):
                while True:
                    _, seq, payload = await self.receive()
                    assert payload[1] == []
                    if seq == publisher.next_seq - 1:
                        return seq

    def close(self) -> None:
        self.sock.close(linger=0)
        self.context.term()


@asynccontextmanager
async def engine_with_consumer(**overrides: Any) -> AsyncIterator[tuple[RankEngine, KvEventPublisher, Consumer]]:
    args = engine_args_from_mapping(
        {"block_size": 4, "num_gpu_blocks": 3, "speedup_ratio": 0.0, "enable_prefix_caching": True, **overrides}
    )
    rank = overrides.get("dp_size", 1) - 1
    with KvEventPublisher.bind("127.0.0.1", dp_rank=rank) as publisher:
        consumer = Consumer(publisher.endpoint)
        try:
            engine = RankEngine(rank, args, publisher)
            async with trio.open_nursery() as nursery:
                await nursery.start(engine.run)
                with trio.fail_after(10):
                    await consumer.sync(publisher)
                yield engine, publisher, consumer
                nursery.cancel_scope.cancel()
        finally:
            consumer.close()


async def test_stored_and_removed_events_for_a_two_block_prompt_and_its_eviction():
    async with engine_with_consumer() as (engine, publisher, consumer):
        with trio.fail_after(10):
            first_seq = publisher.next_seq
            async for _ in engine.submit(SimRequest(uuid="a", prompt=tuple(range(8)), plan=(500,))):
                pass
            topic, seq1, payload1 = await consumer.receive()
            # A different 3-block prompt needs the 2 inactive blocks: both evicted, leaf first.
            async for _ in engine.submit(SimRequest(uuid="b", prompt=tuple(range(100, 112)), plan=(501,))):
                pass
            _, seq2, payload2 = await consumer.receive()

    assert topic == b""
    assert (seq1, seq2) == (first_seq, first_seq + 1)
    timestamp, events1, dp_rank = payload1
    assert isinstance(timestamp, float) and timestamp > 1.6e9
    assert dp_rank == 0
    (stored,) = events1
    assert stored == {
        "type": "BlockStored",
        "block_hashes": stored["block_hashes"],
        "parent_block_hash": None,
        "token_ids": list(range(8)),
        "block_size": 4,
        "group_idx": 0,
    }
    assert len(stored["block_hashes"]) == 2
    assert len(stored["token_ids"]) == len(stored["block_hashes"]) * stored["block_size"]
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in stored["block_hashes"])

    removed, stored_b = payload2[1]
    assert removed == {"type": "BlockRemoved", "block_hashes": stored["block_hashes"][::-1], "group_idx": 0}
    assert stored_b["type"] == "BlockStored" and stored_b["parent_block_hash"] is None
    assert len(stored_b["token_ids"]) == len(stored_b["block_hashes"]) * 4 == 12
    assert "medium" not in stored and "medium" not in stored_b


async def test_generated_blocks_chain_to_their_parent_and_seq_strictly_increases():
    async with engine_with_consumer(num_gpu_blocks=64, dp_size=2) as (engine, publisher, consumer):
        plan = tuple(range(2000, 2013))
        with trio.fail_after(10):
            async for _ in engine.submit(SimRequest(uuid="a", prompt=(1, 2, 3, 4, 5, 6), plan=plan)):
                pass
            # 6 + 13 = 19 tokens, 18 computed: blocks 0 (prompt), 1 (prompt + 2 generated), 2, 3.
            messages = [await consumer.receive() for _ in range(4)]
    seqs = [m[1] for m in messages]
    assert all(b == a + 1 for a, b in itertools.pairwise(seqs))
    events = [e for m in messages for e in m[2][1]]
    assert all(m[2][2] == 1 for m in messages)  # dp_rank of this publisher
    assert [e["type"] for e in events] == ["BlockStored"] * 4
    tokens = [t for e in events for t in e["token_ids"]]
    assert tokens == [1, 2, 3, 4, 5, 6, *plan[:10]]
    parents = [e["parent_block_hash"] for e in events]
    hashes = [e["block_hashes"][0] for e in events]
    assert parents == [None, *hashes[:-1]]


def test_event_maps_use_the_field_names():
    stored = encode_event(BlockStored((1, 2**64 - 1), 7, tuple(range(8)), 4))
    assert stored == {
        "type": "BlockStored",
        "block_hashes": [1, 2**64 - 1],
        "parent_block_hash": 7,
        "token_ids": list(range(8)),
        "block_size": 4,
        "group_idx": 0,
    }
    assert encode_event(BlockRemoved((3,))) == {"type": "BlockRemoved", "block_hashes": [3], "group_idx": 0}
    # Multimodal blocks: vLLM's per-block extra_keys, [identifier, offset from the block start] pairs.
    image = encode_event(BlockStored((1, 2), None, tuple(range(8)), 4, (None, (("ab" * 32, -1),))))
    assert image["extra_keys"] == [None, [["ab" * 32, -1]]]
    assert "extra_keys" not in stored
    # u64 hashes survive MessagePack.
    assert msgpack.unpackb(msgpack.packb(stored))["block_hashes"][1] == 2**64 - 1


def test_socket_options_and_endpoints():
    with KvEventPublisher.bind("127.0.0.1") as publisher:
        pub = publisher._pub
        assert pub.getsockopt(zmq.LINGER) == 0
        assert pub.getsockopt(zmq.SNDTIMEO) == 0
        assert pub.getsockopt(zmq.RECONNECT_IVL) == 100
        assert pub.getsockopt(zmq.RECONNECT_IVL_MAX) == 5000
        assert pub.getsockopt(zmq.TCP_KEEPALIVE) == 1
        assert publisher.endpoint == f"tcp://127.0.0.1:{publisher.port}"
        assert wildcard_endpoint(publisher.endpoint) == f"tcp://0.0.0.0:{publisher.port}"
        assert publisher.replay_endpoint is None
    assert publisher.closed
    publisher.close()  # idempotent
    with pytest.raises(RuntimeError):
        publisher.publish([])


def occupied_tcp_port() -> socket.socket:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    return listener


def test_bind_failure_is_reported_and_nothing_stays_bound():
    with occupied_tcp_port() as listener:
        port = listener.getsockname()[1]
        with pytest.raises(KvEventBindError, match=f"127.0.0.1:{port}"):
            KvEventPublisher.bind("127.0.0.1", port=port)


def port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_rank_ports_are_offset_and_a_failing_rank_closes_the_others():
    # A base port whose successor can be taken by a TCP listener, so that rank 1 fails to bind.
    for _ in range(20):
        with occupied_tcp_port() as probe:
            base = probe.getsockname()[1] - 1
        if not port_is_free(base):
            continue
        blocker = socket.socket()
        try:
            blocker.bind(("127.0.0.1", base + 1))
            blocker.listen()
        except OSError:
            blocker.close()
            continue
        with blocker:
            with pytest.raises(KvEventBindError, match=f"127.0.0.1:{base + 1}"):
                bind_publishers("127.0.0.1", 2, port=base)
            assert port_is_free(base)  # rank 0 was bound there, then closed again
        publishers = bind_publishers("127.0.0.1", 2, port=base)
        try:
            assert [p.port for p in publishers] == [base, base + 1]
            assert [p.dp_rank for p in publishers] == [0, 1]
        finally:
            for p in publishers:
                p.close()
        return
    pytest.skip("no free consecutive port pair found")


def test_auto_ports_per_rank():
    publishers = bind_publishers("127.0.0.1", 2, replay_port=0)
    try:
        assert len({p.port for p in publishers}) == 2
        assert all(p.replay_port is not None and p.replay_endpoint for p in publishers)
    finally:
        for p in publishers:
            p.close()


def test_ipv6_listen_address():
    try:
        publisher = KvEventPublisher.bind("::1")
    except KvEventBindError:
        pytest.skip("no IPv6 loopback")
    with publisher:
        assert publisher.endpoint == f"tcp://[::1]:{publisher.port}"


async def replay(endpoint: str, start: int) -> list[list[bytes]]:
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")], flags=zmq.NOBLOCK)
        frames: list[list[bytes]] = []
        while True:
            message = await recv_multipart(dealer)
            frames.append(message)
            if message[2] == (-1).to_bytes(8, "big", signed=True):
                return frames
    finally:
        dealer.close(linger=0)
        context.term()


async def test_replay_router_streams_buffered_messages_then_the_sentinel():
    with KvEventPublisher.bind("127.0.0.1", dp_rank=0, replay_port=0) as publisher:
        for i in range(5):
            publisher.publish([BlockRemoved((i,))], timestamp=float(i))
        async with trio.open_nursery() as nursery:
            await nursery.start(publisher.run)
            with trio.fail_after(10):
                frames = await replay(publisher.replay_endpoint, 2)
            nursery.cancel_scope.cancel()
    *messages, sentinel = frames
    assert sentinel == [b"", b"", b"\xff" * 8, b""]
    assert [int.from_bytes(m[2], "big") for m in messages] == [2, 3, 4]
    assert all(m[:2] == [b"", b""] for m in messages)
    assert [msgpack.unpackb(m[3])[1][0]["block_hashes"] for m in messages] == [[2], [3], [4]]


async def test_replay_ring_keeps_the_last_10000_messages():
    with KvEventPublisher.bind("127.0.0.1", replay_port=0) as publisher:
        for _ in range(REPLAY_BUFFER_MESSAGES + 5):
            publisher.publish([])
        async with trio.open_nursery() as nursery:
            await nursery.start(publisher.run)
            with trio.fail_after(30):
                frames = await replay(publisher.replay_endpoint, 0)
            nursery.cancel_scope.cancel()
    seqs = [int.from_bytes(m[2], "big") for m in frames[:-1]]
    assert seqs[0] == 5 and seqs[-1] == REPLAY_BUFFER_MESSAGES + 4
    assert len(seqs) == REPLAY_BUFFER_MESSAGES


async def test_run_returns_without_a_replay_socket():
    with KvEventPublisher.bind("127.0.0.1") as publisher:
        with trio.fail_after(5):
            await publisher.run()
