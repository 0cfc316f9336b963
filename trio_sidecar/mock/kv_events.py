"""KV events over ZMQ (docs/reference/mock.md#kv-event-messages): one PUB socket per DP rank, optional replay ROUTER.

Nothing here blocks the Trio thread. PUB sends use ``zmq.NOBLOCK`` (a PUB socket drops rather than
blocks at its high-water mark, and a message nobody can take is a lost event, as with any PUB). The
replay ROUTER is served by :meth:`KvEventPublisher.run`, which waits on the socket's ``zmq.FD`` with
``trio.lowlevel.wait_readable`` and drains with ``NOBLOCK`` receives. libzmq's FD is *edge-triggered*:
it only says "events may have changed", so the loop re-reads ``zmq.EVENTS`` and drains completely before
every wait.

Wire format: multipart ``[topic b"", seq (u64 BE), payload]`` where ``seq`` starts at 0 per rank and grows
by one per message, and ``payload = msgpack([timestamp_seconds, [event map, …], dp_rank])``.

Resource handling: :func:`bind_publishers` binds every rank or none (a failure closes what was bound and
raises :class:`KvEventBindError`, so the server runs without events). :meth:`KvEventPublisher.close`
closes the sockets and the context at once (linger 0); call it after the ``run`` task has ended.
"""

from __future__ import annotations

import collections
import ipaddress
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

import msgpack
import trio
import zmq

from trio_sidecar.mock.kvcache import BlockRemoved, BlockStored, KvEvent

__all__ = [
    "REPLAY_BUFFER_MESSAGES",
    "KvEventBindError",
    "KvEventPublisher",
    "bind_publishers",
    "encode_event",
    "encode_payload",
    "wildcard_endpoint",
]

LOGGER = logging.getLogger("trio_sidecar.mock.kv_events")

REPLAY_BUFFER_MESSAGES = 10_000
_REPLAY_CHUNK = 256  # messages sent between checkpoints while answering a replay request
_REPLAY_STALL_SECONDS = 5.0  # a replay peer that takes nothing for this long is dropped
_END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class KvEventBindError(OSError):
    """A KV-event socket could not be bound; ``str(e)`` names the endpoint and the cause."""


def encode_event(event: KvEvent) -> dict[str, Any]:
    """The MessagePack map of one event (docs/reference/mock.md#kv-event-messages); GPU tier, so no ``medium`` key."""
    if isinstance(event, BlockStored):
        stored: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "group_idx": 0,
        }
        if event.extra_keys is not None:  # vLLM's per-block list: None, or [[mm identifier, offset], ...]
            stored["extra_keys"] = [
                None if keys is None else [[identifier, offset] for identifier, offset in keys]
                for keys in event.extra_keys
            ]
        return stored
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": list(event.block_hashes), "group_idx": 0}
    raise TypeError(f"not a KV event: {event!r}")


def encode_payload(events: Iterable[KvEvent], dp_rank: int, timestamp: float | None = None) -> bytes:
    """``msgpack([timestamp_seconds (float64), [event map, …], dp_rank])``."""
    stamp = time.time() if timestamp is None else timestamp
    return msgpack.packb([float(stamp), [encode_event(e) for e in events], dp_rank], use_bin_type=True)


def _endpoint(host: str, port: int | str) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def wildcard_endpoint(endpoint: str) -> str:
    """``tcp://127.0.0.1:5557`` → ``tcp://0.0.0.0:5557`` (the form the mock reports on purpose, docs/reference/mock.md#kv-event-discovery)."""
    port = endpoint.rsplit(":", 1)[1]
    return f"tcp://0.0.0.0:{port}"


def _bound_port(sock: zmq.Socket) -> int:
    last = sock.getsockopt(zmq.LAST_ENDPOINT)
    text = last.decode() if isinstance(last, bytes) else str(last)
    return int(text.rsplit(":", 1)[1])


