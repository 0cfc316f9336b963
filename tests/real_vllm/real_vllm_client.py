"""Direct gRPC access to the real server from Trio tests, through the project's transport.

``open_direct_channel`` yields a ``trio_sidecar.transport.Channel``. Until the transport existed this
module had a grpcio fallback; it is kept for diagnosing the transport itself
(``TRIO_SIDECAR_REAL_VLLM_CLIENT=grpcio``), with the same surface: ``unary_unary``, ``unary_stream``
(async context manager; opening raises on a non-OK status) and errors carrying ``code`` and ``message``.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from trio_sidecar.core.status import StatusCode

GRPCIO = os.environ.get("TRIO_SIDECAR_REAL_VLLM_CLIENT") == "grpcio"


def _project_transport():
    try:
        from trio_sidecar import transport
    except ImportError:
        return None
    return transport if hasattr(transport, "open_channel") else None


def rpc_error_types() -> tuple[type[BaseException], ...]:
    transport = None if GRPCIO else _project_transport()
    types: tuple[type[BaseException], ...] = (GrpcioRpcError,)
    if transport is not None:
        types += (transport.RpcError,)
    return types


class GrpcioRpcError(Exception):
    def __init__(self, code: StatusCode, message: str):
        super().__init__(f"{message} ({code.rust_name})")
        self.code = code
        self.message = message


def _map(e) -> GrpcioRpcError:
    return GrpcioRpcError(StatusCode.from_wire(e.code().value[0]), e.details() or "")


class _GrpcioStream:
    def __init__(self, call):
        self._call = call
        self._it = iter(call)

    def __aiter__(self):
        return self

    async def __anext__(self):
        import grpc

        def step():
            try:
                return next(self._it)
            except StopIteration:
                return StopAsyncIteration
            except grpc.RpcError as e:
                return _map(e)

        item = await trio.to_thread.run_sync(step, abandon_on_cancel=True)
        if item is StopAsyncIteration:
            raise StopAsyncIteration
        if isinstance(item, GrpcioRpcError):
            raise item
        return item


class GrpcioChannel:
    """grpcio's sync client driven from Trio worker threads (diagnostics only)."""

    def __init__(self, host: str, port: int):
        import grpc

        self._channel = grpc.insecure_channel(f"{host}:{port}")

    async def unary_unary(self, method, request, response_type, *, metadata=(), timeout=None):
        import grpc

        fn = self._channel.unary_unary(
            method, request_serializer=lambda m: m.SerializeToString(), response_deserializer=response_type.FromString
        )
        try:
            return await trio.to_thread.run_sync(
                lambda: fn(request, metadata=tuple(metadata), timeout=timeout), abandon_on_cancel=True
            )
        except grpc.RpcError as e:
            raise _map(e) from None

    @asynccontextmanager
    async def unary_stream(self, method, request, response_type, *, metadata=(), timeout=None):
        import grpc

        fn = self._channel.unary_stream(
            method, request_serializer=lambda m: m.SerializeToString(), response_deserializer=response_type.FromString
        )
        call = fn(request, metadata=tuple(metadata), timeout=timeout)
        try:
            # Headers (or a trailers-only status) arrive; a trailers-only error surfaces on the first read.
            await trio.to_thread.run_sync(call.initial_metadata, abandon_on_cancel=True)
            if call.done() and call.code() != grpc.StatusCode.OK:
                raise _map(call)
            yield _GrpcioStream(call)
        finally:
            call.cancel()

    async def aclose(self):
        self._channel.close()


@asynccontextmanager
async def open_direct_channel(host: str, port: int) -> AsyncIterator[object]:
    transport = None if GRPCIO else _project_transport()
    if transport is None:
        channel = GrpcioChannel(host, port)
        try:
            yield channel
        finally:
            await channel.aclose()
        return
    async with transport.open_channel(host, port) as channel:
        yield channel
