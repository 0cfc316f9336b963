"""The health prober (docs/reference/sidecar.md#health-prober) against a scripted Health + Control server on real sockets.

Every server binds 127.0.0.1 on port 0; waits are on published states, bounded by generous
``fail_after`` guards (the machine is shared), never on elapsed time.
"""

from __future__ import annotations

import logging

import pytest
import trio
from prober_fakes import (
    NOT_SERVING,
    SERVING,
    ScriptedVllm,
    kv_source,
    make_health,
    prober_config,
    running_prober,
    server_info,
)

from trio_sidecar._proto.grpc.health.v1 import health_pb2
from trio_sidecar.core.errors import ProtocolError
from trio_sidecar.core.health_policy import (
    WATCH_ENDED,
    WATCH_NOT_SERVING,
    WATCH_TIMED_OUT,
    HealthKind,
    HealthState,
)
from trio_sidecar.core.status import StatusCode

NOT_SERVING_WARNING = "vLLM is not serving ({reason}); new requests are rejected"


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "trio_sidecar.prober" and r.levelno == logging.WARNING]


def infos_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "trio_sidecar.prober" and r.levelno == logging.INFO]


async def test_serving_server_keeps_admission_open(scripted_vllm):
    async with running_prober(scripted_vllm) as prober:
        # Both Watch streams are open once the server counts the prober's connection.
        with trio.fail_after(20):
            while scripted_vllm.server.open_connections < 1:
                await trio.sleep(0.01)
        await trio.sleep(0.2)
        assert prober.health.kinds() == [HealthKind.SERVING]
        assert scripted_vllm.control.calls["GetModelInfo"] == 0  # no recovery without an outage


async def test_one_service_not_serving_closes_admission_and_warns_once(scripted_vllm, caplog_prober):
    async with running_prober(scripted_vllm) as prober:
        scripted_vllm.health.set_status("vllm.Inference", NOT_SERVING)
        state = await prober.wait_for(HealthKind.NOT_SERVING)
        assert state == HealthState(HealthKind.NOT_SERVING, WATCH_NOT_SERVING)
        scripted_vllm.health.set_status("vllm.Control", NOT_SERVING)  # still not serving: no new warning
        await trio.sleep(0.3)
        assert prober.health.value.kind is HealthKind.NOT_SERVING
    assert warnings_of(caplog_prober) == [NOT_SERVING_WARNING.format(reason=WATCH_NOT_SERVING)]


async def test_recovery_with_the_same_identity_reopens_admission(scripted_vllm, caplog_prober):
    async with running_prober(scripted_vllm) as prober:
        scripted_vllm.health.set_status("vllm.Control", NOT_SERVING)
        await prober.wait_for(HealthKind.NOT_SERVING)
        scripted_vllm.control.server_info = server_info(instance_id="instance-2")
        scripted_vllm.health.set_status("vllm.Control", SERVING)
        await prober.wait_for(HealthKind.SERVING)
        assert prober.health.kinds() == [
            HealthKind.SERVING,
            HealthKind.NOT_SERVING,
            HealthKind.RECOVERING,
            HealthKind.SERVING,
        ]
        assert scripted_vllm.control.calls["GetModelInfo"] == 1
        assert scripted_vllm.control.calls["GetServerInfo"] == 1
        assert scripted_vllm.control.calls["GetKvEventSources"] == 1
        [(model, sources)] = prober.recovered
        assert model.instance_id == "instance-2"
        assert sources == ()
    assert "vLLM is serving again (instance instance-1 → instance-2)" in infos_of(caplog_prober)


