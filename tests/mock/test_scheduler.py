"""The simulated engine of one rank (docs/reference/mock.md#kv-cache-and-kv-events, docs/reference/mock.md#scheduler, docs/reference/mock.md#cancellation-and-abort,
docs/reference/mock.md#timing-model). Passes are observed through the virtual clock (``autojump_clock``) and the timing
model, never through wall-clock measurements."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.lowlevel

from trio_sidecar.core.status import StatusCode
from trio_sidecar.mock.engine_args import engine_args_from_mapping, validate_engine_args
from trio_sidecar.mock.kvcache import BlockRemoved, BlockStored, KvEvent
from trio_sidecar.mock.scheduler import (
    BudgetError,
    CapacityError,
    Metrics,
    OutputSignal,
    RankEngine,
    SimRequest,
    check_prompt,
)
from trio_sidecar.mock.timing import decode_ms, prefill_ms

BASE = {
    "block_size": 4,
    "enable_prefix_caching": False,
    "num_gpu_blocks": 4096,
    "max_num_seqs": 64,
    "max_num_batched_tokens": 1024,
    "speedup_ratio": 0.0,
}


class RecordingPublisher:
    """Stands in for the ZMQ publisher: one entry per published message."""

    def __init__(self) -> None:
        self.messages: list[list[KvEvent]] = []

    def publish(self, events: Sequence[KvEvent]) -> int:
        self.messages.append(list(events))
        return len(self.messages) - 1


@asynccontextmanager
async def running_engine(publisher: Any = None, rank: int = 0, **overrides: Any) -> AsyncIterator[RankEngine]:
    args = engine_args_from_mapping({**BASE, **overrides})
    validate_engine_args(args)
    engine = RankEngine(rank, args, publisher)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        yield engine
        nursery.cancel_scope.cancel()


def sim(uuid: str, prompt: Sequence[int] = (1, 2, 3, 4), n: int = 5, **kw: Any) -> SimRequest:
    return SimRequest(uuid=uuid, prompt=tuple(prompt), plan=tuple(range(1000, 1000 + n)), **kw)


async def drain(receive: trio.MemoryReceiveChannel[OutputSignal]) -> list[OutputSignal]:
    return [signal async for signal in receive]


async def wait_idle(engine: RankEngine) -> Metrics:
    return await engine.metrics_value.wait_value(lambda m: m.running_requests == 0 and m.waiting_requests == 0)


# --- streaming and shape ------------------------------------------------------------------------------


async def test_tokens_follow_the_plan_and_the_last_one_completes(autojump_clock):
    async with running_engine() as engine:
        with trio.fail_after(10):
            signals = await drain(engine.submit(sim("a", n=7)))
            metrics = await wait_idle(engine)
    assert [s.token for s in signals] == list(range(1000, 1007))
    assert [s.completed for s in signals] == [False] * 6 + [True]
    assert metrics == Metrics(
        dp_rank=0,
        active_decode_blocks=0,
        total_blocks=4096,
        gpu_cache_usage_perc=0.0,
        running_requests=0,
        waiting_requests=0,
        vllm_preemptions_total=0,
    )
    assert "a" not in engine


async def test_a_slow_reader_gets_every_token_from_its_buffer(autojump_clock):
    async with running_engine() as engine:
        with trio.fail_after(10):
            receive = engine.submit(sim("a", n=50))
            await wait_idle(engine)  # the engine finished without anyone reading
            signals = await drain(receive)
    assert len(signals) == 50 and signals[-1].completed


async def test_submit_rejections(autojump_clock):
    async with running_engine(block_size=4, num_gpu_blocks=1) as engine:
        with pytest.raises(CapacityError) as info:
            engine.submit(sim("big", prompt=range(5)))
        assert str(info.value) == "request exceeds the simulated KV-cache capacity"
        assert info.value.code is StatusCode.RESOURCE_EXHAUSTED
        assert engine.load == 0
        receive = engine.submit(sim("fits", prompt=range(4), n=1))
        with pytest.raises(ValueError):
            engine.submit(sim("fits", prompt=range(4), n=1))
        with pytest.raises(ValueError):
            engine.submit(SimRequest(uuid="empty", prompt=(1,), plan=()))
        with trio.fail_after(10):
            assert len(await drain(receive)) == 1


def test_budget_error_with_chunked_prefill_off():
    args = engine_args_from_mapping({**BASE, "enable_chunked_prefill": False, "max_num_batched_tokens": 8})
    with pytest.raises(BudgetError) as info:
        check_prompt(args, 9)
    assert str(info.value) == "prompt of 9 tokens exceeds max_num_batched_tokens 8 with chunked prefill disabled"
    assert info.value.code is StatusCode.INVALID_ARGUMENT
    check_prompt(args, 8)
    # Chunked prefill on, or no budget: any length that fits the pool is fine.
    check_prompt(engine_args_from_mapping({**BASE, "max_num_batched_tokens": 8}), 100)
    check_prompt(
        engine_args_from_mapping({**BASE, "enable_chunked_prefill": False, "max_num_batched_tokens": None}), 100
    )


async def test_submit_raises_budget_error():
    async with running_engine(enable_chunked_prefill=False, max_num_batched_tokens=8) as engine:
        with pytest.raises(BudgetError, match="^prompt of 9 tokens exceeds max_num_batched_tokens 8"):
            engine.submit(sim("a", prompt=range(9)))
        assert engine.load == 0


# --- timing -------------------------------------------------------------------------------------------


async def test_speedup_zero_never_sleeps(autojump_clock):
    async with running_engine(speedup_ratio=0.0) as engine:
        start = trio.current_time()
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                for i in range(20):
                    nursery.start_soon(drain, engine.submit(sim(f"r{i}", prompt=range(64), n=30)))
        assert engine.passes >= 30
        assert trio.current_time() == start


async def test_pass_durations_follow_the_timing_model(autojump_clock):
    # block 64 x 16 blocks = 1024 tokens of capacity; a 128-token prompt and 3 output tokens:
    # pass 1 prefills 128 tokens (first token); passes 2 and 3 decode at 129 and 130 tokens.
    async with running_engine(block_size=64, num_gpu_blocks=16, speedup_ratio=1.0) as engine:
        start = trio.current_time()
        stamps = []
        with trio.fail_after(10):
            async for _ in engine.submit(sim("a", prompt=range(128), n=3)):
                stamps.append(trio.current_time() - start)
    expected_ms = [prefill_ms(128), decode_ms(129 / 1024), decode_ms(130 / 1024)]
    assert expected_ms[0] == pytest.approx(18.45, abs=0.01)
    cumulative = [sum(expected_ms[: i + 1]) / 1000 for i in range(3)]
    assert stamps == pytest.approx(cumulative, rel=1e-9)


async def test_speedup_and_decode_speedup_divide_the_time(autojump_clock):
    async with running_engine(block_size=64, num_gpu_blocks=16, speedup_ratio=10.0, decode_speedup_ratio=2.0) as engine:
        start = trio.current_time()
        with trio.fail_after(10):
            await drain(engine.submit(sim("a", prompt=range(128), n=2)))
        elapsed = trio.current_time() - start
    assert elapsed == pytest.approx((prefill_ms(128) / 10 + decode_ms(129 / 1024) / 20) / 1000, rel=1e-9)


async def test_chunked_prefill_splits_the_prompt_over_the_budget(autojump_clock):
    async with running_engine(block_size=4, max_num_batched_tokens=4, speedup_ratio=1.0) as engine:
        start = trio.current_time()
        with trio.fail_after(10):
            receive = engine.submit(sim("a", prompt=range(10), n=1))
            await drain(receive)
        elapsed = trio.current_time() - start
    # 10 prompt tokens at 4 per pass: chunks of 4, 4 and 2; the last pass produces the token.
    assert elapsed == pytest.approx((2 * prefill_ms(4) + prefill_ms(2)) / 1000, rel=1e-9)


async def test_prefill_and_decode_share_a_pass(autojump_clock):
    # a's first token ends pass 1; b arrives while pass 2 (a's decode at 9 tokens) is modelled, so it is
    # admitted in pass 3, which costs prefill(16) + decode(a at 10 tokens).
    async with running_engine(block_size=4, num_gpu_blocks=256, speedup_ratio=1.0) as engine:
        start = trio.current_time()
        a = engine.submit(sim("a", prompt=range(8), n=3))
        with trio.fail_after(10):
            first = await a.receive()
            assert trio.current_time() - start == pytest.approx(prefill_ms(8) / 1000, rel=1e-9)
            b = engine.submit(sim("b", prompt=range(16), n=1))
            await b.receive()
            elapsed = trio.current_time() - start
            await drain(a)
    assert not first.completed
    expected = prefill_ms(8) + decode_ms(9 / 1024) + prefill_ms(16) + decode_ms(10 / 1024)
    assert elapsed == pytest.approx(expected / 1000, rel=1e-9)


# --- batching, admission ------------------------------------------------------------------------------


async def test_hundreds_of_requests_are_batched_per_pass(autojump_clock):
    async with running_engine(max_num_seqs=256, max_num_batched_tokens=8192) as engine:
        results: dict[str, list[OutputSignal]] = {}

        async def consume(uuid: str, receive: trio.MemoryReceiveChannel[OutputSignal]) -> None:
            results[uuid] = await drain(receive)

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for i in range(300):
                    nursery.start_soon(consume, f"r{i}", engine.submit(sim(f"r{i}", prompt=(i, 1, 2), n=20)))
    assert all(len(v) == 20 and v[-1].completed for v in results.values()) and len(results) == 300
    # 256 run together and 44 wait for slots: about 2 x 20 passes, never one pass per token.
    assert engine.passes <= 60


async def test_max_num_seqs_limits_running_requests(autojump_clock):
    async with running_engine(max_num_seqs=1, speedup_ratio=0.01) as engine:
        a = engine.submit(sim("a", n=3))
        b = engine.submit(sim("b", n=3))
        with trio.fail_after(100):
            await a.receive()
            assert (engine.metrics.running_requests, engine.metrics.waiting_requests) == (1, 1)
            assert engine.load == 2
            await drain(a)
            assert len(await drain(b)) == 3


async def first_token_times(engine: RankEngine, requests: dict[str, SimRequest]) -> dict[str, float]:
    """Submit in order and return each request's first-token time (virtual clock)."""
    times: dict[str, float] = {}

    async def consume(name: str, receive: trio.MemoryReceiveChannel[OutputSignal]) -> None:
        await receive.receive()
        times[name] = trio.current_time()
        await drain(receive)

    async with trio.open_nursery() as nursery:
        for name, request in requests.items():
            nursery.start_soon(consume, name, engine.submit(request))
    return times


