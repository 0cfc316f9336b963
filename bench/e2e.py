#!/usr/bin/env python3
"""End-to-end benchmark: trio-sidecar vs Dynamo's native (Rust) vLLM sidecar (issue 6, "Performance").

Usage: python bench/e2e.py [--requests N] [--concurrency C] [--max-tokens T] [--rounds R] [--json PATH]

One invocation, one mock vLLM server and one ``python -m dynamo.frontend``, all on 127.0.0.1. Each sidecar
is started in turn (the native ``python -m dynamo.vllm.sidecar``, then ``trio-sidecar run``, alternating
for ``--rounds``), measured, and stopped by PID before the other starts, so both see the same frontend and
the same mock. Per sidecar:

* startup: process spawn → the model is listed in the frontend's ``/v1/models``;
* completions/s and tokens/s for N streaming ``/v1/completions`` at C concurrent streams
  (``ignore_eos``, ``max_tokens`` T; tokens counted from the final usage chunk);
* sidecar CPU seconds per 1,000 tokens (user + system of the sidecar process, during the load only);
* sidecar peak RSS during the load.

With ``--ceiling`` a third worker is measured the same way: a plain asyncio Dynamo worker (no Trio, no gRPC,
no vLLM) that yields ``max_tokens`` synthetic chunks per request. It is the throughput ceiling of *any*
worker whose handler is Python code under Dynamo's bindings, which the native Rust sidecar does not pay.

Prints the values and trio/native ratios with the targets (throughput ≥ 1.0× native, CPU per token ≤ 2×
native). The mock runs with ``speedup_ratio 0`` (no modelled time) so the sidecar path dominates; on the
2-core reference machine the mock, the frontend, the client and the sidecar share both cores, so treat
absolute numbers as relative only.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import psutil  # noqa: E402

from trio_sidecar.dynamo import local  # noqa: E402

MODEL = "tiny"


def _make_tiny_model(directory: Path) -> Path:
    spec = importlib.util.spec_from_file_location("make_tiny_model", REPO / "scripts" / "make_tiny_model.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module.make_tiny_model(directory)


async def _one_stream(port: int, body: bytes) -> int:
    """One streaming completion over a fresh connection; returns the completion tokens.

    HTTP/1.0, so the server delimits the body by closing the connection instead of chunked encoding (SSE
    lines then arrive unsplit).
    """
    reader, writer = await asyncio.open_connection(local.LOOPBACK, port)
    try:
        writer.write(
            b"POST /v1/completions HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Accept: text/event-stream\r\nConnection: close\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        await writer.drain()
        status = await reader.readline()
        if b" 200 " not in status:
            raise RuntimeError(f"HTTP status {status!r}")
        tokens = 0
        while line := await reader.readline():
            if line.startswith(b"data: {") and b'"usage":{' in line:
                usage = json.loads(line[6:]).get("usage") or {}
                tokens = usage.get("completion_tokens", tokens)
        return tokens
    finally:
        writer.close()


async def _load(port: int, requests: int, concurrency: int, max_tokens: int) -> tuple[float, int, int]:
    body = json.dumps({"model": MODEL, "prompt": "benchmark prompt for the sidecar", "max_tokens": max_tokens,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}).encode()
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
                got = await _one_stream(port, body)  # not `tokens += await ...`: that reads before awaiting
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
import asyncio, os, sys
from dynamo.llm import ModelInput, ModelType, WorkerType, register_model
from dynamo.runtime import DistributedRuntime

async def handler(request, context):
    n = (request.get("stop_conditions") or {}).get("max_tokens") or 16
    for i in range(n):
        chunk = {"token_ids": [1000 + i], "index": 0}
        if i == n - 1:
            p = len(request["token_ids"])
            chunk.update(finish_reason="length",
                         completion_usage={"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n})
        yield chunk

async def main():
    runtime = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp")
    endpoint = runtime.endpoint(sys.argv[2] + ".backend.generate")
    serve = asyncio.ensure_future(endpoint.serve_endpoint(handler))
    await register_model(ModelInput.Tokens, ModelType.Chat | ModelType.Completions, endpoint, sys.argv[1],
                         "tiny", worker_type=WorkerType.Aggregated)
    loop = asyncio.get_running_loop()
    import signal
    loop.add_signal_handler(signal.SIGTERM, runtime.shutdown)
    await serve

asyncio.run(main())
"""


