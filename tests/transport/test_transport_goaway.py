"""GOAWAY handled as gRPC does, and a keepalive that gRPC-core servers accept, frame by frame.

Against grpcio servers (gRPC-core's HTTP/2 transport) that send GOAWAY: a strict ping policy
(``grpc.http2.min_ping_interval_without_data_ms`` and ``grpc.http2.max_ping_strikes``, tuned down from
gRPC-core's 5 minutes so the tests run in seconds), ``grpc.max_connection_age_ms``, and graceful shutdown
(``server.stop(grace)``). Against a bare h2 peer for the exact frames: GOAWAY ENHANCE_YOUR_CALM
``too_many_pings`` with a stream at and one above ``last_stream_id``, and gRPC-core's two-step graceful
GOAWAY. Behaviour: streams at or below ``last_stream_id`` finish normally (their HEADERS, DATA and
trailers after the GOAWAY are valid); streams above fail as ``StreamNotProcessedError`` (UNAVAILABLE,
retryable); new calls on the connection fail the same way and a ``ChannelPool`` sends them on a new
connection while the old one drains; ``too_many_pings`` doubles the target's keepalive time.
"""

from __future__ import annotations

import itertools

import attrs
import h2.config
import h2.connection
import h2.errors
import h2.events
import pytest
import trio
from transport_peers import GENERATE, GENERATE_STREAM, AioServer, request

from trio_sidecar._proto.vllm import inference_pb2 as pb
from trio_sidecar.core.config import KeepaliveConfig, SidecarConfig
from trio_sidecar.core.endpoint import parse_grpc_endpoint
from trio_sidecar.core.status import StatusCode
from trio_sidecar.shell.pool import ChannelPool
from trio_sidecar.transport import ConnectionLostError, RpcError, connect_channel
from trio_sidecar.transport._errors import StreamNotProcessedError
from trio_sidecar.transport._keepalive import keepalive_time_for

R = pb.GenerateResponse
# gRPC-core's ping policy, 300 times stricter than its default (5 minutes between PINGs without data).
STRICT_PING_POLICY = [("grpc.http2.min_ping_interval_without_data_ms", 1000), ("grpc.http2.max_ping_strikes", 2)]


def counting_pings(channel) -> list[float]:
    sent: list[float] = []
    protocol = channel._conn.protocol
    ping = protocol.ping

    def counting(data: bytes) -> bool:
        sent.append(trio.current_time())
        return ping(data)

    protocol.ping = counting
    return sent


# -- grpcio servers ------------------------------------------------------------------------------------


async def test_keepalive_earns_no_ping_strikes_from_a_grpcio_server_with_a_strict_ping_policy(nursery, aio, recorder):
    server = AioServer(aio, recorder, options=STRICT_PING_POLICY)
    await server.start()
    try:
        # A PING 0.1 s after the last read; the client assumes the server's 1 s minimum (gRPC-core's 5 min,
        # scaled). Before the fix a PING every 0.3 s earned three strikes within a second or two: GOAWAY
        # ENHANCE_YOUR_CALM "too_many_pings", then "Invalid input ConnectionInputs.RECV_HEADERS in state
        # ConnectionState.CLOSED" for the stream's next HEADERS.
        keepalive = KeepaliveConfig.client(time=0.1, timeout=0.3, min_ping_interval_without_data=1.0)
        channel = await connect_channel(nursery, "127.0.0.1", server.port, keepalive=keepalive)
        sent = counting_pings(channel)
        async with channel.unary_stream(GENERATE_STREAM, request("silent", n=2, interval_ms=6000), R) as stream:
            assert (await stream.__anext__()).outputs.index == 0
            with trio.fail_after(20):
                second = await stream.__anext__()  # six silent seconds later
            assert second.outputs.index == 1
            assert [m async for m in stream] == []
        print(f"\n{len(sent)} PINGs in 6 silent seconds: {[round(b - a, 2) for a, b in itertools.pairwise(sent)]}")
        assert len(sent) >= 4  # still PINGed: about once per second
        assert all(b - a >= 1.0 for a, b in itertools.pairwise(sent[1:])), sent
        assert not channel.broken and channel._conn.goaway is None
        assert (await channel.unary_unary(GENERATE, request("echo", text="ok"), R, timeout=10)).outputs.text == "ok"
        await channel.aclose()
    finally:
        await server.stop()


