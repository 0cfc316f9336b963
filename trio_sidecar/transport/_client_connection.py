"""The client side of a connection: the reader's dispatch of protocol events to client calls.

``ClientConnection`` is the ``Connection`` a ``Channel`` owns; ``ClientCall`` is one call's state, shared by
the reader task (which fills it) and the caller (``Channel``/``ResponseStream``, in ``_client``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import cast

import trio

from trio_sidecar.core.status import StatusCode

from ._connection import Call, Connection
from ._errors import RpcError, StreamNotProcessedError
from ._events import (
    GoAway,
    MessageReceived,
    ResponseEnded,
    ResponseReceived,
    SettingsReceived,
    StreamFailed,
    StreamReset,
    WindowUpdated,
)
from ._keepalive import TOO_MANY_PINGS, throttle_keepalive
from ._protocol import ErrorCodes, GrpcProtocol

__all__ = ["ClientCall", "ClientConnection", "NoStreamSlot", "StreamRefused", "listener_failed"]

LOGGER = logging.getLogger("trio_sidecar.transport.client")

RESET_CODES = {
    ErrorCodes.CANCEL: (StatusCode.CANCELLED, "stream cancelled by the server"),
    ErrorCodes.REFUSED_STREAM: (StatusCode.UNAVAILABLE, "stream refused by the server"),
    ErrorCodes.ENHANCE_YOUR_CALM: (StatusCode.RESOURCE_EXHAUSTED, "stream reset by the server (ENHANCE_YOUR_CALM)"),
}


class StreamRefused(RpcError):
    """RST_STREAM(REFUSED_STREAM): the server did not process the stream (RFC 9113 section 8.7), so the call can be
    started again on a new stream. grpc-core does this transparently; a server at its
    MAX_CONCURRENT_STREAMS may refuse a stream our count saw as free (it still counts a stream we already
    saw end)."""


def listener_failed(exc: Exception) -> RpcError:
    return RpcError(StatusCode.INTERNAL, f"response listener failed: {exc!r}")


class ClientCall(Call):
    __slots__ = ("end", "headers", "listener", "listener_flush")

    def __init__(self, conn: Connection, stream_id: int) -> None:
        super().__init__(conn, stream_id)
        self.headers: ResponseReceived | None = None
        self.end: ResponseEnded | None = None
        #: ``ResponseStream.listen``: messages go to it from the reader instead of queueing for the owner.
        self.listener: Callable[[bytes], bool] | None = None
        #: ``listen``'s ``flush``: called after each run of messages handed to ``listener`` together.
        self.listener_flush: Callable[[], bool] | None = None

    def close(self) -> None:
        """Forget the call; if the server has not ended the stream, reset it (RST_STREAM CANCEL) now."""
        if self.done:
            return
        self.done = True
        conn = self.conn
        conn.calls.pop(self.stream_id, None)
        if conn.lost is None:
            if self.end is None and self.error is None:
                conn.protocol.reset_stream(self.stream_id, ErrorCodes.CANCEL)
                conn.kick()
                conn.stream_ended()  # type: ignore[attr-defined]
            self.release_messages()

    def peer_ended(self) -> bool:
        return self.end is not None

    def status_error(self) -> RpcError | None:
        """The error a non-OK end represents (None for OK)."""
        status = self.end.status  # type: ignore[union-attr]
        code = status.int_value
        if code == 0:
            return None
        return RpcError(StatusCode.from_wire(code), status.status_message, self.end.custom_metadata)  # type: ignore[union-attr]

    def take_message(self) -> bytes:
        event = self.messages.popleft()
        conn = self.conn  # (Connection.acknowledge, inlined: once per message)
        if conn.lost is None and conn.protocol.acknowledge(self.stream_id, event.flow_controlled_length):
            conn.kick()
        return event.data


class NoStreamSlot(Exception):
    """The server's MAX_CONCURRENT_STREAMS is reached (internal: the call waits for a free stream)."""