async def test_head_of_line_waits_for_kv_and_is_not_overtaken(autojump_clock):
    # 8 blocks of 4: a holds 5 blocks (17 tokens); b needs 4 and waits; c needs 1 and would fit, but
    # must not skip b.
    async with running_engine(num_gpu_blocks=8, speedup_ratio=1.0) as engine:
        with trio.fail_after(100):
            times = await first_token_times(
                engine,
                {
                    "a": sim("a", prompt=range(17), n=3),
                    "b": sim("b", prompt=range(100, 116), n=1),
                    "c": sim("c", prompt=(7,), n=1),
                },
            )
    assert times["a"] < times["b"] <= times["c"]
    assert engine.metrics.vllm_preemptions_total == 0


@pytest.mark.parametrize("caching", [True, False])
async def test_admission_counts_active_cached_prefix_as_free(caching, autojump_clock):
    # 5 blocks: a holds 4 (13-token prompt, 4 output tokens, never more than 16 computed). b (14 tokens,
    # 4 blocks) shares a's 3 committed full blocks: with prefix caching those are active hits and cost
    # nothing, so b needs 1 block and fits beside a; without it b waits for a.
    async with running_engine(num_gpu_blocks=5, speedup_ratio=1.0, enable_prefix_caching=caching) as engine:
        a = engine.submit(sim("a", prompt=range(13), n=4))
        with trio.fail_after(100):
            await a.receive()
            b = engine.submit(sim("b", prompt=tuple(range(12)) + (99, 98), n=1))
            await b.receive()
            assert ("a" in engine) is caching
            await drain(a)
    assert engine.metrics.vllm_preemptions_total == 0


