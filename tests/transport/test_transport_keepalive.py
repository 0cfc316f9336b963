"""Client keepalive: gRPC's keepalive timing, within gRPC-core's ping policy, on a virtual clock.

The peer is a bare h2 server on 127.0.0.1 (in this process, so the virtual clock sees it): it answers every
request with response headers and then stays silent, records the PINGs it receives (h2 acknowledges them),
and can *hang*: stop reading the socket altogether, as a SIGSTOPped process does. A PING follows
``time`` without reads, but never sooner than ``min_ping_interval_without_data`` after the previous PING's
acknowledgement unless the peer sent data after it (a gRPC-core server would count it as a strike). The same
behaviour against real processes (the mock, SIGSTOP/SIGCONT by PID) is in tests/reliability/test_hung_engine.py,
against grpcio servers with a ping policy in tests/transport/test_transport_goaway.py.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import attrs
import h2.config
import h2.connection
import h2.events
import pytest
import trio
from transport_peers import GENERATE_STREAM, request

from trio_sidecar._proto.grpc.health.v1 import health_pb2
from trio_sidecar.core.config import KeepaliveConfig
from trio_sidecar.core.status import StatusCode
from trio_sidecar.transport import ConnectionLostError, RpcError, connect_channel

HERE = Path(__file__).parent
WATCH = "/grpc.health.v1.Health/Watch"
REQUEST = health_pb2.HealthCheckRequest(service="")
TIME, TIMEOUT = 10.0, 4.0
KEEPALIVE = KeepaliveConfig.client(time=TIME, timeout=TIMEOUT)


@attrs.define
class SilentPeer:
    """An h2 server that sends response headers for each request, then nothing unless told to."""

    port: int = 0
    pings: list[float] = attrs.Factory(list)  # virtual times at which PINGs were read
    streams: list[int] = attrs.Factory(list)
    hung: bool = False
    _conn: h2.connection.H2Connection | None = None
    _stream: trio.SocketStream | None = None
    _requests: trio.Event = attrs.Factory(trio.Event)

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started()
        async with listeners[0]:
            stream = await listeners[0].accept()
        self._stream = stream
        conn = self._conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        conn.initiate_connection()
        async with stream:
            await stream.send_all(conn.data_to_send())
            while True:
                if self.hung:
                    await trio.sleep_forever()  # as if SIGSTOPped: nothing is read, nothing is sent
                data = await stream.receive_some(65536)
                if not data:
                    return
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.RequestReceived):
                        conn.send_headers(event.stream_id, [(":status", "200"), ("content-type", "application/grpc")])
                        self.streams.append(event.stream_id)
                        self._requests.set()
                    elif isinstance(event, h2.events.PingReceived):
                        self.pings.append(trio.current_time())
                pending = conn.data_to_send()
                if pending and not self.hung:
                    await stream.send_all(pending)

    async def send_message(self, stream_id: int) -> None:
        """One (empty) gRPC message on ``stream_id``."""
        self._conn.send_data(stream_id, b"\x00\x00\x00\x00\x00")
        await self._stream.send_all(self._conn.data_to_send())


async def open_stream(channel):
    stream = channel.unary_stream(WATCH, REQUEST, None)
    await stream.__aenter__()
    return stream


async def connected(nursery, peer: SilentPeer, **keepalive):
    await nursery.start(peer.serve)
    return await connect_channel(nursery, "127.0.0.1", peer.port, **keepalive)


async def test_a_silent_call_is_pinged_after_keepalive_time_then_at_most_every_five_minutes(nursery, autojump_clock):
    peer = SilentPeer()
    channel = await connected(nursery, peer, keepalive=KEEPALIVE)
    stream = await open_stream(channel)
    opened = trio.current_time()
    await trio.sleep(620)
    # The first PING keepalive time after the last read; then nothing but its ACK was read, so a gRPC-core
    # server would count a PING sooner than 5 minutes after the previous one as a strike. The interval is
    # counted from when the ACK was noticed (at the latest TIMEOUT after the PING).
    assert [round(t - opened, 3) for t in peer.pings] == [10.0, 314.0, 618.0]
    assert not channel.broken
    await peer.send_message(peer.streams[0])
    assert await stream.__anext__() == b""
    await stream.aclose()
    await channel.aclose()


async def test_data_from_the_peer_after_the_ack_allows_the_next_ping_after_keepalive_time(nursery, autojump_clock):
    peer = SilentPeer()
    channel = await connected(nursery, peer, keepalive=KEEPALIVE)
    stream = await open_stream(channel)
    opened = trio.current_time()
    await trio.sleep(25)  # PING at 10, acknowledged
    await peer.send_message(peer.streams[0])  # data written after the ACK: gRPC-core resets its strikes
    assert await stream.__anext__() == b""
    sent = trio.current_time()
    await trio.sleep(15)
    assert [round(t - opened, 3) for t in peer.pings] == [10.0, round(sent - opened + TIME, 3)]
    assert not channel.broken
    await channel.aclose()


async def test_a_hung_peer_with_a_silent_call_is_detected_at_the_next_permitted_ping(nursery, autojump_clock):
    peer = SilentPeer()
    channel = await connected(nursery, peer, keepalive=KEEPALIVE)
    stream = await open_stream(channel)
    opened = trio.current_time()
    await trio.sleep(60)  # the first PING (at 10) is acknowledged
    peer.hung = True
    with trio.fail_after(400), pytest.raises(ConnectionLostError, match="keepalive PING not acknowledged"):
        async for _ in stream:
            raise AssertionError("no message was sent")
    assert trio.current_time() - opened == pytest.approx(314.0 + TIMEOUT, abs=1e-6)


async def test_a_hung_peer_fails_every_open_call_once_within_time_plus_timeout(nursery, autojump_clock):
    peer = SilentPeer()
    channel = await connected(nursery, peer, keepalive=KEEPALIVE)
    streams = [await open_stream(channel) for _ in range(3)]
    last_read = channel._conn.last_read
    peer.hung = True
    failures: list[tuple[float, BaseException]] = []

    async def read(stream) -> None:
        try:
            async for _ in stream:
                raise AssertionError("no message was sent")
        except RpcError as exc:
            failures.append((trio.current_time(), exc))

    with trio.fail_after(60):
        async with trio.open_nursery() as readers:
            for stream in streams:
                readers.start_soon(read, stream)
    assert len(failures) == 3
    for when, exc in failures:
        assert type(exc) is ConnectionLostError and exc.code is StatusCode.UNAVAILABLE
        assert exc.message == f"connection to 127.0.0.1:{peer.port} lost: keepalive PING not acknowledged within 4s"
        assert when - last_read == pytest.approx(TIME + TIMEOUT, abs=1e-6)
    assert channel.broken
    # A new call on the lost connection fails at once, with the same reason.
    started = trio.current_time()
    with pytest.raises(ConnectionLostError, match="keepalive PING not acknowledged"):
        await open_stream(channel)
    assert trio.current_time() == started


async def test_reads_postpone_the_ping(nursery, autojump_clock):
    peer = SilentPeer()
    channel = await connected(nursery, peer, keepalive=KEEPALIVE)
    stream = await open_stream(channel)
    for _ in range(8):  # a message every 6 s (less than the keepalive time) for 48 s: never a PING
        await trio.sleep(6)
        await peer.send_message(peer.streams[0])
        assert await stream.__anext__() == b""
    last = trio.current_time()
    assert peer.pings == []
    await trio.sleep(12)
    assert [round(t - last, 3) for t in peer.pings] == [10.0]
    assert not channel.broken
    await channel.aclose()


async def test_no_ping_without_calls_and_the_time_counts_from_the_first_call(nursery, autojump_clock):
    peer = SilentPeer()
    channel = await connected(nursery, peer, keepalive=KEEPALIVE)
    await trio.sleep(100)
    assert peer.pings == []  # (gRPC's GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS is off)
    stream = await open_stream(channel)
    opened = trio.current_time()
    await trio.sleep(15)
    assert [round(t - opened, 3) for t in peer.pings] == [10.0]
    await stream.aclose()
    await trio.sleep(100)
    assert len(peer.pings) == 1  # idle again: no more PINGs
    await channel.aclose()


async def test_hung_idle_connection_is_detected_by_its_next_call(nursery, autojump_clock):
    peer = SilentPeer()
    channel = await connected(nursery, peer, keepalive=KEEPALIVE)
    await trio.sleep(50)
    peer.hung = True
    await trio.sleep(50)  # no call: nothing noticed
    assert not channel.broken
    started = trio.current_time()
    call = trio.Event()

    async def call_once() -> None:
        with pytest.raises(ConnectionLostError, match="keepalive"):
            await open_stream(channel)  # the peer never answers the headers
        call.set()

    nursery.start_soon(call_once)
    with trio.fail_after(60):
        await call.wait()
    assert trio.current_time() - started == pytest.approx(TIME + TIMEOUT, abs=1e-6)


async def test_keepalive_is_off_by_default(nursery, autojump_clock):
    peer = SilentPeer()
    channel = await connected(nursery, peer)
    assert channel._conn.keepalive is None
    await open_stream(channel)
    peer.hung = True
    await trio.sleep(3600)
    assert peer.pings == [] and not channel.broken
    await channel.aclose()


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"time": 0}, "keepalive time must be a finite, positive number of seconds"),
        ({"time": -1}, "keepalive time must be a finite, positive number of seconds"),
        ({"time": math.nan}, "keepalive time must be a finite, positive number of seconds"),
        ({"timeout": 0}, "keepalive timeout must be a finite, positive number of seconds"),
        ({"timeout": math.inf}, "keepalive timeout must be a finite, positive number of seconds"),
        ({"min_ping_interval_without_data": 0}, "min_ping_interval_without_data must be a finite, positive"),
        ({"max_ping_strikes": -1}, "max_ping_strikes must be a whole number, 0 or more, or None"),
        ({"max_ping_strikes": True}, "max_ping_strikes must be a whole number, 0 or more, or None"),
    ],
)
def test_keepalive_config_is_validated(values, message):
    with pytest.raises(ValueError, match=message):
        KeepaliveConfig(**values)


def test_keepalive_config_has_grpcs_client_and_server_defaults():
    assert KeepaliveConfig.client() == KeepaliveConfig(
        time=None, timeout=20.0, min_ping_interval_without_data=300.0, max_ping_strikes=None
    )
    assert KeepaliveConfig.server() == KeepaliveConfig(
        time=None, timeout=20.0, min_ping_interval_without_data=300.0, max_ping_strikes=2
    )
    assert KeepaliveConfig.server(max_ping_strikes=None).max_ping_strikes is None


@pytest.fixture
async def peer_process_port():
    """Our echo server in its own process (it answers while this process is stalled); killed by PID."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen(  # noqa: ASYNC220 - starting a process does not block; its output is read below
        [sys.executable, str(HERE / "peer_process.py"), "ours"], stdout=subprocess.PIPE, env=env, text=True
    )
    try:
        with trio.fail_after(60):
            line = await trio.to_thread.run_sync(process.stdout.readline)
        yield int(line)
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
        process.wait(10)
        process.stdout.close()


