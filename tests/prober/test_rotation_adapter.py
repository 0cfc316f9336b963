"""The worker's rotation adapter (``dynamo/worker.py``, ``_supervise_health``) on Trio's virtual clock: every
change of the published health state goes to the rotation policy, and its actions reach Dynamo's side in
order and on time (the grace period). Dynamo's side records the calls it gets; the end-to-end version with
Dynamo's runtime and frontend is ``tests/dynamo/test_recovery.py``.
"""

from __future__ import annotations

import logging

import attrs
import trio
import trio.lowlevel
import trio_util

from trio_sidecar.core.config import WorkerOptions
from trio_sidecar.core.health_policy import SERVING_STATE, WATCH_NOT_SERVING, HealthKind, HealthState
from trio_sidecar.core.routing import KvEventSource
from trio_sidecar.dynamo.worker import _supervise_health

GRACE = 5.0
SOURCES = (KvEventSource("tcp://127.0.0.1:20080", "", 0),)
NOT_SERVING = HealthState(HealthKind.NOT_SERVING, WATCH_NOT_SERVING)


class DirectThread:
    """Runs the "asyncio thread" calls in Trio directly."""

    async def run(self, fn, *args):
        return await fn(*args)


@attrs.define
class RecordingDynamo:
    calls: list[tuple[str, float]] = attrs.Factory(list)
    rl_withdrawn: bool = False

    async def unregister(self) -> None:
        self.calls.append(("unregister", trio.current_time()))

    async def register(self) -> None:
        self.calls.append(("register", trio.current_time()))

    async def replace_publishers(self, plan, sources) -> None:
        self.calls.append((f"replace_publishers {[s.endpoint for s in sources]}", trio.current_time()))


@attrs.define
class SidecarState:
    health: trio_util.AsyncValue = attrs.Factory(lambda: trio_util.AsyncValue(SERVING_STATE))
    kv_event_sources: tuple = SOURCES


async def supervised(nursery):
    dynamo, sidecar = RecordingDynamo(), SidecarState()
    options = WorkerOptions(unserving_grace=GRACE)
    nursery.start_soon(_supervise_health, options, DirectThread(), dynamo, sidecar, None, SOURCES)
    await trio.lowlevel.checkpoint()
    return dynamo, sidecar


async def test_not_serving_past_the_grace_unregisters_and_serving_again_registers(nursery, autojump_clock, caplog):
    caplog.set_level(logging.INFO, logger="trio_sidecar.dynamo.worker")
    dynamo, sidecar = await supervised(nursery)
    start = trio.current_time()
    sidecar.health.value = NOT_SERVING
    await trio.sleep(GRACE + 1)
    assert dynamo.calls == [("unregister", start + GRACE)]
    sidecar.kv_event_sources = (KvEventSource("tcp://127.0.0.1:30099", "", 0),)
    back = trio.current_time()
    sidecar.health.value = SERVING_STATE
    await trio.sleep(1)
    assert dynamo.calls[1:] == [("replace_publishers ['tcp://127.0.0.1:30099']", back), ("register", back)]
    messages = [r.getMessage() for r in caplog.records]
    assert f"vLLM has not been serving for 5s ({WATCH_NOT_SERVING}); taking the instance out of rotation" in messages
    assert "vLLM is serving again; the instance is back in rotation" in messages


async def test_an_outage_shorter_than_the_grace_keeps_the_instance(nursery, autojump_clock):
    dynamo, sidecar = await supervised(nursery)
    sidecar.health.value = NOT_SERVING
    await trio.sleep(GRACE - 0.5)
    sidecar.health.value = HealthState(HealthKind.RECOVERING)  # still not serving: the grace runs on
    await trio.sleep(0.4)
    sidecar.health.value = SERVING_STATE
    await trio.sleep(GRACE * 2)
    assert dynamo.calls == []


async def test_a_transient_state_between_two_serving_ones_is_seen(nursery, autojump_clock):
    """A replaced vLLM found after a prober hiccup is published as RECOVERING then SERVING at once."""
    dynamo, sidecar = await supervised(nursery)
    sidecar.kv_event_sources = ()
    sidecar.health.value = HealthState(HealthKind.RECOVERING)
    sidecar.health.value = SERVING_STATE
    await trio.sleep(1)
    assert dynamo.calls == [("replace_publishers []", 0.0)]