async def test_recovery_with_a_changed_served_name_is_fatal(scripted_vllm):
    async with running_prober(scripted_vllm) as prober:
        scripted_vllm.set_all(NOT_SERVING)
        await prober.wait_for(HealthKind.NOT_SERVING)
        expected = scripted_vllm.model().identity
        scripted_vllm.control.model_info.served_model_name = "other-model"
        observed = scripted_vllm.model().identity
        scripted_vllm.set_all(SERVING)
        with trio.fail_after(20):
            await prober.finished.wait()
    assert isinstance(prober.fatal, ProtocolError)
    assert prober.fatal.message == (
        "invalid vLLM gRPC response: model identity changed after vLLM recovery: "
        f"expected {expected!r}, observed {observed!r}"
    )
    assert prober.health.value == HealthState(HealthKind.FAILED, prober.fatal.message)
    assert prober.recovered == []


async def test_recovery_with_a_changed_dp_size_is_fatal(scripted_vllm):
    async with running_prober(scripted_vllm) as prober:
        scripted_vllm.set_all(NOT_SERVING)
        await prober.wait_for(HealthKind.NOT_SERVING)
        scripted_vllm.control.server_info = server_info(dp_size=2)
        scripted_vllm.set_all(SERVING)
        with trio.fail_after(20):
            await prober.finished.wait()
    assert prober.fatal is not None
    assert prober.fatal.message == (
        "invalid vLLM gRPC response: data-parallel size changed after vLLM recovery: expected 1, observed 2"
    )
    assert prober.health.value.kind is HealthKind.FAILED


async def test_recovery_with_changed_kv_sources_replaces_them(scripted_vllm, caplog_prober):
    from trio_sidecar.core.routing import KvEventSource

    scripted_vllm.control.kv_sources = [kv_source("tcp://*:20081")]
    old = (KvEventSource("tcp://127.0.0.1:20081", "", 0),)
    async with running_prober(scripted_vllm, kv_sources=old) as prober:
        scripted_vllm.set_all(NOT_SERVING)
        await prober.wait_for(HealthKind.NOT_SERVING)
        scripted_vllm.control.kv_sources = [kv_source("tcp://0.0.0.0:30099")]
        scripted_vllm.set_all(SERVING)
        await prober.wait_for(HealthKind.SERVING)
        [(_model, sources)] = prober.recovered
        assert sources == (KvEventSource("tcp://127.0.0.1:30099", "", 0),)
        assert prober.fatal is None
    assert any("KV-event sources changed after vLLM recovery" in m for m in warnings_of(caplog_prober))


async def test_a_failing_on_recovered_is_fatal_and_not_a_group(scripted_vllm):
    def explode(model, sources) -> None:
        raise RuntimeError("publisher re-creation failed")

    async with running_prober(scripted_vllm, on_recovered=explode) as prober:
        scripted_vllm.set_all(NOT_SERVING)
        await prober.wait_for(HealthKind.NOT_SERVING)
        scripted_vllm.set_all(SERVING)
        with trio.fail_after(20):
            await prober.finished.wait()
    assert type(prober.fatal) is RuntimeError
    assert prober.health.value == HealthState(HealthKind.FAILED, "publisher re-creation failed")


async def test_watch_that_ends_is_not_serving_and_the_prober_reconnects(scripted_vllm, caplog_prober):
    async with running_prober(scripted_vllm) as prober:
        scripted_vllm.health.shutdown()  # every status NOT_SERVING, then the Watch streams end with OK
        await prober.wait_for_predicate(lambda s: s.reason == WATCH_ENDED)
        assert prober.health.value == HealthState(HealthKind.NOT_SERVING, WATCH_ENDED)
        # vLLM exits and a new one starts on the same port: the prober reconnects and recovers.
        await scripted_vllm.stop()
        scripted_vllm.health = make_health()
        await scripted_vllm.start()
        await prober.wait_for(HealthKind.SERVING)
        assert prober.recovered