async def test_a_stall_of_this_process_is_not_taken_for_a_hung_peer(nursery, peer_process_port):
    """The ACK arrives while this process's event loop is blocked past the keepalive timeout; afterwards the
    keepalive task and the reader become runnable together (in either order): the unread ACK counts."""
    # (Our server has no ping policy; the short gap lets a PING follow every keepalive time.)
    keepalive = KeepaliveConfig.client(time=0.2, timeout=0.2, min_ping_interval_without_data=0.2)
    channel = await connect_channel(nursery, "127.0.0.1", peer_process_port, keepalive=keepalive)
    conn = channel._conn
    sent: list[float] = []
    ping, flush = conn.protocol.ping, conn.flush

    def counting_ping(data: bytes) -> bool:
        sent.append(time.monotonic())
        return ping(data)

    def stalling_flush() -> None:
        flush()
        if len(sent) > stalls:  # the PING just went out: stall the whole event loop past its timeout
            time.sleep(0.5)  # (fault injection: the ACK arrives meanwhile, unread)

    stalls = 0
    conn.protocol.ping = counting_ping
    conn.flush = stalling_flush
    async with channel.unary_stream(GENERATE_STREAM, request("silent", n=2, interval_ms=600_000), None) as stream:
        await stream.__anext__()  # the first message; the second one is ten minutes away
        for _ in range(12):
            with trio.fail_after(10):
                while len(sent) == stalls:
                    await trio.sleep(0.002)
            stalls += 1
            await trio.sleep(0.05)  # the keepalive task has looked at its PING by now
            assert not channel.broken, conn.lost
    assert len(sent) >= 12
    await channel.aclose()
