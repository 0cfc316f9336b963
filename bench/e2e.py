#!/usr/bin/env python3
"""End-to-end benchmark: trio-sidecar vs Dynamo's native (Rust) vLLM sidecar.

Usage: python bench/e2e.py [--requests N] [--concurrency C] [--max-tokens T] [--rounds R] [--ceiling]
                           [--reference] [--candidate DIR] [--candidate-python PATH] [--candidate-env NAME=VALUE]
                           [--speedup-ratio S] [--pin] [--json PATH]

One invocation, one mock vLLM server and one ``python -m dynamo.frontend``, all on 127.0.0.1. Each sidecar
is started in turn (the native ``python -m dynamo.vllm.sidecar``, then ``trio-sidecar run``, alternating
for ``--rounds``), measured, and stopped by PID before the other starts, so both see the same frontend and
the same mock. Per sidecar:

* startup: process spawn → the model is listed in the frontend's ``/v1/models``;
* completions/s and tokens/s for N streaming ``/v1/completions`` at C concurrent streams
  (``ignore_eos``, ``max_tokens`` T; tokens counted from the final usage chunk);
* sidecar CPU seconds per 1,000 tokens (user + system of the sidecar process, during the load only);
* sidecar peak RSS during the load;
* SSE events per completion (client side): how many items the worker handed to Dynamo, plus the frontend's
  usage event;
* client-side latency: time to the first SSE event (p50) and to the end of the completion (p50, p99);
* CPU per completion of the mock, the frontend and the load client (this process) while each sidecar is
  measured: what the whole system spends per completion;
* for trio-sidecar, CPU per completion by thread: the Trio thread (gRPC, conversion), the other Python
  threads (the asyncio loop that runs Dynamo's handler, egress threads) and Dynamo's tokio threads.

With ``--ceiling`` four more workers are measured the same way: plain Python Dynamo workers that do no work
(no Trio, no gRPC, no vLLM) and answer each request with ``max_tokens`` synthetic tokens, either one item per
token or one item per request, on Dynamo's two egress paths: pull (the runtime pulls each item from the
handler's async generator; default asyncio loop: the "ceiling" of earlier versions) and push (the handler
declares ``response_sender`` and sends each item itself; uvloop, like Dynamo's own workers). The two item
counts split each path's CPU into a per-request and a per-item part:
``per item = (one per token - one per request) / (max_tokens - 1)``. They do not use the mock (so
``--speedup-ratio`` does not pace them), and their tokens/s is not comparable with the sidecars'.

With ``--reference`` a third worker is measured the same way, through the same mock: the most direct Python
design (``bench/reference_worker.py``: one uvloop loop, ``grpc.aio``, trio-sidecar's pure conversion, push
egress; no Trio, no bridge). Its ratios to native show what a Python worker reaches without trio-sidecar's
bridge and transport, so they separate what comes with serving from Python on Dynamo from what
trio-sidecar's own design costs.

With ``--candidate DIR`` a second trio-sidecar is measured in the same rounds, imported from ``DIR`` (a
directory holding a changed copy of the ``trio_sidecar`` package, e.g. another worktree), and its values are
printed as ratios to this checkout's: an A/B whose pairs share the machine's state of the moment. (Six
invocations of such pairs resolve a 1% difference in tokens/s; separate invocations drift by ±4–20%.)
With ``--candidate-python PATH`` the candidate runs on another interpreter, with ``--candidate-env NAME=VALUE``
in another environment (without ``--candidate``: this checkout's code, so the A/B measures the interpreter
or the setting alone). Each round starts with the next worker in
turn (native, trio, candidate; then trio, candidate, native; ...), so no worker always runs first.

With ``--pin`` the worker being measured runs on a CPU of its own and the mock, the frontend and the load
client on the others (as on a GPU node, where the sidecar does not compete with them for CPU).

Prints the values and trio/native ratios with the targets (throughput ≥ 1.0× native, CPU per token ≤ 1.5×
native, time to the first event p99 ≤ 1.0×, the gap between consecutive events p99 ≤ 1.1×, all as the client
sees them). Streaming, paced (``--speedup-ratio 1``) with ``--pin`` is the production shape (the sidecar on a
core of its own); without ``--pin`` everything shares both cores. The mixed load is ``bench/soak.py``. The mock runs with ``speedup_ratio 0`` (no modelled time; ``--speedup-ratio``) so the sidecar path
dominates; on the 2-core reference machine the mock, the frontend, the client and the sidecar share both
cores, so treat absolute numbers as relative only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import math
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import psutil  # noqa: E402

from trio_sidecar._devtools import local  # noqa: E402

MODEL = "tiny"


def _make_tiny_model(directory: Path) -> Path:
    spec = importlib.util.spec_from_file_location("make_tiny_model", REPO / "scripts" / "make_tiny_model.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module.make_tiny_model(directory)


async def _one_stream(port: int, body: bytes, stats: list[tuple[int, float, float, list[float]]] | None = None) -> int:
    """One streaming completion over a fresh connection; returns the completion tokens.

    ``stats`` gets ``(SSE data events, seconds to the first event, seconds to the end, the gaps between
    consecutive data events in seconds)`` appended.

    HTTP/1.0, so the server delimits the body by closing the connection instead of chunked encoding (SSE
    lines then arrive unsplit).
    """
    start = time.perf_counter()
    first = None
    reader, writer = await asyncio.open_connection(local.LOOPBACK, port)
    try:
        writer.write(
            b"POST /v1/completions HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Accept: text/event-stream\r\nConnection: close\r\nContent-Length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )
        await writer.drain()
        status = await reader.readline()
        if b" 200 " not in status:
            raise RuntimeError(f"HTTP status {status!r}")
        tokens = 0
        count = 0
        gaps: list[float] = []
        last = 0.0
        while line := await reader.readline():
            if line.startswith(b"data: {"):
                now = time.perf_counter()
                if first is None:
                    first = now - start
                else:
                    gaps.append(now - last)
                last = now
                count += 1
                if b'"usage":{' in line:
                    usage = json.loads(line[6:]).get("usage") or {}
                    tokens = usage.get("completion_tokens", tokens)
        if stats is not None:
            stats.append((count, first if first is not None else math.nan, time.perf_counter() - start, gaps))
        return tokens
    finally:
        writer.close()


async def _load(
    port: int,
    requests: int,
    concurrency: int,
    max_tokens: int,
    stats: list[tuple[int, float, float, list[float]]] | None = None,
) -> tuple[float, int, int]:
    body = json.dumps(
        {
            "model": MODEL,
            "prompt": "benchmark prompt for the sidecar",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    tokens = 0
    failures = 0

    async def worker() -> None:
        nonlocal tokens, failures
        while not queue.empty():
            queue.get_nowait()
            try:
                got = await _one_stream(port, body, stats)  # not `tokens += await ...`: reads before awaiting
            except (OSError, RuntimeError):
                failures += 1
            else:
                tokens += got

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - start, tokens, failures


class _RssSampler:
    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self.proc.memory_info().rss)
            except psutil.Error:
                return
            self._stop.wait(0.05)

    def __enter__(self) -> _RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


ECHO_WORKER = """
import asyncio, sys
from dynamo.llm import ModelInput, ModelType, WorkerType, register_model
from dynamo.runtime import DistributedRuntime

