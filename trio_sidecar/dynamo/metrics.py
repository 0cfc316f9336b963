"""The sidecar's stats as Prometheus metrics for Dynamo's ``/metrics`` (docs/observability.md). PURE: no I/O,
no Trio, no Dynamo import.

Theory of operation
-------------------
Dynamo 1.6.1 serves a worker's metrics on its system status server (``DYN_SYSTEM_PORT``): the runtime's own
families (``dynamo_component_*``, ``dynamo_work_handler_*``, ...) plus whatever the callbacks registered on
``endpoint.metrics`` (``PyRuntimeMetrics``) return when ``/metrics`` is scraped: exposition text
(``register_prometheus_expfmt_callback``) and, for the OTLP export, the same families typed
(``register_prometheus_typed_callback``). Both are *pull*: nothing crosses threads per request; at each
scrape the callback takes one ``StatsSnapshot`` and maps it here.

Names and labels follow Dynamo's conventions (``dynamo.prometheus_names``): the component prefix
``dynamo_component`` (``name_prefix.COMPONENT``) with a ``sidecar_`` family of its own, as Dynamo's Python
components name theirs (``dynamo_component_embedding_cache_*``); ``_total`` for counters, ``_seconds`` for
durations; on every sample the labels Dynamo injects into engine metrics (``register_engine_metrics_callback``:
``dynamo_namespace``, ``dynamo_component``, ``dynamo_endpoint``, ``worker_id``, ``model``, ``model_name``);
``dp_rank`` where a count is per data-parallel rank. None of the runtime's own families is repeated: it
already counts Dynamo-level requests, errors, cancellations, in-flight requests and durations.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import attrs

from ..core.stats import HEALTH_STATES, HistogramSnapshot, StatsSnapshot

__all__ = [
    "METRICS",
    "PREFIX",
    "Metric",
    "Lifecycle",
    "LIFECYCLE_METRICS",
    "common_labels",
    "prometheus_label",
    "metric_names",
    "render_text",
    "render_typed",
]

#: ``dynamo.prometheus_names.name_prefix.COMPONENT`` + this project's family.
PREFIX = "dynamo_component_sidecar_"
#: The ``dp_rank`` label value of requests without a selected rank (vLLM balances them itself).
UNASSIGNED_RANK = "unassigned"

Labels = Sequence[tuple[str, str]]
Sample = tuple[str, Labels, float]  # (sample name, labels, value)


@attrs.frozen
class Metric:
    """One published family: ``name`` (full, as scraped; counters end in ``_total``), Prometheus ``kind``,
    help text, its own label names (besides the common ones) and how its samples come from a snapshot."""

    name: str
    kind: str  # "counter" | "gauge" | "histogram"
    help: str
    labels: tuple[str, ...]
    samples: Callable[[StatsSnapshot], list[tuple[Labels, float]]] | None = None  # counters and gauges
    histogram: Callable[[StatsSnapshot], HistogramSnapshot] | None = None


def _rank(rank: int | None) -> str:
    return UNASSIGNED_RANK if rank is None else str(rank)


def _by_rank(values: Mapping[int | None, int]) -> list[tuple[Labels, float]]:
    return [((("dp_rank", _rank(rank)),), float(count)) for rank, count in sorted(values.items(), key=_rank_key)]


def _rank_key(item: tuple[int | None, int]) -> tuple[int, int]:
    rank = item[0]
    return (1, 0) if rank is None else (0, rank)


def _by(label: str, values: Mapping[str, int]) -> list[tuple[Labels, float]]:
    return [(((label, key),), float(count)) for key, count in values.items()]


def _one(value: float) -> list[tuple[Labels, float]]:
    return [((), float(value))]


def _health(snapshot: StatsSnapshot) -> list[tuple[Labels, float]]:
    return [((("state", state),), 1.0 if snapshot.health_state == state else 0.0) for state in HEALTH_STATES]


def _aborts(snapshot: StatsSnapshot) -> list[tuple[Labels, float]]:
    return [
        ((("outcome", "sent"),), float(snapshot.aborts_sent)),
        ((("outcome", "failed"),), float(snapshot.aborts_failed)),
        ((("outcome", "timed_out"),), float(snapshot.aborts_timed_out)),
    ]


def _m(name: str, kind: str, help: str, labels: tuple[str, ...] = (), **kw: object) -> Metric:
    return Metric(PREFIX + name, kind, help, labels, **kw)  # type: ignore[arg-type]


#: Every published family, in exposition order (docs/observability.md lists the same).
METRICS: tuple[Metric, ...] = (
    _m(
        "requests_started_total",
        "counter",
        "Requests the sidecar accepted and started towards vLLM, by the DP rank selected for them.",
        ("dp_rank",),
        samples=lambda s: _by_rank(s.requests_started_by_dp_rank),
    ),
    _m(
        "inflight_requests",
        "gauge",
        "Requests started and not ended yet, by DP rank.",
        ("dp_rank",),
        samples=lambda s: _by_rank(s.requests_in_flight_by_dp_rank),
    ),
    _m(
        "requests_finished_total",
        "counter",
        "Requests that ended with a final chunk, by finish reason (cancelled: the client's or the engine's "
        "cancellation, or vLLM's abort).",
        ("finish_reason",),
        samples=lambda s: _by("finish_reason", s.requests_finished),
    ),
    _m(
        "request_errors_total",
        "counter",
        "Requests that ended with an error, by the sidecar error kind (unexpected: outside the error family).",
        ("error_type",),
        samples=lambda s: _by("error_type", s.request_errors),
    ),
    _m(
        "requests_rejected_total",
        "counter",
        "Requests refused before they started: vLLM not serving (admission closed by the health prober), "
        "the sidecar not started or draining, or a request that does not convert.",
        ("reason",),
        samples=lambda s: _by("reason", s.requests_rejected),
    ),
    _m(
        "prompt_tokens_total",
        "counter",
        "Prompt tokens of the requests vLLM received, counted when they end.",
        samples=lambda s: _one(s.prompt_tokens),
    ),
    _m(
        "completion_tokens_total",
        "counter",
        "Completion tokens reported in the requests' usage, counted when they end.",
        samples=lambda s: _one(s.completion_tokens),
    ),
    _m(
        "time_to_first_token_seconds",
        "histogram",
        "From the sidecar accepting a request to delivering its first token.",
        histogram=lambda s: s.time_to_first_token,
    ),
    _m(
        "inter_token_latency_seconds",
        "histogram",
        "Per request: the mean interval between its tokens after the first delivered ones (from that "
        "delivery to the request's end, divided by the tokens delivered after it).",
        histogram=lambda s: s.inter_token_latency,
    ),
    _m(
        "aborts_queued_total",
        "counter",
        "Request ids queued for Control.Abort (streams abandoned before vLLM ended them).",
        samples=lambda s: _one(s.aborts_queued),
    ),
    _m(
        "aborts_total",
        "counter",
        "Request ids in Control.Abort calls, by outcome: sent (the call succeeded), failed, timed_out.",
        ("outcome",),
        samples=_aborts,
    ),
    _m(
        "decode_deferrals_total",
        "counter",
        "Decode-mode cancellations deferred until the KV transfer completed.",
        samples=lambda s: _one(s.decode_deferrals),
    ),
    _m(
        "health_state",
        "gauge",
        "The health prober's state: 1 for the current state, 0 for the others.",
        ("state",),
        samples=_health,
    ),
    _m(
        "health_transitions_total",
        "counter",
        "Changes of the health prober's state, by the state entered.",
        ("state",),
        samples=lambda s: _by("state", s.health_transitions),
    ),
    _m(
        "pool_connections",
        "gauge",
        "gRPC connections to vLLM in the sidecar's pool (--grpc-connections).",
        samples=lambda s: _one(s.pool_connections),
    ),
    _m(
        "pool_connections_up",
        "gauge",
        "Pool connections usable now (neither broken nor closed).",
        samples=lambda s: _one(s.pool_connections_up),
    ),
    _m(
        "pool_reconnects_total",
        "counter",
        "Broken pool connections replaced.",
        samples=lambda s: _one(s.pool_reconnects),
    ),
    _m(
        "pool_reconnect_failures_total",
        "counter",
        "Attempts to replace a broken pool connection that failed.",
        samples=lambda s: _one(s.pool_reconnect_failures),
    ),
)


def metric_names() -> list[str]:
    """Every family name as scraped (histograms: the base name; their series add ``_bucket``, ``_sum``, ``_count``)."""
    return [metric.name for metric in METRICS]


def prometheus_label(raw: str) -> str:
    """A Dynamo hierarchy name (namespace, component, endpoint) as Dynamo's own families label it
    (``sanitize_prometheus_label``): every character outside ``[a-zA-Z0-9_]`` becomes ``_``, a leading digit
    gets a ``_`` prefix and a reserved leading ``__`` is dropped. ``m-trio`` → ``m_trio``."""
    out = "".join(c if (c.isascii() and (c.isalnum() or c == "_")) else "_" for c in raw)
    if out[:1].isdigit():
        out = "_" + out
    if out.startswith("__"):
        out = out[2:]
        if not out[:1].isalpha():
            out = "_" + out
    return out


def common_labels(
    *, namespace: str, component: str, endpoint: str, model: str, worker_id: str | None, model_name: str | None = None
) -> tuple[tuple[str, str], ...]:
    """The labels on every sample, as Dynamo injects them into engine metrics (``prometheus_names.labels``):
    the hierarchy names sanitized as on Dynamo's own families, ``model_name`` = ``model`` unless given."""
    labels = [
        ("dynamo_namespace", prometheus_label(namespace)),
        ("dynamo_component", prometheus_label(component)),
        ("dynamo_endpoint", prometheus_label(endpoint)),
    ]
    if worker_id is not None:
        labels.append(("worker_id", worker_id))
    labels += [("model", model), ("model_name", model if model_name is None else model_name)]
    return tuple(labels)