class ClientConnection(Connection):
    def __init__(self, stream: trio.SocketStream, protocol: GrpcProtocol, description: str) -> None:
        super().__init__(stream, protocol, description)
        self.goaway: str | None = None
        self.too_many_pings = False
        self.goaway_frame: str | None = None  # the last GOAWAY received, described ("GOAWAY, error code 11: ...")
        self._slot_waiters: list = []

    async def wait_stream_slot(self) -> None:
        """Park until some stream of this connection ends (or the connection is lost)."""
        if self.lost is not None:
            return
        task = trio.lowlevel.current_task()
        self._slot_waiters.append(task)

        def abort(raise_cancel):  # type: ignore[no-untyped-def]
            try:
                self._slot_waiters.remove(task)
            except ValueError:
                pass
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)

    def stream_ended(self) -> None:
        if self._slot_waiters:
            waiters, self._slot_waiters = self._slot_waiters, []
            for task in waiters:
                trio.lowlevel.reschedule(task)

    def lose(self, reason: str) -> None:
        if self.goaway_frame is not None and self.lost is None and "GOAWAY" not in reason:
            reason = f"{reason} (after {self.goaway_frame})"  # e.g. the server's close after too_many_pings
        super().lose(reason)
        self.stream_ended()

    def handle_events(self, events: list) -> None:
        calls = cast("dict[int, ClientCall]", self.calls)  # this connection's calls are all client calls
        flushing: ClientCall | None = None  # a listening call handed messages in this run, not flushed yet
        for event in events:
            kind = type(event)
            if flushing is not None and (kind is not MessageReceived or event.stream_id != flushing.stream_id):
                self._flush_listener(flushing)  # the run ended: before anything else is reported
                flushing = None
            if kind is MessageReceived:
                call = calls.get(event.stream_id)
                if call is None:
                    self.protocol.acknowledge(event.stream_id, event.flow_controlled_length)
                elif call.listener is None:
                    call.messages.append(event)
                    call.wake()
                else:
                    self._deliver(call, event)
                    if call.listener_flush is not None:
                        flushing = call
            elif kind is ResponseReceived:
                call = calls.get(event.stream_id)
                if call is not None:
                    call.headers = event  # type: ignore[attr-defined]
                    call.wake()
            elif kind is ResponseEnded:
                call = calls.pop(event.stream_id, None)
                if call is not None:
                    call.end = event  # type: ignore[attr-defined]
                    call.wake()
            elif kind is WindowUpdated:
                self.wake_window_waiters(event.stream_id)
            elif kind is StreamReset:
                call = calls.pop(event.stream_id, None)
                if call is not None and call.end is None:  # type: ignore[attr-defined]
                    code, message = RESET_CODES.get(
                        event.error_code,
                        (StatusCode.INTERNAL, f"stream reset by the server (error code {event.error_code})"),
                    )
                    error_type = StreamRefused if event.error_code == ErrorCodes.REFUSED_STREAM else RpcError
                    call.fail(error_type(code, message))
            elif kind is StreamFailed:
                call = calls.pop(event.stream_id, None)
                if call is not None:
                    call.fail(RpcError(event.code, event.message))
            elif kind is SettingsReceived:
                self.wake_window_waiters(0)
            elif kind is GoAway:
                self._goaway(event)
        if flushing is not None:
            self._flush_listener(flushing)
        if self._slot_waiters:
            self.stream_ended()

    def _deliver(self, call: ClientCall, event: MessageReceived) -> None:
        """Hand a message to the call's listener (``ResponseStream.listen``), from this reader task."""
        # Consumed now, by the listener (Connection.acknowledge, inlined: the connection is not lost).
        if self.protocol.acknowledge(call.stream_id, event.flow_controlled_length):
            self.kick()
        try:
            stop = call.listener(event.data)  # type: ignore[misc]
        except Exception as exc:  # a listener must not raise; if one does, only its own call fails
            self._listener_raised(call, exc)
            return
        if stop:
            call.listener = call.listener_flush = None
            call.wake()

    def _flush_listener(self, call: ClientCall) -> None:
        """The end of a run of messages handed to ``call``'s listener: its ``flush`` (if still listening)."""
        flush = call.listener_flush
        if flush is None:
            return
        try:
            stop = flush()
        except Exception as exc:  # as from the listener itself: only its own call fails
            self._listener_raised(call, exc)
            return
        if stop:
            call.listener = call.listener_flush = None
            call.wake()

    def _listener_raised(self, call: ClientCall, exc: Exception) -> None:
        LOGGER.exception("transport: a response listener failed on %s", self.description)
        call.listener = call.listener_flush = None
        # The stream is abandoned: reset it now (the owner's close() does not once the call failed).
        self.calls.pop(call.stream_id, None)
        self.protocol.reset_stream(call.stream_id, ErrorCodes.CANCEL)
        self.kick()
        call.fail(listener_failed(exc))
        self.stream_ended()

    def _goaway(self, event: GoAway) -> None:
        """GOAWAY (RFC 9113 section 6.8, as gRPC-core's client takes it): calls on streams above
        ``last_stream_id`` were not processed and fail with ``StreamNotProcessedError`` (UNAVAILABLE; they
        may be sent again on another connection); calls at or below it carry on to
        their end; no new call starts here. The peer closes the connection when it is done."""
        detail = f": {event.debug_data.decode('utf-8', 'replace')}" if event.debug_data else ""
        if event.error_code:
            reason = (
                f"connection to {self.description} closed by the peer (GOAWAY, error code {event.error_code}{detail})"
            )
        else:
            reason = f"connection to {self.description} is shutting down (GOAWAY{detail})"
        if self.goaway is None:
            LOGGER.info("transport: %s; %d calls open", reason, len(self.calls))
        self.goaway = reason
        self.goaway_frame = f"GOAWAY, error code {event.error_code}{detail}" if event.error_code else f"GOAWAY{detail}"
        if event.error_code == ErrorCodes.ENHANCE_YOUR_CALM and event.debug_data == TOO_MANY_PINGS:
            if not self.too_many_pings and self.keepalive_time is not None:
                self.keepalive_time = throttle_keepalive(self.description, self.keepalive_time)
            self.too_many_pings = True
        for stream_id in [sid for sid in self.calls if sid > event.last_stream_id]:
            self.calls.pop(stream_id).fail(StreamNotProcessedError(f"{reason}; the call was not processed"))
        self.stream_ended()
