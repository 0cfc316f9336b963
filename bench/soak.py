#!/usr/bin/env python3
"""Soak: a mixed load through ``dynamo.frontend``, the native sidecar and trio-sidecar side by side.

Usage: python bench/soak.py [--backend grpcio|mock|grpcio,mock] [--duration S] [--idle S] [--clients N] [--pace-ms P]
                            [--sides native,trio] [--json PATH]

Each side (``native``: ``python -m dynamo.vllm.sidecar``; ``trio``: ``trio-sidecar run``) gets its own vLLM
stand-in, its own frontend and its own Dynamo namespace, all on 127.0.0.1 and all at once, so both see the
same machine at the same moment (with two backends, four sides run at once). The stand-in (``--backend``) is

* ``grpcio``: a ``grpc.aio`` server (gRPC-core, stock policies: keepalive ping enforcement, GOAWAY) that
  streams the mock's deterministic tokens ``--pace-ms`` apart (``trio_sidecar/_devtools/grpcio_vllm.py``), or
* ``mock``: the project's mock, paced by its timing model (``speedup_ratio`` 1).

After ``--idle`` seconds without traffic (a sidecar must stay serving while idle), ``--clients`` clients per
side loop for ``--duration`` seconds over four kinds of request, in turn:

* ``unary``: a non-streaming completion of 16 tokens: HTTP 200, ``finish_reason`` ``length``, 16 tokens;
* ``stream``: a streaming chat completion of 32 tokens: HTTP 200, ``[DONE]``, 32 tokens in the usage;
* ``dropped``: a streaming completion of 2,000 tokens whose client closes the connection after 3 events;
* ``invalid``: a completion with ``top_k`` -5, which both sidecars refuse before vLLM: HTTP 400.

Checked per side, at the end: every answer as expected (any other status, a 503 included, is unexpected);
every engine stream ended within 15 s of the load's end; no dropped stream ran to its end (the grpcio
stand-in counts streams of the dropped length that sent their last token); the sidecar's RSS grew by less
than 64 MiB between the end of the first tenth of the load and its end. Exit status 1 when trio-sidecar
fails a check (the native side is the reference: its results are printed, not judged), 0 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import attrs  # noqa: E402
import psutil  # noqa: E402

from trio_sidecar._devtools import local  # noqa: E402
from trio_sidecar.mock.tiny_model import make_tiny_model  # noqa: E402

MODEL = "tiny"
UNARY_TOKENS = 16
STREAM_TOKENS = 32
DROP_TOKENS = 2000
DROP_AFTER_EVENTS = 3
RSS_GROWTH_LIMIT = 64 * 1024 * 1024
SIDES = ("native", "trio")
KINDS = ("unary", "stream", "dropped", "invalid")


# --- the load client (HTTP/1.0 over asyncio streams: the server closes to end a body) -----------------------


async def _request(port: int, path: str, body: dict, *, drop_after: int | None = None) -> tuple[int, Any]:
    """POST ``body``; returns ``(status, parsed)``: the JSON body, or for a stream the list of its data events
    (``"[DONE]"`` included). ``drop_after``: close the connection after that many data events (status 0 when
    it ended before)."""
    raw = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(local.LOOPBACK, port)
    try:
        writer.write(
            f"POST {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Connection: close\r\nContent-Length: {len(raw)}\r\n\r\n".encode()
            + raw
        )
        await writer.drain()
        status_line = await reader.readline()
        try:
            status = int(status_line.split()[1])
        except (IndexError, ValueError):
            return -1, status_line
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            pass
        if not body.get("stream") or status != 200:
            text = await reader.read()
            try:
                return status, json.loads(text)
            except ValueError:
                return status, text
        events: list[Any] = []
        while line := await reader.readline():
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
            if drop_after is not None and len(events) >= drop_after:
                return status, events
        return (0 if drop_after is not None else status), events
    finally:
        writer.close()


def _check_unary(status: int, body: Any) -> str | None:
    if status != 200:
        return f"HTTP {status}: {str(body)[:200]}"
    choice = body["choices"][0]
    if choice.get("finish_reason") != "length" or body["usage"]["completion_tokens"] != UNARY_TOKENS:
        return f"unexpected completion: {str(body)[:200]}"
    return None


def _check_stream(status: int, events: Any) -> str | None:
    if status != 200:
        return f"HTTP {status}: {str(events)[:200]}"
    if not events or events[-1] != "[DONE]":
        return f"stream without [DONE] ({len(events)} events)"
    usage = [e["usage"] for e in events[:-1] if isinstance(e, dict) and e.get("usage")]
    if not usage or usage[-1]["completion_tokens"] != STREAM_TOKENS:
        return f"stream usage {usage[-1:]}"
    return None


def _check_dropped(status: int, events: Any) -> str | None:
    if status != 200:
        return f"HTTP {status}: {str(events)[:200]}"
    return None


def _check_invalid(status: int, body: Any) -> str | None:
    return None if status == 400 else f"HTTP {status} (expected 400): {str(body)[:200]}"


async def _one(port: int, kind: str) -> str | None:
    if kind == "unary":
        body = {"model": MODEL, "prompt": "soak", "max_tokens": UNARY_TOKENS, "ignore_eos": True}
        return _check_unary(*await _request(port, "/v1/completions", body))
    if kind == "stream":
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "soak"}],
            "max_tokens": STREAM_TOKENS,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        return _check_stream(*await _request(port, "/v1/chat/completions", body))
    if kind == "dropped":
        body = {"model": MODEL, "prompt": "soak", "max_tokens": DROP_TOKENS, "ignore_eos": True, "stream": True}
        return _check_dropped(*await _request(port, "/v1/completions", body, drop_after=DROP_AFTER_EVENTS))
    body = {"model": MODEL, "prompt": "soak", "max_tokens": 4, "top_k": -5}
    return _check_invalid(*await _request(port, "/v1/completions", body))


class SideLoad:
    """One side's counters (answers by kind, unexpected answers with their first examples, latencies)."""

    def __init__(self) -> None:
        self.answered: Counter[str] = Counter()
        self.unexpected: Counter[str] = Counter()
        self.examples: list[str] = []
        self.latency: dict[str, list[float]] = {kind: [] for kind in KINDS}

    def record(self, kind: str, problem: str | None, seconds: float) -> None:
        self.answered[kind] += 1
        self.latency[kind].append(seconds)
        if problem is not None:
            self.unexpected[kind] += 1
            if len(self.examples) < 10:
                self.examples.append(f"{kind}: {problem}")


