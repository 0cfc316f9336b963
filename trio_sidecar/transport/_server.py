"""The server side: ``serve_grpc`` serving generated purerpc ``*Servicer`` instances."""

from __future__ import annotations

import errno
import inspect
import logging
import math
import socket as stdlib_socket
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

import attrs
import trio
from purerpc.grpclib.config import GRPCConfiguration
from purerpc.rpc import Cardinality

from trio_sidecar.core.config import KeepaliveConfig
from trio_sidecar.core.status import StatusCode

from ._connection import Call, Connection, encode_metadata, parse_message
from ._errors import DEFAULT_MAX_MESSAGE_LENGTH, RpcError
from ._events import (
    GoAway,
    MessageReceived,
    PingReceived,
    RequestEnded,
    RequestReceived,
    SettingsReceived,
    StreamFailed,
    StreamReset,
    WindowUpdated,
)
from ._keepalive import TOO_MANY_PINGS
from ._protocol import ErrorCodes, GrpcProtocol
from ._util import collapse_single_exception
from ._wire import encode_grpc_message, frame_message, frame_messages

__all__ = ["CallContext", "FramedMessages", "GrpcServer", "ServerLimits", "serve_grpc"]

LOGGER = logging.getLogger("trio_sidecar.transport.server")

UNEXPECTED_ERROR_MESSAGE = "unexpected server error"
_RESPONSE_HEADERS = ((":status", "200"), ("content-type", "application/grpc"))
_OK_TRAILERS = (("grpc-status", "0"),)
# accept() failures that mean "out of resources right now": wait and retry (as trio.serve_listeners does).
_ACCEPT_CAPACITY_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}


# gRPC-core's interval between PINGs on a connection without streams (keepalive_permit_without_calls off).
_IDLE_PING_INTERVAL = 7200.0

# While the connection cap turns connections away, one log line per this many seconds (with a count).
_CAP_LOG_INTERVAL_S = 10.0


@attrs.frozen(kw_only=True)
class ServerLimits:
    """What one peer may hold on a ``serve_grpc`` server (docs/reliability.md).

    Attributes:
        handshake_timeout: seconds a new connection has to send the HTTP/2 preface and its SETTINGS; after
            that it is closed.
        idle_timeout: seconds a connection may go without any open stream before it is sent GOAWAY and
            closed (``None``: never).
        max_connections: connections served at once; past it a new connection is accepted and closed at
            once, and one WARNING line per 10 s says how many were turned away.
        keepalive: the PING policy (``KeepaliveConfig.server()`` is gRPC-core's: a PING sooner than 5 minutes
            after the previous one with no HEADERS, DATA or WINDOW_UPDATE sent in between is a strike, 2 hours
            on a connection without streams; past 2 strikes, GOAWAY ENHANCE_YOUR_CALM ``too_many_pings`` and
            close). ``None`` (the default, as vLLM's own server): every PING is answered, none policed.
    """

    handshake_timeout: float = 10.0
    idle_timeout: float | None = 300.0
    max_connections: int = 1000
    keepalive: KeepaliveConfig | None = None

    def __attrs_post_init__(self) -> None:
        if not self.handshake_timeout > 0:
            raise ValueError("handshake_timeout must be positive")
        if self.idle_timeout is not None and not self.idle_timeout > 0:
            raise ValueError("idle_timeout must be positive")
        if self.max_connections < 1:
            raise ValueError("max_connections must be at least 1")


class FramedMessages(bytes):
    """One or more responses already serialized *and* gRPC-framed (5-byte prefix each), back to back.

    A streaming handler may yield one instead of a message: it is queued as is, in one HTTP/2 send, so a
    producer with several responses ready pays the per-send cost once. Build it with :meth:`of`. Each
    message still obeys the server's ``max_message_length`` (checked when the whole exceeds it: the
    messages before an oversize one are sent, then the call fails with RESOURCE_EXHAUSTED, as if they
    had been yielded one by one).
    """

    __slots__ = ()

    #: One serialized message with its gRPC prefix (``b"".join`` such pieces into a FramedMessages).
    frame = staticmethod(frame_message)

    @classmethod
    def of(cls, messages: Iterable[bytes]) -> FramedMessages:
        """Frame serialized messages (``message.SerializeToString()`` results) into one payload."""
        return cls(frame_messages(messages))