class KvEventPublisher:
    """The KV-event sockets of one rank. Build with :meth:`bind` (or :func:`bind_publishers`).

    Attributes:
        dp_rank: the rank put in every payload.
        endpoint: the actually bound PUB endpoint, ``tcp://{host}:{port}``.
        port: the bound PUB port.
        replay_endpoint / replay_port: the bound ROUTER, or None without replay.
        next_seq: the sequence number of the next message.
    """

    def __init__(
        self, *, context: zmq.Context, pub: zmq.Socket, router: zmq.Socket | None, host: str, dp_rank: int
    ) -> None:
        self._context = context
        self._pub = pub
        self._router = router
        self.dp_rank = dp_rank
        self.port = _bound_port(pub)
        self.endpoint = _endpoint(host, self.port)
        self.replay_port = _bound_port(router) if router is not None else None
        self.replay_endpoint = _endpoint(host, self.replay_port) if self.replay_port is not None else None
        self.next_seq = 0
        self.dropped = 0  # messages the PUB socket refused (high-water mark)
        self._ring: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=REPLAY_BUFFER_MESSAGES)
        self._closed = False

    @classmethod
    def bind(
        cls, host: str, *, dp_rank: int = 0, port: int | None = None, replay_port: int | None = None
    ) -> KvEventPublisher:
        """Bind the PUB socket (and the replay ROUTER when ``replay_port`` is not None) on ``host``.

        ``port``/``replay_port`` of None or 0 mean an OS-chosen port. The caller adds the rank offset.

        Raises:
            KvEventBindError: a bind failed (nothing is left open).
        """
        ipv6 = False
        try:
            ipv6 = ipaddress.ip_address(host).version == 6
        except ValueError:
            pass
        context = zmq.Context()
        sockets: list[zmq.Socket] = []
        try:
            pub = context.socket(zmq.PUB)
            sockets.append(pub)
            _configure(pub, ipv6)
            _bind(pub, host, port)
            router = None
            if replay_port is not None:
                router = context.socket(zmq.ROUTER)
                sockets.append(router)
                _configure(router, ipv6)
                router.setsockopt(zmq.ROUTER_MANDATORY, 1)
                _bind(router, host, replay_port)
            return cls(context=context, pub=pub, router=router, host=host, dp_rank=dp_rank)
        except BaseException:
            for sock in sockets:
                sock.close(linger=0)
            context.term()
            raise

    # --- publishing -------------------------------------------------------------------------------

    def publish(self, events: Sequence[KvEvent], *, timestamp: float | None = None) -> int:
        """Send one message holding ``events``; returns its sequence number. Never blocks."""
        if self._closed:
            raise RuntimeError("KV event publisher is closed")
        seq = self.next_seq
        self.next_seq += 1
        payload = encode_payload(events, self.dp_rank, timestamp)
        self._ring.append((seq, payload))
        try:
            self._pub.send_multipart([b"", seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
        return seq

    # --- replay -----------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Answer replay requests until cancelled (returns at once without a replay socket)."""
        task_status.started()
        router = self._router
        if router is None:
            return
        fd = _fd(router)
        while True:
            while not self._closed and _events(router) & zmq.POLLIN:
                try:
                    frames = router.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                await self._replay(frames)
            if self._closed:
                return
            await trio.lowlevel.wait_readable(fd)

    async def _replay(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            LOGGER.debug("rank %d: ignoring malformed replay request (%d frames)", self.dp_rank, len(frames))
            return
        identity = frames[0]
        start = int.from_bytes(frames[2], "big")
        # Snapshot first: publishing may continue while this task waits.
        messages = [(seq, payload) for seq, payload in self._ring if seq >= start]
        for index, (seq, payload) in enumerate(messages):
            if index and index % _REPLAY_CHUNK == 0:
                await trio.lowlevel.checkpoint()
            if not await self._send_replay([identity, b"", b"", seq.to_bytes(8, "big"), payload]):
                return
        await self._send_replay([identity, b"", b"", _END_OF_REPLAY, b""])

    async def _send_replay(self, frames: list[bytes]) -> bool:
        """Send one reply, waiting (without blocking Trio) while the peer's pipe is full. The ROUTER is
        ``ROUTER_MANDATORY``, so a full pipe is ``EAGAIN`` instead of a silent drop, and an unknown peer
        is ``EHOSTUNREACH``. Returns False when the peer is gone or stalled."""
        router = self._router
        assert router is not None
        with trio.move_on_after(_REPLAY_STALL_SECONDS):
            while not self._closed:
                try:
                    router.send_multipart(frames, flags=zmq.NOBLOCK)
                    return True
                except zmq.Again:
                    pass
                except zmq.ZMQError:
                    return False
                if _events(router) & zmq.POLLOUT:
                    continue
                await trio.lowlevel.wait_readable(_fd(router))
        return False

    # --- lifetime ---------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close the sockets and the context now (linger 0). Idempotent.

        A ``run`` task still waiting on the replay socket is woken (``notify_closing``) and fails with
        ``ClosedResourceError``; normally cancel it first.
        """
        if self._closed:
            return
        self._closed = True
        if self._router is not None:
            try:
                trio.lowlevel.notify_closing(_fd(self._router))
            except RuntimeError:
                pass  # not inside a Trio run (e.g. closing after trio.run returned)
            self._router.close(linger=0)
        self._pub.close(linger=0)
        self._context.term()

    def __enter__(self) -> KvEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<KvEventPublisher rank={self.dp_rank} {self.endpoint} next_seq={self.next_seq} {state}>"


def _configure(sock: zmq.Socket, ipv6: bool) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 0)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    if ipv6:
        sock.setsockopt(zmq.IPV6, 1)


def _bind(sock: zmq.Socket, host: str, port: int | None) -> None:
    endpoint = _endpoint(host, port if port else "*")
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise KvEventBindError(f"cannot bind KV event socket {endpoint}: {exc}") from None


def bind_publishers(
    host: str, dp_size: int, *, port: int | None = None, replay_port: int | None = None
) -> list[KvEventPublisher]:
    """Bind one publisher per rank; rank ``r`` uses ``port + r`` / ``replay_port + r`` when those are
    set (non-zero), else OS-chosen ports.

    Raises:
        KvEventBindError: any bind failed; the publishers already bound are closed first.
    """
    publishers: list[KvEventPublisher] = []
    try:
        for rank in range(dp_size):
            publishers.append(
                KvEventPublisher.bind(
                    host,
                    dp_rank=rank,
                    port=port + rank if port else None,
                    replay_port=(replay_port + rank if replay_port else 0) if replay_port is not None else None,
                )
            )
    except BaseException:
        for publisher in publishers:
            publisher.close()
        raise
    return publishers


# ZMQ_FD and ZMQ_EVENTS are int options; pyzmq's getsockopt is typed for every option (int | bytes).
def _fd(socket: zmq.Socket[bytes]) -> int:
    return int(socket.getsockopt(zmq.FD))


def _events(socket: zmq.Socket[bytes]) -> int:
    return int(socket.getsockopt(zmq.EVENTS))