async def _client(port: int, side: SideLoad, deadline: float, offset: int) -> None:
    turn = offset
    while time.monotonic() < deadline:
        kind = KINDS[turn % len(KINDS)]
        turn += 1
        start = time.monotonic()
        try:
            problem = await asyncio.wait_for(_one(port, kind), 60)
        except (TimeoutError, OSError, ValueError, KeyError, IndexError) as exc:
            problem = f"{type(exc).__name__}: {exc}"
        side.record(kind, problem, time.monotonic() - start)


async def _load(ports: dict[str, int], clients: int, duration: float) -> dict[str, SideLoad]:
    deadline = time.monotonic() + duration
    loads = {name: SideLoad() for name in ports}
    await asyncio.gather(
        *(_client(port, loads[name], deadline, i) for name, port in ports.items() for i in range(clients))
    )
    return loads


# --- the deployment ---------------------------------------------------------------------------------------------


class RssSampler:
    """The process's RSS once a second, on a thread: the first sample after ``settle`` seconds, the peak and
    the last."""

    def __init__(self, pid: int, settle: float) -> None:
        self.process = psutil.Process(pid)
        self.settle = settle
        self.settled: int | None = None
        self.peak = 0
        self.last = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        start = time.monotonic()
        while not self._stop.wait(1.0):
            try:
                rss = self.process.memory_info().rss
            except psutil.Error:
                return
            self.peak = max(self.peak, rss)
            self.last = rss
            if self.settled is None and time.monotonic() - start >= self.settle:
                self.settled = rss

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def _backend(kind: str, model: Path, pace_ms: float) -> Any:
    if kind == "grpcio":
        from trio_sidecar._devtools.grpcio_vllm import GrpcioVllm

        return GrpcioVllm(
            model_id=str(model), served_model_name=MODEL, pace=pace_ms / 1e3, watch_max_tokens=DROP_TOKENS
        )
    from trio_sidecar._devtools.mock_thread import MockThread

    return MockThread(
        model=str(model),
        served_model_name=MODEL,
        engine_args={"speedup_ratio": 1.0, "max_num_seqs": 256, "max_model_len": 4096},
        max_concurrent_requests=1024,
        record_requests=False,  # (a soak's traffic would grow the recorded lists)
    )


def _active(backend: Any) -> int:
    return backend.stats.active if hasattr(backend, "stats") else backend.active()