# --- preemption ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "first_done"), [("lifo", "a"), ("fifo", "b")])
async def test_preemption_evicts_newest_or_oldest(mode, first_done, autojump_clock):
    # 4 blocks of 4 tokens; two 4-token prompts with 12 outputs each need 4 blocks apiece at the end:
    # decode pressure at 9 tokens forces a preemption; the victim recomputes after the other finishes.
    async with running_engine(num_gpu_blocks=4, preemption_mode=mode, speedup_ratio=1.0) as engine:
        done: list[str] = []
        got: dict[str, list[int]] = {}

        async def consume(name: str, receive: trio.MemoryReceiveChannel[OutputSignal]) -> None:
            got[name] = [s.token for s in await drain(receive)]
            done.append(name)

        with trio.fail_after(100):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(consume, "a", engine.submit(sim("a", prompt=(1, 2, 3, 4), n=12)))
                await trio.lowlevel.checkpoint()
                nursery.start_soon(consume, "b", engine.submit(sim("b", prompt=(5, 6, 7, 8), n=12)))
            metrics = await wait_idle(engine)
    assert done[0] == first_done
    assert metrics.vllm_preemptions_total >= 1
    # Recompute never duplicates or skips a token.
    assert got["a"] == got["b"] == list(range(1000, 1012))


