"""The request bridge and Trio as a guest on the asyncio loop (docs/reference/worker.md#the-request-bridge).

Every test runs a real guest run (:func:`trio_sidecar.dynamo.host.run_as_guest`): Trio on an asyncio loop,
the handler driven as Dynamo's runtime drives it, on the same thread. These tests need no Dynamo install:
the bridge only sees a context with ``id()``, ``async_killed_or_stopped()`` and ``notify_first_token()``,
a ``ResponseSender`` with ``send``/``close``, and ``Sidecar.submit``'s contract (here over a fake
``generate()``).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from trio_sidecar.dynamo.bridge import QUEUE_WARN_THRESHOLD, SHUTTING_DOWN, RequestBridge, _Call, dynamo_exception
from trio_sidecar.dynamo.host import HostLoop, _host, run_as_guest
from trio_sidecar.errors import (
    CannotConnect,
    ConnectionTimeout,
    EngineShutdown,
    InvalidArgument,
    ProtocolError,
    RequestCancelled,
    SidecarError,
)

pytestmark = pytest.mark.dynamo

CANCELLED = {"token_ids": [], "index": 0, "finish_reason": "cancelled"}


def tokens_of(chunks: list) -> list[int]:
    """All token ids of a handler's output (chunks may be coalesced)."""
    return [t for c in chunks for t in c["token_ids"]]


class Chunk:
    def __init__(self, data: dict) -> None:
        self.data = data

    def to_dict(self) -> dict:
        return dict(self.data)


class FakeDynamoContext:
    """Dynamo's per-request ``Context``."""

    def __init__(self, request_id: str, *, stopped: bool = False) -> None:
        self._id = request_id
        self._pre_stopped = stopped
        self._future: asyncio.Future | None = None
        self.first_token_threads: list[int] = []

    def id(self) -> str:
        return self._id

    def async_killed_or_stopped(self) -> asyncio.Future:
        self._future = asyncio.get_running_loop().create_future()
        if self._pre_stopped:
            self._future.set_result(True)
        return self._future

    def stop_generating(self) -> None:
        if self._future is not None and not self._future.done():
            self._future.set_result(True)

    def notify_first_token(self) -> None:
        self.first_token_threads.append(threading.get_ident())


class FakeGenerateContext:
    """Stands in for ``trio_sidecar.api.GenerateContext``."""

    def __init__(self, request_id: str, on_first_token) -> None:
        self.request_id = request_id
        self.on_first_token = on_first_token
        self.stopped = False
        self.stop_calls = 0
        self._event = trio.Event()

    def stop(self) -> None:
        self.stop_calls += 1
        self.stopped = True
        self._event.set()

    async def wait_stopped(self) -> None:
        await self._event.wait()


class FakeSidecar:
    """``generate`` yields ``plan`` chunks; with ``hold`` it waits for stop after the first chunk; with
    ``step`` every chunk carries a key that is not a plain delta's (so none is ever coalesced)."""

    def __init__(
        self,
        *,
        plan: int = 3,
        hold: bool = False,
        error: Exception | None = None,
        step: bool = False,
        start_delay: float = 0.0,
    ) -> None:
        self.plan = plan
        self.start_delay = start_delay
        self.hold = hold
        self.error = error
        self.step = step
        self.contexts: dict[str, FakeGenerateContext] = {}
        self.finished: list[str] = []
        self.started: list[str] = []
        self.task_threads: list[int] = []

    @asynccontextmanager
    async def generate(self, request: dict, ctx: FakeGenerateContext):
        self.contexts[ctx.request_id] = ctx
        if self.start_delay:  # the request task gets to run only later (a busy engine)
            await trio.sleep(self.start_delay)
        self.started.append(ctx.request_id)
        self.task_threads.append(threading.get_ident())
        if self.error is not None:
            raise self.error

        async def chunks():
            try:
                if ctx.stopped:
                    yield Chunk(CANCELLED)
                    return
                for i in range(self.plan):
                    if i == 1 and self.hold:
                        await ctx.wait_stopped()
                    if ctx.stopped:
                        yield Chunk(CANCELLED)
                        return
                    if i == 0:
                        ctx.on_first_token()
                    data = {"token_ids": [request["token_ids"][0] + i], "index": 0}
                    if self.step:
                        data["step"] = i
                    yield Chunk(data)
                    await trio.lowlevel.checkpoint()
            finally:
                self.finished.append(ctx.request_id)

        yield chunks()