def _side_report(name: str, load: SideLoad, backend: Any, rss: RssSampler, ended: bool) -> dict[str, Any]:
    def pct(values: list[float], q: float) -> float:
        if not values:
            return math.nan
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]

    watched = backend.stats.watched_completed if hasattr(backend, "stats") else None
    growth = (rss.last - rss.settled) if rss.settled is not None else None
    problems = [f"{n} unexpected {kind} answer(s)" for kind, n in load.unexpected.items() if n]
    if not ended:
        problems.append(f"{_active(backend)} engine stream(s) still open 15 s after the load")
    if watched:
        problems.append(f"{watched} dropped stream(s) ran to their end")
    if growth is not None and growth > RSS_GROWTH_LIMIT:
        problems.append(f"RSS grew by {growth / 2**20:.0f} MiB")
    return {
        "side": name,
        "answered": dict(load.answered),
        "unexpected": dict(load.unexpected),
        "examples": load.examples,
        "latency_p50_ms": {k: pct(v, 50) * 1e3 for k, v in load.latency.items()},
        "latency_p99_ms": {k: pct(v, 99) * 1e3 for k, v in load.latency.items()},
        "streams": {**attrs.asdict(backend.stats), "active": _active(backend)}
        if hasattr(backend, "stats")
        else {"active": _active(backend)},
        "rss_mib": {
            "settled": (rss.settled or 0) / 2**20,
            "peak": rss.peak / 2**20,
            "last": rss.last / 2**20,
        },
        "problems": problems,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every (backend, side) pair at once: its own stand-in, frontend, namespace and sidecar."""
    pairs = [(backend, side) for backend in args.backend.split(",") for side in args.sides.split(",")]
    names = [f"{side}@{backend}" for backend, side in pairs]
    with tempfile.TemporaryDirectory(prefix="trio-sidecar-soak-") as tmp:
        work = Path(tmp)
        model = make_tiny_model(work / "tiny-model")
        env = local.dynamo_env(work / "kv")
        backends: dict[str, Any] = {}
        processes: list[local.Process] = []
        ports: dict[str, int] = {}
        sidecars: dict[str, local.Process] = {}
        try:
            for name, (backend_kind, side) in zip(names, pairs, strict=True):
                backend = backends[name] = _backend(backend_kind, model, args.pace_ms).start()
                namespace = f"soak-{side}-{backend_kind}"
                frontend, ports[name] = local.start_frontend(work, env, namespace=namespace)
                processes.append(frontend)
                start = local.start_native_sidecar if side == "native" else local.start_trio_sidecar
                sidecar = sidecars[name] = start(work, env, backend.address, namespace=namespace, name=name)
                processes.append(sidecar)
            for name in names:
                local.wait_for_models(ports[name], [MODEL], timeout=180, watch=[sidecars[name]])
            if args.idle:
                print(f"idle for {args.idle:g} s", flush=True)
                time.sleep(args.idle)
            print(f"{args.clients} client(s) per side for {args.duration:g} s: {', '.join(names)}", flush=True)
            samplers = {name: RssSampler(sidecars[name].pid, args.duration / 10) for name in names}
            for sampler in samplers.values():
                sampler.__enter__()
            try:
                loads = asyncio.run(_load(ports, args.clients, args.duration))
            finally:
                for sampler in samplers.values():
                    sampler.__exit__()
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and any(_active(b) for b in backends.values()):
                time.sleep(0.1)
            reports = [
                _side_report(name, loads[name], backends[name], samplers[name], _active(backends[name]) == 0)
                for name in names
            ]
            for name, report in zip(names, reports, strict=True):
                if not sidecars[name].alive():
                    report["problems"].append("the sidecar exited")
        finally:
            for proc in reversed(processes):
                proc.stop(grace=5)
            for backend in backends.values():
                backend.stop()
    return {"duration_s": args.duration, "idle_s": args.idle, "clients_per_side": args.clients, "sides": reports}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="grpcio", help="grpcio (default), mock, or grpcio,mock (both at once)")
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of load (default 180)")
    parser.add_argument("--idle", type=float, default=0.0, help="seconds without traffic before the load")
    parser.add_argument("--clients", type=int, default=24, help="concurrent clients per side (default 24)")
    parser.add_argument("--pace-ms", type=float, default=2.0, help="grpcio stand-in: ms between tokens")
    parser.add_argument("--sides", default="native,trio", help="native,trio (default), or one of them")
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    report = run(args)
    failed = False
    for side in report["sides"]:
        answered = sum(side["answered"].values())
        print(
            f"{side['side']:>12}: {answered} answered {side['answered']}; unexpected {side['unexpected']}; "
            f"streams {side['streams']}; RSS MiB settled {side['rss_mib']['settled']:.0f} "
            f"peak {side['rss_mib']['peak']:.0f} last {side['rss_mib']['last']:.0f}"
        )
        for example in side["examples"]:
            print(f"        {example}")
        for problem in side["problems"]:
            print(f"        problem: {problem}")
        if side["side"].startswith("trio@") and side["problems"]:
            failed = True
    by_name = {side["side"]: sum(side["answered"].values()) for side in report["sides"]}
    for backend in args.backend.split(","):
        native, trio = by_name.get(f"native@{backend}"), by_name.get(f"trio@{backend}")
        if native and trio is not None:
            print(f"answered requests against {backend}: trio-sidecar / native = {trio / native:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
