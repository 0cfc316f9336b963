"""Generation through ``open_sidecar`` against the scripted fake (docs/reference/sidecar.md#stream-level-rules, docs/reference/sidecar.md#lifecycle, docs/reference/sidecar.md#cancellation).

Cancellation tests assert what the *server* observed (its handler cancelled = stream reset, ``Abort``
received), not only what the client saw. Cancellation must take effect within 2 s.
"""

from __future__ import annotations

import logging

import pytest
import trio
from sidecar_fakes import decode_request, request, sidecar_config, usage

from trio_sidecar import GenerateContext, open_sidecar
from trio_sidecar.engine import SidecarEngine
from trio_sidecar.errors import (
    CannotConnect,
    EngineShutdown,
    ErrorKind,
    InvalidArgument,
    ProtocolError,
    UnknownError,
)
from trio_sidecar.status import StatusCode


async def collect(sidecar, body, ctx=None):
    chunks = []
    async with sidecar.generate(body, ctx) as stream:
        async for chunk in stream:
            chunks.append(chunk)
    return chunks


async def test_reference_aggregated_stream_yields_one_terminal_chunk(fake):
    body = request(output_options={"logprobs": 1, "prompt_logprobs": 1})
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        assert sidecar.model.served_model_name == "served-model"
        assert sidecar.engine_config.context_length == 8192
        chunks = await collect(sidecar, body, GenerateContext("req-1"))
    [chunk] = chunks
    assert chunk.token_ids == [42]
    assert chunk.text == " token"
    assert chunk.finish_reason == "stop"
    assert chunk.stop_reason == 2
    assert chunk.log_probs == [-0.25]
    assert len(chunk.top_logprobs[0]) == 2
    assert usage(chunk) == (3, 1, 4)
    assert isinstance(chunk.engine_data["prompt_logprobs"], list)
    [(sent, metadata, _peer)] = fake.requests
    assert sent.request_id == "req-1"
    assert sent.model == "served-model"
    assert "x-data-parallel-rank" not in metadata


async def test_pool_of_two_carries_four_streams_from_two_client_ports(fake):
    fake.tokens = 3
    async with open_sidecar(sidecar_config(fake.endpoint, grpc_connections=2)) as sidecar:
        results = []

        async def one(i):
            results.append(await collect(sidecar, request(), GenerateContext(f"r{i}")))

        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(one, i)
        local_ports = {ch.local_address[1] for ch in sidecar.engine.pool.channels}
    assert len(results) == 4
    assert all(chunks[-1].finish_reason == "stop" for chunks in results)
    ports = {peer[1] for _req, _md, peer in fake.requests}
    assert len(fake.requests) == 4
    assert len(ports) == 2
    assert ports == local_ports
    assert all("x-data-parallel-rank" not in md for _req, md, _peer in fake.requests)


async def test_dp_rank_travels_as_metadata(fake):
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        await collect(sidecar, request(routing={"dp_rank": 1}))
        await collect(sidecar, request())
    assert fake.requests[0][1]["x-data-parallel-rank"] == "1"
    assert "x-data-parallel-rank" not in fake.requests[1][1]


async def test_eof_before_terminal_is_a_protocol_error(fake):
    fake.early_eof_after = 0
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        with pytest.raises(ProtocolError, match="GenerateStream ended before a terminal response"):
            await collect(sidecar, request())


async def test_open_rejection_is_raised_by_generate_and_reaches_the_server_once(fake):
    fake.reject = True
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        with pytest.raises(InvalidArgument) as info:
            async with sidecar.generate(request()):
                pytest.fail("the open must fail")  # pragma: no cover
    assert str(info.value) == "GenerateStream: rejected by fake vLLM (InvalidArgument)"
    assert len(fake.requests) == 1


@pytest.mark.parametrize(
    ("knob", "error_kind"),
    [("early_eof_after", ErrorKind.UNKNOWN), ("read_error_after", ErrorKind.CANNOT_CONNECT)],
)
async def test_stream_error_after_one_token_keeps_the_token(fake, knob, error_kind):
    fake.tokens = 5
    setattr(fake, knob, 1)
    chunks = []
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        with pytest.raises(Exception) as info:
            async with sidecar.generate(request()) as stream:
                async for chunk in stream:
                    chunks.append(chunk)
    assert info.value.kind is error_kind
    assert [c.token_ids for c in chunks] == [[42]]


