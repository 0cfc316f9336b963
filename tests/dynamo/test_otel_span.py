"""The sidecar's OpenTelemetry span through the real ``dynamo.frontend`` (docs/reference/worker.md#trace-context,
docs/reference/sidecar.md#opentelemetry-span).

The worker runs ``trio-sidecar run --otel`` with Dynamo's tracing layer on (``DYN_LOGGING_JSONL=1``) and an
OpenTelemetry SDK tracer provider configured at interpreter start (a test-only ``sitecustomize`` that writes
each finished span as one JSON line to a file): the sidecar's span is a child of Dynamo's worker span, and
vLLM (the mock) receives the sidecar's span as its parent.
"""

from __future__ import annotations

import json
import os
import textwrap
import time

import pytest

from trio_sidecar._devtools import local

pytestmark = pytest.mark.dynamo

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"

SITECUSTOMIZE = textwrap.dedent(
    """
    import os

    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

    _out = open(os.environ["TEST_OTEL_SPANS_FILE"], "a", encoding="utf-8")
    _provider = TracerProvider()
    _provider.add_span_processor(
        SimpleSpanProcessor(ConsoleSpanExporter(out=_out, formatter=lambda span: span.to_json(indent=None) + "\\n"))
    )
    trace.set_tracer_provider(_provider)
    """
)


@pytest.fixture(scope="module")
def traced(deployment_factory, tmp_path_factory):
    site = tmp_path_factory.mktemp("otel-site")
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    spans_file = site / "spans.jsonl"
    dep = deployment_factory()
    mock = dep.mock(served_model_name="tiny", seed=7)
    dep.frontend({"DYN_LOGGING_JSONL": "1"})
    pythonpath = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    env = {"DYN_LOGGING_JSONL": "1", "PYTHONPATH": pythonpath, "TEST_OTEL_SPANS_FILE": str(spans_file)}
    worker = dep.trio_sidecar(mock, "--otel", env=env)
    dep.wait_ready("tiny")
    return dep, mock, spans_file, worker.log_path


def _sidecar_span(spans_file, request_id: str, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        if spans_file.exists():
            for line in spans_file.read_text().splitlines():
                span = json.loads(line)
                if span["attributes"].get("gen_ai.request.id") == request_id:
                    return span
        assert time.monotonic() < deadline, f"no span for {request_id} in {spans_file}"
        time.sleep(0.05)


def _worker_span(log_path, request_id: str) -> dict:
    """The runtime's ``handle_payload`` span of the request, from the worker's JSONL log lines."""
    for line in log_path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if record.get("request_id") == request_id and record.get("span_name") == "handle_payload":
                return record
    raise AssertionError(f"no handle_payload log line for {request_id} in {log_path}")


def test_the_sidecars_span_is_a_child_of_the_workers_span_and_the_parent_of_vllms(traced):
    dep, mock, spans_file, worker_log = traced
    status, body = local.post_json(
        dep.http_port,
        "/v1/completions",
        {"model": "tiny", "prompt": "hello", "max_tokens": 2},
        headers={"traceparent": TRACEPARENT},
    )
    assert status == 200, body
    request_id = body["id"].split("-", 1)[1]
    assert mock.call(lambda: mock.mock.call_record(request_id)) is not None, "the mock never saw the request"
    received = mock.call(lambda: dict(mock.mock.trace_headers)).get(request_id)
    assert received is not None, "vLLM received no trace context"

    span = _sidecar_span(spans_file, request_id)
    assert span["name"] == "trio_sidecar.generate" and span["kind"] == "SpanKind.CLIENT"
    own_trace = span["context"]["trace_id"].removeprefix("0x")
    own_span = span["context"]["span_id"].removeprefix("0x")
    parent = span["parent_id"].removeprefix("0x")
    # In the client's trace, under Dynamo's worker span (the runtime's handle_payload span, the one
    # context.trace_headers() names), and vLLM received the sidecar's own span as its parent.
    worker_span = _worker_span(worker_log, request_id)
    assert own_trace == worker_span["trace_id"] == TRACE_ID
    assert parent == worker_span["span_id"] and parent not in (CLIENT_SPAN, own_span)
    assert received["traceparent"] == f"00-{TRACE_ID}-{own_span}-01"
    assert span["attributes"]["gen_ai.request.model"] == "tiny"
    assert span["attributes"]["gen_ai.usage.completion_tokens"] == 2
    assert span["attributes"]["gen_ai.response.finish_reasons"] == ["length"]
    assert span["status"]["status_code"] == "UNSET"
