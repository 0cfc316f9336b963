"""purerpc's sans-IO gRPC core, with the gaps the transport needs closed (pure: no I/O, no Trio).

``GrpcProtocol`` subclasses ``purerpc.grpclib.connection.GRPCConnection`` (docs/reference/transport.md#the-h2-320-window_update-race):

* RST_STREAM from the peer becomes a ``StreamReset`` event (the core drops it);
* an oversize inbound message fails only its stream (``StreamFailed`` RESOURCE_EXHAUSTED) instead of
  raising out of ``receive_data`` and losing the other events of that read;
* malformed response/request headers or trailers fail only their stream (``StreamFailed``);
* DATA for a stream without a read buffer no longer raises ``KeyError``;
* GOAWAY becomes a ``GoAway`` event and the peer's first SETTINGS a ``SettingsReceived`` event;
* the h2 3.2.0 WINDOW_UPDATE-after-close race is handled inside h2 (``_h2.H2Connection``);
* the common frames take the transport's fast paths (``_fast``, docs/performance.md#fast-paths): plain DATA
  and HEADERS frames skip h2's frame buffer and objects, whole uncompressed messages skip purerpc's read
  buffer, and consumed bytes are counted without h2 while no WINDOW_UPDATE is due.

Flow control: received DATA is acknowledged when the application consumes the message (or drops the
stream), so a slow reader pushes back on its sender. ``discard_stream`` hands back everything still
buffered for a stream, so abandoned streams never eat the connection window.
"""

from __future__ import annotations

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import h2.stream
from h2.errors import ErrorCodes
from h2.settings import SettingCodes
from purerpc.grpclib.buffers import MessageReadBuffer
from purerpc.grpclib.config import GRPCConfiguration
from purerpc.grpclib.connection import GRPCConnection
from purerpc.grpclib.exceptions import MessageTooLargeError
from purerpc.grpclib.exceptions import ProtocolError as GrpcProtocolError
from purerpc.grpclib.headers import HeaderDict

from trio_sidecar.core.status import StatusCode

from . import _fast
from ._decompress import BoundedReadBuffer, MessageDecodeError, buffered_flow_controlled_length
from ._events import (
    PING_RECEIVED,
    SETTINGS_RECEIVED,
    GoAway,
    MessageReceived,
    RequestEnded,
    RequestReceived,
    ResponseEnded,
    ResponseReceived,
    StreamFailed,
    StreamIdsExhausted,
    StreamLimitReached,
    StreamReset,
    WindowUpdated,
)
from ._h2 import H2Connection, unpack_frame_header

__all__ = ["CONNECTION_ERRORS", "ErrorCodes", "GrpcProtocol"]

_MAX_WINDOW = 2**31 - 1

_OPEN_CONNECTION_STATES = frozenset(
    {h2.connection.ConnectionState.CLIENT_OPEN, h2.connection.ConnectionState.SERVER_OPEN}
)

# Errors that parsing a header block can raise (purerpc's parsers index dicts and call int()).
_HEADER_ERRORS = (GrpcProtocolError, ValueError, TypeError, KeyError, IndexError, AttributeError)

#: What ``receive_data`` raises for input that breaks the whole connection: h2's ProtocolError (GOAWAY is
#: queued) and undecodable header bytes (h2 decodes header blocks as UTF-8 after HPACK).
CONNECTION_ERRORS = (h2.exceptions.ProtocolError, UnicodeDecodeError)


_HTTP_TO_GRPC = {
    400: StatusCode.INTERNAL,
    401: StatusCode.UNAUTHENTICATED,
    403: StatusCode.PERMISSION_DENIED,
    404: StatusCode.UNIMPLEMENTED,
    429: StatusCode.UNAVAILABLE,
    502: StatusCode.UNAVAILABLE,
    503: StatusCode.UNAVAILABLE,
    504: StatusCode.UNAVAILABLE,
}