async def test_open_error_unavailable_maps_to_cannot_connect_with_no_tokens(fake):
    fake.open_error = (StatusCode.UNAVAILABLE, "engine gone")
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        with pytest.raises(CannotConnect, match=r"GenerateStream: engine gone \(Unavailable\)"):
            await collect(sidecar, request())


async def test_data_after_the_terminal_is_ignored(fake):
    fake.tokens = 2
    fake.after_terminal = 3
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        chunks = await collect(sidecar, request())
    assert [c.finish_reason for c in chunks] == [None, "stop"]
    assert usage(chunks[-1]) == (3, 2, 5)


async def test_lifecycle_not_started_already_started_and_cleanup_twice(fake, nursery):
    engine = SidecarEngine(sidecar_config(fake.endpoint))
    await engine.cleanup()  # safe before start
    engine = SidecarEngine(sidecar_config(fake.endpoint))
    with pytest.raises(EngineShutdown, match="^vLLM sidecar is not started$"):
        async with engine.generate(request()):
            pass  # pragma: no cover
    await engine.start(nursery)
    with pytest.raises(EngineShutdown, match="^vLLM sidecar has already started$"):
        await engine.start(nursery)
    chunks = []
    async with engine.generate(request()) as stream:
        chunks = [c async for c in stream]
    assert chunks[-1].finish_reason == "stop"
    await engine.cleanup()
    await engine.cleanup()
    with pytest.raises(EngineShutdown, match="^vLLM sidecar is not started$"):
        async with engine.generate(request()):
            pass  # pragma: no cover
    assert engine.pool.closed


async def test_a_concurrent_cleanup_returns_only_once_the_first_has_closed_everything(fake, nursery):
    fake.hang = True  # endless chunks: the in-flight request keeps the first cleanup busy
    engine = SidecarEngine(sidecar_config(fake.endpoint))
    await engine.start(nursery)
    returned: list[str] = []

    async def cleanup(name: str) -> None:
        await engine.cleanup()
        assert engine.pool.closed and engine.in_flight == 0  # never returns while still closing
        returned.append(name)

    async with engine.generate(request()) as stream:
        await stream.__anext__()
        with trio.fail_after(10):
            async with trio.open_nursery() as cleanups:
                cleanups.start_soon(cleanup, "first")
                await trio.sleep(0)
                cleanups.start_soon(cleanup, "second")
        chunks = [c async for c in stream]
    assert chunks[-1].finish_reason == "cancelled"
    assert sorted(returned) == ["first", "second"]


BAD_BODIES = [
    ({"token_ids": []}, "token_ids must not be empty"),
    # An int beyond the f64 range (JSON has no limit): a typed error, not an OverflowError.
    ({"token_ids": [1], "sampling_options": {"temperature": 10**400}},
     "invalid PreprocessedRequest: integer too large to convert to a float @ $.sampling_options.temperature"),
    ({"token_ids": [1], "sampling_options": {"min_p": -10**400}},
     "invalid PreprocessedRequest: integer too large to convert to a float @ $.sampling_options.min_p"),
    # vLLM's own check and text (docs/conformance.md), before any RPC.
    ({"token_ids": [1], "sampling_options": {"temperature": float("nan")}},
     "temperature must be a finite number, got NaN"),
]


@pytest.mark.parametrize(("body", "message"), BAD_BODIES, ids=["empty", "huge-int", "huge-negative-int", "nan"])
async def test_conversion_error_is_raised_before_any_rpc(fake, body, message):
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        with pytest.raises(InvalidArgument) as info:
            async with sidecar.generate(body):
                pass  # pragma: no cover
    assert str(info.value) == message
    assert fake.requests == []


# ---------------------------------------------------------------------------- cancellation


