"""A local Dynamo deployment on loopback: processes, ports and a small HTTP client (stdlib only).

Used by ``examples/demo.py``, ``bench/e2e.py`` and the Dynamo end-to-end tests. Everything binds 127.0.0.1,
uses file discovery in a private directory (docs/reference/worker.md#local-setup-for-tests), and every process this module starts is
stopped by its own PID (SIGTERM, then SIGKILL after a grace period).

Synchronous on purpose: these helpers drive separate processes and are called from scripts and plain
(non-Trio) tests.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

__all__ = [
    "LOOPBACK",
    "PRE_COMMIT_ERROR_PEEK_MS",
    "Process",
    "dynamo_env",
    "free_port",
    "start_frontend",
    "start_mock",
    "start_trio_sidecar",
    "start_native_sidecar",
    "wait_for_models",
    "wait_for_no_model",
    "list_models",
    "post_json",
    "stream_sse",
]

LOOPBACK = "127.0.0.1"
#: The frontend waits up to this long (ms) for a request's first output before it commits HTTP 200 to a
#: streaming response, so an error that comes first is answered with its HTTP status (400 for an invalid
#: argument) like the native sidecar's. Dynamo 1.6.1's frontend does this only when
#: ``DYN_HTTP_PRE_COMMIT_ERROR_PEEK_MS`` is set (docs/dynamo.md, "Errors before the first output").
PRE_COMMIT_ERROR_PEEK_MS = "1000"
_MOCK_LISTENING = re.compile(r"trio-sidecar mock listening on ([0-9.]+):(\d+)")


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1 (the OS picks it; there is a small reuse race)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def dynamo_env(file_kv: str | os.PathLike[str], base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """Environment for Dynamo processes: file discovery in ``file_kv``, TCP planes on loopback, no hub."""
    env = dict(os.environ if base is None else base)
    for key in ("DYN_NAMESPACE", "DYN_NAMESPACE_WORKER_SUFFIX", "DYN_SYSTEM_PORT", "DYN_STORE_KV"):
        env.pop(key, None)
    env.update(
        DYN_FILE_KV=str(file_kv),
        DYN_DISCOVERY_BACKEND="file",
        DYN_REQUEST_PLANE="tcp",
        DYN_TCP_RPC_HOST=LOOPBACK,
        DYN_TCP_RESPONSE_STREAM_HOST=LOOPBACK,
        DYN_EVENT_PLANE_HOST=LOOPBACK,
        DYN_SYSTEM_HOST=LOOPBACK,
        DYN_SELF_HOST_METADATA="0",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        NO_COLOR="1",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


class Process:
    """A child process with its output in a log file; stopped by PID only."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        log_path: Path,
        stdout: int | IO[Any] | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            self.argv,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=self._log if stdout is None else stdout,
            stderr=self._log,
        )
        self.started = time.monotonic()
        self.terminated = False  # SIGTERM already sent: stop() must not send a second one

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def send_signal(self, signum: int) -> None:
        if self.alive():
            os.kill(self.pid, signum)
            if signum == signal.SIGTERM:
                self.terminated = True

    def wait(self, timeout: float) -> int | None:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, grace: float = 15.0) -> int | None:
        """SIGTERM (unless already sent: a second one means "exit now" to a worker), wait up to ``grace``,
        then SIGKILL. Returns the exit code (negative for a signal)."""
        if self.alive():
            if not self.terminated:
                self.send_signal(signal.SIGTERM)
            if self.wait(grace) is None:
                self.send_signal(signal.SIGKILL)
                self.wait(10)
        if self.popen.stdout is not None:
            self.popen.stdout.close()
        self._log.close()
        return self.popen.returncode

    def __repr__(self) -> str:
        state = "running" if self.alive() else f"exited {self.popen.returncode}"
        return f"<Process {self.name} pid={self.pid} {state}>"


