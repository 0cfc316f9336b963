"""The prober drives Dynamo registration (docs/reference/worker.md#out-of-rotation-while-vllm-is-not-serving, docs/reference/sidecar.md#recovery).

* vLLM not serving for ``--unserving-grace-secs`` → ``unregister_endpoint_instance()`` (the model leaves
  ``/v1/models``); SERVING again → ``register_endpoint_instance()`` and requests flow again.
* A restarted vLLM (the mock restarted on the same gRPC port) comes back with new KV-event ports → the
  KV publishers are re-created, not fatal.
* A restarted vLLM with another identity → fatal: exit 1 with the typed error.

Tests run in order and share one deployment (each leaves the worker serving, except the last).
"""

from __future__ import annotations

import time

import pytest
from dynamo_harness import FAST_ENGINE_ARGS, MockThread, free_system_port

from trio_sidecar._devtools import local

pytestmark = pytest.mark.dynamo

GRACE = 1.0
SERVING, NOT_SERVING = 1, 2  # grpc.health.v1 ServingStatus


@pytest.fixture(scope="module")
def rec(deployment_factory):
    dep = deployment_factory()
    holder = {"mock": dep.mock(served_model_name="tiny", engine_args=FAST_ENGINE_ARGS)}
    dep.frontend()
    system_port = free_system_port()
    proc = dep.trio_sidecar(
        holder["mock"],
        "--unserving-grace-secs",
        str(int(GRACE)),
        "--grpc-retry-interval-secs",
        "1",
        "--grpc-connect-attempt-timeout-secs",
        "2",
        env={"DYN_SYSTEM_PORT": str(system_port)},
    )
    dep.wait_ready("tiny")
    dep.system_port = system_port
    return dep, holder, proc


def _system_health(dep, expected: str | None = None, timeout: float = 10.0) -> str:
    """``/health`` of the sidecar's system server; with ``expected``, poll until it says so (or time out)."""
    deadline = time.monotonic() + timeout
    while True:
        status, body = local.get_json(dep.system_port, "/health")
        if expected is None or body["status"] == expected or time.monotonic() > deadline:
            return body["status"]
        time.sleep(0.05)


def _complete(dep) -> tuple[int, object]:
    return local.post_json(dep.http_port, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})


def _log(proc) -> str:
    """The process log with whitespace collapsed (the rich log handler wraps long lines)."""
    return " ".join(proc.log().split())


def _wait_log(proc, text: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in _log(proc):
        assert time.monotonic() < deadline, f"{text!r} not logged:\n{proc.log()[-3000:]}"
        assert proc.alive(), proc.log()[-3000:]
        time.sleep(0.05)


def _restart_mock(dep, holder, **config) -> MockThread:
    old = holder["mock"]
    address = old.address
    dep.mocks.remove(old)
    old.stop()
    new = dep.mock(listen=address, engine_args=FAST_ENGINE_ARGS, **config)
    holder["mock"] = new
    return new


def test_not_serving_takes_the_instance_out_of_rotation_and_recovery_puts_it_back(rec):
    dep, holder, proc = rec
    mock = holder["mock"]
    assert _complete(dep)[0] == 200
    assert _system_health(dep) == "ready"  # DYN_SYSTEM_PORT's /health, like the native sidecar
    start = time.monotonic()
    mock.call(mock.mock.set_serving_status, None, NOT_SERVING)
    gone = local.wait_for_no_model(dep.http_port, "tiny", timeout=30)
    assert gone is not None, proc.log()[-3000:]
    assert time.monotonic() - start >= GRACE * 0.9  # not before the grace period
    _wait_log(proc, "taking the instance out of rotation")
    assert proc.alive()
    assert _system_health(dep, "notready") == "notready"

    mock.call(mock.mock.set_serving_status, None, SERVING)
    local.wait_for_models(dep.http_port, ["tiny"], timeout=30, watch=[proc])
    _wait_log(proc, "the instance is back in rotation")
    status, body = _complete(dep)
    assert status == 200, body
    assert _system_health(dep, "ready") == "ready"


def test_a_short_outage_within_the_grace_keeps_the_instance_registered(rec):
    dep, holder, proc = rec
    mock = holder["mock"]
    unregistered_before = _log(proc).count("taking the instance out of rotation")
    mock.call(mock.mock.set_serving_status, None, NOT_SERVING)
    time.sleep(GRACE / 4)
    mock.call(mock.mock.set_serving_status, None, SERVING)
    deadline = time.monotonic() + GRACE * 3
    while time.monotonic() < deadline:
        assert "tiny" in local.list_models(dep.http_port)
        time.sleep(0.05)
    assert _log(proc).count("taking the instance out of rotation") == unregistered_before


def test_a_restarted_vllm_on_new_kv_ports_gets_new_publishers(rec):
    dep, holder, proc = rec
    old_kv = holder["mock"].call(lambda: holder["mock"].mock.kv_event_endpoints)
    new = _restart_mock(dep, holder, served_model_name="tiny")
    assert new.call(lambda: new.mock.kv_event_endpoints) != old_kv
    _wait_log(proc, "re-creating the KV publishers", timeout=60)
    local.wait_for_models(dep.http_port, ["tiny"], timeout=60, watch=[proc])
    deadline = time.monotonic() + 30
    while True:
        status, body = _complete(dep)
        if status == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert status == 200, body
    assert proc.alive()


def test_a_changed_identity_after_recovery_is_fatal_exit_1(rec):
    dep, holder, proc = rec
    _restart_mock(dep, holder, served_model_name="another-model")
    code = proc.wait(60)
    assert code == 1, proc.log()[-3000:]
    assert "error: invalid vLLM gRPC response: model identity changed after vLLM recovery" in _log(proc)
    assert local.wait_for_no_model(dep.http_port, "tiny", timeout=15) is not None