@attrs.define
class Lifecycle:
    """The worker's lifecycle gauges, as Dynamo 1.6.1's native sidecar publishes them
    (``dynamo_component_{model_load,drain,cleanup}_time_seconds``): set once each, 0 until then."""

    model_load_time_seconds: float = 0.0
    drain_time_seconds: float = 0.0
    cleanup_time_seconds: float = 0.0


#: (family, help) of the lifecycle gauges, Dynamo's texts; their labels are native's: ``model`` is the model
#: path and ``model_name`` the served name.
LIFECYCLE_METRICS = (
    ("dynamo_component_model_load_time_seconds", "Time engine.start() took to return. Set once at Worker setup."),
    (
        "dynamo_component_drain_time_seconds",
        "Time spent draining in-flight work before cleanup. Stays at 0 for engines without a drain hook.",
    ),
    (
        "dynamo_component_cleanup_time_seconds",
        "Time spent releasing engine resources during shutdown. Set by the framework once after "
        "engine.cleanup() returns.",
    ),
)


def _lifecycle_samples(lifecycle: Lifecycle | None, labels: Labels) -> list[tuple[str, str, Sample]]:
    if lifecycle is None:
        return []
    out: list[tuple[str, str, Sample]] = []
    for name, help in LIFECYCLE_METRICS:
        value = getattr(lifecycle, name.removeprefix("dynamo_component_"))
        out.append((name, help, (name, tuple(labels), float(value))))
    return out


