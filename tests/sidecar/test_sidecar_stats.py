"""``Sidecar.stats()`` against the real mock over TCP (docs/observability.md): a known mix of requests counted
exactly, the prober's transitions while the mock reports NOT_SERVING, and the snapshot's invariants."""

from __future__ import annotations

import pytest
import trio
from sidecar_fakes import FAST_ENGINE_ARGS, sidecar_config

from trio_sidecar import CannotConnect, GenerateContext, HealthKind, InvalidArgument, StatsSnapshot, open_sidecar
from trio_sidecar.mock import MockConfig, open_mock_server

N_COMPLETED, M_CANCELLED, K_REJECTED = 5, 3, 2
MAX_TOKENS = 6
PROMPT = [11, 22, 33, 44]
SERVING, NOT_SERVING = 1, 2  # grpc.health.v1 ServingStatus


def mock_config(**engine_args):
    return MockConfig(
        listen="127.0.0.1:0", model="mocker-model", seed=7, engine_args={**FAST_ENGINE_ARGS, **engine_args}
    )


def body(max_tokens: int = MAX_TOKENS) -> dict:
    return {"token_ids": PROMPT, "stop_conditions": {"max_tokens": max_tokens, "ignore_eos": True}}


async def test_a_fresh_sidecar_reports_zeros_and_its_pool():
    async with open_mock_server(mock_config()) as mock:
        async with open_sidecar(sidecar_config(mock.address, grpc_connections=3)) as sidecar:
            stats = sidecar.stats()
    assert isinstance(stats, StatsSnapshot)
    assert stats.requests_started == stats.requests_in_flight == 0
    assert stats.requests_started_by_dp_rank == {None: 0}
    assert set(stats.requests_finished.values()) == {0} and set(stats.request_errors.values()) == {0}
    assert stats.time_to_first_token.count == stats.inter_token_latency.count == 0
    assert stats.health_state == "serving"
    assert (stats.pool_connections, stats.pool_connections_up) == (3, 3)


async def test_a_known_mix_is_counted_exactly():
    # paced like an engine (a few ms per token): a request can be cancelled mid-stream
    async with open_mock_server(mock_config(speedup_ratio=1.0)) as mock:
        config = sidecar_config(mock.address, health_prober=True, retry_interval=0.05, connect_attempt_timeout=1)
        async with open_sidecar(config) as sidecar:
            finals = []
            with trio.fail_after(30):
                for i in range(N_COMPLETED):
                    async with sidecar.generate(body(), GenerateContext(f"done-{i}")) as stream:
                        chunks = [chunk async for chunk in stream]
                    finals.append(chunks[-1])
                for i in range(M_CANCELLED):
                    ctx = GenerateContext(f"stopped-{i}")
                    async with sidecar.generate(body(20000), ctx) as stream:
                        async for chunk in stream:
                            if chunk.token_ids:
                                ctx.stop()
                            if chunk.finish_reason is not None:
                                finals.append(chunk)
                while sidecar.stats().aborts_sent < M_CANCELLED:
                    await trio.sleep(0.01)

                with pytest.raises(InvalidArgument):
                    async with sidecar.generate({"token_ids": []}):
                        pass

                mock.set_serving_status(None, NOT_SERVING)
                await sidecar.health.wait_value(lambda s: s.kind is HealthKind.NOT_SERVING)
                assert sidecar.stats().health_state == "not_serving"
                for _ in range(K_REJECTED):
                    with pytest.raises(CannotConnect, match="^vLLM is not serving"):
                        async with sidecar.generate(body()):
                            pass
                mock.set_serving_status(None, SERVING)
                await sidecar.health.wait_value(lambda s: s.kind is HealthKind.SERVING)
            stats = sidecar.stats()

    assert [f.finish_reason for f in finals] == ["length"] * N_COMPLETED + ["cancelled"] * M_CANCELLED
    assert stats.requests_started == N_COMPLETED + M_CANCELLED
    assert stats.requests_started_by_dp_rank == {None: N_COMPLETED + M_CANCELLED}
    assert stats.requests_in_flight == 0
    assert stats.requests_finished == {"stop": 0, "length": N_COMPLETED, "cancelled": M_CANCELLED}
    assert set(stats.request_errors.values()) == {0}
    assert stats.requests_rejected == {"not_serving": K_REJECTED, "not_started": 0, "invalid_argument": 1}
    # tokens: exactly what the final chunks' usage reported
    assert stats.prompt_tokens == sum(f.completion_usage.prompt_tokens for f in finals) == 8 * len(PROMPT)
    assert stats.completion_tokens == sum(f.completion_usage.completion_tokens for f in finals)
    assert stats.completion_tokens >= N_COMPLETED * MAX_TOKENS + M_CANCELLED
    # one first-token observation per request; one mean inter-token latency per request with later tokens
    assert stats.time_to_first_token.count == N_COMPLETED + M_CANCELLED
    assert 0 < stats.time_to_first_token.sum
    assert 0 < stats.inter_token_latency.count <= N_COMPLETED + M_CANCELLED
    assert 0 < stats.inter_token_latency.sum
    assert stats.inter_token_latency.cumulative()[-1] == stats.inter_token_latency.count
    assert (stats.aborts_queued, stats.aborts_sent, stats.aborts_failed, stats.aborts_timed_out) == (3, 3, 0, 0)
    assert stats.decode_deferrals == 0
    # SERVING → NOT_SERVING → RECOVERING (both services SERVING again: rediscovery) → SERVING
    assert stats.health_transitions == {
        "serving": 1,
        "not_serving": 1,
        "unreachable": 0,
        "recovering": 1,
        "failed": 0,
    }
    assert stats.health_state == "serving"


async def test_requests_after_the_block_are_rejected_as_not_started_and_requests_count_per_dp_rank():
    async with open_mock_server(mock_config(dp_size=2)) as mock:
        async with open_sidecar(sidecar_config(mock.address)) as sidecar:
            with trio.fail_after(10):
                for rank in (1, 1, 0):
                    async with sidecar.generate(dict(body(2), routing={"dp_rank": rank})) as stream:
                        async for _chunk in stream:
                            pass
                async with sidecar.generate(body(2)) as stream:
                    async for _chunk in stream:
                        pass
            sidecar.engine.stop_admission()
            with pytest.raises(Exception, match="^vLLM sidecar is not started$"):
                async with sidecar.generate(body()):
                    pass
    stats = sidecar.stats()
    assert stats.requests_started_by_dp_rank == {None: 1, 0: 1, 1: 2}
    assert stats.requests_in_flight_by_dp_rank == {None: 0, 0: 0, 1: 0}
    assert stats.requests_rejected["not_started"] == 1


async def test_a_snapshot_is_frozen_and_a_copy():
    async with open_mock_server(mock_config()) as mock:
        async with open_sidecar(sidecar_config(mock.address)) as sidecar:
            before = sidecar.stats()
            async with sidecar.generate(body(2)) as stream:
                async for _chunk in stream:
                    pass
            after = sidecar.stats()
    assert before.requests_started == 0 and before.requests_finished["length"] == 0
    assert after.requests_started == 1 and after.requests_finished["length"] == 1
    with pytest.raises(AttributeError):
        after.requests_started = 5  # type: ignore[misc]
