"""Frontend + mock + ``trio-sidecar run`` as real processes on 127.0.0.1.

The frontend gives every request a fresh id, returned as the OpenAI response id (``cmpl-{id}`` /
``chatcmpl-{id}``); the sidecar forwards it as the vLLM ``request_id`` and the mock seeds its tokens with it,
so the exact expected text is ``planned_tokens(seed, id, n)`` rendered as ``<token:{id}>`` (docs/reference/mock.md#text-logprobs-and-candidates).
"""

from __future__ import annotations

import signal
import time

import pytest
from dynamo_harness import FAST_ENGINE_ARGS

from trio_sidecar._devtools import local

pytestmark = pytest.mark.dynamo

SEED = 42
# Modelled time at speedup 1 keeps long requests running long enough to disconnect from them.
ENGINE_ARGS = {**FAST_ENGINE_ARGS, "speedup_ratio": 1.0}


@pytest.fixture(scope="module")
def agg(deployment_factory):
    dep = deployment_factory()
    mock = dep.mock(served_model_name="tiny", seed=SEED, engine_args=ENGINE_ARGS)
    dep.frontend()
    dep.trio_sidecar(mock)
    dep.wait_ready("tiny")
    return dep, mock


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    tokenizers = pytest.importorskip("tokenizers")
    return tokenizers.Tokenizer.from_file(str(tiny_model / "tokenizer.json"))


def expected_text(request_id: str, n: int) -> str:
    from trio_sidecar.mock import planned_tokens

    return "".join(f"<token:{t}>" for t in planned_tokens(SEED, request_id, n))


def request_id_of(response_id: str) -> str:
    return response_id.split("-", 1)[1]


def test_models_lists_the_served_name(agg):
    dep, _ = agg
    assert "tiny" in local.list_models(dep.http_port)


def test_completions_return_the_mock_tokens(agg, tokenizer):
    dep, mock = agg
    status, body = local.post_json(
        dep.http_port,
        "/v1/completions",
        {"model": "tiny", "prompt": "hello world", "max_tokens": 5, "ignore_eos": True},
    )
    assert status == 200, body
    rid = request_id_of(body["id"])
    choice = body["choices"][0]
    assert choice["text"] == expected_text(rid, 5)
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": len(tokenizer.encode("hello world").ids),
        "completion_tokens": 5,
        "total_tokens": len(tokenizer.encode("hello world").ids) + 5,
    }
    sent = [req for rpc, req, _, _ in mock.recorded() if req.request_id == rid]
    assert len(sent) == 1
    assert list(sent[0].token_ids.ids) == tokenizer.encode("hello world").ids


def test_streaming_completions_return_the_mock_tokens(agg):
    dep, _ = agg
    with local.stream_sse(
        dep.http_port,
        "/v1/completions",
        {"model": "tiny", "prompt": "hello", "max_tokens": 7, "ignore_eos": True, "stream": True},
    ) as events:
        chunks = list(events)
    rid = request_id_of(chunks[0]["id"])
    text = "".join(c["choices"][0].get("text") or "" for c in chunks if c.get("choices"))
    assert text == expected_text(rid, 7)
    finishes = [c["choices"][0].get("finish_reason") for c in chunks if c.get("choices")]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])


def test_chat_completions_apply_the_template_and_return_the_mock_tokens(agg, tokenizer):
    dep, _ = agg
    status, body = local.post_json(
        dep.http_port,
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "ignore_eos": True},
    )
    assert status == 200, body
    rid = request_id_of(body["id"])
    assert body["choices"][0]["message"]["content"] == expected_text(rid, 4)
    # The tiny chat template renders "user: hello\nassistant: " (docs/reference/worker.md#tiny-model-directory).
    assert body["usage"]["prompt_tokens"] == len(tokenizer.encode("user: hello\nassistant: ").ids)
    assert body["usage"]["completion_tokens"] == 4


def test_streaming_chat_completions_return_the_mock_tokens(agg):
    dep, _ = agg
    with local.stream_sse(
        dep.http_port,
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi there"}],
            "max_tokens": 6,
            "ignore_eos": True,
            "stream": True,
        },
    ) as events:
        chunks = [c for c in events if c.get("choices")]
    rid = request_id_of(chunks[0]["id"])
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == expected_text(rid, 6)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_client_disconnect_releases_the_mock_request_within_2s(agg):
    dep, mock = agg
    assert mock.active() == 0
    with local.stream_sse(
        dep.http_port,
        "/v1/completions",
        {"model": "tiny", "prompt": "a long one", "max_tokens": 20000, "ignore_eos": True, "stream": True},
    ) as events:
        for _ in range(3):
            next(events)
        assert mock.active() == 1
        # Leaving the block closes the client connection mid-stream.
    start = time.monotonic()
    while mock.active() and time.monotonic() - start < 5:
        time.sleep(0.02)
    released = time.monotonic() - start
    assert mock.active() == 0
    assert released < 2.0, f"the mock request was released after {released:.2f}s"
    metrics = mock.call(mock.mock.metrics)
    deadline = time.monotonic() + 2
    while (metrics.running_requests or metrics.waiting_requests) and time.monotonic() < deadline:
        time.sleep(0.02)
        metrics = mock.call(mock.mock.metrics)
    assert (metrics.running_requests, metrics.waiting_requests) == (0, 0)


