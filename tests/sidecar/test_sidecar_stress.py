"""Seeded concurrent workloads through ``open_sidecar`` against the mock: completions, ``ctx.stop()``,
early ``break`` and scope cancellation mixed on a small pool. Invariants, not timings."""

from __future__ import annotations

import random

import pytest
import trio
from sidecar_fakes import FAST_ENGINE_ARGS, sidecar_config

from trio_sidecar import GenerateContext, open_sidecar
from trio_sidecar.mock import MockConfig, open_mock_server, planned_tokens

SEED = 42
MAX_TOKENS = 30


@pytest.mark.parametrize("seed", [1, 2])
async def test_mixed_cancellations_keep_every_invariant(seed):
    rng = random.Random(seed)
    engine_args = dict(FAST_ENGINE_ARGS, speedup_ratio=2.0, max_num_seqs=256)
    config = MockConfig(listen="127.0.0.1:0", seed=SEED, engine_args=engine_args, max_concurrent_requests=512)
    plans = [
        (i, rng.choice(["full", "stop", "break", "scope"]), rng.randint(1, MAX_TOKENS - 1), rng.random())
        for i in range(120)
    ]
    outcomes: dict[str, tuple[str, list[int], object]] = {}
    async with open_mock_server(config) as mock:
        async with open_sidecar(sidecar_config(mock.address, grpc_connections=3)) as sidecar:

            async def one(i: int, kind: str, at: int, delay: float) -> None:
                rid = f"w{seed}-{i}"
                ctx = GenerateContext(rid)
                tokens: list[int] = []
                last = None
                body = {"token_ids": [1, 2, 3, 4 + i], "stop_conditions": {"max_tokens": MAX_TOKENS}}
                with trio.move_on_after(delay * 0.2 if kind == "scope" else 60):
                    async with sidecar.generate(body, ctx) as stream:
                        async for chunk in stream:
                            tokens.extend(chunk.token_ids)
                            last = chunk
                            if kind == "stop" and len(tokens) == at:
                                ctx.stop()
                            if kind == "break" and len(tokens) == at:
                                break
                outcomes[rid] = (kind, tokens, last)

            async with trio.open_nursery() as nursery:
                for plan in plans:
                    nursery.start_soon(one, *plan)
            with trio.fail_after(5):
                while mock.active_request_count():
                    await trio.sleep(0.02)
                await mock.metrics_value(0).wait_value(lambda m: m.running_requests == 0 and m.waiting_requests == 0)
            assert sidecar.engine.in_flight == 0
        aborted = {rid for call in mock.abort_calls for rid in call}

    assert len(outcomes) == len(plans)
    for rid, (kind, tokens, last) in outcomes.items():
        assert tokens == planned_tokens(SEED, rid, MAX_TOKENS)[: len(tokens)]  # no token lost or reordered
        if kind == "full":
            assert len(tokens) == MAX_TOKENS
            assert last.finish_reason == "length"
            assert rid not in aborted
        elif kind == "stop":
            assert last.finish_reason in ("cancelled", "length")
            if last.finish_reason == "cancelled":
                assert last.completion_usage.completion_tokens == len(tokens)
    full = {rid for rid, (kind, _t, _l) in outcomes.items() if kind == "full"}
    assert not aborted & full