class Engine:
    """``Sidecar.submit``'s contract over a fake ``generate()``: a task per request drives the sink, started
    with ``start_soon`` (so it runs after ``submit`` returned, like the engine's request task)."""

    def __init__(self, sidecar: FakeSidecar, nursery: trio.Nursery) -> None:
        self.sidecar = sidecar
        self.nursery = nursery
        self.in_flight = 0
        self.idle = trio.Event()
        self.idle.set()

    def submit(self, request: dict, ctx, sink) -> None:
        async def run() -> None:
            try:
                async with self.sidecar.generate(request, ctx) as chunks:
                    async for chunk in chunks:
                        sink.chunk(chunk)
            except Exception as exc:  # noqa: BLE001 - handed to the sink, as the engine does
                sink.end(None, exc)
            else:
                sink.end(None, None)
            finally:
                self.in_flight -= 1
                if not self.in_flight:
                    self.idle.set()

        if not self.in_flight:
            self.idle = trio.Event()
        self.in_flight += 1
        self.nursery.start_soon(run)

    async def wait_idle(self) -> None:
        await self.idle.wait()


def guest(scenario: Callable[..., Awaitable[Any]], *, loop_factory=None) -> Any:
    """Run ``scenario(host)`` as a Trio guest on a fresh asyncio loop, under a 30 s guard."""

    async def main(host: HostLoop) -> Any:
        with trio.fail_after(30):
            return await scenario(host)

    return run_as_guest(main, loop_factory=loop_factory)


@asynccontextmanager
async def serving(sidecar: FakeSidecar, submit=None):
    """The worker's shape: the engine's nursery outside, the bridge's inside it."""
    async with trio.open_nursery() as engine_nursery:
        engine = Engine(sidecar, engine_nursery)
        bridge = RequestBridge(submit or engine.submit, make_context=FakeGenerateContext)
        async with trio.open_nursery() as nursery:
            await nursery.start(bridge.run)
            yield bridge, engine, nursery
            nursery.cancel_scope.cancel()
        engine_nursery.cancel_scope.cancel()


async def consume(
    bridge: RequestBridge,
    request: dict,
    context: FakeDynamoContext,
    *,
    close_after=None,
    stop_after=None,
    stall_until=None,
):
    """Drive the pull handler as Dynamo's runtime would (an asyncio task).

    ``stall_until``: after the first item, stop reading until this predicate holds.
    """
    out: list = []
    agen = bridge.handler(request, context)
    try:
        async for item in agen:
            out.append(item)
            if stall_until is not None and len(out) == 1:
                while not stall_until():
                    await asyncio.sleep(0.01)
            if stop_after is not None and len(out) == stop_after:
                context.stop_generating()
            if close_after is not None and len(out) == close_after:
                break
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        out.append(exc)
    finally:
        await agen.aclose()
    return out


def _sidecar_error(raised: BaseException) -> BaseException:
    """The SidecarError behind what the handler raised (Dynamo's typed exception chains to it)."""
    return raised if isinstance(raised, SidecarError) else raised.__cause__


# -- Trio as a guest on the asyncio loop --------------------------------------------------------------------


def test_trio_tasks_and_asyncio_tasks_run_on_one_thread():
    async def scenario(host: HostLoop):
        async def loop_side():
            return threading.get_ident(), asyncio.get_running_loop()

        ident, loop = await host.run(loop_side)
        return ident == threading.get_ident(), loop is host.loop

    assert guest(scenario) == (True, True)