def start_frontend(
    workdir: Path,
    env: Mapping[str, str],
    *,
    namespace: str | None = None,
    router_mode: str | None = None,
    extra: Sequence[str] = (),
    port: int | None = None,
    timeout: float = 120.0,
    attempts: int = 3,
) -> tuple[Process, int]:
    """``python -m dynamo.frontend`` on 127.0.0.1; returns the process and its HTTP port once it accepts.

    Without an explicit ``port`` a free one is picked; if another process takes it first (the frontend then
    exits), a new port is tried, up to ``attempts`` times.
    """
    for _ in range(1 if port else attempts):
        http_port = port or free_port()
        argv = [
            sys.executable,
            "-m",
            "dynamo.frontend",
            "--http-host",
            LOOPBACK,
            "--http-port",
            str(http_port),
            "--discovery-backend",
            "file",
            "--request-plane",
            "tcp",
        ]
        if namespace:
            argv += ["--namespace", namespace]
        if router_mode:
            argv += ["--router-mode", router_mode]
        argv += list(extra)
        proc = Process(
            "frontend",
            argv,
            env={"DYN_HTTP_PRE_COMMIT_ERROR_PEEK_MS": PRE_COMMIT_ERROR_PEEK_MS, **env},
            log_path=workdir / f"frontend-{http_port}.log",
        )
        if _wait_accepting(http_port, proc, timeout):
            return proc, http_port
        proc.stop()
    raise RuntimeError(f"the Dynamo frontend did not start: {proc.log()[-3000:]}")


def _wait_accepting(port: int, proc: Process, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            return False
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.settimeout(1.0)
            if sock.connect_ex((LOOPBACK, port)) == 0:
                return True
        time.sleep(0.05)
    return False


def start_mock(
    workdir: Path,
    env: Mapping[str, str],
    *,
    model: str,
    served_model_name: str | None = None,
    mode: str = "aggregated",
    engine_args: Mapping[str, Any] | None = None,
    seed: int | None = None,
    timeout: float = 60.0,
    name: str = "mock",
) -> tuple[Process, str]:
    """``trio-sidecar mock`` on 127.0.0.1:0; returns the process and its ``IP:PORT`` (read from stdout)."""
    argv = [
        sys.executable,
        "-m",
        "trio_sidecar",
        "mock",
        "--listen",
        f"{LOOPBACK}:0",
        "--model",
        model,
        "--disaggregation-mode",
        mode,
    ]
    if served_model_name:
        argv += ["--served-model-name", served_model_name]
    if engine_args:
        argv += ["--extra-engine-args", json.dumps(dict(engine_args))]
    if seed is not None:
        argv += ["--seed", str(seed)]
    out_path = workdir / f"{name}.out"
    out = open(out_path, "wb")  # noqa: SIM115 - owned by the Process
    proc = Process(name, argv, env=env, log_path=workdir / f"{name}.log", stdout=out)
    proc.popen.stdout = out  # closed by stop()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = _MOCK_LISTENING.search(out_path.read_text(errors="replace"))
        if match:
            return proc, f"{match.group(1)}:{match.group(2)}"
        if not proc.alive():
            break
        time.sleep(0.05)
    log = proc.log()
    proc.stop()
    raise RuntimeError(f"the mock did not start: {log[-2000:]}")


def start_trio_sidecar(
    workdir: Path,
    env: Mapping[str, str],
    grpc_endpoint: str,
    *,
    namespace: str,
    extra: Sequence[str] = (),
    name: str = "trio-sidecar",
) -> Process:
    return _start_sidecar(("trio_sidecar", "run"), workdir, env, grpc_endpoint, namespace, extra, name)


def start_native_sidecar(
    workdir: Path,
    env: Mapping[str, str],
    grpc_endpoint: str,
    *,
    namespace: str,
    extra: Sequence[str] = (),
    name: str = "native-sidecar",
) -> Process:
    """Dynamo's own Rust sidecar (``python -m dynamo.vllm.sidecar``), the differential-test oracle."""
    return _start_sidecar(("dynamo.vllm.sidecar",), workdir, env, grpc_endpoint, namespace, extra, name)


def _start_sidecar(
    module: Sequence[str],
    workdir: Path,
    env: Mapping[str, str],
    grpc_endpoint: str,
    namespace: str,
    extra: Sequence[str],
    name: str,
) -> Process:
    """Either sidecar with the same flags: file discovery, the TCP request plane, the given namespace."""
    argv = [sys.executable, "-m", *module, "--grpc-endpoint", grpc_endpoint]
    argv += ["--discovery-backend", "file", "--request-plane", "tcp", "--namespace", namespace, *extra]
    return Process(name, argv, env=env, log_path=workdir / f"{name}.log")


# --- HTTP (OpenAI surface of the frontend) -----------------------------------------------------------------


def _connection(port: int, timeout: float) -> http.client.HTTPConnection:
    return http.client.HTTPConnection(LOOPBACK, port, timeout=timeout)


def get_json(port: int, path: str, *, timeout: float = 10.0) -> tuple[int, Any]:
    conn = _connection(port, timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        body = resp.read()
        return resp.status, json.loads(body) if body else None
    finally:
        conn.close()


def post_json(
    port: int, path: str, payload: Mapping[str, Any], *, timeout: float = 60.0, headers: Mapping[str, str] | None = None
) -> tuple[int, Any]:
    """POST ``payload`` as JSON (with extra request ``headers``); returns the status and the decoded body."""
    conn = _connection(port, timeout)
    try:
        conn.request(
            "POST", path, body=json.dumps(payload), headers={"content-type": "application/json", **(headers or {})}
        )
        resp = conn.getresponse()
        body = resp.read()
        try:
            return resp.status, json.loads(body)
        except ValueError:
            return resp.status, body.decode(errors="replace")
    finally:
        conn.close()


@contextlib.contextmanager
def stream_sse(port: int, path: str, payload: Mapping[str, Any], *, timeout: float = 60.0) -> Iterator[Iterator[Any]]:
    """POST a streaming request; yields an iterator of decoded SSE ``data:`` events (``[DONE]`` ends it).

    Leaving the block closes the connection (a client disconnect when the stream is not finished).
    """
    conn = _connection(port, timeout)
    try:
        conn.request(
            "POST",
            path,
            body=json.dumps(payload),
            headers={"content-type": "application/json", "accept": "text/event-stream"},
        )
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:500]!r}")

        def events() -> Iterator[Any]:
            while True:
                line = resp.readline()
                if not line:
                    return
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                yield json.loads(data)

        yield events()
    finally:
        with contextlib.suppress(OSError):
            if conn.sock is not None:
                conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()


