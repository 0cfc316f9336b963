"""``ResponseStream.listen(listener)``: response messages handed to a synchronous callback (``response_type=None``).

Against our server and grpc.aio (the ``channel`` fixture), and against ``ScriptedServer``, a raw h2 peer whose
answer each test scripts step by step (so a test decides exactly which messages are already buffered when
``listen`` is called, which trailers end the stream, and when the stream is reset).
"""

from __future__ import annotations

import itertools
import struct
import time
from collections.abc import Awaitable, Callable
from functools import partial

import h2.config
import h2.connection
import h2.errors
import h2.events
import pytest
import trio
from transport_peers import GENERATE, GENERATE_STREAM, TrioEcho, request

from trio_sidecar._proto.vllm import inference_pb2 as pb
from trio_sidecar.core.status import StatusCode
from trio_sidecar.transport import (
    ConnectionLostError,
    RpcError,
    open_channel,
    serve_grpc,
)

R = pb.GenerateResponse


async def wait_for(predicate: Callable[[], bool], timeout: float = 2.0) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.002)


def indexes(messages: list[bytes]) -> list[int]:
    return [R.FromString(data).outputs.index for data in messages]


def payload(index: int, text: str = "") -> bytes:
    return R(outputs=pb.SequenceOutput(index=index, text=text)).SerializeToString()


class Collector:
    """A listener: records every message; returns True on the message ``stop_at`` (0-based), if given."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.stop_at = stop_at
        self.received: list[bytes] = []
        self.tasks: list[object] = []  # the task each message was handed over in

    def __call__(self, data: bytes) -> bool:
        assert type(data) is bytes
        self.received.append(data)
        self.tasks.append(trio.lowlevel.current_task())
        return self.stop_at is not None and len(self.received) == self.stop_at + 1


# -- a scripted raw h2 server ----------------------------------------------------------------------------


class Responder:
    """Writes one stream's answer for a ``ScriptedServer`` script."""

    def __init__(self, conn: h2.connection.H2Connection, stream_id: int, flush: Callable[[], Awaitable[None]]) -> None:
        self.conn = conn
        self.stream_id = stream_id
        self.flush = flush

    async def headers(self) -> None:
        self.conn.send_headers(self.stream_id, [(":status", "200"), ("content-type", "application/grpc")])
        await self.flush()

    async def messages(self, *payloads: bytes) -> None:
        for data in payloads:
            self.conn.send_data(self.stream_id, struct.pack(">BI", 0, len(data)) + data)
        await self.flush()

    async def trailers(self, status: int = 0, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.conn.send_headers(self.stream_id, [("grpc-status", str(status)), *metadata], end_stream=True)
        await self.flush()

    async def reset(self, error_code: int) -> None:
        self.conn.reset_stream(self.stream_id, error_code)
        await self.flush()


class ScriptedServer:
    """Answers every request by running ``script(responder)``; records the client's RST_STREAMs."""

    def __init__(self) -> None:
        self.script: Callable[[Responder], Awaitable[None]] | None = None
        self.go = trio.Event()  # for scripts that wait for the test
        self.resets: list[tuple[int, int]] = []  # (stream id, error code)
        self.port = 0

    async def handle(self, stream: trio.SocketStream) -> None:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding="utf-8"))
        conn.initiate_connection()
        lock = trio.Lock()

        async def flush() -> None:
            async with lock:
                data = conn.data_to_send()
                if data:
                    await stream.send_all(data)

        await flush()
        try:
            async with trio.open_nursery() as nursery:
                while data := await stream.receive_some(65536):
                    for event in conn.receive_data(data):
                        if isinstance(event, h2.events.RequestReceived):
                            assert self.script is not None
                            nursery.start_soon(self.script, Responder(conn, event.stream_id, flush))
                        elif isinstance(event, h2.events.DataReceived):
                            conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                        elif isinstance(event, h2.events.StreamReset):
                            self.resets.append((event.stream_id, event.error_code))
                    await flush()
                nursery.cancel_scope.cancel()  # the client closed the connection
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass


@pytest.fixture
async def scripted(nursery: trio.Nursery) -> ScriptedServer:
    server = ScriptedServer()
    listeners = await nursery.start(partial(trio.serve_tcp, server.handle, 0, host="127.0.0.1"))
    server.port = listeners[0].socket.getsockname()[1]
    return server