def test_host_run_returns_results_and_raises_exceptions_from_the_loop():
    async def add(a, b):
        await asyncio.sleep(0)
        return a + b

    async def fail():
        raise ValueError("boom")

    async def scenario(host: HostLoop):
        assert await host.run(add, 2, 3) == 5
        with pytest.raises(ValueError, match="boom"):
            await host.run(fail)
        return True

    assert guest(scenario)


def test_cancelling_a_trio_caller_cancels_the_asyncio_task():
    cancelled = []

    async def forever():
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def scenario(host: HostLoop):
        with trio.move_on_after(0.05):
            await host.run(forever)
        for _ in range(10):  # the cancellation is delivered on the loop's next iterations
            await host.run(asyncio.sleep, 0)
        return cancelled

    assert guest(scenario) == [True]


def test_a_failure_in_trio_ends_the_asyncio_side_too():
    # The Trio run is the process's lifetime: when it fails, the loop stops and the asyncio tasks still
    # running are cancelled, and the error surfaces as itself (not as an ExceptionGroup).
    cancelled = []

    async def background():
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def scenario(host: HostLoop):
        host.loop.create_task(background())
        await trio.sleep(0.01)
        raise ProtocolError("vLLM changed its identity")

    with pytest.raises(ProtocolError, match="vLLM changed its identity"):
        guest(scenario)
    assert cancelled == [True]


def test_the_asyncio_side_ending_first_cancels_the_trio_run_and_waits_for_its_cleanup():
    events: list[str] = []

    async def main(host: HostLoop) -> None:
        try:
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                await trio.sleep(0.01)  # cleanup that needs Trio to keep running
                events.append("trio cleanup done")

    async def runner() -> None:
        task = asyncio.ensure_future(_host(main))
        await asyncio.sleep(0.05)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            events.append("host cancelled")

    asyncio.run(runner())
    assert events == ["trio cleanup done", "host cancelled"]


def test_the_worker_runs_trio_on_uvloop_like_dynamos_own_workers():
    uvloop = pytest.importorskip("uvloop")
    from trio_sidecar.dynamo.worker import _loop_factory

    assert _loop_factory() is uvloop.new_event_loop

    async def scenario(host: HostLoop):
        return type(host.loop)

    assert guest(scenario, loop_factory=_loop_factory()) is uvloop.Loop


# -- the pull handler ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("plan", [1, 3])
def test_chunks_flow_from_trio_to_the_dynamo_handler_in_order(plan):
    sidecar = FakeSidecar(plan=plan)

    async def scenario(host: HostLoop):
        async with serving(sidecar) as (bridge, engine, _):
            out = await host.run(consume, bridge, {"token_ids": [100]}, FakeDynamoContext("req-1"))
            await engine.wait_idle()
        return out

    out = guest(scenario)
    assert tokens_of(out) == [100 + i for i in range(plan)]
    assert all(c == {"token_ids": c["token_ids"], "index": 0} for c in out)
    assert sidecar.finished == ["req-1"]
    assert sidecar.contexts["req-1"].stop_calls == 0


@pytest.mark.parametrize("push_egress", [False, True])
def test_cancel_before_the_trio_task_starts_is_not_lost(push_egress):
    # Dynamo's context is already stopped when the handler runs: the stop reaches the request's context
    # before the engine's request task gets to run, and the request ends with just its cancelled chunk.
    sidecar = FakeSidecar(plan=5, start_delay=0.2)

    async def scenario(host: HostLoop):
        async with serving(sidecar) as (bridge, engine, _):
            ctx = FakeDynamoContext("early", stopped=True)
            sender = FakeResponseSender()
            if push_egress:
                error = await host.run(push, bridge, {"token_ids": [7]}, ctx, sender)
                assert error is None
                out = sender.frames
            else:
                out = await host.run(consume, bridge, {"token_ids": [7]}, ctx)
            await engine.wait_idle()
        return out

    assert guest(scenario) == [CANCELLED]
    assert sidecar.contexts["early"].stop_calls >= 1 and sidecar.started == ["early"]


