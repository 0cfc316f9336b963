"""Requests through the engine's two faces against the scripted fake (docs/reference/sidecar.md#embedded-api,
docs/reference/sidecar.md#stream-level-rules, docs/reference/sidecar.md#lifecycle,
docs/reference/sidecar.md#cancellation).

The engine has one delivery path: ``submit(request, ctx, sink)`` delivers to a ``ChunkSink``, and
``generate(request, ctx)`` is an adapter over it (an async iterator). Every behaviour both faces share is
tested once, parametrized by ``face``: each face records what the caller got into a :class:`Recording` (the
ordinary chunks, then exactly one ``end(final, error)``). The faces differ where documented, and those tests
are face-specific: ``submit()`` merges the plain chunks of messages read together and refuses synchronously;
``generate()`` yields one chunk per message, raises an open error from ``__aenter__``, applies back-pressure,
and ends the request when the caller's scope is cancelled.

Cancellation tests assert what the *server* observed (its handler cancelled = stream reset, ``Abort``
received), not only what the caller got. Cancellation must take effect within 2 s.
"""

from __future__ import annotations

import gc
import logging
from typing import Any

import pytest
import trio
from sidecar_fakes import PREFILL_HANDOFF, decode_request, request, sidecar_config, usage

from trio_sidecar import GenerateContext, open_sidecar
from trio_sidecar.core.errors import (
    CannotConnect,
    EngineShutdown,
    ErrorKind,
    InvalidArgument,
    ProtocolError,
    UnknownError,
)
from trio_sidecar.core.health_policy import HealthKind, HealthState
from trio_sidecar.core.protocol import token_chunk
from trio_sidecar.core.status import StatusCode
from trio_sidecar.shell.engine import SidecarEngine