@pytest.mark.parametrize("abort_on_cancel", [True, False])
async def test_aggregated_cancel_after_first_chunk(fake, abort_on_cancel):
    fake.hang = True
    config = sidecar_config(fake.endpoint, abort_on_cancel=abort_on_cancel)
    async with open_sidecar(config) as sidecar:
        ctx = GenerateContext("agg-cancel")
        chunks = []
        async with sidecar.generate(request(), ctx) as stream:
            async for chunk in stream:
                chunks.append(chunk)
                if len(chunks) == 1:
                    ctx.stop()
        with trio.fail_after(2):
            await fake.drop_event("agg-cancel").wait()
        if abort_on_cancel:
            with trio.fail_after(2):
                await fake.abort_received.wait()
        else:
            await trio.sleep(0.3)
    assert chunks[0].token_ids == [42]
    final = chunks[-1]
    assert final.finish_reason == "cancelled"
    assert final.token_ids == []
    assert usage(final)[0] == 3 and usage(final)[1] >= 1
    assert usage(final)[1] == len(chunks) - 1  # exactly the delivered tokens are counted
    if abort_on_cancel:
        assert ["agg-cancel"] in fake.abort_calls
    else:
        assert fake.abort_calls == []


async def test_cancel_while_headers_are_pending_gives_a_cancelled_chunk(fake):
    fake.hang_before_headers = True
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        ctx = GenerateContext("pending")

        async def stop_when_arrived():
            await fake.request_arrived.wait()
            ctx.stop()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(stop_when_arrived)
            with trio.fail_after(2):
                chunks = await collect(sidecar, request(), ctx)
        with trio.fail_after(2):
            await fake.drop_event("pending").wait()
    [chunk] = chunks
    assert chunk.finish_reason == "cancelled"
    assert usage(chunk) == (3, 0, 3)


async def test_cancel_before_open_sends_no_rpc(fake):
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        ctx = GenerateContext("early")
        ctx.stop()
        chunks = await collect(sidecar, request(), ctx)
    [chunk] = chunks
    assert chunk.finish_reason == "cancelled"
    assert usage(chunk) == (3, 0, 3)
    assert fake.requests == []
    assert fake.abort_calls == []


async def test_cleanup_during_a_read_yields_a_cancelled_chunk_and_drops_the_rpc(fake):
    fake.hang = True
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        chunks = []
        async with trio.open_nursery() as nursery:
            async with sidecar.generate(request(), GenerateContext("shut")) as stream:
                async for chunk in stream:
                    chunks.append(chunk)
                    if len(chunks) == 1:
                        nursery.start_soon(sidecar.engine.cleanup)
        with trio.fail_after(2):
            await fake.drop_event("shut").wait()
        assert fake.abort_calls == [["shut"]]  # flushed by cleanup before it returned
    assert chunks[-1].finish_reason == "cancelled"
    assert usage(chunks[-1])[1] >= 1


async def test_scope_cancellation_drops_the_stream_and_queues_an_abort(fake):
    fake.hang = True
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        with trio.CancelScope() as scope:
            async with sidecar.generate(request(), GenerateContext("scoped")) as stream:
                async for _chunk in stream:
                    scope.cancel()
                    await trio.sleep(0)
        assert scope.cancelled_caught
        with trio.fail_after(2):
            await fake.drop_event("scoped").wait()
            await fake.abort_received.wait()
    assert fake.abort_calls == [["scoped"]]


async def test_a_cancelled_request_does_not_disturb_another_on_the_same_connection(fake):
    fake.hang = True
    async with open_sidecar(sidecar_config(fake.endpoint, grpc_connections=1)) as sidecar:
        victim = GenerateContext("victim")
        async with sidecar.generate(request(), GenerateContext("survivor")) as survivor:
            first = await survivor.__anext__()
            victim_chunks = []
            async with sidecar.generate(request(), victim) as stream:
                async for chunk in stream:
                    victim_chunks.append(chunk)
                    victim.stop()
            with trio.fail_after(2):
                await fake.drop_event("victim").wait()
            more = [await survivor.__anext__() for _ in range(3)]
        assert first.token_ids == [42]
        assert all(c.token_ids == [42] for c in more)
        assert victim_chunks[-1].finish_reason == "cancelled"
        assert not fake.drop_event("survivor").is_set() or fake.dropped_at["survivor"] > fake.dropped_at["victim"]


