"""A slow consumer does not stall other streams.

All streams share ONE pooled connection. One reader stalls (at least 1 s) with a response far larger than an
HTTP/2 stream window still to come; every other stream on that connection must complete while it is stalled,
and the stalled stream must still deliver every token afterwards.
"""

from __future__ import annotations

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

STALL = 1.0
SLOW_TOKENS = 3000  # with logprobs: several hundred KiB, well past a 64 KiB stream window
OTHERS = 20
OTHER_TOKENS = 20


async def test_slow_consumer_does_not_stall_other_streams():
    from trio_sidecar.api import open_sidecar
    from trio_sidecar.mock import open_mock_server

    engine_args = {"block_size": 4, "enable_prefix_caching": False, "max_num_seqs": 64, "speedup_ratio": 0.0}
    others_done = trio.Event()
    stalled = trio.Event()
    woke_by_timeout = []
    outcomes = []
    with trio.fail_after(120):
        async with open_mock_server(mock_config(engine_args=engine_args)) as mock:
            async with open_sidecar(sidecar_config(mock.address, grpc_connections=1)) as sidecar:

                async def stall_once(outcome, chunk) -> None:
                    if len(outcome.chunks) == 1:
                        stalled.set()
                        began = trio.current_time()
                        with trio.move_on_after(60) as scope:
                            await others_done.wait()
                        woke_by_timeout.append(scope.cancelled_caught)
                        await trio.sleep_until(began + STALL)

                async def slow() -> None:
                    request = mock_request(SLOW_TOKENS, output_options={"logprobs": 5})
                    outcomes.append(await drive(sidecar, request, "slow-reader", on_chunk=stall_once))

                async def other(i: int) -> None:
                    outcomes.append(await drive(sidecar, mock_request(OTHER_TOKENS), f"other-{i}"))

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(slow)
                    with trio.fail_after(30):
                        await stalled.wait()
                    async with trio.open_nursery() as others:
                        for i in range(OTHERS):
                            others.start_soon(other, i)
                    others_done.set()

                check_all(outcomes, OTHERS + 1)
                assert woke_by_timeout == [False], "the other streams did not finish while one reader stalled"
                by_id = {o.request_id: o for o in outcomes}
                for i in range(OTHERS):
                    assert len(by_id[f"other-{i}"].tokens) == OTHER_TOKENS
                slow_outcome = by_id["slow-reader"]
                assert slow_outcome.error is None
                assert len(slow_outcome.tokens) == SLOW_TOKENS
                assert slow_outcome.finish_reason == "length"
                assert all(len(chunk.log_probs) == len(chunk.token_ids) for chunk in slow_outcome.chunks)
                await wait_until(lambda: mock_idle(mock) and sidecar_in_flight(sidecar) == 0)
