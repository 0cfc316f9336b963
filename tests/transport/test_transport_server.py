"""grpc.aio clients against our server (docs/reference/transport.md), plus server-only guarantees."""

from __future__ import annotations

import json
import logging
import time

import grpc
import pytest
import trio
from transport_peers import GENERATE, GENERATE_STREAM, MIB, aio_options, aio_stream, aio_unary, request, status_of

from trio_sidecar._proto.vllm import inference_grpc
from trio_sidecar._proto.vllm import inference_pb2 as pb
from trio_sidecar.core.status import StatusCode
from trio_sidecar.transport import FramedMessages, RpcError, open_channel, serve_grpc
from trio_sidecar.transport._wire import frame_message


async def wait_for(predicate, timeout: float = 2.0) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.002)


@pytest.fixture
def server_logs(caplog):
    caplog.set_level(logging.DEBUG, logger="trio_sidecar.transport")
    return caplog


class AioClient:
    """One grpc.aio channel to ``port``, driven from Trio through the aio thread."""

    def __init__(self, aio, port: int, max_message_length: int = 64 * MIB) -> None:
        self.aio = aio
        self.port = port
        self.max_message_length = max_message_length
        self.channel = None

    async def __aenter__(self):
        async def make():
            return grpc.aio.insecure_channel(f"127.0.0.1:{self.port}", options=aio_options(self.max_message_length))

        self.channel = await self.aio.call(make)
        return self

    async def __aexit__(self, *exc_info):
        channel, self.channel = self.channel, None
        await self.aio.call(lambda: channel.close())

    async def unary(self, req, **kw):
        return await self.aio.call(lambda: aio_unary(self.channel, req, **kw))

    async def unary_error(self, req, **kw):
        async def run():
            try:
                await aio_unary(self.channel, req, **kw)
            except grpc.aio.AioRpcError as error:
                return error
            raise AssertionError("the call succeeded")

        return await self.aio.call(run)

    async def collect(self, req, **kw):
        async def run():
            call = aio_stream(self.channel, req, **kw)
            return [m.outputs.index async for m in call]

        return await self.aio.call(run)


@pytest.fixture
async def aio_client(aio, our_server):
    async with AioClient(aio, our_server.port) as client:
        yield client


async def test_unary_and_metadata_from_grpc_aio(aio_client):
    assert (await aio_client.unary(request("echo", text="héllo"))).outputs.text == "héllo"
    response = await aio_client.unary(request("metadata"), metadata=(("x-data-parallel-rank", "3"),))
    assert json.loads(response.outputs.text) == [["x-data-parallel-rank", "3"]]


@pytest.mark.parametrize(
    ("code", "message"),
    [(StatusCode.NOT_FOUND, "service not registered"), (StatusCode.INVALID_ARGUMENT, "100% ünïcödé\nline %41")],
)
async def test_status_and_percent_encoded_message_reach_grpc_aio(aio_client, aio, code, message):
    error = await aio_client.unary_error(request("fail", text=message, interval_ms=int(code)))
    assert status_of(error) == (code, message)
    assert ("x-trailer", "yes") in tuple(error.trailing_metadata())


async def test_handler_exception_is_unknown_with_a_generic_message_and_is_logged(aio_client, server_logs):
    error = await aio_client.unary_error(request("boom"))
    assert status_of(error) == (StatusCode.UNKNOWN, "unexpected server error")
    assert "secret" not in (error.details() or "")
    logged = [r for r in server_logs.records if r.exc_info and "secret detail" in str(r.exc_info[1])]
    assert len(logged) == 1


async def test_unknown_method_is_unimplemented_for_grpc_aio(aio, our_server):
    async with AioClient(aio, our_server.port) as client:

        async def run():
            method = client.channel.unary_unary(
                "/vllm.Inference/Nope", request_serializer=pb.GenerateRequest.SerializeToString
            )
            try:
                await method(request("echo"))
            except grpc.aio.AioRpcError as error:
                return status_of(error)[0]

        assert await aio.call(run) is StatusCode.UNIMPLEMENTED


async def test_server_streaming_to_grpc_aio(aio_client, aio):
    assert await aio_client.collect(request("stream", n=20)) == list(range(20))

    async def failing():
        call = aio_stream(aio_client.channel, request("stream", n=3, text="bad", fail_code=StatusCode.ABORTED))
        got = []
        try:
            async for message in call:
                got.append(message.outputs.index)
        except grpc.aio.AioRpcError as error:
            return got, status_of(error)

    assert await aio.call(failing) == ([0, 1, 2], (StatusCode.ABORTED, "bad"))