def _format_bound(bound: float) -> str:
    return repr(float(bound))


def _samples(metric: Metric, snapshot: StatsSnapshot, common: Labels) -> list[Sample]:
    if metric.histogram is None:
        assert metric.samples is not None
        return [(metric.name, (*common, *labels), value) for labels, value in metric.samples(snapshot)]
    histogram = metric.histogram(snapshot)
    out: list[Sample] = []
    bounds = [_format_bound(b) for b in histogram.bounds] + ["+Inf"]
    for bound, total in zip(bounds, histogram.cumulative(), strict=True):
        out.append((metric.name + "_bucket", (*common, ("le", bound)), float(total)))
    out.append((metric.name + "_sum", tuple(common), histogram.sum))
    out.append((metric.name + "_count", tuple(common), float(histogram.count)))
    return out


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _format_value(value: float) -> str:
    if value == int(value) and abs(value) < 2**53:
        return str(int(value))
    return repr(value)


def render_text(
    snapshot: StatsSnapshot, common: Labels, lifecycle: Lifecycle | None = None, lifecycle_labels: Labels = ()
) -> str:
    """Prometheus text exposition (0.0.4) of every family, ``common`` labels first on each sample; then the
    ``lifecycle`` gauges (when given) with ``lifecycle_labels``."""
    lines: list[str] = []
    families = [(m.name, m.help, m.kind, _samples(m, snapshot, common)) for m in METRICS]
    families += [
        (name, help, "gauge", [sample]) for name, help, sample in _lifecycle_samples(lifecycle, lifecycle_labels)
    ]
    for family, help, kind, samples in families:
        lines.append(f"# HELP {family} {help}")
        lines.append(f"# TYPE {family} {kind}")
        for name, labels, value in samples:
            label_text = ",".join(f'{key}="{_escape(val)}"' for key, val in labels)
            text = _format_value(value)
            lines.append(f"{name}{{{label_text}}} {text}" if label_text else f"{name} {text}")
    return "\n".join(lines) + "\n"


TypedFamily = tuple[str, str, str, str, list[tuple[str, list[tuple[str, str]], float, None]]]


def render_typed(
    snapshot: StatsSnapshot, common: Labels, lifecycle: Lifecycle | None = None, lifecycle_labels: Labels = ()
) -> list[TypedFamily]:
    """The same families for Dynamo's typed callback (the OTLP export): ``(name, help, type, unit, samples)``
    as ``dynamo.common.utils.prometheus.get_prometheus_typed`` builds them from a ``prometheus_client``
    registry (a counter's family name without ``_total``, its samples with it)."""
    out: list[TypedFamily] = []
    for metric in METRICS:
        family = metric.name.removesuffix("_total") if metric.kind == "counter" else metric.name
        samples = [(name, list(labels), value, None) for name, labels, value in _samples(metric, snapshot, common)]
        out.append((family, metric.help, metric.kind, "", samples))
    for name, help, (sample, labels, value) in _lifecycle_samples(lifecycle, lifecycle_labels):
        out.append((name, help, "gauge", "", [(sample, list(labels), value, None)]))
    return out