def test_stop_from_dynamo_mid_stream_ends_with_the_cancelled_chunk():
    sidecar = FakeSidecar(plan=5, hold=True)

    async def scenario(host: HostLoop):
        async with serving(sidecar) as (bridge, engine, _):
            out = await host.run(partial(consume, stop_after=1), bridge, {"token_ids": [1]}, FakeDynamoContext("mid"))
            await engine.wait_idle()
        return out

    assert guest(scenario) == [{"token_ids": [1], "index": 0}, CANCELLED]
    assert sidecar.contexts["mid"].stopped


def test_runtime_closing_the_generator_stops_the_trio_request():
    sidecar = FakeSidecar(plan=5, hold=True)

    async def scenario(host: HostLoop):
        async with serving(sidecar) as (bridge, engine, _):
            out = await host.run(
                partial(consume, close_after=1), bridge, {"token_ids": [1]}, FakeDynamoContext("closed")
            )
            await engine.wait_idle()
        return out

    assert guest(scenario) == [{"token_ids": [1], "index": 0}]
    assert sidecar.contexts["closed"].stop_calls == 1
    assert sidecar.finished == ["closed"]


@pytest.mark.parametrize(
    ("error", "dynamo_class"),
    [
        (InvalidArgument("bad"), "InvalidArgument"),
        (CannotConnect("vLLM is not serving: down"), "CannotConnect"),
        (ConnectionTimeout("GetModelInfo exceeded the total vLLM startup deadline"), "ConnectionTimeout"),
        (EngineShutdown(SHUTTING_DOWN), "EngineShutdown"),
        (RequestCancelled("GenerateStream: gone (Cancelled)"), "Cancelled"),
        (ProtocolError("GenerateStream ended before a terminal response"), "Unknown"),
    ],
)
def test_sidecar_errors_cross_into_dynamo_as_the_typed_exception_of_their_kind(error, dynamo_class):
    # The 1.6.1 frontend migrates CannotConnect/ConnectionTimeout/EngineShutdown to another worker, answers
    # InvalidArgument with HTTP 400 and Cancelled with 499; the text stays the sidecar's.
    exceptions = pytest.importorskip("dynamo.llm.exceptions")
    translated = dynamo_exception(error)
    assert type(translated) is getattr(exceptions, dynamo_class)
    assert str(translated) == str(error)
    assert translated.__cause__ is error


def test_other_exceptions_cross_unchanged():
    boom = RuntimeError("boom")
    assert dynamo_exception(boom) is boom


def test_sidecar_error_is_raised_from_the_handler_with_its_text():
    sidecar = FakeSidecar(error=InvalidArgument("max_tokens must be at least 1"))

    async def scenario(host: HostLoop):
        async with serving(sidecar) as (bridge, engine, _):
            out = await host.run(consume, bridge, {"token_ids": [1]}, FakeDynamoContext("bad"))
            await engine.wait_idle()
        return out

    out = guest(scenario)
    assert len(out) == 1
    assert isinstance(_sidecar_error(out[0]), InvalidArgument)
    assert str(out[0]) == "max_tokens must be at least 1"


@pytest.mark.parametrize(
    "refusal", [InvalidArgument("max_tokens must be at least 1"), EngineShutdown("vLLM sidecar is not started")]
)
def test_a_request_that_submit_refuses_ends_at_once_with_its_error(refusal):
    # Sidecar.submit raises conversion and admission errors synchronously (the engine owns admission: after
    # stop_admission() it refuses with EngineShutdown, which the frontend migrates).
    submitted: list[str] = []

    def submit(request, ctx, sink):
        submitted.append(ctx.request_id)
        raise refusal

    async def scenario(host: HostLoop):
        async with serving(FakeSidecar(), submit=submit) as (bridge, _, _):
            out = await host.run(consume, bridge, {"token_ids": [1]}, FakeDynamoContext("refused"))
            return out, repr(bridge)

    out, bridge_repr = guest(scenario)
    assert submitted == ["refused"]
    assert len(out) == 1 and type(_sidecar_error(out[0])) is type(refusal)
    assert str(out[0]) == str(refusal)
    assert "0 open" in bridge_repr


