"""LoRA through Dynamo on the real vLLM 0.32 CPU server: the native sidecar vs ``trio-sidecar run`` (docs/lora.md).

Each side has its own ``vllm serve --enable-lora --max-loras 2`` (with the field-order fix of
``tests/real_vllm/lora_field_order``, docs/conformance.md#lora-on-the-cpu-build), so the adapter tables and
vLLM's adapter ids do not mix; its own ``python -m dynamo.frontend`` (file discovery, one namespace each);
and its sidecar with ``DYN_LORA_ENABLED=true`` and a system port. Both servers allow local adapters from one
private directory, where ``scripts/make_tiny_lora.py`` wrote the adapters: nothing is downloaded.

One scenario, step by step; every step goes to both sides and the answers must be equal: load an adapter
through the system port (``POST /v1/loras`` with a ``file://`` URI), list it, see the frontend list it as a
model, complete greedily with ``"model": <adapter>`` (the text differs from the base model's: the adapter is
applied end to end), refusals (a directory without adapter files, a missing directory, an adapter whose rank
the engine refuses), unload it, and complete with it again (404).
"""

from __future__ import annotations

import http.client
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
from dynamo_harness import free_system_port
from real_vllm_lora import launch_lora_server, make_tiny_lora
from real_vllm_server import SERVED_MODEL_NAME, TIMINGS, RealVllmServer, check_env, env_from_environ

from trio_sidecar._devtools import local

SIDES = ("native", "trio")
READY_TIMEOUT_S = 300.0
HTTP_TIMEOUT_S = 60.0
MODEL_TIMEOUT_S = 60.0
ADAPTER = "seed1"
MAX_LORA_RANK = 16  # vLLM's default --max-lora-rank
PROMPT = {"prompt": "hello world", "max_tokens": 16, "temperature": 0}


@attrs.frozen
class Side:
    http_port: int  # the frontend's OpenAI port
    system_port: int  # the sidecar's system port (the LoRA routes)
    vllm_http_port: int  # vLLM's own OpenAI server (the same engine)


@attrs.frozen
class Stack:
    sides: dict[str, Side]
    adapter_dir: Path


def _stop(server: RealVllmServer) -> None:
    try:
        server.stop()
        assert not server.leftovers(), f"vLLM processes still running after stop: {server.leftovers()}"
    finally:
        server.cleanup_files()


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    pytest.importorskip("dynamo.frontend", reason="ai-dynamo 1.6.1 (frontend) is not installed")
    env = env_from_environ()
    assert env is not None
    check_env(env)
    adapter_dir = Path(tempfile.mkdtemp(prefix="real-vllm-lora-diff-"))
    make_tiny_lora(adapter_dir / ADAPTER, seed=1)
    make_tiny_lora(adapter_dir / "rank32", rank=2 * MAX_LORA_RANK)
    (adapter_dir / "not-an-adapter").mkdir()
    workdir = Path(tmp_path_factory.mktemp("real-lora-differential"))
    (workdir / "file-kv").mkdir()
    dyn_env = local.dynamo_env(workdir / "file-kv")
    servers: dict[str, RealVllmServer] = {}
    processes: list[local.Process] = []
    try:
        for side in SIDES:  # both start at once; each is waited for below
            servers[side] = launch_lora_server(env, adapter_dir)
        for side, server in servers.items():
            server.wait_ready()
            TIMINGS.append((f"python launch (LoRA, {side} side): start -> SERVING", server.ready_after_s or 0.0))
        sides: dict[str, Side] = {}
        for side, server in servers.items():
            namespace = f"reallora-{side}"
            frontend, http_port = local.start_frontend(workdir, dyn_env, namespace=namespace)
            processes.append(frontend)
            system_port = free_system_port()
            worker_env = {**dyn_env, "DYN_SYSTEM_PORT": str(system_port), "DYN_LORA_ENABLED": "true"}
            start = local.start_native_sidecar if side == "native" else local.start_trio_sidecar
            processes.append(start(workdir, worker_env, server.endpoint, namespace=namespace, name=f"{side}-lora"))
            sides[side] = Side(http_port, system_port, server.http_port)
        for side in SIDES:
            local.wait_for_models(sides[side].http_port, [SERVED_MODEL_NAME], timeout=READY_TIMEOUT_S, watch=processes)
        yield Stack(sides, adapter_dir)
    finally:
        for proc in processes:
            proc.stop(grace=5.0)
        for server in servers.values():
            _stop(server)
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(adapter_dir, ignore_errors=True)


