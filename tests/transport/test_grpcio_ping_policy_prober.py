"""An idle sidecar stays serving against a stock grpc.aio server that polices PINGs as gRPC-core does.

The health prober keeps one ``Health.Watch`` per service open on its own connection; the server answers
the first status and then writes nothing. gRPC-core's server counts a PING as a strike when it comes
sooner than its minimum interval after the previous one with no data written in between, and ends the
connection with GOAWAY ENHANCE_YOUR_CALM ``too_many_pings`` past two strikes. The policy here is tuned
down (1 s instead of 5 minutes) and the keepalive to 0.1 s / 0.3 s, so the fault reproduces in seconds:
before the fix the prober's connection was PINGed every 0.3 s, got GOAWAY ``too_many_pings`` within about
a second, failed with an HTTP/2 protocol error and the prober published UNREACHABLE (admission closed).
The client still assumes gRPC-core's default 5 minutes, so it PINGs the silent connection once and then
stays quiet: no GOAWAY (the target's keepalive time is never throttled) and SERVING throughout.
"""

from __future__ import annotations

import asyncio
from typing import Any

import fakes
import grpc
import trio
import trio_util
from transport_peers import AioThread

from trio_sidecar._proto.grpc.health.v1 import health_pb2
from trio_sidecar.core.endpoint import parse_grpc_endpoint
from trio_sidecar.core.model import DiscoveredModel
from trio_sidecar.shell.prober import HealthKind, HealthState, run_health_prober
from trio_sidecar.transport._keepalive import keepalive_time_for

SERVING = health_pb2.HealthCheckResponse.SERVING
STRICT_PING_POLICY = [("grpc.http2.min_ping_interval_without_data_ms", 1000), ("grpc.http2.max_ping_strikes", 2)]


def _health_handlers() -> grpc.GenericRpcHandler:
    """``grpc.health.v1.Health`` on grpc.aio: every name SERVING; ``Watch`` answers once, then is silent."""

    async def check(request: Any, context: grpc.aio.ServicerContext) -> Any:
        return health_pb2.HealthCheckResponse(status=SERVING)

    async def watch(request: Any, context: grpc.aio.ServicerContext) -> Any:
        yield health_pb2.HealthCheckResponse(status=SERVING)
        await asyncio.Event().wait()  # nothing changes

    return grpc.method_handlers_generic_handler(
        "grpc.health.v1.Health",
        {
            "Check": grpc.unary_unary_rpc_method_handler(
                check,
                request_deserializer=health_pb2.HealthCheckRequest.FromString,
                response_serializer=health_pb2.HealthCheckResponse.SerializeToString,
            ),
            "Watch": grpc.unary_stream_rpc_method_handler(
                watch,
                request_deserializer=health_pb2.HealthCheckRequest.FromString,
                response_serializer=health_pb2.HealthCheckResponse.SerializeToString,
            ),
        },
    )


async def test_an_idle_prober_stays_serving_against_a_grpcio_server_that_polices_pings(aio: AioThread) -> None:
    server: Any = None

    async def start() -> int:
        nonlocal server
        server = grpc.aio.server(options=STRICT_PING_POLICY)
        server.add_generic_rpc_handlers((_health_handlers(),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return port

    port = await aio.call(start)
    try:
        config = fakes.sidecar_config(f"127.0.0.1:{port}", keepalive_time=0.1, keepalive_timeout=0.3)
        health = trio_util.AsyncValue(HealthState(HealthKind.SERVING))
        kinds: list[HealthKind] = []

        async def record() -> None:
            async for state in health.eventual_values():
                kinds.append(state.kind)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(record)
            await nursery.start(
                lambda task_status: run_health_prober(
                    endpoint=parse_grpc_endpoint(config.grpc_endpoint),
                    config=config,
                    model=DiscoveredModel.from_proto(fakes.model_info(), fakes.server_info()),
                    kv_sources=(),
                    health=health,
                    on_recovered=lambda model, sources: None,
                    task_status=task_status,
                )
            )
            # 8 s: the old keepalive (a PING every 0.3 s) lost the connection within about 1 s.
            await trio.sleep(8)
            nursery.cancel_scope.cancel()
        assert kinds == [HealthKind.SERVING], kinds
        # No GOAWAY too_many_pings on the prober's connection (it would have doubled the keepalive time).
        assert keepalive_time_for(f"127.0.0.1:{port}", 0.1) == 0.1
    finally:
        await aio.call(lambda: server.stop(None))
