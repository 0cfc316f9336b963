"""Issue 24, LoRA: ``trio-sidecar run`` against the native 1.6.1 sidecar, route by route (docs/lora.md).

Each side has its own mock (``max_loras`` 2, so the adapter tables do not mix), its own frontend
(``--namespace``) and its own system port, with ``DYN_LORA_ENABLED=true``. Every step sends the same request
to both system ports and compares the HTTP status, the answer and the Control calls the side's mock
recorded for it. The reference behaviour alone is pinned by ``test_native_lora_reference.py``.

``hf://`` and ``s3://`` sources are downloaded from one loopback fake of the Hugging Face Hub and S3
(``fake_adapter_hub.py``); each side has its own caches, so both download, and the requests each side made
to the fake are compared too.
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
from fake_adapter_hub import ADAPTER_FILES, SHA, FakeAdapterHub

from trio_sidecar._devtools import local

pytestmark = pytest.mark.dynamo

MAX_LORAS = 2
SIDES = ("native", "trio")


class _Side:
    def __init__(self, mock, system_port: int, http_port: int, namespace: str, file_kv: Path, root: Path) -> None:
        self.root = root  # this side's download caches
        self.mock = mock
        self.system_port = system_port
        self.http_port = http_port
        self.namespace = namespace
        self.file_kv = file_kv

    def _record(self, suffix: str | None) -> dict:
        """The discovery record of this side's base model (``suffix`` None) or of an adapter."""
        for path in (self.file_kv / "v1" / "mdc").glob("*"):
            key = urllib.parse.unquote(path.name)
            parts = key.split("/")
            if parts[0] == self.namespace and (parts[4:] == [suffix] if suffix else len(parts) == 4):
                return json.loads(path.read_text())
        raise AssertionError(f"no card for {suffix or 'the base model'} in {self.namespace}")

    def base_lora_capacity(self) -> object:
        """``runtime_config.max_gpu_lora_count`` of the base model's card (the frontend's LoRA slot count)."""
        return self._record(None)["card_json"]["runtime_config"].get("max_gpu_lora_count")

    def adapter_card(self, name: str) -> dict:
        """The model card this side published for adapter ``name`` (``v1/mdc/{ns}/backend/generate/{hex}/{name}``),
        without what legitimately differs: the card's instance and the native-only parts of ``runtime_config``
        (docs/lora.md#discovery)."""
        record = self._record(name)
        runtime = record["card_json"]["runtime_config"]
        runtime.pop("max_gpu_lora_count", None)
        del record["namespace"], record["instance_id"]
        return record

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
def hub() -> Any:
    repos = {"org/adapter": ADAPTER_FILES, "org/not-lora": {"README.md": b"no adapter here"}}
    objects = {f"bucket/adapters/a/{name}": data for name, data in ADAPTER_FILES.items()}
    with FakeAdapterHub(repos, objects).serving() as served:
        yield served


@pytest.fixture(scope="module")
def sides(deployment_factory, hub, tmp_path_factory) -> dict[str, _Side]:
    dep = deployment_factory()
    out: dict[str, _Side] = {}
    for side in SIDES:
        root = tmp_path_factory.mktemp(f"sources-{side}")
        mock = dep.mock(served_model_name="tiny", engine_args={**FAST_ENGINE_ARGS, "max_loras": MAX_LORAS})
        namespace = f"{dep.namespace}-{side}"
        dep.frontend(namespace=namespace)
        system_port = free_system_port()
        env = {"DYN_SYSTEM_PORT": str(system_port), "DYN_LORA_ENABLED": "true", **hub.env(root)}
        start = dep.native_sidecar if side == "native" else dep.trio_sidecar
        start(mock, namespace=namespace, name=f"{side}-lora", env=env)
        out[side] = _Side(mock, system_port, dep.http_port, namespace, dep.file_kv, root)
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
    # The base card carries the LoRA slot count as native's (the frontend seeds its LoRA capacity from it).
    assert sides["trio"].base_lora_capacity() == sides["native"].base_lora_capacity() == MAX_LORAS
    assert "max_gpu_lora_count" not in sides["trio"]._record("d")["card_json"]["runtime_config"]  # see docs/lora.md
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


def test_an_adapter_name_whose_discovery_key_is_taken_is_refused_like_native(sides, adapter):
    """Dynamo keys an adapter's record by the slug of its name (``A.b`` and ``a_b`` give ``a_b``); a second
    adapter with a taken key would overwrite the first one's record, so it is refused, as is a name with an
    empty slug."""
    uri = f"file://{adapter}"
    assert _same(sides, "POST", "/v1/loras", _load("A.b", uri))[0] == 200
    status, body, calls = _same(sides, "POST", "/v1/loras", _load("a_b", uri))
    assert (status, calls) == (500, [("ListLoras",)])
    assert body["message"] == (
        "InvalidRequest: LoRA adapter `a_b` derives the discovery suffix `a_b`, which is already used by loaded "
        "adapter `A.b`; publishing it would overwrite that adapter's discovery record"
    )
    status, body, calls = _same(sides, "POST", "/v1/loras", _load("..", uri))
    assert (status, body["message"]) == (
        500,
        "InvalidRequest: LoRA adapter `..` does not produce a usable discovery suffix",
    )
    assert _same(sides, "POST", "/v1/loras", _load("A.b", uri))[1]["message"] == "LoRA adapter 'A.b' already loaded"
    assert _same(sides, "DELETE", "/v1/loras/A.b")[0] == 200


