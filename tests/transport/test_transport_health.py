"""grpc.health.v1.Health: our servicer and client helpers, also against grpc.aio."""

from __future__ import annotations

import grpc
import pytest
import trio
from transport_peers import aio_options, status_of

from trio_sidecar._proto.grpc.health.v1 import health_pb2
from trio_sidecar.core.status import StatusCode
from trio_sidecar.transport import HealthServicer, RpcError, check_health, open_channel, serve_grpc, watch_health
from trio_sidecar.transport.health import NOT_SERVING, SERVING, WATCH_METHOD


@pytest.fixture
async def health_server(nursery):
    health = HealthServicer({"": SERVING, "vllm.Control": SERVING, "vllm.Inference": NOT_SERVING})
    server = await nursery.start(serve_grpc, [health])
    return health, server


@pytest.fixture
async def health_channel(health_server):
    async with open_channel("127.0.0.1", health_server[1].port) as channel:
        yield channel


async def test_check_reports_each_registered_service(health_server, health_channel):
    health, _ = health_server
    assert await check_health(health_channel, "") == SERVING
    assert await check_health(health_channel, "vllm.Inference") == NOT_SERVING
    health.set_status("vllm.Inference", SERVING)
    assert await check_health(health_channel, "vllm.Inference", timeout=5) == SERVING


async def test_default_statuses_are_overall_serving(nursery):
    server = await nursery.start(serve_grpc, [HealthServicer()])
    async with open_channel("127.0.0.1", server.port) as channel:
        assert await check_health(channel, "") == SERVING
        with pytest.raises(RpcError):
            await check_health(channel, "vllm.Control")


async def test_check_of_an_unknown_service_is_not_found(health_channel):
    with pytest.raises(RpcError) as info:
        await check_health(health_channel, "vllm.Nope")
    assert (info.value.code, info.value.message) == (StatusCode.NOT_FOUND, "service not registered")


async def test_watch_of_an_unknown_service_fails_with_not_found(health_channel):
    with pytest.raises(RpcError) as info:
        async with watch_health(health_channel, "vllm.Nope"):
            pass
    assert (info.value.code, info.value.message) == (StatusCode.NOT_FOUND, "service not registered")


async def test_watch_streams_the_current_status_then_every_change(health_server, health_channel):
    health, _ = health_server
    seen = []
    with trio.fail_after(5):
        async with watch_health(health_channel, "vllm.Inference") as statuses:
            async for status in statuses:
                seen.append(status)
                if len(seen) == 1:
                    health.set_status("vllm.Inference", SERVING)
                elif len(seen) == 2:
                    health.set_status("vllm.Control", NOT_SERVING)  # another service: not reported here
                    health.set_status("vllm.Inference", NOT_SERVING)
                else:
                    break
    assert seen == [NOT_SERVING, SERVING, NOT_SERVING]


async def test_shutdown_reports_not_serving_then_ends_every_watch_with_ok(health_server, health_channel):
    health, _ = health_server
    results: dict[str, list[int]] = {}

    async def watch(service, task_status=trio.TASK_STATUS_IGNORED):
        async with watch_health(health_channel, service) as statuses:
            results[service] = []
            async for status in statuses:
                results[service].append(status)
                if len(results[service]) == 1:
                    task_status.started()

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            for service in ("", "vllm.Control", "vllm.Inference"):
                await nursery.start(watch, service)
            health.shutdown()
    assert results == {
        "": [SERVING, NOT_SERVING],
        "vllm.Control": [SERVING, NOT_SERVING],
        "vllm.Inference": [NOT_SERVING],
    }
    assert await check_health(health_channel, "vllm.Control") == NOT_SERVING
    async with watch_health(health_channel, "") as statuses:  # a Watch after shutdown ends at once
        assert [s async for s in statuses] == [NOT_SERVING]


async def test_grpc_aio_client_checks_and_watches_our_health_service(aio, health_server):
    health, server = health_server

    async def scenario(started: trio.Event | None = None):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=aio_options()) as channel:
            check = channel.unary_unary(
                "/grpc.health.v1.Health/Check",
                request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                response_deserializer=health_pb2.HealthCheckResponse.FromString,
            )
            watch = channel.unary_stream(
                WATCH_METHOD,
                request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                response_deserializer=health_pb2.HealthCheckResponse.FromString,
            )
            checked = (await check(health_pb2.HealthCheckRequest(service="vllm.Control"))).status
            try:
                await check(health_pb2.HealthCheckRequest(service="nope"))
                unknown = None
            except grpc.aio.AioRpcError as error:
                unknown = status_of(error)
            call = watch(health_pb2.HealthCheckRequest(service=""))
            watched = [(await call.read()).status]
            trio.from_thread.run_sync(health.shutdown, trio_token=token)
            while (message := await call.read()) is not grpc.aio.EOF:
                watched.append(message.status)
            return checked, unknown, watched, StatusCode(call_code(await call.code()))

    token = trio.lowlevel.current_trio_token()
    checked, unknown, watched, final = await aio.call(scenario)
    assert checked == SERVING
    assert unknown == (StatusCode.NOT_FOUND, "service not registered")
    assert watched == [SERVING, NOT_SERVING]
    assert final is StatusCode.OK


def call_code(code: grpc.StatusCode) -> int:
    return code.value[0]


async def test_our_health_helpers_against_a_grpc_aio_health_server(aio_server):
    async with open_channel("127.0.0.1", aio_server.port) as channel:
        assert await check_health(channel, "") == SERVING
        with pytest.raises(RpcError) as info:
            await check_health(channel, "vllm.Nope")
        assert (info.value.code, info.value.message) == (StatusCode.NOT_FOUND, "service not registered")
        # That server has no Watch: UNIMPLEMENTED surfaces when the stream opens (prober falls back to Check).
        with pytest.raises(RpcError) as info:
            async with watch_health(channel, ""):
                pass
        assert info.value.code is StatusCode.UNIMPLEMENTED
