"""A prober hiccup seen from Dynamo's frontend: ``trio-sidecar run`` serves the mock through a TCP proxy, HTTP
clients send completions to ``dynamo.frontend`` in a loop, and the proxy resets the sidecar's prober
connection. The prober reconnects at once and no client gets a 503 (or any other non-200 answer).

The sidecar and the frontend are subprocesses (file discovery in a temporary directory, TCP planes on
loopback, a unique namespace); the mock and the proxy run in this process on 127.0.0.1. Marked ``dynamo``:
it needs the optional Dynamo runtime and frontend.
"""

from __future__ import annotations

import importlib.util
import uuid
from collections import Counter
from pathlib import Path

import pytest
import trio
from prober_fakes import MockRunner, ResettableProxy

pytestmark = pytest.mark.dynamo

REPO = Path(__file__).resolve().parents[2]
CONNECTIONS = 2
CLIENTS = 6


def tiny_model(directory: Path) -> Path:
    spec = importlib.util.spec_from_file_location("make_tiny_model", REPO / "scripts" / "make_tiny_model.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module.make_tiny_model(directory)


async def test_resetting_the_probers_connection_gives_no_client_a_503(nursery, tmp_path):
    pytest.importorskip("dynamo.llm", reason="ai-dynamo-runtime 1.6.1 is not installed")
    pytest.importorskip("dynamo.frontend", reason="ai-dynamo 1.6.1 (frontend) is not installed")
    pytest.importorskip("tokenizers")
    from trio_sidecar._devtools import local

    model = str(tiny_model(tmp_path / "tiny-model"))
    runner = MockRunner(nursery)
    await runner.start(
        model=model,
        served_model_name="tiny",
        engine_args={"block_size": 4, "enable_prefix_caching": False, "speedup_ratio": 0.0},
    )
    proxy = await nursery.start(ResettableProxy(runner.port).serve)
    file_kv = tmp_path / "file-kv"
    file_kv.mkdir()
    env = local.dynamo_env(file_kv)
    namespace = f"t{uuid.uuid4().hex[:10]}"
    processes = []
    try:
        frontend, http_port = await trio.to_thread.run_sync(
            lambda: local.start_frontend(tmp_path, env, namespace=namespace)
        )
        processes.append(frontend)
        sidecar = local.start_trio_sidecar(
            tmp_path,
            env,
            proxy.endpoint,
            namespace=namespace,
            extra=["--grpc-connections", str(CONNECTIONS), "--grpc-retry-interval-secs", "1"],
        )
        processes.append(sidecar)
        await trio.to_thread.run_sync(lambda: local.wait_for_models(http_port, ["tiny"], timeout=180, watch=processes))
        with trio.fail_after(30):  # the pool's connections, then the prober's
            while len(proxy.links) < CONNECTIONS + 1:
                await trio.sleep(0.05)
        pool_links, prober_link = proxy.links[:CONNECTIONS], proxy.links[CONNECTIONS]

        answers: Counter[int] = Counter()
        bodies: list = []
        stop = trio.Event()

        def complete() -> None:
            status, body = local.post_json(
                http_port, "/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 3}
            )
            answers[status] += 1
            if status != 200:
                bodies.append((status, body))

        async def client() -> None:
            while not stop.is_set():
                await trio.to_thread.run_sync(complete)

        async def answered(count: int) -> None:
            target = answers[200] + count
            with trio.fail_after(120):
                while answers[200] < target:
                    await trio.sleep(0.05)

        async with trio.open_nursery() as load:
            for _ in range(CLIENTS):
                load.start_soon(client)
            await answered(30)
            before = sum(answers.values())
            proxy.reset(prober_link)
            with trio.fail_after(60):  # the prober's new connection
                while len(proxy.links) < CONNECTIONS + 1:
                    await trio.sleep(0.05)
            await answered(60)
            stop.set()
        during = sum(answers.values()) - before
        print(f"\nprober connection reset behind the frontend: {during} answers after the reset, {dict(answers)}")
        assert bodies == [], bodies[:3]
        assert set(answers) == {200}
        assert proxy.links[:CONNECTIONS] == pool_links  # the pool's connections were not touched
        log = " ".join(sidecar.log().split())  # (the rich log handler wraps long lines)
        assert "reconnecting at once (admission stays open)" in log
        assert "new requests are rejected" not in log
    finally:
        with trio.CancelScope(shield=True):
            for proc in reversed(processes):
                await trio.to_thread.run_sync(proc.stop)