def list_models(port: int) -> list[str]:
    try:
        status, body = get_json(port, "/v1/models", timeout=5.0)
    except (OSError, http.client.HTTPException, ValueError):
        return []
    if status != 200 or not isinstance(body, dict):
        return []
    return [m.get("id") for m in body.get("data", [])]


def frontend_instances(port: int, namespace: str, endpoint: str = "generate") -> list[dict[str, Any]]:
    """The worker instances the frontend on ``port`` currently lists in its ``/health`` for ``endpoint`` of
    ``namespace`` (``[]`` while it does not answer 200)."""
    try:
        status, body = get_json(port, "/health", timeout=5.0)
    except (OSError, http.client.HTTPException, ValueError):
        return []
    if status != 200 or not isinstance(body, dict):
        return []
    return [
        i
        for i in body.get("instances", [])
        if isinstance(i, dict) and i.get("namespace") == namespace and i.get("endpoint") == endpoint
    ]


def wait_for_models(port: int, names: Sequence[str], *, timeout: float = 120.0, watch: Sequence[Process] = ()) -> float:
    """Poll ``/v1/models`` until every name is listed; returns the seconds waited.

    Raises:
        RuntimeError: the timeout passed or a watched process exited (its log tail is included).
    """
    start = time.monotonic()
    while True:
        if set(names) <= set(list_models(port)):
            return time.monotonic() - start
        for proc in watch:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}: {proc.log()[-3000:]}")
        if time.monotonic() - start > timeout:
            tails = "\n".join(f"--- {p.name}\n{p.log()[-2000:]}" for p in watch)
            raise RuntimeError(f"models {list(names)} not listed after {timeout}s\n{tails}")
        time.sleep(0.1)


def wait_for_no_model(port: int, name: str, *, timeout: float) -> float | None:
    """Poll until ``name`` is no longer listed; returns the seconds waited, or None on timeout."""
    start = time.monotonic()
    while time.monotonic() - start <= timeout:
        if name not in list_models(port):
            return time.monotonic() - start
        time.sleep(0.02)
    return None
