"""Native 1.6.1's LoRA lifecycle through Dynamo, pinned as the reference trio-sidecar follows (docs/dynamo.md#lora-and-rl-controls-in-the-native-161-sidecar-as-observed).

``python -m dynamo.vllm.sidecar`` with ``DYN_LORA_ENABLED=true`` in front of the mock with ``max_loras`` 2:
adapters are loaded and unloaded on the sidecar's system port (``/v1/loras``), a loaded adapter is served by
the frontend as its own model, and each route makes the Control calls the mock records. This runs against
the native sidecar only: it is what a LoRA-capable ``trio-sidecar run`` must reproduce.
"""

from __future__ import annotations

import json
import time

import pytest
from dynamo_harness import FAST_ENGINE_ARGS, free_system_port, system_request

from trio_sidecar._devtools import local

pytestmark = pytest.mark.dynamo

MAX_LORAS = 2


@pytest.fixture(scope="module")
def native(deployment_factory, tmp_path_factory):
    dep = deployment_factory()
    mock = dep.mock(served_model_name="tiny", engine_args={**FAST_ENGINE_ARGS, "max_loras": MAX_LORAS})
    dep.frontend()
    system_port = free_system_port()
    dep.native_sidecar(mock, env={"DYN_SYSTEM_PORT": str(system_port), "DYN_LORA_ENABLED": "true"})
    dep.wait_ready("tiny")
    adapter = tmp_path_factory.mktemp("adapter")
    # The sidecar only checks that the directory holds a config and weights; the mock never reads them.
    (adapter / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"]})
    )
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    return dep, mock, system_port, adapter


class _Calls:
    """The Control calls the mock records from now on, as ``(rpc, request)``."""

    def __init__(self, mock) -> None:
        self.mock = mock
        self.start = mock.call(lambda: len(mock.mock.control_calls))

    def new(self) -> list[tuple[str, object]]:
        return self.mock.call(lambda: list(self.mock.mock.control_calls[self.start :]))


def _load_body(name: str, adapter) -> dict:
    return {"lora_name": name, "source": {"uri": f"file://{adapter}"}}


def _wait_model(port: int, name: str, present: bool, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while (name in local.list_models(port)) != present:
        assert time.monotonic() < deadline, f"model {name!r} {'never listed' if present else 'still listed'}"
        time.sleep(0.05)


def test_native_reference_lora_load_generate_with_the_adapter_unload(native):
    dep, mock, system_port, adapter = native
    calls = _Calls(mock)
    assert system_request(system_port, "GET", "/v1/loras") == (200, {"status": "success", "loras": {}, "count": 0})
    assert [name for name, _ in calls.new()] == ["ListLoras"]

    calls = _Calls(mock)
    status, body = system_request(system_port, "POST", "/v1/loras", _load_body("a", adapter))
    assert (status, body) == (
        200,
        {"status": "success", "message": "LoRA adapter 'a' loaded successfully", "lora_name": "a", "lora_id": 1},
    )
    made = calls.new()
    assert [name for name, _ in made] == ["ListLoras", "LoadLora"]
    assert (made[1][1].lora_name, made[1][1].source_path) == ("a", str(adapter))
    assert system_request(system_port, "GET", "/v1/loras") == (
        200,
        {"status": "success", "loras": {"a": 1}, "count": 1},
    )

    # The adapter is a model of its own on the frontend; its requests reach vLLM with lora_name set.
    _wait_model(dep.http_port, "a", present=True)
    status, completion = local.post_json(
        dep.http_port, "/v1/completions", {"model": "a", "prompt": [5, 6, 7], "max_tokens": 3}
    )
    assert status == 200 and completion["model"] == "a"
    assert completion["usage"]["completion_tokens"] == 3
    rpc, request, _, _ = mock.recorded()[-1]
    assert (rpc, request.lora_name, request.model) == ("GenerateStream", "a", "tiny")

    calls = _Calls(mock)
    status, body = system_request(system_port, "DELETE", "/v1/loras/a")
    assert (status, body) == (
        200,
        {"status": "success", "message": "LoRA adapter 'a' unloaded successfully", "lora_name": "a", "lora_id": 1},
    )
    made = calls.new()
    assert [name for name, _ in made] == ["ListLoras", "UnloadLora"] and made[1][1].lora_name == "a"
    _wait_model(dep.http_port, "a", present=False)
    assert local.post_json(dep.http_port, "/v1/completions", {"model": "a", "prompt": [5, 6, 7], "max_tokens": 3}) == (
        404,
        {"message": "Model not found", "type": "Not Found", "code": 404},
    )


def test_native_reference_lora_errors_are_checked_by_the_sidecar(native):
    _, mock, system_port, adapter = native
    assert system_request(system_port, "POST", "/v1/loras", _load_body("b", adapter))[0] == 200
    try:
        calls = _Calls(mock)
        assert system_request(system_port, "POST", "/v1/loras", _load_body("b", adapter)) == (
            200,
            {"status": "success", "message": "LoRA adapter 'b' already loaded", "lora_name": "b", "lora_id": 2},
        )
        assert system_request(system_port, "POST", "/v1/loras", _load_body("tiny", adapter)) == (
            500,
            {
                "status": "error",
                "lora_name": "tiny",
                "message": "InvalidRequest: LoRA adapter `tiny` conflicts with the base model name or one of its aliases",
            },
        )
        assert system_request(system_port, "DELETE", "/v1/loras/zz") == (
            500,
            {
                "status": "error",
                "lora_name": "zz",
                "message": "InvalidRequest: LoRA adapter 'zz' not found. Available LoRAs: [\"b\"]",
            },
        )
        assert system_request(system_port, "POST", "/v1/loras", _load_body("c", adapter))[0] == 200
        assert system_request(system_port, "POST", "/v1/loras", _load_body("d", adapter)) == (
            500,
            {
                "status": "error",
                "lora_name": "d",
                "message": f"InvalidRequest: LoRA capacity exceeded: at most {MAX_LORAS} adapter(s) may be loaded",
            },
        )
        # Only the successful load reached vLLM's LoadLora; every refusal was decided from ListLoras.
        assert [name for name, _ in calls.new() if name != "ListLoras"] == ["LoadLora"]
    finally:
        for name in ("b", "c"):
            system_request(system_port, "DELETE", f"/v1/loras/{name}")
