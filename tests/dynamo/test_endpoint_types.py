"""``--endpoint-types`` through ``dynamo.frontend``: trio-sidecar against the native 1.6.1 sidecar.

One mock per value (each serves its own model name, so one frontend per side lists them all), each behind a
native and a trio-sidecar worker, each side with its own frontend (``--namespace``). For every value we
compare the model card (``model_type`` included), the models the frontend lists, and what chat, completions
and embeddings requests get. vLLM's gRPC contract has no embeddings RPC: nothing is forwarded to vLLM for an
embeddings request. Native 1.6.1 registers an embeddings-only worker but cannot read the embedding request
Dynamo sends it (its log: ``Failed deserializing msgpack request payload``), so the client waits until the
frontend gives up; trio-sidecar answers HTTP 400 at once (README, "Deliberate differences").
"""

from __future__ import annotations

import json
import urllib.parse

import pytest
from dynamo_harness import FAST_ENGINE_ARGS

from trio_sidecar._devtools import local
from trio_sidecar.core.protocol import EMBEDDINGS_UNSUPPORTED

pytestmark = pytest.mark.dynamo

VALUES = {"chat": "tiny-chat", "completions": "tiny-completions", "chat,embeddings": "tiny-ce", "embeddings": "tiny-e"}
MODEL_TYPES = {
    "chat": "Chat",
    "completions": "Completions",
    "chat,embeddings": "Chat | Embedding",
    "embeddings": "Embedding",
}
SIDES = ("native", "trio")
# The same prompt gives the same tokens whatever the request id (docs/reference/mock.md#token-seed-and-request-uuid).
ENGINE_ARGS = {**FAST_ENGINE_ARGS, "token_seed_source": "prompt"}


@pytest.fixture(scope="module")
def deployment(deployment_factory):
    dep = deployment_factory()
    mocks = {value: dep.mock(served_model_name=name, engine_args=ENGINE_ARGS) for value, name in VALUES.items()}
    ports = {}
    for side in SIDES:
        namespace = f"{dep.namespace}-{side}"
        dep.frontend(namespace=namespace)
        ports[side] = dep.http_port
        start = dep.native_sidecar if side == "native" else dep.trio_sidecar
        for value, mock in mocks.items():
            start(mock, "--endpoint-types", value, namespace=namespace, name=f"{side}-{VALUES[value]}")
    for port in ports.values():
        local.wait_for_models(port, list(VALUES.values()), timeout=240, watch=dep.processes)
    return dep, mocks, ports


def _cards(dep) -> dict[str, dict[str, dict]]:
    out: dict[str, dict[str, dict]] = {side: {} for side in SIDES}
    for path in (dep.file_kv / "v1" / "mdc").glob("*"):
        name = urllib.parse.unquote(path.name)
        side = "native" if f"{dep.namespace}-native/" in name else "trio"
        card = json.loads(path.read_text())["card_json"]
        out[side][card["display_name"]] = card
    return out


def test_each_value_registers_the_same_card_as_the_native_sidecar(deployment):
    dep, _, _ = deployment
    cards = _cards(dep)
    assert cards["trio"] == cards["native"]
    assert {name: cards["trio"][name]["model_type"] for name in VALUES.values()} == {
        VALUES[value]: kind for value, kind in MODEL_TYPES.items()
    }


def test_the_frontend_lists_the_same_models(deployment):
    _, _, ports = deployment
    listed = {}
    for side, port in ports.items():
        status, body = local.get_json(port, "/v1/models")
        assert status == 200, body
        listed[side] = sorted((m["id"], m.get("object"), m.get("owned_by")) for m in body["data"])
    assert listed["trio"] == listed["native"]


def _post(port: int, path: str, payload: dict, timeout: float = 60.0) -> tuple[int, object] | None:
    """(status, body), or None when nothing came back within ``timeout``."""
    try:
        status, body = local.post_json(port, path, payload, timeout=timeout)
    except TimeoutError:
        return None
    if isinstance(body, dict):
        body = {k: v for k, v in body.items() if k not in ("id", "created")}
    return status, body


REQUESTS = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}),
    ("/v1/completions", {"prompt": "hello", "max_tokens": 3}),
    ("/v1/embeddings", {"input": "hello world"}),
]


@pytest.mark.parametrize("value", [v for v in VALUES if v != "embeddings"])
@pytest.mark.parametrize(("path", "payload"), REQUESTS, ids=["chat", "completions", "embeddings"])
def test_requests_get_the_same_answer_as_from_the_native_sidecar(deployment, value, path, payload):
    dep, mocks, ports = deployment
    before = len(mocks[value].recorded())
    answers = {side: _post(port, path, {"model": VALUES[value], **payload}) for side, port in ports.items()}
    assert answers["trio"] == answers["native"]
    status, body = answers["trio"]
    kinds = value.split(",")
    served = (path == "/v1/chat/completions" and "chat" in kinds) or (
        path == "/v1/completions" and "completions" in kinds
    )
    assert status == (200 if served else 404), body
    # Only generation reaches vLLM (one GenerateStream per side); an embeddings request never does.
    assert len(mocks[value].recorded()) - before == (2 if served else 0)


def test_an_embeddings_only_worker_refuses_embeddings_at_once_where_native_never_answers(deployment):
    dep, mocks, ports = deployment
    payload = {"model": VALUES["embeddings"], "input": "hello world"}
    before = len(mocks["embeddings"].recorded())
    status, body = _post(ports["trio"], "/v1/embeddings", payload)
    assert status == 400 and EMBEDDINGS_UNSUPPORTED in body["message"], body
    assert _post(ports["native"], "/v1/embeddings", payload, timeout=3.0) is None
    native_log = next(p for p in dep.processes if p.name == "native-tiny-e").log()
    assert "Failed deserializing msgpack request payload" in native_log
    assert len(mocks["embeddings"].recorded()) == before  # nothing was forwarded to vLLM by either
    # Chat and completions are not registered: the frontend answers 404 for both sides alike.
    for path, request in REQUESTS[:2]:
        answers = {side: _post(port, path, {"model": VALUES["embeddings"], **request}) for side, port in ports.items()}
        assert answers["trio"] == answers["native"] and answers["trio"][0] == 404