@pytest.mark.parametrize("interval_ms", [10, 5_000], ids=["busy", "idle"])
async def test_grpc_aio_cancel_cancels_our_handler_within_100ms(aio_client, aio, recorder, interval_ms, server_logs):
    async def scenario():
        other = aio_stream(aio_client.channel, request("stream", n=40, interval_ms=5, key="other"))
        first = await other.read()
        call = aio_stream(aio_client.channel, request("stream", n=100_000, interval_ms=interval_ms, key="victim"))
        await call.read()
        cancelled_at = time.monotonic()
        call.cancel()
        rest = []
        while (message := await other.read()) is not grpc.aio.EOF:
            rest.append(message.outputs.index)
        return cancelled_at, [first.outputs.index, *rest]

    cancelled_at, other = await aio.call(scenario)
    assert other == list(range(40))
    await wait_for(lambda: "victim" in recorder.cancelled)
    assert recorder.cancelled["victim"] - cancelled_at < 0.1
    produced = recorder.produced["victim"]
    await trio.sleep(0.1)
    assert recorder.produced["victim"] == produced
    assert "other" not in recorder.cancelled
    assert [r for r in server_logs.records if r.levelno >= logging.WARNING] == []


async def test_client_disconnect_cancels_an_idle_handler_within_100ms(aio, our_server, recorder, server_logs):
    async with AioClient(aio, our_server.port) as client:

        async def start():
            call = aio_stream(client.channel, request("stream", n=10, interval_ms=5_000, key="orphan"))
            await call.read()

        await aio.call(start)
    closed_at = time.monotonic()
    await wait_for(lambda: "orphan" in recorder.cancelled)
    assert recorder.cancelled["orphan"] - closed_at < 0.1
    assert [r for r in server_logs.records if r.levelno >= logging.WARNING] == []


async def test_our_channel_close_cancels_an_idle_handler_within_100ms(our_server, recorder):
    async with open_channel("127.0.0.1", our_server.port) as channel:
        stream = channel.unary_stream(
            "/vllm.Inference/GenerateStream",
            request("stream", n=10, interval_ms=5_000, key="orphan"),
            pb.GenerateResponse,
        )
        await stream.__aenter__()
        await stream.__anext__()
    closed_at = time.monotonic()
    await wait_for(lambda: "orphan" in recorder.cancelled)
    assert recorder.cancelled["orphan"] - closed_at < 0.1


async def test_grpc_aio_deadline_is_enforced(aio_client, recorder):
    started = time.monotonic()
    error = await aio_client.unary_error(request("sleep", n=5_000, key="slow"), timeout=0.2)
    assert status_of(error)[0] is StatusCode.DEADLINE_EXCEEDED
    await wait_for(lambda: "slow" in recorder.cancelled)
    assert recorder.cancelled["slow"] - started < 1.0


async def test_server_enforces_grpc_timeout_on_its_own(our_server, recorder):
    # White-box: send grpc-timeout but do not enforce it locally, so only the server can end the call.
    async with open_channel("127.0.0.1", our_server.port) as channel:
        call = channel._start_call(GENERATE, (), 0.15)
        started = time.monotonic()
        await channel._conn.send_message(
            call, frame_message(request("sleep", n=5_000, key="s").SerializeToString()), True
        )
        with trio.fail_after(2):
            while call.end is None:
                await call.wait()
        call.close()
    assert call.status_error().code is StatusCode.DEADLINE_EXCEEDED
    assert call.status_error().message == "Deadline Exceeded"
    assert 0.14 <= recorder.cancelled["s"] - started < 1.0


async def test_oversize_request_from_grpc_aio_fails_only_that_call(aio, our_server, recorder):
    async with AioClient(aio, our_server.port, max_message_length=128 * MIB) as client:
        error = await client.unary_error(request("echo", text="q" * (64 * MIB + 1), key="huge"))
        assert status_of(error)[0] is StatusCode.RESOURCE_EXHAUSTED
        assert "huge" not in recorder.started
        assert (await client.unary(request("echo", text="next"))).outputs.text == "next"
    assert our_server.open_connections <= 1


