"""The client side: ``connect_channel`` / ``open_channel`` and ``Channel``."""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, NoReturn

import trio
from purerpc.grpclib.config import GRPCConfiguration

from trio_sidecar.core.config import KeepaliveConfig
from trio_sidecar.core.status import StatusCode

from ._client_connection import ClientCall, ClientConnection, NoStreamSlot, StreamRefused, listener_failed
from ._connection import _copy_error, deadline_after, encode_metadata, parse_message
from ._errors import DEFAULT_MAX_MESSAGE_LENGTH, ConnectionLostError, RpcError, StreamNotProcessedError
from ._events import GoAway, SettingsReceived, StreamIdsExhausted, StreamLimitReached
from ._keepalive import keepalive_time_for
from ._protocol import CONNECTION_ERRORS, GrpcProtocol
from ._util import collapse_single_exception
from ._wire import encode_timeout, frame_message

__all__ = ["Channel", "ResponseStream", "connect_channel", "open_channel"]

LOGGER = logging.getLogger("trio_sidecar.transport.channel")

_REQUEST_HEADERS_TAIL = (("te", "trailers"), ("content-type", "application/grpc"))
_USER_AGENT = ("user-agent", "trio-sidecar (purerpc 0.8.0 core)")


def _deadline_exceeded() -> RpcError:
    return RpcError(StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")


#: Transparent retries of a refused stream per call (each after a short pause, within the call's deadline).
REFUSED_STREAM_RETRIES = 5
_REFUSED_STREAM_PAUSE = 0.005


def _raise_call_error(error: RpcError) -> NoReturn:
    if isinstance(error, StreamRefused):
        raise StreamRefused(error.code, error.message)
    raise _copy_error(error)


async def _pause_before_retry(attempt: int, deadline: float, timeout: float | None) -> float | None:
    """Sleep briefly before re-sending a refused call; returns the remaining ``timeout`` (``grpc-timeout``)."""
    now = trio.current_time()
    if now >= deadline:
        raise _deadline_exceeded()
    await trio.sleep(min(_REFUSED_STREAM_PAUSE * (attempt + 1), deadline - now))
    if trio.current_time() >= deadline:
        raise _deadline_exceeded()
    return None if timeout is None else deadline - trio.current_time()


class Channel:
    """One HTTP/2 connection to a gRPC server; any number of concurrent calls.

    Created by ``connect_channel`` (caller's nursery) or ``open_channel``. A channel never reconnects:
    after a connection-level failure it is ``broken`` and every call raises ``ConnectionLostError``
    (UNAVAILABLE); the owner replaces it.
    """

    def __init__(
        self,
        stream: trio.SocketStream,
        host: str,
        port: int,
        max_message_length: int,
        keepalive: KeepaliveConfig | None = None,
    ) -> None:
        description = f"{host}:{port}"
        protocol = GrpcProtocol(GRPCConfiguration(client_side=True, max_message_length=max_message_length))
        self._conn = ClientConnection(stream, protocol, description)
        self._conn.keepalive = keepalive
        self._conn.keepalive_time = None if keepalive is None else keepalive_time_for(description, keepalive.time)
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._head = ((":method", "POST"), (":scheme", "http"), (":authority", authority))
        self.max_message_length = max_message_length
        self.host = host
        self.port = port
        self.closed = False
        self.local_address: tuple[str, int] = tuple(stream.socket.getsockname()[:2])  # type: ignore[assignment]

    def __repr__(self) -> str:
        state = "closed" if self.closed else "broken" if self.broken else "open"
        return f"<Channel {self.host}:{self.port} [{state}, {len(self._conn.calls)} active calls]>"

    @property
    def draining(self) -> bool:
        """The server sent GOAWAY but the connection is up: calls already open may still finish."""
        return self._conn.goaway is not None and self._conn.lost is None

    @property
    def too_many_pings(self) -> bool:
        """The server's GOAWAY was ENHANCE_YOUR_CALM ``too_many_pings`` (this target's keepalive is throttled)."""
        return self._conn.too_many_pings

    async def wait_idle(self) -> None:
        """Park until no call is open on the connection (or it is lost or closed)."""
        conn = self._conn
        while conn.calls and conn.lost is None:
            await conn.wait_stream_slot()

    @property
    def broken(self) -> bool:
        """A connection-level failure (or GOAWAY) was observed: the owner should replace the channel."""
        return self._conn.lost is not None or self._conn.goaway is not None

    # -- calls ---------------------------------------------------------------------------------------

    def _check_size(self, data: bytes) -> None:
        if len(data) > self.max_message_length:
            raise RpcError(
                StatusCode.RESOURCE_EXHAUSTED,
                f"trying to send message larger than max ({len(data)} vs. {self.max_message_length})",
            )

    def _start_call(self, method: str, metadata: Sequence[tuple[str, Any]], timeout: float | None) -> ClientCall:
        conn = self._conn
        if conn.lost is not None:
            raise ConnectionLostError("channel closed" if self.closed else conn.lost)
        if conn.goaway is not None:
            raise StreamNotProcessedError(conn.goaway)
        headers = [*self._head, (":path", method), *_REQUEST_HEADERS_TAIL]
        if timeout is not None:
            headers.append(("grpc-timeout", encode_timeout(timeout)))
        if metadata:
            headers.extend(encode_metadata(metadata))
        try:
            stream_id = conn.protocol.open_stream(headers)
        except StreamLimitReached:
            raise NoStreamSlot from None
        except StreamIdsExhausted:
            conn.goaway = f"connection to {conn.description} ran out of stream ids"
            raise StreamNotProcessedError(conn.goaway) from None
        call = ClientCall(conn, stream_id)
        conn.calls[stream_id] = call
        if conn.keepalive_waiter is not None:
            conn.call_started()
        return call

    async def _open_call(
        self, method: str, metadata: Sequence[tuple[str, Any]], timeout: float | None, deadline: float
    ) -> ClientCall:
        """Start a call; while the server's MAX_CONCURRENT_STREAMS is reached, wait for a free stream."""
        while True:
            try:
                return self._start_call(method, metadata, timeout)
            except NoStreamSlot:
                pass
            with trio.move_on_at(deadline):
                await self._conn.wait_stream_slot()
            now = trio.current_time()
            if now >= deadline:
                raise _deadline_exceeded()
            if timeout is not None:
                timeout = deadline - now

    async def _request(
        self,
        method: str,
        metadata: Sequence[tuple[str, Any]],
        timeout: float | None,
        deadline: float,
        data: bytes,
        *,
        headers_only: bool,
    ) -> tuple[ClientCall, bool]:
        """Start a call, send the request ``data`` and wait for the response headers (``headers_only``) or
        the call's end; returns the call and whether ``deadline`` passed first.

        A stream the server refuses (RST_STREAM REFUSED_STREAM: not processed) is started again on a new
        stream, up to ``REFUSED_STREAM_RETRIES`` times, after a short pause, within the deadline. On any
        exception (cancellation included) the call is closed: RST_STREAM(CANCEL) at once.
        """
        attempt = 0
        while True:
            call = await self._open_call(method, metadata, timeout, deadline)
            try:
                if deadline == math.inf:
                    # (No cancel scope when there is no deadline: one less enter and exit per call.)
                    await self._exchange(call, data, headers_only)
                    return call, False
                with trio.move_on_at(deadline) as scope:
                    await self._exchange(call, data, headers_only)
                return call, scope.cancelled_caught
            except StreamRefused as exc:
                call.close()
                if self._conn.goaway is not None:
                    # Refused by a GOAWAY (or refused, then GOAWAY): no new stream on this connection.
                    raise StreamNotProcessedError(exc.message) from None
                if attempt == REFUSED_STREAM_RETRIES:
                    raise
                timeout = await _pause_before_retry(attempt, deadline, timeout)
                attempt += 1
            except BaseException:
                call.close()
                raise

    async def _exchange(self, call: ClientCall, data: bytes, headers_only: bool) -> None:
        await self._conn.send_message(call, frame_message(data), True, flush=True)
        while call.end is None and (not headers_only or call.headers is None):
            if call.error is not None:
                _raise_call_error(call.error)
            await call.wait()

    async def unary_unary(
        self,
        method: str,
        request: Any,
        response_type: Any,
        *,
        metadata: Sequence[tuple[str, Any]] = (),
        timeout: float | None = None,
    ) -> Any:
        """Call a unary RPC (``method`` is the full path, e.g. ``"/vllm.Control/GetModelInfo"``).

        Raises:
            RpcError: the server answered a non-OK status; DEADLINE_EXCEEDED when ``timeout`` (seconds,
                also sent as ``grpc-timeout``) expires; RESOURCE_EXHAUSTED for an over-limit message.
            ConnectionLostError: the connection failed (UNAVAILABLE).

        Cancellation: the stream is reset (RST_STREAM CANCEL) at once; the channel stays usable.
        """
        data = request.SerializeToString()
        self._check_size(data)
        deadline = deadline_after(timeout)
        if timeout is not None and timeout <= 0:
            raise _deadline_exceeded()
        call, timed_out = await self._request(method, metadata, timeout, deadline, data, headers_only=False)
        try:
            if timed_out:
                raise _deadline_exceeded()
            error = call.status_error()
            if error is not None:
                raise error
            if len(call.messages) != 1:
                raise RpcError(
                    StatusCode.INTERNAL, f"unary call {method} returned {len(call.messages)} messages, expected 1"
                )
            payload = call.take_message()
        finally:
            call.close()
        return parse_message(response_type, payload, f"the response message of {method}")

    def unary_stream(
        self,
        method: str,
        request: Any,
        response_type: Any,
        *,
        metadata: Sequence[tuple[str, Any]] = (),
        timeout: float | None = None,
    ) -> ResponseStream:
        """Open a server-streaming call: ``async with channel.unary_stream(...) as stream: async for ...``.

        ``__aenter__`` sends the request and waits for the response headers: a non-OK trailers-only answer
        raises ``RpcError`` there. Iterating yields messages until OK trailers; a non-OK status raises
        ``RpcError``; a lost connection raises ``ConnectionLostError`` promptly. With ``response_type``
        ``None`` the messages are the serialized bytes, not parsed (as grpcio without a deserializer).

        Cancellation: leaving the block before the end (break, cancel, exception) resets the stream
        (RST_STREAM CANCEL) at once; other calls on the channel are unaffected.
        """
        return ResponseStream(self, method, request, response_type, metadata, timeout)

    async def aclose(self) -> None:
        """Close the connection (GOAWAY, then the socket); open calls fail with ``ConnectionLostError``."""
        if self.closed:
            return
        self.closed = True
        await self._conn.aclose()

    async def __aenter__(self) -> Channel:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class ResponseStream:
    """The response side of a server-streaming call (see ``Channel.unary_stream``)."""

    def __init__(
        self,
        channel: Channel,
        method: str,
        request: Any,
        response_type: Any,
        metadata: Sequence[tuple[str, Any]],
        timeout: float | None,
    ) -> None:
        self._channel = channel
        self._method = method
        self._request = request
        self._response_type = response_type
        self._metadata = metadata
        self._timeout = timeout
        self._deadline = math.inf
        self._call: ClientCall | None = None
        self._what = f"a response message of {method}"  # (parse_message's text, built once per call)
        self.initial_metadata: tuple = ()
        self.trailing_metadata: tuple = ()

    async def __aenter__(self) -> ResponseStream:
        channel = self._channel
        data = self._request.SerializeToString()
        channel._check_size(data)
        timeout = self._timeout
        if timeout is not None and timeout <= 0:
            raise _deadline_exceeded()
        self._deadline = deadline_after(timeout)
        call, timed_out = await channel._request(
            self._method, self._metadata, timeout, self._deadline, data, headers_only=True
        )
        self._call = call
        try:
            if timed_out:
                raise _deadline_exceeded()
            if call.headers is not None:
                self.initial_metadata = call.headers.custom_metadata
            if call.end is not None and not call.messages:
                # A non-OK answer without messages (usually trailers-only) fails the open itself.
                error = call.status_error()
                if error is not None:
                    raise error
        except BaseException:
            call.close()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop the call now: if the server has not ended it, RST_STREAM(CANCEL) is sent at once."""
        if self._call is not None:
            self._call.close()

    def __aiter__(self) -> AsyncIterator[Any]:
        return self

    async def listen(self, listener: Callable[[bytes], bool], flush: Callable[[], bool] | None = None) -> bool:
        """Hand every response message (serialized) to ``listener(data)`` as it is received, instead of
        iterating, until ``listener`` returns True or the stream ends. Only with ``response_type=None``.

        Messages already received go to ``listener`` first, from the calling task; later ones from the
        connection's reader task, as soon as they are read: no task switch per message. Each is counted as
        consumed (HTTP/2 flow control) when handed over, so the listener is the back-pressure: it must not
        block, await or raise (an exception fails this call with INTERNAL, as a stream error).

        ``flush()``, if given, is called after each run of messages handed over together (those already
        buffered; those of one read from the socket), before anything else about the stream is reported,
        in the same task and without a checkpoint in between, so a listener may collect a run and hand it on
        at once. Its contract is the listener's: True stops delivery as the listener's True does; it must not
        block, await or raise.

        Contract for code that runs in the reader task (``listener`` and ``flush``; the engine's response
        conversion runs here):

        * It runs in the connection's reader task, not in the task that called ``listen``: the caller's
          cancel scopes, deadlines and context variables do not apply to it, and an exception from it never
          reaches the caller as itself (the call fails with INTERNAL ``response listener failed: ...``,
          only this call; the reader carries on).
        * While it runs, nothing else on this connection is read: other calls' messages, WINDOW_UPDATE,
          PING acks and the keepalive all wait. It must be short and bounded (no awaiting, no blocking I/O,
          no sleeping, no waiting on locks); hand bigger work to another task through a non-blocking
          primitive (``send_nowait`` on an unbounded memory channel, ``Event.set``, ``reschedule``).
        * It must not call this channel's async API; closing the call is done by returning True (the
          caller's ``listen`` then returns and the caller decides).

        Returns:
            True: ``listener`` returned True (the stream stays open; messages after it are not delivered).
            False: the stream ended with OK trailers (``trailing_metadata`` is set).

        Raises:
            RpcError: a non-OK status, a reset stream, a lost connection, or the call's deadline, after the
                messages received before it were handed over.
        """
        call = self._call
        if call is None:
            raise RuntimeError("use 'async with channel.unary_stream(...) as stream:' before listening")
        if self._response_type is not None:
            raise RuntimeError("listen() hands over serialized messages: open the stream with response_type=None")
        buffered = bool(call.messages)
        try:
            while call.messages:
                if listener(call.take_message()):
                    return True
            if buffered and flush is not None and flush():
                return True
        except Exception as exc:  # as from the reader task: only this call fails
            LOGGER.exception("transport: a response listener failed on %s", self._channel._conn.description)
            call.close()  # resets the stream unless the server already ended it
            raise listener_failed(exc) from exc
        call.listener = listener
        call.listener_flush = flush
        try:
            while True:
                if call.listener is None and call.error is None:
                    return True
                if self._ended(call):
                    return False
                if await self._wait(call) and call.listener is not None and call.end is None:
                    call.close()
                    raise _deadline_exceeded()
        finally:
            call.listener = call.listener_flush = None

    def _ended(self, call: ClientCall) -> bool:
        """True once the call ended with OK trailers (``trailing_metadata`` set, the call closed); raises the
        status of a non-OK end, the call's error, or ``RuntimeError`` for a call closed by its owner."""
        if call.end is not None:
            self.trailing_metadata = call.end.custom_metadata
            call.close()
            error = call.status_error()
            if error is not None:
                raise error
            return True
        if call.error is not None:
            call.close()
            raise _copy_error(call.error)
        if call.done:
            raise RuntimeError("the response stream is closed")
        return False

    async def _wait(self, call: ClientCall) -> bool:
        """Park until the reader wakes the call; returns whether the call's deadline has passed."""
        if self._deadline == math.inf:
            await call.wait()
            return False
        with trio.move_on_at(self._deadline):
            await call.wait()
        return trio.current_time() >= self._deadline

    async def __anext__(self) -> Any:
        call = self._call
        if call is None:
            raise RuntimeError("use 'async with channel.unary_stream(...) as stream:' before iterating")
        while True:
            if call.messages:
                await trio.lowlevel.checkpoint_if_cancelled()
                payload = call.take_message()
                if self._response_type is None:
                    return payload
                try:
                    return parse_message(self._response_type, payload, self._what)
                except RpcError:
                    call.close()
                    raise
            if self._ended(call):
                raise StopAsyncIteration
            if await self._wait(call) and not call.messages and call.end is None:
                call.close()
                raise _deadline_exceeded()


async def connect_channel(
    nursery: trio.Nursery,
    host: str,
    port: int,
    *,
    max_message_length: int = DEFAULT_MAX_MESSAGE_LENGTH,
    keepalive: KeepaliveConfig | None = None,
) -> Channel:
    """Connect over TCP and exchange the HTTP/2 preface; returns once the server's SETTINGS arrived.

    The channel's reader and writer run in ``nursery``; ``await channel.aclose()`` ends them.

    Keepalive (``keepalive``, gRPC's client keepalive; off when None or its ``time`` is None, as in gRPC):
    while a call is open and nothing was read for ``keepalive.time`` seconds, a PING is sent, never more
    often than a gRPC-core server permits (``KeepaliveConfig``); when nothing is read within
    ``keepalive.timeout`` seconds after it, the connection is lost and every open call fails with
    ``ConnectionLostError`` (UNAVAILABLE) naming the keepalive. After a GOAWAY ``too_many_pings`` from
    ``host:port``, new connections to it use twice the keepalive time (``_keepalive``).

    Raises:
        OSError: the TCP connection failed (refused, unreachable, ...).
        ConnectionLostError: the peer closed or broke the connection during the handshake.

    Cancellation: the caller bounds the attempt with a cancel scope; a cancelled attempt closes its socket.
    """
    stream = await trio.open_tcp_stream(host, port)
    try:
        channel = Channel(stream, host, port, max_message_length, keepalive)
        conn = channel._conn
        conn.protocol.initiate_connection()
        await stream.send_all(conn.protocol.data_to_send())
        settled = False
        while not settled:
            try:
                data = await stream.receive_some(65536)
            except trio.BrokenResourceError as exc:
                raise ConnectionLostError(
                    f"connection to {host}:{port} lost during the HTTP/2 handshake: {exc}"
                ) from exc
            if not data:
                raise ConnectionLostError(f"connection to {host}:{port} closed during the HTTP/2 handshake")
            try:
                events = conn.protocol.receive_data(data)
            except CONNECTION_ERRORS as exc:
                raise ConnectionLostError(f"HTTP/2 handshake with {host}:{port} failed: {exc}") from exc
            for event in events:
                if type(event) is SettingsReceived:
                    settled = True
                elif type(event) is GoAway:
                    raise ConnectionLostError(f"connection to {host}:{port} refused during the handshake (GOAWAY)")
        pending = conn.protocol.data_to_send()
        if pending:
            await stream.send_all(pending)
        await nursery.start(conn.run)
    except trio.BrokenResourceError as exc:
        # A send of the preface or of our SETTINGS ACK hit a reset connection.
        stream.socket.close()
        raise ConnectionLostError(f"connection to {host}:{port} lost during the HTTP/2 handshake: {exc}") from exc
    except BaseException:
        stream.socket.close()
        raise
    return channel


@asynccontextmanager
async def open_channel(
    host: str,
    port: int,
    *,
    max_message_length: int = DEFAULT_MAX_MESSAGE_LENGTH,
    keepalive: KeepaliveConfig | None = None,
) -> AsyncIterator[Channel]:
    """``connect_channel`` with its own nursery; the channel is closed when the block exits."""
    with collapse_single_exception():
        async with trio.open_nursery() as nursery:
            channel = await connect_channel(
                nursery,
                host,
                port,
                max_message_length=max_message_length,
                keepalive=keepalive,
            )
            try:
                yield channel
            finally:
                await channel.aclose()