async def test_conversion_error_mid_stream_raises_drops_and_aborts(fake):
    fake.bad_after = 1
    fake.tokens = 10
    chunks = []
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        with pytest.raises(ProtocolError, match="received unsupported sequence index 1"):
            async with sidecar.generate(request(), GenerateContext("bad")) as stream:
                async for chunk in stream:
                    chunks.append(chunk)
        with trio.fail_after(2):
            await fake.drop_event("bad").wait()
            await fake.abort_received.wait()
    assert [c.token_ids for c in chunks] == [[42]]
    assert fake.abort_calls == [["bad"]]


async def test_an_unparsable_message_mid_stream_raises_the_transport_error_drops_and_aborts(fake):
    fake.unparsable_after = 1
    fake.tokens = 10
    chunks = []
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        with pytest.raises(UnknownError) as caught:
            async with sidecar.generate(request(), GenerateContext("garbled")) as stream:
                async for chunk in stream:
                    chunks.append(chunk)
        with trio.fail_after(2):
            await fake.drop_event("garbled").wait()
            await fake.abort_received.wait()
        # The connection is still good: the next request completes.
        fake.unparsable_after = None
        after = await collect(sidecar, request(), GenerateContext("after-garbled"))
    assert str(caught.value) == (
        "GenerateStream: failed to parse a response message of /vllm.Inference/GenerateStream (Internal)"
    )
    assert [c.token_ids for c in chunks] == [[42]]
    assert fake.abort_calls == [["garbled"]]
    assert after[-1].finish_reason == "stop"


async def test_abort_timeout_is_logged_with_the_configured_value(fake, caplog_sidecar):
    fake.hang = True
    fake.abort_hang = True
    async with open_sidecar(sidecar_config(fake.endpoint, abort_timeout=0.2)) as sidecar:
        ctx = GenerateContext("slow-abort")
        async with sidecar.generate(request(), ctx) as stream:
            async for _chunk in stream:
                ctx.stop()
        with trio.fail_after(2):
            await fake.abort_received.wait()
        with trio.fail_after(2):
            while "Abort did not respond within 0.2s" not in caplog_sidecar.text:
                await trio.sleep(0.02)


# ---------------------------------------------------------------------------- decode deferral (docs/reference/sidecar.md#decode-deferral)


async def test_decode_cancel_while_headers_are_held_waits_for_the_first_token(fake):
    fake.hang = True
    fake.hold_first = trio.Event()
    first_token_notified = []
    config = sidecar_config(fake.endpoint, disaggregation_mode="decode")
    async with open_sidecar(config) as sidecar:
        ctx = GenerateContext("dec", on_first_token=lambda: first_token_notified.append(True))
        result = []

        async def run():
            result.extend(await collect(sidecar, decode_request(), ctx))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            with trio.fail_after(2):
                await fake.request_arrived.wait()
            ctx.stop()
            await trio.sleep(0.2)
            assert not fake.drop_event("dec").is_set()  # never dropped before the first token
            assert result == []
            fake.hold_first.set()
        with trio.fail_after(2):
            await fake.drop_event("dec").wait()
            await fake.abort_received.wait()
    [chunk] = result
    assert chunk.finish_reason == "cancelled"
    assert usage(chunk) == (3, 1, 4)  # counts the first token it replaced (docs/reference/sidecar.md#decode-deferral)
    assert first_token_notified == [True]
    assert fake.abort_calls == [["dec"]]
    assert fake.requests[0][0].kv.kv_transfer_params["remote_port"] == "20097"


async def test_decode_cancel_before_generate_still_submits_the_request(fake):
    fake.hang = True
    config = sidecar_config(fake.endpoint, disaggregation_mode="decode")
    async with open_sidecar(config) as sidecar:
        ctx = GenerateContext("dec-early")
        ctx.stop()
        chunks = await collect(sidecar, decode_request(), ctx)
    assert len(fake.requests) == 1
    assert [c.finish_reason for c in chunks] == ["cancelled"]
    assert usage(chunks[0])[1] == 1


