"""The embedded API surface (docs/reference/sidecar.md#embedded-api) and the abort sender's bounds (docs/reference/sidecar.md#abort-after-abandoning-a-stream) against the fake."""

from __future__ import annotations

import pytest
import trio
import trio.lowlevel
from sidecar_fakes import NOT_SERVING, SERVING, reference_model_info, sidecar_config

import trio_sidecar
from trio_sidecar import GenerateContext, open_sidecar
from trio_sidecar.core.errors import ProtocolError
from trio_sidecar.core.health_policy import HealthKind
from trio_sidecar.core.status import StatusCode
from trio_sidecar.shell import abort as abort_module

BODY = {"token_ids": [1, 2, 3], "stop_conditions": {"max_tokens": 4}}


def test_every_public_name_resolves():
    assert trio_sidecar.__version__
    for name in trio_sidecar.__all__:
        assert getattr(trio_sidecar, name) is not None, name
    with pytest.raises(AttributeError):
        trio_sidecar.not_a_public_name  # noqa: B018


def test_importing_the_package_does_not_import_trio_for_pure_modules():
    import subprocess
    import sys

    code = "import sys, trio_sidecar.core.errors, trio_sidecar.core.config; print('trio' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


async def test_generate_context_stop_is_idempotent_and_awaitable():
    ctx = GenerateContext()
    assert not ctx.stopped and ctx.request_id == ""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ctx.wait_stopped)
        await trio.lowlevel.checkpoint()
        ctx.stop()
        ctx.stop()
    assert ctx.stopped


async def test_empty_request_id_gets_a_uuid(fake):
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        async with sidecar.generate(BODY) as stream:
            assert len(stream.request_id) == 36
            [_chunk] = [c async for c in stream]
    assert fake.request_ids == [stream.request_id]