def _request(port: int, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    conn = http.client.HTTPConnection(local.LOOPBACK, port, timeout=HTTP_TIMEOUT_S)
    try:
        headers = {"content-type": "application/json"} if body is not None else {}
        conn.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
        response = conn.getresponse()
        raw = response.read().decode(errors="replace")
        try:
            return response.status, json.loads(raw)
        except ValueError:
            return response.status, raw
    finally:
        conn.close()


def _same(stack: Stack, step: str, port: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """The step's answer on both sides (``port``: "system" or "http"), which must be equal; returns it."""
    got = {side: _request(getattr(s, f"{port}_port"), method, path, body) for side, s in stack.sides.items()}
    for status, answer in got.values():  # a model list's "created" is the second it was asked
        models = answer.get("data") if status == 200 and isinstance(answer, dict) else None
        for model in models or ():
            model.pop("created", None)
        if models and all(isinstance(m, dict) and "id" in m for m in models):
            models.sort(key=lambda m: m["id"])  # the frontend lists models in no fixed order (seen in CI)
    assert got["trio"] == got["native"], f"{step}: native {got['native']!r}, trio {got['trio']!r}"
    return got["trio"]


def _complete(stack: Stack, step: str, model: str, port: str = "http") -> tuple[int, Any]:
    """A greedy completion through both frontends (or both vLLM servers' own OpenAI port, ``port``
    "vllm_http"); compared without the per-request ``id`` and ``created``."""
    got = {}
    for side, s in stack.sides.items():
        status, body = _request(getattr(s, f"{port}_port"), "POST", "/v1/completions", {"model": model, **PROMPT})
        if isinstance(body, dict):
            body = {k: v for k, v in body.items() if k not in ("id", "created")}
        got[side] = (status, body)
    assert got["trio"] == got["native"], f"{step}: native {got['native']!r}, trio {got['trio']!r}"
    return got["trio"]


def _load(name: str, path: Path | str) -> dict[str, Any]:
    return {"lora_name": name, "source": {"uri": f"file://{path}"}}


@pytest.mark.timeout(600)
def test_an_adapter_is_loaded_served_and_unloaded_through_dynamo_like_native(stack):
    adapter = stack.adapter_dir / ADAPTER
    assert _same(stack, "list (empty)", "system", "GET", "/v1/loras") == (
        200,
        {"status": "success", "loras": {}, "count": 0},
    )
    status, loaded = _same(stack, "load", "system", "POST", "/v1/loras", _load(ADAPTER, adapter))
    assert (status, loaded) == (
        200,
        {
            "status": "success",
            "message": f"LoRA adapter '{ADAPTER}' loaded successfully",
            "lora_name": ADAPTER,
            "lora_id": 1,
        },
    )
    assert _same(stack, "list", "system", "GET", "/v1/loras") == (
        200,
        {"status": "success", "loras": {ADAPTER: 1}, "count": 1},
    )
    for side in SIDES:
        local.wait_for_models(stack.sides[side].http_port, [ADAPTER], timeout=MODEL_TIMEOUT_S)
    status, models = _same(stack, "models", "http", "GET", "/v1/models")
    assert status == 200 and {m["id"] for m in models["data"]} == {SERVED_MODEL_NAME, ADAPTER}, models

    base = _complete(stack, "base completion", SERVED_MODEL_NAME)
    with_adapter = _complete(stack, "adapter completion", ADAPTER)
    assert base[0] == with_adapter[0] == 200, (base, with_adapter)
    assert with_adapter[1]["model"] == ADAPTER
    base_text, adapter_text = base[1]["choices"][0]["text"], with_adapter[1]["choices"][0]["text"]
    assert adapter_text != base_text, "greedy text with the adapter equals the base model's: adapter not applied"
    assert _complete(stack, "adapter completion again", ADAPTER) == with_adapter  # greedy: reproducible
    status, direct = _complete(stack, "adapter completion on vLLM's own server", ADAPTER, port="vllm_http")
    assert status == 200 and direct["choices"][0]["text"] == adapter_text, direct

    status, body = _same(stack, "unload", "system", "DELETE", f"/v1/loras/{ADAPTER}")
    assert (status, body) == (
        200,
        {
            "status": "success",
            "message": f"LoRA adapter '{ADAPTER}' unloaded successfully",
            "lora_name": ADAPTER,
            "lora_id": 1,
        },
    )
    assert _same(stack, "list after unload", "system", "GET", "/v1/loras")[1]["count"] == 0
    for side in SIDES:
        gone = local.wait_for_no_model(stack.sides[side].http_port, ADAPTER, timeout=MODEL_TIMEOUT_S)
        assert gone is not None, f"{side}: {ADAPTER} still listed by the frontend {MODEL_TIMEOUT_S} s after unloading"
    assert _complete(stack, "adapter completion after unload", ADAPTER) == (
        404,
        {"message": "Model not found", "type": "Not Found", "code": 404},
    )
    assert _complete(stack, "base completion after unload", SERVED_MODEL_NAME) == base


@pytest.mark.timeout(300)
def test_bad_adapters_are_refused_like_native(stack):
    """Refused by the sidecar before vLLM (no adapter files, no directory) and by vLLM's engine (rank above
    ``--max-lora-rank``): the same status and JSON on both sides, and nothing is left loaded or listed."""
    empty, missing = stack.adapter_dir / "not-an-adapter", stack.adapter_dir / "missing"
    status, body = _same(stack, "no adapter files", "system", "POST", "/v1/loras", _load("empty", empty))
    assert (status, body["status"], body["lora_name"]) == (500, "error", "empty"), body
    assert body["message"] == (
        f"InvalidRequest: LoRA directory `{empty}` must contain adapter_config.json and adapter weights"
    )
    status, body = _same(stack, "missing directory", "system", "POST", "/v1/loras", _load("missing", missing))
    assert status == 500 and body["message"] == (
        f"Internal: invalid vLLM gRPC response: failed to resolve LoRA source `file://{missing}`: "
        f"Local LoRA not found: file://{missing}"
    ), body
    status, body = _same(
        stack, "rank above max_lora_rank", "system", "POST", "/v1/loras", _load("rank32", stack.adapter_dir / "rank32")
    )
    assert status == 500 and f"LoRA rank {2 * MAX_LORA_RANK} is greater than max_lora_rank" in body["message"], body
    assert _same(stack, "list after refusals", "system", "GET", "/v1/loras")[1]["count"] == 0
    status, models = _same(stack, "models after refusals", "http", "GET", "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == [SERVED_MODEL_NAME], models