# -- the stream's end ------------------------------------------------------------------------------------


async def test_listen_hands_over_every_message_in_order_and_returns_false_on_ok_end(channel):
    collector = Collector()
    with trio.fail_after(5):
        async with channel.unary_stream(GENERATE_STREAM, request("stream", text="t", n=5), None) as stream:
            result = await stream.listen(collector)
            assert stream.trailing_metadata == ()
    assert result is False
    assert collector.received == [payload(i, "t") for i in range(5)]
    assert channel._conn.calls == {}


async def test_listen_sets_the_trailing_metadata_of_an_ok_end(scripted):
    async def script(r: Responder) -> None:
        await r.headers()
        await scripted.go.wait()
        await r.messages(payload(0, "a"), payload(1, "b"), payload(2, "c"))
        await r.trailers(0, (("x-trailer", "yes"), ("x-count", "3")))

    scripted.script = script
    collector = Collector()
    with trio.fail_after(5):
        async with open_channel("127.0.0.1", scripted.port) as channel:
            async with channel.unary_stream(GENERATE_STREAM, request("stream"), None) as stream:
                scripted.go.set()  # (the script cannot run before listen() has installed the listener)
                assert await stream.listen(collector) is False
                assert tuple(stream.trailing_metadata) == (("x-trailer", "yes"), ("x-count", "3"))
            # Every message came from the connection's reader task, none from ours.
            me = trio.lowlevel.current_task()
            assert len(collector.tasks) == 3 and me not in collector.tasks
    assert collector.received == [payload(0, "a"), payload(1, "b"), payload(2, "c")]
    assert scripted.resets == []  # the stream had ended: nothing to reset


async def test_error_status_after_messages_raises_after_handing_them_over(channel):
    collector = Collector()
    with trio.fail_after(5):
        with pytest.raises(RpcError) as info:
            async with channel.unary_stream(
                GENERATE_STREAM,
                request("stream", text="late failure", n=3, interval_ms=5, fail_code=StatusCode.ABORTED),
                None,
            ) as stream:
                await stream.listen(collector)
    assert (info.value.code, info.value.message) == (StatusCode.ABORTED, "late failure")
    assert collector.received == [payload(i, "late failure") for i in range(3)]
    assert channel._conn.calls == {}


@pytest.mark.parametrize(
    ("error_code", "status", "message"),
    [
        (h2.errors.ErrorCodes.CANCEL, StatusCode.CANCELLED, "stream cancelled by the server"),
        (h2.errors.ErrorCodes.INTERNAL_ERROR, StatusCode.INTERNAL, "stream reset by the server (error code 2)"),
    ],
)
async def test_stream_reset_by_the_server_raises_after_the_messages_before_it(scripted, error_code, status, message):
    async def script(r: Responder) -> None:
        await r.headers()
        await scripted.go.wait()
        await r.messages(payload(0), payload(1))
        await r.reset(error_code)

    scripted.script = script
    collector = Collector()
    with trio.fail_after(5):
        async with open_channel("127.0.0.1", scripted.port) as channel:
            with pytest.raises(RpcError) as info:
                async with channel.unary_stream(GENERATE_STREAM, request("stream"), None) as stream:
                    scripted.go.set()
                    await stream.listen(collector)
            assert (info.value.code, info.value.message) == (status, message)
            assert not channel.broken
    assert collector.received == [payload(0), payload(1)]


async def test_lost_connection_while_listening_raises_connection_lost(recorder):
    collector = Collector()
    with trio.fail_after(5):
        async with trio.open_nursery() as server_nursery:
            server = await server_nursery.start(serve_grpc, [TrioEcho(recorder)])

            def listener(data: bytes) -> bool:
                collector(data)
                server_nursery.cancel_scope.cancel()  # the server goes away after the first message
                return False

            async with open_channel("127.0.0.1", server.port) as channel:
                with pytest.raises(ConnectionLostError) as info:
                    async with channel.unary_stream(
                        GENERATE_STREAM, request("stream", n=10, interval_ms=60_000), None
                    ) as stream:
                        await stream.listen(listener)
                assert info.value.code is StatusCode.UNAVAILABLE
                assert channel.broken
    assert collector.received == [payload(0)]


# -- stopping early --------------------------------------------------------------------------------------


