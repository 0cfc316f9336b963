"""The health prober (docs/reference/sidecar.md#health-prober) through ``open_sidecar`` against the mock.

Every mock binds 127.0.0.1; "vLLM restarts" are new mock servers on the same port.
"""

from __future__ import annotations

import logging

import pytest
import trio
from prober_fakes import MockRunner

from trio_sidecar.api import GenerateContext, open_sidecar
from trio_sidecar.core.config import SidecarConfig
from trio_sidecar.core.errors import CannotConnect, ProtocolError
from trio_sidecar.core.health_policy import WATCH_ENDED, WATCH_NOT_SERVING, HealthKind

SERVING = 1
NOT_SERVING = 2
WAIT = 30.0


def config_for(port: int) -> SidecarConfig:
    return SidecarConfig(
        grpc_endpoint=f"127.0.0.1:{port}",
        grpc_connections=1,
        connect_attempt_timeout=15.0,
        retry_interval=0.05,
        startup_deadline=30.0,
    )


def request(max_tokens: int) -> dict:
    return {"token_ids": [11, 22, 33, 44], "stop_conditions": {"max_tokens": max_tokens, "ignore_eos": True}}


async def wait_kind(sidecar, *kinds: HealthKind):
    with trio.fail_after(WAIT):
        return await sidecar.health.wait_value(lambda s: s.kind in kinds)


async def collect(sidecar, request_id: str, max_tokens: int) -> list:
    chunks = []
    async with sidecar.generate(request(max_tokens), GenerateContext(request_id)) as stream:
        async for chunk in stream:
            chunks.append(chunk)
    return chunks


async def test_not_serving_rejects_new_requests_while_in_flight_ones_continue(nursery, caplog):
    """Not serving: new requests fail with ``vLLM is not serving``; in-flight requests continue."""
    caplog.set_level(logging.WARNING, logger="trio_sidecar.prober")
    runner = MockRunner(nursery)
    mock = await runner.start(engine_args={"block_size": 4, "enable_prefix_caching": False, "speedup_ratio": 1.0})
    with trio.fail_after(120):
        async with open_sidecar(config_for(runner.port)) as sidecar:
            chunks = []
            async with sidecar.generate(request(40), GenerateContext("in-flight")) as stream:
                chunks.append(await stream.__anext__())
                mock.set_serving_status(None, NOT_SERVING)
                state = await wait_kind(sidecar, HealthKind.NOT_SERVING)
                assert state.reason == WATCH_NOT_SERVING

                with pytest.raises(CannotConnect) as rejected:
                    async with sidecar.generate(request(2), GenerateContext("rejected")):
                        pytest.fail("admitted while vLLM is not serving")
                assert rejected.value.message == f"vLLM is not serving: {WATCH_NOT_SERVING}"
                assert "rejected" not in [r[1].request_id for r in mock.recorded_requests]

                async for chunk in stream:  # the in-flight request is not cancelled by the prober
                    chunks.append(chunk)
            assert sum(len(c.token_ids) for c in chunks) == 40
            assert chunks[-1].finish_reason == "length"
    warnings = [r.getMessage() for r in caplog.records if r.name == "trio_sidecar.prober"]
    assert warnings == [f"vLLM is not serving ({WATCH_NOT_SERVING}); new requests are rejected"]


async def test_recovery_with_the_same_identity_reopens_admission(nursery, caplog):
    """Recovery with the same identity reopens admission."""
    caplog.set_level(logging.INFO, logger="trio_sidecar.prober")
    runner = MockRunner(nursery)
    mock = await runner.start()
    with trio.fail_after(120):
        async with open_sidecar(config_for(runner.port)) as sidecar:
            instance = sidecar.model.instance_id
            mock.set_serving_status(None, NOT_SERVING)
            await wait_kind(sidecar, HealthKind.NOT_SERVING)
            mock.set_serving_status(None, SERVING)
            await wait_kind(sidecar, HealthKind.SERVING)
            chunks = await collect(sidecar, "after-recovery", 3)
            assert sum(len(c.token_ids) for c in chunks) == 3
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and r.name == "trio_sidecar.prober"]
    assert f"vLLM is serving again (instance {instance} → {instance})" in infos


async def test_recovery_with_a_changed_served_name_is_fatal(nursery):
    """Recovery with another identity is fatal (docs/reference/sidecar.md#recovery): the error propagates out of ``open_sidecar`` as itself (no ExceptionGroup)."""
    runner = MockRunner(nursery)
    await runner.start()
    with trio.fail_after(120):
        with pytest.raises(ProtocolError) as fatal:
            async with open_sidecar(config_for(runner.port)) as sidecar:
                expected = sidecar.model.identity
                await runner.stop()
                await wait_kind(sidecar, HealthKind.UNREACHABLE, HealthKind.NOT_SERVING)
                await runner.start(served_model_name="renamed-model")
                with trio.fail_after(WAIT):
                    await trio.sleep_forever()  # the prober's fatal error ends the block
    assert fatal.value.message.startswith(
        f"invalid vLLM gRPC response: model identity changed after vLLM recovery: expected {expected!r}, observed "
    )
    assert "served_model_name='renamed-model'" in fatal.value.message
    assert sidecar.health.value.kind is HealthKind.FAILED


async def test_watch_that_ends_is_not_serving_and_the_prober_reconnects(nursery):
    """A Watch stream that ends (docs/reference/sidecar.md#watching), graceful path: vLLM's shutdown ends the Watch streams with OK."""
    runner = MockRunner(nursery)
    mock = await runner.start()
    with trio.fail_after(120):
        async with open_sidecar(config_for(runner.port)) as sidecar:
            async with trio.open_nursery() as watch:
                watch.start_soon(mock.graceful_shutdown)
                with trio.fail_after(WAIT):
                    state = await sidecar.health.wait_value(lambda s: s.reason == WATCH_ENDED)
            assert state.kind is HealthKind.NOT_SERVING
            await runner.stop()
            await runner.start()
            await wait_kind(sidecar, HealthKind.SERVING)
            chunks = await collect(sidecar, "after-restart", 2)
            assert chunks[-1].finish_reason == "length"


async def test_watch_that_errors_is_unreachable_and_the_prober_reconnects(nursery):
    """A Watch stream that fails (docs/reference/sidecar.md#watching), error path: the connection drops (vLLM died)."""
    runner = MockRunner(nursery)
    await runner.start()
    with trio.fail_after(120):
        async with open_sidecar(config_for(runner.port)) as sidecar:
            await runner.stop()
            state = await wait_kind(sidecar, HealthKind.UNREACHABLE)
            assert state.reason
            await runner.start()
            await wait_kind(sidecar, HealthKind.SERVING)
            chunks = await collect(sidecar, "after-restart", 2)
            assert chunks[-1].finish_reason == "length"


def test_watch_ended_reason_text():
    assert WATCH_ENDED == "vLLM Health.Watch ended"
