"""h2 3.2.0, patched: GOAWAY semantics, the WINDOW_UPDATE-after-close race, and fast frame building (pure).

``H2Connection`` is the h2 connection ``GrpcProtocol`` drives. The patches keep h2's own checks, state
transitions and bytes (each compared with h2's path by a differential test); see the class docstring.
"""

from __future__ import annotations

import struct

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.stream
import h2.utilities

from ._hpack import CachingDecoder, CachingEncoder

__all__ = ["H2Connection", "frame_header", "unpack_frame_header"]

unpack_frame_header = struct.Struct(">BHBBL").unpack_from  # length (24 bits), type, flags, stream id
frame_header = struct.Struct(">BHBBL").pack  # the same layout, for the frames built here
_SEND_HEADERS = h2.connection.ConnectionInputs.SEND_HEADERS
_STREAM_SEND_HEADERS = h2.stream.StreamInputs.SEND_HEADERS
_SEND_DATA = h2.connection.ConnectionInputs.SEND_DATA
_STREAM_SEND_DATA = h2.stream.StreamInputs.SEND_DATA
_STREAM_SEND_END_STREAM = h2.stream.StreamInputs.SEND_END_STREAM
_CLIENT_STREAM_IDS = h2.connection.AllowedStreamIDs(True)


class H2Connection(h2.connection.H2Connection):
    """h2 3.2.0 with h2 4.x's tolerance of a WINDOW_UPDATE for an already-closed stream.

    grpcio's C core sends WINDOW_UPDATE for streams that are closing. h2 3.2.0 has already pruned them and
    raises ``StreamClosedError`` from ``_receive_window_update_frame``; ``receive_data`` then queues GOAWAY,
    moves the connection to CLOSED and drops the events of the frames before it in the same read
    (docs/reference/transport.md#the-h2-320-window_update-race). Catching the error here, per frame, turns it into "no events" as h2 4.x
    does, and the remaining frames of the read are processed normally.
    """

    #: How many late WINDOW_UPDATE frames were ignored (process-wide; a diagnostic for tests/benchmarks).
    late_window_updates = 0

    def __init__(self, config: h2.config.H2Configuration) -> None:
        super().__init__(config)
        self.encoder = CachingEncoder()
        decoder = CachingDecoder()
        decoder.max_header_list_size = self.decoder.max_header_list_size  # type: ignore[has-type]  # h2 sets it untyped
        self.decoder = decoder

    def _receive_goaway_frame(self, frame):  # type: ignore[no-untyped-def]
        """Any GOAWAY leaves the connection usable for the streams the peer still processes.

        RFC 9113 section 6.8: streams up to ``last_stream_id`` may still complete, whatever the error code
        (gRPC-core sends ENHANCE_YOUR_CALM ``too_many_pings``, and a graceful shutdown sends NO_ERROR twice:
        first with the highest stream id, then, after a PING round trip, with the last one it processes).
        h2 3.2.0 instead moves its state machine to CLOSED, so every later frame of those streams (HEADERS,
        DATA, trailers, the PING that follows the GOAWAY) raises a connection-level ProtocolError, and it
        drops our queued output. The transport refuses new calls itself after a GOAWAY (``GoAway`` event),
        and the peer closes the socket when it is done.
        """
        event = h2.events.ConnectionTerminated()
        event.error_code = h2.connection._error_code_from_int(frame.error_code)
        event.last_stream_id = frame.last_stream_id
        event.additional_data = frame.additional_data or None
        return [], [event]

    def open_request_stream(self, stream_id: int, headers: list) -> None:
        """``send_headers(stream_id, headers)`` for a client's new stream (no END_STREAM, no priority).

        The same checks, state transitions and bytes as h2's ``send_headers``, without building hyperframe
        objects and validation flags that ``validate_outbound_headers=False`` then ignores: the header
        block (usually a cached encoding, ``CachingEncoder``) is framed here. Every other case goes to
        ``send_headers``. ``tests/transport/test_open_request_stream.py`` compares the two.
        """
        if not self.config.client_side or stream_id in self.streams:
            self.send_headers(stream_id, headers)
            return
        if self.open_outbound_streams + 1 > self.remote_settings.max_concurrent_streams:
            raise h2.exceptions.TooManyStreamsError(
                f"Max outbound streams is {self.remote_settings.max_concurrent_streams}, "
                f"{self.open_outbound_streams} open"
            )
        self.state_machine.process_input(_SEND_HEADERS)
        stream = self._get_or_create_stream(stream_id, _CLIENT_STREAM_IDS)
        stream.state_machine.process_input(_STREAM_SEND_HEADERS)
        block = self.encoder.encode(headers)
        size = self.max_outbound_frame_size
        if len(block) <= size:
            self._data_to_send += frame_header(len(block) >> 16, len(block) & 0xFFFF, 0x1, 0x4, stream_id) + block
        else:  # HEADERS, then CONTINUATION frames; END_HEADERS on the last
            chunks = [block[i : i + size] for i in range(0, len(block), size)]
            out = [frame_header(len(chunks[0]) >> 16, len(chunks[0]) & 0xFFFF, 0x1, 0, stream_id), chunks[0]]
            for n, chunk in enumerate(chunks[1:], 2):
                flags = 0x4 if n == len(chunks) else 0
                out += [frame_header(len(chunk) >> 16, len(chunk) & 0xFFFF, 0x9, flags, stream_id), chunk]
            self._data_to_send += b"".join(out)
        if stream._authority is None:
            stream._authority = h2.utilities.authority_from_headers(headers)
        stream.request_method = h2.utilities.extract_method_header(headers)

    def send_data(self, stream_id, data, end_stream=False, pad_length=None):  # type: ignore[no-untyped-def]
        """h2's ``send_data``, with the frame built here when it needs no padding and fits both windows and
        one frame: the same checks, state transitions, window accounting and bytes, without a hyperframe
        ``DataFrame`` (a request's message, and every message a server streams). Anything else (padding, an
        unknown stream, a frame h2 would refuse) goes to h2 unchanged, which raises as before.
        """
        if pad_length is not None or not self.try_send_data(stream_id, data, end_stream):
            return super().send_data(stream_id, data, end_stream, pad_length)
        return None

    def try_send_data(self, stream_id: int, data: bytes, end_stream: bool) -> bool:
        """``send_data``'s fast path: queue ``data`` as one DATA frame if the stream is known and it fits both
        windows and one frame; False (nothing done) otherwise. Raises as h2 for a closed stream."""
        stream = self.streams.get(stream_id)
        size = len(data)
        if (
            stream is None
            or size > self.outbound_flow_control_window
            or size > stream.outbound_flow_control_window
            or size > self.max_outbound_frame_size
        ):
            return False
        self.state_machine.process_input(_SEND_DATA)
        machine = stream.state_machine
        machine.process_input(_STREAM_SEND_DATA)
        if end_stream:
            machine.process_input(_STREAM_SEND_END_STREAM)
        stream.outbound_flow_control_window -= size
        self._data_to_send += frame_header(size >> 16, size & 0xFFFF, 0x0, 0x1 if end_stream else 0, stream_id) + data
        self.outbound_flow_control_window -= size
        return True

    def _receive_window_update_frame(self, frame):  # type: ignore[no-untyped-def]
        try:
            return super()._receive_window_update_frame(frame)
        except h2.exceptions.StreamClosedError:
            if frame.stream_id:
                H2Connection.late_window_updates += 1
                return [], []
            raise
