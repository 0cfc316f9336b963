"""h2 3.2.0, patched: GOAWAY semantics and the WINDOW_UPDATE-after-close race (pure).

``H2Connection`` is the h2 connection ``GrpcProtocol`` drives; it installs the transport's fast paths
(``_fast``: HPACK caches, HEADERS and DATA framing), which keep h2's own checks, state transitions and bytes.
"""

from __future__ import annotations

import struct

import h2.config
import h2.connection
import h2.events
import h2.exceptions

from . import _fast
from ._fast import CachingDecoder, CachingEncoder, frame_header

__all__ = ["H2Connection", "frame_header", "unpack_frame_header"]

unpack_frame_header = struct.Struct(">BHBBL").unpack_from  # length (24 bits), type, flags, stream id


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
        """``send_headers(stream_id, headers)`` for a client's new stream (no END_STREAM, no priority), framed
        by ``_fast.open_request_stream`` when it can."""
        if not _fast.open_request_stream(self, stream_id, headers):
            self.send_headers(stream_id, headers)

    def send_data(self, stream_id, data, end_stream=False, pad_length=None):  # type: ignore[no-untyped-def]
        """h2's ``send_data``, framed by ``_fast.try_send_data`` when it needs no padding and fits both windows
        and one frame. Anything else (padding, an unknown stream, a frame h2 would refuse) goes to h2
        unchanged, which raises as before."""
        if pad_length is not None or not _fast.try_send_data(self, stream_id, data, end_stream):
            return super().send_data(stream_id, data, end_stream, pad_length)
        return None

    def try_send_data(self, stream_id: int, data: bytes, end_stream: bool) -> bool:
        """Queue ``data`` as one DATA frame if it fits both windows and one frame (``_fast.try_send_data``);
        False, nothing done, otherwise. Raises as h2 for a closed stream."""
        return _fast.try_send_data(self, stream_id, data, end_stream)

    def _receive_window_update_frame(self, frame):  # type: ignore[no-untyped-def]
        try:
            return super()._receive_window_update_frame(frame)
        except h2.exceptions.StreamClosedError:
            if frame.stream_id:
                H2Connection.late_window_updates += 1
                return [], []
            raise