async def test_server_limit_is_configurable(aio, nursery, recorder):
    from transport_peers import TrioEcho

    server = await nursery.start(
        lambda task_status: serve_grpc([TrioEcho(recorder)], max_message_length=MIB, task_status=task_status)
    )
    async with AioClient(aio, server.port) as client:
        error = await client.unary_error(request("echo", text="q" * (2 * MIB)))
        assert status_of(error)[0] is StatusCode.RESOURCE_EXHAUSTED
        error = await client.unary_error(request("big", n=2 * MIB))
        assert status_of(error)[0] is StatusCode.RESOURCE_EXHAUSTED
        assert (await client.unary(request("echo", text="fine"))).outputs.text == "fine"


async def test_our_client_gets_the_servers_resource_exhausted_for_an_oversize_request(nursery, recorder):
    from transport_peers import TrioEcho

    server = await nursery.start(
        lambda task_status: serve_grpc([TrioEcho(recorder)], max_message_length=MIB, task_status=task_status)
    )
    async with open_channel("127.0.0.1", server.port) as channel:
        # 3 MiB is more than the server's stream window (2 MiB): the client is mid-send when the answer comes.
        with trio.fail_after(10):
            with pytest.raises(RpcError) as info:
                await channel.unary_unary(
                    GENERATE, request("echo", text="q" * (3 * MIB), key="huge"), pb.GenerateResponse
                )
        assert info.value.code is StatusCode.RESOURCE_EXHAUSTED
        assert "huge" not in recorder.started
        assert (
            await channel.unary_unary(GENERATE, request("echo", text="ok"), pb.GenerateResponse)
        ).outputs.text == "ok"


class _FramedStreamer(inference_grpc.InferenceServicer):
    """Streams ``truncate_prompt_tokens`` messages (``outputs.index`` 0..n-1) in ``FramedMessages`` batches
    of ``priority`` messages; ``text`` pads every message (its length in bytes); ``top_k`` = index of an
    oversize message."""

    async def GenerateStream(self, request, context):  # noqa: N802
        batch: list[bytes] = []
        for i in range(request.truncate_prompt_tokens):
            pad = "x" * (2 * MIB if i == request.sampling.top_k and request.sampling.top_k else int(request.text or 0))
            batch.append(pb.GenerateResponse(outputs=pb.SequenceOutput(index=i, text=pad)).SerializeToString())
            if len(batch) == request.priority:
                yield FramedMessages.of(batch)
                batch = []
        yield FramedMessages.of(batch)  # possibly empty: sends nothing


def _framed_request(n: int, per_batch: int, pad: int = 0, oversize_at: int = 0) -> pb.GenerateRequest:
    req = pb.GenerateRequest(truncate_prompt_tokens=n, priority=per_batch, text=str(pad))
    req.sampling.top_k = oversize_at
    return req


async def test_framed_message_batches_reach_our_client_and_grpc_aio(aio, nursery):
    server = await nursery.start(
        lambda task_status: serve_grpc([_FramedStreamer()], max_message_length=MIB, task_status=task_status)
    )
    cases = [(1, 1, 0), (50, 7, 0), (50, 50, 10), (40, 40, 100_000)]  # the last batch exceeds the 64 KiB window
    async with open_channel("127.0.0.1", server.port) as channel:
        for n, per_batch, pad in cases:
            with trio.fail_after(10):
                async with channel.unary_stream(
                    GENERATE_STREAM, _framed_request(n, per_batch, pad), pb.GenerateResponse
                ) as stream:
                    got = [(m.outputs.index, len(m.outputs.text)) async for m in stream]
            assert got == [(i, pad) for i in range(n)]
    async with AioClient(aio, server.port) as client:
        for n, per_batch, pad in cases:
            assert await client.collect(_framed_request(n, per_batch, pad)) == list(range(n))


async def test_an_oversize_message_in_a_framed_batch_fails_after_the_ones_before_it(nursery):
    server = await nursery.start(
        lambda task_status: serve_grpc([_FramedStreamer()], max_message_length=MIB, task_status=task_status)
    )
    async with open_channel("127.0.0.1", server.port) as channel:
        got = []
        with trio.fail_after(10), pytest.raises(RpcError) as info:
            async with channel.unary_stream(
                GENERATE_STREAM, _framed_request(10, 10, 0, oversize_at=4), pb.GenerateResponse
            ) as stream:
                async for message in stream:
                    got.append(message.outputs.index)
    assert got == [0, 1, 2, 3]
    assert info.value.code is StatusCode.RESOURCE_EXHAUSTED
    assert info.value.message.startswith("trying to send message larger than max (")
