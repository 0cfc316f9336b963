"""Native 1.6.1's RL controls through Dynamo, pinned as the reference trio-sidecar follows (docs/dynamo.md#rl-controls).

``python -m dynamo.vllm.sidecar --enable-rl`` in front of the mock with sleep mode, a weight-transfer backend
and draft weight updates enabled; a frontend with ``DYN_ENABLE_RL=true`` lists the worker on its RL discovery
port, and the worker's system port serves the ``/engine/control/*`` and ``/engine/update/*`` routes. Each
route's Control calls are read from the mock's recorder. Runs against the native sidecar only: it is what an
RL-capable ``trio-sidecar run`` must reproduce.
"""

from __future__ import annotations

import pytest
from dynamo_harness import FAST_ENGINE_ARGS, free_system_port

from trio_sidecar._devtools import local
from trio_sidecar._proto.vllm import control_pb2

pytestmark = pytest.mark.dynamo

RL_ARGS = {"enable_sleep_mode": True, "weight_transfer_backend": "nccl", "enable_draft_weight_updates": True}
ROUTES = [
    "control/get_weight_version",
    "control/is_paused",
    "control/is_sleeping",
    "control/pause_generation",
    "control/resume_generation",
    "control/sleep",
    "control/wake_up",
    "update/finish_weight_update",
    "update/init_weight_transfer_engine",
    "update/model_taints",
    "update/start_draft_weight_update",
    "update/start_weight_update",
    "update/update_weight_version",
    "update/update_weights",
]


@pytest.fixture(scope="module")
def native(deployment_factory):
    dep = deployment_factory()
    mock = dep.mock(served_model_name="tiny", engine_args={**FAST_ENGINE_ARGS, **RL_ARGS})
    rl_port = local.free_port()
    # RL discovery lists the namespace of DYN_NAMESPACE (not --namespace) on its own port.
    dep.frontend(env_overrides={"DYN_ENABLE_RL": "true", "DYN_RL_PORT": str(rl_port), "DYN_NAMESPACE": dep.namespace})
    system_port = free_system_port()
    admin_url = f"http://{local.LOOPBACK}:{local.free_port()}"  # nothing listens: native never called it
    dep.native_sidecar(
        mock,
        "--enable-rl",
        "--vllm-http-endpoint",
        admin_url,
        "--vllm-rl-world-size",
        "1",
        env={"DYN_SYSTEM_PORT": str(system_port)},
    )
    dep.wait_ready("tiny")
    return dep, mock, rl_port, system_port, admin_url


def _route(port: int, route: str, payload: dict) -> tuple[int, object]:
    return local.post_json(port, f"/engine/{route}", payload, timeout=30)


def _calls_during(mock, action) -> tuple[object, list[tuple[str, str]]]:
    """Run ``action()`` and return its result with the Control calls it made as ``(rpc, text of request)``."""
    start = mock.call(lambda: len(mock.mock.control_calls))
    result = action()
    made = mock.call(lambda: list(mock.mock.control_calls[start:]))
    return result, [(rpc, " ".join(str(request).split())) for rpc, request in made]


def test_native_reference_rl_worker_discovery(native):
    dep, _, rl_port, system_port, admin_url = native
    status, body = local.get_json(rl_port, "/v1/rl/workers")
    assert status == 200 and (body["protocol_version"], body["namespace"]) == (1, dep.namespace)
    [worker] = body["workers"]
    assert (worker["component"], worker["endpoint"], worker["model"], worker["world_size"]) == (
        "backend",
        "rl",
        "tiny",
        1,
    )
    assert worker["request_plane_url"] == f"dyn://{dep.namespace}.backend.rl"
    assert (worker["system_url"], worker["admin_base_url"]) == (
        f"http://{local.LOOPBACK}:{system_port}",
        admin_url + "/",
    )
    assert worker["routes"] == ROUTES
    assert local.get_json(dep.http_port, "/v1/rl/workers")[0] == 404  # not on the main HTTP port


