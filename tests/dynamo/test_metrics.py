"""The sidecar's Prometheus metrics on the worker's system status server, through the real ``dynamo.frontend``
(docs/observability.md).

One deployment (frontend, ``trio-sidecar run`` with ``DYN_SYSTEM_PORT``, the mock pacing tokens like an
engine); a known mix of requests: N completed, M cancelled by the client's disconnect, K rejected while the
mock reports NOT_SERVING (admission closed; ``--unserving-grace-secs`` keeps the instance in rotation). The
worker's ``/metrics`` is scraped and every count checked exactly.
"""

from __future__ import annotations

import http.client
import re
import time

import pytest
from dynamo_harness import FAST_ENGINE_ARGS, free_system_port

from trio_sidecar._devtools import local
from trio_sidecar.dynamo.metrics import PREFIX, metric_names

pytestmark = pytest.mark.dynamo

# Paced like an engine (a few ms per token): streams last long enough to disconnect from them, and tokens
# arrive after the first delivery (the inter-token latency histogram fills).
ENGINE_ARGS = {**FAST_ENGINE_ARGS, "speedup_ratio": 1.0}
SERVING, NOT_SERVING = 1, 2  # grpc.health.v1 ServingStatus
N_COMPLETED, M_CANCELLED, K_REJECTED = 4, 2, 3
MAX_TOKENS = 8
SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})? (?P<value>\S+)$")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@pytest.fixture(scope="module")
def deployment(deployment_factory):
    dep = deployment_factory()
    mock = dep.mock(served_model_name="tiny", engine_args=ENGINE_ARGS)
    dep.frontend()
    system_port = free_system_port()
    proc = dep.trio_sidecar(
        mock,
        "--unserving-grace-secs",
        "600",
        "--grpc-retry-interval-secs",
        "1",
        env={"DYN_SYSTEM_PORT": str(system_port)},
    )
    dep.wait_ready("tiny")
    return dep, mock, proc, system_port


def scrape_text(port: int) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        response = conn.getresponse()
        body = response.read().decode()
        assert response.status == 200, body[:500]
        return body
    finally:
        conn.close()


