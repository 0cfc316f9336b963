"""gRPC-core's ping policy, on a virtual clock: our server enforces it (``ServerLimits.keepalive``) and the
client keepalive never trips it.

The server's policy is ``KeepaliveConfig.server()`` (gRPC-core's defaults: a PING within 5 minutes of the
previous one, with no HEADERS, DATA or WINDOW_UPDATE sent in between, is a strike; past 2 strikes GOAWAY
ENHANCE_YOUR_CALM ``too_many_pings`` and close). Its fidelity to gRPC-core is checked against grpcio in
``test_transport_goaway.py``. Here: the reported fault (a keepalive that PINGs an idle ``Health.Watch``
every 10 s makes the prober report vLLM not serving after about 44 s) reproduced in virtual time with the
old PING rate, and the default keepalive keeping an idle prober, and a pool streaming tokens, up for 30
virtual minutes.
"""

from __future__ import annotations

import fakes
import pytest
import trio
import trio_util
from transport_peers import GENERATE_STREAM, Recorder, TrioEcho, request

from trio_sidecar._proto.grpc.health.v1 import health_pb2
from trio_sidecar._proto.vllm import control_grpc, control_pb2
from trio_sidecar._proto.vllm import inference_pb2 as pb
from trio_sidecar.core.config import KeepaliveConfig
from trio_sidecar.core.endpoint import parse_grpc_endpoint
from trio_sidecar.core.model import DiscoveredModel
from trio_sidecar.shell.pool import ChannelPool
from trio_sidecar.shell.prober import HealthKind, HealthState, run_health_prober
from trio_sidecar.transport import ConnectionLostError, HealthServicer, ServerLimits, connect_channel, serve_grpc
from trio_sidecar.transport._keepalive import keepalive_time_for

SERVING = health_pb2.HealthCheckResponse.SERVING
WATCH = "/grpc.health.v1.Health/Watch"
GRPC_CORE = ServerLimits(keepalive=KeepaliveConfig.server(), idle_timeout=None)


class Control(control_grpc.ControlServicer):
    """``vllm.Control`` answering the prober's rediscovery with the fakes' model."""

    async def GetModelInfo(self, request, context):  # noqa: N802
        return fakes.model_info()

    async def GetServerInfo(self, request, context):  # noqa: N802
        return fakes.server_info()

    async def GetKvEventSources(self, request, context):  # noqa: N802
        return control_pb2.GetKvEventSourcesResponse()


async def policed_server(nursery):
    health = HealthServicer({"": SERVING, "vllm.Control": SERVING, "vllm.Inference": SERVING})
    return await nursery.start(
        lambda task_status: serve_grpc(
            [health, Control(), TrioEcho(Recorder())], limits=GRPC_CORE, task_status=task_status
        )
    )


async def test_our_server_answers_a_fourth_ping_too_soon_with_goaway_too_many_pings(nursery, autojump_clock):
    server = await policed_server(nursery)
    # A client that assumes PINGs every 10 s are welcome (the old keepalive).
    keepalive = KeepaliveConfig.client(time=10.0, timeout=4.0, min_ping_interval_without_data=10.0)
    channel = await connect_channel(nursery, "127.0.0.1", server.port, keepalive=keepalive)
    started = trio.current_time()
    async with channel.unary_stream(WATCH, health_pb2.HealthCheckRequest(service=""), None) as watch:
        await watch.__anext__()
        with pytest.raises(ConnectionLostError):
            await watch.__anext__()
    # PINGs at 10 (no strike: the status was sent since), 24, 38 (strikes 1, 2) and 52: the third strike.
    assert trio.current_time() - started == pytest.approx(52.0, abs=0.01)
    assert channel.too_many_pings and "too_many_pings" in channel._conn.goaway
    await channel.aclose()


async def test_the_default_keepalive_keeps_a_silent_watch_on_a_policing_server_for_30_minutes(nursery, autojump_clock):
    server = await policed_server(nursery)
    keepalive = fakes.sidecar_config("127.0.0.1:1")  # the sidecar's defaults: 10 s, 4 s, 300 s
    from trio_sidecar.core.config import keepalive_config

    channel = await connect_channel(nursery, "127.0.0.1", server.port, keepalive=keepalive_config(keepalive))
    pings = 0
    ping = channel._conn.protocol.ping

    def counting(data: bytes) -> bool:
        nonlocal pings
        pings += 1
        return ping(data)

    channel._conn.protocol.ping = counting
    async with channel.unary_stream(WATCH, health_pb2.HealthCheckRequest(service=""), None) as watch:
        await watch.__anext__()
        await trio.sleep(1800)
        assert not channel.broken, channel._conn.lost or channel._conn.goaway
    assert pings == 6  # at 10 s, then every 304 s (5 minutes after the ACK was noticed)
    await channel.aclose()


async def test_a_pool_streaming_tokens_is_pinged_every_keepalive_time_without_strikes(nursery, autojump_clock):
    server = await policed_server(nursery)
    config = fakes.sidecar_config(f"127.0.0.1:{server.port}", grpc_connections=1)
    pool = await ChannelPool.connect(
        nursery, parse_grpc_endpoint(config.grpc_endpoint), config, deadline=trio.current_time() + 30
    )
    channel = pool.channels[0]
    pings = 0
    ping = channel._conn.protocol.ping

    def counting(data: bytes) -> bool:
        nonlocal pings
        pings += 1
        return ping(data)

    channel._conn.protocol.ping = counting
    # A message every 15 s for 30 minutes: 15 s without reads exceed the keepalive time each time, and the
    # message after each ACK makes the next PING one gRPC-core does not count.
    async with pool.stream(
        "GenerateStream", GENERATE_STREAM, request("s", n=121, interval_ms=15_000), pb.GenerateResponse
    ) as s:
        received = [m.outputs.index async for m in s]
    assert received == list(range(121))
    assert pings == 120 and not channel.broken
    await pool.aclose()


@pytest.mark.parametrize(("min_ping_interval", "policed"), [(300.0, False), (10.0, True)])
async def test_an_idle_prober_on_a_policing_server(nursery, autojump_clock, min_ping_interval, policed):
    """The reported fault in virtual time: with PINGs every 10 s on its idle Watch connection (about the old
    keepalive's rate) the prober's connection gets GOAWAY ``too_many_pings`` 52 s after start (and the
    target's keepalive time is doubled); with the default it stays SERVING for 10 minutes, unthrottled."""
    server = await policed_server(nursery)
    target = f"127.0.0.1:{server.port}"
    config = fakes.sidecar_config(target, keepalive_min_ping_interval=min_ping_interval)
    health = trio_util.AsyncValue(HealthState(HealthKind.SERVING))
    kinds: list[tuple[float, HealthKind]] = []
    started = trio.current_time()

    async def record() -> None:
        async for state in health.eventual_values():
            kinds.append((trio.current_time() - started, state.kind))

    async with trio.open_nursery() as inner:
        inner.start_soon(record)
        await inner.start(
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
        if policed:
            with trio.fail_after(60):
                while keepalive_time_for(target, 10.0) == 10.0:
                    await trio.sleep(0.5)
            print(f"\ntoo_many_pings {trio.current_time() - started:.1f} s after start; states {kinds}")
            assert trio.current_time() - started == pytest.approx(52.0, abs=0.6)
        else:
            await trio.sleep(600)
            assert keepalive_time_for(target, 10.0) == 10.0  # never throttled: no GOAWAY too_many_pings
            assert kinds == [(0.0, HealthKind.SERVING)], kinds
        inner.cancel_scope.cancel()