MODEL_DIR, NAMESPACE, EGRESS, ITEMS, LOOP = sys.argv[1:6]


async def chunks(request):
    n = (request.get("stop_conditions") or {}).get("max_tokens") or 16
    step = 1 if ITEMS == "token" else n
    for start in range(0, n, step):
        end = min(n, start + step)
        chunk = {"token_ids": list(range(1000 + start, 1000 + end)), "index": 0}
        if end == n:
            p = len(request["token_ids"])
            chunk.update(finish_reason="length",
                         completion_usage={"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n})
        yield chunk


async def pull(request, context):
    async for chunk in chunks(request):
        yield chunk


def push(request, context=None, response_sender=None):  # a response_sender parameter selects push egress
    if response_sender is None:
        return pull(request, context)
    return _push(request, response_sender)


async def _push(request, sender):
    async for chunk in chunks(request):
        sender.send(chunk)
    sender.close()
    if False:
        yield


async def serve():
    runtime = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp")
    endpoint = runtime.endpoint(NAMESPACE + ".backend.generate")
    serving = asyncio.ensure_future(endpoint.serve_endpoint(push if EGRESS == "push" else pull))
    await register_model(ModelInput.Tokens, ModelType.Chat | ModelType.Completions, endpoint, MODEL_DIR,
                         "tiny", worker_type=WorkerType.Aggregated)
    import signal
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, runtime.shutdown)
    await serving

if LOOP == "uvloop":
    import uvloop
    uvloop.run(serve())
else:
    asyncio.run(serve())
"""

# --ceiling workers: kind -> (egress, items, loop)
CEILINGS = {
    "py-pull-token": ("pull", "token", "asyncio"),
    "py-pull-request": ("pull", "request", "asyncio"),
    "py-push-token": ("push", "token", "uvloop"),
    "py-push-request": ("push", "request", "uvloop"),
}
TICK = os.sysconf("SC_CLK_TCK")


def _thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread group: "main" (the process's first thread), else the thread's name."""
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = "main" if int(tid) == pid else stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / TICK
    return out


def _cpu_s(process: psutil.Process) -> float:
    """User + system CPU seconds of a process (its own threads only)."""
    times = process.cpu_times()
    return times.user + times.system


def _measure(kind: str, workdir: Path, env: dict, address: str, port: int, args) -> dict:
    with _pinned(args.worker_cpus):  # (inherited by the worker and every thread it starts)
        return _measure_pinned(kind, workdir, env, address, port, args)


@contextlib.contextmanager
def _pinned(cpus: set[int] | None) -> Iterator[None]:
    """Run the block with this process's CPU affinity set to ``cpus`` (None: unchanged)."""
    if cpus is None:
        yield
        return
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, saved)


