"""The trace context's ``GenerateStream`` metadata (docs/reference/sidecar.md#trace-context)."""

from __future__ import annotations

import pytest

from trio_sidecar import GenerateContext
from trio_sidecar.core.tracecontext import trace_metadata
from trio_sidecar.dynamo.bridge import _trace_context

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_traceparent_and_tracestate_become_metadata_in_that_order():
    assert trace_metadata(TRACEPARENT, "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE") == (
        ("traceparent", TRACEPARENT),
        ("tracestate", "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"),
    )


def test_traceparent_alone_is_sent_without_tracestate():
    assert trace_metadata(TRACEPARENT, None) == (("traceparent", TRACEPARENT),)
    assert trace_metadata(TRACEPARENT, "") == (("traceparent", TRACEPARENT),)


@pytest.mark.parametrize("traceparent", [None, ""])
def test_no_traceparent_sends_nothing_not_even_tracestate(traceparent):
    assert trace_metadata(traceparent, "rojo=1") == ()


@pytest.mark.parametrize(
    ("traceparent", "tracestate", "name"),
    [(TRACEPARENT + "\n", None, "traceparent"), (TRACEPARENT, "k=é", "tracestate")],
)
def test_a_value_grpc_metadata_cannot_carry_is_refused(traceparent, tracestate, name):
    with pytest.raises(ValueError, match=f"^{name} must be printable ASCII"):
        trace_metadata(traceparent, tracestate)


def test_the_embedded_context_carries_its_trace_metadata():
    assert GenerateContext("r").trace_metadata == ()
    ctx = GenerateContext("r", traceparent=TRACEPARENT, tracestate="a=b")
    assert ctx.trace_metadata == (("traceparent", TRACEPARENT), ("tracestate", "a=b"))
    with pytest.raises(ValueError):
        GenerateContext("r", traceparent="00-\x00")


class _DynamoContext:
    def __init__(self, headers):
        self._headers = headers

    def trace_headers(self):
        if isinstance(self._headers, Exception):
            raise self._headers
        return self._headers


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        (None, (None, None)),
        ({}, (None, None)),
        ({"traceparent": TRACEPARENT, "request-id": "x"}, (TRACEPARENT, None)),
        ({"traceparent": TRACEPARENT, "tracestate": "a=b"}, (TRACEPARENT, "a=b")),
        ({"tracestate": "a=b"}, (None, None)),
        ({"traceparent": TRACEPARENT, "tracestate": "a=\u00e9"}, (TRACEPARENT, None)),
        ({"traceparent": "bad\x7f"}, (None, None)),
        (RuntimeError("boom"), (None, None)),
    ],
)
def test_the_bridge_takes_the_trace_context_from_dynamos_trace_headers(headers, expected):
    assert _trace_context(_DynamoContext(headers)) == expected


def test_a_dynamo_context_without_trace_headers_has_no_trace_context():
    assert _trace_context(object()) == (None, None)
