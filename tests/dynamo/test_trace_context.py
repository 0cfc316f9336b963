"""W3C trace context through the real ``dynamo.frontend`` (docs/reference/worker.md#trace-context).

What Dynamo 1.6.1 does, as observed here: with its OpenTelemetry layer on in both the frontend and the worker
(``DYN_LOGGING_JSONL=1``), the frontend continues the client's ``traceparent`` and the worker's
``context.trace_headers()`` gives a ``traceparent`` with the client's trace id and the worker's own
``handle_payload`` span as the parent (a new span id, not the client's); the client's ``tracestate`` is not
propagated. Without the layer, ``trace_headers()`` is ``None`` and nothing is forwarded.
"""

from __future__ import annotations

import pytest

from trio_sidecar._devtools import local

pytestmark = pytest.mark.dynamo

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
TRACING_ON = {"DYN_LOGGING_JSONL": "1"}


def _deploy(deployment_factory, env: dict[str, str]):
    dep = deployment_factory()
    mock = dep.mock(served_model_name="tiny", seed=7)
    dep.frontend(env)
    dep.trio_sidecar(mock, env=env)
    dep.wait_ready("tiny")
    return dep, mock


@pytest.fixture(scope="module")
def traced(deployment_factory):
    return _deploy(deployment_factory, TRACING_ON)


@pytest.fixture(scope="module")
def untraced(deployment_factory):
    return _deploy(deployment_factory, {})


def _trace_received(deployment, headers: dict[str, str]) -> dict[str, str] | None:
    """Send a completion with ``headers``; the trace metadata the mock received for it (``None``: none)."""
    dep, mock = deployment
    status, body = local.post_json(
        dep.http_port, "/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 2}, headers=headers
    )
    assert status == 200, body
    request_id = body["id"].split("-", 1)[1]
    assert mock.call(lambda: mock.mock.call_record(request_id)) is not None, "the mock never saw the request"
    return mock.call(lambda: dict(mock.mock.trace_headers)).get(request_id)


def test_the_clients_traceparent_reaches_vllm_with_its_trace_id_under_the_workers_span(traced):
    trace = _trace_received(traced, {"traceparent": TRACEPARENT, "tracestate": "vendor=abc"})
    assert trace is not None, "vLLM received no trace context"
    # Dynamo 1.6.1 forwards no tracestate (the client's is dropped by the frontend).
    assert set(trace) == {"traceparent"}
    version, trace_id, parent_id, flags = trace["traceparent"].split("-")
    assert (version, trace_id, flags) == ("00", TRACE_ID, "01")
    # The parent is the worker's span, a child of the frontend's span, itself a child of the client's.
    assert len(parent_id) == 16 and parent_id not in (CLIENT_SPAN, "0" * 16)


def test_each_request_carries_its_own_span(traced):
    first = _trace_received(traced, {"traceparent": TRACEPARENT})
    second = _trace_received(traced, {"traceparent": TRACEPARENT})
    assert first is not None and second is not None
    assert first["traceparent"].split("-")[1] == second["traceparent"].split("-")[1] == TRACE_ID
    assert first["traceparent"] != second["traceparent"]


def test_without_a_client_traceparent_vllm_gets_the_trace_dynamo_started(traced):
    trace = _trace_received(traced, {})
    assert trace is not None, "vLLM received no trace context"
    version, trace_id, parent_id, flags = trace["traceparent"].split("-")
    assert version == "00" and trace_id != TRACE_ID and trace_id != "0" * 32 and len(trace_id) == 32


def test_without_dynamos_tracing_layer_nothing_is_forwarded(untraced):
    assert _trace_received(untraced, {"traceparent": TRACEPARENT}) is None