def _oversize_split(payload: bytes, limit: int) -> tuple[int, int] | None:
    """``(offset, length)`` of the first framed message in ``payload`` longer than ``limit``, if any."""
    offset = 0
    total = len(payload)
    while offset + 5 <= total:
        length = int.from_bytes(payload[offset + 1 : offset + 5], "big")
        if length > limit:
            return offset, length
        offset += 5 + length
    return None


class CallContext:
    """What a handler knows about its call (passed as ``handler(request, context)``)."""

    __slots__ = ("deadline", "metadata", "method", "peer")

    def __init__(self, method: str, metadata: tuple, peer: tuple[str, int], deadline: float | None) -> None:
        self.method = method  # "/vllm.Inference/GenerateStream"
        self.metadata = metadata  # request metadata, lower-case keys
        self.peer = peer
        self.deadline = deadline  # trio.current_time() based, from grpc-timeout

    def __repr__(self) -> str:
        return f"<CallContext {self.method} from {self.peer[0]}:{self.peer[1]}>"


class _Method:
    __slots__ = ("handler", "path", "request_type", "streaming", "takes_context")

    def __init__(self, path: str, handler: Callable | None, request_type: Any, streaming: bool) -> None:
        self.path = path
        self.handler = handler  # None: not implemented by the servicer
        self.request_type = request_type
        self.streaming = streaming
        self.takes_context = handler is not None and len(inspect.signature(handler).parameters) >= 2


class _Probe:
    """Stands in for a servicer while its generated ``service`` property lists the methods.

    The generated property passes bound methods to ``purerpc.Service.add_method``, which insists on the
    stock ``(input_message)`` or ``(input_message, request)`` signatures; our handlers take
    ``(request, context)``, so the property is evaluated against placeholders instead.
    """

    def __getattr__(self, name: str) -> Callable:
        def placeholder(input_message):  # type: ignore[no-untyped-def]
            raise AssertionError("placeholder")

        return placeholder


def _collect_methods(servicers: Iterable[Any]) -> dict[str, _Method]:
    methods: dict[str, _Method] = {}
    for servicer in servicers:
        cls = type(servicer)
        owner = next((klass for klass in cls.__mro__ if "service" in vars(klass)), None)
        if owner is None:
            raise TypeError(f"{cls.__name__} is not a generated purerpc Servicer (no 'service' property)")
        service = vars(owner)["service"].fget(_Probe())
        for name, bound in service.methods.items():
            path = f"/{service.name}/{name}"
            if path in methods:
                raise ValueError(f"method {path} is served twice")
            signature = bound.signature
            handler = getattr(servicer, name, None)
            overridden = getattr(cls, name, None) is not vars(owner).get(name)
            supported = signature.cardinality in (Cardinality.UNARY_UNARY, Cardinality.UNARY_STREAM)
            methods[path] = _Method(
                path,
                handler if overridden and supported else None,
                signature.request_type,
                signature.cardinality == Cardinality.UNARY_STREAM,
            )
    return methods


