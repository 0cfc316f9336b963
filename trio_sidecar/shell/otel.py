"""The sidecar's OpenTelemetry span per traced request (docs/reference/sidecar.md#opentelemetry-span).

Imported only when ``SidecarConfig.otel`` is on (it needs the ``otel`` extra, ``opentelemetry-api``); with it
off nothing in the package imports OpenTelemetry, and a request pays one ``is None`` test.

A request that carries a W3C ``traceparent`` gets a span ``trio_sidecar.generate`` (kind ``CLIENT``: the
sidecar is vLLM's gRPC client) whose parent is that ``traceparent`` (under Dynamo, the worker's
``engine.generate`` span). vLLM receives the *span's* ``traceparent`` (same trace, the span's id) and the
request's ``tracestate``, so vLLM's spans nest under it. The span ends with the request: its usage and
finish reason, or the error (status ``ERROR``).

The tracer comes from OpenTelemetry's global tracer provider (a provider set after the engine was created
still counts: the API's proxy tracer follows it). A span that records nothing (no SDK provider, or the
sampler dropped it) is ended at once and vLLM receives the request's own trace context, unchanged.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from ..core.errors import SidecarError
from ..core.tracecontext import TRACEPARENT, TRACESTATE, trace_metadata

if TYPE_CHECKING:
    from ..core.convert.request import BuiltRequest

__all__ = ["SPAN_NAME", "RequestSpan", "RequestTracing"]

SPAN_NAME = "trio_sidecar.generate"
TRACER_NAME = "trio_sidecar"

LOGGER = logging.getLogger("trio_sidecar.otel")

_PROPAGATOR = TraceContextTextMapPropagator()


class RequestTracing:
    """Starts the span of a request that carries a ``traceparent`` (one per engine)."""

    def __init__(self) -> None:
        self._tracer = trace.get_tracer(TRACER_NAME)

    def start(
        self, request_id: str, built: BuiltRequest, traceparent: str | None, tracestate: str | None
    ) -> RequestSpan | None:
        """The request's span, started now; ``None`` when OpenTelemetry cannot parse ``traceparent`` (the
        request's metadata is then forwarded unchanged: vLLM validates it), when the span records nothing, or
        when OpenTelemetry fails (logged: tracing never fails a request)."""
        try:
            return self._start(request_id, built, traceparent, tracestate)
        except Exception:
            LOGGER.exception("could not start the OpenTelemetry span of request %s", request_id)
            return None

    def _start(
        self, request_id: str, built: BuiltRequest, traceparent: str | None, tracestate: str | None
    ) -> RequestSpan | None:
        carrier = {TRACEPARENT: traceparent or ""}
        if tracestate:
            carrier[TRACESTATE] = tracestate
        parent = _PROPAGATOR.extract(carrier)
        if not trace.get_current_span(parent).get_span_context().is_valid:
            return None
        message = built.message
        attributes: dict[str, str | int] = {
            "gen_ai.request.id": request_id,
            "gen_ai.request.model": message.model,
            "gen_ai.usage.prompt_tokens": built.prompt_tokens,
        }
        if message.lora_name:
            attributes["trio_sidecar.lora_name"] = message.lora_name
        if built.dp_rank is not None:
            attributes["trio_sidecar.dp_rank"] = built.dp_rank
        span = self._tracer.start_span(SPAN_NAME, context=parent, kind=SpanKind.CLIENT, attributes=attributes)
        if not span.is_recording():  # no SDK provider, or sampled out: vLLM gets the request's own context
            span.end()
            return None
        out: dict[str, str] = {}
        _PROPAGATOR.inject(out, context=trace.set_span_in_context(span, parent))
        own = out.get(TRACEPARENT)
        if not own:  # (not expected: a recording span has a valid context)
            return RequestSpan(request_id, span, trace_metadata(traceparent, tracestate))
        metadata = [(TRACEPARENT, own)]
        if out.get(TRACESTATE):
            metadata.append((TRACESTATE, out[TRACESTATE]))
        return RequestSpan(request_id, span, tuple(metadata))


class RequestSpan:
    """One request's span and the trace metadata vLLM receives for it."""

    __slots__ = ("metadata", "request_id", "span")

    def __init__(self, request_id: str, span: Span, metadata: tuple[tuple[str, str], ...]) -> None:
        self.request_id = request_id
        self.span = span
        #: ``traceparent`` (the span's own) and ``tracestate``, for ``GenerateStream``
        self.metadata = metadata

    def end(
        self,
        *,
        prompt_tokens: int,
        completion_tokens: int,
        finish_reason: str | None,
        error: BaseException | None,
    ) -> None:
        """End the span with the request's outcome: its usage, then its finish reason (a final chunk) or its
        error; never raises (a failure is logged)."""
        span = self.span
        try:
            try:
                span.set_attribute("gen_ai.usage.prompt_tokens", prompt_tokens)
                span.set_attribute("gen_ai.usage.completion_tokens", completion_tokens)
                if finish_reason is not None:
                    span.set_attribute("gen_ai.response.finish_reasons", (finish_reason,))
                elif error is not None:
                    kind = error.kind.value if isinstance(error, SidecarError) else type(error).__name__
                    span.set_attribute("error.type", kind)
                    span.set_status(Status(StatusCode.ERROR, str(error)))
            finally:
                span.end()
        except Exception:
            LOGGER.exception("could not end the OpenTelemetry span of request %s", self.request_id)
