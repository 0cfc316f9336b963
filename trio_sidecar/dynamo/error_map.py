"""The Dynamo error map: a SidecarError crosses into Dynamo as Dynamo's typed exception of its kind.

Dynamo 1.6.1's frontend decides from the exception *class* a worker raises what to do with a failed
request: CannotConnect, ConnectionTimeout and EngineShutdown are migrated to another worker (with
``--migration-limit``), InvalidArgument becomes HTTP 400, Cancelled 499, anything else HTTP 500. So a
SidecarError crosses into Dynamo as the class of its kind, with its message unchanged.
"""

from __future__ import annotations

from ..core.errors import ErrorKind, SidecarError

__all__ = ["dynamo_exception"]

_DYNAMO_CLASS_BY_KIND = {
    ErrorKind.INVALID_ARGUMENT: "InvalidArgument",
    ErrorKind.CANNOT_CONNECT: "CannotConnect",
    ErrorKind.CONNECTION_TIMEOUT: "ConnectionTimeout",
    ErrorKind.ENGINE_SHUTDOWN: "EngineShutdown",
    ErrorKind.CANCELLED: "Cancelled",
    ErrorKind.UNKNOWN: "Unknown",
}


def dynamo_exception(exc: BaseException) -> BaseException:
    """The exception to raise into Dynamo for ``exc``: a SidecarError becomes Dynamo's typed exception of
    the same kind and text (chained to the original); anything else, or no Dynamo installed, is unchanged.
    """
    if not isinstance(exc, SidecarError):
        return exc
    try:
        from dynamo.llm import exceptions as dynamo_errors
    except ImportError:
        return exc
    translated: BaseException = getattr(dynamo_errors, _DYNAMO_CLASS_BY_KIND[exc.kind])(str(exc))
    translated.__cause__ = exc
    return translated
