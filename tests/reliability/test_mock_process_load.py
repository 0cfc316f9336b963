"""A ``trio-sidecar mock`` process under load, with the project's
transport client as the peer (docs/reliability.md).

* 2,000 concurrent GenerateStream calls over 8 connections all complete with every token.
* 20,000 requests leave the process's RSS and file-descriptor count flat (measured with psutil after a
  warm-up and at the end).
"""

from __future__ import annotations

import json

import psutil
import trio
from reliability_fakes import MockProcess

from trio_sidecar._proto.vllm import inference_pb2 as pb
from trio_sidecar.transport import open_channel

MIB = 1024 * 1024
GENERATE = "/vllm.Inference/Generate"
GENERATE_STREAM = "/vllm.Inference/GenerateStream"
ENGINE_ARGS = {
    "block_size": 4,
    "enable_prefix_caching": False,
    "num_gpu_blocks": 32768,
    "max_num_seqs": 2048,
    "max_num_batched_tokens": 16384,
    "speedup_ratio": 0.0,
}


def request(request_id: str, tokens: int) -> pb.GenerateRequest:
    req = pb.GenerateRequest(
        request_id=request_id,
        token_ids=pb.TokenIds(ids=[1, 2, 3, 4]),
        stopping=pb.StoppingCriteria(max_new_tokens=tokens),
        response=pb.ResponseOptions(output_token_ids=True),
    )
    req.stopping.ignore_eos = True
    return req


async def start_mock(tmp_path) -> MockProcess:
    mock = MockProcess(
        ["--extra-engine-args", json.dumps(ENGINE_ARGS), "--max-concurrent-requests", "2100"], tmp_path / "mock.log"
    )
    await mock.start()
    return mock


async def test_two_thousand_concurrent_streams_on_a_mock_process(tmp_path):
    streams, tokens, connections = 2000, 8, 8
    mock = await start_mock(tmp_path)
    received: dict[int, int] = {}
    try:
        with trio.fail_after(300):
            async with trio.open_nursery() as nursery:
                channels = [await nursery.start(_hold_channel, mock.port) for _ in range(connections)]
                all_open = trio.Event()
                opened = 0

                async def one(i: int) -> None:
                    nonlocal opened
                    count = 0
                    async with channels[i % connections].unary_stream(
                        GENERATE_STREAM, request(f"s{i}", tokens), pb.GenerateResponse
                    ) as responses:
                        opened += 1
                        if opened == streams:
                            all_open.set()
                        await all_open.wait()  # every stream is open at once before any is read
                        async for message in responses:
                            count += len(message.outputs.token_ids)
                    received[i] = count

                async with trio.open_nursery() as calls:
                    for i in range(streams):
                        calls.start_soon(one, i)
                nursery.cancel_scope.cancel()
    finally:
        await mock.aclose()
    assert len(received) == streams
    assert set(received.values()) == {tokens}


async def _hold_channel(port: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:  # type: ignore[no-untyped-def]
    async with open_channel("127.0.0.1", port) as channel:
        task_status.started(channel)
        await trio.sleep_forever()


async def test_twenty_thousand_requests_keep_rss_and_fds_flat(tmp_path):
    total, warmup, concurrency = 20_000, 2_000, 64
    mock = await start_mock(tmp_path)
    try:
        process = psutil.Process(mock.process.pid)
        samples: dict[str, tuple[int, int]] = {}
        with trio.fail_after(600):
            async with open_channel("127.0.0.1", mock.port) as channel:
                next_id = 0

                async def worker(limit: int) -> None:
                    nonlocal next_id
                    while next_id < limit:
                        i = next_id
                        next_id += 1
                        reply = await channel.unary_unary(GENERATE, request(f"u{i}", 2), pb.GenerateResponse)
                        assert len(reply.outputs.token_ids) == 2

                for label, limit in (("warm", warmup), ("end", total)):
                    async with trio.open_nursery() as nursery:
                        for _ in range(concurrency):
                            nursery.start_soon(worker, limit)
                    samples[label] = (process.memory_info().rss, process.num_fds())
    finally:
        await mock.aclose()
    (rss_warm, fds_warm), (rss_end, fds_end) = samples["warm"], samples["end"]
    print(
        f"20,000 requests: RSS {rss_warm / MIB:.1f} -> {rss_end / MIB:.1f} MiB after the warm-up, "
        f"FDs {fds_warm} -> {fds_end}"
    )
    assert fds_end == fds_warm
    assert rss_end - rss_warm < 8 * MIB
