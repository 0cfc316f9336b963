"""The events ``GrpcProtocol`` reports besides purerpc's, and the exceptions of its surface (pure: no I/O).

purerpc's own events (``RequestReceived``, ``ResponseReceived``, ``MessageReceived``, ``RequestEnded``,
``ResponseEnded``, ``WindowUpdated``) are re-exported here, so the I/O layer takes every event type from
one module.
"""

from __future__ import annotations

import h2.exceptions
from purerpc.grpclib.events import (
    MessageReceived,
    RequestEnded,
    RequestReceived,
    ResponseEnded,
    ResponseReceived,
    WindowUpdated,
)

from trio_sidecar.core.status import StatusCode

__all__ = [
    "GoAway",
    "MessageReceived",
    "RequestEnded",
    "RequestReceived",
    "ResponseEnded",
    "ResponseReceived",
    "PING_RECEIVED",
    "PingReceived",
    "SETTINGS_RECEIVED",
    "SettingsReceived",
    "StreamClosed",
    "StreamFailed",
    "StreamIdsExhausted",
    "StreamLimitReached",
    "StreamReset",
    "WindowUpdated",
]

#: Raised by ``send_message``/``send_data``/``send_window`` for a stream that is closed (h2's exception).
StreamClosed = h2.exceptions.StreamClosedError


class StreamLimitReached(Exception):
    """``open_stream``: the peer's MAX_CONCURRENT_STREAMS is reached; a stream must end first."""


class StreamIdsExhausted(Exception):
    """``open_stream``: the connection has used every stream id; a new connection is needed."""


class StreamReset:
    """The peer sent RST_STREAM."""

    __slots__ = ("error_code", "stream_id")

    def __init__(self, stream_id: int, error_code: int) -> None:
        self.stream_id = stream_id
        self.error_code = error_code


class StreamFailed:
    """One stream failed locally (oversize message, malformed headers); it has already been reset."""

    __slots__ = ("code", "message", "stream_id")

    def __init__(self, stream_id: int, code: StatusCode, message: str) -> None:
        self.stream_id = stream_id
        self.code = code
        self.message = message


class GoAway:
    """The peer sent GOAWAY: streams above ``last_stream_id`` were not processed (RFC 9113 section 6.8);
    ``debug_data`` is its additional debug data (gRPC-core's ``too_many_pings``, for one)."""

    __slots__ = ("debug_data", "error_code", "last_stream_id")

    def __init__(self, last_stream_id: int, error_code: int, debug_data: bytes = b"") -> None:
        self.last_stream_id = last_stream_id
        self.error_code = error_code
        self.debug_data = debug_data


class SettingsReceived:
    """The peer's SETTINGS arrived (completes the client's handshake; may open every stream's window)."""

    __slots__ = ()


SETTINGS_RECEIVED = SettingsReceived()


class PingReceived:
    """The peer sent a PING (h2 acknowledged it); reported to a server, which may police the rate."""

    __slots__ = ()


PING_RECEIVED = PingReceived()