def test_sigterm_removes_the_model_at_once_drains_and_exits_0(agg):
    dep, _ = agg
    mock = dep.mock(served_model_name="tiny-term", seed=SEED, engine_args=ENGINE_ARGS)
    proc = dep.trio_sidecar(mock, "--drain-timeout-secs", "30", name="term-sidecar")
    local.wait_for_models(dep.http_port, ["tiny-term"], timeout=120, watch=[proc])
    with local.stream_sse(
        dep.http_port,
        "/v1/completions",
        {"model": "tiny-term", "prompt": "drain me", "max_tokens": 150, "ignore_eos": True, "stream": True},
    ) as events:
        first = next(events)
        proc.send_signal(signal.SIGTERM)
        gone = local.wait_for_no_model(dep.http_port, "tiny-term", timeout=10)
        rest = list(events)  # the in-flight request is drained, not cut
    assert gone is not None and gone < 2.0, f"model still listed {gone}s after SIGTERM"
    chunks = [first, *rest]
    tokens = "".join(c["choices"][0].get("text") or "" for c in chunks if c.get("choices"))
    assert tokens == expected_text(request_id_of(first["id"]), 150)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert proc.wait(60) == 0, proc.log()[-3000:]
    assert "tiny" in local.list_models(dep.http_port)  # the other worker is untouched


def test_a_second_signal_exits_1_immediately(agg):
    dep, _ = agg
    mock = dep.mock(served_model_name="tiny-2sig", seed=SEED, engine_args=ENGINE_ARGS)
    proc = dep.trio_sidecar(mock, "--drain-timeout-secs", "60", name="2sig-sidecar")
    local.wait_for_models(dep.http_port, ["tiny-2sig"], timeout=120, watch=[proc])
    with local.stream_sse(
        dep.http_port,
        "/v1/completions",
        {"model": "tiny-2sig", "prompt": "x", "max_tokens": 20000, "ignore_eos": True, "stream": True},
    ) as events:
        next(events)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert proc.alive()  # draining the in-flight request
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        code = proc.wait(10)
        elapsed = time.monotonic() - start
    assert code == 1
    assert elapsed < 5
    assert "again; exiting immediately" in proc.log()


def test_drain_timeout_cancels_the_remaining_requests_and_exits_0(agg):
    dep, _ = agg
    mock = dep.mock(served_model_name="tiny-drain", seed=SEED, engine_args=ENGINE_ARGS)
    proc = dep.trio_sidecar(mock, "--drain-timeout-secs", "1", name="drain-sidecar")
    local.wait_for_models(dep.http_port, ["tiny-drain"], timeout=120, watch=[proc])
    with local.stream_sse(
        dep.http_port,
        "/v1/completions",
        {"model": "tiny-drain", "prompt": "x", "max_tokens": 20000, "ignore_eos": True, "stream": True},
    ) as events:
        next(events)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rest = list(events)  # ends after the drain bound with the cancelled chunk (the frontend's "stop")
        ended = time.monotonic() - start
    assert 0.9 <= ended < 15, ended
    finishes = [c["choices"][0].get("finish_reason") for c in rest if c.get("choices")]
    assert finishes and finishes[-1] == "stop"  # docs/reference/worker.md#output-chunks: "cancelled" is shown as "stop"
    assert sum(1 for c in rest if c.get("choices")) < 20000
    assert proc.wait(30) == 0, proc.log()[-3000:]
    assert "drain timeout reached; cancelling 1 remaining request(s)" in " ".join(proc.log().split())
    deadline = time.monotonic() + 5
    while mock.active() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert mock.active() == 0


def test_data_parallel_mock_registers_dp_size_and_one_kv_publisher_per_rank(agg):
    import json

    dep, _ = agg
    mock = dep.mock(served_model_name="tiny-dp", seed=SEED, engine_args={**ENGINE_ARGS, "dp_size": 2})
    proc = dep.trio_sidecar(mock, namespace=dep.namespace, name="dp-sidecar")
    local.wait_for_models(dep.http_port, ["tiny-dp"], timeout=120, watch=[proc])
    assert "relaying KV events from 2 vLLM source(s) to the router" in " ".join(proc.log().split())
    records = [json.loads(p.read_text()) for p in (dep.file_kv / "v1" / "mdc").glob("*")]
    records = [r for r in records if r["card_json"]["display_name"] == "tiny-dp"]
    assert [r["card_json"]["runtime_config"]["data_parallel_size"] for r in records] == [2]
    assert records[0]["card_json"]["runtime_config"]["data_parallel_start_rank"] == 0

    # The frontend forwards nvext.dp_rank (with the pinned instance) as routing.dp_rank (docs/reference/worker.md#request-dict).
    status, body = local.post_json(
        dep.http_port,
        "/v1/completions",
        {
            "model": "tiny-dp",
            "prompt": "rank one",
            "max_tokens": 2,
            "nvext": {"backend_instance_id": records[0]["instance_id"], "dp_rank": 1},
        },
    )
    assert status == 200, body
    rid = request_id_of(body["id"])
    sent = [md for _, req, md, _ in mock.recorded() if req.request_id == rid]
    assert len(sent) == 1
    assert ("x-data-parallel-rank", "1") in sent[0]
