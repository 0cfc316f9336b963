"""Benchmark: streaming through ``open_sidecar`` versus a direct gRPC client to the same mock.

One invocation starts one mock vLLM server as a subprocess (so its CPU is not charged to the client), then
for each concurrency level (1, 64, 512 streams by default) runs the same workload twice — once with a direct
client (the project transport, a pool of the same size used round-robin, the same ``GenerateRequest``) and
once through ``open_sidecar`` — and prints:

* tokens/s (wall clock),
* client CPU µs per token (``time.process_time`` of this process),
* p50/p99 inter-token latency (gaps between consecutive token arrivals of a stream),

as values and as sidecar/direct ratios. Targets: ≥ 0.7× the direct client's tokens/s at 64 streams;
added p99 inter-token latency ≤ 1 ms.

    python bench/sidecar.py [--streams 1,64,512] [--tokens-per-level 20000] [--connections 8] [--repeat 1]

``--requests N`` measures the per-request cost instead (under ``bench/e2e.py``'s load the sidecar's
CPU is per request, not per token): N short requests of ``--tokens-per-request`` tokens (default 32), kept
``--streams`` at a time (default 64), with the request dict shaped like the one Dynamo 1.6.1's frontend
sends, printing CPU µs per request for the direct client and the sidecar (median and range over
``--repeat`` alternated runs):

    python bench/sidecar.py --requests 3000 --repeat 5

Nothing here asserts: the numbers are for the README table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack

import attrs
import trio
from rich.console import Console
from rich.table import Table

from trio_sidecar import GenerateContext, SidecarConfig, open_sidecar
from trio_sidecar._proto.vllm import inference_pb2
from trio_sidecar.core.config import DisaggregationMode
from trio_sidecar.core.convert.request import build_generate_request
from trio_sidecar.core.protocol import structure_request
from trio_sidecar.transport import open_channel

GENERATE_STREAM = "/vllm.Inference/GenerateStream"
PROMPT = [11, 22, 33, 44, 55, 66, 77, 88]


@attrs.define
class Result:
    tokens: int = 0
    wall: float = 0.0
    cpu: float = 0.0
    gaps: list[float] = attrs.field(factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall if self.wall else 0.0

    @property
    def cpu_us_per_token(self) -> float:
        return 1e6 * self.cpu / self.tokens if self.tokens else 0.0

    def percentile(self, q: float) -> float:
        if not self.gaps:
            return 0.0
        ordered = sorted(self.gaps)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def start_mock(max_streams: int) -> tuple[subprocess.Popen, str]:
    engine_args = {
        "block_size": 16,
        "enable_prefix_caching": False,
        "num_gpu_blocks": 1_000_000,
        "max_num_seqs": max(max_streams, 1),
        "max_num_batched_tokens": 1_000_000,
        "speedup_ratio": 0.0,
    }
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trio_sidecar.mock",
            "--listen",
            "127.0.0.1:0",
            "--max-concurrent-requests",
            str(max(2 * max_streams, 16)),
            "--extra-engine-args",
            json.dumps(engine_args),
            "--log-level",
            "warning",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    match = re.search(r"listening on (\S+)", line)
    if match is None:
        process.kill()
        raise SystemExit(f"the mock did not start: {line!r}")
    return process, match.group(1)


def stop_mock(process: subprocess.Popen) -> None:
    """SIGTERM the mock started by :func:`start_mock` (by PID), SIGKILL it after 10 s."""
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


async def run_level(streams: int, per_stream: int, one_stream: Callable[[int, list[float]], Awaitable[int]]) -> Result:
    result = Result()

    async def worker(i: int) -> None:
        stamps: list[float] = []
        tokens = await one_stream(i, stamps)  # (never `x += await ...`: the read happens before the await)
        result.tokens += tokens
        result.gaps.extend(b - a for a, b in itertools.pairwise(stamps))

    cpu0, wall0 = time.process_time(), time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(streams):
            nursery.start_soon(worker, i)
    result.wall = time.perf_counter() - wall0
    result.cpu = time.process_time() - cpu0
    return result


def body(max_tokens: int) -> dict:
    return {"token_ids": PROMPT, "stop_conditions": {"max_tokens": max_tokens, "ignore_eos": True}}


def dynamo_body(max_tokens: int) -> dict:
    """A request dict shaped like the one Dynamo 1.6.1's frontend sends for ``/v1/completions``."""
    return {
        "model": "mocker-model",
        "token_ids": list(PROMPT),
        "stop_conditions": {
            "max_tokens": max_tokens,
            "stop": None,
            "stop_token_ids_hidden": [2],
            "min_tokens": None,
            "ignore_eos": True,
            "max_thinking_tokens": None,
        },
        "sampling_options": {
            "n": None,
            "best_of": None,
            "presence_penalty": None,
            "frequency_penalty": None,
            "repetition_penalty": None,
            "temperature": None,
            "top_p": None,
            "top_k": None,
            "min_p": None,
            "use_beam_search": None,
            "length_penalty": None,
            "seed": None,
            "include_stop_str_in_output": None,
            "guided_decoding": None,
        },
        "output_options": {
            "logprobs": None,
            "prompt_logprobs": None,
            "skip_special_tokens": True,
            "formatted_prompt": None,
        },
        "eos_token_ids": [2],
        "mdc_sum": "0123456789abcdef",
        "annotations": [],
        "routing": None,
        "router_config_override": None,
        "prefill_result": None,
        "bootstrap_info": None,
        "extra_args": None,
    }