class _ServerCall(Call):
    __slots__ = ("path", "request_ended", "reset", "response_started", "scope")

    def __init__(self, conn: Connection, stream_id: int, path: str, deadline: float) -> None:
        super().__init__(conn, stream_id)
        self.path = path
        self.scope = trio.CancelScope(deadline=deadline)
        self.request_ended = False
        self.response_started = False
        self.reset = False  # the client reset the stream (or the connection died)

    async def receive_request(self, request_type: Any) -> Any:
        while not self.request_ended:
            if self.error is not None:
                raise self.error
            await self.wait()
        if len(self.messages) != 1:
            raise RpcError(StatusCode.INTERNAL, f"expected 1 request message, received {len(self.messages)}")
        event = self.messages.popleft()
        self.conn.acknowledge(self.stream_id, event.flow_controlled_length)
        return parse_message(request_type, event.data, "the request message")

    async def send_response(self, response: Any) -> None:
        if self.reset:
            # Reset (or connection lost): the scope is cancelled; raise Cancelled here rather than let a
            # producer that never awaits keep feeding a closed stream.
            await trio.lowlevel.checkpoint()
        limit = self.conn.protocol.config.max_message_length
        if type(response) is FramedMessages:
            payload: bytes = response
            oversize = _oversize_split(payload, limit) if len(payload) > limit else None
            if oversize is not None:
                offset, length = oversize
                if offset:
                    await self._send_payload(payload[:offset])
                raise RpcError(
                    StatusCode.RESOURCE_EXHAUSTED, f"trying to send message larger than max ({length} vs. {limit})"
                )
            if payload:
                await self._send_payload(payload)
            return
        data = response.SerializeToString()
        if len(data) > limit:
            raise RpcError(
                StatusCode.RESOURCE_EXHAUSTED, f"trying to send message larger than max ({len(data)} vs. {limit})"
            )
        await self._send_payload(frame_message(data))

    async def _send_payload(self, payload: bytes) -> None:
        if not self.response_started:
            self.response_started = True
            self.conn.protocol.send_headers(self.stream_id, _RESPONSE_HEADERS)
        await self.conn.send_message(self, payload, False)

    def finish(self, code: StatusCode, message: str = "", metadata: Iterable[tuple[str, str]] = ()) -> None:
        """Send the status (trailers, or a trailers-only response) and end the stream."""
        conn = self.conn
        if self.done or self.reset or conn.lost is not None:
            return
        self.done = True
        conn.calls.pop(self.stream_id, None)
        conn.last_active = trio.current_time()  # type: ignore[attr-defined]
        if code == StatusCode.OK and not message and not metadata and self.response_started:
            trailers: list = list(_OK_TRAILERS)
        else:
            trailers = [] if self.response_started else list(_RESPONSE_HEADERS)
            trailers.append(("grpc-status", str(int(code))))
            if message:
                trailers.append(("grpc-message", encode_grpc_message(message)))
            if metadata:
                try:
                    trailers.extend(encode_metadata(metadata))
                except (ValueError, TypeError, AttributeError):
                    LOGGER.error("invalid trailing metadata for %s dropped: %r", self.path, metadata)
        conn.protocol.send_trailers(self.stream_id, trailers)  # (False: the stream was closed meanwhile)
        if not self.request_ended:
            # The request is not complete: tell the client to stop sending (RFC 9113 section 8.1).
            conn.protocol.reset_stream(self.stream_id, ErrorCodes.NO_ERROR)
        self.release_messages()
        conn.flush()

    def close(self) -> None:
        """After the handler: if no status was sent (cancelled by the server itself), reset the stream."""
        if self.done:
            return
        self.done = True
        conn = self.conn
        conn.calls.pop(self.stream_id, None)
        conn.last_active = trio.current_time()  # type: ignore[attr-defined]
        if conn.lost is None:
            if not self.reset:
                conn.protocol.reset_stream(self.stream_id, ErrorCodes.CANCEL)
                conn.kick()
            self.release_messages()