def test_ending_the_bridge_ends_open_requests_with_engine_shutdown():
    sidecar = FakeSidecar(plan=5, hold=True)
    results: dict[str, list] = {}

    async def scenario(host: HostLoop):
        async with trio.open_nursery() as outer:
            engine = Engine(sidecar, outer)
            bridge = RequestBridge(engine.submit, make_context=FakeGenerateContext)
            async with trio.open_nursery() as requests:
                await requests.start(bridge.run)

                async def drive(rid):
                    results[rid] = await host.run(consume, bridge, {"token_ids": [1]}, FakeDynamoContext(rid))

                for rid in ("a", "b"):
                    outer.start_soon(drive, rid)
                while len(sidecar.contexts) < 2 or "2 open" not in repr(bridge):
                    await trio.sleep(0.01)
                requests.cancel_scope.cancel()  # what the worker does after the drain
            while len(results) < 2:
                await trio.sleep(0.01)
            outer.cancel_scope.cancel()

    guest(scenario)
    for rid, out in results.items():
        assert out[0] == {"token_ids": [1], "index": 0}
        assert isinstance(_sidecar_error(out[-1]), EngineShutdown) and str(out[-1]) == SHUTTING_DOWN
        assert sidecar.contexts[rid].stop_calls >= 1  # the request was told to stop too


def test_a_request_after_the_bridge_ended_is_refused_not_lost():
    sidecar = FakeSidecar()

    async def scenario(host: HostLoop):
        async with trio.open_nursery() as outer:
            engine = Engine(sidecar, outer)
            bridge = RequestBridge(engine.submit, make_context=FakeGenerateContext)
            async with trio.open_nursery() as requests:
                await requests.start(bridge.run)
                requests.cancel_scope.cancel()
            return await host.run(consume, bridge, {"token_ids": [1]}, FakeDynamoContext("late"))

    out = guest(scenario)
    assert len(out) == 1 and isinstance(_sidecar_error(out[0]), EngineShutdown)
    assert str(out[0]) == SHUTTING_DOWN
    assert sidecar.contexts == {}


@given(token_ids=st.lists(st.integers(0, 2**31), max_size=4), text=st.text(max_size=5))
def test_the_sinks_token_fast_path_emits_the_dict_of_the_same_chunk(token_ids, text):
    from trio_sidecar.protocol import token_chunk

    def call() -> _Call:
        bridge = RequestBridge(lambda request, ctx, sink: None)
        return _Call(bridge, "r", FakeGenerateContext("r", None), None, asyncio.Future(loop=_DummyLoop()))

    fast, slow = call(), call()
    fast.tokens(list(token_ids), text)
    slow.chunk(token_chunk(list(token_ids), text))
    assert list(fast.items) == list(slow.items)
    assert type(fast.items[0]["token_ids"]) is list


class _DummyLoop:
    """Just enough of a loop for a Future that is never awaited."""

    def get_debug(self) -> bool:
        return False


def test_first_token_notification_runs_on_the_loop_thread_with_the_trio_tasks():
    sidecar = FakeSidecar(plan=2)
    ctx = FakeDynamoContext("ftt")

    async def scenario(host: HostLoop):
        async with serving(sidecar) as (bridge, engine, _):
            await host.run(consume, bridge, {"token_ids": [1]}, ctx)
            await engine.wait_idle()
        return threading.get_ident()

    ident = guest(scenario)
    assert ctx.first_token_threads == [ident]
    assert sidecar.task_threads == [ident]