async def run_requests(
    requests: int, concurrency: int, one_request: Callable[[int], Awaitable[int]]
) -> tuple[float, float, int]:
    """``requests`` calls of ``one_request``, ``concurrency`` at a time: (wall s, CPU s, tokens)."""
    counter = iter(range(requests))
    tokens = 0

    async def worker() -> None:
        nonlocal tokens
        for i in counter:
            n = await one_request(i)
            tokens += n

    cpu0, wall0 = time.process_time(), time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)
    return time.perf_counter() - wall0, time.process_time() - cpu0, tokens


async def per_request_mode(args: argparse.Namespace, console: Console) -> int:
    concurrency = int(args.streams.split(",")[0]) if args.streams != "1,64,512" else 64
    per_request = args.tokens_per_request
    process, address = start_mock(concurrency)
    host, port = address.rsplit(":", 1)
    direct_us: list[float] = []
    sidecar_us: list[float] = []
    submit_us: list[float] = []
    try:
        config = SidecarConfig(
            grpc_endpoint=address, grpc_connections=args.connections, startup_deadline=30.0, health_prober=False
        )
        async with open_sidecar(config) as sidecar, AsyncExitStack() as stack:
            channels = [await stack.enter_async_context(open_channel(host, int(port))) for _ in range(args.connections)]

            async def direct(i: int) -> int:
                preprocessed = structure_request(body(per_request))
                built = build_generate_request(preprocessed, f"d-{i}", "mocker-model", DisaggregationMode.AGG)
                tokens = 0
                async with channels[i % len(channels)].unary_stream(
                    GENERATE_STREAM, built.message, inference_pb2.GenerateResponse, metadata=built.metadata
                ) as stream:
                    async for response in stream:
                        if response.HasField("outputs"):
                            tokens += response.outputs.num_tokens
                return tokens

            async def through_sidecar(i: int) -> int:
                tokens = 0
                async with sidecar.generate(dynamo_body(per_request), GenerateContext(f"s-{i}")) as chunks:
                    async for chunk in chunks:
                        tokens += len(chunk.token_ids)
                        chunk.to_dict()  # as the Dynamo bridge does
                return tokens

            class Sink:  # what the Dynamo bridge's sink does with the chunks (to_dict), minus the hand-over
                __slots__ = ("tokens_seen", "done")

                def __init__(self) -> None:
                    self.tokens_seen = 0
                    self.done = trio.Event()

                def chunk(self, chunk) -> None:
                    self.tokens_seen += len(chunk.token_ids)
                    chunk.to_dict()

                def tokens(self, token_ids, text) -> None:
                    self.tokens_seen += len(token_ids)
                    _ = {"token_ids": token_ids, "index": 0, "text": text}  # the dict the bridge builds

                def end(self, final, error) -> None:
                    if final is not None:
                        self.tokens_seen += len(final.token_ids)
                        final.to_dict()
                    self.done.set()

            async def submitted(i: int) -> int:
                sink = Sink()
                sidecar.submit(dynamo_body(per_request), GenerateContext(f"u-{i}"), sink)
                await sink.done.wait()
                return sink.tokens_seen

            await run_requests(200, concurrency, direct)  # warm-up
            await run_requests(200, concurrency, through_sidecar)
            await run_requests(200, concurrency, submitted)
            runs = [
                ("direct", direct, direct_us),
                ("sidecar", through_sidecar, sidecar_us),
                ("submit", submitted, submit_us),
            ]
            for _ in range(args.repeat):
                for label, fn, sink in runs:
                    wall, cpu, tokens = await run_requests(args.requests, concurrency, fn)
                    assert tokens == args.requests * per_request, (label, tokens)
                    sink.append(1e6 * cpu / args.requests)
                    console.print(
                        f"{label:8} {args.requests} requests x {per_request} tokens at {concurrency}: "
                        f"{args.requests / wall:,.0f} req/s, {1e6 * cpu / args.requests:,.0f} CPU µs/request"
                    )
    finally:
        stop_mock(process)

    def summary(values: list[float]) -> str:
        ordered = sorted(values)
        return f"{ordered[len(ordered) // 2]:,.0f} [{ordered[0]:,.0f}–{ordered[-1]:,.0f}]"

    console.print(f"CPU µs/request direct:  {summary(direct_us)}")
    console.print(f"CPU µs/request sidecar: {summary(sidecar_us)}")
    console.print(f"CPU µs/request submit:  {summary(submit_us)}")
    added = [s - d for d, s in zip(direct_us, sidecar_us, strict=True)]
    console.print(f"CPU µs/request added by the sidecar: {summary(added)}")
    added = [s - d for d, s in zip(direct_us, submit_us, strict=True)]
    console.print(f"CPU µs/request added by the sidecar through submit(): {summary(added)}")
    return 0


