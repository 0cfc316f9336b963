"""``trio-sidecar run`` as an operator meets it: signals in every phase before serving, signs of life while
waiting, one-line errors with hints, and UTC log lines (real subprocesses, loopback only).

Exit codes (docs/deployment.md, "Exit codes and signals"): a signal before the worker serves ends the process
within 2 s with one notice line and 128 + the signal number; never a traceback, never 0.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta

import pytest
from dynamo_harness import FAST_ENGINE_ARGS, MockThread, require_dynamo, run_on_a_tty

from trio_sidecar._devtools import local

pytestmark = pytest.mark.dynamo

UTC_LINE = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6})Z +(DEBUG|INFO|WARN|ERROR) \S+: ")
EXIT_BOUND = 2.0


@pytest.fixture
def workdir(tmp_path):
    require_dynamo()
    return tmp_path


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, never listened, then released)."""
    return local.free_port()


def _wait_for(proc: local.Process, text: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in proc.log():
        assert proc.alive(), f"exited {proc.popen.returncode} before {text!r}: {proc.log()[-2000:]}"
        assert time.monotonic() < deadline, f"no {text!r} within {timeout}s: {proc.log()[-2000:]}"
        time.sleep(0.05)


def _signal_and_time_exit(proc: local.Process, signum: int) -> tuple[int | None, float]:
    start = time.monotonic()
    proc.send_signal(signum)
    code = proc.wait(20)
    return code, time.monotonic() - start


def _assert_one_notice(log: str, signum: int, phase: str) -> None:
    notices = [line for line in log.splitlines() if f"received {signal.Signals(signum).name}" in line]
    assert len(notices) == 1, log[-3000:]
    assert f"during {phase}: runtime shut down during sidecar initialization" in notices[0], notices[0]
    assert "Traceback" not in log and "error:" not in log, log[-3000:]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_waiting_for_vllm_exits_at_once_with_128_plus_the_signal(workdir, signum):
    env = local.dynamo_env(workdir / "kv")
    proc = local.start_trio_sidecar(workdir, env, f"127.0.0.1:{_closed_port()}", namespace="sig")
    try:
        _wait_for(proc, "bootstrap discovery (deadline 1800s): started")
        code, took = _signal_and_time_exit(proc, signum)
    finally:
        proc.stop()
    assert code == 128 + signum, proc.log()[-2000:]
    assert took < EXIT_BOUND, took
    _assert_one_notice(proc.log(), signum, "bootstrap discovery")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_default_etcd_backend_is_unreachable_exits_at_once(workdir, tiny_model, signum):
    """The default discovery backend with no etcd: Dynamo's runtime would hold the GIL for 120 s."""
    mock = MockThread(model=str(tiny_model), served_model_name="tiny", engine_args=FAST_ENGINE_ARGS).start()
    env = local.dynamo_env(workdir / "kv", ETCD_ENDPOINTS=f"http://127.0.0.1:{_closed_port()}")
    env.pop("DYN_DISCOVERY_BACKEND")
    argv = [sys.executable, "-m", "trio_sidecar", "run", "--grpc-endpoint", mock.address, "--namespace", "etcd"]
    proc = local.Process("trio-sidecar", argv, env=env, log_path=workdir / "run.log")
    try:
        _wait_for(proc, "etcd check (deadline 120s): started")
        time.sleep(0.3)
        code, took = _signal_and_time_exit(proc, signum)
    finally:
        proc.stop()
        mock.stop()
    assert code == 128 + signum, proc.log()[-2000:]
    assert took < EXIT_BOUND, took
    _assert_one_notice(proc.log(), signum, "etcd check")


def test_an_unreachable_etcd_fails_with_one_line_naming_it_and_a_hint(workdir, tiny_model):
    mock = MockThread(model=str(tiny_model), served_model_name="tiny", engine_args=FAST_ENGINE_ARGS).start()
    port = _closed_port()
    env = local.dynamo_env(
        workdir / "kv", ETCD_ENDPOINTS=f"http://127.0.0.1:{port}", ETCD_STARTUP_CONNECT_TIMEOUT_SECONDS="2"
    )
    argv = [
        sys.executable,
        "-m",
        "trio_sidecar",
        "run",
        "--grpc-endpoint",
        mock.address,
        "--namespace",
        "etcd",
        "--discovery-backend",
        "etcd",
    ]
    proc = local.Process("trio-sidecar", argv, env=env, log_path=workdir / "run.log")
    try:
        code = proc.wait(60)
    finally:
        proc.stop()
        mock.stop()
    assert code == 1, proc.log()[-2000:]
    [line] = [line for line in proc.log().splitlines() if line.startswith("error:")]
    assert re.fullmatch(
        rf"error: etcd at http://127\.0\.0\.1:{port} \(ETCD_ENDPOINTS\) is not reachable after 2(\.\d)?s: all "
        rf"attempts to connect to 127\.0\.0\.1:{port} failed: connection refused; hint: start etcd, point "
        r"ETCD_ENDPOINTS at it, or use --discovery-backend file on a single host",
        line,
    ), line


def test_sigint_during_imports_prints_one_line_and_exits_130(workdir):
    """Once the program's first line runs, a SIGINT during the remaining imports, parsing or startup is one
    clean line and 130. (Python's own start-up before that — ``site``, runpy locating ``__main__``, a few
    milliseconds — is not the program's to handle.) PYTHONPROFILEIMPORTTIME reports each finished import on
    stderr; ``trio_sidecar.core.config`` is the first module the CLI imports, so its line means the program's own
    imports are under way."""
    env = local.dynamo_env(workdir / "kv", PYTHONPROFILEIMPORTTIME="1")
    for extra_delay in (0.0, 0.05, 0.2):
        log_path = workdir / f"imports-{extra_delay}.err"
        with open(log_path, "wb") as err_file:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "trio_sidecar",
                    "run",
                    "--grpc-endpoint",
                    f"127.0.0.1:{_closed_port()}",
                    "--discovery-backend",
                    "file",
                ],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err_file,
            )
        try:
            deadline = time.monotonic() + 30
            while not re.search(r"\|\s+trio_sidecar\.core\.config$", log_path.read_text(errors="replace"), re.M):
                assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-2000:]
                time.sleep(0.001)
            time.sleep(extra_delay)
            proc.send_signal(signal.SIGINT)
            code = proc.wait(20)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        err = "\n".join(
            line for line in log_path.read_text(errors="replace").splitlines() if not line.startswith("import time:")
        )
        assert code == 130, err[-2000:]
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-2000:]
        assert sum("SIGINT" in line for line in err.splitlines()) == 1, err[-2000:]


