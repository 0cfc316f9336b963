"""``ChannelPool.unary`` and ``ChannelPool.stream``: the one edge where gRPC errors become ``SidecarError``.

Real sockets on 127.0.0.1: our transport's server (``TrioEcho`` + health) and a pool connected to it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio
from transport_peers import GENERATE, GENERATE_STREAM, request

from trio_sidecar._proto.grpc.health.v1 import health_pb2
from trio_sidecar._proto.vllm import inference_pb2 as pb
from trio_sidecar.core.config import SidecarConfig
from trio_sidecar.core.endpoint import parse_grpc_endpoint
from trio_sidecar.core.errors import CannotConnect, InvalidArgument, SidecarError, UnknownError
from trio_sidecar.core.status import StatusCode
from trio_sidecar.shell.pool import ChannelPool, open_channel_pool
from trio_sidecar.transport import ConnectionLostError, RpcError

WATCH = "/grpc.health.v1.Health/Watch"


@pytest.fixture
async def pool(our_server: Any) -> AsyncIterator[ChannelPool]:
    config = SidecarConfig(grpc_endpoint=f"127.0.0.1:{our_server.port}", grpc_connections=2)
    endpoint = parse_grpc_endpoint(config.grpc_endpoint)
    with trio.fail_after(20):
        async with open_channel_pool(endpoint, config, deadline=trio.current_time() + 15) as opened:
            yield opened


async def test_stream_yields_the_responses_and_ends_with_ok(pool: ChannelPool) -> None:
    with trio.fail_after(20):
        async with pool.stream(
            "GenerateStream", GENERATE_STREAM, request("s", text="t", n=3), pb.GenerateResponse
        ) as responses:
            got = [response.outputs.index async for response in responses]
    assert got == [0, 1, 2]


async def test_stream_translates_a_status_raised_on_entering(pool: ChannelPool) -> None:
    # A trailers-only answer: the health servicer does not know the service.
    missing = health_pb2.HealthCheckRequest(service="nope")
    with trio.fail_after(20), pytest.raises(InvalidArgument) as caught:
        async with pool.stream("Health.Watch", WATCH, missing, health_pb2.HealthCheckResponse):
            raise AssertionError("the stream must not open")
    err = caught.value
    assert str(err) == "Health.Watch: service not registered (NotFound)"
    assert (err.grpc_code, err.grpc_message) == (StatusCode.NOT_FOUND, "service not registered")
    assert isinstance(err.__cause__, RpcError)


async def test_stream_translates_a_status_raised_while_iterating(pool: ChannelPool) -> None:
    failing = request("s", text="broken engine", n=2, fail_code=int(StatusCode.INTERNAL))
    seen = []
    with trio.fail_after(20), pytest.raises(UnknownError) as caught:
        async with pool.stream("GenerateStream", GENERATE_STREAM, failing, pb.GenerateResponse) as responses:
            async for response in responses:
                seen.append(response.outputs.index)
    assert seen == [0, 1]
    assert str(caught.value) == "GenerateStream: broken engine (Internal)"
    assert caught.value.grpc_code == StatusCode.INTERNAL


async def test_stream_translates_a_status_raised_from_listen(pool: ChannelPool) -> None:
    failing = request("s", text="gone", n=3, fail_code=int(StatusCode.UNAVAILABLE))
    delivered: list[bytes] = []

    def listener(data: bytes) -> bool:
        delivered.append(data)
        return False

    with trio.fail_after(20), pytest.raises(CannotConnect, match=r"^GenerateStream: gone \(Unavailable\)$"):
        async with pool.stream("GenerateStream", GENERATE_STREAM, failing, None) as responses:
            await responses.listen(listener)
    assert [pb.GenerateResponse.FromString(d).outputs.index for d in delivered] == [0, 1, 2]


async def test_stream_translates_a_lost_connection(pool: ChannelPool) -> None:
    slow = request("s", text="t", n=100, interval_ms=50)
    with trio.fail_after(20), pytest.raises(CannotConnect) as caught:
        async with pool.stream("GenerateStream", GENERATE_STREAM, slow, pb.GenerateResponse) as responses:
            channel = responses._channel
            await responses.__anext__()
            channel._conn.lose("connection to the test server lost: injected")
            async for _ in responses:
                pass
    assert isinstance(caught.value.__cause__, ConnectionLostError)
    assert str(caught.value) == "GenerateStream: connection to the test server lost: injected (Unavailable)"


async def test_stream_leaves_other_exceptions_and_cancellation_alone(pool: ChannelPool) -> None:
    class Mine(Exception):
        pass

    with trio.fail_after(20):
        with pytest.raises(Mine):
            async with pool.stream("GenerateStream", GENERATE_STREAM, request("s", n=5), pb.GenerateResponse):
                raise Mine
        with trio.move_on_after(0.05) as scope:
            slow = request("s", n=100, interval_ms=1000)
            async with pool.stream("GenerateStream", GENERATE_STREAM, slow, pb.GenerateResponse) as responses:
                async for _ in responses:
                    pass
        assert scope.cancelled_caught
        # The connections are still usable after both (the streams were reset, not the connections).
        answer = await pool.unary("Generate", GENERATE, request("echo", text="after"), pb.GenerateResponse)
        assert answer.outputs.text == "after"


async def test_unary_translates_a_status_and_keeps_it(pool: ChannelPool) -> None:
    failing = request("fail", text="bad input", interval_ms=int(StatusCode.INVALID_ARGUMENT))
    with trio.fail_after(20), pytest.raises(SidecarError) as caught:
        await pool.unary("Generate", GENERATE, failing, pb.GenerateResponse)
    assert type(caught.value) is InvalidArgument
    assert str(caught.value) == "Generate: bad input (InvalidArgument)"
    assert (caught.value.grpc_code, caught.value.grpc_message) == (StatusCode.INVALID_ARGUMENT, "bad input")


async def test_a_dedicated_pool_hands_out_a_broken_connection_instead_of_replacing_it(
    nursery: trio.Nursery, our_server: Any
) -> None:
    from trio_sidecar.transport import connect_channel

    config = SidecarConfig(grpc_endpoint=f"127.0.0.1:{our_server.port}")
    endpoint = parse_grpc_endpoint(config.grpc_endpoint)
    with trio.fail_after(20):
        channel = await connect_channel(nursery, "127.0.0.1", our_server.port)
        dedicated = ChannelPool(nursery, endpoint, config, [channel], reconnect=False)
        channel._conn.lose("injected")
        assert await dedicated.channel("Generate") is channel
        with pytest.raises(CannotConnect, match=r"^Generate: .*\(Unavailable\)$"):
            await dedicated.unary("Generate", GENERATE, request("echo"), pb.GenerateResponse)
        assert dedicated.reconnects == 0
        await dedicated.aclose()
