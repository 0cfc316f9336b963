"""Connections and sockets: peer death, closing, binding, abandoned streams (docs/reference/transport.md)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import psutil
import pytest
import trio
from transport_peers import GENERATE, GENERATE_STREAM, AioServer, TrioEcho, request

from trio_sidecar._proto.vllm import inference_pb2 as pb
from trio_sidecar.core.status import StatusCode
from trio_sidecar.transport import ConnectionLostError, RpcError, connect_channel, open_channel, serve_grpc

R = pb.GenerateResponse
HERE = Path(__file__).parent


async def wait_for(predicate, timeout: float = 2.0) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.005)


def tcp_connections(port: int) -> list:
    """This process's TCP sockets with ``port`` on either end."""
    return [
        c
        for c in psutil.Process().net_connections(kind="tcp")
        if (c.laddr and c.laddr.port == port) or (c.raddr and c.raddr.port == port)
    ]


def established(port: int) -> list:
    return [c for c in tcp_connections(port) if c.status == psutil.CONN_ESTABLISHED]


# -- peer death ------------------------------------------------------------------------------------------


@pytest.fixture
async def peer_process(request):
    """Start ``peer_process.py <kind>``; yields (process, port); killed by PID at the end."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen(  # noqa: ASYNC220 - starting a process does not block; its output is read below
        [sys.executable, str(HERE / "peer_process.py"), request.param], stdout=subprocess.PIPE, env=env, text=True
    )
    try:
        with trio.fail_after(60):
            line = await trio.to_thread.run_sync(process.stdout.readline)
        yield process, int(line)
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
        process.wait(10)
        process.stdout.close()


@pytest.mark.parametrize("peer_process", ["ours", "aio"], indirect=True)
async def test_peer_death_fails_every_open_call_and_new_calls_with_unavailable(peer_process, nursery, our_server):
    process, port = peer_process
    outcomes: dict[str, tuple[BaseException, float]] = {}
    async with open_channel("127.0.0.1", port) as channel:
        streaming = trio.Event()

        async def run(name, fn):
            try:
                await fn()
            except BaseException as exc:  # noqa: BLE001 - recorded for the asserts
                outcomes[name] = (exc, time.monotonic())
                if not isinstance(exc, RpcError):
                    raise

        async def busy_stream():
            async with channel.unary_stream(GENERATE_STREAM, request("stream", n=100_000, interval_ms=10), R) as s:
                async for message in s:
                    if message.outputs.index == 2:
                        streaming.set()

        async def idle_stream():
            async with channel.unary_stream(GENERATE_STREAM, request("stream", n=10, interval_ms=60_000), R) as s:
                async for _ in s:
                    pass

        async def unary():
            await channel.unary_unary(GENERATE, request("sleep", n=60_000), R)

        async with trio.open_nursery() as calls:
            for name, fn in [("busy", busy_stream), ("idle", idle_stream), ("unary", unary)]:
                calls.start_soon(run, name, fn)
            with trio.fail_after(10):
                await streaming.wait()
            await trio.sleep(0.05)
            killed_at = time.monotonic()
            os.kill(process.pid, signal.SIGKILL)
        assert sorted(outcomes) == ["busy", "idle", "unary"]
        for name, (error, at) in outcomes.items():
            assert type(error) is ConnectionLostError, name
            assert error.code is StatusCode.UNAVAILABLE
            assert at - killed_at < 1.0, name
        assert channel.broken
        started = time.monotonic()
        with pytest.raises(ConnectionLostError):
            await channel.unary_unary(GENERATE, request("echo"), R)
        with pytest.raises(ConnectionLostError):
            async with channel.unary_stream(GENERATE_STREAM, request("stream", n=1), R):
                pass
        assert time.monotonic() - started < 1.0
    await trio.to_thread.run_sync(process.wait, 10)
    with pytest.raises((OSError, ConnectionLostError)):
        await connect_channel(nursery, "127.0.0.1", port)
    # The owner replaces the channel: a new one to a live server works.
    async with open_channel("127.0.0.1", our_server.port) as replacement:
        assert (await replacement.unary_unary(GENERATE, request("echo", text="back"), R)).outputs.text == "back"


async def test_server_shutdown_fails_open_calls_with_unavailable(recorder):
    async with trio.open_nursery() as server_nursery:
        server = await server_nursery.start(serve_grpc, [TrioEcho(recorder)])
        async with open_channel("127.0.0.1", server.port) as channel:
            async with channel.unary_stream(GENERATE_STREAM, request("stream", n=10, interval_ms=60_000), R) as s:
                await s.__anext__()
                server_nursery.cancel_scope.cancel()
                with trio.fail_after(1):
                    with pytest.raises(ConnectionLostError):
                        await s.__anext__()
            assert channel.broken


async def test_aclose_fails_open_calls_and_later_calls(our_server):
    async with open_channel("127.0.0.1", our_server.port) as channel:
        failures = []

        async def reader(task_status=trio.TASK_STATUS_IGNORED):
            async with channel.unary_stream(GENERATE_STREAM, request("stream", n=10, interval_ms=60_000), R) as s:
                await s.__anext__()
                task_status.started()
                try:
                    await s.__anext__()
                except ConnectionLostError as exc:
                    failures.append(exc)

        async with trio.open_nursery() as nursery:
            await nursery.start(reader)
            await channel.aclose()
        assert len(failures) == 1 and failures[0].code is StatusCode.UNAVAILABLE
        assert channel.closed
        with pytest.raises(ConnectionLostError):
            await channel.unary_unary(GENERATE, request("echo"), R)


# -- sockets ---------------------------------------------------------------------------------------------


async def test_closing_a_channel_closes_both_ends_of_its_socket(our_server):
    async with (
        open_channel("127.0.0.1", our_server.port) as first,
        open_channel("127.0.0.1", our_server.port) as second,
    ):
        assert first.local_address != second.local_address
        await first.unary_unary(GENERATE, request("echo"), R)
        await second.unary_unary(GENERATE, request("echo"), R)
        assert len(established(our_server.port)) == 4  # two client ends + two server ends
        assert our_server.open_connections == 2
        client_port = first.local_address[1]
        await first.aclose()
        assert [c for c in tcp_connections(client_port) if c.status == psutil.CONN_ESTABLISHED] == []
        await wait_for(lambda: our_server.open_connections == 1)
        assert len(established(our_server.port)) == 2
    await wait_for(lambda: our_server.open_connections == 0)
    assert established(our_server.port) == []


async def test_cancelling_the_server_closes_its_listener_and_connections(recorder):
    async with trio.open_nursery() as nursery:
        server = await nursery.start(serve_grpc, [TrioEcho(recorder)])
        port = server.port
        channel = await connect_channel(nursery, "127.0.0.1", port)
        await channel.unary_unary(GENERATE, request("echo"), R)
        listening = [c for c in tcp_connections(port) if c.status == psutil.CONN_LISTEN]
        assert [(c.laddr.ip, c.laddr.port) for c in listening] == [("127.0.0.1", port)]
        nursery.cancel_scope.cancel()
    assert [c for c in tcp_connections(port) if c.status in (psutil.CONN_LISTEN, psutil.CONN_ESTABLISHED)] == []
    assert channel.broken


async def test_server_binds_exactly_the_given_host(nursery, recorder):
    server = await nursery.start(serve_grpc, [TrioEcho(recorder)])
    assert (server.host, server.port > 0) == ("127.0.0.1", True)
    sockets = [c for c in tcp_connections(server.port) if c.status == psutil.CONN_LISTEN]
    assert [c.laddr.ip for c in sockets] == ["127.0.0.1"]


async def test_second_bind_of_a_port_in_use_is_refused(nursery, recorder, aio):
    server = await nursery.start(serve_grpc, [TrioEcho(recorder)])
    with pytest.raises(OSError) as info:
        await nursery.start(partial(serve_grpc, [TrioEcho(recorder)], port=server.port))
    assert type(info.value) is not BaseExceptionGroup
    assert info.value.errno == errno.EADDRINUSE
    # ... also when the port belongs to another gRPC implementation.
    other = AioServer(aio, recorder)
    await other.start()
    try:
        with pytest.raises(OSError):
            await nursery.start(partial(serve_grpc, [TrioEcho(recorder)], port=other.port))
    finally:
        await other.stop()


async def test_connect_to_a_closed_port_raises_oserror(nursery):
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()
    with pytest.raises(OSError):
        await connect_channel(nursery, "127.0.0.1", port)


async def test_connect_to_a_non_http2_peer_raises_connection_lost(nursery):
    async def http1(stream):
        await stream.receive_some(1024)
        await stream.send_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
        await stream.aclose()

    listeners = await nursery.start(partial(trio.serve_tcp, http1, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    with pytest.raises(ConnectionLostError):
        await connect_channel(nursery, "127.0.0.1", port)


async def test_a_single_failure_inside_open_channel_is_not_an_exception_group(our_server):
    with pytest.raises(RpcError) as info:
        async with open_channel("127.0.0.1", our_server.port) as channel:
            await channel.unary_unary(GENERATE, request("fail", text="no", interval_ms=5), R)
    assert info.value.code is StatusCode.NOT_FOUND


# -- abandoned streams -----------------------------------------------------------------------------------


async def test_abandoned_streams_hand_back_memory_and_window(target):
    chunk = "w" * (64 * 1024)
    async with open_channel("127.0.0.1", target.port) as channel:
        for i in range(20):
            async with channel.unary_stream(
                GENERATE_STREAM, request("stream", text=chunk, n=10_000, key=f"a{i}"), R
            ) as s:
                await s.__anext__()
        await wait_for(lambda: all(f"a{i}" in target.recorder.finished for i in range(20)))
        await trio.sleep(0.1)  # frames already in flight arrive and are credited
        conn = channel._conn
        assert conn.calls == {} and conn.protocol.message_read_buffers == {}
        manager = conn.protocol.h2_connection._inbound_flow_control_window_manager
        assert manager.current_window_size + manager._bytes_processed == manager.max_window_size
        produced = sum(target.recorder.produced[f"a{i}"] for i in range(20))
        assert produced < 20 * 10_000
        response = await channel.unary_unary(GENERATE, request("echo", text="alive"), R, timeout=5)
        assert response.outputs.text == "alive"


async def test_graceful_goaway_lets_open_calls_finish_and_refuses_new_ones(aio, recorder):
    server = AioServer(aio, recorder)
    await server.start()
    try:
        async with open_channel("127.0.0.1", server.port) as channel:
            async with channel.unary_stream(GENERATE_STREAM, request("stream", n=10, interval_ms=50), R) as stream:
                first = await stream.__anext__()
                grpc_server, server.server = server.server, None
                stopping = trio.Event()

                async def stop() -> None:
                    await aio.call(lambda: grpc_server.stop(5))  # GOAWAY, then let in-flight calls finish
                    stopping.set()

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(stop)
                    with trio.fail_after(5):
                        while not channel.broken:
                            await trio.sleep(0.005)
                    rest = [m.outputs.index async for m in stream]
            assert [first.outputs.index, *rest] == list(range(10))
            with pytest.raises(ConnectionLostError):
                await channel.unary_unary(GENERATE, request("echo"), R)
    finally:
        await server.stop()