class _ServerConnection(Connection):
    def __init__(self, stream: trio.SocketStream, protocol: GrpcProtocol, server: GrpcServer) -> None:
        peer = stream.socket.getpeername()
        super().__init__(stream, protocol, f"{peer[0]}:{peer[1]}")
        self.server = server
        self.peer: tuple[str, int] = (peer[0], peer[1])
        self.handshaken = trio.Event()  # the client's SETTINGS arrived
        self.last_active = trio.current_time()  # when the last stream ended (or the connection opened)
        # PING policing (``ServerLimits.keepalive``): the last PING's time, the strikes, and the count of data
        # frames sent at that PING (a data frame sent since forgives the earlier PINGs).
        self._last_ping = -math.inf
        self._ping_strikes = 0
        self._sent_at_last_ping = -1

    async def supervise(self, limits: ServerLimits) -> None:
        """Close the connection when its handshake or, later, an idle period exceeds ``limits``."""
        with trio.move_on_after(limits.handshake_timeout):
            await self.handshaken.wait()
        if not self.handshaken.is_set():
            LOGGER.debug(
                "transport: closing %s: no HTTP/2 handshake within %s s", self.description, limits.handshake_timeout
            )
            self.lose(f"connection from {self.description} closed: handshake timeout")
            return
        idle_timeout = limits.idle_timeout
        if idle_timeout is None:
            return
        while self.lost is None:
            now = trio.current_time()
            if self.calls:
                deadline = now + idle_timeout
            else:
                deadline = self.last_active + idle_timeout
                if now >= deadline:
                    LOGGER.debug("transport: closing %s: idle for %s s", self.description, idle_timeout)
                    await self.aclose()  # GOAWAY (NO_ERROR), then close
                    return
            await trio.sleep_until(deadline)

    def connection_lost(self, call: Call, reason: str) -> None:
        call.reset = True  # type: ignore[attr-defined]
        call.scope.cancel()  # type: ignore[attr-defined]
        call.wake()

    def handle_events(self, events: list) -> None:
        calls = self.calls
        for event in events:
            kind = type(event)
            if kind is MessageReceived:
                call = calls.get(event.stream_id)
                if call is None:
                    self.protocol.acknowledge(event.stream_id, event.flow_controlled_length)
                else:
                    call.messages.append(event)
            elif kind is RequestReceived:
                self._request_received(event)
            elif kind is RequestEnded:
                call = calls.get(event.stream_id)
                if call is not None:
                    call.request_ended = True  # type: ignore[attr-defined]
                    call.wake()
            elif kind is WindowUpdated:
                self.wake_window_waiters(event.stream_id)
            elif kind is StreamReset:
                call = calls.pop(event.stream_id, None)
                if call is not None:
                    self.last_active = trio.current_time()
                    self.connection_lost(call, "reset")
            elif kind is StreamFailed:
                call = calls.get(event.stream_id)
                if call is not None:
                    call.finish(event.code, event.message)  # type: ignore[attr-defined]
                    call.scope.cancel()  # type: ignore[attr-defined]
                else:
                    self._reject(event.stream_id, event.code, event.message)
            elif kind is SettingsReceived:
                self.handshaken.set()
                self.wake_window_waiters(0)
            elif kind is GoAway:
                pass  # the client is going away; its open calls continue until the socket closes
            elif kind is PingReceived:
                policy = self.server.limits.keepalive
                if policy is not None and policy.max_ping_strikes is not None:
                    self._police_ping(policy.min_ping_interval_without_data, policy.max_ping_strikes)

    def _police_ping(self, min_interval: float, max_strikes: int) -> None:
        """gRPC-core's ping abuse policy (``ServerLimits.keepalive``), for one PING received."""
        protocol = self.protocol
        if protocol.data_frames_sent != self._sent_at_last_ping:  # data sent since the last PING: forgiven
            self._sent_at_last_ping = protocol.data_frames_sent
            self._last_ping = -math.inf
            self._ping_strikes = 0
        now = trio.current_time()
        interval = min_interval if self.calls else _IDLE_PING_INTERVAL
        too_soon = self._last_ping + interval > now
        self._last_ping = now
        if not too_soon:
            return
        self._ping_strikes += 1
        if self._ping_strikes <= max_strikes or max_strikes == 0:
            return
        LOGGER.debug("transport: %s sent too many PINGs; GOAWAY ENHANCE_YOUR_CALM", self.description)
        protocol.close_connection(ErrorCodes.ENHANCE_YOUR_CALM, TOO_MANY_PINGS)
        self._flush_final()
        self.lose(f"connection from {self.description} closed: too many pings")

    def _reject(self, stream_id: int, code: StatusCode, message: str) -> None:
        trailers = [*_RESPONSE_HEADERS, ("grpc-status", str(int(code))), ("grpc-message", encode_grpc_message(message))]
        self.protocol.send_trailers(stream_id, trailers)
        self.protocol.reset_stream(stream_id, ErrorCodes.NO_ERROR)
        self.kick()
        self.last_active = trio.current_time()

    def _request_received(self, event: RequestReceived) -> None:
        path = f"/{event.service_name}/{event.method_name}"
        method = self.server._methods.get(path)
        if method is None or method.handler is None:
            self._reject(event.stream_id, StatusCode.UNIMPLEMENTED, f"method {path} is not implemented")
            return
        timeout = event.timeout
        deadline = math.inf if timeout is None else trio.current_time() + timeout.total_seconds()
        call = _ServerCall(self, event.stream_id, path, deadline)
        self.calls[event.stream_id] = call
        context = CallContext(path, event.custom_metadata, self.peer, None if timeout is None else deadline)
        self.nursery.start_soon(self._run_call, call, method, context)  # type: ignore[union-attr]

    async def _run_call(self, call: _ServerCall, method: _Method, context: CallContext) -> None:
        try:
            with call.scope:
                try:
                    request = await call.receive_request(method.request_type)
                    handler = method.handler
                    if method.streaming:
                        responses = handler(request, context) if method.takes_context else handler(request)  # type: ignore[misc]
                        try:
                            async for response in responses:
                                await call.send_response(response)
                        finally:
                            await responses.aclose()
                    else:
                        response = await (handler(request, context) if method.takes_context else handler(request))  # type: ignore[misc]
                        await call.send_response(response)
                    call.finish(StatusCode.OK)
                except RpcError as exc:
                    call.finish(exc.code, exc.message, exc.trailing_metadata)
                except Exception:
                    LOGGER.exception("handler for %s raised", call.path)
                    call.finish(StatusCode.UNKNOWN, UNEXPECTED_ERROR_MESSAGE)
            if call.scope.cancelled_caught and not call.reset and trio.current_time() >= call.scope.deadline:
                call.finish(StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        finally:
            call.close()


class GrpcServer:
    """A running ``serve_grpc`` server, as passed to ``task_status.started``."""

    def __init__(
        self, host: str, port: int, methods: dict[str, _Method], max_message_length: int, limits: ServerLimits
    ) -> None:
        self.host = host
        self.port = port
        self.open_connections = 0
        self.max_message_length = max_message_length
        self.limits = limits
        self.refused_connections = 0  # turned away at the connection cap, since the server started
        self._methods = methods
        self._cap_logged_at = -math.inf
        self._refused_since_log = 0

    def _refuse(self, stream: trio.SocketStream) -> None:
        """At the connection cap: close the new connection at once; log at most once per interval."""
        stream.socket.close()
        self.refused_connections += 1
        self._refused_since_log += 1
        now = trio.current_time()
        if now - self._cap_logged_at >= _CAP_LOG_INTERVAL_S:
            LOGGER.warning(
                "connection limit reached: %d connections open (max_connections=%d); refused %d new "
                "connection(s) since the last report",
                self.open_connections,
                self.limits.max_connections,
                self._refused_since_log,
            )
            self._cap_logged_at = now
            self._refused_since_log = 0

    def __repr__(self) -> str:
        return f"<GrpcServer {self.host}:{self.port} [{self.open_connections} open connections]>"

    async def _handle_connection(self, stream: trio.SocketStream) -> None:
        try:
            try:
                protocol = GrpcProtocol(
                    GRPCConfiguration(client_side=False, max_message_length=self.max_message_length)
                )
                conn = _ServerConnection(stream, protocol, self)
            except OSError:  # the peer is already gone (getpeername fails)
                stream.socket.close()
                return
            protocol.initiate_connection()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(conn.supervise, self.limits)
                await conn.run()
                nursery.cancel_scope.cancel()
        except Exception:  # a bug in one connection must not take the server down
            LOGGER.exception("transport: connection handler failed")
            stream.socket.close()
        finally:
            self.open_connections -= 1


async def _bind(host: str, port: int) -> trio.SocketListener:
    infos = await trio.socket.getaddrinfo(host, port, type=stdlib_socket.SOCK_STREAM, flags=stdlib_socket.AI_PASSIVE)
    if not infos:  # pragma: no cover - getaddrinfo raises instead
        raise OSError(f"cannot resolve {host!r}")
    family, type_, proto, _, sockaddr = infos[0]
    sock = trio.socket.socket(family, type_, proto)
    try:
        # SO_REUSEADDR only lets a restart bind over TIME_WAIT connections; Linux still refuses a second
        # listener on the same port. SO_REUSEPORT (purerpc's default) is deliberately never set.
        sock.setsockopt(stdlib_socket.SOL_SOCKET, stdlib_socket.SO_REUSEADDR, 1)
        if family == stdlib_socket.AF_INET6:
            sock.setsockopt(stdlib_socket.IPPROTO_IPV6, stdlib_socket.IPV6_V6ONLY, 1)
        await sock.bind(sockaddr)
        sock.listen(1024)
    except BaseException:
        sock.close()
        raise
    return trio.SocketListener(sock)


async def serve_grpc(
    servicers: Iterable[Any],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    max_message_length: int = DEFAULT_MAX_MESSAGE_LENGTH,
    limits: ServerLimits = ServerLimits(),  # noqa: B008 (frozen)
    task_status: trio.TaskStatus[GrpcServer] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Serve gRPC on ``host:port`` until cancelled; start it with ``await nursery.start(serve_grpc, ...)``.

    Args:
        servicers: instances of generated purerpc ``*Servicer`` subclasses. Handlers are called as
            ``await handler(request, context)`` (unary) or iterated as ``handler(request, context)`` async
            generators (server streaming). Methods a servicer does not override answer UNIMPLEMENTED.
        host: the exact address to bind (default loopback); port 0 picks a free port.
        max_message_length: limit for one message, each way (also the cap on a decompressed message).
        limits: handshake and idle timeouts and the connection cap (``ServerLimits``).

    Returns:
        Never; ``task_status.started(server)`` reports the ``GrpcServer`` (``host``, ``port``,
        ``open_connections``).

    Raises:
        OSError: the address cannot be bound (e.g. the port is in use; no SO_REUSEPORT).

    Error handling: ``RpcError(code, message)`` from a handler answers that status; any other exception
    answers UNKNOWN ``"unexpected server error"`` (the traceback is logged, never sent). A handler is
    cancelled when its client resets the stream or disconnects, and at its ``grpc-timeout`` deadline
    (answering DEADLINE_EXCEEDED).

    Resource handling: cancelling ``serve_grpc`` closes the listener and every connection.
    """
    methods = _collect_methods(servicers)
    listener = await _bind(host, port)
    try:
        bound = listener.socket.getsockname()
        server = GrpcServer(bound[0], bound[1], methods, max_message_length, limits)
        with collapse_single_exception():
            async with trio.open_nursery() as nursery:
                task_status.started(server)
                while True:
                    try:
                        stream = await listener.accept()
                    except OSError as exc:
                        if exc.errno in _ACCEPT_CAPACITY_ERRNOS:
                            LOGGER.error("accept() failed (%s); retrying in 100 ms", exc)
                            await trio.sleep(0.1)
                            continue
                        raise
                    if server.open_connections >= limits.max_connections:
                        server._refuse(stream)
                        continue
                    server.open_connections += 1  # (counted here, so a burst of accepts sees the cap)
                    nursery.start_soon(server._handle_connection, stream)
    finally:
        listener.socket.close()
    raise AssertionError("unreachable")  # pragma: no cover
