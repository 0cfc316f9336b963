"""The sidecar's error family (docs/reference/sidecar.md#errors). PURE: no I/O, no Trio.

Every failure the sidecar reports is a :class:`SidecarError` whose ``kind`` mirrors the native sidecar's
error kinds (``lib/sidecar/common/src/error.rs``). gRPC statuses are translated once, at the edge, by
:func:`status_to_error`; nothing else should build a status-derived message.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from typing import Any

from .status import StatusCode

__all__ = [
    "native_error_text",
    "native_kind_name",
    "ErrorKind",
    "SidecarError",
    "InvalidArgument",
    "UnknownError",
    "ProtocolError",
    "EngineShutdown",
    "CannotConnect",
    "ConnectionTimeout",
    "RequestCancelled",
    "PROTOCOL_ERROR_PREFIX",
    "status_to_error",
    "format_status",
    "format_duration",
]

PROTOCOL_ERROR_PREFIX = "invalid vLLM gRPC response: "


class ErrorKind(enum.Enum):
    INVALID_ARGUMENT = "InvalidArgument"
    UNKNOWN = "Unknown"
    ENGINE_SHUTDOWN = "EngineShutdown"
    CANNOT_CONNECT = "CannotConnect"
    CONNECTION_TIMEOUT = "ConnectionTimeout"
    CANCELLED = "Cancelled"


class SidecarError(Exception):
    """Root of the family. ``str(err) == err.message``; ``err.kind`` is its kind (docs/reference/sidecar.md#error-kinds)."""

    kind: ErrorKind = ErrorKind.UNKNOWN
    #: The gRPC status code this error translates (set by :func:`status_to_error`), else None.
    grpc_code: StatusCode | None = None
    #: That status's message (the percent-decoded ``grpc-message``); empty without a status.
    grpc_message: str = ""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r})"

    def __reduce__(
        self,
    ) -> tuple[Callable[[type[SidecarError], str], SidecarError], tuple[type[SidecarError], str], dict[str, Any]]:
        # Keeps pickling (and copy) working despite subclass __init__ signatures; the state keeps the
        # attributes set after construction (``grpc_code``, ``grpc_message``).
        return (_rebuild, (type(self), self.message), dict(self.__dict__))


def _rebuild(cls: type[SidecarError], message: str) -> SidecarError:
    err = Exception.__new__(cls)
    Exception.__init__(err, message)
    err.message = message
    if issubclass(cls, ProtocolError):
        err.detail = message.removeprefix(PROTOCOL_ERROR_PREFIX)  # type: ignore[attr-defined]
    return err


class InvalidArgument(SidecarError):
    """Bad configuration or request; nothing was sent to vLLM because of it (or vLLM rejected it)."""

    kind = ErrorKind.INVALID_ARGUMENT


class UnknownError(SidecarError):
    """Kind ``UNKNOWN``: a mapped gRPC status outside the other kinds (``INTERNAL``, ``ABORTED``, ...)."""

    kind = ErrorKind.UNKNOWN


class ProtocolError(UnknownError):
    """vLLM answered something the sidecar cannot accept.

    ``ProtocolError("x").message == "invalid vLLM gRPC response: x"``; ``detail`` keeps ``"x"``.
    """

    def __init__(self, detail: str) -> None:
        super().__init__(PROTOCOL_ERROR_PREFIX + detail)
        self.detail = detail


class EngineShutdown(SidecarError):
    kind = ErrorKind.ENGINE_SHUTDOWN


class CannotConnect(SidecarError):
    kind = ErrorKind.CANNOT_CONNECT


class ConnectionTimeout(SidecarError):
    kind = ErrorKind.CONNECTION_TIMEOUT


class RequestCancelled(SidecarError):
    """A gRPC ``CANCELLED`` status from vLLM (not ``trio.Cancelled``, which is never shadowed)."""

    kind = ErrorKind.CANCELLED


