"""Our client against our server and against a grpc.aio server (docs/reference/transport.md).

Every test runs twice through the ``target`` fixture: ours → ours and ours → grpc.aio.
"""

from __future__ import annotations

import json
import time

import pytest
import trio
from transport_peers import GENERATE, GENERATE_STREAM, MIB, request

from trio_sidecar._proto.vllm import inference_pb2 as pb
from trio_sidecar.core.status import StatusCode
from trio_sidecar.transport import DEFAULT_MAX_MESSAGE_LENGTH, RpcError, open_channel

R = pb.GenerateResponse


async def wait_for(predicate, timeout: float = 2.0) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.002)


async def test_unary_round_trip(channel):
    response = await channel.unary_unary(GENERATE, request("echo", text="héllo"), R)
    assert response.outputs.text == "héllo"


async def test_per_call_metadata_reaches_the_server(channel):
    metadata = [("x-data-parallel-rank", "1"), ("x-other", "a b")]
    response = await channel.unary_unary(GENERATE, request("metadata"), R, metadata=metadata)
    assert json.loads(response.outputs.text) == [["x-data-parallel-rank", "1"], ["x-other", "a b"]]
    plain = await channel.unary_unary(GENERATE, request("metadata"), R)
    assert json.loads(plain.outputs.text) == []


@pytest.mark.parametrize(
    ("code", "message"),
    [
        (StatusCode.NOT_FOUND, "service not registered"),
        (StatusCode.INVALID_ARGUMENT, "100% sure: ünïcödé, tab\tand newline\nend"),
        (StatusCode.RESOURCE_EXHAUSTED, "%41 is not A; %%"),
    ],
)
async def test_status_code_and_percent_encoded_message_round_trip(channel, code, message):
    with pytest.raises(RpcError) as info:
        await channel.unary_unary(GENERATE, request("fail", text=message, interval_ms=int(code)), R)
    assert info.value.code is code
    assert info.value.message == message
    assert ("x-trailer", "yes") in info.value.trailing_metadata
    assert str(info.value) == f"{message} ({code.rust_name})"


async def test_handler_exception_is_unknown(channel, target):
    with pytest.raises(RpcError) as info:
        await channel.unary_unary(GENERATE, request("boom"), R)
    assert info.value.code is StatusCode.UNKNOWN
    if target.kind == "ours":
        assert info.value.message == "unexpected server error"


async def test_unknown_method_is_unimplemented(channel):
    with pytest.raises(RpcError) as info:
        await channel.unary_unary("/vllm.Inference/Nope", request("echo"), R)
    assert info.value.code is StatusCode.UNIMPLEMENTED


async def test_server_streaming_yields_every_message_then_ends(channel):
    async with channel.unary_stream(GENERATE_STREAM, request("stream", text="t", n=5), R) as stream:
        received = [(m.outputs.index, m.outputs.text) async for m in stream]
    assert received == [(i, "t") for i in range(5)]


async def test_stream_without_a_response_type_yields_serialized_messages(channel):
    # (as grpcio without a deserializer)
    with trio.fail_after(5):
        async with channel.unary_stream(GENERATE_STREAM, request("stream", text="t", n=5), None) as stream:
            received = [m async for m in stream]
    assert len(received) == 5 and all(type(m) is bytes for m in received)
    assert [(R.FromString(m).outputs.index, R.FromString(m).outputs.text) for m in received] == [
        (i, "t") for i in range(5)
    ]


async def test_stream_error_after_messages_raises_after_them(channel):
    got = []
    with pytest.raises(RpcError) as info:
        async with channel.unary_stream(
            GENERATE_STREAM, request("stream", text="late failure", n=3, fail_code=StatusCode.ABORTED), R
        ) as stream:
            async for message in stream:
                got.append(message.outputs.index)
    assert got == [0, 1, 2]
    assert (info.value.code, info.value.message) == (StatusCode.ABORTED, "late failure")


async def test_trailers_only_error_raises_when_opening_the_stream(channel):
    opened = False
    with pytest.raises(RpcError) as info:
        async with channel.unary_stream(
            GENERATE_STREAM, request("stream", text="rejected", n=0, fail_code=StatusCode.INVALID_ARGUMENT), R
        ):
            opened = True
    assert not opened
    assert (info.value.code, info.value.message) == (StatusCode.INVALID_ARGUMENT, "rejected")


# -- cancellation ----------------------------------------------------------------------------------------


class Boom(Exception):
    pass


