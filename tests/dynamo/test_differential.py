"""Issue 6 test 5: differential test against Dynamo's native sidecar (``python -m dynamo.vllm.sidecar``).

Both sidecars serve the *same* mock (engine argument ``token_seed_source: "prompt"``, docs/reference/mock.md#token-seed-and-request-uuid, so
the same prompt yields the same tokens whatever the frontend's request id), each behind its own frontend
(the frontend's ``--namespace`` scopes discovery to one sidecar). trio-sidecar runs with
``--no-abort-on-cancel`` (upstream behaviour). For a matrix of requests we compare:

* the OpenAI responses (tokens, finish reasons, usage, logprobs), minus ids and timestamps;
* the ``GenerateRequest`` each sidecar sent (the mock's recorded requests) and its metadata, minus the
  request id;
* the model-card records both wrote under ``v1/mdc``.

Prefill/decode pairs are compared the same way in a second deployment, which also hosts issue 6 test 3
(trio-sidecar prefill + decode workers with two mocks behind one frontend complete a request).
"""

from __future__ import annotations

import json
import urllib.parse

import pytest
from dynamo_harness import FAST_ENGINE_ARGS, start_pair

from trio_sidecar._devtools import local

pytestmark = pytest.mark.dynamo

ENGINE_ARGS = {**FAST_ENGINE_ARGS, "token_seed_source": "prompt"}
# Aggregated and decode workers register the channel of their worker-side prefill completion
# (docs/dynamo.md#router-load-signals); prefill workers do not.
PREFILL_COMPLETION = ("event_channels", "backend", "generate", "active_sequences_events")


@pytest.fixture(scope="module")
def agg_pair(deployment_factory):
    dep = deployment_factory()
    mock = dep.mock(served_model_name="tiny", engine_args=ENGINE_ARGS)
    return start_pair(dep, {"native": ((),), "trio": ((),)}, [mock])


@pytest.fixture(scope="module")
def pd_pair(deployment_factory):
    dep = deployment_factory()
    prefill = dep.mock(served_model_name="tiny", disaggregation_mode="prefill", engine_args=ENGINE_ARGS)
    decode = dep.mock(served_model_name="tiny", disaggregation_mode="decode", engine_args=ENGINE_ARGS)
    args = (("--disaggregation-mode", "prefill"), ("--disaggregation-mode", "decode"))
    return start_pair(dep, {"native": args, "trio": args}, [prefill, decode])


def _strip_response(body):
    if not isinstance(body, dict):
        return body
    body = {k: v for k, v in body.items() if k not in ("id", "created")}
    return body


def _request_id(body) -> str:
    return body["id"].split("-", 1)[1]


def _sent(mock, request_id: str) -> tuple[dict, dict]:
    from google.protobuf.json_format import MessageToDict

    found = [(req, md) for _, req, md, _ in mock.recorded() if req.request_id == request_id]
    assert len(found) == 1, f"{len(found)} requests recorded for {request_id}"
    req, metadata = found[0]
    as_dict = MessageToDict(req, preserving_proto_field_name=True)
    as_dict.pop("request_id")
    # The native 1.6.1 sidecar has post-stack upstream features, so these differ by design: priority negation and the temperature default.
    as_dict.pop("priority", None)
    as_dict.pop("temperature", None)
    meta = {k: v for k, v in metadata if k.startswith("x-")}
    return as_dict, meta


def _prompt_seeded_tokens(request, n: int, seed: int = 42) -> list[int]:
    """The mock's tokens under ``token_seed_source: "prompt"`` (docs/reference/mock.md#token-seed-and-request-uuid)."""
    from trio_sidecar.mock.generation import prompt_token_seed, token_at

    value = prompt_token_seed(seed, list(request.token_ids.ids))
    return [token_at(value, p) for p in range(n)]


def _greedy_tokens(text: str) -> list[int]:
    return [int(part.rstrip(">")) for part in text.split("<token:")[1:]]


MATRIX = [
    ("greedy", "/v1/completions", {"prompt": "hello world", "max_tokens": 6, "temperature": 0}),
    (
        "sampling",
        "/v1/completions",
        {
            "prompt": "hello world",
            "max_tokens": 5,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 20,
            "seed": 7,
            "min_tokens": 1,
            "repetition_penalty": 1.1,
            "frequency_penalty": 0.1,
            "presence_penalty": 0.2,
        },
    ),
    ("logprobs", "/v1/completions", {"prompt": "the quick brown fox", "max_tokens": 4, "logprobs": 2}),
    ("prompt logprobs", "/v1/completions", {"prompt": "the quick brown fox", "max_tokens": 3, "prompt_logprobs": 1}),
    ("max tokens 1", "/v1/completions", {"prompt": "a", "max_tokens": 1}),
    ("ignore eos", "/v1/completions", {"prompt": "lazy dog", "max_tokens": 7, "ignore_eos": True}),
    ("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}),
    (
        "chat logprobs",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3, "logprobs": True, "top_logprobs": 2},
    ),
    (
        "structured output",
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "json please"}],
            "max_tokens": 5,
            "response_format": {"type": "json_object"},
        },
    ),
]


