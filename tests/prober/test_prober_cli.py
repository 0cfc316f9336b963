"""A fatal recovery (docs/reference/sidecar.md#recovery) through the CLI: ``trio-sidecar run`` exits 1 when vLLM comes back with another identity.

The sidecar runs as a subprocess (file discovery in a temporary directory, TCP planes on loopback, a unique
namespace; no frontend is needed). The mock runs in this process on 127.0.0.1 and is restarted on the same
port with another served name. Marked ``dynamo``: it needs the optional Dynamo runtime.
"""

from __future__ import annotations

import importlib.util
import uuid
from pathlib import Path

import pytest
import trio
from prober_fakes import MockRunner

pytestmark = pytest.mark.dynamo

REPO = Path(__file__).resolve().parents[2]


def tiny_model(directory: Path) -> Path:
    spec = importlib.util.spec_from_file_location("make_tiny_model", REPO / "scripts" / "make_tiny_model.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module.make_tiny_model(directory)


async def wait_for_log(process, text: str, *, timeout: float) -> None:
    with trio.fail_after(timeout):
        while text not in process.log():
            if not process.alive():
                pytest.fail(f"{process!r} exited before logging {text!r}:\n{process.log()[-3000:]}")
            await trio.sleep(0.1)


async def test_cli_exits_1_when_vllm_recovers_with_another_identity(nursery, tmp_path):
    pytest.importorskip("dynamo.llm", reason="ai-dynamo-runtime 1.6.1 is not installed")
    pytest.importorskip("tokenizers")
    from trio_sidecar._devtools import local

    model = str(tiny_model(tmp_path / "tiny-model"))
    runner = MockRunner(nursery)
    await runner.start(model=model, served_model_name="tiny")
    file_kv = tmp_path / "file-kv"
    file_kv.mkdir()
    sidecar = local.start_trio_sidecar(
        tmp_path,
        local.dynamo_env(file_kv),
        f"127.0.0.1:{runner.port}",
        namespace=f"t{uuid.uuid4().hex[:10]}",
        extra=["--grpc-connect-attempt-timeout-secs", "5", "--grpc-retry-interval-secs", "1"],
    )
    try:
        # Registered with Dynamo: the start phase (KV sources, prober) is over.
        await wait_for_log(sidecar, "ready: serving `tiny`", timeout=180)
        await runner.stop()
        await runner.start(model=model, served_model_name="renamed")
        with trio.move_on_after(120):
            while sidecar.alive():
                await trio.sleep(0.1)
        log = sidecar.log()
        if sidecar.alive():
            pytest.fail(f"the sidecar did not exit after the identity change:\n{log[-5000:]}")
        assert sidecar.popen.returncode == 1, log[-3000:]
        assert "model identity changed after vLLM recovery" in log, log[-5000:]
        assert "served_model_name='renamed'" in log, log[-5000:]
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(sidecar.stop)