class GrpcProtocol(GRPCConnection):
    """``GRPCConnection`` with per-stream failure handling and a table-driven ``receive_data``."""

    #: SETTINGS_MAX_FRAME_SIZE advertised (HTTP/2's default, as grpc-go and Rust's h2 advertise; purerpc's
    #: 16 MiB let one peer make us buffer a 16 MiB frame per connection). A frame header declaring more is
    #: a connection error (FRAME_SIZE_ERROR) as soon as its 9 bytes arrive, before any payload is buffered.
    MAX_INBOUND_FRAME_SIZE = 16_384

    def __init__(self, config: GRPCConfiguration) -> None:
        self.config = config
        self.h2_connection = H2Connection(
            h2.config.H2Configuration(
                client_side=config.client_side,
                header_encoding="utf-8",
                # h2's per-header validation costs ~10% of a unary call's CPU each way. Outbound header
                # blocks are built here from constants and lower-cased metadata; inbound ones are parsed
                # by purerpc's parsers, whose failures fail only their stream (StreamFailed) instead of
                # the whole connection as h2's validation errors would.
                validate_outbound_headers=False,
                normalize_outbound_headers=False,
                validate_inbound_headers=False,
            )
        )
        self.h2_connection.clear_outbound_data_buffer()
        self._set_h2_connection_local_settings()
        self.message_read_buffers: dict[int, MessageReadBuffer] = {}
        #: HEADERS, DATA and WINDOW_UPDATE frames received (each one resets gRPC-core's ping policing), and
        #: their count when the last PING acknowledgement was read (-1: none yet).
        self.data_frames_received = 0
        self._data_frames_at_ping_ack = -1
        #: PING acknowledgements received.
        self.ping_acks_received = 0
        #: HEADERS, DATA and WINDOW_UPDATE frames queued (a server's ping policing forgives earlier PINGs).
        self.data_frames_sent = 0
        self._dispatch = {
            h2.events.RequestReceived: self._request_received,
            h2.events.ResponseReceived: self._response_received,
            h2.events.TrailersReceived: self._trailers_received,
            h2.events.DataReceived: self._data_received,
            h2.events.WindowUpdated: self._window_updated,
            h2.events.RemoteSettingsChanged: self._remote_settings_changed,
            h2.events.StreamEnded: self._stream_ended,
            h2.events.StreamReset: self._stream_reset,
            h2.events.ConnectionTerminated: self._connection_terminated,
            h2.events.PingAckReceived: self._ping_ack_received,
        }
        if not config.client_side:
            self._dispatch[h2.events.PingReceived] = self._ping_received

    def _set_h2_connection_local_settings(self) -> None:
        # The core sets the per-stream window to twice the message limit; clamp to HTTP/2's maximum.
        self.h2_connection.local_settings = h2.settings.Settings(
            client=self.config.client_side,
            initial_values={
                SettingCodes.MAX_CONCURRENT_STREAMS: self.MAX_CONCURRENT_STREAMS,
                SettingCodes.INITIAL_WINDOW_SIZE: min(2 * self.config.max_message_length, _MAX_WINDOW),
                SettingCodes.MAX_FRAME_SIZE: self.MAX_INBOUND_FRAME_SIZE,
                SettingCodes.MAX_HEADER_LIST_SIZE: self.MAX_HEADER_LIST_SIZE,
            },
        )
        self.h2_connection.max_inbound_frame_size = self.MAX_INBOUND_FRAME_SIZE

    # -- the surface the I/O layer uses (Connection, the client, the server) ----------------------------
    #
    # Everything below the h2/hpack/purerpc API line stays in this module: the I/O layer only calls these
    # methods (and ``receive_data``, ``discard_stream``, ``reset_stream``, ``initiate_connection``), and
    # catches only the exceptions this module exports (``StreamClosed``, ``StreamLimitReached``,
    # ``StreamIdsExhausted``, ``CONNECTION_ERRORS``). ``tests/transport/test_protocol_boundary.py`` checks it.

    def open_stream(self, headers: list) -> int:
        """Open a client stream with the request ``headers`` (no END_STREAM); returns its stream id.

        Raises:
            StreamLimitReached: the peer's MAX_CONCURRENT_STREAMS is reached (nothing was sent).
            StreamIdsExhausted: this connection has used every client stream id.
        """
        h2conn = self.h2_connection
        try:
            stream_id = h2conn.get_next_available_stream_id()
            h2conn.open_request_stream(stream_id, headers)
        except h2.exceptions.TooManyStreamsError:
            raise StreamLimitReached from None
        except h2.exceptions.NoAvailableStreamIDError:
            raise StreamIdsExhausted from None
        return stream_id

    def send_headers(self, stream_id: int, headers: list | tuple) -> None:
        """Queue a server's response headers on ``stream_id`` (raises as h2 for a closed stream)."""
        self.h2_connection.send_headers(stream_id, headers)
        self.data_frames_sent += 1

    def send_trailers(self, stream_id: int, headers: list) -> bool:
        """Queue ``headers`` with END_STREAM (trailers, or a trailers-only response); False when the stream
        can no longer take them (closed or reset meanwhile: nothing is queued)."""
        try:
            self.h2_connection.send_headers(stream_id, headers, end_stream=True)
        except h2.exceptions.ProtocolError:
            return False
        self.data_frames_sent += 1
        return True

    def send_message(self, stream_id: int, data: bytes, end_stream: bool) -> bool:
        """Queue ``data`` (framed gRPC messages) as one DATA frame if it fits both flow-control windows and one
        frame; False, with nothing queued, otherwise (``send_window`` and ``send_data`` then split it).

        Raises:
            StreamClosed: the stream is closed.
        """
        if self.h2_connection.try_send_data(stream_id, data, end_stream):
            self.data_frames_sent += 1
            return True
        return False

    def send_data(self, stream_id: int, data: bytes, end_stream: bool) -> None:
        """Queue one DATA frame; it must fit ``send_window`` and ``max_outbound_frame_size``.

        Raises:
            StreamClosed: the stream is closed.
        """
        self.h2_connection.send_data(stream_id, data, end_stream=end_stream)
        self.data_frames_sent += 1

    def send_window(self, stream_id: int) -> int:
        """How many bytes ``stream_id`` may send now (the smaller of its window and the connection's).

        Raises:
            StreamClosed: the stream is closed and forgotten.
        """
        return self.h2_connection.local_flow_control_window(stream_id)  # type: ignore[no-any-return]

    @property
    def max_outbound_frame_size(self) -> int:
        """The largest DATA frame the peer accepts (its SETTINGS_MAX_FRAME_SIZE)."""
        return self.h2_connection.max_outbound_frame_size  # type: ignore[no-any-return]

    def acknowledge(self, stream_id: int, length: int) -> bool:
        """The application consumed ``length`` flow-controlled bytes of ``stream_id``; returns whether output
        is queued now (a WINDOW_UPDATE, or anything queued before).

        h2's ``acknowledge_received_data`` only counts the bytes until half a window is processed (or the
        window is empty), then queues WINDOW_UPDATE. While neither window is near that point the counting is
        done here (``_fast.count_acknowledged``, once per message on the streaming path); otherwise h2 does
        it all.
        """
        h2conn = self.h2_connection
        if _fast.count_acknowledged(h2conn, stream_id, length):
            return bool(h2conn._data_to_send)
        queued = len(h2conn._data_to_send)
        h2conn.acknowledge_received_data(length, stream_id)
        if len(h2conn._data_to_send) > queued:
            self.data_frames_sent += 1  # a WINDOW_UPDATE
        return bool(h2conn._data_to_send)

    def output_size(self) -> int:
        """How many bytes are queued for the socket (``data_to_send`` takes them)."""
        return len(self.h2_connection._data_to_send)

    def peer_sent_data_since_ping_ack(self) -> bool:
        """Whether HEADERS, DATA or WINDOW_UPDATE arrived after the acknowledgement of our last PING (or no
        PING was acknowledged yet).

        The peer wrote such a frame after it had received that PING (frames arrive in the order written),
        and gRPC-core's server forgives every earlier PING when it writes one: a PING sent now earns no
        strike, however soon (``KeepaliveConfig``).
        """
        return self.data_frames_received != self._data_frames_at_ping_ack

    def ping(self, opaque_data: bytes) -> bool:
        """Queue a PING; False when the connection is closing (GOAWAY sent) and nothing was queued."""
        try:
            self.h2_connection.ping(opaque_data)
        except h2.exceptions.ProtocolError:
            return False
        return True

    def close_connection(self, error_code: int = ErrorCodes.NO_ERROR, debug_data: bytes = b"") -> None:
        """Queue GOAWAY with ``error_code`` and ``debug_data`` (nothing if the connection is already closed)."""
        try:
            self.h2_connection.close_connection(error_code, additional_data=debug_data or None)
        except h2.exceptions.ProtocolError:
            pass

    def receive_data(self, data: bytes) -> list:
        """Feed bytes from the socket; returns events. h2 ``ProtocolError`` means the connection is dead.

        Fast path: plain DATA frames (no flags) of an open stream with a read buffer are handled here, with
        h2's own flow-control and content-length bookkeeping (``_fast.accept_plain_data``), without building
        hyperframe/h2 objects (h2 also re-slices its whole buffer once per frame). Every other frame, and any DATA frame the fast path
        is not sure about (window overrun, oversize, unknown stream or state), goes through h2 unchanged, one
        complete frame at a time and in order, so h2 raises and queues exactly what it did before.
        """
        h2conn = self.h2_connection
        frames = h2conn.incoming_buffer
        if frames._preamble_len:
            events = self._receive_via_h2(data)
            pending = frames.data
            if len(pending) >= 9 and (pending[0] << 16 | pending[1] << 8 | pending[2]) > h2conn.max_inbound_frame_size:
                self._frame_too_large(pending[0] << 16 | pending[1] << 8 | pending[2])
            return events
        if frames.data:
            data = frames.data + data
            frames.data = b""
        events = []
        total = len(data)
        position = 0
        buffers = self.message_read_buffers
        open_connection = h2conn.state_machine.state in _OPEN_CONNECTION_STATES
        max_frame_size = h2conn.max_inbound_frame_size
        while total - position >= 9:
            length_high, length_low, frame_type, flags, stream_id = unpack_frame_header(data, position)
            length = (length_high << 16) | length_low
            if length > max_frame_size:
                self._frame_too_large(length)
            end = position + 9 + length
            if end > total:
                break  # an incomplete frame: kept for the next read
            if frame_type == 0 and flags == 0 and open_connection and not frames._headers_buffer:
                stream_id &= 0x7FFFFFFF
                buffer = buffers.get(stream_id)
                if buffer is not None and _fast.accept_plain_data(h2conn, stream_id, length):
                    self.data_frames_received += 1
                    events.extend(self._data_payload(stream_id, buffer, data[position + 9 : end], length))
                    position = end
                    continue
            if (
                frame_type == 1
                and flags in _fast.PLAIN_HEADERS_FLAGS
                and open_connection
                and not frames._headers_buffer
                and self.fast_headers
            ):
                events.extend(self._receive_plain_headers(stream_id & 0x7FFFFFFF, flags, data[position + 9 : end]))
            else:
                events.extend(self._receive_via_h2(data[position:end]))
            position = end
            open_connection = h2conn.state_machine.state in _OPEN_CONNECTION_STATES
        if position < total:
            frames.data = data[position:]
        return events

    def _frame_too_large(self, length: int) -> None:
        """A frame header declares more than SETTINGS_MAX_FRAME_SIZE: GOAWAY FRAME_SIZE_ERROR, as h2 would
        after buffering the whole payload (RFC 9113 section 4.2), but before a byte of it is kept."""
        h2conn = self.h2_connection
        h2conn.incoming_buffer.data = b""
        exc = h2.exceptions.FrameTooLargeError(
            f"Received overlong frame: length {length}, max {h2conn.max_inbound_frame_size}"
        )
        h2conn._terminate_connection(exc.error_code)
        raise exc

    #: Take plain HEADERS frames without h2's frame buffer (a switch for the tests that compare the paths).
    fast_headers = True

    def _receive_plain_headers(self, stream_id: int, flags: int, block: bytes) -> list:
        """One complete HEADERS frame without padding or priority, as ``_receive_via_h2`` would take it.

        h2's frame buffer parses the frame into a hyperframe ``HeadersFrame`` (flag sets, padding and
        priority fields), twice per call (response headers and trailers). ``_fast.plain_headers_frame``
        builds the same frame object directly and this hands it to h2's ``_receive_frame``,
        with ``H2Connection.receive_data``'s handling of a ``ProtocolError``, so the state changes, the
        frames queued, the events and the errors are h2's.
        """
        frame = _fast.plain_headers_frame(stream_id, flags, block)
        h2conn = self.h2_connection
        try:
            h2_events = h2conn._receive_frame(frame)
        except h2.exceptions.ProtocolError as exc:
            h2conn._terminate_connection(exc.error_code)
            raise
        events = []
        dispatch = self._dispatch
        for event in h2_events:
            handler = dispatch.get(type(event))
            if handler is not None:
                events.extend(handler(event))
        return events

    def _receive_via_h2(self, data: bytes) -> list:
        events = []
        dispatch = self._dispatch
        for event in self.h2_connection.receive_data(data):
            handler = dispatch.get(type(event))
            if handler is not None:
                events.extend(handler(event))
        return events

    # -- per-stream failures -------------------------------------------------------------------------

    def discard_stream(self, stream_id: int) -> None:
        """Forget a stream's read buffer and hand its buffered bytes back to the connection window."""
        buffer = self.message_read_buffers.pop(stream_id, None)
        if buffer is not None:
            pending = buffered_flow_controlled_length(buffer)
            if pending:
                self.h2_connection.acknowledge_received_data(pending, stream_id)

    def reset_stream(self, stream_id: int, error_code: int = ErrorCodes.CANCEL) -> None:
        """Send RST_STREAM unless the stream is already closed; always discards its buffer."""
        self.discard_stream(stream_id)
        try:
            self.h2_connection.reset_stream(stream_id, error_code)
        except h2.exceptions.StreamClosedError:
            pass
        except h2.exceptions.ProtocolError:
            # Stream in a state that cannot be reset (e.g. already closed and pruned): nothing to do.
            pass

    def _fail(self, stream_id: int, code: StatusCode, message: str) -> list:
        # A client resets at once; a server first answers the status (the I/O layer), then resets.
        if self.config.client_side:
            self.reset_stream(stream_id)
        else:
            self.discard_stream(stream_id)
        return [StreamFailed(stream_id, code, message)]

    # -- event handlers ------------------------------------------------------------------------------

    def _request_received(self, event: h2.events.RequestReceived) -> list:
        stream_id = event.stream_id
        if event.stream_ended:
            return [StreamFailed(stream_id, StatusCode.INTERNAL, "request ended before a message was sent")]
        try:
            request = RequestReceived.parse_from_stream_id_and_headers_destructive(stream_id, HeaderDict(event.headers))
        except _HEADER_ERRORS as exc:
            return [StreamFailed(stream_id, StatusCode.INTERNAL, f"malformed request headers: {exc}")]
        self.message_read_buffers[stream_id] = BoundedReadBuffer(
            request.message_encoding, self.config.max_message_length
        )
        return [request]

    def _response_received(self, event: h2.events.ResponseReceived) -> list:
        self.data_frames_received += 1
        stream_id = event.stream_id
        headers = HeaderDict(event.headers)
        try:
            http_status = int(headers.get(":status", "0"))
        except (ValueError, TypeError):  # not a number, or repeated
            http_status = 0
        if http_status != 200:
            code = _HTTP_TO_GRPC.get(http_status, StatusCode.UNKNOWN)
            return self._fail(stream_id, code, f"unexpected HTTP status {http_status}")
        try:
            response = ResponseReceived.parse_from_stream_id_and_headers_destructive(stream_id, headers)
            if event.stream_ended:
                ended = ResponseEnded.parse_from_stream_id_and_headers_destructive(stream_id, headers)
                ended.custom_metadata = response.custom_metadata
                return [response, ended]
        except _HEADER_ERRORS as exc:
            return self._fail(stream_id, StatusCode.UNKNOWN, f"malformed response headers: {exc}")
        self.message_read_buffers[stream_id] = BoundedReadBuffer(
            response.message_encoding, self.config.max_message_length
        )
        return [response]

    def _trailers_received(self, event: h2.events.TrailersReceived) -> list:
        self.data_frames_received += 1
        try:
            return [
                ResponseEnded.parse_from_stream_id_and_headers_destructive(event.stream_id, HeaderDict(event.headers))
            ]
        except _HEADER_ERRORS as exc:
            self.discard_stream(event.stream_id)
            return [StreamFailed(event.stream_id, StatusCode.UNKNOWN, f"malformed trailers: {exc}")]

    def _data_received(self, event: h2.events.DataReceived) -> list:
        self.data_frames_received += 1
        stream_id = event.stream_id
        buffer = self.message_read_buffers.get(stream_id)
        if buffer is None:
            # Give the bytes back to the connection window whatever happens to the stream.
            if event.flow_controlled_length:
                self.h2_connection.acknowledge_received_data(event.flow_controlled_length, stream_id)
            if self.config.client_side:
                return self._fail(stream_id, StatusCode.INTERNAL, "DATA received before response headers")
            return []
        return self._data_payload(stream_id, buffer, event.data, event.flow_controlled_length)

    def _data_payload(
        self, stream_id: int, buffer: MessageReadBuffer, data: bytes, flow_controlled_length: int
    ) -> list:
        """The messages a DATA payload completes (purerpc's framing rules)."""
        if flow_controlled_length == len(data) and not buffer._buffer._size and buffer._message_length is None:
            # Nothing buffered: whole uncompressed messages are cut straight out of the payload (the usual
            # case, ``_fast.whole_messages``); anything else goes through the read buffer as before, whole.
            messages = _fast.whole_messages(data, buffer._max_message_length)
            if messages is not None:
                return [MessageReceived(stream_id, message, length) for message, length in messages]
        return self._buffer_payload(stream_id, buffer, data, flow_controlled_length)

    def _buffer_payload(
        self, stream_id: int, buffer: MessageReadBuffer, data: bytes, flow_controlled_length: int
    ) -> list:
        try:
            buffer.data_received(data, flow_controlled_length)
        except MessageTooLargeError:
            length = buffer._message_length
            return self._fail(
                stream_id,
                StatusCode.RESOURCE_EXHAUSTED,
                f"received message larger than max ({length} vs. {self.config.max_message_length})",
            )
        except MessageDecodeError as exc:
            return self._fail(stream_id, exc.code, exc.message)
        except Exception as exc:  # e.g. an unsupported compression flag
            return self._fail(stream_id, StatusCode.INTERNAL, f"invalid message framing: {exc}")
        messages = buffer._messages
        if not messages:
            return []
        buffer._messages = type(messages)()
        return [MessageReceived(stream_id, data, length) for data, length in messages]

    def _window_updated(self, event: h2.events.WindowUpdated) -> list:
        self.data_frames_received += 1
        return [WindowUpdated(event.stream_id, event.delta)]

    def _remote_settings_changed(self, event: h2.events.RemoteSettingsChanged) -> list:
        return [SETTINGS_RECEIVED]

    def _stream_ended(self, event: h2.events.StreamEnded) -> list:
        if self.message_read_buffers.pop(event.stream_id, None) is not None and not self.config.client_side:
            return [RequestEnded(event.stream_id)]
        return []

    def _stream_reset(self, event: h2.events.StreamReset) -> list:
        self.discard_stream(event.stream_id)
        return [StreamReset(event.stream_id, event.error_code)]

    def _connection_terminated(self, event: h2.events.ConnectionTerminated) -> list:
        return [GoAway(event.last_stream_id or 0, event.error_code, event.additional_data or b"")]

    def _ping_received(self, event: h2.events.PingReceived) -> list:
        return [PING_RECEIVED]

    def _ping_ack_received(self, event: h2.events.PingAckReceived) -> list:
        self.ping_acks_received += 1
        self._data_frames_at_ping_ack = self.data_frames_received
        return []