def _measure_pinned(kind: str, workdir: Path, env: dict, address: str, port: int, args) -> dict:
    namespace = f"bench-{kind}"
    start = time.monotonic()
    if kind == "native":
        proc = local.start_native_sidecar(workdir, env, address, namespace=namespace, name=f"{kind}-sidecar")
    elif kind == "reference":
        proc = local.Process(
            f"{kind}-worker",
            [sys.executable, str(REPO / "bench" / "reference_worker.py"), args.model_dir, namespace, address, MODEL],
            env=env,
            log_path=workdir / f"{kind}-worker.log",
        )
    elif kind == "candidate":
        code = (
            f"import sys; sys.path.insert(0, {str(args.candidate)!r}); "
            "from trio_sidecar.__main__ import main; sys.exit(main())"
        )
        proc = local.Process(
            f"{kind}-sidecar",
            [
                str(args.candidate_python or sys.executable),
                "-c",
                code,
                "run",
                "--grpc-endpoint",
                address,
                "--discovery-backend",
                "file",
                "--request-plane",
                "tcp",
                "--namespace",
                namespace,
                "--log-level",
                "warning",
            ],
            env={**env, **args.candidate_env},
            log_path=workdir / f"{kind}-sidecar.log",
        )
    elif kind in CEILINGS:
        proc = local.Process(
            f"{kind}-worker",
            [sys.executable, "-c", ECHO_WORKER, args.model_dir, namespace, *CEILINGS[kind]],
            env=env,
            log_path=workdir / f"{kind}-worker.log",
        )
    else:
        proc = local.start_trio_sidecar(
            workdir, env, address, namespace=namespace, name=f"{kind}-sidecar", extra=["--log-level", "warning"]
        )
    if args.worker_cpus is not None:
        os.sched_setaffinity(0, args.other_cpus)  # the load client: with the mock and the frontend
    try:
        local.wait_for_models(port, [MODEL], timeout=300, watch=[proc])
        startup = time.monotonic() - start
        asyncio.run(_load(port, min(args.concurrency, args.requests), args.concurrency, args.max_tokens))  # warm-up
        ps = psutil.Process(proc.pid)
        peers = {name: psutil.Process(pid) for name, pid in args.peer_pids.items()}
        peers["client"] = psutil.Process()
        peers_before = {name: _cpu_s(p) for name, p in peers.items()}
        cpu_before = ps.cpu_times()
        threads_before = _thread_cpu(proc.pid)
        stats: list[tuple[int, float, float, list[float]]] = []
        with _RssSampler(proc.pid) as rss:
            elapsed, tokens, failures = asyncio.run(
                _load(port, args.requests, args.concurrency, args.max_tokens, stats)
            )
        cpu_after = ps.cpu_times()
        threads_after = _thread_cpu(proc.pid)
        peers_cpu = {name: _cpu_s(p) - peers_before[name] for name, p in peers.items()}
        cpu = (cpu_after.user - cpu_before.user) + (cpu_after.system - cpu_before.system)
        done = max(args.requests - failures, 1)
        threads = {name: (value - threads_before.get(name, 0.0)) / done * 1e6 for name, value in threads_after.items()}
        return {
            "startup_s": startup,
            "completions_per_s": (args.requests - failures) / elapsed,
            "tokens_per_s": tokens / elapsed,
            "cpu_s_per_1k_tokens": cpu / max(tokens, 1) * 1000,
            "cpu_us_per_completion": cpu / done * 1e6,
            "events_per_completion": sum(s[0] for s in stats) / max(len(stats), 1),
            "ttft_p50_ms": _percentile([s[1] for s in stats], 50) * 1e3,
            "ttft_p99_ms": _percentile([s[1] for s in stats], 99) * 1e3,
            "gap_p50_ms": _percentile([g for s in stats for g in s[3]], 50) * 1e3,
            "gap_p99_ms": _percentile([g for s in stats for g in s[3]], 99) * 1e3,
            "latency_p50_ms": _percentile([s[2] for s in stats], 50) * 1e3,
            "latency_p99_ms": _percentile([s[2] for s in stats], 99) * 1e3,
            "thread_cpu_us_per_completion": threads,
            "peer_cpu_us_per_completion": {name: v / done * 1e6 for name, v in peers_cpu.items()},
            "peak_rss_mib": rss.peak / 2**20,
            "failures": failures,
            "tokens": tokens,
        }
    finally:
        proc.send_signal(signal.SIGTERM)
        local.wait_for_no_model(port, MODEL, timeout=30)
        proc.stop(grace=10)


