"""``trio-sidecar run`` with ``DYN_LORA_ENABLED``: the adapters it loaded come back after vLLM restarts
(docs/lora.md#reconciliation), a deliberate difference from the native 1.6.1 sidecar (which was observed not
to reload them, docs/dynamo.md).

The mock is stopped and started again on the same gRPC port; the health prober's recovery triggers the
reconciliation: ``ListLoras``, ``LoadLora`` again for each adapter loaded through the sidecar, and the
discovery records follow what vLLM then holds (an adapter that could not be loaded again leaves
``/v1/models``).
"""

from __future__ import annotations

import json
import time

import pytest
from dynamo_harness import FAST_ENGINE_ARGS, free_system_port, system_request

from trio_sidecar._devtools import local
from trio_sidecar.core.status import StatusCode
from trio_sidecar.mock.generation import RequestRejected

pytestmark = pytest.mark.dynamo


def _wait(predicate, what: str, proc, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what}\n{proc.log()[-3000:]}"
        assert proc.alive(), proc.log()[-3000:]
        time.sleep(0.1)


def refuse_to_load(table, name: str) -> None:
    """Fault injection: the mock's adapter table refuses ``name`` as vLLM refuses a local path that is gone."""
    load = table.load

    def load_unless_gone(lora_name: str, source_path: str):
        if lora_name == name:
            raise RequestRejected(StatusCode.INVALID_ARGUMENT, "Local LoRA adapter path must exist and be accessible.")
        return load(lora_name, source_path)

    table.load = load_unless_gone


def test_adapters_are_loaded_again_after_a_vllm_restart_and_discovery_follows(deployment_factory, tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    dep = deployment_factory()
    mock = dep.mock(served_model_name="tiny", engine_args={**FAST_ENGINE_ARGS, "max_loras": 2})
    dep.frontend()
    port = free_system_port()
    proc = dep.trio_sidecar(
        mock,
        "--grpc-retry-interval-secs",
        "1",
        "--grpc-connect-attempt-timeout-secs",
        "2",
        env={"DYN_SYSTEM_PORT": str(port), "DYN_LORA_ENABLED": "true"},
    )
    dep.wait_ready("tiny")
    for name in ("a", "b"):
        assert (
            system_request(port, "POST", "/v1/loras", {"lora_name": name, "source": {"uri": f"file://{adapter}"}})[0]
            == 200
        )
    _wait(lambda: {"a", "b"} <= set(local.list_models(dep.http_port)), "adapters never listed", proc)

    # vLLM restarts and can load `a` again but not `b` (its files are gone): `b` leaves discovery.
    address = mock.address
    dep.mocks.remove(mock)
    mock.stop()
    new = dep.mock(listen=address, served_model_name="tiny", engine_args={**FAST_ENGINE_ARGS, "max_loras": 2})
    new.call(refuse_to_load, new.mock.lora, "b")
    _wait(lambda: new.call(lambda: [a.lora_name for a in new.mock.lora]) == ["a"], "`a` not loaded again", proc)
    calls = new.call(lambda: [(n, getattr(r, "lora_name", None)) for n, r in new.mock.control_calls])
    assert [c for c in calls if c[0] in ("ListLoras", "LoadLora")][:3] == [
        ("ListLoras", None),
        ("LoadLora", "a"),
        ("LoadLora", "b"),
    ]
    _wait(lambda: "b" not in local.list_models(dep.http_port), "`b` still listed", proc)
    assert "a" in local.list_models(dep.http_port)
    deadline = time.monotonic() + 30
    while True:
        status, body = local.post_json(
            dep.http_port, "/v1/completions", {"model": "a", "prompt": [5, 6], "max_tokens": 2}
        )
        if status == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert (status, body.get("model")) == (200, "a"), body
    rpc, request, _, _ = new.recorded()[-1]
    assert (rpc, request.lora_name, request.model) == ("GenerateStream", "a", "tiny")
    assert system_request(port, "GET", "/v1/loras") == (200, {"status": "success", "loras": {"a": 1}, "count": 1})
    assert "LoRA 'b' was not loaded again after the vLLM restart" in " ".join(proc.log().split())