async def test_decode_scope_cancellation_propagates_at_once_but_keeps_the_stream(fake):
    fake.hang = True
    fake.hold_first = trio.Event()
    config = sidecar_config(fake.endpoint, disaggregation_mode="decode")
    async with open_sidecar(config) as sidecar:
        with trio.CancelScope() as scope:

            async def cancel_when_arrived():
                await fake.request_arrived.wait()
                scope.cancel()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(cancel_when_arrived)
                await collect(sidecar, decode_request(), GenerateContext("dec-scope"))
        assert scope.cancelled_caught
        await trio.sleep(0.2)
        assert not fake.drop_event("dec-scope").is_set()
        assert sidecar.engine.in_flight == 1
        fake.hold_first.set()
        with trio.fail_after(2):
            await fake.drop_event("dec-scope").wait()
            await fake.abort_received.wait()
    assert fake.abort_calls == [["dec-scope"]]


@pytest.mark.parametrize(
    ("knob", "warning"),
    [
        ("early_eof_after", "vLLM GenerateStream ended before transfer completion after request cancellation"),
        ("read_error_after", "vLLM GenerateStream failed before transfer completion after request cancellation"),
        ("bad_after", "vLLM response conversion failed after request cancellation"),
    ],
)
async def test_decode_after_cancellation_eof_or_error_gives_a_cancelled_chunk(fake, caplog_sidecar, knob, warning):
    fake.hold_first = trio.Event()
    fake.tokens = 5
    setattr(fake, knob, 0)
    config = sidecar_config(fake.endpoint, disaggregation_mode="decode")
    async with open_sidecar(config) as sidecar:
        ctx = GenerateContext("dec-eof")
        result = []

        async def run():
            result.extend(await collect(sidecar, decode_request(), ctx))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            with trio.fail_after(2):
                await fake.request_arrived.wait()
            ctx.stop()
            await trio.sleep(0.05)
            fake.hold_first.set()
    assert [c.finish_reason for c in result] == ["cancelled"]
    assert warning in caplog_sidecar.text
    assert any(r.levelno == logging.WARNING and warning in r.getMessage() for r in caplog_sidecar.records)


async def test_decode_cancel_after_the_first_token_is_immediate(fake):
    fake.hang = True
    config = sidecar_config(fake.endpoint, disaggregation_mode="decode")
    async with open_sidecar(config) as sidecar:
        ctx = GenerateContext("dec-late")
        chunks = []
        async with sidecar.generate(decode_request(), ctx) as stream:
            async for chunk in stream:
                chunks.append(chunk)
                if len(chunks) == 2:
                    ctx.stop()
        with trio.fail_after(2):
            await fake.drop_event("dec-late").wait()
    assert [c.token_ids for c in chunks[:2]] == [[42], [42]]
    assert chunks[-1].finish_reason == "cancelled"


@pytest.mark.parametrize("task_ends_first", [False, True])
async def test_cancel_with_a_batch_half_returned_counts_only_the_returned_chunks(fake, task_ends_first):
    # While the caller sleeps, several messages are received; the request task hands them over as one
    # run. Stopping with chunks handed over but not taken drops them: the cancelled chunk comes next and
    # its usage counts exactly the chunks the caller got.
    fake.hang = True
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        ctx = GenerateContext("batch-cancel")
        chunks = []
        async with sidecar.generate(request(), ctx) as stream:
            chunks.append(await stream.__anext__())
            await trio.sleep(0.2)  # ~20 messages arrive meanwhile; the request pauses one run ahead
            chunks.append(await stream.__anext__())  # the caller starts on the next run: the request resumes
            await trio.sleep(0.05)  # and hands the messages received meanwhile over as one run
            chunks.append(await stream.__anext__())
            assert not stream._finished and stream._pending  # chunks handed over but not taken yet
            ctx.stop()
            if task_ends_first:  # the request task builds its cancelled chunk before the caller drops the rest
                with trio.fail_after(2):
                    await fake.drop_event("batch-cancel").wait()
                await trio.sleep(0.05)
            async for chunk in stream:
                chunks.append(chunk)
    assert [c.token_ids for c in chunks[:-1]] == [[42]] * 3
    final = chunks[-1]
    assert final.finish_reason == "cancelled"
    assert usage(final)[1] == 3