async def test_too_many_pings_from_grpcio_doubles_the_keepalive_time_of_the_target(nursery, aio, recorder):
    server = AioServer(aio, recorder, options=STRICT_PING_POLICY)
    await server.start()
    target = f"127.0.0.1:{server.port}"
    try:
        # A client that assumes a laxer server than this one: its PINGs earn strikes.
        keepalive = KeepaliveConfig.client(time=0.1, timeout=0.2, min_ping_interval_without_data=0.2)
        channel = await connect_channel(nursery, "127.0.0.1", server.port, keepalive=keepalive)
        assert channel._conn.keepalive_time == 0.1
        with pytest.raises(RpcError) as caught:
            async with channel.unary_stream(GENERATE_STREAM, request("silent", n=2, interval_ms=30_000), R) as s:
                with trio.fail_after(20):
                    async for _ in s:
                        pass
        # gRPC-core closes the connection right after its GOAWAY: the stream fails UNAVAILABLE (never as
        # an HTTP/2 protocol error of ours).
        assert caught.value.code is StatusCode.UNAVAILABLE, caught.value
        assert "protocol error" not in caught.value.message
        assert channel.too_many_pings and channel.broken
        assert "too_many_pings" in channel._conn.goaway
        assert keepalive_time_for(target, 0.1) == 0.2  # doubled for every new connection to the target
        again = await connect_channel(nursery, "127.0.0.1", server.port, keepalive=keepalive)
        assert again._conn.keepalive_time == 0.2
        await again.aclose()
        await channel.aclose()
    finally:
        await server.stop()


async def test_max_connection_age_goaway_drains_the_old_connection_while_the_pool_uses_a_new_one(aio, recorder):
    options = [("grpc.max_connection_age_ms", 1000), ("grpc.max_connection_age_grace_ms", 30_000)]
    server = AioServer(aio, recorder, options=options)
    await server.start()
    config = SidecarConfig(grpc_endpoint=f"127.0.0.1:{server.port}", grpc_connections=1, keepalive_time=0)
    endpoint = parse_grpc_endpoint(config.grpc_endpoint)
    try:
        async with trio.open_nursery() as nursery:
            pool = await ChannelPool.connect(nursery, endpoint, config, deadline=trio.current_time() + 30)
            first = pool.channels[0]
            async with pool.stream("GenerateStream", GENERATE_STREAM, request("s", n=30, interval_ms=100), R) as s:
                indexes = [(await s.__anext__()).outputs.index]
                with trio.fail_after(20):
                    while not first.draining:  # GOAWAY after the connection's maximum age
                        await trio.sleep(0.01)
                # A new call goes to a new connection; the old one is not closed (that would kill the stream).
                echo = await pool.unary("Generate", GENERATE, request("echo", text="new"), R, timeout=10)
                assert echo.outputs.text == "new"
                assert pool.channels[0] is not first and pool.reconnects == 1
                assert not first.closed and first in pool._draining
                indexes += [m.outputs.index async for m in s]
            assert indexes == list(range(30))  # every message after the GOAWAY, then OK trailers
            with trio.fail_after(10):
                while not first.closed:  # drained: closed by the pool once its last call ended
                    await trio.sleep(0.01)
            assert pool._draining == set()
            await pool.aclose()
            nursery.cancel_scope.cancel()
    finally:
        await server.stop()