def parse(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Every sample of the sidecar's families: name → [(labels, value)]."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        if not line.startswith(PREFIX):
            continue
        match = SAMPLE.match(line)
        assert match is not None, line
        labels = dict(LABEL.findall(match["labels"] or ""))
        out.setdefault(match["name"], []).append((labels, float(match["value"])))
    return out


def value(samples, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    found = [v for have, v in samples[PREFIX + name] if all(have.get(k) == want for k, want in labels.items())]
    assert found, f"no sample {name}{labels}"
    return sum(found)


def wait_for(port: int, predicate, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        samples = parse(scrape_text(port))
        if predicate(samples):
            return samples
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {samples}"
        time.sleep(0.1)


def test_every_family_is_published_from_the_start_with_dynamos_labels(deployment):
    dep, _mock, _proc, port = deployment
    text = scrape_text(port)
    samples = parse(text)
    assert set(samples) >= {n for n in metric_names() if not n.endswith("_seconds")}
    for name in metric_names():
        assert f"# TYPE {name} " in text
    # The runtime's own families are still there, and none of ours repeats one of them.
    assert "dynamo_component_uptime_seconds" in text or "dynamo_component_requests_total" in text
    types = re.findall(r"^# TYPE (\S+) ", text, flags=re.MULTILINE)
    assert len(types) == len(set(types)), "a family is declared twice"
    labels, _ = samples[PREFIX + "pool_connections"][0]
    assert labels["dynamo_namespace"] == dep.namespace
    assert labels["dynamo_component"] == "backend"
    assert labels["dynamo_endpoint"] == "generate"
    assert labels["model"] == labels["model_name"] == "tiny"
    assert re.fullmatch(r"[0-9a-f]+", labels["worker_id"])
    assert value(samples, "health_state", state="serving") == 1
    assert value(samples, "health_state") == 1


def test_a_known_mix_is_counted_exactly(deployment):
    dep, mock, proc, port = deployment
    before = parse(scrape_text(port))
    started_before = value(before, "requests_started_total")

    # N completed
    for _ in range(N_COMPLETED):
        status, body = local.post_json(
            dep.http_port,
            "/v1/completions",
            {"model": "tiny", "prompt": "hello there", "max_tokens": MAX_TOKENS, "ignore_eos": True},
        )
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == MAX_TOKENS

    # M cancelled: the client disconnects mid-stream
    for _ in range(M_CANCELLED):
        with local.stream_sse(
            dep.http_port,
            "/v1/completions",
            {"model": "tiny", "prompt": "a long one", "max_tokens": 20000, "ignore_eos": True, "stream": True},
        ) as events:
            for _ in range(3):
                next(events)
    wait_for(
        port,
        lambda s: value(s, "inflight_requests") == 0 and value(s, "aborts_total", outcome="sent") == M_CANCELLED,
        "the cancelled requests to end and their aborts to be sent",
    )

    # K rejected: vLLM not serving closes admission (the instance stays in rotation: --unserving-grace-secs)
    mock.call(mock.mock.set_serving_status, None, NOT_SERVING)
    wait_for(port, lambda s: value(s, "health_state", state="not_serving") == 1, "the prober to see NOT_SERVING")
    for _ in range(K_REJECTED):
        status, body = local.post_json(
            dep.http_port, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2}
        )
        assert status >= 500, body
    mock.call(mock.mock.set_serving_status, None, SERVING)
    samples = wait_for(port, lambda s: value(s, "health_state", state="serving") == 1, "the prober to recover")

    assert value(samples, "requests_started_total") - started_before == N_COMPLETED + M_CANCELLED
    assert value(samples, "requests_started_total", dp_rank="unassigned") == value(samples, "requests_started_total")
    assert value(samples, "requests_finished_total", finish_reason="length") == N_COMPLETED
    assert value(samples, "requests_finished_total", finish_reason="cancelled") == M_CANCELLED
    assert value(samples, "requests_finished_total", finish_reason="stop") == 0
    assert value(samples, "request_errors_total") == 0
    assert value(samples, "requests_rejected_total", reason="not_serving") == K_REJECTED
    assert value(samples, "requests_rejected_total") == K_REJECTED
    assert value(samples, "inflight_requests") == 0
    assert value(samples, "completion_tokens_total") >= N_COMPLETED * MAX_TOKENS + M_CANCELLED * 3
    assert value(samples, "prompt_tokens_total") > 0
    # every started request delivered tokens: one first-token observation each; one mean inter-token
    # latency for each request with tokens after its first delivery
    assert value(samples, "time_to_first_token_seconds_count") == N_COMPLETED + M_CANCELLED
    assert value(samples, "time_to_first_token_seconds_sum") > 0
    assert 0 < value(samples, "inter_token_latency_seconds_count") <= N_COMPLETED + M_CANCELLED
    assert value(samples, "inter_token_latency_seconds_sum") > 0
    assert value(samples, "inter_token_latency_seconds_bucket", le="+Inf") == value(
        samples, "inter_token_latency_seconds_count"
    )
    assert value(samples, "aborts_queued_total") == M_CANCELLED
    assert value(samples, "aborts_total", outcome="sent") == M_CANCELLED
    assert value(samples, "aborts_total", outcome="failed") == value(samples, "aborts_total", outcome="timed_out") == 0
    assert value(samples, "health_transitions_total", state="not_serving") == 1
    assert value(samples, "health_transitions_total", state="recovering") == 1
    assert value(samples, "health_transitions_total", state="serving") == 1
    assert value(samples, "decode_deferrals_total") == 0
    assert value(samples, "pool_connections") == value(samples, "pool_connections_up") > 0
    assert value(samples, "pool_reconnects_total") == value(samples, "pool_reconnect_failures_total") == 0
    assert proc.alive()
