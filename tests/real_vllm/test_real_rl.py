"""RL controls on the real vLLM 0.32 CPU server (docs/rl.md, docs/conformance.md row 8d).

The CPU build answers ``PauseGeneration`` / ``ResumeGeneration`` / ``IsPaused``; it refuses sleep mode at startup and
reports no weight-transfer backend, so its ``rl_capabilities`` are empty and the sleep and weight-transfer calls
are refused (``FAILED_PRECONDITION``). Embedded: the ``Sidecar`` methods. Through Dynamo: the native sidecar and
``trio-sidecar run --enable-rl``, each behind its own frontend with RL discovery, pause and resume the shared
server through their system ports (one after the other; every pause is undone before the step ends).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from dynamo_harness import free_system_port
from real_vllm_server import SERVED_MODEL_NAME

from trio_sidecar import SidecarConfig, WakeState, open_sidecar
from trio_sidecar._devtools import local
from trio_sidecar.core.errors import InvalidArgument
from trio_sidecar.core.rl_requests import RlCapabilities

READY_TIMEOUT_S = 300.0
SIDES = ("native", "trio")


def sidecar_config(server) -> SidecarConfig:
    return SidecarConfig(
        grpc_endpoint=server.endpoint, grpc_connections=2, startup_deadline=120.0, connect_attempt_timeout=10.0
    )


async def test_embedded_pause_and_resume_on_the_cpu_build(real_server):
    with trio.fail_after(120):
        async with open_sidecar(sidecar_config(real_server)) as sidecar:
            assert sidecar.rl_capabilities == RlCapabilities()
            try:
                await sidecar.pause_generation("keep")
                assert await sidecar.is_paused() is True
                assert await sidecar.is_sleeping() is True  # vLLM: a paused engine reports sleeping
            finally:
                resumed = await sidecar.resume_generation()
            assert resumed == WakeState(sleeping=None)  # no sleep mode: IsSleeping is not asked
            assert await sidecar.is_paused() is False
            assert await sidecar.get_weight_version() == "default"


async def test_the_cpu_build_refuses_sleep_and_weight_transfer(real_server):
    with trio.fail_after(120):
        async with open_sidecar(sidecar_config(real_server)) as sidecar:
            with pytest.raises(InvalidArgument) as caught:
                await sidecar.sleep(1)
            assert str(caught.value) == (
                "Sleep: sleep mode is not configured; start vLLM with --enable-sleep-mode (FailedPrecondition)"
            )
            with pytest.raises(InvalidArgument) as caught:
                await sidecar.start_weight_update()
            assert str(caught.value) == (
                "StartWeightUpdate: weight transfer is not configured; start vLLM with --weight-transfer-config "
                "(FailedPrecondition)"
            )
            assert await sidecar.is_paused() is False


@pytest.fixture(scope="module")
def workers(real_server, tmp_path_factory) -> Iterator[dict[str, dict[str, int]]]:
    pytest.importorskip("dynamo.frontend", reason="ai-dynamo 1.6.1 (frontend) is not installed")
    workdir = Path(tmp_path_factory.mktemp("real-rl"))
    (workdir / "file-kv").mkdir()
    env = local.dynamo_env(workdir / "file-kv")
    endpoint = f"{real_server.host}:{real_server.grpc_port}"
    admin = f"http://{real_server.host}:{getattr(real_server, 'http_port', None) or 1}"
    processes: list[local.Process] = []
    ports: dict[str, dict[str, int]] = {}
    try:
        for side in SIDES:
            namespace = f"realrl-{side}"
            rl_port, system_port = local.free_port(), free_system_port()
            frontend_env = {**env, "DYN_ENABLE_RL": "true", "DYN_RL_PORT": str(rl_port), "DYN_NAMESPACE": namespace}
            frontend, http_port = local.start_frontend(workdir, frontend_env, namespace=namespace)
            processes.append(frontend)
            start = local.start_native_sidecar if side == "native" else local.start_trio_sidecar
            worker_env = {**env, "DYN_SYSTEM_PORT": str(system_port)}
            extra = ("--enable-rl", "--vllm-http-endpoint", admin)
            processes.append(start(workdir, worker_env, endpoint, namespace=namespace, extra=extra, name=f"{side}-rl"))
            ports[side] = {"http": http_port, "rl": rl_port, "system": system_port}
        for side in SIDES:
            local.wait_for_models(ports[side]["http"], [SERVED_MODEL_NAME], timeout=READY_TIMEOUT_S, watch=processes)
        yield ports
    finally:
        for proc in processes:
            proc.stop(grace=5.0)
        shutil.rmtree(workdir, ignore_errors=True)


def _pause_and_resume(ports: dict[str, int]) -> list[object]:
    def route(name: str, body: dict) -> tuple[int, object]:
        return local.post_json(ports["system"], f"/engine/{name}", body, timeout=60)

    seen: list[object] = []
    try:
        seen.append(route("control/pause_generation", {"mode": "keep"}))
        seen.append(route("control/is_paused", {}))
        seen.append(local.list_models(ports["http"]))  # withdrawn from discovery while paused
    finally:
        seen.append(route("control/resume_generation", {}))
    seen.append(route("control/is_paused", {}))
    seen.append(route("control/sleep", {}))  # not served: the CPU build has no sleep mode
    local.wait_for_models(ports["http"], [SERVED_MODEL_NAME], timeout=60)
    status, body = local.post_json(
        ports["http"], "/v1/completions", {"model": SERVED_MODEL_NAME, "prompt": "hello", "max_tokens": 4}, timeout=60
    )
    seen.append((status, body["choices"][0]["finish_reason"] if status == 200 else body))
    return seen


def test_pause_and_resume_through_the_system_port_like_native(workers):
    seen = {side: _pause_and_resume(workers[side]) for side in SIDES}
    assert seen["trio"] == seen["native"]
    assert seen["native"][:2] == [(200, {"status": "paused"}), (200, {"is_paused": True})]
    assert seen["native"][2] == []
    assert seen["native"][3:5] == [(200, {"status": "resumed"}), (200, {"is_paused": False})]
    assert seen["native"][5][0] == 404


def test_rl_workers_list_the_cpu_builds_routes_like_native(workers):
    described = {}
    for side in SIDES:
        status, body = local.get_json(workers[side]["rl"], "/v1/rl/workers")
        assert status == 200
        [worker] = body["workers"]
        described[side] = {k: worker[k] for k in ("admin_base_url", "model", "routes", "world_size")}
    assert described["trio"] == described["native"]
    assert "control/sleep" not in described["native"]["routes"]
    assert "control/pause_generation" in described["native"]["routes"]
