"""W3C Trace Context (https://www.w3.org/TR/trace-context/) as gRPC metadata for ``GenerateStream``
(docs/reference/sidecar.md#trace-context). PURE: no I/O, no Trio.

The sidecar does not parse or rewrite the headers: vLLM's OpenTelemetry propagator validates them (an invalid
``traceparent`` starts a new trace there). It only keeps values gRPC metadata can carry (printable ASCII), and
drops ``tracestate`` without ``traceparent`` (the W3C rule: no ``tracestate`` without a parent).
"""

from __future__ import annotations

__all__ = ["TRACEPARENT", "TRACESTATE", "is_metadata_value", "trace_metadata"]

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"


def is_metadata_value(value: str) -> bool:
    """Whether ``value`` can be sent as an ASCII gRPC metadata value (printable ASCII, space included)."""
    return value.isascii() and value.isprintable()


def trace_metadata(traceparent: str | None, tracestate: str | None) -> tuple[tuple[str, str], ...]:
    """The per-call metadata for a trace context: ``()`` without ``traceparent``.

    Raises:
        ValueError: a value gRPC metadata cannot carry.
    """
    if not traceparent:
        return ()
    for name, value in ((TRACEPARENT, traceparent), (TRACESTATE, tracestate)):
        if value and not is_metadata_value(value):
            raise ValueError(f"{name} must be printable ASCII to travel as gRPC metadata: {value!r}")
    if tracestate:
        return ((TRACEPARENT, traceparent), (TRACESTATE, tracestate))
    return ((TRACEPARENT, traceparent),)