async def _leave_stream(channel, how: str, key: str, interval_ms: int, after: int = 2) -> float:
    """Open a stream, read ``after`` messages, leave it in the way ``how``; returns the leave time."""
    req = request("stream", n=100_000, interval_ms=interval_ms, key=key)
    if how == "cancel":
        with trio.CancelScope() as scope:
            async with channel.unary_stream(GENERATE_STREAM, req, R) as stream:
                seen = 0
                async for _ in stream:
                    seen += 1
                    if seen == after:
                        left = time.monotonic()
                        scope.cancel()
                        await trio.sleep(1)  # cancelled here
        assert scope.cancelled_caught
        return left
    if how == "exception":
        with pytest.raises(Boom):
            async with channel.unary_stream(GENERATE_STREAM, req, R) as stream:
                seen = 0
                async for _ in stream:
                    seen += 1
                    if seen == after:
                        left = time.monotonic()
                        raise Boom
        return left
    if how == "aclose":
        async with channel.unary_stream(GENERATE_STREAM, req, R) as stream:
            for _ in range(after):
                await stream.__anext__()
            await stream.aclose()
            left = time.monotonic()
            with pytest.raises(RuntimeError):
                await stream.__anext__()
        return left
    async with channel.unary_stream(GENERATE_STREAM, req, R) as stream:
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == after:
                break
    return time.monotonic()


@pytest.mark.parametrize("how", ["break", "cancel", "exception", "aclose"])
async def test_leaving_a_stream_resets_it_and_the_server_stops_within_100ms(channel, target, how):
    recorder = target.recorder
    async with channel.unary_stream(GENERATE_STREAM, request("stream", n=50, interval_ms=5, key="other"), R) as other:
        first = await other.__anext__()
        left = await _leave_stream(channel, how, "abandoned", interval_ms=10)
        await wait_for(lambda: "abandoned" in recorder.cancelled)
        assert recorder.cancelled["abandoned"] - left < 0.1
        produced = recorder.produced["abandoned"]
        await trio.sleep(0.2)
        assert recorder.produced["abandoned"] == produced  # nothing more was sent
        rest = [m.outputs.index async for m in other]
    assert [first.outputs.index, *rest] == list(range(50))  # the other stream was unaffected
    assert "other" not in recorder.cancelled
    assert (await channel.unary_unary(GENERATE, request("echo", text="still usable"), R)).outputs.text == "still usable"


async def test_idle_server_handler_is_cancelled_within_100ms_of_reset(channel, target):
    left = await _leave_stream(channel, "break", "idle", interval_ms=5_000, after=1)
    await wait_for(lambda: "idle" in target.recorder.cancelled)
    assert target.recorder.cancelled["idle"] - left < 0.1


async def test_cancelled_unary_call_resets_its_stream(channel, target):
    with trio.move_on_after(0.2):
        await channel.unary_unary(GENERATE, request("sleep", n=5_000, key="unary-cancel"), R)
    left = time.monotonic()
    await wait_for(lambda: "unary-cancel" in target.recorder.cancelled)
    assert target.recorder.cancelled["unary-cancel"] - left < 0.1


# -- deadlines -------------------------------------------------------------------------------------------


async def test_timeout_is_sent_as_grpc_timeout(channel):
    assert (await channel.unary_unary(GENERATE, request("timeout"), R, timeout=10)).outputs.text == "1"
    assert (await channel.unary_unary(GENERATE, request("timeout"), R)).outputs.text == "0"


async def test_unary_deadline_exceeded(channel, target):
    started = time.monotonic()
    with pytest.raises(RpcError) as info:
        await channel.unary_unary(GENERATE, request("sleep", n=5_000, key="late"), R, timeout=0.2)
    elapsed = time.monotonic() - started
    assert info.value.code is StatusCode.DEADLINE_EXCEEDED
    assert 0.19 <= elapsed < 1.5
    await wait_for(lambda: "late" in target.recorder.cancelled)


async def test_stream_deadline_exceeded_while_iterating(channel):
    got = []
    with pytest.raises(RpcError) as info:
        async with channel.unary_stream(
            GENERATE_STREAM, request("stream", n=1000, interval_ms=50), R, timeout=0.3
        ) as s:
            async for message in s:
                got.append(message.outputs.index)
    assert info.value.code is StatusCode.DEADLINE_EXCEEDED
    assert 1 <= len(got) < 100


async def test_non_positive_timeout_fails_without_sending(channel, target):
    with pytest.raises(RpcError) as info:
        await channel.unary_unary(GENERATE, request("echo", key="never"), R, timeout=0)
    assert info.value.code is StatusCode.DEADLINE_EXCEEDED
    await trio.sleep(0.05)
    assert "never" not in target.recorder.started


# -- message size ----------------------------------------------------------------------------------------


async def test_default_limit_is_64_mib_and_5_mib_messages_pass(channel):
    assert channel.max_message_length == DEFAULT_MAX_MESSAGE_LENGTH == 64 * MIB
    response = await channel.unary_unary(GENERATE, request("echo", text="y" * (5 * MIB)), R)
    assert len(response.outputs.text) == 5 * MIB
    big = await channel.unary_unary(GENERATE, request("big", n=5 * MIB), R)
    assert len(big.outputs.text) == 5 * MIB


