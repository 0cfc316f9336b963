"""Helpers for the Dynamo end-to-end tests (tests/dynamo, tests/launch): an in-process mock on a thread and a
per-module deployment. It sits beside the root conftest, whose directory pytest puts on the import path."""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from trio_sidecar._devtools import local
from trio_sidecar._devtools.mock_thread import MockThread  # noqa: F401  (re-exported for the tests)

REPO = Path(__file__).resolve().parents[1]

FAST_ENGINE_ARGS = {
    "block_size": 4,
    "num_gpu_blocks": 4096,
    "max_num_seqs": 64,
    "max_num_batched_tokens": 1024,
    "speedup_ratio": 0.0,
}


def require_dynamo() -> None:
    """Skip (only) when the Dynamo packages are not installed."""
    pytest.importorskip("dynamo.llm", reason="ai-dynamo-runtime 1.6.1 is not installed")
    pytest.importorskip("dynamo.frontend", reason="ai-dynamo 1.6.1 (frontend) is not installed")


def make_tiny_model(directory: Path) -> Path:
    spec = importlib.util.spec_from_file_location("make_tiny_model", REPO / "scripts" / "make_tiny_model.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module.make_tiny_model(directory)


def free_system_port() -> int:
    """A free 127.0.0.1 port below 32768: Dynamo 1.6.1 parses ``DYN_SYSTEM_PORT`` as an i16."""
    import random
    import socket

    for _ in range(200):
        port = random.randint(20000, 32000)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below 32768")


class Deployment:
    """One module's processes: a frontend, sidecars and in-process mocks, all torn down by :meth:`close`."""

    def __init__(self, workdir: Path, model: Path) -> None:
        self.workdir = workdir
        self.model = model
        self.namespace = f"t{uuid.uuid4().hex[:10]}"
        self.file_kv = workdir / "file-kv"
        self.file_kv.mkdir(parents=True, exist_ok=True)
        self.env = local.dynamo_env(self.file_kv)
        self.processes: list[local.Process] = []
        self.mocks: list[MockThread] = []
        self.http_port = 0

    def mock(self, **config: Any) -> MockThread:
        config.setdefault("model", str(self.model))
        mock = MockThread(**config).start()
        self.mocks.append(mock)
        return mock

    def frontend(self, env_overrides: dict[str, str] | None = None, **kw: Any) -> local.Process:
        kw.setdefault("namespace", self.namespace)
        proc, self.http_port = local.start_frontend(self.workdir, {**self.env, **(env_overrides or {})}, **kw)
        self.processes.append(proc)
        return proc

    def trio_sidecar(
        self,
        mock: MockThread,
        *extra: str,
        namespace: str | None = None,
        name: str = "trio-sidecar",
        env: dict[str, str] | None = None,
    ) -> local.Process:
        return self._sidecar(local.start_trio_sidecar, mock, extra, namespace, name, env)

    def native_sidecar(
        self,
        mock: MockThread,
        *extra: str,
        namespace: str | None = None,
        name: str = "native-sidecar",
        env: dict[str, str] | None = None,
    ) -> local.Process:
        return self._sidecar(local.start_native_sidecar, mock, extra, namespace, name, env)

    def _sidecar(
        self,
        start: Callable[..., local.Process],
        mock: MockThread,
        extra: tuple[str, ...],
        namespace: str | None,
        name: str,
        env: dict[str, str] | None,
    ) -> local.Process:
        env = {**self.env, **(env or {})}
        proc = start(self.workdir, env, mock.address, namespace=namespace or self.namespace, extra=extra, name=name)
        self.processes.append(proc)
        return proc

    def wait_ready(self, *names: str, timeout: float = 180.0) -> None:
        local.wait_for_models(self.http_port, names, timeout=timeout, watch=self.processes)

    def wait_workers(self, *components: str, timeout: float = 60.0) -> None:
        """Until the frontend's ``/health`` lists a ``generate`` instance of each component in this namespace.

        A model is listed once its first worker registered; in a disaggregated deployment the other worker can
        still be missing from the frontend's view then, and a request meanwhile gets HTTP 503."""
        deadline = time.monotonic() + timeout
        while True:
            listed = {i.get("component") for i in local.frontend_instances(self.http_port, self.namespace)}
            if set(components) <= listed:
                return
            for proc in self.processes:
                assert proc.alive(), f"{proc.name} exited: {proc.log()[-3000:]}"
            assert time.monotonic() < deadline, f"the frontend lists {sorted(listed)}, expected {sorted(components)}"
            time.sleep(0.1)

    def close(self) -> None:
        """Stop everything by PID: all sidecars at once (they unregister), then the frontends, then mocks.

        The native sidecar (the oracle) sometimes takes 5–15 s to exit on SIGTERM in 1.6.1; it gets a short
        grace before SIGKILL so it does not dominate the suite's run time.
        """
        import signal
        import time

        sidecars = [p for p in self.processes if p.name != "frontend"]
        frontends = [p for p in self.processes if p.name == "frontend"]
        for group in (sidecars, frontends):
            start = time.monotonic()
            for proc in group:
                proc.send_signal(signal.SIGTERM)
            for proc in group:
                grace = 3.0 if proc.name.startswith("native") else 15.0
                proc.stop(grace=max(0.1, grace - (time.monotonic() - start)))
        for mock in self.mocks:
            mock.stop()


class Pair:
    """The same mock behind two frontends: ``native`` and ``trio``."""

    def __init__(self, dep, mocks):
        self.dep = dep
        self.mocks = mocks
        self.ports: dict[str, int] = {}

    def post(self, path: str, payload: dict) -> dict[str, tuple[int, object]]:
        return {side: local.post_json(port, path, payload) for side, port in self.ports.items()}

    def stream(self, path: str, payload: dict) -> dict[str, list[dict]]:
        out = {}
        for side, port in self.ports.items():
            with local.stream_sse(port, path, payload) as events:
                out[side] = list(events)
        return out


def start_pair(dep, mode_args: dict[str, tuple[str, ...]], mocks) -> Pair:
    """Each side (``native``, ``trio``) behind its own frontend (its ``--namespace`` scopes discovery to one
    sidecar family), every sidecar of a side on the mock at the same position in ``mocks``."""
    pair = Pair(dep, mocks)
    for side in ("native", "trio"):
        namespace = f"{dep.namespace}-{side}"
        dep.frontend(namespace=namespace)
        pair.ports[side] = dep.http_port
        for mock, args in zip(mocks, mode_args[side], strict=True):
            if side == "native":
                dep.native_sidecar(mock, *args, namespace=namespace, name=f"native-{len(dep.processes)}")
            else:
                dep.trio_sidecar(
                    mock, "--no-abort-on-cancel", *args, namespace=namespace, name=f"trio-{len(dep.processes)}"
                )
    for port in pair.ports.values():
        local.wait_for_models(port, ["tiny"], timeout=180, watch=dep.processes)
    return pair


def run_on_a_tty(
    args: list[str],
    env: dict[str, str],
    *,
    until: Callable[[bytes], bool] = lambda _out: False,
    timeout: float = 60.0,
    then_signal: signal.Signals | None = None,
) -> tuple[int, str]:
    """``python -m trio_sidecar ARGS`` with its output on a pseudo-terminal (so it draws as for a person).

    Reads until ``until(output)`` holds, the process exits or ``timeout`` passes; then sends ``then_signal``
    (if any) and waits up to 30 s. Returns the exit code and the output; the process is killed by PID if it
    is still running at the end.
    """
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "trio_sidecar", *args],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=slave,
    )
    os.close(slave)
    out = b""
    try:
        deadline = time.monotonic() + timeout
        while not until(out) and proc.poll() is None and time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    out += os.read(master, 65536)
                except OSError:
                    break
        if then_signal is not None and proc.poll() is None:
            proc.send_signal(then_signal)
        code = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    return code, out.decode(errors="replace")