def _same_sourced(sides, hub, body: dict) -> tuple:
    """``_same`` for a load from a remote source: the side's cache root becomes ``<root>`` in the LoadLora
    call, and the requests each side made to the fake hub must be the same too."""
    got = {}
    for side in SIDES:
        s = sides[side]
        start, fetched = s.calls(), hub.count()
        status, answer = _request(s.system_port, "POST", "/v1/loras", json.dumps(body))
        calls = [
            tuple(part.replace(str(s.root), "<root>") for part in _call_view(name, req))
            for name, req in s.calls_since(start)
        ]
        got[side] = (status, answer, calls, hub.requests_since(fetched))
    assert got["trio"] == got["native"], body
    return got["trio"]


def test_hf_and_s3_sources_are_downloaded_and_refused_like_native(sides, hub):
    status, body, calls, fetched = _same_sourced(sides, hub, _load("h", "hf://org/adapter"))
    assert (status, body["message"]) == (200, "LoRA adapter 'h' loaded successfully")
    assert calls == [("ListLoras",), ("LoadLora", "h", f"<root>/hf/hub/models--org--adapter/snapshots/{SHA}")]
    assert ("GET", "/api/models/org/adapter/revision/main") in fetched
    status, body, calls, fetched = _same_sourced(sides, hub, _load("s", "s3://bucket/adapters/a"))
    assert (status, calls) == (200, [("ListLoras",), ("LoadLora", "s", "<root>/loras/s3__bucket_adapters_a")])
    assert ("GET", "/bucket/adapters/a/adapter_config.json") in fetched
    # Already loaded: nothing is downloaded again.
    assert _same_sourced(sides, hub, _load("h", "hf://org/adapter"))[2:] == ([("ListLoras",)], [])
    assert _same(sides, "DELETE", "/v1/loras/h")[0] == 200
    assert _same(sides, "DELETE", "/v1/loras/s")[0] == 200
    # Loaded again from the caches.
    status, _, calls, fetched = _same_sourced(sides, hub, _load("h", "hf://org/adapter"))
    assert (status, len(calls), fetched) == (200, 2, [])
    assert _same(sides, "DELETE", "/v1/loras/h")[0] == 200
    refusals = {
        "hf://org/missing": "resolving Hugging Face repository org/missing at revision main",
        "hf://org/not-lora": "Hugging Face repository hf://org/not-lora is not a valid LoRA",
        "s3://bucket/adapters/none": "LoRA s3://bucket/adapters/none not found in any source",
    }
    for uri, text in refusals.items():
        status, body, calls, _ = _same_sourced(sides, hub, _load("x", uri))
        # (after a failed load, the next call also starts with a reconciliation ListLoras, on both sides)
        assert status == 500 and set(calls) == {("ListLoras",)}, uri
        assert body["message"].startswith(
            f"Internal: invalid vLLM gRPC response: failed to resolve LoRA source `{uri}`: "
        )
        assert text in body["message"], body


def test_names_and_uris_are_trimmed_and_an_ambiguous_adapter_list_is_refused_like_native(sides, adapter):
    """A load trims ``lora_name`` and ``source.uri``; an unload does not; the scheme check is case-sensitive.
    An adapter list whose names clash through their discovery key (another client loaded ``Z.z`` and ``z_z``
    into vLLM) is refused by a list and a load, not by an unload."""
    uri = f"file://{adapter}"
    status, body, calls = _same(sides, "POST", "/v1/loras", _load(" sp ", f" {uri} "))
    assert (status, body["lora_name"], calls[-1]) == (200, "sp", ("LoadLora", "sp", str(adapter)))
    status, body, calls = _same(sides, "POST", "/v1/loras", _load("   ", uri))
    assert (status, body["message"], calls) == (500, "InvalidRequest: lora_name must be a non-empty string", [])
    assert _same(sides, "POST", "/v1/loras", _load("u", uri.replace("file:", "FILE:")))[0] == 500
    assert _same(sides, "DELETE", "/v1/loras/%20sp%20")[0] == 500
    assert _same(sides, "DELETE", "/v1/loras/sp")[0] == 200
    for side in SIDES:  # behind the sidecars' backs
        mock = sides[side].mock
        for name in ("Z.z", "z_z"):
            mock.call(lambda mock=mock, name=name: mock.mock.lora.load(name, str(adapter)))
    refusal = (
        "Internal: invalid vLLM gRPC response: adapter `z_z` derives the discovery suffix `z_z`, which another "
        "loaded adapter already uses"
    )
    assert _same(sides, "GET", "/v1/loras") == (200, {"status": "error", "message": refusal}, [("ListLoras",)])
    status, body, calls = _same(sides, "POST", "/v1/loras", _load("q", uri))
    assert (status, body["message"], calls) == (500, refusal, [("ListLoras",)])
    status, body, calls = _same(sides, "DELETE", "/v1/loras/z_z")
    assert (status, calls[-1]) == (200, ("UnloadLora", "z_z"))
    assert _same(sides, "GET", "/v1/loras")[1]["loras"].keys() == {"Z.z"}
    assert _same(sides, "DELETE", "/v1/loras/Z.z")[0] == 200


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