def test_a_stalled_consumer_is_reported_once(caplog):
    plan = 2 * QUEUE_WARN_THRESHOLD + 50
    sidecar = FakeSidecar(plan=plan)
    caplog.set_level(logging.WARNING, logger="trio_sidecar.dynamo.bridge")

    async def scenario(host: HostLoop):
        async with serving(sidecar) as (bridge, engine, _):
            out = await host.run(
                partial(consume, stall_until=lambda: "slow" in sidecar.finished),
                bridge,
                {"token_ids": [0]},
                FakeDynamoContext("slow"),
            )
            await engine.wait_idle()
        return out

    out = guest(scenario)
    assert tokens_of(out) == list(range(plan))
    assert len(out) < QUEUE_WARN_THRESHOLD  # the backlog was coalesced into multi-token deltas
    stalled = [r for r in caplog.records if "consumer is stalled" in r.getMessage()]
    assert len(stalled) == 1


def test_many_concurrent_streams_lose_no_chunk_and_keep_order():
    sidecar = FakeSidecar(plan=200)

    async def scenario(host: HostLoop):
        async with serving(sidecar) as (bridge, engine, _):

            async def all_of_them():
                return await asyncio.gather(
                    *(consume(bridge, {"token_ids": [i * 1000]}, FakeDynamoContext(f"r{i}")) for i in range(30))
                )

            outs = await host.run(all_of_them)
            await engine.wait_idle()
        return outs

    for i, out in enumerate(guest(scenario)):
        assert tokens_of(out) == [i * 1000 + k for k in range(200)]


# -- push egress (Dynamo 1.6.1 passes a ResponseSender to a handler that declares ``response_sender``) ----


class FakeResponseSender:
    """Dynamo's ``ResponseSender``: ``send`` queues a frame on the request's bounded channel and blocks its
    caller while the channel is full; it raises ``RuntimeError`` once the response stream is gone.

    ``capacity`` frames may be unread at once (None: unbounded); ``read(n)`` is the consumer reading.
    """

    def __init__(self, *, capacity: int | None = None, gone_after: int | None = None) -> None:
        self.frames: list[dict] = []
        self.send_threads: list[int] = []
        self.closed = 0
        self.blocked = threading.Event()  # a send is waiting for room
        self._room = threading.Semaphore(capacity) if capacity is not None else None
        self._gone_after = gone_after
        self._gone = False

    def send(self, obj: dict) -> None:
        if self.closed:
            raise RuntimeError("response stream is closed; send() after close()")
        if self._gone or (self._gone_after is not None and len(self.frames) >= self._gone_after):
            self._gone = True
            raise RuntimeError("response stream is closed; the consumer dropped the response stream")
        if self._room is not None and not self._room.acquire(blocking=False):
            self.blocked.set()
            self._room.acquire()
            self.blocked.clear()
        self.frames.append(dict(obj))
        self.send_threads.append(threading.get_ident())

    def read(self, n: int) -> None:
        assert self._room is not None
        for _ in range(n):
            self._room.release()

    def close(self) -> None:
        self.closed += 1


async def push(bridge: RequestBridge, request: dict, context: FakeDynamoContext, sender: FakeResponseSender):
    """Drive the handler as Dynamo's push egress does: one ``__anext__`` runs the whole request."""
    agen = bridge.handler(request, context, response_sender=sender)
    try:
        yielded = [item async for item in agen]
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return exc
    assert yielded == []  # a push-mode handler yields nothing (Dynamo fails the request otherwise)
    return None


async def push_and_stop(bridge: RequestBridge, request: dict, ctx: FakeDynamoContext, sender: FakeResponseSender):
    """Push, and stop Dynamo's context once the first frame went out."""
    task = asyncio.ensure_future(push(bridge, request, ctx, sender))
    while not sender.frames and not task.done():
        await asyncio.sleep(0.005)
    ctx.stop_generating()
    return await task


