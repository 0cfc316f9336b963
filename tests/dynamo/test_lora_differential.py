"""Issue 24, LoRA: ``trio-sidecar run`` against the native 1.6.1 sidecar, route by route (docs/lora.md).

Each side has its own mock (``max_loras`` 2, so the adapter tables do not mix), its own frontend
(``--namespace``) and its own system port, with ``DYN_LORA_ENABLED=true``. Every step sends the same request
to both system ports and compares the HTTP status, the answer and the Control calls the side's mock
recorded for it. The reference behaviour alone is pinned by ``test_native_lora_reference.py``.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
from dynamo_harness import FAST_ENGINE_ARGS, free_system_port

from trio_sidecar._devtools import local

pytestmark = pytest.mark.dynamo

MAX_LORAS = 2
SIDES = ("native", "trio")


class _Side:
    def __init__(self, mock, system_port: int, http_port: int, namespace: str, file_kv: Path) -> None:
        self.mock = mock
        self.system_port = system_port
        self.http_port = http_port
        self.namespace = namespace
        self.file_kv = file_kv

    def adapter_card(self, name: str) -> dict:
        """The model card this side published for adapter ``name`` (``v1/mdc/{ns}/backend/generate/{hex}/{name}``),
        without what legitimately differs: the card's instance and the native-only parts of ``runtime_config``
        (docs/lora.md#discovery)."""
        for path in (self.file_kv / "v1" / "mdc").glob("*"):
            key = urllib.parse.unquote(path.name)
            if key.startswith(f"{self.namespace}/") and key.endswith(f"/{name}"):
                record = json.loads(path.read_text())
                runtime = record["card_json"]["runtime_config"]
                runtime["runtime_data"].pop("vllm_inference_v1_generate", None)
                for ignored in ("kv_event_publishing_enabled", "max_gpu_lora_count"):
                    runtime.pop(ignored, None)
                del record["namespace"], record["instance_id"]
                return record
        raise AssertionError(f"no card for adapter {name!r} in {self.namespace}")

    def calls(self) -> int:
        return self.mock.call(lambda: len(self.mock.mock.control_calls))

    def calls_since(self, start: int) -> list[tuple[str, Any]]:
        return self.mock.call(lambda: list(self.mock.mock.control_calls[start:]))


def _request(port: int, method: str, path: str, body: str | None) -> tuple[int, object]:
    conn = http.client.HTTPConnection(local.LOOPBACK, port, timeout=30)
    try:
        headers = {"content-type": "application/json"} if body is not None else {}
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        raw = resp.read().decode()
        try:
            return resp.status, json.loads(raw)
        except ValueError:
            return resp.status, raw
    finally:
        conn.close()


def _call_view(name: str, request: Any) -> tuple[str, ...]:
    if name == "LoadLora":
        return (name, request.lora_name, request.source_path)
    if name == "UnloadLora":
        return (name, request.lora_name)
    return (name,)


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("adapter")
    (directory / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    (directory / "adapter_model.safetensors").write_bytes(b"")
    return directory


@pytest.fixture(scope="module")
def sides(deployment_factory) -> dict[str, _Side]:
    dep = deployment_factory()
    out: dict[str, _Side] = {}
    for side in SIDES:
        mock = dep.mock(served_model_name="tiny", engine_args={**FAST_ENGINE_ARGS, "max_loras": MAX_LORAS})
        namespace = f"{dep.namespace}-{side}"
        dep.frontend(namespace=namespace)
        system_port = free_system_port()
        env = {"DYN_SYSTEM_PORT": str(system_port), "DYN_LORA_ENABLED": "true"}
        start = dep.native_sidecar if side == "native" else dep.trio_sidecar
        start(mock, namespace=namespace, name=f"{side}-lora", env=env)
        out[side] = _Side(mock, system_port, dep.http_port, namespace, dep.file_kv)
    for side in SIDES:
        local.wait_for_models(out[side].http_port, ["tiny"], timeout=180, watch=dep.processes)
    return out


def _both(sides: dict[str, _Side], method: str, path: str, body: object = None) -> dict[str, tuple]:
    text = None if body is None else body if isinstance(body, str) else json.dumps(body)
    out = {}
    for side in SIDES:
        s = sides[side]
        start = s.calls()
        status, answer = _request(s.system_port, method, path, text)
        out[side] = (status, answer, [_call_view(name, req) for name, req in s.calls_since(start)])
    return out


def _same(sides, method, path, body=None) -> tuple:
    got = _both(sides, method, path, body)
    assert got["trio"] == got["native"], f"{method} {path} {body!r}"
    return got["trio"]


def _load(name: str, uri: str) -> dict:
    return {"lora_name": name, "source": {"uri": uri}}


def test_start_up_control_calls_end_with_list_loras_like_native(sides):
    views = {side: [name for name, _ in sides[side].calls_since(0) if name != "Abort"][:6] for side in SIDES}
    assert views["trio"] == views["native"]
    assert views["trio"][-1] == "ListLoras"


def test_each_lora_route_answers_and_calls_like_native(sides, adapter, tmp_path):
    uri = f"file://{adapter}"
    assert _same(sides, "GET", "/v1/loras") == (200, {"status": "success", "loras": {}, "count": 0}, [("ListLoras",)])
    status, body, calls = _same(sides, "POST", "/v1/loras", _load("a", uri))
    assert (status, body["message"]) == (200, "LoRA adapter 'a' loaded successfully")
    assert calls == [("ListLoras",), ("LoadLora", "a", str(adapter))]
    assert _same(sides, "POST", "/v1/loras", _load("a", f"file://{tmp_path}"))[1]["message"] == (
        "LoRA adapter 'a' already loaded"
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    refusals = [
        _load("tiny", uri),
        _load("", uri),
        _load("x", "file://relative/x"),
        _load("x", str(adapter)),
        _load("x", f"file://{tmp_path}/nope"),
        _load("x", f"file://{empty}"),
        {"lora_name": "x"},
        {"lora_name": "x", "source": {}},
    ]
    for body in refusals:
        status, answer, _ = _same(sides, "POST", "/v1/loras", body)
        assert status in (422, 500), (body, answer)
    assert _same(sides, "DELETE", "/v1/loras/zz")[0] == 500
    assert _same(sides, "POST", "/v1/loras", _load("b", uri))[0] == 200
    status, body, calls = _same(sides, "POST", "/v1/loras", _load("c", uri))
    assert status == 500 and "capacity exceeded" in body["message"] and calls == [("ListLoras",)]
    # The same handlers as engine updates: 200 with the JSON as is (errors included), plus "hot_swap".
    assert _same(sides, "POST", "/engine/update/list_loras", {})[1]["count"] == 2
    assert _same(sides, "POST", "/engine/update/load_lora", _load("a", uri))[1]["hot_swap"] is False
    assert _same(sides, "POST", "/engine/update/load_lora", _load("c", uri))[0] == 200
    assert _same(sides, "POST", "/engine/update/load_lora", {"lora_name": "c", "lora_path": str(adapter)})[0] == 200
    status, body, calls = _same(sides, "POST", "/engine/update/unload_lora", {"lora_name": "b"})
    assert (status, calls) == (200, [("ListLoras",), ("UnloadLora", "b")])
    status, body, calls = _same(sides, "DELETE", "/v1/loras/a")
    assert (status, body["lora_id"], calls) == (200, 1, [("ListLoras",), ("UnloadLora", "a")])


def _wait_model(port: int, name: str, present: bool, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while (name in local.list_models(port)) != present:
        assert time.monotonic() < deadline, f"model {name!r} {'never listed' if present else 'still listed'}"
        time.sleep(0.05)


def test_a_loaded_adapter_is_a_model_and_its_requests_carry_lora_name_like_native(sides, adapter):
    assert _same(sides, "POST", "/v1/loras", _load("d", f"file://{adapter}"))[0] == 200
    completions = {}
    for side in SIDES:
        s = sides[side]
        _wait_model(s.http_port, "d", present=True)
        status, body = local.post_json(
            s.http_port, "/v1/completions", {"model": "d", "prompt": [5, 6, 7], "max_tokens": 3}
        )
        completions[side] = (status, body.get("model"), body.get("usage", {}).get("completion_tokens"))
        rpc, request, _, _ = s.mock.recorded()[-1]
        assert (rpc, request.lora_name, request.model) == ("GenerateStream", "d", "tiny"), side
    assert completions["trio"] == completions["native"] == (200, "d", 3)
    card = sides["trio"].adapter_card("d")
    assert card == sides["native"].adapter_card("d")
    assert card["card_json"]["lora"] == {"name": "d", "max_gpu_lora_count": MAX_LORAS}
    assert card["model_suffix"] == "d"
    assert _same(sides, "DELETE", "/v1/loras/d")[0] == 200
    for side in SIDES:
        s = sides[side]
        _wait_model(s.http_port, "d", present=False)
        assert local.post_json(s.http_port, "/v1/completions", {"model": "d", "prompt": [5], "max_tokens": 1}) == (
            404,
            {"message": "Model not found", "type": "Not Found", "code": 404},
        )


def test_hot_swap_no_lora_support_and_lora_off_answer_like_native(deployment_factory, adapter):
    """``DYN_LORA_HOTSWAP_ENABLED`` refuses a reload; a server with ``max_loras`` 0 gets no LoRA handlers;
    without ``DYN_LORA_ENABLED`` the system port has no LoRA routes at all."""
    dep = deployment_factory()
    ports: dict[tuple[str, str], int] = {}
    for side in SIDES:
        start = dep.native_sidecar if side == "native" else dep.trio_sidecar
        mocks = {  # one adapter table per side; the server without LoRA is only read
            "lora": dep.mock(served_model_name="tiny", engine_args={**FAST_ENGINE_ARGS, "max_loras": MAX_LORAS}),
            "none": dep.mock(served_model_name="tiny", engine_args=FAST_ENGINE_ARGS),
        }
        mocks["off"] = mocks["lora"]  # a second worker on the LoRA server, started without DYN_LORA_ENABLED
        for kind, mock in mocks.items():
            port = free_system_port()
            env = {"DYN_SYSTEM_PORT": str(port), "DYN_LORA_HOTSWAP_ENABLED": "true"}
            if kind != "off":
                env["DYN_LORA_ENABLED"] = "true"
            start(mock, namespace=f"{dep.namespace}-{side}-{kind}", name=f"{side}-{kind}", env=env)
            ports[side, kind] = port
    deadline = time.monotonic() + 120
    for port in ports.values():
        while True:
            try:
                if local.get_json(port, "/health")[1].get("status") == "ready":
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"system port {port} never ready"
            time.sleep(0.2)
    uri = f"file://{adapter}"
    got: dict[str, list] = {side: [] for side in SIDES}
    for side in SIDES:
        lora, none = ports[side, "lora"], ports[side, "none"]
        body = json.dumps(_load("h", uri))
        got[side].append(_request(lora, "POST", "/v1/loras", body))
        got[side].append(_request(lora, "POST", "/v1/loras", body))
        got[side].append(_request(lora, "DELETE", "/v1/loras/h", None))
        got[side].append(_request(none, "GET", "/v1/loras", None))
        got[side].append(_request(none, "POST", "/v1/loras", body))
        got[side].append(_request(none, "DELETE", "/v1/loras/h", None))
        got[side].append(_request(ports[side, "off"], "GET", "/v1/loras", None))
    assert got["trio"] == got["native"]
    assert got["trio"][1][0] == 500 and "hot swap is not supported" in got["trio"][1][1]["message"]
    assert got["trio"][3][0] == 500 and "LoRA management not available" in got["trio"][3][1]["message"]
    assert got["trio"][6][0] == 404
