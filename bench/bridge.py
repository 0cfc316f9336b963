#!/usr/bin/env python3
"""Micro-benchmark of the asyncio-thread bridge alone (trio_sidecar.dynamo.bridge), no Dynamo, no gRPC.

Usage: python bench/bridge.py [--streams 64] [--chunks 500]

A fake sidecar yields ready-made chunks on the Trio side; an asyncio consumer on the bridge's thread drains
the Dynamo handler like the runtime would. Prints chunks/s and process CPU seconds per 1,000 chunks, to
compare with the end-to-end tokens/s of bench/e2e.py: when the bridge sustains far more than the
end-to-end rate, the bridge is not the bottleneck.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trio  # noqa: E402

from trio_sidecar.dynamo.bridge import RequestBridge  # noqa: E402
from trio_sidecar.dynamo.thread import AsyncioThread  # noqa: E402


class _Chunk:
    __slots__ = ("data",)

    def __init__(self, data: dict) -> None:
        self.data = data

    def to_dict(self) -> dict:
        return self.data


class _DynamoContext:
    def __init__(self, request_id: str) -> None:
        self._id = request_id

    def id(self) -> str:
        return self._id

    def async_killed_or_stopped(self) -> asyncio.Future:
        return asyncio.get_running_loop().create_future()

    def notify_first_token(self) -> None:
        pass


def _make_submit(chunks: int, nursery: trio.Nursery):
    """``Sidecar.submit`` over a fake producer: one task per request feeds the sink."""

    def submit(request, ctx, sink) -> None:
        async def produce() -> None:
            for i in range(chunks):
                sink.chunk(_Chunk({"token_ids": [1000 + i], "index": 0}))
                if i % 8 == 7:
                    await trio.lowlevel.checkpoint()  # vLLM messages arrive in bursts, not all at once
            sink.end(None, None)

        nursery.start_soon(produce)

    return submit


async def _main(streams: int, chunks: int) -> tuple[float, float, int]:
    thread = AsyncioThread()
    await thread.start()
    bridge = RequestBridge(thread)

    async def consume_all() -> int:
        async def one(i: int) -> int:
            n = 0  # chunks, not yielded items: queued deltas may be coalesced into one item
            async for item in bridge.handler({"token_ids": [i]}, _DynamoContext(f"r{i}")):
                n += len(item["token_ids"])
            return n

        return sum(await asyncio.gather(*(one(i) for i in range(streams))))

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(bridge.run_dispatcher, _make_submit(chunks, nursery))
            cpu0, t0 = time.process_time(), time.perf_counter()
            total = await thread.run(consume_all)
            elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            nursery.cancel_scope.cancel()
    finally:
        await thread.stop()
    return elapsed, cpu, total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--chunks", type=int, default=500)
    args = parser.parse_args(argv)
    logging.getLogger("trio_sidecar.dynamo.bridge").setLevel(logging.ERROR)  # the fake producer outruns all
    elapsed, cpu, total = trio.run(_main, args.streams, args.chunks)
    print(f"bridge: {args.streams} streams x {args.chunks} chunks = {total} chunks in {elapsed:.2f}s")
    print(f"| chunks/s | CPU s / 1k chunks |\n|---:|---:|\n| {total / elapsed:.0f} | {cpu / total * 1000:.4f} |")
    return 0 if total == args.streams * args.chunks else 1


if __name__ == "__main__":
    sys.exit(main())