# docs/reference/sidecar.md#grpc-status-mapping: a table, not branches.
_STATUS_CLASS: dict[StatusCode, type[SidecarError]] = {
    StatusCode.INVALID_ARGUMENT: InvalidArgument,
    StatusCode.NOT_FOUND: InvalidArgument,
    StatusCode.OUT_OF_RANGE: InvalidArgument,
    StatusCode.FAILED_PRECONDITION: InvalidArgument,
    StatusCode.ALREADY_EXISTS: InvalidArgument,
    StatusCode.UNAVAILABLE: CannotConnect,
    StatusCode.CANCELLED: RequestCancelled,
    StatusCode.DEADLINE_EXCEEDED: ConnectionTimeout,
}


def format_status(code: StatusCode, message: str) -> str:
    """Render a gRPC status as ``{message} ({CodeName})`` (docs/reference/sidecar.md#readiness-wait, docs/reference/sidecar.md#grpc-status-mapping)."""
    return f"{message} ({StatusCode(code).rust_name})"


def status_to_error(rpc: str, code: StatusCode, message: str) -> SidecarError:
    """Translate a gRPC status of ``rpc`` into the sidecar error family.

    Args:
        rpc: the RPC name as upstream prints it (``"GenerateStream"``, ``"GetModelInfo"``).
        code: the status code (connection-level failures are passed as ``UNAVAILABLE``).
        message: the percent-decoded ``grpc-message``.

    Returns:
        The error (not raised): ``"{rpc}: {message} ({CodeName})"`` with the kind of docs/reference/sidecar.md#grpc-status-mapping;
        ``grpc_code`` and ``grpc_message`` keep the status for callers that branch on the code.
    """
    code = StatusCode(code)
    cls = _STATUS_CLASS.get(code, UnknownError)
    error = cls(f"{rpc}: {format_status(code, message)}")
    error.grpc_code = code
    error.grpc_message = message
    return error


def _trim_fraction(integer: int, fraction: int, digits: int, unit: str) -> str:
    if fraction == 0:
        return f"{integer}{unit}"
    text = f"{fraction:0{digits}d}".rstrip("0")
    return f"{integer}.{text}{unit}"


def format_duration(seconds: float) -> str:
    """Format like Rust's ``Debug`` for ``Duration`` (docs/reference/sidecar.md#duration-format): ``5s``, ``1.5s``, ``100ms``, ``12.5ms``, ``3µs``, ``7ns``.

    The value is first rounded to whole nanoseconds (a ``Duration``'s resolution). Non-finite inputs
    (which no ``Duration`` can hold) render as ``inf``/``nan``; negative ones get a leading ``-``.
    """
    if not math.isfinite(seconds):
        return str(seconds)
    if seconds < 0:
        return "-" + format_duration(-seconds)
    nanos = round(seconds * 1_000_000_000)
    if nanos >= 1_000_000_000:
        return _trim_fraction(nanos // 1_000_000_000, nanos % 1_000_000_000, 9, "s")
    if nanos >= 1_000_000:
        return _trim_fraction(nanos // 1_000_000, nanos % 1_000_000, 6, "ms")
    if nanos >= 1_000:
        return _trim_fraction(nanos // 1_000, nanos % 1_000, 3, "µs")
    return f"{nanos}ns"


# How the native sidecar names an error's kind in the JSON answers of its system-port routes (LoRA and RL
# controls, docs/dynamo.md): ``InvalidRequest: …``, ``Unavailable: …``, ``Internal: …``.
_NATIVE_KIND_NAME = {
    ErrorKind.INVALID_ARGUMENT: "InvalidRequest",
    ErrorKind.UNKNOWN: "Internal",
    ErrorKind.ENGINE_SHUTDOWN: "EngineShutdown",
    ErrorKind.CANNOT_CONNECT: "Unavailable",
    ErrorKind.CONNECTION_TIMEOUT: "Timeout",
    ErrorKind.CANCELLED: "Cancelled",
}


def native_kind_name(error: SidecarError) -> str:
    """The native sidecar's name for ``error``'s kind: ``InvalidRequest``, ``Unavailable``, ``Internal``, …"""
    return _NATIVE_KIND_NAME[error.kind]


def native_error_text(error: SidecarError) -> str:
    """``{Kind}: {message}``, e.g. ``InvalidRequest: StartWeightUpdate: … (FailedPrecondition)``."""
    return f"{native_kind_name(error)}: {error}"