async def test_oversize_request_fails_locally_with_resource_exhausted(target):
    async with open_channel("127.0.0.1", target.port, max_message_length=1 * MIB) as channel:
        with pytest.raises(RpcError) as info:
            await channel.unary_unary(GENERATE, request("echo", text="z" * (2 * MIB), key="too-big"), R)
        assert info.value.code is StatusCode.RESOURCE_EXHAUSTED
        assert "too-big" not in target.recorder.started
        assert (await channel.unary_unary(GENERATE, request("echo", text="ok"), R)).outputs.text == "ok"


async def test_oversize_response_fails_only_its_own_call(target):
    async with open_channel("127.0.0.1", target.port, max_message_length=1 * MIB) as channel:
        async with channel.unary_stream(GENERATE_STREAM, request("stream", n=30, interval_ms=5), R) as bystander:
            with pytest.raises(RpcError) as info:
                await channel.unary_unary(GENERATE, request("big", n=2 * MIB), R)
            assert info.value.code is StatusCode.RESOURCE_EXHAUSTED
            got = []
            with pytest.raises(RpcError) as stream_info:
                async with channel.unary_stream(GENERATE_STREAM, request("big", n=2 * MIB), R) as big:
                    async for message in big:
                        got.append(message.outputs.index)
            assert stream_info.value.code is StatusCode.RESOURCE_EXHAUSTED
            assert got == [0]
            assert [m.outputs.index async for m in bystander] == list(range(30))
        assert not channel.broken
        assert (await channel.unary_unary(GENERATE, request("big", n=MIB // 2), R)).outputs.text == "x" * (MIB // 2)


async def test_producer_that_never_waits_is_cancelled_within_100ms_of_reset(channel, target):
    left = await _leave_stream(channel, "break", "tight", interval_ms=0)
    # Stopped while suspended at a yield: the generator is closed (GeneratorExit), not cancelled inside.
    await wait_for(lambda: "tight" in target.recorder.finished)
    assert target.recorder.finished["tight"] - left < 0.1
    assert target.recorder.produced["tight"] < 100_000
    assert (await channel.unary_unary(GENERATE, request("echo", text="after"), R)).outputs.text == "after"


async def test_calls_wait_for_a_free_stream_when_the_server_limits_concurrency(aio, recorder):
    from transport_peers import AioServer, aio_options

    class LimitedServer(AioServer):
        async def start(self) -> None:
            import grpc
            from transport_peers import _aio_handlers

            async def start() -> int:
                self.server = grpc.aio.server(options=[*aio_options(), ("grpc.max_concurrent_streams", 2)])
                self.server.add_generic_rpc_handlers(_aio_handlers(self.recorder))
                port = self.server.add_insecure_port("127.0.0.1:0")
                await self.server.start()
                return port

            self.port = await self.aio.call(start)

    server = LimitedServer(aio, recorder)
    await server.start()
    try:
        async with open_channel("127.0.0.1", server.port) as channel:
            await channel.unary_unary(GENERATE, request("echo"), R)  # SETTINGS with the limit have arrived
            results = []

            async def stream(i: int) -> None:
                async with channel.unary_stream(GENERATE_STREAM, request("stream", n=3, interval_ms=50), R) as s:
                    results.append((i, len([m async for m in s])))

            async with trio.open_nursery() as nursery:
                for i in range(5):
                    nursery.start_soon(stream, i)
                await trio.sleep(0.02)
                # Two streams are open; a third call waits for a slot and its deadline still applies.
                with pytest.raises(RpcError) as info:
                    await channel.unary_unary(GENERATE, request("echo"), R, timeout=0.05)
                assert info.value.code is StatusCode.DEADLINE_EXCEEDED
            assert sorted(results) == [(i, 3) for i in range(5)]
    finally:
        await server.stop()


async def test_many_concurrent_calls_share_one_channel(channel):
    results = {}

    async def unary(i: int) -> None:
        results[i] = (await channel.unary_unary(GENERATE, request("echo", text=str(i)), R, timeout=30)).outputs.text

    async def stream(i: int) -> None:
        async with channel.unary_stream(GENERATE_STREAM, request("stream", text=str(i), n=10), R, timeout=30) as s:
            results[-1 - i] = "".join([m.outputs.text async for m in s])

    async with trio.open_nursery() as nursery:
        for i in range(300):
            nursery.start_soon(unary, i)
            nursery.start_soon(stream, i)
    assert results == {**{i: str(i) for i in range(300)}, **{-1 - i: str(i) * 10 for i in range(300)}}
    assert channel._conn.calls == {}
