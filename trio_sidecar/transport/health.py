"""``grpc.health.v1.Health``: a servicer for ``serve_grpc`` and client helpers (docs/reference/wire.md#health)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import trio

from trio_sidecar._proto.grpc.health.v1 import health_grpc, health_pb2
from trio_sidecar.core.status import StatusCode

from ._client import Channel, ResponseStream
from ._errors import RpcError

__all__ = [
    "CHECK_METHOD",
    "NOT_SERVING",
    "SERVICE_UNKNOWN",
    "SERVING",
    "UNKNOWN",
    "WATCH_METHOD",
    "HealthServicer",
    "check_health",
    "watch_health",
]

CHECK_METHOD = "/grpc.health.v1.Health/Check"
WATCH_METHOD = "/grpc.health.v1.Health/Watch"

_ServingStatus = health_pb2.HealthCheckResponse.ServingStatus
UNKNOWN: int = _ServingStatus.Value("UNKNOWN")
SERVING: int = _ServingStatus.Value("SERVING")
NOT_SERVING: int = _ServingStatus.Value("NOT_SERVING")
SERVICE_UNKNOWN: int = _ServingStatus.Value("SERVICE_UNKNOWN")

NOT_REGISTERED_MESSAGE = "service not registered"


class HealthServicer(health_grpc.HealthServicer):
    """Serving status per service name; ``Watch`` streams every change.

    ``Check``/``Watch`` of a name never registered answer NOT_FOUND ``"service not registered"`` (as vLLM
    does). ``shutdown()`` reports NOT_SERVING for every name, then ends every open ``Watch`` with OK.
    """

    def __init__(self, statuses: Mapping[str, int] | None = None) -> None:
        self._statuses: dict[str, int] = dict(statuses) if statuses is not None else {"": SERVING}
        self._changed = trio.Event()
        self._shut_down = False

    def __repr__(self) -> str:
        names = ", ".join(
            f"{name or '<server>'}={_ServingStatus.Name(status)}" for name, status in self._statuses.items()
        )
        return f"<HealthServicer [{names}]{' shut down' if self._shut_down else ''}>"

    def status(self, service: str) -> int | None:
        return self._statuses.get(service)

    def set_status(self, service: str, status: int) -> None:
        """Set (or register) ``service``'s status; open ``Watch`` streams see the change."""
        self._statuses[service] = status
        self._notify()

    def shutdown(self) -> None:
        """Every status NOT_SERVING, then open ``Watch`` streams end with OK (and new ones end at once)."""
        for name in self._statuses:
            self._statuses[name] = NOT_SERVING
        self._shut_down = True
        self._notify()

    def _notify(self) -> None:
        changed, self._changed = self._changed, trio.Event()
        changed.set()

    async def Check(self, request: Any, context: Any) -> Any:  # noqa: N802 (gRPC method name)
        status = self._statuses.get(request.service)
        if status is None:
            raise RpcError(StatusCode.NOT_FOUND, NOT_REGISTERED_MESSAGE)
        return health_pb2.HealthCheckResponse(status=status)  # type: ignore[arg-type]  # the enum's int value

    async def Watch(self, request: Any, context: Any) -> AsyncIterator[Any]:  # noqa: N802
        name = request.service
        if name not in self._statuses:
            raise RpcError(StatusCode.NOT_FOUND, NOT_REGISTERED_MESSAGE)
        last = None
        while True:
            changed = self._changed
            status = self._statuses.get(name, SERVICE_UNKNOWN)
            if status != last:
                last = status
                yield health_pb2.HealthCheckResponse(status=status)  # type: ignore[arg-type]  # the enum's int value
            if self._shut_down:
                return
            await changed.wait()


async def check_health(channel: Channel, service: str, *, timeout: float | None = None) -> int:
    """``Health.Check(service)``; returns the ``ServingStatus`` value. Raises ``RpcError`` as calls do."""
    response = await channel.unary_unary(
        CHECK_METHOD, health_pb2.HealthCheckRequest(service=service), health_pb2.HealthCheckResponse, timeout=timeout
    )
    return response.status


class _StatusIterator:
    def __init__(self, stream: ResponseStream) -> None:
        self._stream = stream

    def __aiter__(self) -> _StatusIterator:
        return self

    async def __anext__(self) -> int:
        response = await self._stream.__anext__()
        return response.status


@asynccontextmanager
async def watch_health(channel: Channel, service: str) -> AsyncIterator[AsyncIterator[int]]:
    """``Health.Watch(service)``: ``async with watch_health(ch, "") as statuses: async for s in statuses``.

    Entering raises ``RpcError`` for an immediate error (e.g. NOT_FOUND, UNIMPLEMENTED). Iteration ends
    when the server ends the stream with OK (shutdown); errors raise ``RpcError``. Leaving the block
    resets the stream.
    """
    async with channel.unary_stream(
        WATCH_METHOD, health_pb2.HealthCheckRequest(service=service), health_pb2.HealthCheckResponse
    ) as stream:
        yield _StatusIterator(stream)
