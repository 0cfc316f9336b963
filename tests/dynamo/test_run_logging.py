"""``trio-sidecar run`` honours Dynamo's logging environment: with ``DYN_LOGGING_JSONL=1`` every stderr line is
one of Dynamo's JSON records (the sidecar's own records, banners and notices included, with Dynamo's field
names), and ``DYN_LOG`` sets the sidecar's level (real subprocesses, loopback only)."""

from __future__ import annotations

import json
import signal
import time

import pytest
from dynamo_harness import FAST_ENGINE_ARGS, MockThread, require_dynamo

from trio_sidecar._devtools import local

pytestmark = pytest.mark.dynamo

READY = "ready: serving"


def _run_until_ready_then_stop(tmp_path, tiny_model, env_extra: dict[str, str]) -> tuple[int | None, str]:
    require_dynamo()
    mock = MockThread(model=str(tiny_model), served_model_name="tiny", engine_args=FAST_ENGINE_ARGS).start()
    env = {**local.dynamo_env(tmp_path / "kv"), **env_extra}
    proc = local.start_trio_sidecar(tmp_path, env, mock.address, namespace="logs")
    try:
        deadline = time.monotonic() + 120
        while READY not in proc.log():
            assert proc.alive(), f"exited {proc.popen.returncode}: {proc.log()[-3000:]}"
            assert time.monotonic() < deadline, f"not ready within 120 s: {proc.log()[-3000:]}"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
    finally:
        proc.stop()
        mock.stop()
    return code, proc.log()


def test_with_dynamo_jsonl_every_stderr_line_of_run_is_a_dynamo_json_record(tmp_path, tiny_model):
    code, log = _run_until_ready_then_stop(tmp_path, tiny_model, {"DYN_LOGGING_JSONL": "1", "DYN_LOG": "debug"})
    assert code == 0, log[-3000:]
    records = []
    for line in log.splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            pytest.fail(f"not a JSON line: {line!r}\n{log[-3000:]}")
    ours = [r for r in records if str(r.get("log.target", "")).startswith("trio_sidecar")]
    runtime = [r for r in records if str(r.get("target", "")).startswith("dynamo_runtime")]
    assert ours and runtime, log[-3000:]
    for record in ours:  # Dynamo's own field names and values
        assert {"time", "level", "target", "message", "log.file", "log.line", "log.target"} <= record.keys(), record
        assert record["time"].endswith("Z") and record["level"] in ("DEBUG", "INFO", "WARN", "ERROR"), record
    levels = {r["level"] for r in ours}
    assert "DEBUG" in levels, sorted(levels)
    messages = [r["message"] for r in ours]
    assert any(m.startswith("configuration: SidecarConfig(") for m in messages), messages
    assert any(m.startswith("Discovering vLLM model metadata from ") for m in messages), messages  # the banner
    assert any(READY in m for m in messages), messages


def test_dyn_log_sets_the_sidecars_level_without_json(tmp_path, tiny_model):
    code, log = _run_until_ready_then_stop(tmp_path, tiny_model, {"DYN_LOG": "warn,trio_sidecar=debug"})
    assert code == 0, log[-3000:]
    assert "DEBUG trio_sidecar.cli: configuration: SidecarConfig(" in log, log[-3000:]


def test_without_dyn_log_the_sidecar_logs_at_info(tmp_path, tiny_model):
    code, log = _run_until_ready_then_stop(tmp_path, tiny_model, {"DYN_LOG": "info"})
    assert code == 0, log[-3000:]
    assert READY in log and "configuration: SidecarConfig(" not in log, log[-3000:]


def test_with_dynamo_jsonl_a_startup_failure_is_an_error_record_too(tmp_path):
    require_dynamo()
    env = {**local.dynamo_env(tmp_path / "kv"), "DYN_LOGGING_JSONL": "1"}
    closed = f"127.0.0.1:{local.free_port()}"  # nothing listens there
    proc = local.start_trio_sidecar(
        tmp_path, env, closed, namespace="logs", extra=("--grpc-startup-deadline-secs", "1")
    )
    try:
        code = proc.wait(60)
    finally:
        proc.stop()
    log = proc.log()
    assert code == 1, log[-3000:]
    records = [json.loads(line) for line in log.splitlines()]  # raises on a line that is not JSON
    errors = [r for r in records if r["level"] == "ERROR" and r["message"].startswith("error: ")]
    assert len(errors) == 1 and errors[0]["log.target"].startswith("trio_sidecar"), records[-5:]
