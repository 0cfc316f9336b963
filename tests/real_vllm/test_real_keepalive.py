"""The client keepalive against the real vLLM 0.32 gRPC server.

vllm-rs 0.32.0 serves gRPC with tonic 0.14.6 on hyper 1.10.1 and h2 0.4.15 (the crate paths compiled into
the binary). In those sources h2 answers every PING (one ACK pending at a time: a flood is back-pressured by
not reading, never answered with GOAWAY) and neither hyper's nor tonic's server has a ping-rate policy; only
grpc-core-style servers send GOAWAY(ENHANCE_YOUR_CALM, "too_many_pings"). These tests prove it on the wire:
the default keepalive (which PINGs a silent connection once, then at most every 5 minutes, as gRPC-core's
server policy permits) keeps a connection that reads nothing up for over a minute, and with the minimum
interval lowered even a PING every 0.5 s is accepted.

A connection only PINGs while it has calls open, so each test keeps a ``Health.Watch`` open: vLLM sends its
first status and then nothing (as for the sidecar's prober), which is exactly the silence the keepalive
measures.
"""

from __future__ import annotations

import pytest
import trio
from real_vllm_server import SERVED_MODEL_NAME

from trio_sidecar import SidecarConfig
from trio_sidecar._proto.grpc.health.v1 import health_pb2
from trio_sidecar._proto.vllm import control_pb2
from trio_sidecar.core.config import KeepaliveConfig
from trio_sidecar.shell.pool import channel_options
from trio_sidecar.transport import connect_channel

WATCH = "/grpc.health.v1.Health/Watch"
SERVING = health_pb2.HealthCheckResponse.SERVING


async def silent_connection(nursery, server, **options):
    """A channel with a ``Health.Watch`` open and its first status read; PINGs sent are counted."""
    channel = await connect_channel(nursery, server.host, server.grpc_port, **options)
    conn = channel._conn
    sent: list[float] = []
    ping = conn.protocol.ping

    def counting_ping(data: bytes) -> bool:
        sent.append(trio.current_time())
        return ping(data)

    conn.protocol.ping = counting_ping
    watch = channel.unary_stream(
        WATCH, health_pb2.HealthCheckRequest(service="vllm.Control"), health_pb2.HealthCheckResponse
    )
    await watch.__aenter__()
    with trio.fail_after(30):
        first = await watch.__anext__()
    assert first.status == SERVING
    return channel, watch, sent


async def observe(channel, watch, seconds: float) -> list[float]:
    """Wait ``seconds`` while the Watch stays silent; returns the distinct times bytes were read."""
    conn = channel._conn
    reads = [conn.last_read]
    with trio.move_on_after(seconds):
        while True:
            await trio.sleep(0.05)
            assert not channel.broken, conn.lost or conn.goaway
            if conn.last_read != reads[-1]:
                reads.append(conn.last_read)
    return reads[1:]


async def test_default_keepalive_keeps_a_silent_connection_to_real_vllm_up_for_60_seconds(nursery, real_server):
    config = SidecarConfig(grpc_endpoint=real_server.endpoint)
    options = channel_options(config)
    assert options["keepalive"] == KeepaliveConfig.client(time=10.0, timeout=4.0, min_ping_interval_without_data=300.0)
    channel, watch, sent = await silent_connection(nursery, real_server, **options)
    start = trio.current_time()
    reads = await observe(channel, watch, 62.0)
    assert trio.current_time() - start >= 60.0
    # One PING keepalive time after the last read, answered; then none for 5 minutes (vLLM sent no data).
    print(f"\n{len(sent)} PINGs in {trio.current_time() - start:.1f} s")
    assert len(sent) == 1, sent
    assert any(sent[0] <= read_at <= sent[0] + 4.0 for read_at in reads), (sent, reads)
    # No GOAWAY: the same connection still serves a request, and the Watch is still open.
    assert not channel.broken and channel._conn.goaway is None
    info = await channel.unary_unary(
        "/vllm.Control/GetModelInfo", control_pb2.GetModelInfoRequest(), control_pb2.ModelInfo, timeout=30
    )
    assert info.served_model_name == SERVED_MODEL_NAME
    assert not channel.broken
    await watch.aclose()
    await channel.aclose()