async def test_listener_returning_true_stops_delivery_and_leaving_the_block_resets_the_stream(channel, target):
    recorder = target.recorder
    collector = Collector(stop_at=1)
    with trio.fail_after(5):
        async with channel.unary_stream(
            GENERATE_STREAM, request("stream", n=100_000, interval_ms=10, key="stopped"), None
        ) as stream:
            assert await stream.listen(collector) is True
            assert indexes(collector.received) == [0, 1]
            # The stream stays open: the next message is there for the owner, not for the listener.
            assert R.FromString(await stream.__anext__()).outputs.index == 2
            assert len(collector.received) == 2
            assert "stopped" not in recorder.cancelled
        await wait_for(lambda: "stopped" in recorder.cancelled)
    assert len(collector.received) == 2
    assert recorder.produced["stopped"] < 100_000
    assert (await channel.unary_unary(GENERATE, request("echo", text="still usable"), R)).outputs.text == "still usable"


async def test_listener_true_on_a_buffered_message_leaves_the_rest_for_iteration_then_rst_cancel(scripted):
    async def script(r: Responder) -> None:
        await r.headers()
        await r.messages(payload(0), payload(1), payload(2))
        await scripted.go.wait()
        await r.messages(payload(3))
        await trio.sleep_forever()  # no trailers: the client has to reset the stream

    scripted.script = script
    collector = Collector(stop_at=1)
    with trio.fail_after(5):
        async with open_channel("127.0.0.1", scripted.port) as channel:
            async with channel.unary_stream(GENERATE_STREAM, request("stream"), None) as stream:
                await wait_for(lambda: len(stream._call.messages) == 3)
                assert await stream.listen(collector) is True
                assert collector.received == [payload(0), payload(1)]
                assert await stream.__anext__() == payload(2)
                scripted.go.set()
                assert await stream.__anext__() == payload(3)
                stream_id = stream._call.stream_id
            await wait_for(lambda: scripted.resets != [])
            assert scripted.resets == [(stream_id, h2.errors.ErrorCodes.CANCEL)]
    assert collector.received == [payload(0), payload(1)]


async def test_cancelling_the_listening_task_resets_the_stream(channel, target):
    recorder = target.recorder
    seen: list[bytes] = []
    with trio.fail_after(5):
        with trio.CancelScope() as scope:
            async with channel.unary_stream(
                GENERATE_STREAM, request("stream", n=100_000, interval_ms=10, key="cancelled"), None
            ) as stream:

                def listener(data: bytes) -> bool:
                    seen.append(data)
                    if len(seen) == 3:
                        scope.cancel()
                    return False

                await stream.listen(listener)
                pytest.fail("listen() returned in a cancelled scope")  # pragma: no cover
        assert scope.cancelled_caught
        left = len(seen)
        await wait_for(lambda: "cancelled" in recorder.cancelled)
    assert indexes(seen) == list(range(left)) and left >= 3
    assert len(seen) == left  # nothing was handed over after the block was left
    assert channel._conn.calls == {}
    assert (await channel.unary_unary(GENERATE, request("echo", text="after"), R)).outputs.text == "after"


# -- flow control, buffering, failures -------------------------------------------------------------------


async def test_stream_larger_than_the_flow_control_window_completes_while_listening(target):
    # A 16 KiB message limit makes the stream's receive window 32 KiB (twice the limit, as grpc-core; the
    # connection window is 1 GiB): 2000 messages of 1 KiB get through only if each delivery is credited.
    text = "k" * 1024
    collector = Collector()
    with trio.fail_after(20):
        async with open_channel("127.0.0.1", target.port, max_message_length=16 * 1024) as channel:
            async with channel.unary_stream(GENERATE_STREAM, request("stream", text=text, n=2000), None) as stream:
                window = channel._conn.protocol.h2_connection.streams[
                    stream._call.stream_id
                ]._inbound_window_manager.max_window_size
                assert window == 32 * 1024
                assert await stream.listen(collector) is False
            assert not channel.broken
            assert (await channel.unary_unary(GENERATE, request("echo", text="after"), R)).outputs.text == "after"
    assert len(collector.received) == 2000
    assert collector.received == [payload(i, text) for i in range(2000)]


