"""The transport's error family (pure: no I/O, no Trio)."""

from __future__ import annotations

from collections.abc import Sequence

from trio_sidecar.core.status import StatusCode

__all__ = ["DEFAULT_MAX_MESSAGE_LENGTH", "ConnectionLostError", "RpcError", "StreamNotProcessedError"]

#: Default maximum size of one encoded message, each way (docs/reference/wire.md#transport).
DEFAULT_MAX_MESSAGE_LENGTH = 64 * 1024 * 1024


class RpcError(Exception):
    """A call ended with a gRPC status other than OK.

    Raised by the client for a non-OK status, and raised by a server handler to answer one.
    ``message`` is the percent-decoded ``grpc-message``.
    """

    def __init__(
        self,
        code: StatusCode,
        message: str = "",
        trailing_metadata: Sequence[tuple[str, str]] = (),
    ) -> None:
        super().__init__(code, message)
        self.code = StatusCode(code)
        self.message = message
        self.trailing_metadata = tuple(trailing_metadata)

    def __str__(self) -> str:
        return f"{self.message} ({self.code.rust_name})"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code.name}, {self.message!r})"


class ConnectionLostError(RpcError):
    """The connection failed (peer gone, socket error, GOAWAY, HTTP/2 protocol error, closed channel).

    Its code is always UNAVAILABLE; the channel that raised it is ``broken`` (or ``closed``) and must be
    replaced.
    """

    def __init__(self, message: str) -> None:
        super().__init__(StatusCode.UNAVAILABLE, message)


class StreamNotProcessedError(ConnectionLostError):
    """The server did not process the call: its connection got GOAWAY before the call's stream was opened,
    or the stream's id is above the GOAWAY's last stream id (RFC 9113 section 6.8). Nothing reached the
    application, so the call may be sent again on another connection (``ChannelPool`` does)."""