async def test_graceful_shutdown_lets_open_calls_finish_and_new_calls_are_not_processed(nursery, aio, recorder):
    server = AioServer(aio, recorder)
    await server.start()
    channel = await connect_channel(nursery, "127.0.0.1", server.port)
    async with channel.unary_stream(GENERATE_STREAM, request("s", n=10, interval_ms=50), R) as stream:
        first = await stream.__anext__()
        grpc_server, server.server = server.server, None
        async with trio.open_nursery() as stopping:
            stopping.start_soon(aio.call, lambda: grpc_server.stop(5))
            with trio.fail_after(5):
                while not channel.draining:
                    await trio.sleep(0.005)
            with pytest.raises(StreamNotProcessedError) as caught:
                await channel.unary_unary(GENERATE, request("echo"), R)
            assert caught.value.code is StatusCode.UNAVAILABLE
            rest = [m.outputs.index async for m in stream]
    assert [first.outputs.index, *rest] == list(range(10))
    await channel.aclose()


# -- a bare h2 peer: the exact frames ----------------------------------------------------------------------


@attrs.define
class GoawayPeer:
    """An h2 server on 127.0.0.1 that answers each request with response headers, then does as told."""

    port: int = 0
    streams: list[int] = attrs.Factory(list)
    pings: int = 0
    _conn: h2.connection.H2Connection | None = None
    _stream: trio.SocketStream | None = None

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
            while data := await stream.receive_some(65536):
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.RequestReceived):
                        conn.send_headers(event.stream_id, [(":status", "200"), ("content-type", "application/grpc")])
                        self.streams.append(event.stream_id)
                    elif isinstance(event, h2.events.PingReceived):
                        self.pings += 1
                await stream.send_all(conn.data_to_send())

    async def wait_streams(self, n: int) -> None:
        with trio.fail_after(5):
            while len(self.streams) < n:
                await trio.sleep(0.001)

    async def send(self, frames: bytes) -> None:
        await self._stream.send_all(frames)

    def goaway(self, last_stream_id: int, error_code: int, debug: bytes = b"") -> bytes:
        # Built by hand: h2's own close_connection would move the server's state machine to CLOSED.
        payload = last_stream_id.to_bytes(4, "big") + error_code.to_bytes(4, "big") + debug
        return len(payload).to_bytes(3, "big") + b"\x07\x00" + b"\x00\x00\x00\x00" + payload

    def message_and_trailers(self, stream_id: int) -> bytes:
        self._conn.send_data(stream_id, b"\x00\x00\x00\x00\x00")
        self._conn.send_headers(stream_id, [("grpc-status", "0")], end_stream=True)
        return self._conn.data_to_send()

    def ping(self) -> bytes:
        self._conn.ping(b"12345678")
        return self._conn.data_to_send()


async def open_streams(channel, n: int) -> list:
    streams = []
    for _ in range(n):
        stream = channel.unary_stream(GENERATE_STREAM, request("x"), None)
        await stream.__aenter__()
        streams.append(stream)
    return streams


async def test_too_many_pings_goaway_finishes_streams_up_to_last_stream_id_and_fails_the_rest(nursery, autojump_clock):
    peer = GoawayPeer()
    await nursery.start(peer.serve)
    keepalive = KeepaliveConfig.client(time=10.0, timeout=4.0)
    channel = await connect_channel(nursery, "127.0.0.1", peer.port, keepalive=keepalive)
    below, above = await open_streams(channel, 2)
    await peer.wait_streams(2)
    assert peer.streams == [1, 3]
    # GOAWAY(last_stream_id=1, ENHANCE_YOUR_CALM, "too_many_pings"), then stream 1's DATA and trailers.
    await peer.send(peer.goaway(1, h2.errors.ErrorCodes.ENHANCE_YOUR_CALM, b"too_many_pings"))
    with pytest.raises(StreamNotProcessedError, match="too_many_pings") as caught:
        await above.__anext__()
    assert caught.value.code is StatusCode.UNAVAILABLE
    assert channel.draining and channel.too_many_pings
    assert channel._conn.keepalive_time == 20.0  # this connection PINGs less from now on
    assert keepalive_time_for(f"127.0.0.1:{peer.port}", 10.0) == 20.0
    await peer.send(peer.message_and_trailers(1))
    assert [m async for m in below] == [b""]  # the message, then OK trailers: no protocol error
    assert below.trailing_metadata == ()
    with pytest.raises(StreamNotProcessedError):
        await open_streams(channel, 1)
    assert channel._conn.lost is None
    await channel.aclose()


