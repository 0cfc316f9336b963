"""Readiness wait and Control discovery (docs/reference/sidecar.md#readiness-wait, docs/reference/sidecar.md#discovery, docs/reference/sidecar.md#kv-event-sources).

Every step here is bounded by the *phase deadline* (``trio.current_time()`` based) that the caller
computed when the phase began (docs/reference/sidecar.md#phases-and-deadlines), so the bootstrap phase cannot eat the start phase's budget.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import trio

from .._proto.grpc.health.v1 import health_pb2
from .._proto.vllm import control_pb2
from ..core.config import SidecarConfig, validate_sidecar_config
from ..core.endpoint import GrpcEndpoint
from ..core.errors import (
    CannotConnect,
    ConnectionTimeout,
    ProtocolError,
    SidecarError,
    format_duration,
    format_status,
)
from ..core.model import DiscoveredModel
from ..core.status import StatusCode
from .diagnostics import round_duration
from .pool import ChannelPool, cause_chain, open_channel_pool
from .progress import note_failure

__all__ = [
    "CONTROL_SERVICE",
    "INFERENCE_SERVICE",
    "wait_for_services",
    "discover_model",
    "discover",
    "fetch_kv_event_sources",
    "HEALTH_CHECK",
]

LOGGER = logging.getLogger("trio_sidecar.discovery")

CONTROL_SERVICE = "vllm.Control"
INFERENCE_SERVICE = "vllm.Inference"

GET_MODEL_INFO = "/vllm.Control/GetModelInfo"
GET_SERVER_INFO = "/vllm.Control/GetServerInfo"
GET_KV_EVENT_SOURCES = "/vllm.Control/GetKvEventSources"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"

_SERVING = health_pb2.HealthCheckResponse.SERVING
_FAIL_AT_ONCE = (StatusCode.NOT_FOUND, StatusCode.UNIMPLEMENTED)


def _status_name(status: int) -> str:
    """``reported {NAME}``: unknown enum values count as ``UNKNOWN`` (docs/reference/sidecar.md#readiness-wait)."""
    try:
        return health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    except ValueError:
        return "UNKNOWN"


async def wait_for_services(
    pool: ChannelPool, services: Sequence[str], *, deadline: float, retry_interval: float
) -> None:
    """Wait until each service reports ``SERVING``, sequentially in the given order (docs/reference/sidecar.md#readiness-wait).

    Raises:
        ProtocolError: the health service answered ``NOT_FOUND``/``UNIMPLEMENTED`` (fails at once).
        CannotConnect: ``{service} did not become SERVING before the total vLLM startup deadline ...``.
    """
    for service in services:
        start = trio.current_time()
        last = "health check exceeded the startup deadline"
        while True:
            if trio.current_time() < deadline:
                last = "health check exceeded the startup deadline"
                with trio.move_on_at(deadline):
                    try:
                        status = await _check_health(pool, service)
                    except (_HealthCheckFailed, CannotConnect) as exc:  # (CannotConnect: the pool's own)
                        last = f"health check failed: {exc}"
                    except OSError as exc:
                        last = f"health check failed: {cause_chain(exc)}"
                    else:
                        if status == _SERVING:
                            break
                        last = f"reported {_status_name(status)}"
            now = trio.current_time()
            if now >= deadline:
                raise CannotConnect(
                    f"{service} did not become SERVING before the total vLLM startup deadline after "
                    f"{format_duration(round_duration(now - start))}: {last}"
                )
            LOGGER.debug("waiting for %s to become SERVING: %s", service, last)
            note_failure(f"{service} {last}")
            await trio.sleep_until(min(now + retry_interval, deadline))


class _HealthCheckFailed(Exception):
    """``Health.Check`` answered another gRPC status; the text is the status (``{message} ({Code})``)."""


async def _check_health(pool: ChannelPool, service: str) -> int:
    """``Health.Check(service)`` on the next connection; its ``ServingStatus`` value.

    Raises:
        ProtocolError: ``NOT_FOUND``/``UNIMPLEMENTED``: no standard health API for ``service``.
        _HealthCheckFailed: any other gRPC status.
        CannotConnect: the pool's own (a broken connection that could not be replaced).
    """
    channel = await pool.channel("Health.Check")
    try:
        response = await pool.unary(
            "Health.Check",
            HEALTH_CHECK,
            health_pb2.HealthCheckRequest(service=service),
            health_pb2.HealthCheckResponse,
            channel=channel,
        )
    except SidecarError as exc:
        if exc.grpc_code is None:
            raise
        status = format_status(exc.grpc_code, exc.grpc_message)
        if exc.grpc_code in _FAIL_AT_ONCE:
            raise ProtocolError(f"{service} is unavailable through the standard gRPC health API: {status}") from exc
        raise _HealthCheckFailed(status) from exc
    return response.status


async def _bounded_unary(
    pool: ChannelPool,
    channel: Any,
    rpc: str,
    method: str,
    request: Any,
    response_type: Any,
    deadline: float,
    timeout: float | None,
) -> Any:
    with trio.move_on_at(deadline):
        return await pool.unary(rpc, method, request, response_type, channel=channel, timeout=timeout)
    raise ConnectionTimeout(f"{rpc} exceeded the total vLLM startup deadline")


async def discover_model(
    pool: ChannelPool, *, deadline: float, timeout: float | None = None, channel: Any = None
) -> DiscoveredModel:
    """``GetModelInfo`` then ``GetServerInfo`` on the same connection, validated (docs/reference/sidecar.md#bootstrap-phase step 3, docs/reference/sidecar.md#control-metadata-validation).

    Args:
        deadline: the phase deadline (``math.inf``: none, as for the prober's rediscovery).
        timeout: each RPC's own timeout (``grpc-timeout``), if any.
        channel: the connection to use (default: the pool's next one).

    Raises:
        ConnectionTimeout: ``GetModelInfo exceeded the total vLLM startup deadline`` (or ``GetServerInfo``).
        SidecarError: a mapped gRPC status (rpc name ``GetModelInfo``/``GetServerInfo``).
        ProtocolError: the validation of docs/reference/sidecar.md#control-metadata-validation.
    """
    if channel is None:
        channel = await pool.channel("GetModelInfo")
    model_info = await _bounded_unary(
        pool,
        channel,
        "GetModelInfo",
        GET_MODEL_INFO,
        control_pb2.GetModelInfoRequest(),
        control_pb2.ModelInfo,
        deadline,
        timeout,
    )
    server_info = await _bounded_unary(
        pool,
        channel,
        "GetServerInfo",
        GET_SERVER_INFO,
        control_pb2.GetServerInfoRequest(),
        control_pb2.ServerInfo,
        deadline,
        timeout,
    )
    return DiscoveredModel.from_proto(model_info, server_info)


async def fetch_kv_event_sources(
    pool: ChannelPool,
    endpoint: GrpcEndpoint,
    model: DiscoveredModel,
    *,
    deadline: float,
    timeout: float | None = None,
    channel: Any = None,
) -> tuple[Any, ...]:
    """``GetKvEventSources``, validated and rewritten (docs/reference/sidecar.md#kv-event-sources); warnings are logged.

    ``deadline``, ``timeout`` and ``channel`` as for :func:`discover_model`.

    Raises:
        ConnectionTimeout: ``GetKvEventSources exceeded the total vLLM startup deadline``.
        SidecarError: mapped gRPC status (rpc name ``GetKvEventSources``); ProtocolError as in docs/reference/sidecar.md#kv-event-sources.
    """
    from ..core.routing import validate_kv_event_sources

    if channel is None:
        channel = await pool.channel("GetKvEventSources")
    response = await _bounded_unary(
        pool,
        channel,
        "GetKvEventSources",
        GET_KV_EVENT_SOURCES,
        control_pb2.GetKvEventSourcesRequest(),
        control_pb2.GetKvEventSourcesResponse,
        deadline,
        timeout,
    )
    sources, warnings = validate_kv_event_sources(list(response.sources), model.local_ranks, endpoint.host)
    for text in warnings:
        LOGGER.warning(text)
    return tuple(sources)


async def discover(config: SidecarConfig) -> DiscoveredModel:
    """The bootstrap phase (docs/reference/sidecar.md#bootstrap-phase) as a standalone coroutine.

    A pool of exactly one connection, a readiness wait for ``vllm.Control`` only, then discovery; the pool
    is closed before returning.

    Raises:
        InvalidArgument: the ``SidecarConfig`` pre-network checks (docs/reference/sidecar.md#pre-network-checks) — no socket is opened.
        CannotConnect, ConnectionTimeout, ProtocolError, SidecarError: docs/reference/sidecar.md#connection-pool, docs/reference/sidecar.md#discovery.
    """
    endpoint = validate_sidecar_config(config)
    deadline = trio.current_time() + config.startup_deadline
    async with open_channel_pool(endpoint, config, deadline=deadline, size=1) as pool:
        await wait_for_services(pool, [CONTROL_SERVICE], deadline=deadline, retry_interval=config.retry_interval)
        return await discover_model(pool, deadline=deadline)