async def test_server_crash_is_unreachable_and_a_restart_on_the_same_port_recovers(scripted_vllm, caplog_prober):
    async with running_prober(scripted_vllm) as prober:
        port = scripted_vllm.port
        await scripted_vllm.stop()
        state = await prober.wait_for(HealthKind.UNREACHABLE)
        assert state.reason  # the detail of the failure
        # Reconnect attempts keep failing while the port is closed: still unreachable, one warning.
        await trio.sleep(0.3)
        assert prober.health.value.kind is HealthKind.UNREACHABLE
        assert "cannot connect to" in prober.health.value.reason
        scripted_vllm.control.server_info = server_info(instance_id="instance-2")
        await scripted_vllm.start()
        assert scripted_vllm.port == port
        await prober.wait_for(HealthKind.SERVING)
        assert prober.recovered[-1][0].instance_id == "instance-2"
    warnings = warnings_of(caplog_prober)
    assert len(warnings) == 1 and warnings[0].startswith("vLLM is not serving (")


async def test_unreachable_at_start_then_serving(nursery):
    vllm = ScriptedVllm(nursery)
    await vllm.start()
    port = vllm.port
    await vllm.stop()  # a port that refuses connections, and that we may bind again
    async with running_prober(vllm, config=prober_config(port)) as prober:
        state = await prober.wait_for(HealthKind.UNREACHABLE)
        assert state.reason.startswith(f"cannot connect to http://127.0.0.1:{port}: ")
        await vllm.start()
        await prober.wait_for(HealthKind.SERVING)
        assert prober.health.kinds()[-2:] == [HealthKind.RECOVERING, HealthKind.SERVING]


async def test_transient_recovery_failure_goes_back_and_retries(scripted_vllm):
    from trio_sidecar.transport import RpcError

    scripted_vllm.control.failures = [RpcError(StatusCode.UNAVAILABLE, "engine warming up")]
    async with running_prober(scripted_vllm) as prober:
        scripted_vllm.set_all(NOT_SERVING)
        await prober.wait_for(HealthKind.NOT_SERVING)
        scripted_vllm.set_all(SERVING)
        await prober.wait_for(HealthKind.SERVING)
        assert (
            HealthState(HealthKind.UNREACHABLE, "GetModelInfo: engine warming up (Unavailable)")
            in prober.health.history
        )
        assert scripted_vllm.control.calls["GetModelInfo"] == 2
        assert len(prober.recovered) == 1


async def test_not_serving_during_recovery_cancels_it(scripted_vllm):
    async with running_prober(scripted_vllm) as prober:
        scripted_vllm.set_all(NOT_SERVING)
        await prober.wait_for(HealthKind.NOT_SERVING)
        gate = scripted_vllm.control.gate = trio.Event()
        scripted_vllm.set_all(SERVING)
        await prober.wait_for(HealthKind.RECOVERING)
        scripted_vllm.health.set_status("vllm.Inference", NOT_SERVING)
        await prober.wait_for(HealthKind.NOT_SERVING)
        gate.set()
        await trio.sleep(0.3)
        # The abandoned recovery never reopened admission.
        assert prober.health.value.kind is HealthKind.NOT_SERVING
        assert prober.recovered == []
        scripted_vllm.health.set_status("vllm.Inference", SERVING)
        await prober.wait_for(HealthKind.SERVING)
        assert len(prober.recovered) == 1


def _no_watch_health():
    from trio_sidecar.transport import HealthServicer, RpcError

    class NoWatch(HealthServicer):
        async def Watch(self, request, context):
            raise RpcError(StatusCode.UNIMPLEMENTED, "Method not found!")
            yield  # pragma: no cover - makes this an async generator

    return NoWatch({"": SERVING, "vllm.Control": SERVING, "vllm.Inference": SERVING})


async def test_watch_unimplemented_falls_back_to_check_polling(nursery):
    vllm = ScriptedVllm(nursery, health=_no_watch_health())
    await vllm.start()
    async with running_prober(vllm) as prober:
        await trio.sleep(0.3)
        assert prober.health.value.kind is HealthKind.SERVING
        vllm.health.set_status("vllm.Control", NOT_SERVING)
        state = await prober.wait_for(HealthKind.NOT_SERVING)
        assert state.reason == "vLLM Health.Check is not SERVING"
        vllm.health.set_status("vllm.Control", SERVING)
        await prober.wait_for(HealthKind.SERVING)
        assert len(prober.recovered) == 1