async def test_buffered_messages_are_handed_over_first_from_the_callers_task(scripted):
    async def script(r: Responder) -> None:
        await r.headers()
        await r.messages(payload(0), payload(1), payload(2))
        await scripted.go.wait()
        await r.messages(payload(3), payload(4), payload(5))
        await r.trailers(0)

    scripted.script = script
    received: list[bytes] = []
    tasks: list[object] = []

    def listener(data: bytes) -> bool:
        received.append(data)
        tasks.append(trio.lowlevel.current_task())
        if len(received) == 3:
            scripted.go.set()  # only now does the server send the rest
        return False

    me = trio.lowlevel.current_task()
    with trio.fail_after(5):
        async with (
            open_channel("127.0.0.1", scripted.port) as channel,
            channel.unary_stream(GENERATE_STREAM, request("stream"), None) as stream,
        ):
            await wait_for(lambda: len(stream._call.messages) == 3)
            assert await stream.listen(listener) is False
    assert received == [payload(i) for i in range(6)]
    assert tasks[:3] == [me, me, me]
    assert me not in tasks[3:]


async def test_listen_after_the_stream_ended_hands_over_everything_and_returns_false(scripted):
    async def script(r: Responder) -> None:
        await r.headers()
        await r.messages(payload(0), payload(1))
        await r.trailers(0, (("x-done", "1"),))

    scripted.script = script
    collector = Collector()
    me = trio.lowlevel.current_task()
    with trio.fail_after(5):
        async with (
            open_channel("127.0.0.1", scripted.port) as channel,
            channel.unary_stream(GENERATE_STREAM, request("stream"), None) as stream,
        ):
            await wait_for(lambda: stream._call.end is not None)
            assert await stream.listen(collector) is False
            assert tuple(stream.trailing_metadata) == (("x-done", "1"),)
    assert collector.received == [payload(0), payload(1)]
    assert collector.tasks == [me, me]