async def test_graceful_double_goaway_and_ping_keep_open_streams_running(nursery, autojump_clock):
    peer = GoawayPeer()
    await nursery.start(peer.serve)
    channel = await connect_channel(nursery, "127.0.0.1", peer.port)
    first, second = await open_streams(channel, 2)
    await peer.wait_streams(2)
    # gRPC-core's graceful shutdown: GOAWAY(2^31-1, NO_ERROR) and a PING, then GOAWAY(last id, NO_ERROR).
    await peer.send(peer.goaway(2**31 - 1, 0) + peer.ping())
    await trio.sleep(1)
    assert channel.draining and not channel.too_many_pings
    await peer.send(peer.goaway(3, 0) + peer.message_and_trailers(3) + peer.message_and_trailers(1))
    assert [m async for m in second] == [b""]
    assert [m async for m in first] == [b""]
    assert channel._conn.lost is None and channel._conn.calls == {}
    with pytest.raises(StreamNotProcessedError, match="shutting down"):
        await open_streams(channel, 1)
    await channel.aclose()


async def test_a_goaway_with_a_protocol_error_code_also_lets_earlier_streams_finish(nursery, autojump_clock):
    peer = GoawayPeer()
    await nursery.start(peer.serve)
    channel = await connect_channel(nursery, "127.0.0.1", peer.port)
    (stream,) = await open_streams(channel, 1)
    await peer.wait_streams(1)
    await peer.send(peer.goaway(1, h2.errors.ErrorCodes.INTERNAL_ERROR) + peer.message_and_trailers(1))
    assert [m async for m in stream] == [b""]
    assert "error code 2" in channel._conn.goaway
    with pytest.raises(ConnectionLostError):
        await open_streams(channel, 1)
    await channel.aclose()


@attrs.define
class RefusingThenServingPeer:
    """An h2 server: on its first connection it answers every request with GOAWAY(last_stream_id=0) (the
    request was not processed) and keeps the connection open; later connections answer each request with
    one empty message and OK trailers."""

    port: int = 0
    connections: int = 0
    answered: int = 0

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started()
        async with trio.open_nursery() as nursery:
            await trio.serve_listeners(self._connection, listeners, handler_nursery=nursery)

    async def _connection(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        refuse = self.connections == 1
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        conn.initiate_connection()
        async with stream:
            await stream.send_all(conn.data_to_send())
            while data := await stream.receive_some(65536):
                out = b""
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.RequestReceived):
                        if refuse:
                            out += GoawayPeer().goaway(0, 0)
                        else:
                            conn.send_headers(
                                event.stream_id, [(":status", "200"), ("content-type", "application/grpc")]
                            )
                            conn.send_data(event.stream_id, b"\x00\x00\x00\x00\x00")
                            conn.send_headers(event.stream_id, [("grpc-status", "0")], end_stream=True)
                            self.answered += 1
                await stream.send_all(conn.data_to_send() + out)


@pytest.mark.parametrize("kind", ["unary", "stream"])
async def test_the_pool_sends_a_call_the_server_did_not_process_again_on_a_new_connection(nursery, kind):
    peer = RefusingThenServingPeer()
    await nursery.start(peer.serve)
    config = SidecarConfig(grpc_endpoint=f"127.0.0.1:{peer.port}", grpc_connections=1, keepalive_time=0)
    pool = await ChannelPool.connect(
        nursery, parse_grpc_endpoint(config.grpc_endpoint), config, deadline=trio.current_time() + 30
    )
    first = pool.channels[0]
    with trio.fail_after(10):
        if kind == "unary":
            assert await pool.unary("Generate", GENERATE, request("x"), R, timeout=5) == R()
        else:
            async with pool.stream("GenerateStream", GENERATE_STREAM, request("x"), R) as s:
                assert [m async for m in s] == [R()]
    assert peer.connections == 2 and peer.answered == 1
    assert pool.reconnects == 1 and pool.channels[0] is not first
    with trio.fail_after(5):
        while not first.closed:  # drained at once (no call left on it), then closed by the pool
            await trio.sleep(0.01)
    await pool.aclose()