def _failing_health(fail: trio.Event, watching: list, *, times: int = 1, then_silent: bool = False):
    """Watch streams end with UNAVAILABLE once ``fail`` is set (vLLM's SIGTERM path, docs/reference/real-vllm.md#shutdown-and-engine-death,
    or a reset of the prober's own connection), for the first ``times`` sessions; later ones are normal, or
    send nothing at all with ``then_silent``."""
    from trio_sidecar.transport import HealthServicer, RpcError

    class Failing(HealthServicer):
        async def Watch(self, request, context):
            watching.append(request.service)
            if len(watching) > 2 * times and then_silent:
                await trio.sleep_forever()
            if len(watching) > 2 * times:  # later sessions: a normal server again
                async for message in super().Watch(request, context):
                    yield message
                return
            yield health_pb2.HealthCheckResponse(status=SERVING)
            await fail.wait()
            raise RpcError(StatusCode.UNAVAILABLE, "server shutting down")

    return Failing({"": SERVING, "vllm.Control": SERVING, "vllm.Inference": SERVING})


async def wait_watching(watching: list, count: int) -> None:
    with trio.fail_after(20):
        while len(watching) < count:
            await trio.sleep(0.01)


async def test_a_watch_failing_while_serving_is_a_hiccup_reconnected_at_once_with_admission_open(
    nursery, caplog_prober
):
    fail, watching = trio.Event(), []
    vllm = ScriptedVllm(nursery, health=_failing_health(fail, watching))
    await vllm.start()
    # A long retry interval: the reconnect is immediate, not the outage path's.
    async with running_prober(vllm, config=prober_config(vllm.port, retry_interval=60.0)) as prober:
        await wait_watching(watching, 2)
        fail.set()
        await wait_watching(watching, 4)  # the second session watches again
        with trio.fail_after(20):
            while vllm.control.calls["GetKvEventSources"] < 1:  # the verification after the reconnect
                await trio.sleep(0.01)
        await trio.sleep(0.2)
        assert prober.health.history == [HealthState(HealthKind.SERVING)]
        assert prober.recovered == []  # the same vLLM: nothing to adopt
    assert warnings_of(caplog_prober) == []
    assert any("reconnecting at once (admission stays open)" in m for m in infos_of(caplog_prober))


async def test_a_second_failure_within_the_retry_interval_is_an_outage(nursery):
    fail, watching = trio.Event(), []
    vllm = ScriptedVllm(nursery, health=_failing_health(fail, watching, times=2))
    await vllm.start()
    fail.set()  # every stream of the first two sessions fails right after its first status
    async with running_prober(vllm, config=prober_config(vllm.port, retry_interval=0.5)) as prober:
        state = await prober.wait_for(HealthKind.UNREACHABLE)
        assert state.reason.endswith("Health.Watch failed: server shutting down (Unavailable)")
        await prober.wait_for(HealthKind.SERVING)  # the third session: a normal server, recovered
        assert len(prober.recovered) == 1


async def test_a_failed_reconnect_after_a_hiccup_closes_admission(nursery):
    fail, watching = trio.Event(), []
    vllm = ScriptedVllm(nursery, health=_failing_health(fail, watching))
    await vllm.start()
    async with running_prober(vllm) as prober:
        await wait_watching(watching, 2)
        port = vllm.port
        await vllm.stop()  # every connection drops, and the port refuses the reconnect
        state = await prober.wait_for(HealthKind.UNREACHABLE)
        assert state.reason.startswith(f"cannot connect to http://127.0.0.1:{port}: "), state.reason
        assert prober.health.kinds() == [HealthKind.SERVING, HealthKind.UNREACHABLE]


