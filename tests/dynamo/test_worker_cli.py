"""``trio-sidecar run`` startup failures and signals as a real process (docs/reference/sidecar.md#exit-codes, docs/reference/sidecar.md#bootstrap-phase).

No frontend is needed: these paths end before a model is registered. (The second-signal test needs a
registered worker with a request in flight; it lives in test_e2e.py.)
"""

from __future__ import annotations

import signal
import time

import pytest
from dynamo_harness import FAST_ENGINE_ARGS, MockThread, require_dynamo, run_on_a_tty

from trio_sidecar._devtools import local

pytestmark = pytest.mark.dynamo


@pytest.fixture
def workdir(tmp_path):
    require_dynamo()
    return tmp_path


def _collapsed(proc) -> str:
    return " ".join(proc.log().split())


def test_an_unreachable_vllm_fails_startup_with_exit_1_and_the_typed_error(workdir):
    port = local.free_port()  # nothing listens there
    env = local.dynamo_env(workdir / "kv")
    proc = local.start_trio_sidecar(
        workdir,
        env,
        f"127.0.0.1:{port}",
        namespace="cli",
        extra=["--grpc-startup-deadline-secs", "1", "--grpc-retry-interval-secs", "1"],
    )
    try:
        code = proc.wait(60)
    finally:
        proc.stop()
    assert code == 1
    log = _collapsed(proc)
    assert f"Discovering vLLM model metadata from http://127.0.0.1:{port}; startup deadline: 1s" in log
    # docs/reference/sidecar.md#construction-and-retries: the slot's own deadline check or, on a loaded machine, the phase deadline around
    # the whole pool construction fires first; both are typed startup errors.
    assert (
        f"error: failed to establish the vLLM gRPC connection pool to http://127.0.0.1:{port} for pool slot 1 within 1s"
        in log
        or f"error: vLLM gRPC connection pool to http://127.0.0.1:{port} exceeded the total startup deadline" in log
    ), log[-2000:]


def test_sigterm_during_startup_exits_143_with_one_init_shutdown_line(workdir):
    port = local.free_port()
    env = local.dynamo_env(workdir / "kv")
    proc = local.start_trio_sidecar(workdir, env, f"127.0.0.1:{port}", namespace="cli")
    try:
        deadline = time.monotonic() + 60
        while "bootstrap" not in proc.log() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        assert proc.alive(), proc.log()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
    finally:
        proc.stop()
    assert code == 143, proc.log()[-2000:]  # 128 + SIGTERM: the worker never served
    notices = [line for line in proc.log().splitlines() if "runtime shut down during sidecar initialization" in line]
    assert len(notices) == 1 and "received SIGTERM during bootstrap discovery" in notices[0], proc.log()[-2000:]
    assert "error:" not in proc.log()


def test_a_registration_failure_exits_1_with_dynamos_message(workdir, tiny_model):
    mock = MockThread(model=str(tiny_model), served_model_name="tiny", engine_args=FAST_ENGINE_ARGS).start()
    env = local.dynamo_env(workdir / "kv")
    proc = local.start_trio_sidecar(
        workdir, env, mock.address, namespace="cli", extra=["--custom-jinja-template", str(workdir / "missing.jinja")]
    )
    try:
        code = proc.wait(60)
    finally:
        proc.stop()
        mock.stop()
    assert code == 1, proc.log()[-2000:]
    log = _collapsed(proc)
    assert f"error: Custom template file does not exist: {workdir / 'missing.jinja'}" in log
    assert "Exceptions from Trio nursery" not in log


def test_on_a_tty_startup_phases_the_model_table_and_the_ready_line_are_shown(workdir, tiny_model):
    mock = MockThread(model=str(tiny_model), served_model_name="tiny", engine_args=FAST_ENGINE_ARGS).start()
    env = {**local.dynamo_env(workdir / "kv"), "COLUMNS": "120", "TERM": "xterm"}
    env.pop("NO_COLOR", None)
    try:
        code, text = run_on_a_tty(
            ["run", "--grpc-endpoint", mock.address, "--discovery-backend", "file", "--namespace", "tty"],
            env,
            until=lambda out: b"ready: serving" in out,
            timeout=120,
            then_signal=signal.SIGTERM,
        )
    finally:
        mock.stop()
    assert code == 0, text[-3000:]
    for expected in (
        "bootstrap discovery (deadline 1800s)",
        "start phase (deadline 1800s)",
        "Discovered vLLM model",
        "served name",
        "KV block size",
        "max batched tokens",
        "ready: serving `tiny` on dyn://tty.backend.generate (Aggregated)",
    ):
        assert expected in text, expected
    assert "\x1b[" in text  # styled for the terminal


def test_a_signal_while_the_process_exits_after_the_run_exits_1_not_killed(tmp_path):
    """After ``run_worker``'s Trio run the process still tears Dynamo down; a signal then exits 1 (docs/reference/sidecar.md#exit-codes)."""
    import subprocess
    import sys

    code = (
        "import os, signal, time\n"
        "from trio_sidecar.dynamo.worker import exit_on_late_signals\n"
        "exit_on_late_signals()\n"
        "print('ready', flush=True)\n"
        "time.sleep(30)\n"
    )
    for signum in (signal.SIGTERM, signal.SIGINT):
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            assert proc.stdout.readline() == b"ready\n"
            proc.send_signal(signum)
            assert proc.wait(10) == 1
            assert f"received {signum.name} again; exiting immediately" in proc.stderr.read().decode()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()
            proc.stderr.close()