async def test_real_vllm_has_no_ping_rate_policy(nursery, real_server):
    # The next PING waits for the previous one's timeout: about one every 0.6 s here, 500 times gRPC-core's
    # default minimum interval (5 minutes) between PINGs on a connection that sends no data.
    keepalive = KeepaliveConfig.client(time=0.1, timeout=0.5, min_ping_interval_without_data=0.1)
    channel, watch, sent = await silent_connection(nursery, real_server, keepalive=keepalive)
    reads = await observe(channel, watch, 15.0)
    print(f"\n{len(sent)} PINGs in 15 s, {len(reads)} reads")
    assert len(sent) >= 20, len(sent)
    assert len(reads) >= len(sent) - 1  # each answered (the last may still be in flight)
    assert not channel.broken and channel._conn.goaway is None
    info = await channel.unary_unary(
        "/vllm.Control/GetModelInfo", control_pb2.GetModelInfoRequest(), control_pb2.ModelInfo, timeout=30
    )
    assert info.served_model_name == SERVED_MODEL_NAME
    await watch.aclose()
    await channel.aclose()


async def test_sigstopped_real_vllm_is_detected_within_15_s_with_the_defaults_and_serves_after_sigcont(real_server):
    """The whole vLLM process tree (its own session: the supervisor, the Rust frontend, the engine) is
    stopped with streams in flight, then continued; the sidecar runs with the default keepalive."""
    import os
    import signal

    from trio_sidecar import CannotConnect, GenerateContext, HealthKind, open_sidecar

    if real_server.pid <= 0:
        pytest.skip("an attached server is not ours to stop")
    assert os.getpgid(real_server.pid) == real_server.pid  # its own session: the signals reach only its tree
    config = SidecarConfig(
        grpc_endpoint=real_server.endpoint,
        grpc_connections=2,
        startup_deadline=120.0,
        connect_attempt_timeout=10.0,
        retry_interval=0.5,
    )
    request = {
        "token_ids": [5, 6, 7, 8],
        "stop_conditions": {"max_tokens": 240, "ignore_eos": True},
        "sampling_options": {"temperature": 0.0},
    }
    concurrent = 4
    errors: list[BaseException] = []
    ended: list[float] = []
    live: set[int] = set()  # tasks whose current stream has produced a chunk and not ended
    all_live = trio.Event()

    async def one(sidecar, i: int) -> None:
        # The tiny model can finish a request in well under a second: each task streams requests back to
        # back until one fails, so that all of them are mid-stream at the stop.
        n = 0
        try:
            while True:
                n += 1
                async with sidecar.generate(request, GenerateContext(f"hung-{i}-{n}")) as chunks:
                    async for _ in chunks:
                        live.add(i)
                        if len(live) == concurrent:
                            all_live.set()
                live.discard(i)
        except CannotConnect as exc:
            errors.append(exc)
        ended.append(trio.current_time())

    stopped_group = False
    try:
        with trio.fail_after(240):
            async with open_sidecar(config) as sidecar:
                async with trio.open_nursery() as nursery:
                    for i in range(concurrent):
                        nursery.start_soon(one, sidecar, i)
                    with trio.fail_after(120):
                        await all_live.wait()
                    os.killpg(real_server.pid, signal.SIGSTOP)  # the server's own session, started by the fixture
                    stopped_group = True
                    stopped = trio.current_time()
                detected = max(ended) - stopped
                keepalive = sum("keepalive" in exc.message for exc in errors)
                print(
                    f"\nreal vLLM stopped: {concurrent} requests failed (by the keepalive: {keepalive}) within "
                    f"{detected:.2f} s after SIGSTOP"
                )
                assert len(errors) == concurrent and len(ended) == concurrent
                # A stream in flight at the stop fails by the keepalive; a request that started just after it
                # (its predecessor had just finished) too, or, once the prober saw it, at admission.
                for exc in errors:
                    assert "keepalive PING not acknowledged within 4s" in exc.message or exc.message.startswith(
                        "vLLM is not serving: "
                    ), exc.message
                assert any("keepalive PING not acknowledged within 4s" in exc.message for exc in errors)
                assert detected <= 15.0, detected
                with trio.fail_after(15.0 - (trio.current_time() - stopped) + 1.0):
                    await sidecar.health.wait_value(lambda s: s.kind is HealthKind.UNREACHABLE)
                started = trio.current_time()
                with pytest.raises(CannotConnect, match="vLLM is not serving"):
                    async with sidecar.generate(request, GenerateContext("while-stopped")):
                        pass
                assert trio.current_time() - started < 0.5
                os.killpg(real_server.pid, signal.SIGCONT)
                stopped_group = False
                with trio.fail_after(120):
                    await sidecar.health.wait_value(lambda s: s.kind is HealthKind.SERVING)
                tokens = []
                async with sidecar.generate(
                    {**request, "stop_conditions": {"max_tokens": 4, "ignore_eos": True}},
                    GenerateContext("after-sigcont"),
                ) as chunks:
                    async for chunk in chunks:
                        tokens.extend(chunk.token_ids)
                assert len(tokens) == 4
    finally:
        if stopped_group:
            os.killpg(real_server.pid, signal.SIGCONT)
