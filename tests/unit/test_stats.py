"""The pure stats core (``trio_sidecar.core.stats``) and its Prometheus mapping (``trio_sidecar.dynamo.metrics``);
docs/observability.md. The Grafana dashboard (``deploy/grafana-dashboard.json``) uses only published names."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from trio_sidecar.core.errors import ErrorKind
from trio_sidecar.core.health_policy import HealthKind
from trio_sidecar.core.stats import (
    ERROR_TYPES,
    HEALTH_STATES,
    ITL_BUCKETS,
    TTFT_BUCKETS,
    Histogram,
    SidecarStats,
    error_type,
)
from trio_sidecar.dynamo.metrics import (
    LIFECYCLE_METRICS,
    METRICS,
    PREFIX,
    Lifecycle,
    common_labels,
    metric_names,
    prometheus_label,
    render_text,
    render_typed,
)

REPO = Path(__file__).resolve().parents[2]
LABELS = common_labels(namespace="ns", component="backend", endpoint="generate", model='m"1\\', worker_id="1f")


def busy_stats() -> SidecarStats:
    stats = SidecarStats()
    stats.add_dp_ranks(2)
    for rank in (0, 1, 1, None):
        stats.request_started(rank)
    stats.request_finished(0, "length", None, 10, 4)
    stats.request_finished(1, "cancelled", None, 10, 2)
    stats.request_finished(1, None, "CannotConnect", 0, 0)
    stats.request_rejected("not_serving")
    stats.ttft.observe(0.003)
    stats.itl.observe(0.02 / 4, 4)
    stats.aborts_queued += 2
    stats.aborts_sent += 1
    stats.aborts_timed_out += 1
    stats.health_changed("not_serving")
    return stats


# --- the core -----------------------------------------------------------------------------------------------


def test_histogram_buckets_are_upper_inclusive_and_a_batch_counts_each_token():
    histogram = Histogram((0.1, 1.0))
    histogram.observe(0.1)
    histogram.observe(0.5)
    histogram.observe(2.0)
    histogram.observe(0.25, 4)  # 4 tokens 0.25 s apart: 1 s in all
    snap = histogram.snapshot()
    assert snap.counts == (1, 5, 1)
    assert snap.cumulative() == [1, 6, 7]
    assert snap.count == 7
    assert math.isclose(snap.sum, 0.1 + 0.5 + 2.0 + 1.0)


def test_the_buckets_are_vllms_with_finer_inter_token_buckets():
    assert TTFT_BUCKETS[0] == 0.001 and TTFT_BUCKETS[-1] == 2560.0 and len(TTFT_BUCKETS) == 22
    assert ITL_BUCKETS[:4] == (0.001, 0.0025, 0.005, 0.01) and ITL_BUCKETS[-1] == 80.0
    assert list(TTFT_BUCKETS) == sorted(set(TTFT_BUCKETS)) and list(ITL_BUCKETS) == sorted(set(ITL_BUCKETS))


def test_every_error_kind_has_its_own_error_type():
    types = [error_type(kind.value) for kind in ErrorKind]
    assert len(set(types)) == len(ErrorKind) and "unexpected" not in types
    assert set(types) | {"unexpected"} == set(ERROR_TYPES)
    assert error_type(None) == "unexpected"


def test_the_health_states_are_the_probers():
    assert HEALTH_STATES == tuple(kind.value for kind in HealthKind)


def test_the_snapshot_counts_requests_per_outcome_and_rank():
    snap = busy_stats().snapshot(health_state="not_serving", pool_connections=4, pool_connections_up=3)
    assert snap.requests_started == 4
    assert snap.requests_started_by_dp_rank == {None: 1, 0: 1, 1: 2}
    assert snap.requests_in_flight == 1 and snap.requests_in_flight_by_dp_rank == {None: 1, 0: 0, 1: 0}
    assert snap.requests_finished == {"stop": 0, "length": 1, "cancelled": 1}
    assert snap.request_errors["cannot_connect"] == 1 and sum(snap.request_errors.values()) == 1
    started = sum(snap.requests_finished.values()) + sum(snap.request_errors.values()) + snap.requests_in_flight
    assert started == snap.requests_started
    assert (snap.prompt_tokens, snap.completion_tokens) == (20, 6)
    assert snap.health_transitions["not_serving"] == 1 and snap.health_state == "not_serving"
    assert (snap.pool_connections, snap.pool_connections_up) == (4, 3)


def test_a_snapshot_does_not_change_with_the_recorder():
    stats = busy_stats()
    snap = stats.snapshot()
    stats.request_started(None)
    stats.request_finished(None, "stop", None, 1, 1)
    stats.ttft.observe(1.0)
    assert snap.requests_started == 4 and snap.requests_finished["stop"] == 0
    assert snap.time_to_first_token.count == 1


def test_a_finish_reason_not_known_in_advance_is_counted_too():
    stats = SidecarStats()
    stats.request_started(None)
    stats.request_finished(None, "abort", None, 0, 0)
    assert stats.snapshot().requests_finished["abort"] == 1


# --- the Prometheus mapping ---------------------------------------------------------------------------------


@pytest.mark.dynamo  # prometheus_client comes with Dynamo
def test_the_text_is_valid_prometheus_exposition_with_every_family_and_the_common_labels():
    parser = pytest.importorskip("prometheus_client.parser")
    text = render_text(busy_stats().snapshot(health_state="serving", pool_connections=2), LABELS)
    families = {f.name: f for f in parser.text_string_to_metric_families(text)}
    # prometheus_client names a counter family without its ``_total``
    assert {name.removesuffix("_total") for name in metric_names()} == set(families)
    for metric in METRICS:
        family = families[metric.name.removesuffix("_total")]
        assert family.type == metric.kind
        for sample in family.samples:
            assert sample.labels["dynamo_namespace"] == "ns" and sample.labels["model"] == 'm"1\\'
            assert sample.labels["worker_id"] == "1f"
            assert set(sample.labels) - {"le"} == {*dict(LABELS), *metric.labels}
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}

    def value(name, **labels):
        return values[(PREFIX + name, tuple(sorted({**dict(LABELS), **labels}.items())))]

    assert value("requests_started_total", dp_rank="1") == 2
    assert value("requests_started_total", dp_rank="unassigned") == 1
    assert value("request_errors_total", error_type="cannot_connect") == 1
    assert value("aborts_total", outcome="timed_out") == 1
    assert value("health_state", state="serving") == 1 and value("health_state", state="failed") == 0
    assert value("inter_token_latency_seconds_bucket", le="0.005") == 4
    assert value("inter_token_latency_seconds_count") == 4
    assert value("time_to_first_token_seconds_bucket", le="+Inf") == 1
    assert value("pool_connections") == 2


def test_the_typed_families_carry_the_same_samples_as_the_text():
    snap = busy_stats().snapshot()
    text = render_text(snap, LABELS)
    typed = render_typed(snap, LABELS)
    assert [family[0] for family in typed] == [
        m.name.removesuffix("_total") if m.kind == "counter" else m.name for m in METRICS
    ]
    lines = [line for line in text.splitlines() if not line.startswith("#")]
    samples = [sample for family in typed for sample in family[4]]
    assert len(samples) == len(lines)
    for (name, labels, value, timestamp), line in zip(samples, lines, strict=True):
        assert line.startswith(name + "{") and float(line.rsplit(" ", 1)[1]) == value and timestamp is None
        assert isinstance(labels, list)


@pytest.mark.parametrize(
    ("raw", "label"),
    [
        ("m-trio", "m_trio"),
        ("m-trio-s1", "m_trio_s1"),
        ("a.b/c", "a_b_c"),
        ("9ns", "_9ns"),
        ("__x", "x"),
        ("ok_1", "ok_1"),
    ],
)
def test_hierarchy_names_are_labelled_as_dynamos_own_families_label_them(raw, label):
    assert prometheus_label(raw) == label
    labels = dict(common_labels(namespace=raw, component=raw, endpoint=raw, model="m", worker_id=None))
    assert labels["dynamo_namespace"] == labels["dynamo_component"] == labels["dynamo_endpoint"] == label


def test_the_lifecycle_gauges_carry_natives_labels_and_values():
    lifecycle = Lifecycle(model_load_time_seconds=1.5, drain_time_seconds=0.25)
    native = common_labels(
        namespace="ns",
        component="backend",
        endpoint="generate",
        model="/models/tiny",
        model_name="tiny",
        worker_id="1f",
    )
    text = render_text(busy_stats().snapshot(), LABELS, lifecycle, native)
    assert (
        'dynamo_component_model_load_time_seconds{dynamo_namespace="ns",dynamo_component="backend",'
        'dynamo_endpoint="generate",worker_id="1f",model="/models/tiny",model_name="tiny"} 1.5'
    ) in text
    assert "\ndynamo_component_drain_time_seconds{" in text and "} 0.25\n" in text
    typed = render_typed(busy_stats().snapshot(), LABELS, lifecycle, native)
    assert [family[0] for family in typed[-3:]] == [name for name, _help in LIFECYCLE_METRICS]
    assert typed[-1][4][0][2] == 0.0  # cleanup: 0 until set


@pytest.mark.dynamo  # dynamo.prometheus_names
def test_names_and_labels_follow_dynamos_prometheus_names():
    names = pytest.importorskip("dynamo.prometheus_names")
    assert PREFIX.startswith(names.name_prefix.COMPONENT + "_")
    assert [key for key, _ in LABELS] == [
        names.labels.NAMESPACE,
        names.labels.COMPONENT,
        names.labels.ENDPOINT,
        names.labels.WORKER_ID,
        names.labels.MODEL,
        names.labels.MODEL_NAME,
    ]
    # none of the runtime's own component families is repeated
    runtime = {
        f"{names.name_prefix.COMPONENT}_{value}"
        for value in vars(names.work_handler).values()
        if isinstance(value, str)
    }
    assert not runtime & set(metric_names())
    for metric in METRICS:
        assert re.fullmatch(r"[a-z_]+", metric.name)
        assert metric.name.endswith("_total") == (metric.kind == "counter")
        assert "dp_rank" not in metric.labels or names.labels.DP_RANK == "dp_rank"


# --- the dashboard ------------------------------------------------------------------------------------------


def _expressions(node):
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "definition") and isinstance(value, str):
                yield value
            else:
                yield from _expressions(value)
    elif isinstance(node, list):
        for item in node:
            yield from _expressions(item)


def test_every_dashboard_expression_names_only_published_metrics_and_every_metric_is_shown():
    dashboard = json.loads((REPO / "deploy" / "grafana-dashboard.json").read_text())
    published = set(metric_names())
    series = published | {
        f"{m.name}{suffix}" for m in METRICS if m.kind == "histogram" for suffix in ("_bucket", "_sum", "_count")
    }
    used: set[str] = set()
    expressions = list(_expressions(dashboard))
    assert expressions
    label_names = {key for key, _ in LABELS}
    for expr in expressions:
        found = set(re.findall(rf"\b({PREFIX}[a-z_]+)", expr))
        assert found, f"no published metric in {expr!r}"
        assert found <= series, f"{expr!r} names {found - series}"
        others = set(re.findall(r"\b((?:dynamo|vllm)[a-z_:]*)", expr)) - found - label_names
        assert not others, f"{expr!r} names metrics trio-sidecar does not publish: {others}"
        used |= {name.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count") for name in found}
    assert published <= used, f"metrics not on the dashboard: {published - used}"