async def bench_direct(address: str, connections: int, streams: int, per_stream: int, tag: str) -> Result:
    host, port = address.rsplit(":", 1)
    async with AsyncExitStack() as stack:
        channels = [await stack.enter_async_context(open_channel(host, int(port))) for _ in range(connections)]
        preprocessed = structure_request(body(per_stream))

        async def one(i: int, stamps: list[float]) -> int:
            built = build_generate_request(preprocessed, f"{tag}-{i}", "mocker-model", DisaggregationMode.AGG)
            tokens = 0
            channel = channels[i % len(channels)]
            async with channel.unary_stream(
                GENERATE_STREAM, built.message, inference_pb2.GenerateResponse, metadata=built.metadata
            ) as stream:
                async for response in stream:
                    if response.HasField("outputs") and response.outputs.num_tokens:
                        tokens += response.outputs.num_tokens
                        stamps.append(time.perf_counter())
            return tokens

        return await run_level(streams, per_stream, one)


async def bench_sidecar(sidecar, streams: int, per_stream: int, tag: str) -> Result:
    async def one(i: int, stamps: list[float]) -> int:
        tokens = 0
        async with sidecar.generate(body(per_stream), GenerateContext(f"{tag}-{i}")) as chunks:
            async for chunk in chunks:
                if chunk.token_ids:
                    tokens += len(chunk.token_ids)
                    stamps.append(time.perf_counter())
        return tokens

    return await run_level(streams, per_stream, one)


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}×" if b else "—"


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="open_sidecar vs direct client, same mock")
    parser.add_argument("--streams", default="1,64,512")
    parser.add_argument("--tokens-per-level", type=int, default=20000)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=1, help="runs per level and client; the best is kept")
    parser.add_argument("--requests", type=int, default=0, help="per-request mode: this many short requests")
    parser.add_argument("--tokens-per-request", type=int, default=32)
    args = parser.parse_args(argv)
    if args.requests:
        return await per_request_mode(args, Console())
    levels = [int(s) for s in args.streams.split(",") if s.strip()]
    console = Console()
    process, address = start_mock(max(levels))
    rows = []
    try:
        config = SidecarConfig(
            grpc_endpoint=address, grpc_connections=args.connections, startup_deadline=30.0, health_prober=False
        )
        async with open_sidecar(config) as sidecar:
            # warm-up both paths
            await bench_direct(address, args.connections, 4, 20, "warm-d")
            await bench_sidecar(sidecar, 4, 20, "warm-s")
            for streams in levels:
                per_stream = max(10, args.tokens_per_level // streams)
                best_direct = best_sidecar = None
                for r in range(args.repeat):
                    d = await bench_direct(address, args.connections, streams, per_stream, f"d{streams}-{r}")
                    s = await bench_sidecar(sidecar, streams, per_stream, f"s{streams}-{r}")
                    if best_direct is None or d.tokens_per_s > best_direct.tokens_per_s:
                        best_direct = d
                    if best_sidecar is None or s.tokens_per_s > best_sidecar.tokens_per_s:
                        best_sidecar = s
                rows.append((streams, per_stream, best_direct, best_sidecar))
    finally:
        stop_mock(process)

    table = Table(
        title=f"open_sidecar vs direct client (mock on {address}, {args.connections} connections, "
        f"{os.cpu_count()} CPUs)"
    )
    for column in (
        "streams",
        "tokens/s direct",
        "tokens/s sidecar",
        "ratio",
        "CPU µs/tok direct",
        "CPU µs/tok sidecar",
        "ratio",
        "p50 ITL ms d/s",
        "p99 ITL ms d/s",
        "added p99 ms",
    ):
        table.add_column(column, justify="right")
    for streams, _per_stream, d, s in rows:
        table.add_row(
            str(streams),
            f"{d.tokens_per_s:,.0f}",
            f"{s.tokens_per_s:,.0f}",
            ratio(s.tokens_per_s, d.tokens_per_s),
            f"{d.cpu_us_per_token:.1f}",
            f"{s.cpu_us_per_token:.1f}",
            ratio(s.cpu_us_per_token, d.cpu_us_per_token),
            f"{1e3 * d.percentile(0.5):.3f} / {1e3 * s.percentile(0.5):.3f}",
            f"{1e3 * d.percentile(0.99):.3f} / {1e3 * s.percentile(0.99):.3f}",
            f"{1e3 * (s.percentile(0.99) - d.percentile(0.99)):+.3f}",
        )
    console.print(table)
    for streams, _per_stream, d, s in rows:
        if streams == 64:
            console.print(f"64-stream throughput ratio: {s.tokens_per_s / d.tokens_per_s:.2f} (target ≥ 0.70)")
    return 0


if __name__ == "__main__":
    sys.exit(trio.run(main))