class Recording:
    """What a caller got, through either face: a :class:`~trio_sidecar.shell.context.ChunkSink` that records.

    Protocol violations (a second ``end``, a chunk after ``end``, ``end`` with both or neither argument)
    are recorded rather than raised (a sink must not raise) and checked by :meth:`outcome`.

    Args:
        engine: when given, ``engine.in_flight`` is recorded when ``end`` runs.
        on_chunk: called as ``on_chunk(recording, chunk)`` after a chunk was recorded (in the task that
            delivered it: the reading task for ``submit()``, the consumer for ``generate()``).
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

    def tokens(self, token_ids: list[int], text: str) -> None:
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

    def tokens_received(self) -> list[int]:
        """Every token id of the ordinary chunks, in order (``submit()`` merges the chunks of messages read
        together, so tests that are not about chunk boundaries compare tokens)."""
        return [t for c in self.chunks for t in c.token_ids]


class Face:
    """How a test drives one face of the engine (``target``: a ``Sidecar`` or a ``SidecarEngine``)."""

    name = ""

    def __init__(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery

    def __repr__(self) -> str:
        return self.name

    async def start(self, target: Any, body: Any, ctx: GenerateContext | None = None, **recording: Any) -> Recording:
        """Start a request; its chunks and its end go to the returned recording."""
        raise NotImplementedError

    async def refuse(self, target: Any, body: Any, ctx: GenerateContext | None = None) -> None:
        """Start a request that must be refused before anything is sent: raises the refusal."""
        raise NotImplementedError

    async def run(self, target: Any, body: Any, ctx: GenerateContext | None = None, **recording: Any) -> Recording:
        """Start a request and wait (2 s at most) until it ended."""
        rec = await self.start(target, body, ctx, **recording)
        with trio.fail_after(2):
            await rec.ended.wait()
        return rec


class SubmitFace(Face):
    name = "submit"

    async def start(self, target, body, ctx=None, **recording):
        rec = Recording(_engine(target), **recording)
        target.submit(body, ctx if ctx is not None else GenerateContext(), rec)
        return rec

    async def refuse(self, target, body, ctx=None):
        rec = Recording()
        try:
            target.submit(body, ctx if ctx is not None else GenerateContext(), rec)
        finally:
            assert rec.chunks == [] and rec.ends == []  # refused: the sink is never called
        raise AssertionError("submit() did not refuse the request")  # pragma: no cover


class GenerateFace(Face):
    """``generate()`` consumed by a task: every yielded chunk with a ``finish_reason`` is the final one; an
    exception (from ``__aenter__`` or the iteration) is the error."""

    name = "generate"

    async def start(self, target, body, ctx=None, **recording):
        rec = Recording(_engine(target), **recording)
        self.nursery.start_soon(self._consume, target, body, ctx, rec)
        return rec

    @staticmethod
    async def _consume(target: Any, body: Any, ctx: GenerateContext | None, rec: Recording) -> None:
        try:
            async with target.generate(body, ctx) as stream:
                async for chunk in stream:
                    if rec.ended.is_set():
                        rec.violations.append(f"a chunk after the final one: {chunk!r}")
                    elif chunk.finish_reason is not None:
                        rec.end(chunk, None)
                    else:
                        rec.chunk(chunk)
        except Exception as exc:
            rec.end(None, exc)
        if not rec.ended.is_set():
            rec.violations.append("the iteration ended without a final chunk")
            rec.ended.set()

    async def refuse(self, target, body, ctx=None):
        async with target.generate(body, ctx):
            pass  # pragma: no cover
        raise AssertionError("generate() did not refuse the request")  # pragma: no cover


def _engine(target: Any) -> SidecarEngine:
    return target if isinstance(target, SidecarEngine) else target.engine


@pytest.fixture(params=[GenerateFace, SubmitFace], ids=["generate", "submit"])
def face(request, nursery) -> Face:
    return request.param(nursery)


def stop_at(n: int, ctx: GenerateContext):
    """``on_chunk``: ``ctx.stop()`` when the ``n``-th chunk arrives."""

    def on_chunk(rec: Recording, _chunk: Any) -> None:
        if len(rec.chunks) == n:
            ctx.stop()

    return on_chunk


# ---------------------------------------------------------------------------- streams


async def test_reference_aggregated_stream_ends_with_the_terminal_chunk(fake, face):
    body = request(output_options={"logprobs": 1, "prompt_logprobs": 1})
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        assert sidecar.model.served_model_name == "served-model"
        assert sidecar.engine_config.context_length == 8192
        rec = await face.run(sidecar, body, GenerateContext("req-1"))
        assert sidecar.engine.aborts_queued == 0
    chunk = rec.final()
    assert rec.chunks == []
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


async def test_several_tokens_arrive_as_chunks_in_order_then_the_terminal_as_final(fake, face):
    fake.tokens = 5
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        rec = await face.run(sidecar, request(), GenerateContext("five"))
    final = rec.final()
    assert 1 <= len(rec.chunks) <= 4
    assert rec.tokens_received() == [42] * 4
    assert "".join(c.text for c in rec.chunks) == " token" * 4
    assert all(c.finish_reason is None and c.completion_usage is None for c in rec.chunks)
    assert final.token_ids == [42]
    assert final.finish_reason == "stop"
    assert usage(final) == (3, 5, 8)
    assert fake.finished == {"five"}
    assert fake.abort_calls == []


@pytest.mark.parametrize("tokens", [1, 5])
async def test_on_first_token_is_called_once_before_the_first_tokens_reach_the_caller(fake, face, tokens):
    fake.tokens = tokens  # 1: the terminal itself carries the only token
    seen: list[tuple[int, int]] = []
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        ctx = GenerateContext("first")
        rec = await face.start(sidecar, request(), ctx)  # (no checkpoint yet: the request has not run)
        ctx.on_first_token = lambda: seen.append((len(rec.chunks), len(rec.ends)))
        with trio.fail_after(2):
            await rec.ended.wait()
    assert usage(rec.final()) == (3, tokens, 3 + tokens)
    assert seen == [(0, 0)]  # once, before any chunk or the final one


async def test_chunks_are_delivered_while_the_request_is_still_running(fake, face):
    fake.hang = True  # endless chunks
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        ctx = GenerateContext("live")
        rec = await face.start(sidecar, request(), ctx)
        with trio.fail_after(2):
            await rec.wait_chunks(3)
        assert not rec.ended.is_set()
        assert sidecar.engine.in_flight == 1
        ctx.stop()
        with trio.fail_after(2):
            await rec.ended.wait()
    assert rec.final().finish_reason == "cancelled"


async def test_a_uuid_request_id_is_generated_for_an_empty_one(fake, face):
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        rec = await face.run(sidecar, request(), GenerateContext())
    assert rec.final().finish_reason == "stop"
    [rid] = fake.request_ids
    assert len(rid) == 36 and rid.count("-") == 4


async def test_dp_rank_travels_as_metadata(fake, face):
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        await face.run(sidecar, request(routing={"dp_rank": 1}))
        await face.run(sidecar, request())
    assert fake.requests[0][1]["x-data-parallel-rank"] == "1"
    assert "x-data-parallel-rank" not in fake.requests[1][1]


async def test_data_after_the_terminal_is_ignored(fake, face):
    fake.tokens = 2
    fake.after_terminal = 3
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        rec = await face.run(sidecar, request())
    final = rec.final()
    assert [c.finish_reason for c in rec.chunks] == [None]
    assert final.finish_reason == "stop"
    assert usage(final) == (3, 2, 5)


async def test_a_pool_of_two_carries_four_concurrent_requests_from_two_client_ports(fake, face):
    fake.tokens = 3
    async with open_sidecar(sidecar_config(fake.endpoint, grpc_connections=2)) as sidecar:
        recs = [await face.start(sidecar, request(), GenerateContext(f"r{i}")) for i in range(4)]
        with trio.fail_after(2):
            for rec in recs:
                await rec.ended.wait()
        local_ports = {ch.local_address[1] for ch in sidecar.engine.pool.channels}
    for rec in recs:
        assert rec.tokens_received() == [42, 42]
        assert rec.final().finish_reason == "stop"
    assert sorted(fake.request_ids) == ["r0", "r1", "r2", "r3"]
    assert {peer[1] for _req, _md, peer in fake.requests} == local_ports
    assert len(local_ports) == 2
    assert all("x-data-parallel-rank" not in md for _req, md, _peer in fake.requests)


async def test_a_finished_request_leaves_no_reference_cycle_behind(fake, face):
    # A request's objects are freed by reference counting when it ends; a cycle (say, between the request
    # and its sink) would leave them to the garbage collector, which costs every request CPU.
    fake.tokens = 3
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for i in range(5):
                rec = await face.run(sidecar, request(), GenerateContext(f"gc-{i}"))
                assert rec.final().finish_reason == "stop"
            del rec
            gc.collect()
            leaked = [type(o).__name__ for o in gc.garbage if type(o).__module__.startswith("trio_sidecar")]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
    assert leaked == []


# ---------------------------------------------------------------------------- refusals (nothing is sent)


BAD_BODIES = [
    ({"token_ids": []}, "token_ids must not be empty"),
    # An int beyond the f64 range (JSON has no limit): a typed error, not an OverflowError.
    (
        {"token_ids": [1], "sampling_options": {"temperature": 10**400}},
        "invalid PreprocessedRequest: integer too large to convert to a float @ $.sampling_options.temperature",
    ),
    (
        {"token_ids": [1], "sampling_options": {"min_p": -(10**400)}},
        "invalid PreprocessedRequest: integer too large to convert to a float @ $.sampling_options.min_p",
    ),
    (
        {"token_ids": [1], "sampling_options": {"top_p": 10**400}},
        "invalid PreprocessedRequest: integer too large to convert to a float @ $.sampling_options.top_p",
    ),
    # vLLM's own checks and texts (docs/conformance.md), before any RPC.
    (
        {"token_ids": [1], "sampling_options": {"temperature": float("nan")}},
        "temperature must be a finite number, got NaN",
    ),
    (
        {"token_ids": [1], "sampling_options": {"repetition_penalty": float("-inf")}},
        "repetition_penalty must be a finite number, got -inf",
    ),
]


@pytest.mark.parametrize(
    ("body", "message"), BAD_BODIES, ids=["empty", "huge-int", "huge-negative-int", "huge-int-top-p", "nan", "-inf"]
)
async def test_conversion_error_is_raised_before_any_rpc(fake, face, body, message):
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        with pytest.raises(InvalidArgument) as info:
            await face.refuse(sidecar, body, GenerateContext("bad-body"))
        assert str(info.value) == message
        assert sidecar.engine.in_flight == 0
        # the engine still works
        ok = await face.run(sidecar, request(), GenerateContext("ok"))
    assert ok.final().finish_reason == "stop"
    assert fake.request_ids == ["ok"]


async def test_lifecycle_not_started_already_started_and_cleanup_twice(fake, nursery, face):
    engine = SidecarEngine(sidecar_config(fake.endpoint))
    await engine.cleanup()  # safe before start
    engine = SidecarEngine(sidecar_config(fake.endpoint))
    with pytest.raises(EngineShutdown, match="^vLLM sidecar is not started$"):
        await face.refuse(engine, request())
    await engine.start(nursery)
    with pytest.raises(EngineShutdown, match="^vLLM sidecar has already started$"):
        await engine.start(nursery)
    started = await face.run(engine, request(), GenerateContext("while-started"))
    await engine.cleanup()
    await engine.cleanup()
    with pytest.raises(EngineShutdown, match="^vLLM sidecar is not started$"):
        await face.refuse(engine, request())
    assert engine.pool.closed
    assert started.final().finish_reason == "stop"
    assert fake.request_ids == ["while-started"]


async def test_not_started_is_raised_after_the_sidecar_block(fake, face):
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        pass
    with pytest.raises(EngineShutdown, match="^vLLM sidecar is not started$"):
        await face.refuse(sidecar, request())
    assert fake.requests == []


async def test_stop_admission_refuses_new_requests_as_not_started_while_in_flight_ones_continue(fake, face):
    fake.hang = True
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        ctx = GenerateContext("in-flight")
        running = await face.start(sidecar, request(), ctx)
        with trio.fail_after(2):
            await running.wait_chunks(1)
        sidecar.engine.stop_admission()
        assert not sidecar.engine.admitting
        with pytest.raises(EngineShutdown, match="^vLLM sidecar is not started$"):
            await face.refuse(sidecar, request(), GenerateContext("refused"))
        # the in-flight request continues
        with trio.fail_after(2):
            await running.wait_chunks(3)
        ctx.stop()
        with trio.fail_after(2):
            await running.ended.wait()
    assert running.final().finish_reason == "cancelled"
    assert fake.request_ids == ["in-flight"]


async def test_the_admission_gate_refuses_while_vllm_is_not_serving(fake, face):
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        assert sidecar.health is sidecar.engine.health  # one owner of admission: the engine
        sidecar.health.value = HealthState(HealthKind.NOT_SERVING, "vLLM Health.Watch is not SERVING")
        with pytest.raises(CannotConnect) as info:
            await face.refuse(sidecar, request(), GenerateContext("gated"))
        assert str(info.value) == "vLLM is not serving: vLLM Health.Watch is not SERVING"
        assert sidecar.engine.in_flight == 0
        sidecar.health.value = HealthState(HealthKind.SERVING)
        ok = await face.run(sidecar, request(), GenerateContext("admitted"))
    assert ok.final().finish_reason == "stop"
    assert fake.request_ids == ["admitted"]


# ---------------------------------------------------------------------------- errors


async def test_open_rejection_is_the_error_and_reaches_the_server_once(fake, face):
    fake.reject = True
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        rec = await face.run(sidecar, request(), GenerateContext("rejected"))
        assert sidecar.engine.aborts_queued == 0
    error = rec.error()
    assert isinstance(error, InvalidArgument)
    assert str(error) == "GenerateStream: rejected by fake vLLM (InvalidArgument)"
    assert rec.chunks == []
    assert len(fake.requests) == 1
    assert fake.abort_calls == []


async def test_open_error_unavailable_maps_to_cannot_connect_with_no_chunk(fake, face):
    fake.open_error = (StatusCode.UNAVAILABLE, "engine gone")
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        rec = await face.run(sidecar, request())
    error = rec.error()
    assert isinstance(error, CannotConnect)
    assert str(error) == "GenerateStream: engine gone (Unavailable)"
    assert rec.chunks == []


async def test_eof_before_terminal_is_a_protocol_error(fake, face):
    fake.early_eof_after = 0
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        rec = await face.run(sidecar, request())
        assert sidecar.engine.aborts_queued == 0  # the server ended the stream
    error = rec.error()
    assert isinstance(error, ProtocolError)
    assert str(error) == "invalid vLLM gRPC response: GenerateStream ended before a terminal response"
    assert rec.chunks == []


@pytest.mark.parametrize(
    ("knob", "error_kind", "error_type"),
    [
        ("early_eof_after", ErrorKind.UNKNOWN, ProtocolError),
        ("read_error_after", ErrorKind.CANNOT_CONNECT, CannotConnect),
    ],
)
async def test_stream_error_after_one_token_keeps_the_token(fake, face, knob, error_kind, error_type):
    fake.tokens = 5
    setattr(fake, knob, 1)
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        rec = await face.run(sidecar, request())
        assert sidecar.engine.aborts_queued == 0
    error = rec.error()
    assert type(error) is error_type
    assert error.kind is error_kind
    assert [c.token_ids for c in rec.chunks] == [[42]]


async def test_conversion_error_mid_stream_ends_with_the_error_drops_and_aborts(fake, face):
    fake.bad_after = 1
    fake.tokens = 10
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        rec = await face.run(sidecar, request(), GenerateContext("bad"))
        with trio.fail_after(2):
            await fake.drop_event("bad").wait()
            await fake.abort_received.wait()
    error = rec.error()
    assert isinstance(error, ProtocolError)
    assert "received unsupported sequence index 1" in str(error)
    assert [c.token_ids for c in rec.chunks] == [[42]]
    assert fake.abort_calls == [["bad"]]


async def test_an_unparsable_message_mid_stream_ends_with_the_transport_error_drops_and_aborts(fake, face):
    fake.unparsable_after = 1
    fake.tokens = 10
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        rec = await face.run(sidecar, request(), GenerateContext("garbled"))
        with trio.fail_after(2):
            await fake.drop_event("garbled").wait()
            await fake.abort_received.wait()
        # The connection is still good: the next request completes.
        fake.unparsable_after = None
        after = await face.run(sidecar, request(), GenerateContext("after-garbled"))
    error = rec.error()
    assert type(error) is UnknownError
    assert str(error) == (
        "GenerateStream: failed to parse a response message of /vllm.Inference/GenerateStream (Internal)"
    )
    assert [c.token_ids for c in rec.chunks] == [[42]]
    assert fake.abort_calls == [["garbled"]]
    assert after.final().finish_reason == "stop"


async def test_abort_timeout_is_logged_with_the_configured_value(fake, face, caplog_sidecar, autojump_clock):
    fake.hang = True
    fake.abort_hang = True
    async with open_sidecar(sidecar_config(fake.endpoint, abort_timeout=0.2)) as sidecar:
        ctx = GenerateContext("slow-abort")
        await face.run(sidecar, request(), ctx, on_chunk=stop_at(1, ctx))
        with trio.fail_after(2):
            await fake.abort_received.wait()
        with trio.fail_after(2):
            while "Abort did not respond within 0.2s" not in caplog_sidecar.text:
                await trio.sleep(0.02)
        stats = sidecar.stats()
        assert (stats.aborts_queued, stats.aborts_sent, stats.aborts_failed, stats.aborts_timed_out) == (1, 0, 0, 1)


# ---------------------------------------------------------------------------- cancellation


@pytest.mark.parametrize("abort_on_cancel", [True, False])
async def test_aggregated_stop_at_the_first_chunk_counts_exactly_the_delivered_tokens(fake, face, abort_on_cancel):
    fake.hang = True
    config = sidecar_config(fake.endpoint, abort_on_cancel=abort_on_cancel)
    async with open_sidecar(config) as sidecar:
        ctx = GenerateContext("agg-cancel")
        rec = await face.run(sidecar, request(), ctx, on_chunk=stop_at(1, ctx))
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
    final = rec.final()
    tokens = rec.tokens_received()
    assert len(rec.chunks) == 1 and len(tokens) >= 1 and tokens == [42] * len(tokens)
    assert final.finish_reason == "cancelled"
    assert final.token_ids == []
    assert usage(final) == (3, len(tokens), 3 + len(tokens))  # exactly the delivered tokens
    if abort_on_cancel:
        assert fake.abort_calls == [["agg-cancel"]]
    else:
        assert fake.abort_calls == []


async def test_aggregated_stop_from_another_task_counts_exactly_the_delivered_chunks(fake, face):
    fake.hang = True
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        ctx = GenerateContext("agg-later")
        rec = await face.start(sidecar, request(), ctx)
        with trio.fail_after(2):
            await rec.wait_chunks(4)
        ctx.stop()
        with trio.fail_after(2):
            await rec.ended.wait()
            await fake.drop_event("agg-later").wait()
            await fake.abort_received.wait()
    final = rec.final()
    tokens = rec.tokens_received()
    assert len(rec.chunks) >= 4
    assert tokens == [42] * len(tokens)
    assert final.finish_reason == "cancelled"
    assert usage(final) == (3, len(tokens), 3 + len(tokens))
    assert fake.abort_calls == [["agg-later"]]


async def test_stop_while_headers_are_pending_gives_a_cancelled_final(fake, face):
    fake.hang_before_headers = True
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        ctx = GenerateContext("pending")
        rec = await face.start(sidecar, request(), ctx)
        with trio.fail_after(2):
            await fake.request_arrived.wait()
        assert not rec.ended.is_set()
        ctx.stop()
        with trio.fail_after(2):
            await rec.ended.wait()
            await fake.drop_event("pending").wait()
    final = rec.final()
    assert rec.chunks == []
    assert final.finish_reason == "cancelled"
    assert usage(final) == (3, 0, 3)


@pytest.mark.parametrize("when", ["before-the-request", "right-after-the-request"])
async def test_stop_before_the_task_opens_sends_no_rpc(fake, face, when):
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        ctx = GenerateContext("early")
        if when == "before-the-request":
            ctx.stop()
            rec = await face.start(sidecar, request(), ctx)
        else:
            rec = await face.start(sidecar, request(), ctx)
            ctx.stop()  # the request task has not run yet
        assert not rec.ended.is_set()  # the end comes from the request task, never from starting it
        with trio.fail_after(2):
            await rec.ended.wait()
        assert sidecar.engine.aborts_queued == 0
    final = rec.final()
    assert rec.chunks == []
    assert final.finish_reason == "cancelled"
    assert usage(final) == (3, 0, 3)
    assert fake.requests == []
    assert fake.abort_calls == []


async def test_stop_after_end_is_harmless(fake, face):
    fake.tokens = 3
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        ctx = GenerateContext("done")
        rec = await face.run(sidecar, request(), ctx)
        ctx.stop()
        ctx.stop()
        assert sidecar.engine.in_flight == 0
    assert rec.final().finish_reason == "stop"  # (and no second end: outcome() checks)
    assert fake.abort_calls == []


async def test_cleanup_during_a_read_ends_with_a_cancelled_final_and_drops_the_rpc(fake, face):
    fake.hang = True
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        rec = await face.start(sidecar, request(), GenerateContext("shut"))
        with trio.fail_after(2):
            await rec.wait_chunks(1)
        assert not rec.ended.is_set()
        await sidecar.engine.cleanup()
        # cleanup ended the request and flushed its Abort before returning
        assert fake.abort_calls == [["shut"]]
        if face.name == "submit":
            assert rec.ended.is_set()  # the sink's end came from the request task, before cleanup returned
        with trio.fail_after(2):
            await rec.ended.wait()
    with trio.fail_after(2):
        await fake.drop_event("shut").wait()
    final = rec.final()
    assert final.finish_reason == "cancelled"
    assert usage(final)[1] == len(rec.tokens_received()) >= 1
    assert rec.in_flight_at_end == 0


async def test_cleanup_while_headers_are_pending_ends_with_a_cancelled_final(fake, face):
    fake.hang_before_headers = True
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        rec = await face.start(sidecar, request(), GenerateContext("shut-pending"))
        with trio.fail_after(2):
            await fake.request_arrived.wait()
    if face.name == "submit":
        assert rec.ended.is_set()  # the sink's end came before open_sidecar's cleanup returned
    with trio.fail_after(2):
        await rec.ended.wait()
        await fake.drop_event("shut-pending").wait()
    final = rec.final()
    assert rec.chunks == []
    assert final.finish_reason == "cancelled"
    assert usage(final) == (3, 0, 3)


async def test_a_concurrent_cleanup_returns_only_once_the_first_has_closed_everything(fake, nursery, face):
    fake.hang = True  # endless chunks: the in-flight request keeps the first cleanup busy
    engine = SidecarEngine(sidecar_config(fake.endpoint))
    await engine.start(nursery)
    returned: list[str] = []

    async def cleanup(name: str) -> None:
        await engine.cleanup()
        assert engine.pool.closed and engine.in_flight == 0  # never returns while still closing
        returned.append(name)

    rec = await face.start(engine, request())
    with trio.fail_after(2):
        await rec.wait_chunks(1)
    with trio.fail_after(10):
        async with trio.open_nursery() as cleanups:
            cleanups.start_soon(cleanup, "first")
            await trio.lowlevel.checkpoint()
            cleanups.start_soon(cleanup, "second")
        await rec.ended.wait()
    assert rec.final().finish_reason == "cancelled"
    assert sorted(returned) == ["first", "second"]


async def test_cancel_in_flight_ends_requests_like_shutdown(fake, face):
    fake.hang = True
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        engine = sidecar.engine
        rec = await face.start(sidecar, request(), GenerateContext("drain"))
        with trio.fail_after(2):
            await rec.wait_chunks(1)
        assert engine.cancel_in_flight() == 1
        with trio.fail_after(2):
            await rec.ended.wait()
            await engine.wait_idle()
            await fake.abort_received.wait()
    assert rec.final().finish_reason == "cancelled"
    assert fake.abort_calls == [["drain"]]


async def test_drain_waits_for_requests_that_end_in_time_and_stops_the_rest(fake, face):
    fake.tokens = 3
    fake.token_delay = 0.05
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        engine = sidecar.engine
        quick = await face.start(sidecar, request(), GenerateContext("quick"))
        with trio.fail_after(2):
            await quick.wait_chunks(1)
        with trio.fail_after(5):
            assert await engine.drain(timeout=5, grace=5) == 0
        assert engine.in_flight == 0
        with trio.fail_after(2):  # (generate(): its caller takes the final chunk after the request ended)
            await quick.ended.wait()
        assert quick.final().finish_reason == "stop"
        with pytest.raises(EngineShutdown, match="^vLLM sidecar is not started$"):
            await face.refuse(sidecar, request(), GenerateContext("refused"))
    fake.hang = True
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        engine = sidecar.engine
        ctx = GenerateContext("slow")
        slow = await face.start(sidecar, request(), ctx)
        with trio.fail_after(2):
            await slow.wait_chunks(1)
        with trio.fail_after(2):
            assert await engine.drain(timeout=0.1, grace=5) == 1
        assert engine.in_flight == 0
        assert ctx.stopped  # stopped as its client would
        with trio.fail_after(2):
            await slow.ended.wait()
            await fake.abort_received.wait()
    final = slow.final()
    assert final.finish_reason == "cancelled"
    assert usage(final)[1] == len(slow.tokens_received())
    assert fake.request_ids == ["quick", "slow"]
    assert fake.abort_calls == [["slow"]]


async def test_drain_honours_the_decode_deferral_within_its_grace_and_leaves_the_rest_to_cleanup(
    fake, face, autojump_clock
):
    fake.hang = True
    fake.hold_first = trio.Event()  # the KV transfer never completes
    config = sidecar_config(fake.endpoint, disaggregation_mode="decode")
    async with open_sidecar(config) as sidecar:
        engine = sidecar.engine
        rec = await face.start(sidecar, decode_request(), GenerateContext("dec-drain"))
        with trio.fail_after(2):
            await fake.request_arrived.wait()
        with trio.fail_after(2):
            assert await engine.drain(timeout=0.1, grace=0.2) == 1
        assert engine.in_flight == 1  # the stop is deferred: the stream is kept
        assert not fake.drop_event("dec-drain").is_set()
    # cleanup (leaving the block) interrupts it
    with trio.fail_after(2):
        await rec.ended.wait()
        await fake.drop_event("dec-drain").wait()
    assert rec.final().finish_reason == "cancelled"
    assert fake.abort_calls == [["dec-drain"]]


async def test_a_cancelled_request_does_not_disturb_another_on_the_same_connection(fake, face):
    fake.hang = True
    async with open_sidecar(sidecar_config(fake.endpoint, grpc_connections=1)) as sidecar:
        survivor_ctx = GenerateContext("survivor")
        survivor = await face.start(sidecar, request(), survivor_ctx)
        with trio.fail_after(2):
            await survivor.wait_chunks(1)
        victim_ctx = GenerateContext("victim")
        victim = await face.start(sidecar, request(), victim_ctx)
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
    tokens = survivor.tokens_received()
    assert tokens == [42] * len(tokens)
    assert survivor.final().finish_reason == "cancelled"
    assert usage(survivor.final())[1] == len(tokens)
    assert fake.dropped_at["survivor"] > fake.dropped_at["victim"]


async def test_the_end_comes_once_the_engine_no_longer_counts_the_request(fake, face):
    fake.hang = True
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        engine = sidecar.engine
        ctx_a, ctx_b = GenerateContext("a"), GenerateContext("b")
        a = await face.start(sidecar, request(), ctx_a)
        b = await face.start(sidecar, request(), ctx_b)
        with trio.fail_after(2):
            await a.wait_chunks(1)
            await b.wait_chunks(1)
        assert engine.in_flight == 2
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
        c = await face.run(sidecar, request(), GenerateContext("c"))
    assert a.in_flight_at_end == 1
    assert b.in_flight_at_end == 0
    assert c.in_flight_at_end == 0
    assert [r.final().finish_reason for r in (a, b, c)] == ["cancelled", "cancelled", "stop"]


# ---------------------------------------------------------------------------- decode deferral (docs/reference/sidecar.md#decode-deferral)


async def test_decode_stop_while_headers_are_held_waits_for_the_first_token(fake, face):
    fake.hang = True
    fake.hold_first = trio.Event()
    first_token_notified = []
    config = sidecar_config(fake.endpoint, disaggregation_mode="decode")
    async with open_sidecar(config) as sidecar:
        ctx = GenerateContext("dec", on_first_token=lambda: first_token_notified.append(True))
        rec = await face.start(sidecar, decode_request(), ctx)
        with trio.fail_after(2):
            await fake.request_arrived.wait()
        ctx.stop()
        with trio.move_on_after(0.2):
            await fake.drop_event("dec").wait()
        assert not fake.drop_event("dec").is_set()  # never dropped before the first token
        assert not rec.ended.is_set()
        assert rec.chunks == []
        fake.hold_first.set()
        with trio.fail_after(2):
            await rec.ended.wait()
            await fake.drop_event("dec").wait()
            await fake.abort_received.wait()
    final = rec.final()
    assert rec.chunks == []  # the cancelled chunk replaced the first token's
    assert final.finish_reason == "cancelled"
    assert usage(final) == (3, 1, 4)  # counts the first token it replaced (docs/reference/sidecar.md#decode-deferral)
    assert first_token_notified == [True]
    assert fake.abort_calls == [["dec"]]
    assert fake.requests[0][0].kv.kv_transfer_params["remote_port"] == "20097"
    stats = sidecar.stats()
    assert stats.decode_deferrals == 1  # docs/observability.md
    assert stats.requests_finished["cancelled"] == 1 and stats.completion_tokens == 1
    assert (stats.aborts_queued, stats.aborts_sent) == (1, 1)


async def test_decode_stop_before_the_request_still_submits_it(fake, face):
    fake.hang = True
    config = sidecar_config(fake.endpoint, disaggregation_mode="decode")
    async with open_sidecar(config) as sidecar:
        ctx = GenerateContext("dec-early")
        ctx.stop()
        rec = await face.run(sidecar, decode_request(), ctx)
        with trio.fail_after(2):
            await fake.abort_received.wait()
    assert fake.request_ids == ["dec-early"]
    assert rec.chunks == []
    final = rec.final()
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
async def test_decode_after_stop_eof_or_error_gives_a_cancelled_final(fake, face, caplog_sidecar, knob, warning):
    fake.hold_first = trio.Event()
    fake.tokens = 5
    setattr(fake, knob, 0)
    config = sidecar_config(fake.endpoint, disaggregation_mode="decode")
    async with open_sidecar(config) as sidecar:
        ctx = GenerateContext("dec-eof")
        rec = await face.start(sidecar, decode_request(), ctx)
        with trio.fail_after(2):
            await fake.request_arrived.wait()
        ctx.stop()
        fake.hold_first.set()
        with trio.fail_after(2):
            await rec.ended.wait()
    final = rec.final()
    assert rec.chunks == []
    assert final.finish_reason == "cancelled"
    assert any(r.levelno == logging.WARNING and warning in r.getMessage() for r in caplog_sidecar.records)


async def test_decode_stop_after_the_first_token_is_immediate(fake, face):
    fake.hang = True
    config = sidecar_config(fake.endpoint, disaggregation_mode="decode")
    async with open_sidecar(config) as sidecar:
        ctx = GenerateContext("dec-late")
        rec = await face.run(sidecar, decode_request(), ctx, on_chunk=stop_at(2, ctx))
        with trio.fail_after(2):
            await fake.drop_event("dec-late").wait()
            await fake.abort_received.wait()
    final = rec.final()
    tokens = rec.tokens_received()
    assert len(rec.chunks) == 2 and len(tokens) >= 2 and tokens == [42] * len(tokens)
    assert final.finish_reason == "cancelled"
    assert usage(final) == (3, len(tokens), 3 + len(tokens))
    assert fake.abort_calls == [["dec-late"]]
    assert sidecar.stats().decode_deferrals == 0  # the transfer had completed: no deferral


async def test_decode_cleanup_while_headers_are_held_does_not_wait_for_the_transfer(fake, face):
    fake.hang = True
    fake.hold_first = trio.Event()  # never set: shutdown interrupts every phase in every mode
    config = sidecar_config(fake.endpoint, disaggregation_mode="decode")
    async with open_sidecar(config) as sidecar:
        ctx = GenerateContext("dec-shut")
        ctx.stop()  # a deferred cancellation is recorded; shutdown must not wait for it either
        rec = await face.start(sidecar, decode_request(), ctx)
        with trio.fail_after(2):
            await fake.request_arrived.wait()
        assert not rec.ended.is_set()
    if face.name == "submit":
        assert rec.ended.is_set()  # the sink's end came before open_sidecar's cleanup returned
    with trio.fail_after(2):
        await rec.ended.wait()
        await fake.drop_event("dec-shut").wait()
    final = rec.final()
    assert rec.chunks == []
    assert final.finish_reason == "cancelled"
    assert usage(final) == (3, 0, 3)
    assert fake.abort_calls == [["dec-shut"]]


# ---------------------------------------------------------------------------- prefill (cancels at once)


async def test_prefill_stream_ends_with_the_handoff(fake, face):
    config = sidecar_config(fake.endpoint, disaggregation_mode="prefill")
    async with open_sidecar(config) as sidecar:
        rec = await face.run(sidecar, request(), GenerateContext("pre"))
    final = rec.final()
    assert rec.chunks == []
    assert final.finish_reason == "stop"
    assert final.disaggregated_params == PREFILL_HANDOFF
    assert usage(final)[1] == 0  # prefill's one token is decode's to report
    assert fake.abort_calls == []


async def test_prefill_stop_while_headers_are_held_cancels_at_once(fake, face):
    fake.hold_first = trio.Event()  # never set: unlike decode, prefill does not wait for a token
    config = sidecar_config(fake.endpoint, disaggregation_mode="prefill")
    async with open_sidecar(config) as sidecar:
        ctx = GenerateContext("pre-stop")
        rec = await face.start(sidecar, request(), ctx)
        with trio.fail_after(2):
            await fake.request_arrived.wait()
        ctx.stop()
        with trio.fail_after(2):
            await rec.ended.wait()
            await fake.drop_event("pre-stop").wait()
            await fake.abort_received.wait()
    final = rec.final()
    assert rec.chunks == []
    assert final.finish_reason == "cancelled"
    assert usage(final) == (3, 0, 3)
    assert fake.abort_calls == [["pre-stop"]]


# ---------------------------------------------------------------------------- a stop racing the terminal


class _StopOnceTheTerminalWasRead:
    """A Trio instrument: ``ctx.stop()`` just before the request task of ``ctx`` next runs after the
    connection's reader converted the terminal message (the listener ran in the reader task), i.e. from a
    task scheduled in the same batch as the woken request task."""

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


async def test_stop_racing_the_terminal_counts_only_what_the_caller_received(fake, face):
    fake.tokens = 3
    fake.token_delay = 0.05  # the request task is parked in listen() when the terminal arrives
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        for attempt in range(3):  # (only a scheduling stall of ~50 ms can make the set-up miss the race)
            ctx = GenerateContext(f"race-{attempt}")
            instrument = _StopOnceTheTerminalWasRead(sidecar.engine, ctx)
            trio.lowlevel.add_instrument(instrument)
            try:
                rec = await face.run(sidecar, request(), ctx)
            finally:
                trio.lowlevel.remove_instrument(instrument)
            if instrument.fired:
                break
        else:
            raise RuntimeError("the stop never landed between the terminal's conversion and the request task")
    final = rec.final()
    assert rec.tokens_received() == [42, 42]
    # Either ending is acceptable (the terminal, as the server ended the stream; or the cancelled chunk, as a
    # stop that raced with the message wins), but the usage must count exactly what the caller received.
    received = sum(len(c.token_ids) for c in [*rec.chunks, final])
    assert usage(final)[1] == received, (final.finish_reason, usage(final), received)
    assert final.finish_reason == "stop"  # the terminal was converted first: it is what the caller gets
    assert sidecar.engine.aborts_queued == 0  # the server had ended the stream


# ---------------------------------------------------------------------------- generate() only


def untaken_runs(stream: Any) -> list[Any]:
    """The runs a ``generate()`` stream holds that its caller has not taken all of."""
    return [run for run in (stream._batch, *stream._queued) if run]


async def test_generate_yields_one_chunk_per_message(fake):
    fake.tokens = 5
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        async with sidecar.generate(request(), GenerateContext("per-message")) as stream:
            chunks = [chunk async for chunk in stream]
    assert [c.token_ids for c in chunks] == [[42]] * 5
    assert [c.finish_reason for c in chunks] == [None] * 4 + ["stop"]


async def test_open_rejection_is_raised_by_generate_and_reaches_the_server_once(fake):
    fake.reject = True
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        with pytest.raises(InvalidArgument) as info:
            async with sidecar.generate(request()):
                pytest.fail("the open must fail")  # pragma: no cover
    assert str(info.value) == "GenerateStream: rejected by fake vLLM (InvalidArgument)"
    assert len(fake.requests) == 1


async def test_generate_reads_at_most_one_run_ahead_of_a_caller_that_does_not_read(fake, autojump_clock):
    # Back-pressure: while the caller sleeps, the request pauses once it holds a run the caller has not
    # started on; the messages that arrive meanwhile stay in the transport (HTTP/2 flow control) and are
    # not converted, so usage never counts them.
    fake.hang = True  # endless chunks, ~10 ms apart
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        ctx = GenerateContext("slow-reader")
        async with sidecar.generate(request(), ctx) as stream:
            chunks = [await stream.__anext__()]
            await trio.sleep(0.3)  # ~30 messages arrive meanwhile
            state = stream._state
            assert len(untaken_runs(stream)) == 2  # the run being returned and the one it paused on
            converted = state.completion_tokens
            assert converted == 1 + sum(len(run) for run in untaken_runs(stream))  # nothing converted beyond
            await trio.sleep(0.1)  # ~10 more messages arrive: the request stays paused
            assert state.completion_tokens == converted
            # Taking the held runs resumes the request: what arrived meanwhile comes as one run.
            chunks += [await stream.__anext__() for _ in range(2)]
            with trio.fail_after(2):
                while state.completion_tokens < 10:
                    await trio.sleep(0.01)
            ctx.stop()
            chunks += [chunk async for chunk in stream]
    assert [c.token_ids for c in chunks[:3]] == [[42]] * 3
    assert chunks[-1].finish_reason == "cancelled"
    assert usage(chunks[-1])[1] == len(chunks) - 1  # the chunks not taken were dropped and not counted


@pytest.mark.parametrize("task_ends_first", [False, True])
async def test_cancel_with_a_run_half_returned_counts_only_the_returned_chunks(fake, task_ends_first, autojump_clock):
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
            chunks.append(await stream.__anext__())
            chunks.append(await stream.__anext__())  # the caller starts on the next run: the request resumes
            await trio.sleep(0.05)  # and hands the messages received meanwhile over as one run
            assert not stream._finished
            assert sum(len(run) for run in untaken_runs(stream)) > 1  # chunks handed over but not taken yet
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


async def test_scope_cancellation_drops_the_stream_and_queues_an_abort(fake):
    fake.hang = True
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        with trio.CancelScope() as scope:
            async with sidecar.generate(request(), GenerateContext("scoped")) as stream:
                async for _chunk in stream:
                    scope.cancel()
                    await trio.lowlevel.checkpoint()
        assert scope.cancelled_caught
        with trio.fail_after(2):
            await fake.drop_event("scoped").wait()
            await fake.abort_received.wait()
    assert fake.abort_calls == [["scoped"]]


async def test_decode_scope_cancellation_propagates_at_once_but_keeps_the_stream(fake, autojump_clock):
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
                async with sidecar.generate(decode_request(), GenerateContext("dec-scope")) as stream:
                    async for _chunk in stream:
                        pytest.fail("no chunk before the transfer completed")  # pragma: no cover
        assert scope.cancelled_caught
        await trio.sleep(0.2)
        assert not fake.drop_event("dec-scope").is_set()
        assert sidecar.engine.in_flight == 1
        fake.hold_first.set()
        with trio.fail_after(2):
            await fake.drop_event("dec-scope").wait()
            await fake.abort_received.wait()
    assert fake.abort_calls == [["dec-scope"]]


# ---------------------------------------------------------------------------- submit() only


async def test_cancelling_the_submitting_scope_does_not_end_the_request(fake):
    fake.tokens = 3
    fake.token_delay = 0.05
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        rec = Recording(sidecar.engine)
        with trio.CancelScope() as scope:
            sidecar.submit(request(), GenerateContext("detached"), rec)
            scope.cancel()
            await trio.sleep_forever()
        assert scope.cancelled_caught
        with trio.fail_after(2):
            await rec.ended.wait()
    assert rec.tokens_received() == [42, 42]
    assert rec.final().finish_reason == "stop"
    assert not fake.drop_event("detached").is_set()
    assert fake.abort_calls == []


async def test_a_sink_whose_chunk_raises_fails_only_its_request_with_that_error(fake, caplog_sidecar):
    class Boom(Exception):
        pass

    class BrokenSink(Recording):
        def tokens(self, token_ids, text):
            raise Boom("sink bug")

    fake.tokens = 5
    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        broken = BrokenSink(sidecar.engine)
        sidecar.submit(request(), GenerateContext("broken"), broken)
        with trio.fail_after(2):
            await broken.ended.wait()
        healthy = await SubmitFace(None).run(sidecar, request(), GenerateContext("healthy"))
        assert sidecar.engine.in_flight == 0
    error = broken.error()
    assert isinstance(error, Boom) and str(error) == "sink bug"
    assert "unexpected failure in request broken" in caplog_sidecar.text
    assert usage(healthy.final()) == (3, 5, 8)


async def test_a_sink_whose_end_raises_is_logged_and_the_engine_carries_on(fake, caplog_sidecar):
    class EndRaises(Recording):
        def end(self, final, error):
            super().end(final, error)
            raise RuntimeError("end bug")

    async with open_sidecar(sidecar_config(fake.endpoint)) as sidecar:
        sink = EndRaises(sidecar.engine)
        sidecar.submit(request(), GenerateContext("end-raises"), sink)
        with trio.fail_after(2):
            await sink.ended.wait()
        after = await SubmitFace(None).run(sidecar, request(), GenerateContext("after"))
    assert sink.final().finish_reason == "stop"
    assert after.final().finish_reason == "stop"
    assert "the sink of request end-raises failed at its end" in caplog_sidecar.text