def system_request(port: int, method: str, path: str, payload: dict | None = None) -> tuple[int, object]:
    """One JSON request to a worker's system status server (``DYN_SYSTEM_PORT``): (status, decoded body)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        body = None if payload is None else json.dumps(payload)
        conn.request(method, path, body=body, headers={"content-type": "application/json"} if body else {})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def wait_routes_served(
    port: int, routes: Sequence[tuple[str, str]], *, watch: Sequence[local.Process] = (), timeout: float = 120.0
) -> None:
    """Poll a worker's system server until each ``(method, path)`` route is registered, the process alive.

    ``/health`` is no readiness signal for this: the native sidecar answers ``{"status": "ready"}`` before it has
    reached the engine and registered its engine routes (the port answers "Route not found" for a moment), so a
    test that then stops the engine or calls a route raced the start-up. Any answer but the system server's own
    "Route not found" 404 (a route's own 404 included) means the route is there.
    """
    deadline = time.monotonic() + timeout
    pending = list(routes)
    while pending:
        method, path = pending[0]
        try:
            status, body = system_request(port, method, path, {} if method == "POST" else None)
        except (OSError, http.client.HTTPException, ValueError):
            status, body = 0, None
        if not (status == 404 and isinstance(body, dict) and body.get("error") == "Route not found") and status:
            pending.pop(0)
            continue
        for proc in watch:
            assert proc.alive(), f"{proc.name} exited before serving {method} {path}:\n{proc.log()[-2000:]}"
        assert time.monotonic() < deadline, f"{method} {path} not served on port {port} within {timeout:g}s"
        time.sleep(0.05)
