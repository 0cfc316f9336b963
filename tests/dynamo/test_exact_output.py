"""Exact text and pre-output errors through the real ``dynamo.frontend``, against the native sidecar.

One mock (engine arguments ``text_mode: "bytes"``, ``token_seed_source: "prompt"``, ``max_model_len`` 64)
serves both sidecars, each behind its own frontend (``dynamo_harness.start_pair``). In the byte text mode the
mock's tokens are pieces of UTF-8 and, like vLLM's incremental detokenizer, a message whose character is
still incomplete carries text ``""``: if a sidecar left ``text`` out of such a chunk the frontend would
detokenize the chunk's token ids itself (with the tiny model's tokenizer) and the client would read other
text. Compared: the text a client reads, byte for byte, streaming and not, with native's and with the
mock's own detokenized text; and the HTTP status of every request the sidecar or the mock rejects before
any output (docs/dynamo.md, "Errors before the first output").
"""

from __future__ import annotations

import pytest
from dynamo_harness import FAST_ENGINE_ARGS, start_pair

from trio_sidecar._devtools import local
from trio_sidecar.mock.generation import ByteDetokenizer, prompt_token_seed, token_at, token_bytes

pytestmark = pytest.mark.dynamo

# Paced (speedup 1: a few ms per decode pass), so a token's message usually reaches the sidecar on its own
# and is not coalesced with its neighbours (coalesced chunks carry the joined text, held-back or not).
ENGINE_ARGS = {
    **FAST_ENGINE_ARGS,
    "speedup_ratio": 1.0,
    "token_seed_source": "prompt",
    "text_mode": "bytes",
    "max_model_len": 64,
}
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def pair(deployment_factory):
    dep = deployment_factory()
    mock = dep.mock(served_model_name="tiny", engine_args=ENGINE_ARGS)
    return start_pair(dep, {"native": ((),), "trio": ((),)}, [mock])


def _mock_text(mock, request_id: str, completion_tokens: int) -> tuple[str, list[str]]:
    """What the mock (vLLM) detokenized for the request: the whole text, and each message's text."""
    found = [req for _, req, _, _ in mock.recorded() if req.request_id == request_id]
    assert len(found) == 1, f"{len(found)} requests recorded for {request_id}"
    seed = prompt_token_seed(42, list(found[0].token_ids.ids))
    tokens = [token_at(seed, p) for p in range(completion_tokens)]
    detok = ByteDetokenizer()
    messages = [detok.step([t]) for t in tokens]
    messages[-1] += detok.finish()
    whole = b"".join(token_bytes(t) for t in tokens).decode("utf-8", "replace")
    assert "".join(messages) == whole
    return whole, messages


def _payload(path: str, prompt: str, **extra) -> dict:
    payload = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    if path == "/v1/completions":
        payload["prompt"] = prompt
    else:
        payload["messages"] = [{"role": "user", "content": prompt}]
    return payload


def _text(path: str, body: dict) -> str:
    choice = body["choices"][0]
    return choice["text"] if path == "/v1/completions" else choice["message"]["content"]


PATHS = ["/v1/completions", "/v1/chat/completions"]
PROMPTS = ["hello world", "byte level text", "the quick brown fox"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("prompt", PROMPTS)
def test_unary_text_is_byte_for_byte_vllms_and_natives(pair, path, prompt):
    (mock,) = pair.mocks
    results = pair.post(path, _payload(path, prompt, ignore_eos=True))
    (n_status, n_body), (t_status, t_body) = results["native"], results["trio"]
    assert (n_status, t_status) == (200, 200), (n_body, t_body)
    assert _text(path, t_body).encode() == _text(path, n_body).encode()
    assert t_body["usage"] == n_body["usage"]
    completion = t_body["usage"]["completion_tokens"]
    whole, messages = _mock_text(mock, t_body["id"].split("-", 1)[1], completion)
    assert "" in messages[:-1]  # the request did exercise held-back text
    assert _text(path, t_body).encode() == whole.encode()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("prompt", PROMPTS)
def test_streamed_text_is_byte_for_byte_vllms_and_natives(pair, path, prompt):
    (mock,) = pair.mocks
    payload = _payload(path, prompt, ignore_eos=True, stream=True, stream_options={"include_usage": True})
    streams = pair.stream(path, payload)
    texts, usages, ids = {}, {}, {}
    for side, events in streams.items():
        parts = []
        for event in events:
            for choice in event.get("choices") or ():
                parts.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
            if event.get("usage"):
                usages[side] = event["usage"]
            ids[side] = event["id"]
        texts[side] = "".join(parts)
    assert texts["trio"].encode() == texts["native"].encode()
    assert usages["trio"] == usages["native"]
    whole, messages = _mock_text(mock, ids["trio"].split("-", 1)[1], usages["trio"]["completion_tokens"])
    assert "" in messages[:-1]
    assert texts["trio"].encode() == whole.encode()


# Requests rejected before any output: by the sidecar's conversion (n, best_of) or by the mock, which
# rejects like vLLM (min_tokens > max_tokens, a prompt beyond max_model_len). stop_token_ids outside the
# vocabulary: the mock accepts them, so both answer 200 (the status is still compared).
REJECTED = [
    ("n=2", {"n": 2}),
    ("best_of=2", {"best_of": 2}),
    ("min_tokens > max_tokens", {"min_tokens": 5, "max_tokens": 3}),
    ("prompt beyond max_model_len", {"prompt": "hello world " * 60}),
    ("stop_token_ids outside the vocabulary", {"stop_token_ids": [10**6]}),
]


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streaming"])
@pytest.mark.parametrize(("name", "extra"), REJECTED, ids=[r[0] for r in REJECTED])
def test_an_error_before_any_output_has_the_native_sidecars_http_status(pair, name, extra, stream):
    payload = {"model": "tiny", "prompt": "hello", "max_tokens": 4, **extra, "stream": stream}
    results = pair.post("/v1/completions", payload)
    (n_status, n_body), (t_status, t_body) = results["native"], results["trio"]
    assert t_status == n_status, (name, n_body, t_body)
    if name.startswith("stop_token_ids"):
        assert t_status == 200
        return
    assert t_status == 400, t_body
    # trio-sidecar keeps the detailed message (native's says "Invalid request").
    assert isinstance(t_body, dict) and t_body["message"] != "Invalid request", t_body
    # The worker is still serving afterwards (a failed request does not take it out of the frontend).
    status, body = local.post_json(
        pair.ports["trio"], "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    )
    assert status == 200, body


@pytest.fixture(scope="module")
def unreachable_pair(deployment_factory):
    """Both sidecars registered, then their mock stopped: vLLM is unreachable."""
    dep = deployment_factory()
    mock = dep.mock(served_model_name="tiny", engine_args={**FAST_ENGINE_ARGS, "token_seed_source": "prompt"})
    pair = start_pair(dep, {"native": ((),), "trio": ((),)}, [mock])
    mock.stop()
    return pair


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streaming"])
def test_an_unreachable_engine_has_the_native_sidecars_http_status(unreachable_pair, stream):
    payload = {"model": "tiny", "prompt": "hello", "max_tokens": 3, "stream": stream}
    results = unreachable_pair.post("/v1/completions", payload)
    (n_status, n_body), (t_status, t_body) = results["native"], results["trio"]
    assert (t_status, n_status) == (503, 503), (n_body, t_body)