async def test_chunks_convert_to_the_dynamo_dict_shape(fake):
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        async with sidecar.generate(BODY, GenerateContext("d")) as stream:
            [chunk] = [c async for c in stream]
    assert chunk.to_dict() == {
        "token_ids": [42],
        "index": 0,
        "text": " token",
        "finish_reason": "stop",
        "stop_reason": 2,
        "completion_usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }


async def test_normal_endings_send_no_abort(fake):
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        async with sidecar.generate(BODY) as stream:
            [_chunk] = [c async for c in stream]
        fake.early_eof_after = 0
        with pytest.raises(ProtocolError):
            async with sidecar.generate(BODY) as stream:
                [_ async for _ in stream]
        fake.early_eof_after = None
        fake.reject = True
        with pytest.raises(Exception, match="rejected by fake vLLM"):
            async with sidecar.generate(BODY):
                pass  # pragma: no cover
    # leaving open_sidecar flushed every queued Abort: none was queued
    assert fake.abort_calls == []
    assert sidecar.engine.aborts_queued == 0


async def test_aborts_queued_while_one_is_in_flight_are_batched(fake):
    fake.hang = True
    fake.abort_hang = True
    async with open_sidecar(sidecar_config(fake.endpoint, abort_timeout=0.5)) as sidecar:
        for name in ("a", "b", "c", "d"):
            ctx = GenerateContext(name)
            async with sidecar.generate(BODY, ctx) as stream:
                async for _chunk in stream:
                    ctx.stop()
            if name == "a":
                with trio.fail_after(2):
                    await fake.abort_received.wait()
        with trio.fail_after(3):
            while len(fake.abort_calls) < 2:
                await trio.sleep(0.01)
    assert fake.abort_calls[0] == ["a"]
    assert fake.abort_calls[1] == ["b", "c", "d"]


async def test_abort_failures_are_logged_never_raised(fake, caplog_sidecar):
    fake.hang = True
    fake.abort_error = (StatusCode.INTERNAL, "abort broke")
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        ctx = GenerateContext("x")
        async with sidecar.generate(BODY, ctx) as stream:
            async for _chunk in stream:
                ctx.stop()
    assert "Control.Abort failed for ['x']: Abort: abort broke (Internal)" in caplog_sidecar.text
    stats = sidecar.stats()
    assert (stats.aborts_queued, stats.aborts_sent, stats.aborts_failed, stats.aborts_timed_out) == (1, 0, 1, 0)


async def test_cleanup_flushes_aborts_within_the_shielded_grace(fake, monkeypatch, autojump_clock):
    monkeypatch.setattr(abort_module, "ABORT_FLUSH_GRACE", 0.3)
    fake.hang = True
    fake.abort_hang = True
    async with open_sidecar(sidecar_config(fake.endpoint, abort_timeout=30)) as sidecar:
        ctx = GenerateContext("flush")
        async with sidecar.generate(BODY, ctx) as stream:
            async for _chunk in stream:
                ctx.stop()
        start = trio.current_time()
    assert trio.current_time() - start < 2  # not the 30 s Abort timeout
    assert fake.abort_calls == [["flush"]]


async def test_leaving_the_block_cancels_in_flight_requests(fake):
    fake.hang = True
    chunks = []
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        stream_cm = sidecar.generate(BODY, GenerateContext("left"))
        stream = await stream_cm.__aenter__()
        chunks.append(await stream.__anext__())
    # the sidecar ended the request: the stream yields the cancelled chunk, then stops
    async for chunk in stream:
        chunks.append(chunk)
    await stream_cm.__aexit__(None, None, None)
    assert chunks[-1].finish_reason == "cancelled"
    with trio.fail_after(2):
        await fake.drop_event("left").wait()
    assert fake.abort_calls == [["left"]]
    assert sidecar.engine.in_flight == 0


async def test_prober_fatal_identity_change_leaves_open_sidecar_as_one_exception(fake):
    config = sidecar_config(fake.endpoint, health_prober=True, retry_interval=0.05, connect_attempt_timeout=1)
    with pytest.raises(ProtocolError, match="model identity changed after vLLM recovery"):
        async with open_sidecar(config) as sidecar:
            fake.model_infos = [reference_model_info(served_model_name="renamed")]
            fake.model_info_calls = 0
            fake.health.set_status("vllm.Control", NOT_SERVING)
            with trio.fail_after(5):
                await sidecar.health.wait_value(lambda s: s.kind is not HealthKind.SERVING)
            fake.health.set_status("vllm.Control", SERVING)
            with trio.fail_after(5):
                await trio.sleep_forever()


async def test_drain_support_stop_admission_in_flight_and_cancel(fake):
    from trio_sidecar.core.errors import EngineShutdown

    fake.hang = True
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        engine = sidecar.engine
        async with sidecar.generate(BODY, GenerateContext("drain")) as stream:
            first = await stream.__anext__()
            assert engine.in_flight == 1
            assert "[started, 1 in flight, 0 aborts queued]" in repr(engine)
            assert repr(sidecar) == "<Sidecar 'served-model' SERVING [1 in flight]>"
            engine.stop_admission()
            with pytest.raises(EngineShutdown, match="^vLLM sidecar is not started$"):
                async with sidecar.generate(BODY):
                    pass  # pragma: no cover
            engine.cancel_in_flight()
            rest = [c async for c in stream]
        with trio.fail_after(2):
            await engine.wait_idle()
        assert engine.in_flight == 0
    assert first.token_ids == [42]
    assert rest[-1].finish_reason == "cancelled"
    assert fake.abort_calls == [["drain"]]


def test_cause_chain_joins_causes_and_contexts():
    from trio_sidecar.shell.pool import cause_chain

    try:
        try:
            raise OSError("connection refused")
        except OSError as inner:
            raise RuntimeError("connect failed") from inner
    except RuntimeError as outer:
        assert cause_chain(outer) == "connect failed: connection refused"
    assert cause_chain(TimeoutError()) == "TimeoutError"


def test_collapse_single_exception_unwraps_a_single_failure_only():
    from trio_sidecar.transport import collapse_single_exception

    with pytest.raises(KeyError):
        with collapse_single_exception():
            raise ExceptionGroup("one", [ExceptionGroup("nested", [KeyError("k")])])
    with pytest.raises(ExceptionGroup):
        with collapse_single_exception():
            raise ExceptionGroup("two", [KeyError("a"), ValueError("b")])


@pytest.mark.parametrize(
    ("state", "message"),
    [
        (("NOT_SERVING", "vLLM Health.Watch is not SERVING"), "vLLM is not serving: vLLM Health.Watch is not SERVING"),
        (("RECOVERING", ""), "vLLM is not serving: recovering"),
    ],
)
async def test_admission_gate_reads_the_health_value(fake, state, message):
    from trio_sidecar.core.errors import CannotConnect
    from trio_sidecar.core.health_policy import HealthState

    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        sidecar.health.value = HealthState(HealthKind[state[0]], state[1])
        with pytest.raises(CannotConnect) as info:
            async with sidecar.generate(BODY):
                pass  # pragma: no cover
        assert str(info.value) == message
        sidecar.health.value = HealthState(HealthKind.SERVING)
        async with sidecar.generate(BODY) as stream:
            [chunk] = [c async for c in stream]
    assert chunk.finish_reason == "stop"
    assert len(fake.requests) == 1


async def test_wait_idle_returns_when_overlapping_requests_have_all_ended(fake):
    fake.hang = True
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        engine = sidecar.engine
        idle = trio.Event()
        first, second = GenerateContext("one"), GenerateContext("two")

        async def waiter():
            await engine.wait_idle()
            idle.set()

        async with sidecar.generate(BODY, first) as one:
            await one.__anext__()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(waiter)
                await trio.lowlevel.checkpoint()
                async with sidecar.generate(BODY, second) as two:
                    await two.__anext__()
                    first.stop()
                    [c async for c in one]
                    await trio.sleep(0.05)
                    assert not idle.is_set() and engine.in_flight == 1
                    second.stop()
                    [c async for c in two]
                with trio.fail_after(2):
                    await idle.wait()
