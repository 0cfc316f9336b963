"""RL controls: ``trio-sidecar run --enable-rl`` against the native 1.6.1 sidecar, route by route (docs/rl.md).

Each side runs in front of its own mock (sleep mode, a weight-transfer backend and draft weight updates on), in
its own namespace, behind its own frontend with RL discovery on. Every step sends the same body to the same
``/engine/{route}`` of both workers' system ports and compares the HTTP status, the JSON answer and the Control
calls the mock recorded; the frontends' ``/v1/rl/workers`` must describe both workers alike.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from dynamo_harness import FAST_ENGINE_ARGS, free_system_port, wait_routes_served

from trio_sidecar._devtools import local

pytestmark = pytest.mark.dynamo

RL_ARGS = {"enable_sleep_mode": True, "weight_transfer_backend": "nccl", "enable_draft_weight_updates": True}
SIDES = ("native", "trio")
IS_PAUSED = ("POST", "/engine/control/is_paused")  # registered by every worker, with or without --enable-rl


@pytest.fixture(scope="module")
def sides(deployment_factory):
    dep = deployment_factory()
    out = {}
    for side in SIDES:
        namespace = f"{dep.namespace}-{side}"
        mock = dep.mock(served_model_name="tiny", engine_args={**FAST_ENGINE_ARGS, **RL_ARGS})
        rl_port = local.free_port()
        dep.frontend(
            namespace=namespace,
            env_overrides={"DYN_ENABLE_RL": "true", "DYN_RL_PORT": str(rl_port), "DYN_NAMESPACE": namespace},
        )
        http_port = dep.http_port
        system_port = free_system_port()
        start = dep.native_sidecar if side == "native" else dep.trio_sidecar
        start(
            mock,
            "--enable-rl",
            "--vllm-http-endpoint",
            "HTTP://LocalHost:80",
            "--vllm-rl-world-size",
            "3",
            namespace=namespace,
            name=f"{side}-rl",
            env={"DYN_SYSTEM_PORT": str(system_port)},
        )
        out[side] = {
            "mock": mock,
            "namespace": namespace,
            "rl_port": rl_port,
            "http_port": http_port,
            "system_port": system_port,
        }
    for side in SIDES:
        local.wait_for_models(out[side]["http_port"], ["tiny"], timeout=180, watch=dep.processes)
    return dep, out


def _step(side: dict, route: str, body: object) -> tuple[int, object, list[tuple[str, str]]]:
    mock = side["mock"]
    start = mock.call(lambda: len(mock.mock.control_calls))
    status, answer = local.post_json(side["system_port"], f"/engine/{route}", body, timeout=30)  # type: ignore[arg-type]
    made = mock.call(lambda: list(mock.mock.control_calls[start:]))
    return status, answer, [(rpc, " ".join(str(request).split())) for rpc, request in made]


# Dynamo's Python binding answers an exception of an engine-route callback as 500 "Handler error" with the
# message "Python callback failed: {Class}: {text}"; trio-sidecar names its classes after native's kinds, so after
# that prefix the message is native's (the one difference, README "Deliberate differences").
BINDING_PREFIX = "Python callback failed: "


def _as_trio_answers(native: tuple[int, object, list]) -> tuple[int, object, list]:
    status, answer, calls = native
    if status == 500 and isinstance(answer, dict) and answer.get("error") == "Handler error":
        message = answer["message"]
        if ":" not in message.split(" ")[0]:  # no kind: Dynamo's own ValueError texts (model taints)
            message = f"ValueError: {message}"
        answer = {**answer, "message": BINDING_PREFIX + message}
    return status, answer, calls


def _both(sides, route: str, body: object) -> tuple[int, object, list[tuple[str, str]]]:
    _, by_side = sides
    native, trio_side = (_step(by_side[side], route, body) for side in SIDES)
    assert trio_side == _as_trio_answers(native), f"{route} {body}"
    return native


def _models(sides) -> dict[str, list[str]]:
    _, by_side = sides
    return {side: local.list_models(by_side[side]["http_port"]) for side in SIDES}


def test_rl_workers_are_described_alike(sides):
    _, by_side = sides
    workers = {}
    for side in SIDES:
        status, body = local.get_json(by_side[side]["rl_port"], "/v1/rl/workers")
        assert status == 200
        [worker] = body["workers"]
        assert worker.get("system_url") == f"http://{local.LOOPBACK}:{by_side[side]['system_port']}", (side, worker)
        assert worker.get("request_plane_url") == f"dyn://{by_side[side]['namespace']}.backend.rl", (side, worker)
        workers[side] = {
            k: worker[k] for k in ("component", "endpoint", "admin_base_url", "model", "routes", "world_size")
        }
    assert workers["trio"] == workers["native"]
    assert workers["native"]["admin_base_url"] == "http://localhost/"
    assert workers["native"]["world_size"] == 1  # the mock reports it; the flag only fills in when it does not


def test_rl_request_plane_endpoint_answers_alike(sides):
    dep, by_side = sides
    payloads = [
        {"method": "routes"},
        {"method": "is_paused"},
        {"method": ""},
        {"method": 5},
        {},
        {"method": "routes", "kwargs": 5},
    ]
    script = textwrap.dedent(
        """
        import asyncio, json, sys
        from dynamo.runtime import DistributedRuntime

        async def main():
            runtime = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp")
            client = await runtime.endpoint(sys.argv[1]).client()
            await asyncio.wait_for(client.wait_for_instances(), 60)
            for raw in sys.argv[2:]:
                stream = await client.generate(json.loads(raw))
                print(json.dumps([item.data() async for item in stream]))
            runtime.shutdown()

        asyncio.run(main())
        """
    )
    answers = {}
    for side in SIDES:
        done = subprocess.run(
            [sys.executable, "-c", script, f"{by_side[side]['namespace']}.backend.rl", *map(json.dumps, payloads)],
            env=dep.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        answers[side] = [json.loads(line) for line in done.stdout.splitlines()]
        for answer in answers[side]:  # the system URL is each worker's own
            answer[0].pop("system_url", None)
    assert answers["trio"] == answers["native"]
    assert answers["native"][1] == [
        {"status": "error", "method": "is_paused", "message": "rl request-plane endpoint only supports method='routes'"}
    ]


def test_pause_resume_and_discovery_alike(sides):
    assert _both(sides, "control/pause_generation", {"mode": "bogus"})[:2] == (
        200,
        {
            "status": "error",
            "message": "InvalidRequest: pause_generation mode must be abort, wait, or keep; got `bogus`",
        },
    )
    _both(sides, "control/pause_generation", {"mode": 5})
    _both(sides, "control/pause_generation", {"mode": "abort", "clear_cache": "x"})
    assert _both(sides, "control/pause_generation", {"mode": "keep", "clear_cache": True}) == (
        200,
        {"status": "paused"},
        [("PauseGeneration", "mode: PAUSE_MODE_KEEP clear_cache: true")],
    )
    # withdrawn from discovery first; each frontend sees that through its discovery watch, a moment later
    for side in SIDES:
        assert local.wait_for_no_model(sides[1][side]["http_port"], "tiny", timeout=30) is not None, side
    assert _models(sides) == {"native": [], "trio": []}
    failed = _both(sides, "control/pause_generation", {"mode": "wait"})  # file discovery: already withdrawn
    assert failed[1]["message"].startswith("failed to unregister endpoint before /engine/control/pause_generation: ")
    assert failed[2] == []
    assert _both(sides, "control/is_paused", {})[1] == {"is_paused": True}
    assert _both(sides, "control/is_sleeping", {})[1] == {"is_sleeping": True}
    assert _both(sides, "control/resume_generation", {"x": 1}) == (
        200,
        {"status": "resumed"},
        [("ResumeGeneration", ""), ("IsSleeping", "")],
    )
    local.wait_for_models(sides[1]["trio"]["http_port"], ["tiny"], timeout=60)
    local.wait_for_models(sides[1]["native"]["http_port"], ["tiny"], timeout=60)
    assert _both(sides, "control/pause_generation", {"mode": "wait", "clear_cache": False})[2] == [
        ("PauseGeneration", "mode: PAUSE_MODE_WAIT clear_cache: false")
    ]
    _both(sides, "control/resume_generation", {})
    local.wait_for_models(sides[1]["trio"]["http_port"], ["tiny"], timeout=60)


def test_sleep_and_wake_up_alike(sides):
    for body in ({"level": 3}, {"level": "1"}, {"level": -1}, {"level": 1.5}, {"mode": "bogus"}):
        assert _both(sides, "control/sleep", body)[0] == 200
    for body in ({"tags": "weights"}, {"tags": [1]}, {"tags": ["bogus"]}):
        assert _both(sides, "control/wake_up", body)[0] == 200
    assert _both(sides, "control/sleep", {"level": 2})[2] == [("Sleep", "level: 2 mode: PAUSE_MODE_ABORT")]
    assert _both(sides, "control/wake_up", {"tags": ["weights"]})[1] == {
        "status": "partially_awake",
        "is_sleeping": True,
    }
    assert _both(sides, "control/resume_generation", {})[1] == {"status": "resumed", "is_sleeping": True}
    assert _models(sides) == {"native": [], "trio": []}  # still asleep: still withdrawn
    assert _both(sides, "control/wake_up", {})[1] == {"status": "awake"}
    local.wait_for_models(sides[1]["trio"]["http_port"], ["tiny"], timeout=60)
    local.wait_for_models(sides[1]["native"]["http_port"], ["tiny"], timeout=60)
    assert _both(sides, "control/sleep", {"level": 0, "mode": "wait"})[2] == [
        ("Sleep", "level: 0 mode: PAUSE_MODE_WAIT")
    ]
    assert _both(sides, "control/wake_up", {"tags": ["kv_cache", "weights", "scheduling"]})[1] == {"status": "awake"}


def test_weight_updates_alike(sides):
    steps = [
        ("update/init_weight_transfer_engine", {}),
        ("update/init_weight_transfer_engine", {"init_info": [1]}),
        ("update/init_weight_transfer_engine", {"init_info": {"b": 1, "a": [1, 2.5, "é"]}}),
        ("update/update_weights", {"update_info": {}}),  # engine error: no update in progress
        ("update/start_weight_update", {}),
        ("update/start_weight_update", {}),  # engine error: already in progress
        ("update/update_weights", {"update_info": "x"}),
        ("update/update_weights", {"update_info": {"names": ["w"]}}),
        ("update/finish_weight_update", {"weight_version": 5}),
        ("update/finish_weight_update", {"weight_version": "step-1"}),
        ("control/get_weight_version", {}),
        ("update/start_draft_weight_update", {}),
        ("update/finish_weight_update", {"weight_version": ""}),
        ("update/finish_weight_update", {}),
        ("update/update_weight_version", {"new_version": ""}),
        ("update/update_weight_version", {"new_version": 5}),
        ("update/update_weight_version", {"new_version": "step-2"}),
        ("control/get_weight_version", {}),
        ("update/model_taints", {"taints": ["b", "a", "a"]}),
        ("update/model_taints", {"taints": ["dynamo.topology/x"]}),
        ("update/model_taints", {}),
        ("update/model_taints", {"taints": []}),
        ("control/nonexistent", {}),
    ]
    results = [_both(sides, route, body) for route, body in steps]
    assert results[5] == (
        500,
        {
            "error": "Handler error",
            "message": "InvalidRequest: StartWeightUpdate: a weight update is already in progress (FailedPrecondition)",
        },
        [("StartWeightUpdate", "")],
    )
    assert results[17][1] == {"weight_version": "step-2"}
    assert results[-1][0] == 404


def test_non_object_bodies_alike(sides):
    for route in ("control/is_paused", "update/update_weights"):
        assert _both(sides, route, [1])[0] == 200


def test_without_enable_rl_the_control_routes_are_served_alike_on_a_server_without_capabilities(deployment_factory):
    dep = deployment_factory()
    by_side = {}
    for side in SIDES:
        mock = dep.mock(served_model_name="tiny", engine_args=FAST_ENGINE_ARGS)
        system_port = free_system_port()
        start = dep.native_sidecar if side == "native" else dep.trio_sidecar
        proc = start(mock, name=f"{side}-plain", env={"DYN_SYSTEM_PORT": str(system_port)})
        by_side[side] = {"mock": mock, "system_port": system_port, "proc": proc}
    for side in SIDES:
        wait_routes_served(by_side[side]["system_port"], [IS_PAUSED], watch=[by_side[side]["proc"]])
    steps = [
        ("control/is_paused", {}),
        ("control/pause_generation", {"mode": "wait"}),
        ("control/resume_generation", {}),  # no sleep mode: no IsSleeping
        ("control/is_sleeping", {}),
        ("control/get_weight_version", {}),
        ("control/sleep", {}),  # 404: no sleep mode
        ("control/wake_up", {}),
        ("update/start_weight_update", {}),  # 404: no weight transfer
        ("update/update_weight_version", {"new_version": "v"}),
        ("update/model_taints", {"taints": ["x"]}),
    ]
    results = []
    for route, body in steps:
        native, trio_side = (_step(by_side[side], route, body) for side in SIDES)
        assert trio_side == _as_trio_answers(native), f"{route} {body}"
        results.append(native)
    assert results[2] == (200, {"status": "resumed"}, [("ResumeGeneration", "")])
    assert [status for status, _, _ in results[5:8]] == [404, 404, 404]


@pytest.mark.parametrize(
    ("env", "text"),
    [
        ({}, "RL endpoint configuration: RL discovery requires the Dynamo system server; set DYN_SYSTEM_PORT to 0"),
        (
            {"DYN_SYSTEM_PORT": "0", "DYN_RL_ENDPOINT": "a.b"},
            "RL endpoint configuration: DYN_RL_ENDPOINT must contain only letters, digits, '-' or '_'",
        ),
    ],
)
def test_enable_rl_startup_refusals_exit_1_like_native(deployment_factory, env, text):
    dep = deployment_factory()
    mock = dep.mock(served_model_name="tiny", engine_args=FAST_ENGINE_ARGS)
    for side in SIDES:
        start = dep.native_sidecar if side == "native" else dep.trio_sidecar
        proc = start(mock, "--enable-rl", name=f"{side}-refused", env=env)
        assert proc.wait(120) == 1, proc.log()[-2000:]
        log = " ".join(proc.log().split())
        assert text in log, log[-2000:]
        if side == "trio":
            assert f"error: {text}" in log


def test_an_unreachable_vllm_is_a_500_of_kind_unavailable_on_control_routes_too(deployment_factory):
    dep = deployment_factory()
    by_side = {}
    for side in SIDES:
        mock = dep.mock(served_model_name="tiny", engine_args={**FAST_ENGINE_ARGS, **RL_ARGS})
        system_port = free_system_port()
        start = dep.native_sidecar if side == "native" else dep.trio_sidecar
        proc = start(mock, name=f"{side}-down", env={"DYN_SYSTEM_PORT": str(system_port)})
        by_side[side] = {"mock": mock, "system_port": system_port, "proc": proc}
    for side in SIDES:
        # the engine goes away only once the worker reached it and registered its routes
        wait_routes_served(by_side[side]["system_port"], [IS_PAUSED], watch=[by_side[side]["proc"]])
        by_side[side]["mock"].stop()
    for route, rpc in (("control/is_paused", "IsPaused"), ("control/get_weight_version", "GetWeightVersion")):
        answers = {
            side: local.post_json(by_side[side]["system_port"], f"/engine/{route}", {}, timeout=60) for side in SIDES
        }
        # The transport's own words after the RPC name differ (tonic's "tcp connect error" and the project's).
        assert answers["native"][0] == answers["trio"][0] == 500
        assert answers["native"][1]["message"].startswith(f"Unavailable: {rpc}: ")
        assert answers["trio"][1]["message"].startswith(f"{BINDING_PREFIX}Unavailable: {rpc}: ")
        assert answers["native"][1]["message"].endswith("(Unavailable)")
        assert answers["trio"][1]["message"].endswith("(Unavailable)")
