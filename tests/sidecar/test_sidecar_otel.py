"""The sidecar's OpenTelemetry span (docs/reference/sidecar.md#opentelemetry-span), against the mock.

The spans are recorded by the SDK's in-memory exporter on the process's global tracer provider (OpenTelemetry
allows one global provider per process: the fixture installs an SDK provider once and adds its exporter).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import trio
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from sidecar_fakes import FAST_ENGINE_ARGS, sidecar_config

from trio_sidecar import GenerateContext, open_sidecar
from trio_sidecar.mock import MockConfig, open_mock_server
from trio_sidecar.shell.otel import SPAN_NAME

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN}-01"
BODY = {"token_ids": [1, 2, 3], "stop_conditions": {"max_tokens": 3}}


@pytest.fixture(scope="module")
def exporter():
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    assert trace.get_tracer_provider() is provider, "another global tracer provider is installed"
    recorded = InMemorySpanExporter()
    processor = SimpleSpanProcessor(recorded)
    provider.add_span_processor(processor)
    yield recorded
    processor.shutdown()


@pytest.fixture
def spans(exporter):
    exporter.clear()
    return exporter


def mock_config(**engine_args):
    return MockConfig(
        listen="127.0.0.1:0", model="mocker-model", seed=7, engine_args={**FAST_ENGINE_ARGS, **engine_args}
    )


async def collect(sidecar, body, ctx):
    async with sidecar.generate(body, ctx) as stream:
        return [chunk async for chunk in stream]


def only_span(spans):
    finished = spans.get_finished_spans()
    assert [s.name for s in finished] == [SPAN_NAME], finished
    return finished[0]


def fields(traceparent: str) -> tuple[str, str, str, str]:
    version, trace_id, span_id, flags = traceparent.split("-")
    return version, trace_id, span_id, flags


async def test_a_traced_request_gets_a_client_span_under_its_traceparent_and_vllm_gets_the_spans_context(spans):
    async with open_mock_server(mock_config(dp_size=2)) as mock:
        async with open_sidecar(sidecar_config(mock.address, otel=True)) as sidecar:
            ctx = GenerateContext("otel-1", traceparent=TRACEPARENT, tracestate="rojo=00f067aa0ba902b7")
            with trio.fail_after(10):
                chunks = await collect(sidecar, dict(BODY, routing={"dp_rank": 1}), ctx)
    assert chunks[-1].finish_reason == "length"
    span = only_span(spans)
    assert span.kind is SpanKind.CLIENT
    assert span.parent is not None and span.parent.is_remote
    assert format(span.parent.trace_id, "032x") == TRACE_ID and format(span.parent.span_id, "016x") == PARENT_SPAN
    assert format(span.context.trace_id, "032x") == TRACE_ID
    own_span = format(span.context.span_id, "016x")
    assert own_span != PARENT_SPAN
    # vLLM's spans nest under the sidecar's: same trace, the sidecar's span id, the request's tracestate
    received = mock.trace_headers["otel-1"]
    assert fields(received["traceparent"]) == ("00", TRACE_ID, own_span, "01")
    assert received["tracestate"] == "rojo=00f067aa0ba902b7"
    assert dict(span.attributes) == {
        "gen_ai.request.id": "otel-1",
        "gen_ai.request.model": "mocker-model",
        "trio_sidecar.dp_rank": 1,
        "gen_ai.usage.prompt_tokens": 3,
        "gen_ai.usage.completion_tokens": 3,
        "gen_ai.response.finish_reasons": ("length",),
    }
    assert span.status.status_code is StatusCode.UNSET
    assert span.end_time is not None


async def test_a_cancelled_request_ends_its_span_with_the_cancelled_finish_reason(spans):
    async with open_mock_server(mock_config(speedup_ratio=0.1)) as mock:
        async with open_sidecar(sidecar_config(mock.address, otel=True)) as sidecar:
            ctx = GenerateContext("otel-cancel", traceparent=TRACEPARENT)
            chunks = []
            with trio.fail_after(10):
                body = {"token_ids": [1, 2, 3], "stop_conditions": {"max_tokens": 10000}}
                async with sidecar.generate(body, ctx) as stream:
                    async for chunk in stream:
                        chunks.append(chunk)
                        ctx.stop()
                while not spans.get_finished_spans():
                    await trio.sleep(0.01)
    assert chunks[-1].finish_reason == "cancelled"
    span = only_span(spans)
    assert span.attributes["gen_ai.response.finish_reasons"] == ("cancelled",)
    assert span.attributes["gen_ai.usage.completion_tokens"] == len(chunks) - 1 >= 1
    assert span.status.status_code is StatusCode.UNSET
    assert "error.type" not in span.attributes
    assert fields(mock.trace_headers["otel-cancel"]["traceparent"])[2] == format(span.context.span_id, "016x")


async def test_a_failed_request_ends_its_span_with_status_error_and_the_error_kind(spans):
    async with open_mock_server(mock_config(dp_size=2)) as mock:
        async with open_sidecar(sidecar_config(mock.address, otel=True)) as sidecar:
            ctx = GenerateContext("otel-error", traceparent=TRACEPARENT)
            with trio.fail_after(10), pytest.raises(Exception) as info:
                await collect(sidecar, dict(BODY, routing={"dp_rank": 5}), ctx)
    assert info.value.kind.name == "INVALID_ARGUMENT"
    span = only_span(spans)
    assert span.status.status_code is StatusCode.ERROR
    assert span.status.description == str(info.value)
    assert span.attributes["error.type"] == "InvalidArgument"
    assert span.attributes["trio_sidecar.dp_rank"] == 5
    assert "gen_ai.response.finish_reasons" not in span.attributes
    assert fields(mock.trace_headers["otel-error"]["traceparent"])[1:3] == (
        TRACE_ID,
        format(span.context.span_id, "016x"),
    )


async def test_an_untraced_unsampled_or_invalid_trace_gets_no_span_and_vllm_gets_the_context_unchanged(spans):
    unsampled = f"00-{TRACE_ID}-{PARENT_SPAN}-00"
    invalid = f"00-{'0' * 32}-{PARENT_SPAN}-01"  # the all-zero trace id is invalid (W3C Trace Context)
    async with open_mock_server(mock_config()) as mock:
        async with open_sidecar(sidecar_config(mock.address, otel=True)) as sidecar:
            with trio.fail_after(10):
                await collect(sidecar, BODY, GenerateContext("untraced"))
                await collect(sidecar, BODY, GenerateContext("unsampled", traceparent=unsampled))
                await collect(sidecar, BODY, GenerateContext("invalid", traceparent=invalid, tracestate="k=v"))
    assert spans.get_finished_spans() == ()
    assert mock.trace_headers == {
        "unsampled": {"traceparent": unsampled},
        "invalid": {"traceparent": invalid, "tracestate": "k=v"},
    }


async def test_with_otel_off_no_span_is_made_and_vllm_gets_the_requests_traceparent(spans):
    async with open_mock_server(mock_config()) as mock:
        async with open_sidecar(sidecar_config(mock.address)) as sidecar:
            with trio.fail_after(10):
                await collect(sidecar, BODY, GenerateContext("off", traceparent=TRACEPARENT, tracestate="k=v"))
    assert spans.get_finished_spans() == ()
    assert mock.trace_headers == {"off": {"traceparent": TRACEPARENT, "tracestate": "k=v"}}


# A fresh interpreter: this one has OpenTelemetry imported (and an SDK provider set) by the tests above.
SCRIPT = textwrap.dedent(
    """
    import json
    import sys
    import trio
    from trio_sidecar import GenerateContext, SidecarConfig, open_sidecar
    from trio_sidecar.mock import MockConfig, open_mock_server

    async def main(otel):
        config = MockConfig(listen="127.0.0.1:0", model="m", seed=7, engine_args={"speedup_ratio": 0.0})
        async with open_mock_server(config) as mock:
            sidecar_config = SidecarConfig(grpc_endpoint=mock.address, health_prober=False, otel=otel)
            async with open_sidecar(sidecar_config) as sidecar:
                ctx = GenerateContext("r", traceparent=sys.argv[2], tracestate="k=v")
                with trio.fail_after(20):
                    async with sidecar.generate({"token_ids": [1], "stop_conditions": {"max_tokens": 2}}, ctx) as s:
                        chunks = [c async for c in s]
        assert chunks[-1].finish_reason == "length", chunks
        return mock.trace_headers

    received = trio.run(main, sys.argv[1] == "on")
    modules = sorted(m for m in sys.modules if m.startswith(("opentelemetry", "trio_sidecar.shell.otel")))
    print(json.dumps({"received": received, "modules": modules}))
    """
)


def run_script(otel: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, otel, TRACEPARENT], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_with_otel_off_opentelemetry_is_never_imported():
    out = run_script("off")
    assert out["received"] == {"r": {"traceparent": TRACEPARENT, "tracestate": "k=v"}}
    assert out["modules"] == []


def test_with_otel_on_but_no_sdk_provider_vllm_gets_the_requests_context_unchanged():
    out = run_script("on")
    assert out["received"] == {"r": {"traceparent": TRACEPARENT, "tracestate": "k=v"}}
    assert "trio_sidecar.shell.otel" in out["modules"]  # (on: the module was loaded, and made no span)


def test_otel_without_the_extra_fails_the_pre_network_checks_with_its_text():
    script = textwrap.dedent(
        """
        import importlib.util, sys
        real_find_spec = importlib.util.find_spec
        importlib.util.find_spec = lambda name, *a: None if name.startswith("opentelemetry") else real_find_spec(name, *a)
        from trio_sidecar import SidecarConfig, SidecarEngine
        from trio_sidecar.core.config import WorkerOptions, prepare
        from trio_sidecar.core.errors import InvalidArgument
        config = SidecarConfig(grpc_endpoint="127.0.0.1:1", otel=True)
        for check in (lambda: SidecarEngine(config), lambda: prepare(config, WorkerOptions(), dynamo_required=False)):
            try:
                check()
            except InvalidArgument as exc:
                print(exc)
        SidecarEngine(SidecarConfig(grpc_endpoint="127.0.0.1:1"))  # off: no check
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["otel requires the optional 'otel' extra (opentelemetry-api)"] * 2


class FailingTracer:
    """Fault injection: an OpenTelemetry tracer that fails to start a span."""

    def start_span(self, *args, **kwargs):
        raise RuntimeError("tracer broken")


async def test_a_failing_tracer_never_fails_the_request_and_vllm_gets_the_requests_context(spans, caplog):
    async with open_mock_server(mock_config()) as mock:
        async with open_sidecar(sidecar_config(mock.address, otel=True)) as sidecar:
            sidecar.engine._tracing._tracer = FailingTracer()
            with trio.fail_after(10):
                chunks = await collect(sidecar, BODY, GenerateContext("broken", traceparent=TRACEPARENT))
    assert chunks[-1].finish_reason == "length"
    assert mock.trace_headers == {"broken": {"traceparent": TRACEPARENT}}
    assert spans.get_finished_spans() == ()
    assert "could not start the OpenTelemetry span of request broken" in caplog.text