METRICS = [
    ("completions/s", "completions_per_s", "{:.1f}", "≥ 1.0×"),
    ("tokens/s", "tokens_per_s", "{:.0f}", "≥ 1.0×"),
    ("CPU s / 1k tokens", "cpu_s_per_1k_tokens", "{:.3f}", "≤ 1.5×"),
    ("CPU µs / completion", "cpu_us_per_completion", "{:.0f}", ""),
    ("SSE events / completion", "events_per_completion", "{:.1f}", ""),
    ("time to first event p50 (ms)", "ttft_p50_ms", "{:.1f}", ""),
    ("time to first event p99 (ms)", "ttft_p99_ms", "{:.1f}", "≤ 1.0×"),
    ("inter-event gap p50 (ms)", "gap_p50_ms", "{:.2f}", ""),
    ("inter-event gap p99 (ms)", "gap_p99_ms", "{:.2f}", "≤ 1.1×"),
    ("completion latency p50 (ms)", "latency_p50_ms", "{:.1f}", ""),
    ("completion latency p99 (ms)", "latency_p99_ms", "{:.1f}", ""),
    ("peak RSS (MiB)", "peak_rss_mib", "{:.0f}", ""),
    ("startup to registered (s)", "startup_s", "{:.2f}", ""),
]


def _percentile(values: list[float], pct: float) -> float:
    values = sorted(v for v in values if v == v)
    if not values:
        return math.nan
    return values[min(len(values) - 1, int(len(values) * pct / 100))]


