"""Machinery of the native-vs-trio matrix differential (tests/dynamo/test_native_matrix.py): run one sidecar
family against a mock, wait until it registered (or exited), and collect everything another process can
observe of it.

Each side has its own file-discovery store, so both sides run with the same namespace and nothing needs to be
renamed before comparing; every case uses its own namespace inside the store. One long-lived request-plane
client per side (``Client``) sends the same ``PreprocessedRequest`` to each registered generate endpoint, and
the mock records what each sidecar forwarded.
"""

from __future__ import annotations

import http.client
import json
import re
import select
import subprocess
import sys
import textwrap
import time
import urllib.parse
from pathlib import Path
from typing import Any

from dynamo_harness import free_system_port

from trio_sidecar._devtools import local

SIDES = ("native", "trio")
MODULES = {"native": ("dynamo.vllm.sidecar",), "trio": ("trio_sidecar", "run")}

# One request through the request plane: token ids, two tokens, greedy. The mock seeds tokens by prompt.
REQUEST: dict[str, Any] = {
    "token_ids": [1, 2, 3, 4, 5, 6, 7, 8],
    "stop_conditions": {"max_tokens": 2, "ignore_eos": True},
    "sampling_options": {"temperature": 0.0},
    "output_options": {},
    "eos_token_ids": [2],
}

_CLIENT = textwrap.dedent(
    """
    import asyncio, json, sys
    from dynamo.runtime import DistributedRuntime

    async def main():
        runtime = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp")
        loop = asyncio.get_running_loop()
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                break
            cmd = json.loads(line)
            try:
                client = await runtime.endpoint(cmd["endpoint"]).client()
                await asyncio.wait_for(client.wait_for_instances(), 30)
                stream = await client.generate(cmd["request"])
                out = {"ok": [item.data() async for item in stream]}
            except Exception as exc:  # reported to the test
                out = {"error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps(out), flush=True)
        runtime.shutdown()

    asyncio.run(main())
    """
)


class Client:
    """A Dynamo request-plane client on one side's store (a subprocess driven over stdin/stdout).

    Every endpoint client watches the store (inotify instances are limited per user on Linux, and shared by
    everything on the machine), so the process is replaced after ``RECYCLE`` requests to release them.
    """

    RECYCLE = 8

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.sent = 0
        self.proc = self._start()

    def _start(self) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-c", _CLIENT],
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )

    def generate(self, endpoint: str, request: dict[str, Any]) -> dict[str, Any]:
        if self.sent == self.RECYCLE:
            self.close()
            self.proc, self.sent = self._start(), 0
        self.sent += 1
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"endpoint": endpoint, "request": request}) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], 120)
        if not ready:
            raise AssertionError(f"no answer from {endpoint} within 120 s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the request-plane client exited")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _store_entries(store: Path, kind: str, namespace: str) -> list[tuple[str, dict[str, Any]]]:
    """``(key, record)`` of every ``v1/{kind}`` entry whose key names ``namespace``."""
    out = []
    for path in sorted((store / "v1" / kind).glob("*")):
        key = urllib.parse.unquote(path.name)
        if namespace not in key:
            continue
        try:
            out.append((key, json.loads(path.read_text())))
        except (OSError, ValueError):
            continue
    return out


def start_side(
    side: str, workdir: Path, store: Path, grpc: str, args: tuple[str, ...], env: dict[str, str], name: str
) -> tuple[local.Process, int]:
    """One sidecar of ``side`` (``native``/``trio``) on ``grpc``; returns it and its system (metrics) port."""
    port = free_system_port()
    full_env = {**local.dynamo_env(store), "DYN_SYSTEM_PORT": str(port), "DYN_SYSTEM_ENABLED": "true", **env}
    argv = [sys.executable, "-m", *MODULES[side], "--grpc-endpoint", grpc, "--discovery-backend", "file"]
    argv += ["--request-plane", "tcp", *args]
    if side == "trio":
        argv.append("--no-abort-on-cancel")
    return local.Process(f"{side}-{name}", argv, env=full_env, log_path=workdir / f"{side}-{name}.log"), port


def wait_settled(proc: local.Process, store: Path, namespace: str, cards: int, timeout: float) -> None:
    """Until ``proc`` exited, or registered ``cards`` model cards and nothing it registers changed for 2 s
    (KV publishers and their query endpoints are registered one by one)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    stable_since = time.monotonic()
    while time.monotonic() < deadline:
        if not proc.alive():
            return
        if len(_store_entries(store, "mdc", namespace)) >= cards:
            now = _snapshot(store, namespace)
            if now != last:
                last, stable_since = now, time.monotonic()
            elif time.monotonic() - stable_since >= 2.0:
                return
        time.sleep(0.2)
    raise AssertionError(f"{proc.name} neither registered nor exited within {timeout}s: {proc.log()[-3000:]}")


def _snapshot(store: Path, namespace: str) -> list[str]:
    return sorted(
        key
        for kind in ("mdc", "instances", "event_sources", "event_channels")
        for key, _ in _store_entries(store, kind, namespace)
    )


_ERROR_LINE = re.compile(r"^(?:[A-Za-z]*Error|Exception|error|Error): (.*)$")
_ERROR_KINDS = ("Internal: ", "InvalidArgument: ", "InvalidRequest: ", "EngineShutdown: ", "CannotConnect: ")


def error_line(log: str) -> str | None:
    """The startup error a side printed as its last error line (native: the Python launcher's exception,
    ``ValueError: Internal: …``; trio-sidecar: ``error: …``), without the exception and error-kind prefixes."""
    for line in reversed(log.splitlines()):
        match = _ERROR_LINE.match(line.strip())
        if match:
            text = match.group(1).strip()
            for kind in _ERROR_KINDS:
                text = text.removeprefix(kind)
            return text
    return None


def registration(store: Path, namespace: str) -> dict[str, Any]:
    """Model cards by ``component/endpoint``, event sources/channels and served endpoints: what the side
    wrote into its store."""
    cards = {}
    for _key, record in _store_entries(store, "mdc", namespace):
        cards[f"{record['component']}/{record['endpoint']}"] = record["card_json"]
    events = set()
    for kind in ("event_sources", "event_channels"):
        for _key, record in _store_entries(store, kind, namespace):
            scope = record["scope"]["endpoint"]
            events.add((kind, scope["component"], scope["name"], record["topic"]))
    endpoints = sorted({(r["component"], r["endpoint"]) for _k, r in _store_entries(store, "instances", namespace)})
    return {"cards": cards, "events": events, "endpoints": endpoints}


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def scrape(port: int) -> dict[str, set[tuple[tuple[str, str], ...]]]:
    """``/metrics`` as {sample name: label sets}; values are dropped (they depend on timing)."""
    conn = http.client.HTTPConnection(local.LOOPBACK, port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    except OSError:
        return {}
    finally:
        conn.close()
    families: dict[str, set[tuple[tuple[str, str], ...]]] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match or line.startswith("#"):
            continue
        labels = tuple(sorted(_LABEL.findall(match.group(2) or "")))
        families.setdefault(match.group(1), set()).add(labels)
    return families
