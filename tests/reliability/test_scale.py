"""1,000 concurrent streams through one sidecar against the mock (speedup 0).

All complete with exactly the tokens the mock plans for their request ids; live counters return to zero;
peak RSS of this process (sidecar + in-process mock) is reported and must stay bounded.
"""

from __future__ import annotations

import psutil
import trio
from reliability_fakes import (
    check_all,
    drive,
    mock_config,
    mock_idle,
    mock_request,
    sidecar_config,
    sidecar_in_flight,
    wait_until,
)

STREAMS = 1000
TOKENS = 8
SEED = 42
#: Generous functional bound on growth: 1,000 small streams must not cost anywhere near this.
RSS_GROWTH_LIMIT = 768 * 1024 * 1024


async def test_thousand_concurrent_streams():
    from trio_sidecar.api import open_sidecar
    from trio_sidecar.mock import open_mock_server, planned_tokens

    engine_args = {
        "block_size": 4,
        "enable_prefix_caching": False,
        "num_gpu_blocks": 16384,
        "max_num_seqs": 1024,
        "max_num_batched_tokens": 8192,
        "speedup_ratio": 0.0,
    }
    process = psutil.Process()
    baseline = peak = process.memory_info().rss
    outcomes = []
    with trio.fail_after(240):
        async with open_mock_server(
            mock_config(engine_args=engine_args, max_concurrent_requests=STREAMS + 24, seed=SEED)
        ) as mock:
            async with open_sidecar(sidecar_config(mock.address, grpc_connections=8)) as sidecar:

                async def sample_rss() -> None:
                    nonlocal peak
                    while True:
                        peak = max(peak, process.memory_info().rss)
                        await trio.sleep(0.05)

                async def one(i: int) -> None:
                    outcomes.append(await drive(sidecar, mock_request(TOKENS), f"scale-{i}"))

                started = trio.current_time()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(sample_rss)
                    async with trio.open_nursery() as streams:
                        for i in range(STREAMS):
                            streams.start_soon(one, i)
                    nursery.cancel_scope.cancel()
                elapsed = trio.current_time() - started

                check_all(outcomes, STREAMS)
                for outcome in outcomes:
                    assert outcome.error is None, (outcome.request_id, outcome.error)
                    assert outcome.tokens == planned_tokens(SEED, outcome.request_id, TOKENS), outcome.request_id
                    assert outcome.finish_reason == "length"
                    usage = outcome.chunks[-1].completion_usage
                    assert (usage.prompt_tokens, usage.completion_tokens) == (4, TOKENS)
                await wait_until(lambda: mock_idle(mock) and sidecar_in_flight(sidecar) == 0)

    growth = peak - baseline
    print(
        f"\n{STREAMS} concurrent streams x {TOKENS} tokens: {elapsed:.2f} s, "
        f"peak RSS {peak / 2**20:.0f} MiB (+{growth / 2**20:.0f} MiB over {baseline / 2**20:.0f} MiB)"
    )
    assert growth < RSS_GROWTH_LIMIT