def _median_runs(runs: list[dict]) -> dict:
    med = {
        key: statistics.median(r[key] for r in runs) for key, value in runs[0].items() if not isinstance(value, dict)
    }
    names = {name for r in runs for name in r["thread_cpu_us_per_completion"]}
    med["thread_cpu_us_per_completion"] = {
        name: statistics.median(r["thread_cpu_us_per_completion"].get(name, 0.0) for r in runs) for name in names
    }
    if "peer_cpu_us_per_completion" in runs[0]:
        med["peer_cpu_us_per_completion"] = {
            name: statistics.median(r["peer_cpu_us_per_completion"][name] for r in runs)
            for name in runs[0]["peer_cpu_us_per_completion"]
        }
    return med


def _report(results: dict[str, list[dict]], args) -> dict:
    med = {kind: _median_runs(runs) for kind, runs in results.items()}
    pinned = f", worker pinned to CPU {sorted(args.worker_cpus)[0]}" if args.worker_cpus else ""
    print(
        f"\nE2E: {args.requests} streaming completions x {args.max_tokens} tokens at concurrency "
        f"{args.concurrency}, mock speedup_ratio {args.speedup_ratio:g}, median of {args.rounds} round(s), "
        f"same frontend and mock{pinned}\n"
    )
    print("| metric | native | trio-sidecar | ratio (trio/native) | target |")
    print("|---|---:|---:|---:|---|")
    ratios = {}
    for label, key, fmt, target in METRICS:
        n, t = med["native"][key], med["trio"][key]
        ratio = t / n if n else float("nan")
        ratios[key] = ratio
        print(f"| {label} | {fmt.format(n)} | {fmt.format(t)} | {ratio:.2f}x | {target} |")
    threads = med["trio"]["thread_cpu_us_per_completion"]
    trio_thread = threads.get("main", 0.0)
    tokio = sum(v for name, v in threads.items() if name.startswith("tokio"))
    python = sum(v for name, v in threads.items() if name.startswith("python"))
    other = max(0.0, sum(threads.values()) - trio_thread - tokio - python)
    print(
        f"\ntrio-sidecar CPU µs per completion by thread: Trio {trio_thread:.0f}, asyncio loop and egress "
        f"{python:.0f}, Dynamo tokio {tokio:.0f}, other {other:.0f}"
    )
    for kind in ("native", "trio", "candidate", "reference"):
        peers = med.get(kind, {}).get("peer_cpu_us_per_completion")
        if peers:
            total = med[kind]["cpu_us_per_completion"] + sum(peers.values())
            print(
                f"with {kind}: CPU µs per completion of the worker {med[kind]['cpu_us_per_completion']:.0f}, "
                + ", ".join(f"{name} {value:.0f}" for name, value in peers.items())
                + f"; all {total:.0f}"
            )
    reference = med.get("reference")
    if reference is not None:
        native = med["native"]
        print("\nThe reference Python worker (--reference: one uvloop loop, grpc.aio, the same conversion, no Trio):\n")
        print("| metric | native | trio-sidecar | reference | ratio (reference/native) |")
        print("|---|---:|---:|---:|---:|")
        for label, key, fmt, _target in METRICS[:7]:
            n = native[key]
            print(
                f"| {label} | {fmt.format(n)} | {fmt.format(med['trio'][key])} | {fmt.format(reference[key])} | "
                f"{reference[key] / n if n else float('nan'):.2f}x |"
            )
        ratios["reference_tokens_per_s"] = reference["tokens_per_s"] / native["tokens_per_s"]
        ratios["reference_cpu_s_per_1k_tokens"] = reference["cpu_s_per_1k_tokens"] / native["cpu_s_per_1k_tokens"]
    candidate = med.get("candidate")
    if candidate is not None:
        trio_ = med["trio"]
        print(f"\nThe candidate (--candidate {args.candidate}) against this checkout's trio-sidecar, same rounds:\n")
        print("| metric | trio-sidecar | candidate | ratio (candidate/trio-sidecar) |")
        print("|---|---:|---:|---:|")
        for label, key, fmt, _target in METRICS:
            t = trio_[key]
            print(
                f"| {label} | {fmt.format(t)} | {fmt.format(candidate[key])} | "
                f"{candidate[key] / t if t else float('nan'):.3f}x |"
            )
        ratios["candidate_tokens_per_s"] = candidate["tokens_per_s"] / trio_["tokens_per_s"]
        ratios["candidate_cpu_s_per_1k_tokens"] = candidate["cpu_s_per_1k_tokens"] / trio_["cpu_s_per_1k_tokens"]
    ceilings = [kind for kind in CEILINGS if kind in med]
    if ceilings:
        print("\nPython workers that do no work (--ceiling):\n")
        print("| worker | egress | loop | items / completion | tokens/s | CPU µs / completion | CPU s / 1k tokens |")
        print("|---|---|---|---:|---:|---:|---:|")
        for kind in ceilings:
            m = med[kind]
            egress, items, loop = CEILINGS[kind]
            count = args.max_tokens if items == "token" else 1
            print(
                f"| {kind} | {egress} | {loop} | {count} | {m['tokens_per_s']:.0f} | "
                f"{m['cpu_us_per_completion']:.0f} | {m['cpu_s_per_1k_tokens']:.3f} |"
            )
        if args.max_tokens > 1:
            print()
            for egress in ("pull", "push"):
                per_token, per_request = med.get(f"py-{egress}-token"), med.get(f"py-{egress}-request")
                if per_token and per_request:
                    item = (per_token["cpu_us_per_completion"] - per_request["cpu_us_per_completion"]) / (
                        args.max_tokens - 1
                    )
                    print(
                        f"{egress} egress: ≈ {per_request['cpu_us_per_completion'] - item:.0f} µs CPU per request "
                        f"+ {item:.1f} µs per item"
                    )
    failures = {k: sum(r["failures"] for r in runs) for k, runs in results.items()}
    if any(failures.values()):
        print(f"\nfailed requests: {failures}")
    verdict = {
        "throughput >= 1.0x native": ratios["tokens_per_s"] >= 1.0,
        "cpu per token <= 1.5x native": ratios["cpu_s_per_1k_tokens"] <= 1.5,
        "ttft p99 <= 1.0x native": ratios["ttft_p99_ms"] <= 1.0,
        "inter-event gap p99 <= 1.1x native": ratios["gap_p99_ms"] <= 1.1,
    }
    print("\n" + "  ".join(f"{name}: {'yes' if ok else 'NO'}" for name, ok in verdict.items()))
    return {"median": med, "ratios": ratios, "targets": verdict, "runs": results, "failures": failures}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="trio-sidecar vs native sidecar through one Dynamo frontend")
    parser.add_argument("--requests", type=int, default=640)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1, help="alternating native/trio rounds (median)")
    parser.add_argument(
        "--speedup-ratio",
        type=float,
        default=0.0,
        help="the mock's speedup_ratio: 0 (default) models no time, so tokens arrive in bursts "
        "and the sidecar path dominates; 1 paces decoding like an engine, token by token",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="give the worker being measured a CPU of its own (the last one) and run the mock, "
        "the frontend and the load client on the others, as on a GPU node where the "
        "sidecar does not compete with them (default: all share every CPU)",
    )
    parser.add_argument("--json", type=Path, help="also write the results as JSON")
    parser.add_argument("--keep-logs", action="store_true", help="keep the temporary directory with all logs")
    parser.add_argument(
        "--reference",
        action="store_true",
        help="also measure the reference Python worker (bench/reference_worker.py: Dynamo's loop, "
        "grpc.aio, the same conversion, no Trio) through the same mock",
    )
    parser.add_argument(
        "--candidate",
        type=Path,
        metavar="DIR",
        help="also measure a trio-sidecar imported from DIR (which holds a changed trio_sidecar "
        "package) in the same rounds, and print its ratios to this checkout's",
    )
    parser.add_argument(
        "--candidate-python",
        type=Path,
        metavar="PATH",
        help="run the candidate with this Python interpreter (which must have trio-sidecar's "
        "dependencies and Dynamo's runtime installed); without --candidate, the candidate is this "
        "checkout's own code: an A/B of the interpreter alone",
    )
    parser.add_argument(
        "--candidate-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="set this environment variable for the candidate only (repeatable; e.g. "
        "DYN_SIDECAR_GRPC_CONNECTIONS=2); without --candidate, the candidate is this checkout's code",
    )
    parser.add_argument(
        "--ceiling",
        action="store_true",
        help="also measure Python workers that do no work (pull/push egress, one item per "
        "token/request): per-request and per-item CPU of a Python handler on Dynamo",
    )
    args = parser.parse_args(argv)
    args.worker_cpus = args.other_cpus = None
    if args.pin:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            parser.error("--pin needs at least 2 CPUs")
        args.worker_cpus = {cpus[-1]}
        args.other_cpus = set(cpus[:-1])
        os.sched_setaffinity(0, args.other_cpus)  # the mock and the frontend inherit it
    try:
        args.candidate_env = dict(item.split("=", 1) for item in args.candidate_env)
    except ValueError:
        parser.error("--candidate-env takes NAME=VALUE")
    if args.candidate is None and (args.candidate_python is not None or args.candidate_env):
        args.candidate = REPO
    if args.candidate is not None:
        args.candidate = args.candidate.resolve()
        if not (args.candidate / "trio_sidecar" / "__init__.py").is_file():
            parser.error(f"--candidate {args.candidate}: no trio_sidecar package in that directory")
    if importlib.util.find_spec("dynamo") is None:
        print("error: Dynamo 1.6.1 is not installed (scripts/install-dynamo.sh .venv/bin/python)", file=sys.stderr)
        return 1

    workdir = Path(tempfile.mkdtemp(prefix="trio-sidecar-bench-"))
    env = local.dynamo_env(workdir / "file-kv", DYN_LOG="warn")
    model = _make_tiny_model(workdir / "tiny-model")
    args.model_dir = str(model)
    procs = []
    try:
        mock, address = local.start_mock(
            workdir,
            env,
            model=str(model),
            served_model_name=MODEL,
            engine_args={"speedup_ratio": args.speedup_ratio, "max_num_seqs": 256},
        )
        procs.append(mock)
        frontend, port = local.start_frontend(workdir, env)
        procs.append(frontend)
        args.peer_pids = {"mock": mock.pid, "frontend": frontend.pid}
        kinds = (
            "native",
            "trio",
            *(("candidate",) if args.candidate else ()),
            *(("reference",) if args.reference else ()),
            *(CEILINGS if args.ceiling else ()),
        )
        results: dict[str, list[dict]] = {kind: [] for kind in kinds}
        for round_ in range(args.rounds):
            shift = round_ % len(kinds)  # each round starts with the next kind: no kind always runs first
            for kind in kinds[shift:] + kinds[:shift]:
                print(f"round {round_ + 1}/{args.rounds}: {kind} ...", flush=True)
                results[kind].append(_measure(kind, workdir, env, address, port, args))
        summary = _report(results, args)
        if args.json:
            args.json.write_text(json.dumps(summary, indent=2))
    finally:
        for proc in reversed(procs):
            proc.stop()
        if args.keep_logs:
            print(f"logs: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