def test_the_handler_declares_response_sender_so_dynamo_serves_it_with_push_egress():
    # Dynamo 1.6.1 picks the push egress for a handler whose signature has a `response_sender` parameter.
    bridge = RequestBridge(lambda request, ctx, sink: None, make_context=FakeGenerateContext)
    assert "response_sender" in inspect.signature(bridge.handler).parameters
    agen = bridge.handler({"token_ids": [1]}, FakeDynamoContext("x"))
    assert inspect.isasyncgen(agen)  # pull: no sender
    asyncio.run(agen.aclose())


def test_push_egress_sends_every_chunk_in_order_from_the_loop_thread_and_closes_once():
    sidecar = FakeSidecar(plan=5, step=True)
    sender = FakeResponseSender()

    async def scenario(host: HostLoop):
        async with serving(sidecar) as (bridge, engine, _):
            error = await host.run(push, bridge, {"token_ids": [100]}, FakeDynamoContext("p1"), sender)
            await engine.wait_idle()
        return error, threading.get_ident()

    error, ident = guest(scenario)
    assert error is None
    assert tokens_of(sender.frames) == [100 + i for i in range(5)]
    assert sender.closed == 1
    assert set(sender.send_threads) == {ident}
    assert sidecar.contexts["p1"].stop_calls == 0


def test_push_egress_merges_the_chunks_of_one_trio_batch_into_one_frame():
    # Chunks that the Trio tasks ready at the same time deliver for one request go out as one frame: the
    # bridge flushes once the current Trio batch has run, not per chunk.
    sender = FakeResponseSender()

    def submit(request, ctx, sink):
        for i in range(4):
            sink.tokens([i], "x")
        sink.end(None, None)

    async def scenario(host: HostLoop):
        async with serving(FakeSidecar(), submit=submit) as (bridge, _, _):
            return await host.run(push, bridge, {"token_ids": [0]}, FakeDynamoContext("batch"), sender)

    assert guest(scenario) is None
    assert sender.frames == [{"token_ids": [0, 1, 2, 3], "index": 0, "text": "xxxx"}]
    assert sender.closed == 1


def test_push_egress_raises_a_sidecar_error_as_its_typed_exception():
    sidecar = FakeSidecar(error=InvalidArgument("max_tokens must be at least 1"))
    sender = FakeResponseSender()

    async def scenario(host: HostLoop):
        async with serving(sidecar) as (bridge, engine, _):
            error = await host.run(push, bridge, {"token_ids": [1]}, FakeDynamoContext("bad"), sender)
            await engine.wait_idle()
        return error

    error = guest(scenario)
    assert isinstance(_sidecar_error(error), InvalidArgument)
    assert str(error) == "max_tokens must be at least 1"
    assert sender.frames == [] and sender.closed == 0


def test_push_egress_stop_from_dynamo_mid_stream_sends_the_cancelled_chunk():
    sidecar = FakeSidecar(plan=5, hold=True)
    sender = FakeResponseSender()

    async def scenario(host: HostLoop):
        async with serving(sidecar) as (bridge, engine, _):
            error = await host.run(push_and_stop, bridge, {"token_ids": [1]}, FakeDynamoContext("mid"), sender)
            await engine.wait_idle()
        return error

    assert guest(scenario) is None
    assert sender.frames == [{"token_ids": [1], "index": 0}, CANCELLED]
    assert sender.closed == 1


def test_push_egress_stops_the_trio_request_when_the_response_stream_is_gone():
    sidecar = FakeSidecar(plan=5, hold=True)
    sender = FakeResponseSender(gone_after=1)  # the first frame is taken, then the consumer is gone

    async def scenario(host: HostLoop):
        async with serving(sidecar) as (bridge, engine, _):
            error = await host.run(push_and_stop, bridge, {"token_ids": [1]}, FakeDynamoContext("gone"), sender)
            await engine.wait_idle()
        return error

    assert guest(scenario) is None
    assert sender.frames == [{"token_ids": [1], "index": 0}]
    assert sidecar.contexts["gone"].stopped
    assert sidecar.finished == ["gone"]