async def test_preempted_request_goes_back_to_the_front_of_the_queue(autojump_clock):
    # As above with lifo: b is preempted and waits for 3 blocks while a runs; c (1 block) would fit
    # beside a but queues behind b.
    async with running_engine(num_gpu_blocks=4, speedup_ratio=1.0) as engine:
        a = engine.submit(sim("a", prompt=(1, 2, 3, 4), n=12))
        b = engine.submit(sim("b", prompt=(5, 6, 7, 8), n=12))
        resumed: list[float] = []

        async def consume_b() -> None:
            async for _ in b:
                if engine.metrics.vllm_preemptions_total and not resumed and c_submitted:
                    resumed.append(trio.current_time())

        c_submitted = False
        with trio.fail_after(100):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(drain, a)
                nursery.start_soon(consume_b)
                await engine.metrics_value.wait_value(lambda m: m.vllm_preemptions_total == 1)
                assert engine.metrics.waiting_requests == 1
                c = engine.submit(sim("c", prompt=(9,), n=1))
                c_submitted = True
                assert engine.metrics.waiting_requests == 2
                await c.receive()
                c_time = trio.current_time()
    assert resumed and resumed[0] <= c_time


# --- cancellation -------------------------------------------------------------------------------------


async def test_cancel_frees_blocks_and_slot_during_a_long_pass(autojump_clock):
    # speedup 0.0001: every pass is modelled at more than a minute.
    async with running_engine(speedup_ratio=0.0001) as engine:
        receive = engine.submit(sim("a", prompt=range(40), n=10_000))
        other = engine.submit(sim("b", prompt=range(40), n=3))
        with trio.fail_after(10_000):
            await receive.receive()
            await other.receive()
        before = trio.current_time()
        assert engine.metrics.active_decode_blocks > 0
        assert engine.cancel("a") is True
        # Applied at once, not after the modelled pass.
        m = engine.metrics
        assert (m.running_requests, m.waiting_requests) == (1, 0)
        assert m.active_decode_blocks == 11  # only b's 41 tokens -> 11 blocks
        with pytest.raises(trio.EndOfChannel):
            await receive.receive()
        assert trio.current_time() == before
        assert engine.cancel("a") is False  # idempotent
        with trio.fail_after(10_000):
            assert [s.token for s in await drain(other)] == [1001, 1002]
            metrics = await wait_idle(engine)
        assert metrics.active_decode_blocks == 0