def _measure(kind: str, workdir: Path, env: dict, address: str, port: int, args) -> dict:
    namespace = f"bench-{kind}"
    start = time.monotonic()
    if kind == "native":
        proc = local.start_native_sidecar(workdir, env, address, namespace=namespace, name=f"{kind}-sidecar")
    elif kind == "ceiling":
        proc = local.Process(f"{kind}-worker", [sys.executable, "-c", ECHO_WORKER, args.model_dir, namespace],
                             env=env, log_path=workdir / "ceiling-worker.log")
    else:
        proc = local.start_trio_sidecar(workdir, env, address, namespace=namespace, name=f"{kind}-sidecar",
                                        extra=["--log-level", "warning"])
    try:
        local.wait_for_models(port, [MODEL], timeout=300, watch=[proc])
        startup = time.monotonic() - start
        asyncio.run(_load(port, min(args.concurrency, args.requests), args.concurrency, args.max_tokens))  # warm-up
        ps = psutil.Process(proc.pid)
        cpu_before = ps.cpu_times()
        with _RssSampler(proc.pid) as rss:
            elapsed, tokens, failures = asyncio.run(_load(port, args.requests, args.concurrency, args.max_tokens))
        cpu_after = ps.cpu_times()
        cpu = (cpu_after.user - cpu_before.user) + (cpu_after.system - cpu_before.system)
        return {
            "startup_s": startup,
            "completions_per_s": (args.requests - failures) / elapsed,
            "tokens_per_s": tokens / elapsed,
            "cpu_s_per_1k_tokens": cpu / max(tokens, 1) * 1000,
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
    ("CPU s / 1k tokens", "cpu_s_per_1k_tokens", "{:.3f}", "≤ 2.0×"),
    ("peak RSS (MiB)", "peak_rss_mib", "{:.0f}", ""),
    ("startup to registered (s)", "startup_s", "{:.2f}", ""),
]


def _report(results: dict[str, list[dict]], args) -> dict:
    med = {kind: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for kind, runs in results.items()}
    if "ceiling" in med:
        c = med["ceiling"]
        print(f"\nceiling (plain asyncio Python worker, no vLLM): {c['completions_per_s']:.1f} completions/s, "
              f"{c['tokens_per_s']:.0f} tokens/s, {c['cpu_s_per_1k_tokens']:.3f} CPU s / 1k tokens; "
              f"trio-sidecar reaches {med['trio']['tokens_per_s'] / c['tokens_per_s']:.2f}x of it")
    print(f"\nE2E: {args.requests} streaming completions x {args.max_tokens} tokens at concurrency "
          f"{args.concurrency}, median of {args.rounds} round(s), same frontend and mock\n")
    print("| metric | native | trio-sidecar | ratio (trio/native) | target |")
    print("|---|---:|---:|---:|---|")
    ratios = {}
    for label, key, fmt, target in METRICS:
        n, t = med["native"][key], med["trio"][key]
        ratio = t / n if n else float("nan")
        ratios[key] = ratio
        print(f"| {label} | {fmt.format(n)} | {fmt.format(t)} | {ratio:.2f}x | {target} |")
    failures = {k: sum(r["failures"] for r in runs) for k, runs in results.items()}
    if any(failures.values()):
        print(f"\nfailed requests: {failures}")
    verdict = {
        "throughput >= 1.0x native": ratios["tokens_per_s"] >= 1.0,
        "cpu per token <= 2x native": ratios["cpu_s_per_1k_tokens"] <= 2.0,
    }
    print("\n" + "  ".join(f"{name}: {'yes' if ok else 'NO'}" for name, ok in verdict.items()))
    return {"median": med, "ratios": ratios, "targets": verdict, "runs": results, "failures": failures}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="trio-sidecar vs native sidecar through one Dynamo frontend")
    parser.add_argument("--requests", type=int, default=640)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1, help="alternating native/trio rounds (median)")
    parser.add_argument("--json", type=Path, help="also write the results as JSON")
    parser.add_argument("--keep-logs", action="store_true", help="keep the temporary directory with all logs")
    parser.add_argument("--ceiling", action="store_true",
                        help="also measure a plain asyncio Python worker (the Python-handler ceiling)")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("dynamo") is None:
        print("error: Dynamo 1.6.1 is not installed (scripts/install-dynamo.sh .venv/bin/python)", file=sys.stderr)
        return 1

    workdir = Path(tempfile.mkdtemp(prefix="trio-sidecar-bench-"))
    env = local.dynamo_env(workdir / "file-kv", DYN_LOG="warn")
    model = _make_tiny_model(workdir / "tiny-model")
    args.model_dir = str(model)
    procs = []
    try:
        mock, address = local.start_mock(workdir, env, model=str(model), served_model_name=MODEL,
                                         engine_args={"speedup_ratio": 0.0, "max_num_seqs": 256})
        procs.append(mock)
        frontend, port = local.start_frontend(workdir, env)
        procs.append(frontend)
        kinds = ("native", "trio", "ceiling") if args.ceiling else ("native", "trio")
        results: dict[str, list[dict]] = {kind: [] for kind in kinds}
        for round_ in range(args.rounds):
            for kind in kinds:
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