@pytest.mark.timeout(120)  # a real 25 s start-up deadline with a line every 10 s
def test_while_waiting_for_vllm_a_line_every_10s_reports_attempts_elapsed_and_the_cause(workdir):
    port = _closed_port()
    env = local.dynamo_env(workdir / "kv", TZ="America/New_York")
    proc = local.start_trio_sidecar(
        workdir, env, f"127.0.0.1:{port}", namespace="life", extra=["--grpc-startup-deadline-secs", "25"]
    )
    try:
        code = proc.wait(90)
    finally:
        proc.stop()
    assert code == 1
    log = proc.log()
    waiting = [line for line in log.splitlines() if "still waiting for vLLM" in line]
    assert len(waiting) == 2, log[-3000:]  # at 10 s and 20 s of a 25 s deadline
    assert re.search(
        rf"still waiting for vLLM at http://127\.0\.0\.1:{port}: 10s of 25s, \d+ failed attempts?, "
        r"last: connection refused$",
        waiting[0],
    ), waiting[0]
    # The failure is one line with the cause once, a rounded duration and a hint.
    [error] = [line for line in log.splitlines() if line.startswith("error:")]
    assert re.fullmatch(
        rf"error: failed to establish the vLLM gRPC connection pool to http://127\.0\.0\.1:{port} for pool slot "
        rf"1 within 25s after \d+ attempts over 25(\.\d)?s: all attempts to connect to 127\.0\.0\.1:{port} "
        r"failed: connection refused; hint: nothing accepts connections there; .*",
        error,
    ), error
    assert "sub-exception" not in log
    # Every other line, the first included, is a log line stamped in UTC like Dynamo's, whatever TZ says.
    now = datetime.now(UTC)
    for line in log.splitlines():
        if line.startswith("error:"):
            continue
        match = UTC_LINE.match(line)
        assert match, line
        stamp = datetime.fromisoformat(match.group(1)).replace(tzinfo=UTC)
        assert now - timedelta(minutes=5) < stamp <= now + timedelta(seconds=1), line
    assert "phase=" not in log and "_the_" not in log


def test_an_endpoint_without_a_port_warns_that_port_80_is_used(workdir):
    env = local.dynamo_env(workdir / "kv")
    argv = [
        sys.executable,
        "-m",
        "trio_sidecar",
        "run",
        "--grpc-endpoint",
        "localhost",
        "--grpc-startup-deadline-secs",
        "1",
        "--discovery-backend",
        "file",
    ]
    proc = local.Process("trio-sidecar", argv, env=env, log_path=workdir / "run.log")
    try:
        proc.wait(60)
    finally:
        proc.stop()
    [warning] = [line for line in proc.log().splitlines() if " WARN " in line]
    assert warning.endswith(
        "`--grpc-endpoint` `localhost` has no port, so port 80 is used; vLLM's gRPC server listens on its "
        "--grpc-port (e.g. `localhost:50051`)"
    ), warning


def test_on_a_tty_the_wait_is_a_live_status_line(workdir):
    env = {**local.dynamo_env(workdir / "kv"), "COLUMNS": "160", "TERM": "xterm"}
    env.pop("NO_COLOR", None)
    code, text = run_on_a_tty(
        ["run", "--grpc-endpoint", f"127.0.0.1:{_closed_port()}", "--discovery-backend", "file"]
        + ["--grpc-startup-deadline-secs", "4"],
        env,
    )
    assert code == 1, text[-3000:]
    assert "still waiting for vLLM at http://127.0.0.1:" in text and "last: connection refused" in text, text[-3000:]
    assert "\x1b[" in text  # drawn for the terminal, not logged


def test_a_ready_worker_still_drains_and_exits_0_on_sigterm(workdir, tiny_model):
    """Serving: the first signal is the graceful shutdown, unchanged (exit 0)."""
    mock = MockThread(model=str(tiny_model), served_model_name="tiny", engine_args=FAST_ENGINE_ARGS).start()
    env = local.dynamo_env(workdir / "kv")
    proc = local.start_trio_sidecar(workdir, env, mock.address, namespace="drain")
    try:
        _wait_for(proc, "ready: serving `tiny`", timeout=120)
        code, _ = _signal_and_time_exit(proc, signal.SIGTERM)
    finally:
        proc.stop()
        mock.stop()
    assert code == 0, proc.log()[-2000:]
    assert "received SIGTERM; shutting down" in proc.log()
    assert "runtime shut down during sidecar initialization" not in proc.log()
