"""Messages that do not parse fail their call with INTERNAL, on both sides, and only their call.

Real sockets on 127.0.0.1; the bytes that do not parse are a truncated protobuf tag (``b"\\xff\\xff"``).
"""

from __future__ import annotations

from typing import Any

import pytest
import trio

from trio_sidecar._proto.vllm import inference_grpc
from trio_sidecar._proto.vllm import inference_pb2 as pb
from trio_sidecar.core.status import StatusCode
from trio_sidecar.transport import FramedMessages, RpcError, open_channel, serve_grpc

GENERATE = "/vllm.Inference/Generate"
GENERATE_STREAM = "/vllm.Inference/GenerateStream"
GARBAGE = b"\xff\xff"


class _Garbage:
    """Serializes to bytes no protobuf message parses from."""

    def SerializeToString(self) -> bytes:  # noqa: N802 (protobuf's name)
        return GARBAGE


class _Broken(inference_grpc.InferenceServicer):
    async def Generate(self, request: Any, context: Any) -> Any:  # noqa: N802
        if request.request_id == "garbage":
            return _Garbage()
        return pb.GenerateResponse(outputs=pb.SequenceOutput(text=request.text))

    async def GenerateStream(self, request: Any, context: Any) -> Any:  # noqa: N802
        yield pb.GenerateResponse(outputs=pb.SequenceOutput(index=0))
        yield FramedMessages.of([GARBAGE])
        await trio.sleep_forever()  # (the client must reset the stream: nothing else ends it)


@pytest.fixture
async def port(nursery: trio.Nursery) -> int:
    server = await nursery.start(serve_grpc, [_Broken()])
    return int(server.port)


async def test_a_unary_response_that_does_not_parse_fails_the_call_with_internal(port: int) -> None:
    with trio.fail_after(20):
        async with open_channel("127.0.0.1", port) as channel:
            with pytest.raises(RpcError) as caught:
                await channel.unary_unary(GENERATE, pb.GenerateRequest(request_id="garbage"), pb.GenerateResponse)
            assert caught.value.code == StatusCode.INTERNAL
            assert caught.value.message == f"failed to parse the response message of {GENERATE}"
            answer = await channel.unary_unary(GENERATE, pb.GenerateRequest(text="fine"), pb.GenerateResponse)
            assert answer.outputs.text == "fine"


async def test_a_streamed_response_that_does_not_parse_fails_and_closes_the_stream(port: int) -> None:
    with trio.fail_after(20):
        async with open_channel("127.0.0.1", port) as channel:
            async with channel.unary_stream(GENERATE_STREAM, pb.GenerateRequest(), pb.GenerateResponse) as stream:
                first = await stream.__anext__()
                assert first.outputs.index == 0
                with pytest.raises(RpcError) as caught:
                    await stream.__anext__()
                assert caught.value.code == StatusCode.INTERNAL
                assert caught.value.message == f"failed to parse a response message of {GENERATE_STREAM}"
                assert channel._conn.calls == {}  # closed (reset) at once
            assert not channel.broken


async def test_a_request_that_does_not_parse_is_answered_internal(port: int) -> None:
    with trio.fail_after(20):
        async with open_channel("127.0.0.1", port) as channel:
            with pytest.raises(RpcError) as caught:
                await channel.unary_unary(GENERATE, _Garbage(), pb.GenerateResponse)
            assert caught.value.code == StatusCode.INTERNAL
            assert caught.value.message == "failed to parse the request message"
