"""A prober hiccup is not an outage: the prober's own connection to vLLM is reset or closed (fault injection in
a TCP proxy in front of the mock, on 127.0.0.1) while requests flow through ``open_sidecar`` on the pool's
connections. The prober reconnects and watches again at once, and not one request is refused; a
``NOT_SERVING`` reported afterwards still closes admission, and so does a reconnect that fails.

The prober's connection is the one opened after the pool's (``open_sidecar`` starts the prober once the
pool is up); each test checks that the pool's connections were left alone.
"""

from __future__ import annotations

import logging

import attrs
import pytest
import trio
from prober_fakes import ResettableProxy

from trio_sidecar.api import GenerateContext, open_sidecar
from trio_sidecar.core.config import SidecarConfig
from trio_sidecar.core.errors import CannotConnect
from trio_sidecar.core.health_policy import WATCH_NOT_SERVING, HealthKind, HealthState
from trio_sidecar.mock import MockConfig, open_mock_server

CONNECTIONS = 2
WORKERS = 8
WAIT = 30.0
NOT_SERVING = 2
FAST = {"block_size": 4, "enable_prefix_caching": False, "speedup_ratio": 0.0}


@attrs.define
class Load:
    """Requests issued in a loop by ``WORKERS`` tasks; each outcome counted."""

    completed: int = 0
    rejected: list[str] = attrs.Factory(list)  # "vLLM is not serving: ..." refusals
    failed: list[BaseException] = attrs.Factory(list)

    async def run(self, sidecar, stop: trio.Event) -> None:
        async def worker(w: int) -> None:
            n = 0
            while not stop.is_set():
                request = {"token_ids": [11, 22, 33, 44], "stop_conditions": {"max_tokens": 4, "ignore_eos": True}}
                try:
                    tokens = 0
                    async with sidecar.generate(request, GenerateContext(f"load-{w}-{n}")) as stream:
                        async for chunk in stream:
                            tokens += len(chunk.token_ids)
                    assert tokens == 4
                    self.completed += 1
                except CannotConnect as exc:
                    if not exc.message.startswith("vLLM is not serving: "):
                        raise
                    self.rejected.append(exc.message)
                    await trio.sleep(0.01)
                except Exception as exc:  # noqa: BLE001 - recorded, asserted empty
                    self.failed.append(exc)
                n += 1

        async with trio.open_nursery() as nursery:
            for w in range(WORKERS):
                nursery.start_soon(worker, w)

    async def wait_completed(self, count: int) -> None:
        target = self.completed + count
        with trio.fail_after(WAIT):
            while self.completed < target:
                await trio.sleep(0.01)


def config(endpoint: str) -> SidecarConfig:
    return SidecarConfig(
        grpc_endpoint=endpoint,
        grpc_connections=CONNECTIONS,
        connect_attempt_timeout=15.0,
        retry_interval=0.2,
        startup_deadline=30.0,
    )


async def wait_for_links(proxy: ResettableProxy, count: int) -> None:
    with trio.fail_after(WAIT):
        while len(proxy.links) < count:
            await trio.sleep(0.01)


def record_states(sidecar, nursery: trio.Nursery) -> list[HealthState]:
    seen = [sidecar.health.value]

    async def watch() -> None:
        async for state, _ in sidecar.health.transitions():
            seen.append(state)

    nursery.start_soon(watch)
    return seen


