"""Benchmark: the mock server's streaming rate against the raw transport, and its memory at 1,000 requests.

Usage::

    python bench/mock.py [--tokens-per-level 20000] [--levels 1,64,512] [--rss-requests 1000]

Two server processes are started on 127.0.0.1 (port 0, killed by PID at the end):

* ``mock``: ``python -m trio_sidecar.mock`` with ``speedup_ratio`` 0 (no modelled time), so the rate is the
  mock's own cost: validation, planning, the scheduler passes, the per-request pump and message building;
* ``raw``: this file's ``--raw-server`` mode, a bare ``serve_grpc`` ``GenerateStream`` that yields
  pre-built one-token messages of the same shape, i.e. the transport's ceiling on this machine.

The client (this process, our transport, one connection) runs N concurrent ``GenerateStream`` calls and
counts tokens. Printed per level: tokens/s for both servers, their ratio (target ≥ 0.60 at 64 streams),
and each server process's CPU µs per token (from psutil; on a shared machine the CPU columns are the
steadier comparison). Then the mock's peak RSS
(``VmHWM``) after 1,000 concurrent requests (target ≤ 300 MB). Ratios, never assertions: the machine is
shared.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import psutil
import trio

from trio_sidecar._proto.vllm import inference_grpc
from trio_sidecar._proto.vllm import inference_pb2 as pb

MOCK_ARGS = {
    "speedup_ratio": 0.0,
    "block_size": 16,
    "enable_prefix_caching": False,
    "num_gpu_blocks": 65536,
    "max_num_seqs": 1024,
    "max_num_batched_tokens": 65536,
}
LISTENING = re.compile(r"listening on (\S+):(\d+)")


# --- the raw transport server (child process) ----------------------------------------------------------


class _RawInference(inference_grpc.InferenceServicer):
    """A bare streaming servicer: prompt_info, then one pre-built message per token."""

    def __init__(self) -> None:
        self._token = pb.GenerateResponse(
            outputs=pb.SequenceOutput(index=0, num_tokens=1, text="<token:12345>", token_ids=[12345])
        )

    async def GenerateStream(self, request: Any, context: Any) -> AsyncIterator[Any]:  # noqa: N802
        yield pb.GenerateResponse(prompt_info=pb.PromptInfo(num_prompt_tokens=len(request.token_ids.ids)))
        for _ in range(request.stopping.max_new_tokens - 1):
            yield self._token
        last = pb.GenerateResponse()
        last.CopyFrom(self._token)
        last.outputs.finish_info.num_output_tokens = request.stopping.max_new_tokens
        last.outputs.finish_info.finish_reason = pb.FinishInfo.LENGTH
        yield last


async def _raw_server() -> None:
    from trio_sidecar.transport import serve_grpc

    async with trio.open_nursery() as nursery:
        server = await nursery.start(lambda task_status: serve_grpc([_RawInference()], task_status=task_status))
        print(f"raw server listening on 127.0.0.1:{server.port}", flush=True)


# --- client ---------------------------------------------------------------------------------------------


def _start(command: list[str]) -> tuple[subprocess.Popen, int]:
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = process.stdout.readline()  # type: ignore[union-attr]
    match = LISTENING.search(line)
    if not match:
        process.kill()
        raise SystemExit(f"server did not start: {line!r}")
    return process, int(match.group(2))


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.kill(process.pid, signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
    if process.stdout is not None:
        process.stdout.close()


def _cpu(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def _peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return psutil.Process(pid).memory_info().rss / 2**20


async def _run_streams(port: int, streams: int, tokens_each: int) -> tuple[int, float]:
    from trio_sidecar.transport import open_channel

    counted = 0

    async def one(i: int) -> None:
        nonlocal counted
        request = pb.GenerateRequest(
            request_id=f"bench-{i}-{time.monotonic_ns()}",
            token_ids=pb.TokenIds(ids=[1, 2, 3, 4, 5, 6, 7, 8]),
            stopping=pb.StoppingCriteria(max_new_tokens=tokens_each),
            response=pb.ResponseOptions(output_token_ids=True),
        )
        async with channel.unary_stream("/vllm.Inference/GenerateStream", request, pb.GenerateResponse) as stream:
            async for message in stream:
                counted += message.outputs.num_tokens

    async with open_channel("127.0.0.1", port) as channel:
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(streams):
                nursery.start_soon(one, i)
        elapsed = time.perf_counter() - start
    return counted, elapsed


async def _measure(port: int, pid: int, streams: int, total_tokens: int) -> tuple[float, float]:
    tokens_each = max(2, min(32768, total_tokens // streams))
    await _run_streams(port, streams, max(2, tokens_each // 10))  # warm-up
    cpu0 = _cpu(pid)
    counted, elapsed = await _run_streams(port, streams, tokens_each)
    cpu = _cpu(pid) - cpu0
    return counted / elapsed, cpu / counted * 1e6


async def _bench(args: argparse.Namespace) -> None:
    levels = [int(x) for x in args.levels.split(",")]
    mock_cmd = [
        sys.executable,
        "-m",
        "trio_sidecar.mock",
        "--listen",
        "127.0.0.1:0",
        "--max-concurrent-requests",
        str(max(levels + [args.rss_requests]) + 24),
        "--extra-engine-args",
        json.dumps(MOCK_ARGS),
        "--log-level",
        "error",
    ]
    raw_cmd = [sys.executable, __file__, "--raw-server"]
    raw, raw_port = _start(raw_cmd)
    mock, mock_port = _start(mock_cmd)
    try:
        print(f"# trio-sidecar mock benchmark (speedup_ratio 0; {os.cpu_count()} CPUs; one client connection)")
        print()
        print(
            "| concurrent streams | raw transport tokens/s | mock tokens/s | mock / raw "
            "| raw server CPU µs/token | mock server CPU µs/token |"
        )
        print("|---:|---:|---:|---:|---:|---:|")
        for streams in levels:
            raw_rate, raw_us = await _measure(raw_port, raw.pid, streams, args.tokens_per_level)
            mock_rate, mock_us = await _measure(mock_port, mock.pid, streams, args.tokens_per_level)
            print(
                f"| {streams} | {raw_rate:,.0f} | {mock_rate:,.0f} | {mock_rate / raw_rate:.2f} "
                f"| {raw_us:.0f} | {mock_us:.0f} |"
            )
        _stop(mock)
        # Peak RSS: a fresh mock, then N concurrent requests (default engine limits: 256 running).
        mock, mock_port = _start(mock_cmd)
        rss_before = _peak_rss_mb(mock.pid)
        await _run_streams(mock_port, args.rss_requests, 200)
        rss_after = _peak_rss_mb(mock.pid)
        print()
        print(
            f"Peak RSS of the mock server: {rss_before:.0f} MB idle, {rss_after:.0f} MB after "
            f"{args.rss_requests:,} concurrent requests of 200 tokens (target ≤ 300 MB)"
        )
    finally:
        _stop(mock)
        _stop(raw)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", default="1,64,512", help="concurrent stream counts (default: %(default)s)")
    parser.add_argument("--tokens-per-level", type=int, default=20_000, help="tokens streamed per level")
    parser.add_argument("--rss-requests", type=int, default=1000, help="concurrent requests for the RSS probe")
    parser.add_argument("--raw-server", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.raw_server:
        try:
            trio.run(_raw_server)
        except KeyboardInterrupt:
            pass
        return
    trio.run(_bench, args)


if __name__ == "__main__":
    main()
