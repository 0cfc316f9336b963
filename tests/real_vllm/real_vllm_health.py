"""Watching the real server's health go away: direct Health.Watch streams plus a sidecar's prober."""

from __future__ import annotations

import time

import pytest
import trio
from real_vllm_client import open_direct_channel, rpc_error_types
from real_vllm_helpers import unique_id

from trio_sidecar import CannotConnect, GenerateContext, HealthKind, SidecarConfig, open_sidecar
from trio_sidecar._proto.grpc.health.v1 import health_pb2

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICES = ("", "vllm.Control", "vllm.Inference")
REQUEST = {"token_ids": [5, 6, 7, 8], "stop_conditions": {"max_tokens": 4}}


async def watch(channel, service: str, record: list, serving: trio.Event) -> None:
    """Record every status of one Health.Watch stream, then how it ended ("OK" or the error code name)."""
    try:
        async with channel.unary_stream(
            "/grpc.health.v1.Health/Watch",
            health_pb2.HealthCheckRequest(service=service),
            health_pb2.HealthCheckResponse,
        ) as stream:
            async for message in stream:
                record.append(message.status)
                if message.status == SERVING:
                    serving.set()
        record.append("OK")
    except rpc_error_types() as e:
        record.append(e.code.name)


async def observe_shutdown(server, trigger) -> dict:
    """Start a sidecar and direct watchers, run ``trigger()``, and collect what everyone saw."""
    config = SidecarConfig(
        grpc_endpoint=server.endpoint,
        grpc_connections=1,
        startup_deadline=120.0,
        connect_attempt_timeout=5.0,
        retry_interval=0.5,
    )
    watches: dict[str, list] = {service: [] for service in SERVICES}
    prober_states: list = []
    seen: dict = {}
    async with open_sidecar(config) as sidecar, open_direct_channel(server.host, server.grpc_port) as direct:
        async with trio.open_nursery() as nursery:
            for service in SERVICES:
                serving = trio.Event()
                nursery.start_soon(watch, direct, service, watches[service], serving)
                with trio.fail_after(30):
                    await serving.wait()

            async def record_prober():
                async for state in sidecar.health.eventual_values():
                    prober_states.append(state)

            nursery.start_soon(record_prober)
            assert sidecar.health.value.kind is HealthKind.SERVING
            t0 = time.monotonic()
            trigger()
            with trio.fail_after(30):
                await sidecar.health.wait_value(lambda s: s.kind is not HealthKind.SERVING)
            seen["prober_left_serving_s"] = time.monotonic() - t0
            seen["prober_state"] = sidecar.health.value
            with pytest.raises(CannotConnect) as info:
                async with sidecar.generate(REQUEST, GenerateContext(unique_id("refused"))):
                    pytest.fail("admission should be closed")  # pragma: no cover
            seen["refusal"] = str(info.value)
            with trio.fail_after(30):
                while not all(w and isinstance(w[-1], str) for w in watches.values()):
                    await trio.sleep(0.05)
            seen["watches_ended_s"] = time.monotonic() - t0
            with trio.fail_after(30):
                while not server.exited():
                    await trio.sleep(0.05)
            seen["process_exited_s"] = time.monotonic() - t0
            # Stay until the prober has noticed the server is gone for good (connection refused).
            with trio.fail_after(30):
                await sidecar.health.wait_value(lambda s: s.kind is HealthKind.UNREACHABLE)
            nursery.cancel_scope.cancel()
    seen["watches"] = watches
    seen["prober_states"] = prober_states
    return seen


def assert_left_serving(seen: dict) -> None:
    for service, record in seen["watches"].items():
        statuses, ending = record[:-1], record[-1]
        assert statuses[0] == SERVING, (service, record)
        # Either path of docs/reference/real-vllm.md#shutdown-and-engine-death: NOT_SERVING then the stream ends OK, or the stream ends with an
        # error (possibly without a NOT_SERVING first). Never an OK ending while still SERVING.
        if ending == "OK":
            assert statuses[-1] == NOT_SERVING, (service, record)
        else:
            assert ending in ("UNAVAILABLE", "CANCELLED", "UNKNOWN", "INTERNAL"), (service, record)
    state = seen["prober_state"]
    assert state.kind in (HealthKind.NOT_SERVING, HealthKind.UNREACHABLE), state
    assert state.reason
    assert seen["refusal"] == f"vLLM is not serving: {state.reason}"
    assert seen["prober_states"][0].kind is HealthKind.SERVING
    assert seen["prober_states"][-1].kind is HealthKind.UNREACHABLE