async def test_cancel_a_waiting_request(autojump_clock):
    async with running_engine(max_num_seqs=1, speedup_ratio=0.001) as engine:
        a = engine.submit(sim("a", n=3))
        b = engine.submit(sim("b", n=3))
        assert engine.cancel("b") is True
        assert engine.metrics.waiting_requests == 1 and engine.load == 1  # only a (not started yet)
        assert engine.cancel("unknown") is False
        with trio.fail_after(1000):
            assert len(await drain(a)) == 3
            assert await drain(b) == []


async def test_a_closed_reader_cancels_its_request(autojump_clock):
    async with running_engine(speedup_ratio=0.0) as engine:
        receive = engine.submit(sim("a", n=10_000))
        with trio.fail_after(10):
            await receive.receive()
            await receive.aclose()
            metrics = await wait_idle(engine)
    assert metrics.active_decode_blocks == 0 and "a" not in engine


async def test_stopping_the_engine_closes_open_channels(autojump_clock):
    args = engine_args_from_mapping({**BASE, "speedup_ratio": 0.001})
    engine = RankEngine(0, args, None)
    with trio.fail_after(1000):
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            receive = engine.submit(sim("a", n=10_000))
            await receive.receive()
            nursery.cancel_scope.cancel()
        with pytest.raises(trio.EndOfChannel):
            await receive.receive()


async def test_an_idle_engine_does_not_spin(autojump_clock):
    async with running_engine() as engine:
        with trio.fail_after(10):
            await drain(engine.submit(sim("a", n=3)))
        passes = engine.passes
        await trio.sleep(60)  # virtual time: a polling loop would run passes meanwhile
        assert engine.passes == passes
        # ... and wakes up for the next request.
        with trio.fail_after(10):
            assert len(await drain(engine.submit(sim("b", n=3)))) == 3


# --- KV events through the engine ---------------------------------------------------------------------


async def test_one_message_per_pass_with_prompt_and_generated_blocks(autojump_clock):
    publisher = RecordingPublisher()
    async with running_engine(publisher, enable_prefix_caching=True) as engine:
        with trio.fail_after(10):
            await drain(engine.submit(sim("a", prompt=range(8), n=5)))
    # pass 1: the prompt's 2 blocks; passes 2-5 decode positions 8..11: the third block is full after
    # position 11 is computed (pass 5).
    stored = [e for message in publisher.messages for e in message]
    assert all(isinstance(e, BlockStored) for e in stored)
    assert len(publisher.messages) == 2
    first, second = publisher.messages[0][0], publisher.messages[1][0]
    assert first.token_ids == tuple(range(8)) and first.parent_block_hash is None
    assert second.token_ids == (1000, 1001, 1002, 1003)
    assert second.parent_block_hash == first.block_hashes[-1]


async def test_reuse_emits_nothing_and_salt_separates_prefixes(autojump_clock):
    publisher = RecordingPublisher()
    async with running_engine(publisher, enable_prefix_caching=True) as engine:
        with trio.fail_after(10):
            await drain(engine.submit(sim("a", prompt=range(9), n=1)))
            await drain(engine.submit(sim("b", prompt=range(9), n=1)))
            assert len(publisher.messages) == 1  # b reused a's two blocks
            await drain(engine.submit(sim("c", prompt=range(9), n=1, cache_salt="t1")))
            assert len(publisher.messages) == 2
            await drain(engine.submit(sim("d", prompt=range(9), n=1, bypass_prefix_cache=True)))
            assert len(publisher.messages) == 2  # d's blocks duplicate a's: private, no event
    salted = publisher.messages[1][0]
    assert set(salted.block_hashes).isdisjoint(publisher.messages[0][0].block_hashes)


async def test_eviction_is_published_as_removed(autojump_clock):
    publisher = RecordingPublisher()
    async with running_engine(publisher, enable_prefix_caching=True, num_gpu_blocks=3) as engine:
        with trio.fail_after(10):
            await drain(engine.submit(sim("a", prompt=range(8), n=1)))
            await drain(engine.submit(sim("b", prompt=range(100, 112), n=1)))  # 3 blocks: 1 free + 2 evicted
    (stored_a,), (removed, stored_b) = publisher.messages
    assert isinstance(removed, BlockRemoved) and isinstance(stored_b, BlockStored)
    assert removed.block_hashes == tuple(reversed(stored_a.block_hashes))


