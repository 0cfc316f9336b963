"""``submit()``: generation whose chunks go to a sink, against the scripted fake (the ``generate()``
counterparts of tests/sidecar/test_sidecar_generate.py).

``submit()`` is synchronous: conversion errors, admission refusal and "not started" are raised by the call
(the sink is never called); everything else reaches the sink as ``chunk(c)`` per ordinary chunk and exactly
one ``end(final, error)``, last. Cancellation tests assert what the *server* observed (its handler
cancelled = stream reset, ``Abort`` received), not only what the sink got. Cancellation must take effect within 2 s.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import trio
from sidecar_fakes import PREFILL_HANDOFF, decode_request, request, sidecar_config, usage

from trio_sidecar import GenerateContext, open_sidecar
from trio_sidecar.engine import SidecarEngine
from trio_sidecar.protocol import token_chunk
from trio_sidecar.errors import (
    CannotConnect,
    EngineShutdown,
    ErrorKind,
    InvalidArgument,
    ProtocolError,
    UnknownError,
)
from trio_sidecar.prober import HealthKind, HealthState
from trio_sidecar.status import StatusCode


class RecordingSink:
    """A :class:`~trio_sidecar.engine.ChunkSink` that records what it got.

    Protocol violations (a second ``end``, a chunk after ``end``, ``end`` with both or neither argument)
    are recorded rather than raised (a sink must not raise) and checked by :meth:`outcome`.

    Args:
        engine: when given, ``engine.in_flight`` is recorded when ``end`` runs.
        on_chunk: called as ``on_chunk(sink, chunk)`` after a chunk was recorded (in the reading task).
    """

    def __init__(self, engine: SidecarEngine | None = None, on_chunk: Any = None) -> None:
        self.chunks: list[Any] = []
        self.ends: list[tuple[Any, Any]] = []
        self.violations: list[str] = []
        self.ended = trio.Event()
        self.in_flight_at_end: int | None = None
        self._engine = engine
        self._on_chunk = on_chunk
        self._changed = trio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def chunk(self, chunk: Any) -> None:
        if self.ended.is_set():
            self.violations.append(f"chunk after end: {chunk!r}")
            return
        self.chunks.append(chunk)
        if self._on_chunk is not None:
            self._on_chunk(self, chunk)
        self._notify()

    def tokens(self, token_ids: list[int], text: str | None) -> None:
        self.chunk(token_chunk(token_ids, text))

    def end(self, final: Any, error: Any) -> None:
        if self.ended.is_set():
            self.violations.append(f"end called again: {final!r}, {error!r}")
            return
        if (final is None) == (error is None):
            self.violations.append(f"end needs exactly one of final/error: {final!r}, {error!r}")
        self.ends.append((final, error))
        if self._engine is not None:
            self.in_flight_at_end = self._engine.in_flight
        self.ended.set()
        self._notify()

    async def wait_chunks(self, n: int) -> None:
        """Wait (unbounded: callers bound it) until ``n`` chunks arrived; fails if the request ended first."""
        while len(self.chunks) < n:
            if self.ended.is_set():
                raise AssertionError(f"ended after {len(self.chunks)} chunks (wanted {n}): {self.ends}")
            await self._changed.wait()

    def outcome(self) -> tuple[Any, Any]:
        assert self.violations == []
        assert len(self.ends) == 1, self.ends
        return self.ends[0]

    def final(self) -> Any:
        final, error = self.outcome()
        assert error is None, repr(error)
        return final

    def error(self) -> BaseException:
        final, error = self.outcome()
        assert final is None, final
        return error


async def submit_and_wait(sidecar, body, ctx=None, **sink_args) -> RecordingSink:
    sink = RecordingSink(sidecar.engine, **sink_args)
    sidecar.submit(body, ctx if ctx is not None else GenerateContext(), sink)
    with trio.fail_after(2):
        await sink.ended.wait()
    return sink


def delivered(sink: RecordingSink) -> list[int]:
    """Every token id the sink's chunks carried, in order (the chunks of messages read together come merged,
    so tests that are not about chunk boundaries compare tokens)."""
    return [t for c in sink.chunks for t in c.token_ids]


def stop_at(n: int, ctx: GenerateContext):
    """``on_chunk``: ``ctx.stop()`` when the ``n``-th chunk arrives (from the task that read it)."""

    def on_chunk(sink: RecordingSink, _chunk: Any) -> None:
        if len(sink.chunks) == n:
            ctx.stop()

    return on_chunk


# ---------------------------------------------------------------------------- streams


async def test_reference_aggregated_stream_ends_with_the_terminal_chunk(fake):
    body = request(output_options={"logprobs": 1, "prompt_logprobs": 1})
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        sink = await submit_and_wait(sidecar, body, GenerateContext("req-1"))
        assert sidecar.engine.aborts_queued == 0
    chunk = sink.final()
    assert sink.chunks == []
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
    assert fake.abort_calls == []


async def test_several_tokens_arrive_as_chunks_in_order_then_the_terminal_as_final(fake):
    fake.tokens = 5
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        sink = await submit_and_wait(sidecar, request(), GenerateContext("five"))
    final = sink.final()
    # Messages read together come as one chunk (their tokens in order, texts joined): compare by content.
    assert 1 <= len(sink.chunks) <= 4
    assert delivered(sink) == [42] * 4
    assert "".join(c.text for c in sink.chunks) == " token" * 4
    assert all(c.finish_reason is None and c.completion_usage is None for c in sink.chunks)
    assert final.token_ids == [42]
    assert final.finish_reason == "stop"
    assert usage(final) == (3, 5, 8)
    assert fake.finished == {"five"}
    assert fake.abort_calls == []


async def test_chunks_are_delivered_while_the_request_is_still_running(fake):
    fake.hang = True  # endless chunks
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        ctx = GenerateContext("live")
        sink = RecordingSink(sidecar.engine)
        sidecar.submit(request(), ctx, sink)
        with trio.fail_after(2):
            await sink.wait_chunks(3)
        assert not sink.ended.is_set()
        assert sidecar.engine.in_flight == 1
        ctx.stop()
        with trio.fail_after(2):
            await sink.ended.wait()
    assert sink.final().finish_reason == "cancelled"


async def test_a_uuid_request_id_is_generated_for_an_empty_one(fake):
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        sink = await submit_and_wait(sidecar, request(), GenerateContext())
    assert sink.final().finish_reason == "stop"
    [rid] = fake.request_ids
    assert len(rid) == 36 and rid.count("-") == 4


async def test_dp_rank_travels_as_metadata(fake):
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        await submit_and_wait(sidecar, request(routing={"dp_rank": 1}))
        await submit_and_wait(sidecar, request())
    assert fake.requests[0][1]["x-data-parallel-rank"] == "1"
    assert "x-data-parallel-rank" not in fake.requests[1][1]


async def test_data_after_the_terminal_is_ignored(fake):
    fake.tokens = 2
    fake.after_terminal = 3
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        sink = await submit_and_wait(sidecar, request())
    final = sink.final()
    assert [c.finish_reason for c in sink.chunks] == [None]
    assert final.finish_reason == "stop"
    assert usage(final) == (3, 2, 5)


async def test_four_concurrent_submits_on_a_pool_of_two(fake):
    fake.tokens = 3
    async with open_sidecar(sidecar_config(fake.endpoint, grpc_connections=2)) as sidecar:
        sinks = [RecordingSink(sidecar.engine) for _ in range(4)]
        for i, sink in enumerate(sinks):
            sidecar.submit(request(), GenerateContext(f"r{i}"), sink)
        with trio.fail_after(2):
            for sink in sinks:
                await sink.ended.wait()
        local_ports = {ch.local_address[1] for ch in sidecar.engine.pool.channels}
    for sink in sinks:
        assert delivered(sink) == [42, 42]
        assert sink.final().finish_reason == "stop"
    assert sorted(fake.request_ids) == ["r0", "r1", "r2", "r3"]
    assert {peer[1] for _req, _md, peer in fake.requests} == local_ports
    assert len(local_ports) == 2


# ---------------------------------------------------------------------------- synchronous refusals


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"token_ids": []}, "token_ids must not be empty"),
        ({"token_ids": [1], "sampling_options": {"top_p": 10**400}},
         "invalid PreprocessedRequest: integer too large to convert to a float @ $.sampling_options.top_p"),
        ({"token_ids": [1], "sampling_options": {"repetition_penalty": float("-inf")}},
         "repetition_penalty must be a finite number, got -inf"),
    ],
    ids=["empty", "huge-int", "negative-infinity"],
)
async def test_conversion_error_is_raised_by_submit_before_any_rpc(fake, body, message):
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        sink = RecordingSink()
        with pytest.raises(InvalidArgument) as info:
            sidecar.submit(body, GenerateContext("bad-body"), sink)
        assert str(info.value) == message
        assert sidecar.engine.in_flight == 0
        # the engine still works
        ok = await submit_and_wait(sidecar, request(), GenerateContext("ok"))
    assert sink.chunks == [] and sink.ends == []
    assert ok.final().finish_reason == "stop"
    assert fake.request_ids == ["ok"]


async def test_not_started_is_raised_by_submit_before_start_and_after_cleanup(fake, nursery):
    engine = SidecarEngine(sidecar_config(fake.endpoint))
    sink = RecordingSink()
    with pytest.raises(EngineShutdown, match="^vLLM sidecar is not started$"):
        engine.submit(request(), GenerateContext(), sink)
    await engine.start(nursery)
    started = RecordingSink(engine)
    engine.submit(request(), GenerateContext("while-started"), started)
    with trio.fail_after(2):
        await started.ended.wait()
    await engine.cleanup()
    with pytest.raises(EngineShutdown, match="^vLLM sidecar is not started$"):
        engine.submit(request(), GenerateContext(), sink)
    assert sink.chunks == [] and sink.ends == []
    assert started.final().finish_reason == "stop"
    assert fake.request_ids == ["while-started"]


async def test_not_started_is_raised_by_sidecar_submit_after_the_block(fake):
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        pass
    sink = RecordingSink()
    with pytest.raises(EngineShutdown, match="^vLLM sidecar is not started$"):
        sidecar.submit(request(), GenerateContext(), sink)
    assert sink.chunks == [] and sink.ends == []
    assert fake.requests == []


async def test_stop_admission_makes_submit_raise_not_started(fake):
    fake.hang = True
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        ctx = GenerateContext("in-flight")
        running = RecordingSink(sidecar.engine)
        sidecar.submit(request(), ctx, running)
        with trio.fail_after(2):
            await running.wait_chunks(1)
        sidecar.engine.stop_admission()
        refused = RecordingSink()
        with pytest.raises(EngineShutdown, match="^vLLM sidecar is not started$"):
            sidecar.submit(request(), GenerateContext("refused"), refused)
        # the in-flight request continues
        with trio.fail_after(2):
            await running.wait_chunks(3)
        ctx.stop()
        with trio.fail_after(2):
            await running.ended.wait()
    assert refused.chunks == [] and refused.ends == []
    assert running.final().finish_reason == "cancelled"
    assert fake.request_ids == ["in-flight"]


async def test_admission_gate_refuses_submit_synchronously(fake):
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        sidecar.health.value = HealthState(HealthKind.NOT_SERVING, "vLLM Health.Watch is not SERVING")
        sink = RecordingSink()
        with pytest.raises(CannotConnect) as info:
            sidecar.submit(request(), GenerateContext("gated"), sink)
        assert str(info.value) == "vLLM is not serving: vLLM Health.Watch is not SERVING"
        assert sidecar.engine.in_flight == 0
        sidecar.health.value = HealthState(HealthKind.SERVING)
        ok = await submit_and_wait(sidecar, request(), GenerateContext("admitted"))
    assert sink.chunks == [] and sink.ends == []
    assert ok.final().finish_reason == "stop"
    assert fake.request_ids == ["admitted"]


# ---------------------------------------------------------------------------- errors reach end()


async def test_open_rejection_reaches_end_and_the_server_once(fake):
    fake.reject = True
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        sink = await submit_and_wait(sidecar, request(), GenerateContext("rejected"))
        assert sidecar.engine.aborts_queued == 0
    error = sink.error()
    assert isinstance(error, InvalidArgument)
    assert str(error) == "GenerateStream: rejected by fake vLLM (InvalidArgument)"
    assert sink.chunks == []
    assert len(fake.requests) == 1
    assert fake.abort_calls == []


async def test_open_error_unavailable_maps_to_cannot_connect_with_no_chunk(fake):
    fake.open_error = (StatusCode.UNAVAILABLE, "engine gone")
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        sink = await submit_and_wait(sidecar, request())
    error = sink.error()
    assert isinstance(error, CannotConnect)
    assert str(error) == "GenerateStream: engine gone (Unavailable)"
    assert sink.chunks == []


async def test_eof_before_terminal_is_a_protocol_error(fake):
    fake.early_eof_after = 0
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        sink = await submit_and_wait(sidecar, request())
        assert sidecar.engine.aborts_queued == 0  # the server ended the stream
    error = sink.error()
    assert isinstance(error, ProtocolError)
    assert str(error) == "invalid vLLM gRPC response: GenerateStream ended before a terminal response"
    assert sink.chunks == []


@pytest.mark.parametrize(
    ("knob", "error_kind", "error_type"),
    [("early_eof_after", ErrorKind.UNKNOWN, ProtocolError), ("read_error_after", ErrorKind.CANNOT_CONNECT, CannotConnect)],
)
async def test_stream_error_after_one_token_keeps_the_token(fake, knob, error_kind, error_type):
    fake.tokens = 5
    setattr(fake, knob, 1)
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        sink = await submit_and_wait(sidecar, request())
        assert sidecar.engine.aborts_queued == 0
    error = sink.error()
    assert type(error) is error_type
    assert error.kind is error_kind
    assert [c.token_ids for c in sink.chunks] == [[42]]


async def test_conversion_error_mid_stream_ends_with_the_error_drops_and_aborts(fake):
    fake.bad_after = 1
    fake.tokens = 10
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        sink = await submit_and_wait(sidecar, request(), GenerateContext("bad"))
        with trio.fail_after(2):
            await fake.drop_event("bad").wait()
            await fake.abort_received.wait()
    error = sink.error()
    assert isinstance(error, ProtocolError)
    assert "received unsupported sequence index 1" in str(error)
    assert [c.token_ids for c in sink.chunks] == [[42]]
    assert fake.abort_calls == [["bad"]]


async def test_an_unparsable_message_mid_stream_ends_with_the_transport_error_drops_and_aborts(fake):
    fake.unparsable_after = 1
    fake.tokens = 10
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        sink = await submit_and_wait(sidecar, request(), GenerateContext("garbled"))
        with trio.fail_after(2):
            await fake.drop_event("garbled").wait()
            await fake.abort_received.wait()
        # The connection is still good: the next request completes.
        fake.unparsable_after = None
        after = await submit_and_wait(sidecar, request(), GenerateContext("after-garbled"))
    error = sink.error()
    assert type(error) is UnknownError
    assert str(error) == (
        "GenerateStream: failed to parse a response message of /vllm.Inference/GenerateStream (Internal)"
    )
    assert [c.token_ids for c in sink.chunks] == [[42]]
    assert fake.abort_calls == [["garbled"]]
    assert after.final().finish_reason == "stop"


# ---------------------------------------------------------------------------- cancellation


@pytest.mark.parametrize("abort_on_cancel", [True, False])
async def test_aggregated_stop_at_the_first_chunk(fake, abort_on_cancel):
    fake.hang = True
    config = sidecar_config(fake.endpoint, abort_on_cancel=abort_on_cancel)
    async with open_sidecar(config) as sidecar:
        ctx = GenerateContext("agg-cancel")
        sink = await submit_and_wait(sidecar, request(), ctx, on_chunk=stop_at(1, ctx))
        with trio.fail_after(2):
            await fake.drop_event("agg-cancel").wait()
        if abort_on_cancel:
            with trio.fail_after(2):
                await fake.abort_received.wait()
            assert sidecar.engine.aborts_queued == 1
        else:
            with trio.move_on_after(0.3):
                await fake.abort_received.wait()
            assert sidecar.engine.aborts_queued == 0
    final = sink.final()
    tokens = delivered(sink)
    assert len(sink.chunks) == 1 and tokens == [42] * len(tokens)
    assert final.finish_reason == "cancelled"
    assert final.token_ids == []
    assert usage(final) == (3, len(tokens), 3 + len(tokens))  # exactly the delivered chunk
    if abort_on_cancel:
        assert fake.abort_calls == [["agg-cancel"]]
    else:
        assert fake.abort_calls == []


async def test_aggregated_stop_from_another_task_counts_exactly_the_delivered_chunks(fake):
    fake.hang = True
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        ctx = GenerateContext("agg-later")
        sink = RecordingSink(sidecar.engine)
        sidecar.submit(request(), ctx, sink)
        with trio.fail_after(2):
            await sink.wait_chunks(4)
        ctx.stop()
        with trio.fail_after(2):
            await sink.ended.wait()
            await fake.drop_event("agg-later").wait()
            await fake.abort_received.wait()
    final = sink.final()
    tokens = delivered(sink)
    assert len(sink.chunks) >= 4
    assert tokens == [42] * len(tokens)
    assert final.finish_reason == "cancelled"
    assert usage(final) == (3, len(tokens), 3 + len(tokens))
    assert fake.abort_calls == [["agg-later"]]


async def test_stop_while_headers_are_pending_gives_a_cancelled_final(fake):
    fake.hang_before_headers = True
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        ctx = GenerateContext("pending")
        sink = RecordingSink(sidecar.engine)
        sidecar.submit(request(), ctx, sink)
        with trio.fail_after(2):
            await fake.request_arrived.wait()
        assert not sink.ended.is_set()
        ctx.stop()
        with trio.fail_after(2):
            await sink.ended.wait()
            await fake.drop_event("pending").wait()
    final = sink.final()
    assert sink.chunks == []
    assert final.finish_reason == "cancelled"
    assert usage(final) == (3, 0, 3)


@pytest.mark.parametrize("when", ["before-submit", "right-after-submit"])
async def test_stop_before_the_task_opens_sends_no_rpc(fake, when):
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        ctx = GenerateContext("early")
        sink = RecordingSink(sidecar.engine)
        if when == "before-submit":
            ctx.stop()
            sidecar.submit(request(), ctx, sink)
        else:
            sidecar.submit(request(), ctx, sink)
            ctx.stop()  # the request task has not run yet
        assert not sink.ended.is_set()  # end comes from the request task, never from submit() itself
        with trio.fail_after(2):
            await sink.ended.wait()
        assert sidecar.engine.aborts_queued == 0
    final = sink.final()
    assert sink.chunks == []
    assert final.finish_reason == "cancelled"
    assert usage(final) == (3, 0, 3)
    assert fake.requests == []
    assert fake.abort_calls == []


async def test_stop_after_end_is_harmless(fake):
    fake.tokens = 3
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        ctx = GenerateContext("done")
        sink = await submit_and_wait(sidecar, request(), ctx)
        ctx.stop()
        ctx.stop()
        assert sidecar.engine.in_flight == 0
    assert sink.final().finish_reason == "stop"  # (and no second end: outcome() checks)
    assert fake.abort_calls == []


async def test_cancelling_the_submitting_scope_does_not_end_the_request(fake):
    fake.tokens = 3
    fake.token_delay = 0.05
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        sink = RecordingSink(sidecar.engine)
        with trio.CancelScope() as scope:
            sidecar.submit(request(), GenerateContext("detached"), sink)
            scope.cancel()
            await trio.sleep_forever()
        assert scope.cancelled_caught
        with trio.fail_after(2):
            await sink.ended.wait()
    assert delivered(sink) == [42, 42]
    assert sink.final().finish_reason == "stop"
    assert not fake.drop_event("detached").is_set()
    assert fake.abort_calls == []


async def test_cleanup_during_a_read_ends_with_a_cancelled_final_and_drops_the_rpc(fake):
    fake.hang = True
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        sink = RecordingSink(sidecar.engine)
        sidecar.submit(request(), GenerateContext("shut"), sink)
        with trio.fail_after(2):
            await sink.wait_chunks(1)
        assert not sink.ended.is_set()
    # leaving open_sidecar ended the request and flushed its Abort before returning
    assert sink.ended.is_set()
    assert fake.abort_calls == [["shut"]]
    with trio.fail_after(2):
        await fake.drop_event("shut").wait()
    final = sink.final()
    assert final.finish_reason == "cancelled"
    assert usage(final)[1] == len(delivered(sink)) >= 1
    assert sink.in_flight_at_end == 0


async def test_cleanup_while_headers_are_pending_ends_with_a_cancelled_final(fake):
    fake.hang_before_headers = True
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        sink = RecordingSink(sidecar.engine)
        sidecar.submit(request(), GenerateContext("shut-pending"), sink)
        with trio.fail_after(2):
            await fake.request_arrived.wait()
    assert sink.ended.is_set()
    with trio.fail_after(2):
        await fake.drop_event("shut-pending").wait()
    final = sink.final()
    assert sink.chunks == []
    assert final.finish_reason == "cancelled"
    assert usage(final) == (3, 0, 3)


async def test_cancel_in_flight_ends_submitted_requests_like_shutdown(fake):
    fake.hang = True
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        engine = sidecar.engine
        sink = RecordingSink(engine)
        sidecar.submit(request(), GenerateContext("drain"), sink)
        with trio.fail_after(2):
            await sink.wait_chunks(1)
        engine.cancel_in_flight()
        with trio.fail_after(2):
            await sink.ended.wait()
            await engine.wait_idle()
            await fake.abort_received.wait()
    assert sink.final().finish_reason == "cancelled"
    assert fake.abort_calls == [["drain"]]


async def test_a_cancelled_request_does_not_disturb_another_on_the_same_connection(fake):
    fake.hang = True
    async with open_sidecar(sidecar_config(fake.endpoint, grpc_connections=1)) as sidecar:
        survivor_ctx = GenerateContext("survivor")
        survivor = RecordingSink(sidecar.engine)
        sidecar.submit(request(), survivor_ctx, survivor)
        with trio.fail_after(2):
            await survivor.wait_chunks(1)
        victim_ctx = GenerateContext("victim")
        victim = RecordingSink(sidecar.engine)
        sidecar.submit(request(), victim_ctx, victim)
        with trio.fail_after(2):
            await victim.wait_chunks(1)
        victim_ctx.stop()
        with trio.fail_after(2):
            await victim.ended.wait()
            await fake.drop_event("victim").wait()
        seen = len(survivor.chunks)
        with trio.fail_after(2):
            await survivor.wait_chunks(seen + 3)
        assert not fake.drop_event("survivor").is_set()
        survivor_ctx.stop()
        with trio.fail_after(2):
            await survivor.ended.wait()
    assert victim.final().finish_reason == "cancelled"
    tokens = delivered(survivor)
    assert tokens == [42] * len(tokens)
    assert survivor.final().finish_reason == "cancelled"
    assert usage(survivor.final())[1] == len(tokens)
    assert fake.dropped_at["survivor"] > fake.dropped_at["victim"]


async def test_end_runs_once_the_engine_no_longer_counts_the_request(fake):
    fake.hang = True
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        engine = sidecar.engine
        ctx_a, ctx_b = GenerateContext("a"), GenerateContext("b")
        a, b = RecordingSink(engine), RecordingSink(engine)
        sidecar.submit(request(), ctx_a, a)
        sidecar.submit(request(), ctx_b, b)
        assert engine.in_flight == 2
        with trio.fail_after(2):
            await a.wait_chunks(1)
            await b.wait_chunks(1)
        ctx_a.stop()
        with trio.fail_after(2):
            await a.ended.wait()
        assert engine.in_flight == 1
        ctx_b.stop()
        with trio.fail_after(2):
            await b.ended.wait()
            await engine.wait_idle()
        assert engine.in_flight == 0
        # a plain completed request too
        fake.hang = False
        c = await submit_and_wait(sidecar, request(), GenerateContext("c"))
    assert a.in_flight_at_end == 1
    assert b.in_flight_at_end == 0
    assert c.in_flight_at_end == 0
    assert [s.final().finish_reason for s in (a, b, c)] == ["cancelled", "cancelled", "stop"]


# ---------------------------------------------------------------------------- decode deferral (docs/reference/sidecar.md#decode-deferral)


async def test_decode_stop_while_headers_are_held_waits_for_the_first_token(fake):
    fake.hang = True
    fake.hold_first = trio.Event()
    first_token_notified = []
    config = sidecar_config(fake.endpoint, disaggregation_mode="decode")
    async with open_sidecar(config) as sidecar:
        ctx = GenerateContext("dec", on_first_token=lambda: first_token_notified.append(True))
        sink = RecordingSink(sidecar.engine)
        sidecar.submit(decode_request(), ctx, sink)
        with trio.fail_after(2):
            await fake.request_arrived.wait()
        ctx.stop()
        with trio.move_on_after(0.2):
            await fake.drop_event("dec").wait()
        assert not fake.drop_event("dec").is_set()  # never dropped before the first token
        assert not sink.ended.is_set()
        assert sink.chunks == []
        fake.hold_first.set()
        with trio.fail_after(2):
            await sink.ended.wait()
            await fake.drop_event("dec").wait()
            await fake.abort_received.wait()
    final = sink.final()
    assert sink.chunks == []  # the cancelled chunk replaced the first token's
    assert final.finish_reason == "cancelled"
    assert usage(final) == (3, 1, 4)  # counts the first token it replaced (docs/reference/sidecar.md#decode-deferral)
    assert first_token_notified == [True]
    assert fake.abort_calls == [["dec"]]
    assert fake.requests[0][0].kv.kv_transfer_params["remote_port"] == "20097"


async def test_decode_stop_before_submit_still_submits_the_request(fake):
    fake.hang = True
    config = sidecar_config(fake.endpoint, disaggregation_mode="decode")
    async with open_sidecar(config) as sidecar:
        ctx = GenerateContext("dec-early")
        ctx.stop()
        sink = await submit_and_wait(sidecar, decode_request(), ctx)
        with trio.fail_after(2):
            await fake.abort_received.wait()
    assert fake.request_ids == ["dec-early"]
    assert sink.chunks == []
    final = sink.final()
    assert final.finish_reason == "cancelled"
    assert usage(final)[1] == 1
    assert fake.abort_calls == [["dec-early"]]


@pytest.mark.parametrize(
    ("knob", "warning"),
    [
        ("early_eof_after", "vLLM GenerateStream ended before transfer completion after request cancellation"),
        ("read_error_after", "vLLM GenerateStream failed before transfer completion after request cancellation"),
        ("bad_after", "vLLM response conversion failed after request cancellation"),
    ],
)
async def test_decode_after_stop_eof_or_error_gives_a_cancelled_final(fake, caplog_sidecar, knob, warning):
    fake.hold_first = trio.Event()
    fake.tokens = 5
    setattr(fake, knob, 0)
    config = sidecar_config(fake.endpoint, disaggregation_mode="decode")
    async with open_sidecar(config) as sidecar:
        ctx = GenerateContext("dec-eof")
        sink = RecordingSink(sidecar.engine)
        sidecar.submit(decode_request(), ctx, sink)
        with trio.fail_after(2):
            await fake.request_arrived.wait()
        ctx.stop()
        fake.hold_first.set()
        with trio.fail_after(2):
            await sink.ended.wait()
    final = sink.final()
    assert sink.chunks == []
    assert final.finish_reason == "cancelled"
    assert any(r.levelno == logging.WARNING and warning in r.getMessage() for r in caplog_sidecar.records)


async def test_decode_stop_after_the_first_token_is_immediate(fake):
    fake.hang = True
    config = sidecar_config(fake.endpoint, disaggregation_mode="decode")
    async with open_sidecar(config) as sidecar:
        ctx = GenerateContext("dec-late")
        sink = await submit_and_wait(sidecar, decode_request(), ctx, on_chunk=stop_at(2, ctx))
        with trio.fail_after(2):
            await fake.drop_event("dec-late").wait()
            await fake.abort_received.wait()
    final = sink.final()
    tokens = delivered(sink)
    assert len(sink.chunks) == 2 and len(tokens) >= 2 and tokens == [42] * len(tokens)
    assert final.finish_reason == "cancelled"
    assert usage(final) == (3, len(tokens), 3 + len(tokens))
    assert fake.abort_calls == [["dec-late"]]


async def test_decode_cleanup_while_headers_are_held_does_not_wait_for_the_transfer(fake):
    fake.hang = True
    fake.hold_first = trio.Event()  # never set: shutdown interrupts every phase in every mode
    config = sidecar_config(fake.endpoint, disaggregation_mode="decode")
    async with open_sidecar(config) as sidecar:
        ctx = GenerateContext("dec-shut")
        ctx.stop()  # a deferred cancellation is recorded; shutdown must not wait for it either
        sink = RecordingSink(sidecar.engine)
        sidecar.submit(decode_request(), ctx, sink)
        with trio.fail_after(2):
            await fake.request_arrived.wait()
        assert not sink.ended.is_set()
    assert sink.ended.is_set()
    with trio.fail_after(2):
        await fake.drop_event("dec-shut").wait()
    final = sink.final()
    assert sink.chunks == []
    assert final.finish_reason == "cancelled"
    assert usage(final) == (3, 0, 3)
    assert fake.abort_calls == [["dec-shut"]]


# ---------------------------------------------------------------------------- prefill (cancels at once)


async def test_prefill_stream_ends_with_the_handoff(fake):
    config = sidecar_config(fake.endpoint, disaggregation_mode="prefill")
    async with open_sidecar(config) as sidecar:
        sink = await submit_and_wait(sidecar, request(), GenerateContext("pre"))
    final = sink.final()
    assert sink.chunks == []
    assert final.finish_reason == "stop"
    assert final.disaggregated_params == PREFILL_HANDOFF
    assert usage(final)[1] == 0  # prefill's one token is decode's to report
    assert fake.abort_calls == []


async def test_prefill_stop_while_headers_are_held_cancels_at_once(fake):
    fake.hold_first = trio.Event()  # never set: unlike decode, prefill does not wait for a token
    config = sidecar_config(fake.endpoint, disaggregation_mode="prefill")
    async with open_sidecar(config) as sidecar:
        ctx = GenerateContext("pre-stop")
        sink = RecordingSink(sidecar.engine)
        sidecar.submit(request(), ctx, sink)
        with trio.fail_after(2):
            await fake.request_arrived.wait()
        ctx.stop()
        with trio.fail_after(2):
            await sink.ended.wait()
            await fake.drop_event("pre-stop").wait()
            await fake.abort_received.wait()
    final = sink.final()
    assert sink.chunks == []
    assert final.finish_reason == "cancelled"
    assert usage(final) == (3, 0, 3)
    assert fake.abort_calls == [["pre-stop"]]


# ---------------------------------------------------------------------------- a stop racing the terminal


class _StopOnceTheTerminalWasRead:
    """A Trio instrument: ``ctx.stop()`` just before the request task of ``ctx`` next runs after the
    connection's reader converted the terminal message (``submit()``'s listener ran in the reader task), i.e.
    from a task scheduled in the same batch as the woken request task."""

    def __init__(self, engine: SidecarEngine, ctx: GenerateContext) -> None:
        self.engine = engine
        self.ctx = ctx
        self.fired = False

    def before_task_step(self, task: Any) -> None:
        if self.fired or not task.name.startswith("vllm-request"):
            return
        for req in self.engine._requests:
            ending = req.builder.ending
            if req.ctx is self.ctx and ending is not None and ending.final is not None:
                assert ending.final.finish_reason == "stop"
                self.fired = True
                self.ctx.stop()


async def test_stop_racing_the_terminal_counts_only_what_the_sink_received(fake):
    fake.tokens = 3
    fake.token_delay = 0.05  # the request task is parked in listen() when the terminal arrives
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        for attempt in range(3):  # (only a scheduling stall of ~50 ms can make the set-up miss the race)
            ctx = GenerateContext(f"race-{attempt}")
            sink = RecordingSink(sidecar.engine)
            instrument = _StopOnceTheTerminalWasRead(sidecar.engine, ctx)
            trio.lowlevel.add_instrument(instrument)
            try:
                sidecar.submit(request(), ctx, sink)
                with trio.fail_after(2):
                    await sink.ended.wait()
            finally:
                trio.lowlevel.remove_instrument(instrument)
            if instrument.fired:
                break
        else:
            raise RuntimeError("the stop never landed between the terminal's conversion and the request task")
    final = sink.final()
    assert delivered(sink) == [42, 42]
    # Either ending is acceptable (the terminal, as the server ended the stream; or the cancelled chunk, as a
    # stop that raced with the message wins), but the usage must count exactly what the sink received.
    received = sum(len(c.token_ids) for c in [*sink.chunks, final])
    assert usage(final)[1] == received, (final.finish_reason, usage(final), received)
    assert final.finish_reason == "stop"  # the terminal was converted first: it is what the sink gets
    assert sidecar.engine.aborts_queued == 0  # the server had ended the stream


# ---------------------------------------------------------------------------- sinks that break the rules


async def test_a_sink_whose_chunk_raises_fails_only_its_request_with_that_error(fake, caplog_sidecar):
    class Boom(Exception):
        pass

    class BrokenSink(RecordingSink):
        def tokens(self, token_ids, text):
            raise Boom("sink bug")

    fake.tokens = 5
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        broken = BrokenSink(sidecar.engine)
        sidecar.submit(request(), GenerateContext("broken"), broken)
        with trio.fail_after(2):
            await broken.ended.wait()
        healthy = await submit_and_wait(sidecar, request(), GenerateContext("healthy"))
        assert sidecar.engine.in_flight == 0
    error = broken.error()
    assert isinstance(error, Boom) and str(error) == "sink bug"
    assert "unexpected failure in request broken" in caplog_sidecar.text
    assert usage(healthy.final()) == (3, 5, 8)


async def test_a_sink_whose_end_raises_is_logged_and_the_engine_carries_on(fake, caplog_sidecar):
    class EndRaises(RecordingSink):
        def end(self, final, error):
            super().end(final, error)
            raise RuntimeError("end bug")

    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        sink = EndRaises(sidecar.engine)
        sidecar.submit(request(), GenerateContext("end-raises"), sink)
        with trio.fail_after(2):
            await sink.ended.wait()
        after = await submit_and_wait(sidecar, request(), GenerateContext("after"))
    assert sink.final().finish_reason == "stop"
    assert after.final().finish_reason == "stop"
    assert "the sink of request end-raises failed at its end" in caplog_sidecar.text