def test_native_reference_pause_and_resume(native):
    _, mock, _, system_port, _ = native
    assert _calls_during(mock, lambda: _route(system_port, "control/pause_generation", {"mode": "keep"})) == (
        (200, {"status": "paused"}),
        [("PauseGeneration", "mode: PAUSE_MODE_KEEP")],
    )
    assert _calls_during(mock, lambda: _route(system_port, "control/is_paused", {})) == (
        (200, {"is_paused": True}),
        [("IsPaused", "")],
    )
    assert _route(system_port, "control/is_sleeping", {}) == (200, {"is_sleeping": True})
    assert _route(system_port, "control/pause_generation", {"mode": "bogus"}) == (
        200,
        {
            "status": "error",
            "message": "InvalidRequest: pause_generation mode must be abort, wait, or keep; got `bogus`",
        },
    )
    assert _calls_during(mock, lambda: _route(system_port, "control/resume_generation", {})) == (
        (200, {"status": "resumed"}),
        [("ResumeGeneration", ""), ("IsSleeping", "")],
    )
    assert _route(system_port, "control/is_paused", {}) == (200, {"is_paused": False})
    assert mock.call(lambda: mock.mock.rl.paused) is False


def test_native_reference_sleep_and_wake_up(native):
    _, mock, _, system_port, _ = native
    assert _calls_during(mock, lambda: _route(system_port, "control/sleep", {"level": 2})) == (
        (200, {"status": "sleeping"}),
        [("Sleep", "level: 2 mode: PAUSE_MODE_ABORT")],
    )
    assert _route(system_port, "control/sleep", {"level": 3}) == (
        200,
        {"status": "error", "message": "InvalidRequest: `level` must be one of 0, 1, or 2"},
    )
    assert _calls_during(mock, lambda: _route(system_port, "control/wake_up", {"tags": ["weights"]})) == (
        (200, {"status": "partially_awake", "is_sleeping": True}),
        [("WakeUp", 'tags: "weights"'), ("IsSleeping", "")],
    )
    assert _calls_during(mock, lambda: _route(system_port, "control/wake_up", {})) == (
        (200, {"status": "awake"}),
        [("WakeUp", ""), ("IsSleeping", "")],
    )
    assert _calls_during(mock, lambda: _route(system_port, "control/sleep", {})) == (
        (200, {"status": "sleeping"}),
        [("Sleep", "mode: PAUSE_MODE_ABORT")],
    )  # level left unset
    assert _route(system_port, "control/wake_up", {"tags": ["kv_cache", "weights", "scheduling"]}) == (
        200,
        {"status": "awake"},
    )
    assert _route(system_port, "control/is_sleeping", {}) == (200, {"is_sleeping": False})


def test_native_reference_weight_update_and_version(native):
    _, mock, _, system_port, _ = native
    assert _calls_during(
        mock, lambda: _route(system_port, "update/init_weight_transfer_engine", {"init_info": {"master_port": 1}})
    ) == (
        (200, {"message": "Weight transfer initialized"}),
        [("InitWeightTransferEngine", 'init_info_json: "{\\"master_port\\":1}"')],
    )
    assert _route(system_port, "update/start_weight_update", {}) == (200, {"message": "Weight update started"})
    assert _calls_during(mock, lambda: _route(system_port, "update/start_weight_update", {})) == (
        (
            500,
            {
                "error": "Handler error",
                "message": "InvalidRequest: StartWeightUpdate: a weight update is already "
                "in progress (FailedPrecondition)",
            },
        ),
        [("StartWeightUpdate", "")],
    )
    assert _route(system_port, "update/update_weights", {"update_info": {"names": ["w"]}}) == (
        200,
        {"message": "Weights updated"},
    )
    assert _route(system_port, "update/update_weights", {}) == (
        500,
        {"error": "Handler error", "message": "InvalidRequest: missing `update_info` JSON object"},
    )
    assert _calls_during(
        mock, lambda: _route(system_port, "update/finish_weight_update", {"weight_version": "step-1"})
    ) == ((200, {"message": "Weight update finished"}), [("FinishWeightUpdate", 'weight_version: "step-1"')])
    assert _route(system_port, "control/get_weight_version", {}) == (200, {"weight_version": "step-1"})
    assert _calls_during(
        mock, lambda: _route(system_port, "update/update_weight_version", {"new_version": "step-2"})
    ) == ((200, {"success": True, "new_version": "step-2"}), [("UpdateWeightVersion", 'weight_version: "step-2"')])
    assert _route(system_port, "update/update_weight_version", {"new_version": ""}) == (
        500,
        {"error": "Handler error", "message": "InvalidRequest: missing non-empty `new_version` string"},
    )
    assert mock.call(lambda: mock.mock.rl.weight_version) == "step-2"
    assert isinstance(mock.call(lambda: mock.mock.control_calls[-1][1]), control_pb2.UpdateWeightVersionRequest)
