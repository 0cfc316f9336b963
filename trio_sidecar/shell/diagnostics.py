"""Operator-facing wording: one clean clause per cause, a short label, and a hint. No I/O and no Trio, but it
reads the I/O layer's exception types (``socket.gaierror``, errno codes), so it sits in the shell beside the pool.

Connection failures arrive as exception chains whose texts repeat each other (Trio's ``open_tcp_stream``
raises ``OSError("all attempts to connect to H:P failed")`` caused by an ``ExceptionGroup`` with the same
text plus ``(1 sub-exception)``, and the real reason sits inside the group). :func:`describe_exception`
turns such a chain into one readable clause; :func:`short_cause` labels a clause for the startup progress
line; :func:`startup_hint` suggests what to do about a startup failure.
"""

from __future__ import annotations

import errno
import socket

__all__ = ["describe_exception", "short_cause", "startup_hint", "round_duration"]

_ERRNO_TEXT = {
    errno.ECONNREFUSED: "connection refused",
    errno.ECONNRESET: "connection reset by peer",
    errno.EHOSTUNREACH: "host unreachable",
    errno.ENETUNREACH: "network unreachable",
    errno.ETIMEDOUT: "connection timed out",
    errno.EADDRNOTAVAIL: "address not available",
}


def _leaf_text(exc: BaseException) -> str:
    """One exception without its chain: OS errors by their errno, everything else by ``str()``."""
    if isinstance(exc, socket.gaierror):
        return f"DNS lookup failed: {exc.strerror or exc}"
    if isinstance(exc, OSError) and exc.errno in _ERRNO_TEXT:
        return _ERRNO_TEXT[exc.errno]
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror[:1].lower() + exc.strerror[1:]
    return str(exc) or type(exc).__name__


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    found: list[BaseException] = []
    for sub in group.exceptions:
        if isinstance(sub, BaseExceptionGroup):
            found.extend(_leaves(sub))
        else:
            found.append(sub)
    return found


def describe_exception(exc: BaseException) -> str:
    """``exc`` and the causes below it as one clause, ``"outer: inner: ..."``, without repetitions.

    An exception group is replaced by its distinct leaf causes (joined with ``"; "``) and ends the chain;
    a text already contained in the previous part is skipped; OS errors read as their short name
    (``connection refused``, ``DNS lookup failed: ...``).
    """
    parts: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, BaseExceptionGroup):
            texts = list(dict.fromkeys(describe_exception(leaf) for leaf in _leaves(current)))
            parts.append("; ".join(texts) or str(current))
            break
        text = _leaf_text(current)
        if not parts or text not in parts[-1]:
            parts.append(text)
        current = current.__cause__ or current.__context__
    return ": ".join(parts)


def short_cause(text: str) -> str:
    """A short label for a failure clause: ``connection refused``, ``NOT_SERVING``, ``UNIMPLEMENTED``,
    ``DNS failure``, ``timed out``; otherwise the clause itself (cut to 160 characters)."""
    lowered = text.lower()
    for needle, label in (
        ("dns lookup failed", "DNS failure"),
        ("name or service not known", "DNS failure"),
        ("connection refused", "connection refused"),
        ("not_serving", "NOT_SERVING"),
        ("unimplemented", "UNIMPLEMENTED"),
        ("service_unknown", "SERVICE_UNKNOWN"),
        ("timed out", "timed out"),
        ("exceeded the startup deadline", "timed out"),
    ):
        if needle in lowered:
            return label
    return text if len(text) <= 160 else text[:157] + "..."


def startup_hint(message: str) -> str | None:
    """What an operator can do about a startup failure, or None when there is nothing general to say."""
    label = short_cause(message)
    if label == "connection refused":
        return (
            "nothing accepts connections there; start vLLM with its gRPC server on that port "
            "(or `trio-sidecar mock --listen HOST:PORT`), or fix --grpc-endpoint"
        )
    if label == "DNS failure":
        return "the host name in --grpc-endpoint does not resolve"
    if label in ("NOT_SERVING", "SERVICE_UNKNOWN"):
        return "vLLM is up but not ready; check its log, or raise --grpc-startup-deadline-secs"
    if label == "UNIMPLEMENTED" or "standard grpc health api" in message.lower():
        return "the server at --grpc-endpoint is not a vLLM gRPC server with the health service"
    if label == "timed out" or "deadline" in message.lower():
        return "vLLM did not answer in time; raise --grpc-startup-deadline-secs if it is still loading"
    return None


def round_duration(seconds: float) -> float:
    """Round an elapsed time for a message: 0.1 s resolution from 1 s up, 1 ms below."""
    if seconds >= 1:
        return round(seconds, 1)
    return round(seconds, 3)