async def test_raising_listener_fails_only_its_own_call_with_internal(channel, target):
    seen: list[bytes] = []

    def listener(data: bytes) -> bool:
        seen.append(data)
        if len(seen) == 3:
            raise ValueError("listener bug")
        return False

    async def failing(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with pytest.raises(RpcError) as info:
            async with channel.unary_stream(
                GENERATE_STREAM, request("stream", n=100_000, interval_ms=5, key="failing"), None
            ) as stream:
                task_status.started()
                await stream.listen(listener)
        failures.append(info.value)

    failures: list[RpcError] = []
    with trio.fail_after(10):
        async with (
            channel.unary_stream(GENERATE_STREAM, request("stream", n=50, interval_ms=5, key="other"), R) as other,
            trio.open_nursery() as nursery,
        ):
            await nursery.start(failing)
            bystander = [m.outputs.index async for m in other]
    assert bystander == list(range(50))
    assert len(failures) == 1
    assert (failures[0].code, failures[0].message) == (
        StatusCode.INTERNAL,
        "response listener failed: ValueError('listener bug')",
    )
    assert indexes(seen) == [0, 1, 2]  # never called again after it raised
    assert "other" not in target.recorder.cancelled
    assert not channel.broken
    assert (await channel.unary_unary(GENERATE, request("echo", text="ok"), R, timeout=5)).outputs.text == "ok"


async def test_raising_listener_resets_its_stream(scripted):
    async def script(r: Responder) -> None:
        await r.headers()
        await scripted.go.wait()
        await r.messages(payload(0), payload(1))
        await trio.sleep_forever()  # no trailers: only a reset ends this stream

    def listener(data: bytes) -> bool:
        raise ValueError("listener bug")

    scripted.script = script
    with trio.fail_after(5):
        async with open_channel("127.0.0.1", scripted.port) as channel:
            with pytest.raises(RpcError) as info:
                async with channel.unary_stream(GENERATE_STREAM, request("stream"), None) as stream:
                    stream_id = stream._call.stream_id
                    scripted.go.set()  # (both messages reach the listener from the reader task)
                    await stream.listen(listener)
            assert (info.value.code, info.value.message) == (
                StatusCode.INTERNAL,
                "response listener failed: ValueError('listener bug')",
            )
            # The abandoned stream is reset (the server stops producing and the stream slot is freed).
            await wait_for(lambda: scripted.resets != [], timeout=1.0)
            assert scripted.resets == [(stream_id, h2.errors.ErrorCodes.CANCEL)]


async def test_raising_listener_on_a_buffered_message_fails_the_call_with_internal(scripted):
    async def script(r: Responder) -> None:
        await r.headers()
        await r.messages(payload(0))
        await trio.sleep_forever()

    def listener(data: bytes) -> bool:
        raise ValueError("listener bug")

    scripted.script = script
    with trio.fail_after(5):
        async with open_channel("127.0.0.1", scripted.port) as channel:
            try:
                async with channel.unary_stream(GENERATE_STREAM, request("stream"), None) as stream:
                    await wait_for(lambda: len(stream._call.messages) == 1)
                    await stream.listen(listener)
            except RpcError as exc:
                error = exc
            else:
                pytest.fail("listen() returned although the listener raised")
    assert (error.code, error.message) == (StatusCode.INTERNAL, "response listener failed: ValueError('listener bug')")


# -- flush: the end of each run of messages handed over together -----------------------------------------


class RunLog:
    """A listener and its ``flush``: logs ``m<index>`` per message and ``"flush"`` per flush, in order.

    ``flush`` returns True on its ``stop_at``-th call (1-based) or raises on its ``raise_at``-th call.
    """

    def __init__(self, stop_at: int | None = None, raise_at: int | None = None) -> None:
        self.log: list[str] = []
        self.flushes = 0
        self.stop_at = stop_at
        self.raise_at = raise_at

    def listener(self, data: bytes) -> bool:
        self.log.append(f"m{R.FromString(data).outputs.index}")
        return False

    def flush(self) -> bool:
        self.flushes += 1
        self.log.append("flush")
        if self.flushes == self.raise_at:
            raise ValueError("flush bug")
        return self.flushes == self.stop_at

    def messages(self) -> list[str]:
        return [entry for entry in self.log if entry != "flush"]

    def flushes_follow_runs(self) -> bool:
        """No flush without a message before it since the previous flush, and the last run flushed."""
        return (
            self.log[-1:] == ["flush"]
            and self.log[0] != "flush"
            and all(not (a == b == "flush") for a, b in itertools.pairwise(self.log))
        )


async def listen_then_go(scripted: ScriptedServer, runs: RunLog) -> None:
    """Open a stream, listen with ``runs`` from the reader task, then let the script go on (``scripted.go``);
    returns once the stream ended."""
    with trio.fail_after(5):
        async with (
            open_channel("127.0.0.1", scripted.port) as channel,
            channel.unary_stream(GENERATE_STREAM, request("stream"), None) as stream,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(partial(stream.listen, runs.listener, runs.flush))
            await wait_for(lambda: stream._call.listener is not None)
            scripted.go.set()


async def test_flush_follows_the_buffered_messages_once(scripted):
    async def script(r: Responder) -> None:
        await r.headers()
        await r.messages(payload(0), payload(1), payload(2))
        await r.trailers(0)

    scripted.script = script
    runs = RunLog()
    with trio.fail_after(5):
        async with (
            open_channel("127.0.0.1", scripted.port) as channel,
            channel.unary_stream(GENERATE_STREAM, request("stream"), None) as stream,
        ):
            await wait_for(lambda: stream._call.end is not None)
            assert await stream.listen(runs.listener, runs.flush) is False
    assert runs.log == ["m0", "m1", "m2", "flush"]


async def test_no_flush_without_messages(scripted):
    async def script(r: Responder) -> None:
        await r.headers()
        await scripted.go.wait()
        await r.trailers(0)

    scripted.script = script
    runs = RunLog()
    await listen_then_go(scripted, runs)
    assert runs.log == []


async def test_every_run_ends_with_a_flush_before_the_end_is_reported(channel):
    runs = RunLog()
    with trio.fail_after(5):
        async with channel.unary_stream(GENERATE_STREAM, request("stream", n=30, interval_ms=1), None) as stream:
            assert await stream.listen(runs.listener, runs.flush) is False
    assert runs.messages() == [f"m{i}" for i in range(30)]
    assert runs.flushes_follow_runs()  # (the last run was flushed before listen() returned)
    assert 1 <= runs.flushes <= 30


async def test_flush_in_the_reader_task_ends_the_run_before_the_next_messages_arrive(scripted):
    async def script(r: Responder) -> None:
        await r.headers()
        await scripted.go.wait()
        await r.messages(payload(0), payload(1))  # one write: one run
        await wait_for(lambda: runs.flushes == 1)
        await r.messages(payload(2))
        await r.trailers(0)

    scripted.script = script
    runs = RunLog()
    await listen_then_go(scripted, runs)
    # A run is what one read delivered (two messages in one write may still come in two reads), but m2 was
    # only sent after a flush, so a flush separates it from m0, and the last run was flushed too.
    assert runs.messages() == ["m0", "m1", "m2"]
    assert "flush" in runs.log[runs.log.index("m0") : runs.log.index("m2")]
    assert runs.flushes_follow_runs()


async def test_flush_returning_true_stops_delivery_and_leaving_the_block_resets_the_stream(scripted):
    async def script(r: Responder) -> None:
        await r.headers()
        await r.messages(payload(0), payload(1))
        await scripted.go.wait()
        await r.messages(payload(2))
        await trio.sleep_forever()  # no trailers: the client has to reset the stream

    scripted.script = script
    runs = RunLog(stop_at=1)
    with trio.fail_after(5):
        async with open_channel("127.0.0.1", scripted.port) as channel:
            async with channel.unary_stream(GENERATE_STREAM, request("stream"), None) as stream:
                await wait_for(lambda: len(stream._call.messages) == 2)
                assert await stream.listen(runs.listener, runs.flush) is True
                scripted.go.set()
                assert await stream.__anext__() == payload(2)  # for the owner, not the listener
                stream_id = stream._call.stream_id
            await wait_for(lambda: scripted.resets != [])
            assert scripted.resets == [(stream_id, h2.errors.ErrorCodes.CANCEL)]
    assert runs.log == ["m0", "m1", "flush"]


async def test_raising_flush_fails_only_its_own_call_with_internal_and_resets_its_stream(scripted):
    async def script(r: Responder) -> None:
        await r.headers()
        await scripted.go.wait()
        await r.messages(payload(0))
        await trio.sleep_forever()

    scripted.script = script
    runs = RunLog(raise_at=1)
    with trio.fail_after(5):
        async with open_channel("127.0.0.1", scripted.port) as channel:
            with pytest.raises(RpcError) as info:
                async with channel.unary_stream(GENERATE_STREAM, request("stream"), None) as stream:
                    stream_id = stream._call.stream_id
                    scripted.go.set()
                    await stream.listen(runs.listener, runs.flush)
            assert (info.value.code, info.value.message) == (
                StatusCode.INTERNAL,
                "response listener failed: ValueError('flush bug')",
            )
            await wait_for(lambda: scripted.resets != [], timeout=1.0)
            assert scripted.resets == [(stream_id, h2.errors.ErrorCodes.CANCEL)]
            assert not channel.broken
    assert runs.log == ["m0", "flush"]


# -- misuse and deadlines --------------------------------------------------------------------------------


async def test_listen_with_a_response_type_raises_runtime_error_and_leaves_the_stream_alone(channel):
    collector = Collector()
    with trio.fail_after(5):
        async with channel.unary_stream(GENERATE_STREAM, request("stream", text="t", n=3), R) as stream:
            with pytest.raises(RuntimeError, match="response_type=None"):
                await stream.listen(collector)
            assert [(m.outputs.index, m.outputs.text) async for m in stream] == [(0, "t"), (1, "t"), (2, "t")]
    assert collector.received == []


async def test_listen_before_entering_the_block_raises_runtime_error(channel):
    stream = channel.unary_stream(GENERATE_STREAM, request("stream", n=3), None)
    with pytest.raises(RuntimeError, match="async with"):
        await stream.listen(Collector())


async def test_deadline_exceeded_while_listening(channel, target):
    collector = Collector()
    started = time.monotonic()
    with trio.fail_after(5):
        with pytest.raises(RpcError) as info:
            async with channel.unary_stream(
                GENERATE_STREAM, request("stream", n=1000, interval_ms=50, key="late"), None, timeout=0.3
            ) as stream:
                await stream.listen(collector)
    elapsed = time.monotonic() - started
    assert info.value.code is StatusCode.DEADLINE_EXCEEDED
    assert 0.29 <= elapsed < 1.5
    assert 1 <= len(collector.received) < 100
    assert indexes(collector.received) == list(range(len(collector.received)))
    await wait_for(lambda: "late" in target.recorder.finished)
    assert channel._conn.calls == {}