@pytest.mark.parametrize("abortive", [True, False], ids=["reset", "close"])
async def test_resetting_the_probers_connection_under_load_refuses_no_request(nursery, caplog, abortive):
    caplog.set_level(logging.INFO, logger="trio_sidecar.prober")
    with trio.fail_after(120):
        async with open_mock_server(MockConfig(listen="127.0.0.1:0", model="mocker-model", engine_args=FAST)) as mock:
            proxy = await nursery.start(ResettableProxy(mock.port).serve)
            async with open_sidecar(config(proxy.endpoint)) as sidecar:
                await wait_for_links(proxy, CONNECTIONS + 1)
                pool_links, prober_link = proxy.links[:CONNECTIONS], proxy.links[CONNECTIONS]
                load, stop = Load(), trio.Event()
                async with trio.open_nursery() as inner:
                    states = record_states(sidecar, inner)
                    inner.start_soon(load.run, sidecar, stop)
                    await load.wait_completed(50)
                    verified_before = [c[0] for c in mock.control_calls].count("GetKvEventSources")
                    before = load.completed
                    proxy.reset(prober_link, abortive=abortive)
                    await wait_for_links(proxy, CONNECTIONS + 1)  # the prober's new connection
                    with trio.fail_after(WAIT):  # ... on which it verified that vLLM is the same one
                        while [c[0] for c in mock.control_calls].count("GetKvEventSources") == verified_before:
                            await trio.sleep(0.01)
                    await load.wait_completed(100)
                    stop.set()
                    inner.cancel_scope.cancel()
                during = load.completed - before
                print(
                    f"\nprober connection {'reset' if abortive else 'closed'}: {during} requests completed across "
                    f"the reconnect, {len(load.rejected)} refused, {len(load.failed)} failed"
                )
                assert load.rejected == []
                assert load.failed == []
                assert states == [HealthState(HealthKind.SERVING)]
                assert proxy.links[:CONNECTIONS] == pool_links  # the pool's connections were not touched
                assert sidecar.engine._pool.reconnects == 0
    assert any("reconnecting at once (admission stays open)" in r.getMessage() for r in caplog.records)
    assert not [r for r in caplog.records if r.name == "trio_sidecar.prober" and r.levelno >= logging.WARNING]


async def test_not_serving_after_a_hiccup_still_closes_admission(nursery):
    with trio.fail_after(120):
        async with open_mock_server(MockConfig(listen="127.0.0.1:0", model="mocker-model", engine_args=FAST)) as mock:
            proxy = await nursery.start(ResettableProxy(mock.port).serve)
            async with open_sidecar(config(proxy.endpoint)) as sidecar:
                await wait_for_links(proxy, CONNECTIONS + 1)
                load, stop = Load(), trio.Event()
                async with trio.open_nursery() as inner:
                    inner.start_soon(load.run, sidecar, stop)
                    await load.wait_completed(20)
                    proxy.reset(proxy.links[CONNECTIONS])
                    await wait_for_links(proxy, CONNECTIONS + 1)
                    await load.wait_completed(20)
                    assert load.rejected == []
                    mock.set_serving_status(None, NOT_SERVING)
                    with trio.fail_after(WAIT):
                        state = await sidecar.health.wait_value(lambda s: not s.admits)
                    assert state == HealthState(HealthKind.NOT_SERVING, WATCH_NOT_SERVING)
                    with trio.fail_after(WAIT):
                        while not load.rejected:
                            await trio.sleep(0.01)
                    stop.set()
                    inner.cancel_scope.cancel()
                assert load.rejected[0] == f"vLLM is not serving: {WATCH_NOT_SERVING}"
                assert load.failed == []


async def test_a_failed_reconnect_still_closes_admission_until_vllm_is_reachable_again(nursery):
    with trio.fail_after(120):
        async with open_mock_server(MockConfig(listen="127.0.0.1:0", model="mocker-model", engine_args=FAST)) as mock:
            proxy = await nursery.start(ResettableProxy(mock.port).serve)
            async with open_sidecar(config(proxy.endpoint)) as sidecar:
                await wait_for_links(proxy, CONNECTIONS + 1)
                load, stop = Load(), trio.Event()
                async with trio.open_nursery() as inner:
                    inner.start_soon(load.run, sidecar, stop)
                    await load.wait_completed(20)
                    proxy.refuse = True  # the prober's reconnect finds no vLLM behind the proxy
                    proxy.reset(proxy.links[CONNECTIONS])
                    with trio.fail_after(WAIT):
                        state = await sidecar.health.wait_value(lambda s: not s.admits)
                    assert state.kind is HealthKind.UNREACHABLE
                    assert state.reason.startswith(f"cannot connect to http://{proxy.endpoint}: "), state.reason
                    with trio.fail_after(WAIT):
                        while not load.rejected:
                            await trio.sleep(0.01)
                    proxy.refuse = False  # reachable again: the next reconnect recovers
                    with trio.fail_after(WAIT):
                        await sidecar.health.wait_value(lambda s: s.admits)
                    rejected = len(load.rejected)
                    await load.wait_completed(20)
                    stop.set()
                    inner.cancel_scope.cancel()
                assert rejected and load.failed == []
                # Refused while unreachable, then (briefly) while the recovery re-checks the model (no reason).
                assert load.rejected[0].startswith("vLLM is not serving: cannot connect to "), load.rejected[0]
                assert {m for m in load.rejected if "cannot connect to" not in m} <= {"vLLM is not serving: recovering"}