def test_a_full_response_channel_parks_a_worker_thread_never_the_loop():
    # Past its inline window a request's frames are sent from worker threads: while its consumer does not
    # read (the channel is full and send() blocks), other requests still flow, and its own frames stay in
    # order.
    plan = 8
    sidecar = FakeSidecar(plan=plan, step=True)
    stalled = FakeResponseSender(capacity=3)  # room for 3 unread frames: the 4th send blocks
    other = FakeResponseSender()
    outcome: list = []

    async def scenario(host: HostLoop):
        async with serving(sidecar) as (bridge, engine, nursery):
            bridge.push_inline_frames = 2

            async def drive_stalled():
                outcome.append(await host.run(push, bridge, {"token_ids": [0]}, FakeDynamoContext("s"), stalled))

            nursery.start_soon(drive_stalled)
            try:
                await trio.to_thread.run_sync(stalled.blocked.wait)
                # The loop is free: another request is served from start to end while the first one is stuck.
                assert await host.run(push, bridge, {"token_ids": [1000]}, FakeDynamoContext("o"), other) is None
                assert len(stalled.frames) == 3 and not outcome
            finally:
                stalled.read(plan)  # the consumer reads again (also unblocks the thread, should this fail)
            while not outcome:
                await trio.sleep(0.01)
            await engine.wait_idle()
        return threading.get_ident()

    ident = guest(scenario)
    assert tokens_of(other.frames) == [1000 + i for i in range(plan)] and other.closed == 1
    assert outcome == [None]
    assert tokens_of(stalled.frames) == list(range(plan))
    assert stalled.closed == 1
    assert [t == ident for t in stalled.send_threads] == [True, True] + [False] * 6


def test_push_egress_many_concurrent_streams_lose_no_chunk_and_keep_order():
    # 40 streams x 300 chunks, the window crossed to the worker threads: every token delivered once, in order.
    sidecar = FakeSidecar(plan=300)
    senders = [FakeResponseSender() for _ in range(40)]

    async def scenario(host: HostLoop):
        async with serving(sidecar) as (bridge, engine, _):
            bridge.push_inline_frames = 50

            async def push_all():
                return await asyncio.gather(
                    *(
                        push(bridge, {"token_ids": [i * 1000]}, FakeDynamoContext(f"p{i}"), senders[i])
                        for i in range(40)
                    )
                )

            errors = await host.run(push_all)
            await engine.wait_idle()
        return errors

    assert guest(scenario) == [None] * 40
    for i, sender in enumerate(senders):
        assert tokens_of(sender.frames) == [i * 1000 + k for k in range(300)]
        assert sender.closed == 1


def test_push_egress_raises_an_unexpected_send_failure_and_sends_nothing_after_it():
    # A send that fails with anything but the closed-stream RuntimeError is raised by the handler (Dynamo
    # reports it), stops the request, and no later frame of the request goes out (no hole in the stream).
    class FailsOnce(FakeResponseSender):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def send(self, obj: dict) -> None:
            self.calls += 1
            if self.calls == 2:
                raise ValueError("cannot encode the second frame")
            super().send(obj)

    sidecar = FakeSidecar(plan=6, step=True)
    sender = FailsOnce()

    async def scenario(host: HostLoop):
        async with serving(sidecar) as (bridge, engine, _):
            error = await host.run(push, bridge, {"token_ids": [10]}, FakeDynamoContext("hole"), sender)
            await engine.wait_idle()
        return error

    error = guest(scenario)
    assert isinstance(error, ValueError) and str(error) == "cannot encode the second frame"
    assert tokens_of(sender.frames) == [10]
    assert sender.calls == 2
    assert sidecar.contexts["hole"].stopped