async def test_no_events_without_prefix_caching(autojump_clock):
    publisher = RecordingPublisher()
    async with running_engine(publisher, enable_prefix_caching=False) as engine:
        with trio.fail_after(10):
            await drain(engine.submit(sim("a", prompt=range(16), n=8)))
    assert publisher.messages == []


async def test_metrics_report_the_rank_and_usage(autojump_clock):
    async with running_engine(rank=3, num_gpu_blocks=10, speedup_ratio=0.001) as engine:
        receive = engine.submit(sim("a", prompt=range(8), n=100))
        with trio.fail_after(1000):
            await receive.receive()
        m = engine.metrics
        assert m.dp_rank == 3 and m.total_blocks == 10
        assert m.active_decode_blocks == 2  # the snapshot after pass 1: the 8-token prompt
        assert m.gpu_cache_usage_perc == pytest.approx(0.2)
        assert "rank=3" in repr(engine)


# --- randomized scenarios -----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(12))
async def test_random_workloads_deliver_every_plan_exactly_once(seed, autojump_clock):
    import random

    rng = random.Random(seed)
    overrides = {
        "block_size": rng.choice([1, 2, 4]),
        "num_gpu_blocks": rng.randint(8, 40),
        "max_num_seqs": rng.choice([None, 1, 3, 8]),
        "max_num_batched_tokens": rng.choice([None, 3, 7, 64]),
        "enable_prefix_caching": rng.random() < 0.7,
        "enable_chunked_prefill": rng.random() < 0.7,
        "preemption_mode": rng.choice(["lifo", "fifo"]),
    }
    publisher = RecordingPublisher()
    async with running_engine(publisher, **overrides) as engine:
        args = engine.args
        results: dict[str, list[OutputSignal]] = {}
        expected: dict[str, tuple[int, ...]] = {}
        cancelled: set[str] = set()

        async def consume(uuid: str, receive: trio.MemoryReceiveChannel[OutputSignal]) -> None:
            results[uuid] = await drain(receive)

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for i in range(40):
                    prompt_len = rng.randint(1, 12)
                    if args.token_budget and not args.enable_chunked_prefill:
                        prompt_len = min(prompt_len, args.token_budget)
                    prompt_len = min(prompt_len, args.num_gpu_blocks * args.block_size)
                    family = rng.randint(0, 3)
                    request = SimRequest(
                        uuid=f"r{i}",
                        prompt=tuple(family * 10 + k for k in range(prompt_len)),
                        plan=tuple(rng.randint(1000, 31999) for _ in range(rng.randint(1, 15))),
                        cache_salt=rng.choice(["", "", "s"]),
                        bypass_prefix_cache=rng.random() < 0.2,
                    )
                    expected[request.uuid] = request.plan
                    nursery.start_soon(consume, request.uuid, engine.submit(request))
                    if rng.random() < 0.3:
                        await trio.lowlevel.checkpoint()
                    if rng.random() < 0.15:
                        victim = f"r{rng.randint(0, i)}"
                        if engine.cancel(victim):
                            cancelled.add(victim)
            metrics = await wait_idle(engine)
    assert metrics.active_decode_blocks == 0
    assert engine.kv_pool.active_blocks == 0
    for uuid, plan in expected.items():
        tokens = [s.token for s in results[uuid]]
        if uuid in cancelled:
            assert tokens == list(plan[: len(tokens)])
            assert not any(s.completed for s in results[uuid][:-1])
        else:
            assert tokens == list(plan)
            assert [s.completed for s in results[uuid]] == [False] * (len(plan) - 1) + [True]
    # Every removal names a stored, not yet removed hash.
    live: set[int] = set()
    for message in publisher.messages:
        assert message
        for event in message:
            if isinstance(event, BlockStored):
                assert live.isdisjoint(event.block_hashes)
                live.update(event.block_hashes)
            else:
                assert set(event.block_hashes) <= live
                live.difference_update(event.block_hashes)