@pytest.mark.parametrize(("name", "path", "payload"), MATRIX, ids=[m[0] for m in MATRIX])
def test_same_responses_and_same_vllm_requests_as_the_native_sidecar(agg_pair, name, path, payload):
    (mock,) = agg_pair.mocks
    results = agg_pair.post(path, {"model": "tiny", **payload})
    (n_status, n_body), (t_status, t_body) = results["native"], results["trio"]
    assert (t_status, _strip_response(t_body)) == (n_status, _strip_response(n_body))
    assert n_status == 200, n_body
    assert _sent(mock, _request_id(t_body)) == _sent(mock, _request_id(n_body))


def test_stop_token_ids_end_both_streams_at_the_same_token(agg_pair):
    (mock,) = agg_pair.mocks
    base = {"model": "tiny", "prompt": "stop here please", "max_tokens": 8, "temperature": 0}
    status, body = local.post_json(agg_pair.ports["trio"], "/v1/completions", base)
    assert status == 200, body
    third = _greedy_tokens(body["choices"][0]["text"])[2]
    results = agg_pair.post("/v1/completions", {**base, "stop_token_ids": [third]})
    (n_status, n_body), (t_status, t_body) = results["native"], results["trio"]
    assert (t_status, _strip_response(t_body)) == (n_status, _strip_response(n_body))
    assert t_body["choices"][0]["finish_reason"] == "stop"
    assert t_body["usage"]["completion_tokens"] == 3
    assert _sent(mock, _request_id(t_body)) == _sent(mock, _request_id(n_body))


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_same_streamed_chunks_as_the_native_sidecar(agg_pair, path):
    payload = {"model": "tiny", "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}}
    if path == "/v1/completions":
        payload["prompt"] = "stream me"
    else:
        payload["messages"] = [{"role": "user", "content": "stream me"}]
    streams = agg_pair.stream(path, payload)
    native = _fold_stream(streams["native"])
    trio = _fold_stream(streams["trio"])
    native_shapes, trio_shapes = native.pop("shapes"), trio.pop("shapes")
    assert trio == native
    assert trio_shapes <= native_shapes  # no chunk shape the native sidecar would not produce
    assert len(streams["native"]) >= 6


def _fold_stream(chunks: list[dict]) -> dict:
    """What a client reads from a stream, independent of chunk boundaries.

    trio-sidecar coalesces the token deltas of one request that are queued together (coalesce.take_merged),
    so a loaded machine may deliver the same tokens in fewer SSE events than the native sidecar.
    """
    content, finishes, usage, shapes = [], [], [], set()
    for chunk in chunks:
        chunk = _strip_response(chunk)
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            content.append(choice.get("text") or delta.get("content") or "")
            if choice.get("finish_reason"):
                finishes.append(choice["finish_reason"])
            shapes.add((chunk.get("object"), chunk.get("model"), tuple(sorted(choice)), tuple(sorted(delta))))
        if chunk.get("usage"):
            usage.append(chunk["usage"])
    return {"content": "".join(content), "finishes": finishes, "usage": usage, "shapes": shapes}


def _registrations(dep) -> dict[str, dict]:
    """Per side: each component's (endpoint, model card) from ``v1/mdc``, and the event publishers: the (component, endpoint, topic) of every event
    source and event channel the side's processes registered (KV events, prefill completion)."""
    sides: dict[str, dict] = {"native": {"cards": {}, "events": set()}, "trio": {"cards": {}, "events": set()}}

    def side_of(name: str) -> str:
        return "native" if f"{dep.namespace}-native/" in name else "trio"

    for path in (dep.file_kv / "v1" / "mdc").glob("*"):
        name = urllib.parse.unquote(path.name)
        record = json.loads(path.read_text())
        card = record["card_json"]
        sides[side_of(name)]["cards"][record["component"]] = (record["endpoint"], card)
    for kind in ("event_sources", "event_channels"):
        for path in (dep.file_kv / "v1" / kind).glob("*"):
            name = urllib.parse.unquote(path.name)
            scope = json.loads(path.read_text())["scope"]["endpoint"]
            entry = (kind, scope["component"], scope["name"], json.loads(path.read_text())["topic"])
            sides[side_of(name)]["events"].add(entry)
    return sides


def test_same_model_card_and_kv_publishers_as_the_native_sidecar(agg_pair):
    regs = _registrations(agg_pair.dep)
    assert set(regs["native"]["cards"]) == {"backend"}
    assert PREFILL_COMPLETION in regs["native"]["events"]
    assert regs["trio"] == regs["native"]


def test_prefill_and_decode_register_the_same_cards_and_kv_publishers_as_the_native_sidecar(pd_pair):
    regs = _registrations(pd_pair.dep)
    native, trio = regs["native"], regs["trio"]
    assert set(native["cards"]) == {"prefill", "backend"}
    prefill_card, decode_card = native["cards"]["prefill"][1], native["cards"]["backend"][1]
    # What the comparison covers (the native values, as documented in docs/dynamo.md).
    assert prefill_card["model_type"] != decode_card["model_type"]
    assert prefill_card["runtime_config"]["enable_local_indexer"] is True
    assert decode_card["runtime_config"]["enable_local_indexer"] is True
    assert ("event_sources", "prefill", "generate", "kv-events") in native["events"]
    # The decode worker publishes no KV events, only its prefill completion.
    assert {e for e in native["events"] if e[1] == "backend"} == {PREFILL_COMPLETION}
    assert trio["cards"] == native["cards"]
    assert trio["events"] == native["events"]


@pytest.mark.parametrize(("name", "path", "payload"), [MATRIX[0], MATRIX[6]], ids=["completions", "chat"])
def test_prefill_decode_same_responses_and_requests_as_the_native_sidecar(pd_pair, name, path, payload):
    prefill, decode = pd_pair.mocks
    before = {id(m): len(m.recorded()) for m in pd_pair.mocks}
    results = pd_pair.post(path, {"model": "tiny", **payload})
    (n_status, n_body), (t_status, t_body) = results["native"], results["trio"]
    assert n_status == 200, n_body
    assert (t_status, _strip_response(t_body)) == (n_status, _strip_response(n_body))

    def sent(mock):
        from google.protobuf.json_format import MessageToDict

        out = []
        for _, req, md, _ in mock.recorded()[before[id(mock)] :]:
            d = MessageToDict(req, preserving_proto_field_name=True)
            for key in ("request_id", "priority", "temperature"):
                d.pop(key, None)
            # Prefill handoff parameters carry per-request ids; compare their shape, not their values.
            kv = d.get("kv", {}).get("kv_transfer_params")
            if isinstance(kv, dict):
                d["kv"]["kv_transfer_params"] = sorted(kv)
            out.append((d, {k: v for k, v in md if k.startswith("x-")}))
        return out

    p_sent, d_sent = sent(prefill), sent(decode)
    assert len(p_sent) == 2 and len(d_sent) == 2  # one per sidecar family
    assert p_sent[0] == p_sent[1]
    assert d_sent[0] == d_sent[1]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_request_is_prefilled_on_one_worker_and_decoded_on_the_other(pd_pair, path):
    """Issue 6 test 3, on the trio-sidecar side of the P/D deployment."""
    prefill, decode = pd_pair.mocks
    before_p, before_d = len(prefill.recorded()), len(decode.recorded())
    payload = {"model": "tiny", "max_tokens": 5, "ignore_eos": True, "nvext": {"extra_fields": ["worker_id"]}}
    if path == "/v1/completions":
        payload["prompt"] = "hello world " * 8
    else:
        payload["messages"] = [{"role": "user", "content": "hello world " * 8}]
    status, body = local.post_json(pd_pair.ports["trio"], path, payload)
    assert status == 200, body
    workers = body["nvext"]["worker_id"]
    assert workers["prefill_worker_id"] != workers["decode_worker_id"]

    p_reqs = [req for _, req, _, _ in prefill.recorded()[before_p:]]
    d_reqs = [req for _, req, _, _ in decode.recorded()[before_d:]]
    assert len(p_reqs) == 1 and len(d_reqs) == 1
    # The prefill request computes the prompt; the decode request carries the prefill's transfer params.
    assert p_reqs[0].stopping.max_new_tokens == 1
    assert list(p_reqs[0].token_ids.ids) == list(d_reqs[0].token_ids.ids)
    assert d_reqs[0].kv.kv_transfer_params.fields, "the decode request carries no kv_transfer_params"
    # The decode mock generated the answer (seeded by the prompt: token_seed_source "prompt").
    text = body["choices"][0]["text"] if path == "/v1/completions" else body["choices"][0]["message"]["content"]
    assert text == "".join(f"<token:{t}>" for t in _prompt_seeded_tokens(d_reqs[0], 5))
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5