async def test_a_replaced_vllm_found_after_a_hiccup_is_adopted(nursery, caplog_prober):
    fail, watching = trio.Event(), []
    vllm = ScriptedVllm(nursery, health=_failing_health(fail, watching))
    await vllm.start()
    async with running_prober(vllm, config=prober_config(vllm.port, retry_interval=60.0)) as prober:
        await wait_watching(watching, 2)
        vllm.control.server_info = server_info(instance_id="instance-2")
        fail.set()
        with trio.fail_after(20):
            while not prober.recovered:
                await trio.sleep(0.01)
        await prober.wait_for(HealthKind.SERVING)
        assert prober.health.kinds() == [HealthKind.SERVING, HealthKind.RECOVERING, HealthKind.SERVING]
        assert prober.recovered[0][0].instance_id == "instance-2"
    assert "vLLM is serving again (instance instance-1 → instance-2)" in infos_of(caplog_prober)


async def test_a_reconnect_that_gets_no_status_closes_admission_at_the_hung_engine_deadline(nursery):
    fail, watching = trio.Event(), []
    vllm = ScriptedVllm(nursery, health=_failing_health(fail, watching, then_silent=True))
    await vllm.start()
    # keepalive 0.2 s + 0.3 s: the hiccup may keep admission open for 0.5 s at most.
    config = prober_config(vllm.port, keepalive_time=0.2, keepalive_timeout=0.3, retry_interval=60.0)
    async with running_prober(vllm, config=config) as prober:
        await wait_watching(watching, 2)
        fail.set()  # the next session's watches stay silent
        state = await prober.wait_for(HealthKind.UNREACHABLE)
        assert state.reason == (
            "vllm.Control Health.Watch failed: server shutting down (Unavailable); not watching again within 0.5s"
        ) or state.reason == (
            "vllm.Inference Health.Watch failed: server shutting down (Unavailable); not watching again within 0.5s"
        )


def _silent_health():
    from trio_sidecar.transport import HealthServicer

    class Silent(HealthServicer):
        async def Watch(self, request, context):
            await trio.sleep_forever()
            yield  # pragma: no cover

    return Silent()


async def test_watch_without_a_first_status_times_out(nursery):
    vllm = ScriptedVllm(nursery, health=_silent_health())
    await vllm.start()
    config = prober_config(vllm.port, connect_attempt_timeout=0.3, retry_interval=0.05)
    async with running_prober(vllm, config=config) as prober:
        state = await prober.wait_for(HealthKind.UNREACHABLE)
        assert state.reason == WATCH_TIMED_OUT


async def test_prober_connection_is_its_own_and_closes_on_exit(scripted_vllm):
    async with running_prober(scripted_vllm):
        with trio.fail_after(20):
            while scripted_vllm.server.open_connections != 1:
                await trio.sleep(0.01)
    with trio.fail_after(20):
        while scripted_vllm.server.open_connections != 0:
            await trio.sleep(0.01)


def test_health_state_admission():
    assert HealthState(HealthKind.SERVING).admits
    for kind in (HealthKind.NOT_SERVING, HealthKind.UNREACHABLE, HealthKind.RECOVERING, HealthKind.FAILED):
        assert not HealthState(kind, "x").admits


async def test_the_hung_engine_deadline_of_a_hiccup_is_keepalive_time_plus_timeout(nursery, autojump_clock):
    fail, watching = trio.Event(), []
    vllm = ScriptedVllm(nursery, health=_failing_health(fail, watching, then_silent=True))
    await vllm.start()
    config = prober_config(vllm.port, keepalive_time=10.0, keepalive_timeout=4.0, retry_interval=60.0)
    async with running_prober(vllm, config=config) as prober:
        await wait_watching(watching, 2)
        fail.set()
        failed = trio.current_time()
        state = await prober.wait_for(HealthKind.UNREACHABLE, timeout=60)
        assert trio.current_time() - failed == pytest.approx(14.0, abs=0.1)
        assert state.reason.endswith("; not watching again within 14s"), state.reason
        assert prober.health.kinds() == [HealthKind.SERVING, HealthKind.UNREACHABLE]
